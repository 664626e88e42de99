"""Tasks from a user's own table: JSONL, parquet and local `datasets`, chosen columns, chat prompts, a system prompt;
and `--model org/name` through the local Hugging Face cache."""

from __future__ import annotations

import asyncio
import json

import pytest

from inflight.tasks.jsonl import reward_fn
from inflight.tasks.loading import load_task
from inflight.tasks.rewards import load_rewards, score_group
from inflight.tasks.rows import TaskFileError

GSM = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
     "answer": "In May she sold 48/2 = 24 clips.\nIn all she sold 48+24 = 72 clips.\n#### 72", "level": 1},
    {"question": "Weng earns $12 an hour. How much for 50 minutes?",
     "answer": "Per minute $12/60 = $0.2.\nFor 50 minutes 0.2*50 = $10.\n#### 10", "level": 2},
]  # fmt: skip


def write_gsm_jsonl(path, rows=GSM):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def problems_of(spec: str, n: int = 2, **keys):
    task, _ = load_task(spec, seed=0, shuffle=False, **keys)
    return [p for _, p in zip(range(n), task, strict=False)]


def test_a_gsm8k_file_with_a_trl_reward_scores_right_completions_and_not_wrong_ones(tmp_path):
    path = write_gsm_jsonl(tmp_path / "gsm.jsonl")
    natalia, weng = problems_of(f"jsonl:{path}", prompt_key="question")
    assert natalia.question.startswith("Natalia") and natalia.columns["level"] == 1
    rewards = load_rewards("gsm_rewards:gsm_correct")
    assert rewards[0].convention == "group"
    texts = ["48/2 = 24, 48 + 24 = 72\n#### 72", "#### 73", "no idea"]
    scores = asyncio.run(score_group(rewards, natalia, texts))
    assert scores.total == [1.0, 0.0, 0.0] and scores.errors == 0
    assert asyncio.run(score_group(rewards, weng, ["It is $10.\n#### 10"])).total == [1.0]


def test_the_default_reward_reads_a_gsm8k_answer_after_its_hashes_instead_of_scoring_zero(tmp_path):
    natalia, _ = problems_of(f"jsonl:{write_gsm_jsonl(tmp_path / 'gsm.jsonl')}", prompt_key="question")
    assert reward_fn("They sold 72 clips.", natalia) == 1.0
    assert reward_fn("They sold 71 clips.", natalia) == 0.0


def test_parquet_and_saved_datasets_give_the_same_problems_as_the_jsonl(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_gsm_jsonl(tmp_path / "gsm.jsonl")
    pq.write_table(pa.Table.from_pylist(GSM), tmp_path / "gsm.parquet")
    datasets.Dataset.from_list(GSM).save_to_disk(str(tmp_path / "flat" / "gsm"))
    held_out = [{**r, "question": r["question"] + " (held out)"} for r in GSM]
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM),
                                   "test": datasets.Dataset.from_list(held_out)})  # fmt: skip
    splits.save_to_disk(str(tmp_path / "split" / "gsm"))
    expected = problems_of(f"jsonl:{jsonl}", prompt_key="question")
    for spec in (f"parquet:{tmp_path / 'gsm.parquet'}", str(tmp_path / "gsm.parquet"),
                 f"hf:{tmp_path / 'flat' / 'gsm'}", f"hf:{tmp_path / 'split' / 'gsm'}@train"):  # fmt: skip
        got = problems_of(spec, prompt_key="question")
        assert [(p.id, p.question, p.answer, p.columns) for p in got] == \
            [(p.id, p.question, p.answer, p.columns) for p in expected], spec  # fmt: skip
    test = problems_of(f"hf:{tmp_path / 'split' / 'gsm'}@test", prompt_key="question")
    assert all(p.question.endswith("(held out)") for p in test)
    with pytest.raises(TaskFileError, match=r"no split 'dev'.*\['test', 'train'\]"):
        problems_of(f"hf:{tmp_path / 'split' / 'gsm'}@dev", prompt_key="question")


def test_a_prompt_key_absent_from_the_file_is_refused_naming_the_columns_it_has(tmp_path):
    path = write_gsm_jsonl(tmp_path / "gsm.jsonl")
    with pytest.raises(TaskFileError, match=r"--prompt-key 'prompt'.*\['answer', 'level', 'question'\]"):
        problems_of(f"jsonl:{path}")
    with pytest.raises(TaskFileError, match=r"--answer-key 'solution'"):
        problems_of(f"jsonl:{path}", prompt_key="question", answer_key="solution")


def test_chat_message_prompts_and_a_system_prompt_reach_the_chat_template_and_the_reward(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
             "answer": "4"},
            {"prompt": "3+3?", "answer": "6"}]  # fmt: skip
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    chat, plain = problems_of(f"jsonl:{path}", system_prompt="Answer with a number.")
    assert chat.chat() == rows[0]["prompt"] and chat.question == "2+2?"  # its own system message is kept
    assert plain.chat() == [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "3+3?"}]
    assert chat.trl_prompt() == rows[0]["prompt"] and plain.trl_prompt() == "3+3?"

    seen = {}

    def spy(prompts, completions, **columns):
        seen.update(prompts=prompts, completions=completions, columns=columns)
        return [1.0] * len(completions)

    from inflight.tasks.rewards import Reward

    asyncio.run(score_group([Reward("spy", spy, "group")], chat, ["4"], [[19]]))
    assert seen["prompts"] == [rows[0]["prompt"]] and seen["completions"] == [[{"role": "assistant", "content": "4"}]]
    assert seen["columns"] == {"answer": ["4"], "completion_ids": [[19]]}
    arithmetic = problems_of("arithmetic", system_prompt="Be exact.")
    assert arithmetic[0].chat()[0] == {"role": "system", "content": "Be exact."}


def test_a_hub_dataset_missing_from_the_local_cache_names_the_download_command():
    with pytest.raises(TaskFileError, match=r"hf download --repo-type dataset no-such-org/no-such-set"):
        problems_of("hf:no-such-org/no-such-set@train")


def test_a_hub_model_id_resolves_through_the_local_cache_or_names_the_download_command(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from inflight.models import resolve_model

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SystemExit, match=r"hf download my-org/my-model"):
        resolve_model("my-org/my-model")
    repo = tmp_path / "models--my-org--my-model"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    assert resolve_model("my-org/my-model") == snapshot
