"""Problems from a table: a JSONL file, a parquet file, or a local Hugging Face `datasets` dataset.

`--task` names the table (`load_rows`); `--prompt-key` / `--answer-key` name its columns; `--system-prompt` is put
before every prompt. A prompt cell is either a string (one user message) or chat messages, a list of
`{"role": ..., "content": ...}`. Every column of a row stays on its `Problem` (`Problem.columns`), so a reward sees
all of them. pyarrow and datasets are imported only when a parquet or `hf:` task is loaded (`pip install
'inflight[data]'`).

Specs:
- `jsonl:<path>` (or any path ending in `.jsonl`): one JSON object per line.
- `parquet:<path>` (or a path ending in `.parquet`).
- `hf:<dir or name>[@<split>]`: a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`, else a
  `datasets.load_dataset` name (`hf:openai/gsm8k:main@test`: name, config, split) that resolves with no network.
  The split defaults to `train`.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from inflight.tasks.base import Message, Problem


class TaskFileError(ValueError):
    """A prompt table is missing, empty, or lacks the columns the flags name; the message names the fix."""


class RowTask:
    """Cycles through a table's problems forever (shuffled per pass when `seed` is given)."""

    def __init__(self, problems: list[Problem], seed: int | None = None):
        self.problems, self.seed = problems, seed

    def __iter__(self) -> Iterator[Problem]:
        rng = random.Random(self.seed)
        while True:
            order = list(self.problems)
            if self.seed is not None:
                rng.shuffle(order)
            yield from order


def load_rows(spec: str) -> tuple[list[dict[str, Any]], str]:
    """The rows of the table `spec` names (see the module docstring) and a short name for problem ids."""
    kind, sep, rest = spec.partition(":")
    if not sep or kind not in ("jsonl", "parquet", "hf"):  # a bare path: its suffix says the format
        kind, rest = Path(spec).suffix.lstrip("."), spec
    if kind == "jsonl":
        return read_jsonl(Path(rest)), Path(rest).stem
    if kind == "parquet":
        return read_parquet(Path(rest)), Path(rest).stem
    if kind == "hf":
        return read_hf(rest), Path(rest.partition("@")[0]).name
    raise TaskFileError(
        f"--task is {spec!r}, expected 'arithmetic', 'jsonl:<path>', 'parquet:<path>' or "
        "'hf:<saved dataset dir or name>[@split]'"
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise TaskFileError(f"prompt file {path} does not exist: pass --task jsonl:<path to a .jsonl file>")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskFileError(f"{path}:{lineno} is not JSON: {exc}") from exc
        if not isinstance(row, dict):
            raise TaskFileError(f"{path}:{lineno} is a JSON {type(row).__name__}, expected an object (one row)")
        rows.append(row)
    return rows


def read_parquet(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise TaskFileError(f"prompt file {path} does not exist: pass --task parquet:<path to a .parquet file>")
    pq = _import("pyarrow.parquet")
    return pq.read_table(path).to_pylist()


def read_hf(spec: str) -> list[dict[str, Any]]:
    """A saved `datasets` directory, or a `load_dataset` name found in the local cache (offline: never downloads)."""
    source, _, split = spec.partition("@")
    split = split or "train"
    # Offline before the import: datasets reads these once. A run must not depend on (or wait for) the network.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    datasets = _import("datasets")
    datasets.config.HF_HUB_OFFLINE = True  # in case datasets was imported before (by this process's caller)
    if Path(source).is_dir() and any(Path(source).glob("*.json")):
        data = datasets.load_from_disk(source)
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise TaskFileError(
                    f"--task hf:{spec}: no split {split!r}; the dataset has {sorted(data)}: pass hf:{source}@<split>"
                )
            data = data[split]
        return data.to_list()
    name, _, config = source.partition(":")
    try:
        data = datasets.load_dataset(name, config or None, split=split)
    except Exception as exc:  # datasets raises many kinds for "not in the cache"; all mean the same to the user
        raise TaskFileError(
            f"--task hf:{spec}: could not load {name!r} split {split!r} offline ({exc}); download "
            f"it once with `hf download --repo-type dataset {name}`, or pass a directory "
            "written by save_to_disk"
        ) from exc
    return data.to_list()


def _import(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TaskFileError(f"reading this task needs {module.split('.')[0]}: pip install 'inflight[data]'") from exc


def rows_to_problems(
    rows: list[dict[str, Any]],
    name: str,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    system_prompt: str = "",
) -> list[Problem]:
    """One `Problem` per row; a missing column or a malformed prompt raises naming the row, the flag and the fix."""
    if not rows:
        raise TaskFileError(f"task {name} has no rows")
    columns = sorted(rows[0])
    for flag, key in (("--prompt-key", prompt_key), ("--answer-key", answer_key)):
        if key and key not in rows[0]:
            raise TaskFileError(
                f"{flag} {key!r}: no such column in task {name}; its columns are {columns}: pass {flag} <one of them>"
            )
    problems = []
    for index, row in enumerate(rows):
        where = f"task {name} row {index}"
        if prompt_key not in row or (answer_key and answer_key not in row):
            raise TaskFileError(f"{where} lacks {prompt_key!r} or {answer_key!r}; its columns are {sorted(row)}")
        question, messages = _prompt(row[prompt_key], system_prompt, where, prompt_key)
        problems.append(
            Problem(
                id=str(row.get("id", f"{name}-{index}")),
                question=question,
                answer=row[answer_key] if answer_key else None,
                messages=messages,
                columns=dict(row),
                conversational=isinstance(row[prompt_key], list),
            )
        )
    return problems


def _prompt(cell: Any, system_prompt: str, where: str, key: str) -> tuple[str, tuple[Message, ...] | None]:
    """(user text, chat messages or None) of one prompt cell: a string, or a list of role/content messages."""
    if isinstance(cell, str):
        messages = [{"role": "user", "content": cell}]
    elif isinstance(cell, list) and cell and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in cell):
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in cell]
    else:
        raise TaskFileError(
            f"{where}: {key!r} is {cell!r:.80}, expected a string or a list of {{'role': ..., 'content': ...}} messages"
        )
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    users = [m["content"] for m in messages if m["role"] == "user"]
    question = users[-1] if users else messages[-1]["content"]
    plain = len(messages) == 1 and isinstance(cell, str)
    return question, None if plain else tuple(messages)
