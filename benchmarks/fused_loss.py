"""Speed and peak memory of the LM-head + policy loss, forward and backward: naive vs chunked torch vs fused.

    python -m benchmarks.fused_loss [--tokens 8192] [--vocab 49152 151936] [--hidden 896 4096] [--json out.json]

For every (vocab, hidden) the three paths run on the same bf16 inputs, one after the other in this process:
- naive: logits = h @ Wᵀ for all tokens, fp32 log_softmax, gather, `policy_loss`, autograd (tokens × vocab tensors);
- chunked: `token_logprobs` (recomputes each chunk's logits in backward) + `policy_loss` — the CPU fallback's path;
- fused: `fused_policy_loss` (Triton row kernel on CUDA; on CPU its torch row pass).
Time = median of `--reps` forward+backward passes after a warm-up (CUDA events on GPU); peak = the most memory
allocated during one pass above what the inputs and their gradients hold. Ratios are against naive, measured in this
run. A path that runs out of memory is reported as OOM, not skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from learner.fused_loss import fused_policy_loss, triton_available
from learner.losses import LossConfig, policy_loss
from learner.model import naive_token_logprobs, token_logprobs

CFG = LossConfig("tis")


def make_inputs(tokens: int, hidden: int, vocab: int, device: str, seed: int = 0) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(tokens, hidden, device=device, generator=gen, dtype=torch.bfloat16)
    w = (torch.randn(vocab, hidden, device=device, generator=gen) / hidden**0.5).to(torch.bfloat16)
    return {
        "hidden": h, "weight": w, "targets": torch.randint(0, vocab, (tokens,), device=device, generator=gen),
        "behaviour": -torch.rand(tokens, device=device, generator=gen) * 10,
        "advantages": torch.randn(tokens, device=device, generator=gen),
        "mask": torch.rand(tokens, device=device, generator=gen) > 0.1,
        "seq_ids": torch.arange(tokens, device=device) // 512,
    }  # fmt: skip


def run_naive(b: dict, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    logp = naive_token_logprobs(h, w, b["targets"])
    return policy_loss(logp, b["behaviour"], b["advantages"], b["mask"], b["seq_ids"], CFG).loss


def run_chunked(b: dict, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    logp = token_logprobs(h, w, b["targets"], chunk_tokens=1024)
    return policy_loss(logp, b["behaviour"], b["advantages"], b["mask"], b["seq_ids"], CFG).loss


def run_fused(b: dict, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return fused_policy_loss(h, w, b["targets"], b["behaviour"], b["advantages"], b["mask"], b["seq_ids"], CFG,
                             chunk_tokens=1024).loss  # fmt: skip


PATHS = {"naive": run_naive, "chunked": run_chunked, "fused": run_fused}


def measure(fn, b: dict, reps: int) -> dict:
    cuda = b["hidden"].is_cuda
    h = b["hidden"].clone().requires_grad_()
    w = b["weight"].clone().requires_grad_()

    def once() -> None:
        h.grad = w.grad = None
        fn(b, h, w).backward()

    try:
        once()  # warm-up (Triton compiles here)
        times = []
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                once()
                stop.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(stop) / 1000)
                peak = torch.cuda.max_memory_allocated() - base
            else:
                t0 = time.perf_counter()
                once()
                times.append(time.perf_counter() - t0)
                peak = float("nan")
        return {"seconds": statistics.median(times), "peak_bytes": peak}
    except torch.OutOfMemoryError:
        return {"seconds": float("nan"), "peak_bytes": float("nan"), "oom": True}
    finally:
        h.grad = w.grad = None
        if cuda:
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    p.add_argument("--hidden", type=int, nargs="+", default=[896, 4096])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    print(f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}), "
          f"fused backend {'triton' if args.device == 'cuda' and triton_available() else 'torch'}, "
          f"{args.tokens} tokens, bf16, loss tis, forward+backward, median of {args.reps}")  # fmt: skip
    rows = []
    header = f"{'vocab':>7} {'hidden':>6} {'path':>8} {'ms':>9} {'peak MiB':>9} {'time/naive':>10} {'mem/naive':>9}"
    print(header)
    for vocab in args.vocab:
        for hidden in args.hidden:
            b = make_inputs(args.tokens, hidden, vocab, args.device)
            results = {name: measure(fn, b, args.reps) for name, fn in PATHS.items()}
            naive = results["naive"]
            for name, r in results.items():
                row = {"vocab": vocab, "hidden": hidden, "tokens": args.tokens, "path": name, **r,
                       "time_ratio": r["seconds"] / naive["seconds"],
                       "mem_ratio": r["peak_bytes"] / naive["peak_bytes"]}  # fmt: skip
                rows.append(row)
                print(
                    f"{vocab:>7} {hidden:>6} {name:>8} {r['seconds'] * 1e3:>9.2f} {r['peak_bytes'] / 2**20:>9.0f} "
                    f"{row['time_ratio']:>10.3f} {row['mem_ratio']:>9.3f}" + ("  OOM" if r.get("oom") else "")
                )
            del b
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
