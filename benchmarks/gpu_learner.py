"""The learner on a GPU, trained from a recorded rollout journal, checked against the CPU and a plain torch loop.

    python -m benchmarks.gpu_learner --replay runs/gpu-rec [--steps 20] [--out gpu-learner] [--json FILE]

`--replay` is the run directory of a live run recorded with `--keep-journal` (on any machine with vLLM; here the CPU:
`python -m benchmarks.gpu_learner record`). No vLLM is needed to replay it. Three runs, one report:

1. CPU reference: `python -m inflight.learn --device cpu --autocast none --replay DIR --steps 1` — step 1 in fp32.
2. The learner on CUDA: `python -m inflight.learn --device cuda --replay DIR --steps N` as its own process, with a
   receiver process (benchmarks/receiver.py) joined as a serve in a gloo weights group: every step's update streams
   to it from the GPU (bucket by bucket through host memory) and is verified there; at the end the last version
   received must equal the exported `hf-final` cast to the serve's dtype, tensor for tensor.
3. A plain single-GPU torch loop on the same batches: the HF model (fp32 master weights, bf16 autocast as the
   learner's decoder), full logits, log-softmax, the same TIS loss, backward, clip, AdamW — no FSDP, no chunking, no
   fused kernel. Both are timed from the step's CPU tensors to the optimizer step done (the learner's `train_s`).

Both learner runs take the recording's training flags (its `learn-config.json`: groups per step, lr, loss, max lag,
seed...), so every step trains the groups the live run trained, in the same order. Step 1 is on the same weights on
both devices: its loss and gradient norm must agree within bf16 tolerance (the CUDA decoder runs in bf16). Learner
tokens/s over the plain loop's is the median over the steps after the first two (warm-up: kernel compilation).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20
# Step-1 agreement between the fp32 CPU learner and the bf16-decoder CUDA learner, relative to the CPU value (grad
# norm) or to the scale of the loss's terms (the loss is a mean of ratio x advantage, which can cancel to ~0): bf16
# keeps 8 bits of mantissa (u = 2^-8 = 3.9e-3), and a 30-layer decoder's logprobs move by a few u (the lag-0 logprob
# mismatch of a bf16 engine against an fp32 learner is 3e-2 on SmolLM2, BENCHMARKS.md).
STEP1_RTOL = 0.05
WARMUP_STEPS = 2


def recorded_config(replay: Path):
    """The recording learner's `LearnConfig` (its `learn-config.json`, read once; keys a newer learner added take
    their defaults). ValueError naming `--replay` when it holds no journal, SystemExit when the config is missing."""
    from inflight.learn.config import LearnConfig
    from inflight.learn.replay import journal_dir

    path = journal_dir(replay).parent / "learn-config.json"
    if not path.exists():
        raise SystemExit(f"--replay {replay}: no learn-config.json next to its journal; pass the --run-dir of the "
                         "recorded run")  # fmt: skip
    recorded = json.loads(path.read_text())
    return LearnConfig(**{k: v for k, v in recorded.items() if k in LearnConfig.__dataclass_fields__})


def training_flags(cfg) -> list[str]:
    """`cfg`'s training flags as `inflight.learn` arguments: everything that changes what is trained, nothing that
    says where or how it runs."""
    from inflight.learn.replay import _NOT_TRAINING

    skip = _NOT_TRAINING | {"autocast", "steps", "fused_loss"}  # set per run below
    flags = []
    for name, value in sorted(dataclasses.asdict(cfg).items()):
        if name not in skip:
            flags += [f"--{name.replace('_', '-')}", str(value).lower() if isinstance(value, bool) else str(value)]
    return ["--model", cfg.model, *flags]


def learn(args, device: str, steps: int, run_dir: Path, extra: list[str]) -> list[dict]:
    """One `inflight.learn --replay` process; its metrics lines. Raises SystemExit with its log tail if it fails."""
    cmd = [sys.executable, "-m", "inflight.learn", "--device", device, "--replay", str(args.replay), "--steps",
           str(steps), "--run-dir", str(run_dir), *training_flags(args.cfg), *extra]  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "learn.cmd").write_text(" ".join(cmd) + "\n")
    with open(run_dir / "learn.log", "w") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if code != 0:
        tail = (run_dir / "learn.log").read_text().splitlines()[-30:]
        raise SystemExit(f"inflight.learn on {device} exited {code}:\n" + "\n".join(tail))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def cuda_run(args, out: Path) -> tuple[list[dict], dict]:
    """The CUDA learner with a receiver joined; its metrics and what the receiver saw."""
    import torch
    from safetensors import safe_open

    from benchmarks.receiver import Receiver
    from inflight.models import resolve_model
    from inflight.run.launch import free_ports

    rollouts, control, weights = free_ports(3, "127.0.0.1")
    # on CUDA what auto resolves to, and what a bf16 serve reports
    cfg = dataclasses.replace(args.cfg, autocast=args.autocast)
    model_dir = resolve_model(cfg.model)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = f.keys()  # safe_open is not iterable
        specs = [(name, args.serve_dtype, list(f.get_slice(name).get_shape())) for name in names]
    # gloo: the update streams through host buckets; nccl: GPU to GPU, the receiver on the second GPU
    receiver_device = "cuda:1" if args.backend == "nccl" else "cpu"
    receiver = Receiver(f"tcp://127.0.0.1:{control}", specs, contract=cfg.contract(), device=receiver_device)
    extra = ["--autocast", args.autocast, "--wait-for-serves", "1", "--rollouts-port", str(rollouts), "--control-port",
             str(control), "--weights-port", str(weights), "--bucket-mb", str(args.bucket_mb), "--backend",
             args.backend, *shlex.split(args.learn_args)]  # fmt: skip
    try:
        metrics = learn(args, args.device, args.steps, out / "cuda", extra)
    finally:
        crcs = receiver.stop()
    final = _final_check(crcs, out / "cuda" / "hf-final", args.serve_dtype, torch)
    return metrics, {"versions": sorted(crcs), **final}


def _final_check(crcs: dict, hf_final: Path, dtype: str, torch) -> dict:
    """Does the last version received equal the exported weights cast to the serve's dtype, tensor for tensor?"""
    from safetensors.torch import load_file

    from inflight.wire.checksum import tensor_checksum

    if not crcs:
        return {"last_equals_export": False, "why": "the receiver received nothing"}
    last = crcs[max(crcs)]
    state = load_file(hf_final / "model.safetensors")
    exported = {name: tensor_checksum(t.to(getattr(torch, dtype)), "crc32") for name, t in state.items()}
    missing = sorted(set(last) ^ set(exported))
    differ = sorted(k for k in set(last) & set(exported) if last[k] != exported[k])
    return {"last_equals_export": not missing and not differ, "differ": differ[:5], "missing": missing[:5]}


def plain_loop(args, cuda_metrics: list[dict]) -> list[dict]:
    """The same groups, step by step, through the plainest single-GPU torch training loop; per-step timings."""
    import torch
    from transformers import AutoModelForCausalLM

    from inflight.learn.replay import JournalReplay
    from inflight.learn.samples import build_samples
    from inflight.learn.store import RolloutBuffer
    from inflight.models import resolve_model
    from learner.step import AUTOCAST, Sample, make_batch

    cfg = dataclasses.asdict(args.cfg)
    torch.manual_seed(cfg["seed"])
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(cfg["model"]), dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    replay, buffer, rows = JournalReplay(args.replay), RolloutBuffer(cfg["model"]), []
    for version, line in enumerate(cuda_metrics):
        replay.fill(buffer, cfg["groups_per_step"])
        groups = buffer.take(cfg["groups_per_step"])
        assert [g[0].group_id for g in groups] == line["groups"], "the plain loop must train the learner's groups"
        samples, _ = build_samples(groups, version, cfg["max_lag"], cfg["advantage"], cfg["max_kv_lag"])
        batch = make_batch([Sample(s.prompt_ids, s.completion_ids, s.behaviour_logprobs, s.advantage, s.token_mask)
                            for s in samples], pad_id=0)  # fmt: skip
        _synchronize(device)
        start = time.perf_counter()
        loss = _plain_step(model, optimizer, batch.to(device), cfg, AUTOCAST[args.autocast])
        _synchronize(device)
        seconds = time.perf_counter() - start
        tokens = int(batch.mask.sum())
        mean_abs_adv = float(batch.advantages.abs()[batch.mask].mean()) if tokens else 0.0
        rows.append({"step": version + 1, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                     "loss": loss, "mean_abs_advantage": mean_abs_adv})  # fmt: skip
    return rows


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plain_step(model, optimizer, batch, cfg: dict, autocast) -> float:
    """Forward (bf16 autocast), full-vocabulary log-softmax, truncated-IS policy gradient, backward, clip, AdamW."""
    import torch

    with torch.autocast(batch.input_ids.device.type, dtype=autocast, enabled=autocast is not None):
        logits = model(input_ids=batch.input_ids).logits
    logp = torch.log_softmax(logits.float() / cfg["temperature"], dim=-1)
    logp = logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp.detach() - batch.behaviour_logp).clamp(max=cfg["tis_cap"])
    mask = batch.mask.float()
    loss = -(ratio * batch.advantages * logp * mask).sum() / mask.sum().clamp(min=1)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def summarize(cpu: list[dict], cuda: list[dict], plain: list[dict], received: dict, args) -> dict:
    """The figures the GPU check reports (and asserts on)."""
    first_cpu, first_cuda = cpu[0], cuda[0]
    scale = max(abs(first_cpu["loss"]), plain[0]["mean_abs_advantage"], 1e-6)
    loss_err = abs(first_cuda["loss"] - first_cpu["loss"]) / scale
    grad_err = abs(first_cuda["grad_norm"] - first_cpu["grad_norm"]) / max(abs(first_cpu["grad_norm"]), 1e-12)
    timed = cuda[WARMUP_STEPS:] or cuda
    plain_timed = plain[WARMUP_STEPS:] or plain
    learner_tps = statistics.median(r["train_tokens"] / r["train_s"] for r in timed)
    plain_tps = statistics.median(r["tokens_per_s"] for r in plain_timed)
    publish = [r for r in timed if r.get("publish_s") is not None]
    import torch

    from inflight.machine import cpu_label

    return {
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else f"no GPU: a dry run on {cpu_label()}",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "steps": len(cuda), "replay": str(args.replay), "backend": args.backend, "device": args.device,
        "step1": {"cpu_loss": first_cpu["loss"], "cuda_loss": first_cuda["loss"], "loss_scale": scale,
                  "loss_rel_err": loss_err, "cpu_grad_norm": first_cpu["grad_norm"],
                  "cuda_grad_norm": first_cuda["grad_norm"], "grad_norm_rel_err": grad_err, "rtol": STEP1_RTOL,
                  "ok": loss_err <= STEP1_RTOL and grad_err <= STEP1_RTOL},
        "ok": loss_err <= STEP1_RTOL and grad_err <= STEP1_RTOL and learner_tps / plain_tps >= 0.9
        and received["last_equals_export"],
        "tokens_per_step": statistics.median(r["train_tokens"] for r in timed),
        "learner_tokens_per_s": learner_tps, "plain_tokens_per_s": plain_tps,
        "learner_vs_plain": learner_tps / plain_tps,
        "publish_s_median": statistics.median(r["publish_s"] for r in publish) if publish else None,
        "publish_bytes": publish[-1]["publish_bytes"] if publish else None,
        "publish_host_peak_bytes_max": max((r.get("publish_peak_bytes") or 0) for r in publish) if publish else None,
        "publish_gpu_peak_bytes_max": max((r.get("publish_device_peak_bytes") or 0) for r in publish)
        if publish else None,
        "bucket_bytes": args.bucket_mb * MiB,
        "received_versions": received["versions"], "last_equals_export": received["last_equals_export"],
        "received_detail": {k: v for k, v in received.items() if k not in ("versions", "last_equals_export")},
        "losses": [r["loss"] for r in cuda], "rewards": [r["reward"] for r in cuda],
    }  # fmt: skip


def print_report(s: dict) -> None:
    st = s["step1"]
    print(f"\n== learner on {s['gpu']} (torch {s['torch']}, CUDA {s['cuda']}), {s['steps']} steps from "
          f"{s['replay']} ==")  # fmt: skip
    print("| figure | value |")
    print("|---|---|")
    fast = "CUDA, bf16 decoder" if s["device"] == "cuda" else "CPU dry run, fp32"
    print(f"| step-1 loss CPU fp32 / {fast} | {st['cpu_loss']:.6f} / {st['cuda_loss']:.6f} "
          f"(diff / scale {st['loss_rel_err']:.4f}, tolerance {st['rtol']}) |")  # fmt: skip
    print(f"| step-1 grad norm CPU / CUDA | {st['cpu_grad_norm']:.5f} / {st['cuda_grad_norm']:.5f} "
          f"(rel {st['grad_norm_rel_err']:.4f}) |")  # fmt: skip
    print(f"| trained tokens per step (median) | {s['tokens_per_step']:.0f} |")
    print(f"| learner tokens/s / plain torch loop tokens/s | {s['learner_tokens_per_s']:.0f} / "
          f"{s['plain_tokens_per_s']:.0f} = {s['learner_vs_plain']:.2f} |")  # fmt: skip
    if s["publish_s_median"] is not None:
        print(f"| publish per step (median, {s['publish_bytes'] / MiB:.0f} MiB over {s['backend']} to 1 receiver) | "
              f"{s['publish_s_median'] * 1e3:.0f} ms |")  # fmt: skip
        host, gpu = s["publish_host_peak_bytes_max"] / MiB, s["publish_gpu_peak_bytes_max"] / MiB
        print(f"| publish peak extra: host / GPU (max over steps; bucket {s['bucket_bytes'] / MiB:.0f} MiB) | "
              f"{host:.0f} / {gpu:.0f} MiB |")  # fmt: skip
    versions = s["received_versions"] or [0]
    print(f"| versions received and verified | {len(s['received_versions'])} (last {max(versions)}), "
          f"last equals hf-final: {s['last_equals_export']} |")  # fmt: skip
    print(
        f"gpu_learner: {'PASS' if s['ok'] else 'FAIL'} (step 1 within tolerance: {st['ok']}; learner/plain >= 0.9: "
        f"{s['learner_vs_plain'] >= 0.9}; last update equals the export: {s['last_equals_export']})"
    )


def record(argv: list[str]) -> int:
    """`record`: the journal to replay, from a live never-stop run on this machine (needs vLLM): SmolLM2 on the
    arithmetic task, 2 groups of 8 per step, every segment kept, a lag gate wide enough that no token of the
    recording is masked when replayed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_learner record")
    parser.add_argument("--run-dir", default="runs/gpu-rec")
    parser.add_argument("--duration-s", type=float, default=420)
    parser.add_argument("--serve-gpus", default="", help="record on a GPU serve (a machine with vLLM on CUDA)")
    parser.add_argument("--learn-gpus", default="", help="the recording learner's GPUs (default: the CPU)")
    ns = parser.parse_args(argv)
    cmd = [sys.executable, "-m", "inflight.run", "--run-dir", ns.run_dir, "--groups-per-step", "2", "--max-tokens",
           "48", "--max-lag", "64", "--admit-lag", "64", "--duration-s", str(ns.duration_s),
           "--learn-args=--keep-journal", "--echo", "progress"]  # fmt: skip
    if ns.learn_gpus:
        cmd += ["--learn-gpus", ns.learn_gpus]
    if ns.serve_gpus:
        cmd += ["--serve-gpus", ns.serve_gpus]
    else:
        cmd += ["--serve-args=--kv-cache-gib 0.25"]
    return subprocess.call(cmd)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["record"]:
        return record(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_learner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replay", type=Path, required=True, help="a run directory recorded with --keep-journal")
    parser.add_argument("--steps", type=int, default=20, help="learner steps on the GPU (the journal must hold them)")
    parser.add_argument("--bucket-mb", type=int, default=64, help="the learner's --bucket-mb")
    parser.add_argument("--serve-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the dtype the receiver announces, as a serve of that dtype would")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-learner"), help="the three runs' directories")
    parser.add_argument("--json", type=Path, default=None, help="write the summary here too")
    parser.add_argument("--learn-args", default="", help="more flags for the CUDA learner, e.g. '--publish-every 5'")
    parser.add_argument(
        "--backend",
        default="gloo",
        choices=("gloo", "nccl"),
        help="the weights group's: nccl needs two GPUs (learner on the first, receiver on the second)",
    )
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: the same three runs without a GPU (fp32 throughout), to check the flow")  # fmt: skip
    args = parser.parse_args(argv)
    args.autocast = "bfloat16" if args.device == "cuda" else "none"
    try:
        args.cfg = recorded_config(args.replay)  # a missing journal or config fails here, before anything starts
    except ValueError as exc:
        parser.error(str(exc))
    import torch

    from inflight.models import MODEL_NAMES, prepare

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"benchmarks.gpu_learner needs a CUDA GPU (torch {torch.__version__} sees none)")
    if args.backend == "nccl" and (args.device != "cuda" or torch.cuda.device_count() < 2):
        raise SystemExit("--backend nccl needs two GPUs (a learner and a receiver: NCCL refuses two ranks on one GPU)")
    if args.cfg.model in MODEL_NAMES:  # one of ours: prepared here (a GPU machine starts with none)
        prepare(args.cfg.model)
    cpu = learn(args, "cpu", 1, args.out / "cpu", ["--autocast", "none", "--fused-loss", "off"])
    cuda, received = cuda_run(args, args.out)
    plain = plain_loop(args, cuda)
    summary = summarize(cpu, cuda, plain, received, args)
    summary["plain"] = plain
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    print_report(summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
