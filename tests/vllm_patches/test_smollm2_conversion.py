"""The GGUF → bf16 conversion is faithful: vLLM serving the prepared SmolLM2 and transformers running the same
directory pick the same greedy tokens on the same chat prompt."""

from __future__ import annotations

import pytest
import torch
from support import chat_ids, greedy, start_engine, stop_engine
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.engine
PROMPTS = ["What is the capital of France?", "What is 2 + 3? Reply with only the number."]


def test_vllm_greedy_equals_transformers_greedy_on_prepared_smollm2(loop, model_dirs):
    path = model_dirs["smollm2"]
    tok = AutoTokenizer.from_pretrained(path)
    engine = start_engine(loop, path, max_model_len=512)
    try:
        served = loop.run_until_complete(greedy(engine, tok, PROMPTS, max_tokens=16, tag="parity"))
    finally:
        stop_engine(loop, engine)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for prompt, out in zip(PROMPTS, served, strict=True):
        ids = torch.tensor([chat_ids(tok, prompt)])
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, ids.shape[1] :]
        got, want = tok.decode(out.token_ids), tok.decode(ref)
        assert out.token_ids == ref.tolist(), f"{prompt!r}: vLLM {got!r} vs transformers {want!r}"
