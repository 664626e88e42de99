"""Delta updates: bytes and seconds per weight update, full vs delta, along a real learner trajectory, same run.

The trajectory is the learner's own: `--steps` steps of `learner/step.py:train_step` (the TIS policy loss, AdamW,
grad clip 1.0, fp32 master weights) on SmolLM2, on the demo's arithmetic task — each step samples `--group-size`
completions for each of `--groups` prompts with transformers at temperature 1, scores them with the task's reward and
trains on them at lag 0 — once at the demo's learning rate and once at each `--lr`. After each step the weights are cast
to the serve's dtype (`--dtype`, bfloat16 by default: what GPU serves run) and sent both ways over a real gloo group
to a receiver process, which unpacks and verifies them as a serve's staging thread does (a delta applied to the copy
it holds of the previous version, then every whole tensor checked against the learner's checksum: bit for bit, or the
run fails). Per update:

- bytes on the wire, full vs delta, and their ratio (target: delta / full <= 0.3 at the demo's learning rate);
- learner seconds to plan it (checksums; for a delta also the comparison with the previous version and the encoding);
- the broadcast's seconds, and the receiver's seconds to unpack, apply and verify;
- a TP=2 rank's seconds to keep its half of the same buckets, played back to `receive_kept` in the receiver (every
  whole tensor of a full update verified as it passes, its half copied out; a delta's payloads verified and decoded
  onto the rank's half of the held version).

    python -m benchmarks.delta_updates [--steps 10] [--lr 1e-6] [--out benchmarks/results/delta_updates.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import RESULTS

BUCKET_BYTES = 64 << 20


class _Replayed:
    """The buckets a receiver got, broadcast again in manifest order: what a tensor-parallel rank's receive reads."""

    def __init__(self, manifest, buckets: list[torch.Tensor]):
        self.parts = [buckets[i][first:end] for i, first, end in manifest.parts()]

    def broadcast(self, tensor: torch.Tensor, what: str = "") -> None:
        tensor.copy_(self.parts.pop(0))


def _rank_of_two(name: str, whole: torch.Tensor) -> torch.Tensor:
    """Rank 1 of a TP=2 serve, roughly: the second half of every matrix's rows; vectors (norms) replicated."""
    return whole.narrow(0, len(whole) // 2, len(whole) - len(whole) // 2) if whole.dim() == 2 else whole


def _receiver(port: int, pipe) -> None:
    """Rank 1: for each manifest from `pipe`, receive its buckets, unpack + verify (a delta on the held version), then
    keep a TP=2 rank's half of the same buckets, played back (`receive_kept`: a delta decoded onto the rank's own
    half of the held version); answer (seconds, rank's seconds, error); what was kept becomes the held version."""
    from inflight.wire.group import GroupAddress, WeightsGroup
    from inflight.wire.transfer import receive_kept, receive_update
    from inflight.wire.weights import UpdateManifest, unpack_buckets

    torch.set_num_threads(1)  # as a serve's staging thread: one thread, next to the engine's
    group, held, half = WeightsGroup(GroupAddress("127.0.0.1", port, 2, timeout_s=300), 1), None, None
    while (data := pipe.recv()) is not None:
        manifest = UpdateManifest.decode(data)
        buckets = receive_update(group, manifest)
        try:
            start = time.perf_counter()
            tensors = unpack_buckets(manifest, buckets, verify=True, base=held)
            seconds = time.perf_counter() - start
            start = time.perf_counter()
            kept = receive_kept(_Replayed(manifest, buckets), manifest, _rank_of_two, base=half)
            rank_s = time.perf_counter() - start
            if manifest.keep_base:
                held = (manifest.version, tensors)  # views of this update's buckets, or a delta's new tensors
                half = (manifest.version, kept)
            pipe.send((seconds, rank_s, ""))
        except Exception as exc:
            pipe.send((0.0, 0.0, f"{type(exc).__name__}: {exc}"))
    group.close()


class Link:
    """The sender's end: a gloo group with a spawned receiver, manifests over a pipe."""

    def __init__(self):
        from inflight.wire.group import GroupAddress, WeightsGroup, open_store

        store = open_store(GroupAddress("127.0.0.1", 0, 2, timeout_s=300), is_host=True)
        self.pipe, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_receiver, args=(store.port, child), daemon=True)
        self.proc.start()
        self.group = WeightsGroup(GroupAddress("127.0.0.1", store.port, 2, timeout_s=300), 0, store)

    def send(self, manifest, payloads) -> tuple[float, float, float]:
        """(broadcast seconds, receiver seconds, a TP=2 rank's seconds); raises when the receiver refused the update."""
        from inflight.wire.transfer import send_update

        self.pipe.send(manifest.encode())
        stats = send_update(self.group, manifest, payloads)
        seconds, rank_s, error = self.pipe.recv()
        if error:
            raise RuntimeError(f"the receiver refused v{manifest.version}: {error}")
        return stats.seconds, seconds, rank_s

    def close(self) -> None:
        self.pipe.send(None)
        self.proc.join(60)


class Trajectory:
    """The learner on the demo task: `step()` trains once on freshly sampled groups, returns the HF-named state."""

    def __init__(self, model_dir: Path, lr: float, groups: int, group_size: int, seed: int = 0):
        from transformers import AutoTokenizer

        from inflight.tasks.arithmetic import ArithmeticTask
        from learner.model import load_policy
        from learner.step import TrainConfig, make_optimizer

        torch.manual_seed(seed)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = load_policy(model_dir)
        self.cfg = TrainConfig(lr=lr)
        self.optimizer = make_optimizer(self.model, self.cfg)
        self.problems = iter(ArithmeticTask(seed))
        self.groups, self.group_size = groups, group_size

    def state(self) -> dict[str, torch.Tensor]:
        from learner.export import full_hf_state

        return full_hf_state(self.model)

    def step(self) -> float:
        """One train step on new groups; the mean reward."""
        from learner.step import make_batch, train_step

        samples, rewards = [], []
        for _ in range(self.groups):
            group, scores = self._group(next(self.problems))
            samples += group
            rewards += scores
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.model.train(False)
        train_step(self.model, self.optimizer, make_batch(samples, pad), self.cfg)
        return sum(rewards) / len(rewards)

    def _group(self, problem):
        from inflight.tasks.arithmetic import reward_fn
        from learner.step import Sample

        prompt = self.tok.apply_chat_template(problem.chat(), add_generation_prompt=True, tokenize=True,
                                              return_dict=False)  # fmt: skip
        ids = torch.tensor([prompt] * self.group_size)
        hf = self.model.hf
        with torch.no_grad():
            out = hf.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=24,
                              output_scores=True, return_dict_in_generate=True,
                              pad_token_id=self.tok.eos_token_id)  # fmt: skip
        completions = out.sequences[:, len(prompt) :]
        logps = torch.stack(out.scores, 1).float().log_softmax(-1).gather(2, completions[:, :, None])[:, :, 0]
        scores = [reward_fn(self.tok.decode(c, skip_special_tokens=True), problem) for c in completions]
        mean = sum(scores) / len(scores)
        return [Sample(prompt, c.tolist(), lp.tolist(), s - mean, [True] * len(c))
                for c, lp, s in zip(completions, logps, scores, strict=True)], scores  # fmt: skip


def measure(link: Link, model_dir: Path, lr: float, args, version: int) -> tuple[list[dict], int]:
    """`args.steps` steps at `lr`; one record per step; returns them and the next free version number."""
    from inflight.wire.weights import DTYPES, plan_update

    learner = Trajectory(model_dir, lr, args.groups, args.group_size)
    cast = {n: t.to(DTYPES[args.dtype]).contiguous() for n, t in learner.state().items()}
    manifest, payloads = plan_update(cast, version, BUCKET_BYTES, keep_base=True)
    link.send(manifest, payloads)  # the receiver now holds the starting point, as after a full update
    held, rows = (version, cast), []
    for step in range(1, args.steps + 1):
        reward = learner.step()
        version += 1
        cast = {n: t.to(DTYPES[args.dtype]).contiguous() for n, t in learner.state().items()}
        row = {"lr": lr, "step": step, "reward": reward}
        for kind, base in (("full", None), ("delta", held)):
            start = time.perf_counter()
            manifest, payloads = plan_update(cast, version, BUCKET_BYTES, base=base, keep_base=kind == "delta")
            plan_s = time.perf_counter() - start
            send_s, receive_s, rank_s = link.send(manifest, payloads)
            row[kind] = {"bytes": manifest.total_bytes, "plan_s": plan_s, "send_s": send_s, "receive_s": receive_s,
                         "rank_receive_s": rank_s}  # fmt: skip
        row["ratio"] = row["delta"]["bytes"] / row["full"]["bytes"]
        changed = sum(t.count for t in manifest.tensors) / sum(t.numel() for t in cast.values())
        row["changed"] = changed
        print(f"lr {lr:g} step {step}: changed {changed:.4f}, delta/full bytes {row['ratio']:.3f}, "
              f"plan {row['full']['plan_s']:.2f}/{row['delta']['plan_s']:.2f} s, "
              f"receive {row['full']['receive_s']:.2f}/{row['delta']['receive_s']:.2f} s, "
              f"TP rank {row['full']['rank_receive_s']:.2f}/{row['delta']['rank_receive_s']:.2f} s",
              flush=True)  # fmt: skip
        rows.append(row)
        held = (version, cast)
    return rows, version + 1


def summary(rows: list[dict]) -> dict:
    """Means over the steps of one learning rate, full and delta side by side."""
    out = {"ratio": statistics.mean(r["ratio"] for r in rows), "changed": statistics.mean(r["changed"] for r in rows)}
    for kind in ("full", "delta"):
        for key in ("bytes", "plan_s", "send_s", "receive_s", "rank_receive_s"):
            out[f"{kind}_{key}"] = statistics.mean(r[kind][key] for r in rows)
    return out


def parse_args(argv: list[str] | None):
    from inflight.run.demo import DEMO_FLAGS

    demo_lr = float(DEMO_FLAGS[DEMO_FLAGS.index("--lr") + 1])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.delta_updates", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="learner steps per learning rate")
    parser.add_argument("--lr", type=float, nargs="*", default=[1e-6], help=f"besides the demo's {demo_lr:g}")
    parser.add_argument("--groups", type=int, default=2, help="prompts per step (the demo's --groups-per-step)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the serve's dtype")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", type=Path, default=RESULTS / "delta_updates.json")
    args = parser.parse_args(argv)
    args.lrs = [demo_lr, *args.lr]
    if args.steps < 1:
        parser.error(f"--steps is {args.steps}: give at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    from inflight.machine import cpu_label
    from inflight.models import prepare

    args = parse_args(sys.argv[1:] if argv is None else argv)
    model_dir = prepare(args.model)
    link, version, results = Link(), 1, {}
    try:
        for lr in args.lrs:
            rows, version = measure(link, model_dir, lr, args, version)
            results[f"{lr:g}"] = {"summary": summary(rows), "steps": rows}
    finally:
        link.close()
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_label(), "model": args.model,
              "dtype": args.dtype, "steps": args.steps, "groups": args.groups, "group_size": args.group_size,
              "results": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{args.model}, {args.dtype} serve, {args.steps} learner steps per learning rate ({cpu_label()}):")
    print("| lr | elements changed | delta / full bytes | plan s full / delta | send s full / delta | "
          "receive s full / delta | a TP=2 rank's receive s full / delta |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for lr, r in results.items():
        s = r["summary"]
        print(f"| {lr} | {s['changed']:.4f} | {s['ratio']:.3f} | {s['full_plan_s']:.2f} / {s['delta_plan_s']:.2f} | "
              f"{s['full_send_s']:.3f} / {s['delta_send_s']:.3f} | "
              f"{s['full_receive_s']:.2f} / {s['delta_receive_s']:.2f} | "
              f"{s['full_rank_receive_s']:.2f} / {s['delta_rank_receive_s']:.2f} |")  # fmt: skip
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
