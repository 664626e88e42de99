"""CUDA staging: copy bandwidth against the device's own ceilings, and what staging costs a decode loop.

    python -m benchmarks.cuda_staging [--layers 28] [--json out.json]     (needs CUDA; prints one table)

Measured side by side in one run, on a model-shaped update (Qwen2.5-1.5B's tensor shapes, bf16, `--layers` layers):
- ceilings: one large device-to-device copy and one pinned host-to-device copy (GB/s of payload);
- commit: the staged views (`unpack_buckets` over device buckets) copied into parameter tensors one by one, as the
  worker's commit does — its bandwidth as a share of the device-to-device ceiling;
- receive: the real `StagedUpdate` (side stream, CRC checked) receiving the update over a real gloo weights group from
  a sender process on this host — gloo's CUDA broadcast goes through host memory over loopback TCP, so it is compared
  with the host-to-device ceiling; NCCL needs a second GPU (two ranks may not share one), which this machine lacks;
- overlap: a decode-shaped loop (bf16 [32, hidden] @ [hidden, intermediate] matmuls, 20 steps then a wait on its own
  stream) on the default stream, timed alone and while `StagedUpdate` receives and checks on its side stream: median
  and mean step, split by phase, and the longest 20-step chunk of each round (the stalls an update causes).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

from inflight.wire.group import GroupAddress, WeightsGroup, open_store
from inflight.wire.transfer import send_update
from inflight.wire.weights import pack_bucket, plan_manifest, unpack_buckets

HIDDEN, INTER, VOCAB, KV = 1536, 8960, 151936, 256
BUCKET = 256 << 20


def model_state(layers: int, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)  # on the CPU: the sender and the receiver must make the same numbers

    def t(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(torch.bfloat16).to(device)

    state = {"model.embed_tokens.weight": t(VOCAB, HIDDEN), "model.norm.weight": t(HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": t(HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": t(KV, HIDDEN),
            p + "self_attn.v_proj.weight": t(KV, HIDDEN), p + "self_attn.o_proj.weight": t(HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": t(INTER, HIDDEN), p + "mlp.up_proj.weight": t(INTER, HIDDEN),
            p + "mlp.down_proj.weight": t(HIDDEN, INTER), p + "input_layernorm.weight": t(HIDDEN),
            p + "post_attention_layernorm.weight": t(HIDDEN),
        })  # fmt: skip
    return state


def timed(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1000)
    return statistics.median(times)


def sender_main(address: GroupAddress, layers: int, rounds: int) -> None:
    """Rank 0 on this host's CPU: broadcast the same update `rounds` times (the learner's side of the group)."""
    state = model_state(layers, "cpu")
    manifest = plan_manifest(state, 1, BUCKET)
    group = WeightsGroup(address, 0, store=open_store(address, is_host=False))
    for _ in range(rounds):
        send_update(group, manifest, state, pin=False)
    group.close()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.cuda_staging needs CUDA")
    out: dict = {"device": torch.cuda.get_device_name(), **copy_ceilings("cuda")}
    host_state = model_state(args.layers, "cpu")  # the same numbers the sender process makes
    manifest = plan_manifest(host_state, 1, BUCKET, checksums=True)
    state = {name: t.to("cuda") for name, t in host_state.items()}
    del host_state
    out["update_bytes"], out["tensors"] = manifest.total_bytes, len(manifest.tensors)
    out.update(commit_rate(manifest, state, out["d2d_ceiling_gbs"]))
    decode = decoder("cuda")
    alone = decode_steps_alone(decode)
    in_receive, in_verify = staging_rounds(manifest, state, args.layers, decode, out)
    out.update(decode_figures(alone, in_receive, in_verify))
    print_table(out, args.layers)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def copy_ceilings(dev: str) -> dict:
    """Device-to-device and pinned host-to-device copy rates of 1 GiB, GB/s: what the commit and receive compare to."""
    big = 1 << 30
    src, dst = torch.empty(big, dtype=torch.uint8, device=dev), torch.empty(big, dtype=torch.uint8, device=dev)
    d2d = big / timed(lambda: dst.copy_(src)) / 1e9
    host = torch.empty(big, dtype=torch.uint8, pin_memory=True)
    return {"d2d_ceiling_gbs": d2d, "h2d_ceiling_gbs": big / timed(lambda: dst.copy_(host, non_blocking=True)) / 1e9}


def commit_rate(manifest, state: dict, d2d_gbs: float) -> dict:
    """The commit: the staged views (device buckets, verified) copied into parameter tensors one by one."""
    buckets = [pack_bucket(manifest, i, state, torch.empty(s, dtype=torch.uint8, device="cuda"))
               for i, s in enumerate(manifest.bucket_sizes)]  # fmt: skip
    views = unpack_buckets(manifest, buckets, verify=True)
    assert all(torch.equal(views[n], state[n]) for n in state), "a staged view differs from the state it packed"
    params = {n: torch.empty_like(t) for n, t in state.items()}

    def commit() -> None:
        for name, view in views.items():
            params[name].copy_(view)

    seconds = timed(commit)
    gbs = manifest.total_bytes / seconds / 1e9
    return {"commit_s": seconds, "commit_gbs": gbs, "commit_vs_d2d": gbs / d2d_gbs}


def decoder(dev: str):
    """Decode-shaped work on the default stream: 20 MLP steps, then a wait for this stream only."""
    x = torch.randn(32, HIDDEN, device=dev, dtype=torch.bfloat16)
    w_up = torch.randn(HIDDEN, INTER, device=dev, dtype=torch.bfloat16)
    w_down = torch.randn(INTER, HIDDEN, device=dev, dtype=torch.bfloat16)

    def decode(steps: int = 20) -> None:
        y = x
        for _ in range(steps):
            y = torch.relu(y @ w_up) @ w_down
            y = y / (y.norm() + 1)
        # then wait for this stream only, as an engine waits for its sampled tokens: a device-wide synchronize would
        # also wait for the side stream's copies and measure the benchmark's own barrier, not the overlap
        torch.cuda.current_stream().synchronize()

    return decode


def decode_steps_alone(decode) -> list[float]:
    decode()
    alone = []
    for _ in range(100):
        c0 = time.perf_counter()
        decode()
        alone.append((time.perf_counter() - c0) / 20)
    return alone


def staging_rounds(manifest, state: dict, layers: int, decode, out: dict) -> tuple[list[float], list[float]]:
    """Receive the update `rounds` times from a spawned CPU sender while decoding the whole time; per-round figures
    and the receive rate go into `out`; returns the decode step times while buckets arrived and while CRCs ran."""
    from vllm_patches.staging import StagedUpdate

    rounds = 5  # the first rounds also grow the caching allocator (cudaMalloc); later ones reuse its blocks
    address = GroupAddress("127.0.0.1", 0, 2, "bench-staging", "gloo", 300.0)
    store = open_store(address, is_host=True)
    address = GroupAddress("127.0.0.1", store.port, 2, "bench-staging", "gloo", 300.0)
    sender = mp.get_context("spawn").Process(target=sender_main, args=(address, layers, rounds), daemon=True)
    sender.start()
    group = WeightsGroup(address, 1, store)
    receive_s, in_receive, in_verify = [], [], []
    for _ in range(rounds):
        stage = StagedUpdate(manifest, group, "cuda").start()
        chunks = []  # (seconds, whether the buckets were still arriving when it ended)
        while not stage.finished:  # decode the whole time the update is received
            c0 = time.perf_counter()
            decode()
            chunks.append((time.perf_counter() - c0, stage.receive_s == 0.0))
        assert stage.state.value == "staged", stage.error
        assert all(torch.equal(stage.tensors[n], state[n]) for n in list(state)[:4])
        receive_s.append(stage.receive_s)
        out.setdefault("rounds", []).append(round_figures(stage.receive_s, chunks))
        in_receive += [c / 20 for c, receiving in chunks if receiving]
        in_verify += [c / 20 for c, receiving in chunks if not receiving]
    sender.join(60)
    group.close()
    out["receive_s"] = statistics.median(receive_s)
    out["receive_gbs"] = manifest.total_bytes / out["receive_s"] / 1e9
    out["receive_vs_h2d"] = out["receive_gbs"] / out["h2d_ceiling_gbs"]
    return in_receive, in_verify


def round_figures(receive_s: float, chunks: list[tuple[float, bool]]) -> dict:
    steps = [c / 20 for c, _ in chunks]
    return {"receive_s": receive_s, "chunks": len(chunks), "step_median_ms": 1e3 * statistics.median(steps),
            "step_mean_ms": 1e3 * statistics.fmean(steps), "chunk_max_ms": 1e3 * max(c for c, _ in chunks),
            "chunk_max_phase": "transfer" if max(chunks)[1] else "crc"}  # fmt: skip


def decode_figures(alone: list[float], in_receive: list[float], in_verify: list[float]) -> dict:
    during = in_receive + in_verify
    ms = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")  # noqa: E731
    out = {
        "decode_step_alone_ms": ms(alone), "decode_step_alone_mean_ms": 1e3 * statistics.fmean(alone),
        "decode_step_alone_max_ms": 1e3 * max(alone),
        "decode_step_while_staging_ms": ms(during), "decode_step_while_staging_mean_ms": 1e3 * statistics.fmean(during),
        "decode_step_while_staging_max_ms": 1e3 * max(during),
        # the stage's two phases: buckets arriving (gloo, side stream), then the CRC check (host copies + zlib)
        "decode_step_during_transfer_ms": ms(in_receive), "decode_step_during_crc_ms": ms(in_verify),
    }  # fmt: skip
    out["decode_slowdown"] = out["decode_step_while_staging_ms"] / out["decode_step_alone_ms"]
    out["decode_slowdown_mean"] = out["decode_step_while_staging_mean_ms"] / out["decode_step_alone_mean_ms"]
    return out


def print_table(out: dict, layers: int) -> None:
    print(f"device {out['device']}; update {out['update_bytes'] / 2**30:.2f} GiB in {out['tensors']} tensors "
          f"(Qwen2.5-1.5B shapes, {layers} layers, bf16)")  # fmt: skip
    rows = [
        ("device-to-device copy ceiling", f"{out['d2d_ceiling_gbs']:.0f} GB/s", ""),
        ("pinned host-to-device ceiling", f"{out['h2d_ceiling_gbs']:.1f} GB/s", ""),
        ("commit: staged views -> parameters", f"{out['commit_gbs']:.0f} GB/s",
         f"{out['commit_vs_d2d']:.2f} of d2d ({out['commit_s'] * 1e3:.1f} ms)"),
        ("receive: StagedUpdate over gloo", f"{out['receive_gbs']:.2f} GB/s",
         f"{out['receive_vs_h2d']:.3f} of h2d ({out['receive_s']:.2f} s)"),
        ("decode step alone: median / mean / max", f"{out['decode_step_alone_ms']:.3f} ms",
         f"{out['decode_step_alone_mean_ms']:.3f} / {out['decode_step_alone_max_ms']:.3f} ms"),
        ("decode step while staging: median", f"{out['decode_step_while_staging_ms']:.3f} ms",
         f"x{out['decode_slowdown']:.3f} (mean x{out['decode_slowdown_mean']:.3f}, max "
         f"{out['decode_step_while_staging_max_ms']:.3f} ms)"),
        ("  while buckets arrive: median", f"{out['decode_step_during_transfer_ms']:.3f} ms",
         f"x{out['decode_step_during_transfer_ms'] / out['decode_step_alone_ms']:.3f}"),
        ("  while CRCs are checked: median", f"{out['decode_step_during_crc_ms']:.3f} ms",
         f"x{out['decode_step_during_crc_ms'] / out['decode_step_alone_ms']:.3f}"),
    ]  # fmt: skip
    for name, value, ratio in rows:
        print(f"{name:<38} {value:>14}  {ratio}")
    for i, r in enumerate(out["rounds"]):
        print(
            f"  round {i + 1}: receive {r['receive_s']:.2f} s, decode step median {r['step_median_ms']:.3f} ms, "
            f"mean {r['step_mean_ms']:.3f} ms, longest 20-step chunk {r['chunk_max_ms']:.1f} ms"
        )


if __name__ == "__main__":
    main()
