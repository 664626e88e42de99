"""`scripts/task_accuracy.py`, the base-model signal check, on a user's own task file and reward: the serve's flags
reach the task loader, the rewards and the sampler, and the printed figures and exit code follow from the scores.

A real engine start costs more than this check is worth (the script has no flag for a small KV cache), so a canned
engine stands in for `InflightEngine`; the task file, the reward module, tiny-llama's tokenizer and chat template,
the scoring and the summary are the real ones."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from inflight.machine import resolve_precision, serve_device
from inflight.serve.config import ServeConfig

SCRIPT = Path(__file__).parents[1] / "scripts" / "task_accuracy.py"
GSM = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
     "answer": "In May she sold 48/2 = 24 clips.\nIn all she sold 48+24 = 72 clips.\n#### 72"},
    {"question": "Weng earns $12 an hour. How much for 50 minutes?",
     "answer": "Per minute $12/60 = $0.2.\nFor 50 minutes 0.2*50 = $10.\n#### 10"},
]  # fmt: skip
REWARDS = '''
def gsm_correct(prompts, completions, answer, **kwargs):
    """TRL's convention: 1.0 when the completion's last `#### n` is the reference's."""
    final = lambda text: text.rpartition("####")[2].strip() if "####" in text else None
    return [float(final(c) is not None and final(c) == final(a)) for c, a in zip(completions, answer)]
'''


def load_script():
    spec = importlib.util.spec_from_file_location("task_accuracy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CannedEngine:
    """Stands in for `InflightEngine` (start, its generation, shutdown): sample 0 of every group answers `first`, the
    others `rest`; each engine started is kept in `started`, with its config and what it was asked."""

    first, rest, started = "", "", []

    def __init__(self, cfg):
        self.cfg, self.params, self.prompts = cfg, [], []
        self.generation = self  # what the script samples from

    @classmethod
    async def start(cls, cfg):
        cls.started.append(cls(cfg))
        return cls.started[-1]

    async def generate(self, prompt_ids, params, request_id):
        from vllm_patches.generation import Completion

        self.params.append(params)
        self.prompts.append(prompt_ids)
        text = self.first if request_id.endswith("-0") else self.rest
        return Completion(request_id, list(prompt_ids), [1, 2], [-0.5, -0.5], [0, 0], "stop", text=text)

    def shutdown(self) -> None:
        pass


def canned(first: str, rest: str) -> type[CannedEngine]:
    return type("Canned", (CannedEngine,), {"first": first, "rest": rest, "started": []})


@pytest.fixture
def gsm_task(tmp_path, monkeypatch):
    """A GSM8K-style file and the user's reward module, as a new user would write them."""
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GSM))
    (tmp_path / "accuracy_check_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"jsonl:{path}"


def run_main(monkeypatch, engine: type, args: list[str]) -> int:
    monkeypatch.setattr("vllm_patches.engine.InflightEngine", engine)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    return load_script().main()


def test_the_scripts_flags_default_to_the_serves_own():
    script = load_script()
    args, serve = script.parse([]), ServeConfig()
    assert {name: getattr(args, name) for name in script.SERVE_FLAGS} == {
        name: getattr(serve, name) for name in script.SERVE_FLAGS
    }
    assert args.samples == serve.group_size


def test_a_users_task_file_and_trl_reward_are_scored_and_summarized_with_standard_errors(
    gsm_task, model_dirs, monkeypatch, capsys
):
    model = str(model_dirs["tiny-llama"])
    engine = canned("48 + 24\n#### 72", "no idea")
    argv = ["--model", model, "--task", gsm_task, "--prompt-key", "question", "--reward",
            "accuracy_check_rewards:gsm_correct", "--problems", "2", "--samples", "4", "--temperature", "0.5",
            "--max-tokens", "16"]  # fmt: skip
    rc = run_main(monkeypatch, engine, argv)
    out = capsys.readouterr().out
    [started] = engine.started
    assert started.cfg.model == model and len(started.prompts) == 2 * 4
    # the engine a serve with these flags runs here (its precision resolved for this machine), not a bare EngineConfig
    serve = ServeConfig()
    assert started.cfg.dtype == resolve_precision(serve.dtype, serve_device()).dtype
    assert (started.cfg.head_dtype, started.cfg.update_memory, started.cfg.kv_cache_gib) == (
        serve.head_dtype,
        serve.engine_mode(serve_device()).update_memory,
        serve.kv_cache_gib,
    )
    assert {(p.temperature, p.max_tokens) for p in started.params} == {(0.5, 16)}
    # Natalia's group: 1 of 4 right (its reference ends in #### 72); Weng's: 0 of 4. Per problem 0.25 and 0.0: mean
    # 0.125, standard error sqrt(((0.125² + 0.125²) / 1) / 2) = 0.125; one group of two has signal.
    assert ("reward 0.125 ± 0.125 (gsm_correct 0.125); accuracy (reward > 0) 0.125 ± 0.125 (standard errors over "
            "problems); groups with signal 0.50") in out  # fmt: skip
    assert "within the 5%–70% band RL needs" in out and rc == 0


def test_a_reward_that_never_fires_exits_1_pointing_at_the_reward(gsm_task, model_dirs, monkeypatch, capsys):
    """No `--reward`: the task file's default reward, which reads the answer after `####`; the model never gives one."""
    engine = canned("I cannot say", "no idea")
    argv = ["--model", str(model_dirs["tiny-llama"]), "--task", gsm_task, "--prompt-key", "question", "--problems",
            "2", "--samples", "2"]  # fmt: skip
    rc = run_main(monkeypatch, engine, argv)
    out = capsys.readouterr().out
    assert "accuracy (reward > 0) 0.000 ± 0.000" in out and "groups with signal 0.00" in out
    assert "OUTSIDE the 5%–70% band" in out and "parsing mismatch" in out and rc == 1
