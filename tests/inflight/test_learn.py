"""inflight.learn + inflight.serve as real processes on SmolLM2: the learner's logprobs match the serve's behaviour
logprobs, and after a published update the serve answers like the learner's model. (Training and publishing every
step through the launcher is tests/inflight/test_run.py; resume with the serve up through the learner's death is
tests/inflight/test_faults.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from serve_support import ServeProcess
from test_serve import free_port

pytestmark = pytest.mark.engine


def start_pair(model_dir, run_dir, steps: int, extra_learn=(), extra_serve=()):
    p = [free_port() for _ in range(3)]
    learn = ServeProcess(["--model", str(model_dir), "--steps", str(steps), "--groups-per-step", "2",
                          "--run-dir", str(run_dir), "--rollouts-port", str(p[0]), "--control-port", str(p[1]),
                          "--weights-port", str(p[2]), "--bucket-mb", "1", "--timeout-s", "30", "--lr", "1e-3",
                          "--group-size", "4", *extra_learn], module="inflight.learn")  # fmt: skip
    learn.wait_for("inflight.learn ready", timeout_s=120)
    serve = ServeProcess(["--model", str(model_dir), "--rollouts", f"tcp://127.0.0.1:{p[0]}",
                          "--control", f"tcp://127.0.0.1:{p[1]}", "--group-size", "4", "--max-tokens", "12",
                          "--groups-per-step", "2", "--admit-lag", "1", "--metrics", str(run_dir / "serve.jsonl"),
                          "--reward", "serve_rewards:text_length",
                          *extra_serve])  # fmt: skip
    return learn, serve


def wait_exit(proc: ServeProcess, timeout_s: float = 400) -> int:
    deadline = time.monotonic() + timeout_s
    while proc.proc.poll() is None:
        assert time.monotonic() < deadline, proc.tail()
        time.sleep(0.5)
    return proc.proc.returncode


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_serve_answers_like_the_export(model_dir, export_dir, http_port: int, version: int) -> None:
    """The serve behind `http_port`, at weight version `version`, greedy-decodes exactly what transformers decodes from
    `export_dir` (the learner's `hf-final`, loaded in fp32 as the test serves run) on prompts with a clear greedy
    choice."""
    import openai
    import torch
    from support import CONFIDENT_PROMPTS, greedy_transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", timeout=120)
    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    for prompt in CONFIDENT_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_dict=False)  # fmt: skip
        create = client.completions.with_raw_response.create
        raw = create(model=Path(model_dir).name, prompt=list(ids), max_tokens=16, temperature=0.0,
                     extra_body={"ignore_eos": True})  # fmt: skip
        assert raw.headers["x-inflight-weight-version"] == str(version)
        with torch.no_grad():
            want = tok.decode(greedy_transformers(model, torch.tensor([ids]), 16), skip_special_tokens=True)
        assert raw.parse().choices[0].text == want, prompt


def test_learner_matches_the_serves_logprobs_and_after_an_update_the_serve_answers_like_the_learners_model(
    model_dirs, tmp_path
):
    """Step 1 trains on version-0 rollouts only, so the learner's own lag-0 probe is |log pi_learner - log mu_vLLM|
    over every token: the float32 serve and the float32 learner agree to 5e-3 (bf16 serving: test_logprob_parity).
    Then the engine, after receiving the learner's update over the weights group, greedy-decodes exactly what
    transformers decodes from the learner's exported weights (prompts with a clear greedy choice). Both sides share a
    secret: the sockets run CURVE and the update arrives with keyed tags the serve verified (tests of forgeries:
    tests/vllm_patches/test_authenticated_updates.py)."""
    path, port = model_dirs["smollm2"], free_port()
    secret = tmp_path / "secret"
    secret.write_bytes(b"a secret both sides were given, 40 bytes")
    learn, serve = start_pair(path, tmp_path, 1, extra_learn=["--lr", "1e-5", "--secret-file", str(secret)],
                              extra_serve=["--http-port", str(port), "--secret-file", str(secret)])  # fmt: skip
    try:
        assert wait_exit(learn) == 0, learn.tail()
        [step] = read_jsonl(tmp_path / "metrics.jsonl")
        assert step["probe_tokens"] == step["tokens"] > 0 and step["mismatch_lag0"] <= 5e-3, step
        serve.wait_for("weights v1 committed", timeout_s=60)
        assert_serve_answers_like_the_export(path, tmp_path / "hf-final", port, version=1)
    finally:
        serve.stop()
        learn.stop()
