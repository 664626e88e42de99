"""Small rollout records for buffer tests."""

from inflight.wire.rollouts import Sampling, Times, make_rollout


def rollout(group: str, index: int, model: str = "tiny-llama", temperature: float = 1.0, size: int = 2):
    return make_rollout(
        prompt_ids=[1, 2], completion_ids=[3], logprobs=[-1.0], versions=[0], rollout_id=f"{group}-{index}",
        group_id=group, group_size=size, index=index, server_id="s", model=model, reward=float(index),
        finish_reason="stop", sampling=Sampling(temperature), times=Times(0, 0, 0),
    )  # fmt: skip
