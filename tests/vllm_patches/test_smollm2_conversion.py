"""The GGUF → bf16 conversion is faithful: vLLM serving the prepared SmolLM2 and transformers running the same
directory pick the same greedy tokens on the same chat prompts, and score them alike.

The prompts are ones where the model's greedy choice is clear (top-2 log-prob margin ≥ 0.5 over the 16 tokens in
transformers): on "What is the capital of France?" the first token is a 0.1-nat call between "The" and "L", which
bf16 kernel differences legitimately flip."""

from __future__ import annotations

import pytest
import torch
from support import CONFIDENT_PROMPTS, chat_ids, greedy, greedy_transformers, start_engine, stop_engine
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.engine
PROMPTS = CONFIDENT_PROMPTS


def test_vllm_greedy_equals_transformers_greedy_on_prepared_smollm2(loop, model_dirs):
    path = model_dirs["smollm2"]
    tok = AutoTokenizer.from_pretrained(path)
    engine = start_engine(loop, path, max_model_len=512)
    try:
        served = loop.run_until_complete(greedy(engine, tok, PROMPTS, max_tokens=16, tag="parity"))
    finally:
        stop_engine(loop, engine)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    deltas = []
    for prompt, out in zip(PROMPTS, served, strict=True):
        ids = torch.tensor([chat_ids(tok, prompt)])
        with torch.no_grad():
            ref = greedy_transformers(model, ids, 16)
            full = torch.cat([ids[0], torch.tensor(out.token_ids)])[None]
            logp = model(full).logits[0, ids.shape[1] - 1 : -1].float().log_softmax(-1)
        got, want = tok.decode(out.token_ids), tok.decode(ref)
        assert out.token_ids == ref.tolist(), f"{prompt!r}: vLLM {got!r} vs transformers {want!r}"
        hf = logp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        deltas += (hf - torch.tensor(out.logprobs)).abs().tolist()
    mean = sum(deltas) / len(deltas)
    print(f"\nmean |logprob vLLM - transformers| over {len(deltas)} greedy tokens: {mean:.4f}")
    assert mean < 0.1
