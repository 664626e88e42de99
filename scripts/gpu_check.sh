#!/usr/bin/env bash
# Every GPU test and benchmark in one call, then one table. Run from the repository root on a CUDA machine:
#   scripts/gpu_check.sh [out_dir]          (default: $OUT if set, else ./gpu-check)
# Needs torch with CUDA, Triton, pytest, msgspec, pyzmq, transformers. Without CUDA the tests skip and the benchmarks
# refuse. tests/wire/test_cuda_serve_checks.py is the torch-only proof of the serve's GPU path (no vLLM needed):
# a forked child initialises CUDA after the front end's device checks (1), staging that overflows its arena is refused
# while the engine stream's cached blocks survive (4), pinned host bytes stay at the arena's figure over ten updates
# (5), a broadcast stalled by a sleeping peer leaves another stream's kernels alone (6, two GPUs), a captured graph
# computes with prepared weights copied in the copy commit's way and not with ones swapped in by reference (7);
# tests/wire/test_cuda_staging.py runs the real staging thread in a worker's arenas (4, 5).
#
# The learner on CUDA (benchmarks/gpu_learner.py) trains from a recorded journal: INFLIGHT_GPU_JOURNAL names the run
# directory of a live run recorded with --keep-journal (`python -m benchmarks.gpu_learner record` makes one on any
# machine with vLLM, CPU included). Without it, on a machine with vLLM the script records one itself (the serve on GPU
# 0, the learner on GPU 1 or the CPU); with neither, the learner check is skipped and says so.
# With two or more GPUs it also runs the NCCL weights group between a learner GPU and a receiver GPU, and, when vLLM
# is installed, the main job's smoke test `inflight.run --serve-gpus 0 --learn-gpus 1`.
set -uo pipefail
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
$py -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
  | tee -a "$out/gpu.txt"

$py -m pytest -q -p no:cacheprovider -o addopts="" --junitxml="$out/pytest.xml" \
  tests/learner/test_fused_loss.py tests/wire/test_cuda_staging.py tests/wire/test_cuda_stream_order.py tests/wire/test_group.py \
  tests/wire/test_checksum.py tests/wire/test_delta.py tests/learner/test_logprobs.py \
  tests/learner/test_losses.py tests/wire/test_transfer.py tests/inflight/test_publisher_stream.py \
  tests/wire/test_cuda_serve_checks.py 2>&1 \
  | tee "$out/pytest.log"
tests_rc=${PIPESTATUS[0]}
$py -m benchmarks.fused_loss --json "$out/fused_loss.json" 2>&1 | tee "$out/fused_loss.txt"
fused_rc=${PIPESTATUS[0]}
$py -m benchmarks.cuda_staging --json "$out/cuda_staging.json" 2>&1 | tee "$out/cuda_staging.txt"
staging_rc=${PIPESTATUS[0]}
$py -m benchmarks.host_round_trips --json "$out/host_round_trips.json" 2>&1 | tee "$out/host_round_trips.txt"
staging_rc=$(( staging_rc | PIPESTATUS[0] ))

gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
has_vllm=$($py -c "import vllm" 2>/dev/null && echo 1 || echo 0)
journal=${INFLIGHT_GPU_JOURNAL:-}
if [ -z "$journal" ] && [ "$has_vllm" = 1 ]; then
  journal="$out/recorded"
  # vLLM's CUDA build serves on a GPU only: the serve on GPU 0, the learner on GPU 1 where there is one (else CPU)
  learn_gpus=$([ "$gpus" -ge 2 ] && echo 1 || echo "")
  $py -m benchmarks.gpu_learner record --run-dir "$journal" --duration-s 300 --serve-gpus 0 \
    ${learn_gpus:+--learn-gpus $learn_gpus} > "$out/record.log" 2>&1 || journal=""
fi
learner_rc=0
if [ -n "$journal" ]; then
  $py -m benchmarks.gpu_learner --replay "$journal" --steps 20 --out "$out/learner" --json "$out/gpu_learner.json" \
    2>&1 | tee "$out/gpu_learner.txt"
  learner_rc=${PIPESTATUS[0]}
else
  echo "gpu_learner: skipped (no INFLIGHT_GPU_JOURNAL and no vLLM to record one)" | tee "$out/gpu_learner.txt"
fi
nccl_rc=0
if [ "$gpus" -ge 2 ] && [ -n "$journal" ]; then  # the weights group over NCCL: learner on GPU 0, receiver on GPU 1
  $py -m benchmarks.gpu_learner --replay "$journal" --steps 5 --backend nccl --out "$out/learner-nccl" \
    --json "$out/gpu_learner_nccl.json" 2>&1 | tee "$out/gpu_learner_nccl.txt"
  nccl_rc=${PIPESTATUS[0]}
else
  echo "nccl weights group: skipped ($gpus GPU(s); it needs two)" | tee "$out/gpu_learner_nccl.txt"
fi
run_rc=0
if [ "$gpus" -ge 2 ] && [ "$has_vllm" = 1 ]; then  # the main job on split GPU pools
  $py -m inflight.run --serve-gpus 0 --learn-gpus 1 --steps 3 --run-dir "$out/run-smoke" --echo none \
    > "$out/run_smoke.log" 2>&1
  run_rc=$?
  echo "inflight.run --serve-gpus 0 --learn-gpus 1 --steps 3: exit $run_rc" | tee -a "$out/run_smoke.log"
else
  echo "inflight.run smoke test: skipped ($gpus GPU(s), vLLM installed: $has_vllm; it needs two GPUs and vLLM)" \
    | tee "$out/run_smoke.log"
fi

$py - "$out" "$tests_rc" "$fused_rc" "$staging_rc" "$learner_rc" "$nccl_rc" "$run_rc" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, rcs = Path(sys.argv[1]), sys.argv[2:]
print("\n== gpu_check summary ==")
try:
    root = ET.parse(out / "pytest.xml").getroot()
    suite = root.find("testsuite") if root.find("testsuite") is not None else root
    a = suite.attrib
    print(f"tests: {a.get('tests')} run, {a.get('failures')} failed, {a.get('errors')} errors, {a.get('skipped')} skipped")
except Exception as exc:
    print("tests: no report", exc)
try:
    rows = json.loads((out / "fused_loss.json").read_text())
    print(f"{'vocab':>7} {'hidden':>6} {'path':>8} {'ms':>8} {'peak MiB':>9} {'time/naive':>10} {'mem/naive':>9}")
    for r in rows:
        print(f"{r['vocab']:>7} {r['hidden']:>6} {r['path']:>8} {r['seconds'] * 1e3:>8.1f} "
              f"{r['peak_bytes'] / 2**20:>9.0f} {r['time_ratio']:>10.3f} {r['mem_ratio']:>9.3f}")
except Exception as exc:
    print("fused_loss: no result", exc)
try:
    s = json.loads((out / "cuda_staging.json").read_text())
    print(f"staging: commit {s['commit_gbs']:.0f} GB/s = {s['commit_vs_d2d']:.2f} of d2d {s['d2d_ceiling_gbs']:.0f} GB/s; "
          f"gloo receive {s['receive_gbs']:.2f} GB/s = {s['receive_vs_h2d']:.3f} of h2d {s['h2d_ceiling_gbs']:.1f} GB/s; "
          f"decode step while staging x{s['decode_slowdown']:.3f} (median), x{s['decode_slowdown_mean']:.3f} (mean)")
except Exception as exc:
    print("cuda_staging: no result", exc)
for name in ("host_round_trips.txt", "gpu_learner.txt", "gpu_learner_nccl.txt", "run_smoke.log"):
    lines = (out / name).read_text().splitlines() if (out / name).exists() else ["(no output)"]
    print(f"{name}: {lines[-1]}")
print("exit codes (tests, fused_loss, cuda_staging + host_round_trips, gpu_learner, nccl, run smoke):", " ".join(rcs))
sys.exit(max(int(r) for r in rcs))
PY
