"""Reasoning Gym tasks: `--task reasoning-gym:<dataset>[,<dataset>...]`, scored by each dataset's own `score_answer`.

Reasoning Gym (`pip install 'inflight[envs]'`) generates its problems: item `i` of a dataset seeded `s` is drawn from
`random.Random(s + i)`, so a (seed, index) pair names one problem forever. Loaded by inflight/tasks/loading.py.

Options: `--task-args` (JSON; `task_args` in a run file's [serve] table), every key optional:

    {"size": 10000, "datasets": {"basic_arithmetic": {"max_terms": 2}}, "weights": {"basic_arithmetic": 2}}

- `size`: problems per pass; the stream cycles them forever, reshuffled each pass from the task seed.
- `datasets`: each dataset's own config (the fields of its config dataclass, e.g. basic_arithmetic's `max_terms`).
- `weights`: how often each dataset is drawn relative to the others (1 each by default). Several datasets are mixed
  by Reasoning Gym's `CompositeDataset`, which draws item i's dataset from the seed as well: deterministic.

Seeds: task seed `s` (`--task-seed`, the run's `--seed`) becomes Reasoning Gym seed `s * SEED_STRIDE`, so two task
seeds never share a generator seed (size + datasets <= SEED_STRIDE is enforced). `--eval-task` is loaded at task seed
+ 1000 (inflight/serve/eval.py:load_eval_problems): its problems are held out from training's. A small problem space
(two 1-digit operands) can still repeat a question by chance.

Scoring (`reward_fn`, the task's default reward): the answer is the text inside the completion's last
`<answer>...</answer>` (Reasoning Gym's convention) or, without one, the whole completion stripped; the dataset's
`score_answer(answer, entry)` scores it: 1.0 exact, and for most datasets partial credit len(answer) / len(reply) when
the reply contains the answer among other text, which rewards a short, right reply.
"""

from __future__ import annotations

import importlib
import json
import random
import re
from collections.abc import Iterator
from typing import Any

from inflight.tasks.base import Problem
from inflight.tasks.rows import TaskFileError

PREFIX = "reasoning-gym:"
SEED_STRIDE = 2**16  # generator seeds per task seed: task seeds s and s+1 draw from disjoint Random() seeds
DEFAULT_SIZE = 10_000
INSTALL = "pip install 'inflight[envs]'"
OPTION_KEYS = ("size", "datasets", "weights")
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

# Dataset name -> the configured dataset that scores its entries (the last one loaded in this process: the serve's
# training and eval tasks share --task-args, so both configure a dataset alike).
_SCORERS: dict[str, Any] = {}


def import_reasoning_gym(flag: str):
    """The `reasoning_gym` package, or a TaskFileError naming `flag` and the install line."""
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError as exc:
        raise TaskFileError(f"{flag} needs the reasoning-gym package ({exc}): {INSTALL}") from exc


class ReasoningGymTask:
    """An endless stream of Reasoning Gym problems: `size` problems per pass, mixed from `names` (module docstring)."""

    def __init__(self, spec: str, seed: int, task_args: str = "", shuffle: bool = True, system_prompt: str = ""):
        self.names = dataset_names(spec)
        options = parse_task_args(task_args, self.names)
        self.size, self.seed, self.shuffle, self.system_prompt = options["size"], seed, shuffle, system_prompt
        if seed < 0:
            raise TaskFileError(f"--task-seed is {seed} for --task {spec}: expected a seed >= 0")
        if self.size < 1 or self.size + len(self.names) > SEED_STRIDE:
            raise TaskFileError(
                f"--task-args size is {self.size}: expected 1..{SEED_STRIDE - len(self.names)} "
                "(larger would share generator seeds with the next task seed)"
            )
        self.dataset = _composite(spec, self.names, seed * SEED_STRIDE, self.size, options)
        _SCORERS.update(self.dataset.datasets)

    def __iter__(self) -> Iterator[Problem]:
        rng = random.Random(self.seed)
        while True:
            order = list(range(self.size))
            if self.shuffle:
                rng.shuffle(order)
            for index in order:
                yield self.problem(index)

    def problem(self, index: int) -> Problem:
        """Problem `index` of this seed's pass: the dataset's entry as its columns, its answer as the reference."""
        entry = self.dataset[index]
        name = entry["metadata"]["source_dataset"]
        system = ({"role": "system", "content": self.system_prompt},) if self.system_prompt else ()
        messages = (*system, {"role": "user", "content": entry["question"]}) if system else None
        return Problem(
            id=f"rg-{name}-{self.seed}-{index}",
            question=entry["question"],
            answer=entry["answer"],
            messages=messages,
            columns=dict(entry),
        )


def dataset_names(spec: str) -> list[str]:
    """The dataset names of `reasoning-gym:a,b`; unknown ones refused with the list of known names."""
    names = [n.strip() for n in spec.removeprefix(PREFIX).split(",") if n.strip()]
    known = import_reasoning_gym(f"--task {spec}").factory.DATASETS
    unknown = [n for n in names if n not in known or n == "composite"]
    if not names or unknown or len(set(names)) < len(names):
        raise TaskFileError(
            f"--task is {spec!r}: expected reasoning-gym:<dataset>[,<dataset>...], each once, from Reasoning Gym's "
            f"datasets; unknown: {unknown}; known: {', '.join(sorted(set(known) - {'composite'}))}"
        )
    return names


def parse_task_args(text: str, names: list[str]) -> dict[str, Any]:
    """`--task-args` as {"size", "datasets", "weights"}, defaults filled; a bad key or value raises naming it."""
    try:
        options = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise TaskFileError(
            f"--task-args is {text!r}: not JSON ({exc}); expected an object, e.g. '{{\"size\": 1000}}'"
        ) from None
    if not isinstance(options, dict) or set(options) - set(OPTION_KEYS):
        raise TaskFileError(f"--task-args is {text!r}: expected a JSON object with keys from {OPTION_KEYS}")
    options = {"size": DEFAULT_SIZE, "datasets": {}, "weights": {}, **options}
    if not isinstance(options["size"], int) or isinstance(options["size"], bool):
        raise TaskFileError(f"--task-args size is {options['size']!r}: expected an integer")
    for key in ("datasets", "weights"):
        table = options[key]
        if not isinstance(table, dict) or set(table) - set(names):
            raise TaskFileError(
                f"--task-args {key} is {table!r}: expected an object keyed by the --task datasets {names}"
            )
    for name, config in options["datasets"].items():
        if not isinstance(config, dict) or {"seed", "size"} & set(config):
            raise TaskFileError(
                f"--task-args datasets.{name} is {config!r}: expected an object of {name}'s config fields "
                "without seed or size (those come from --task-seed and --task-args size)"
            )
    for name, weight in options["weights"].items():
        if not isinstance(weight, int | float) or isinstance(weight, bool) or not weight > 0:
            raise TaskFileError(f"--task-args weights.{name} is {weight!r}: expected a number > 0")
    return options


def _composite(spec: str, names: list[str], base_seed: int, size: int, options: dict[str, Any]):
    """Reasoning Gym's CompositeDataset over `names` (dataset i seeded base_seed + i + 1 by Reasoning Gym)."""
    composite = importlib.import_module("reasoning_gym.composite")
    datasets = [
        composite.DatasetSpec(name, float(options["weights"].get(name, 1.0)), dict(options["datasets"].get(name, {})))
        for name in names
    ]
    try:
        return composite.CompositeDataset(composite.CompositeConfig(size=size, seed=base_seed, datasets=datasets))
    except (TypeError, ValueError, AssertionError) as exc:  # a config field the dataset lacks, or a value it refuses
        raise TaskFileError(
            f"--task {spec} with --task-args {options}: Reasoning Gym refused the config: {exc!r}"
        ) from exc


def extract_answer(completion_text: str) -> str:
    """The text inside the last `<answer>...</answer>`, else the whole completion, stripped."""
    tagged = ANSWER.findall(completion_text)
    return (tagged[-1] if tagged else completion_text).strip()


def reward_fn(completion_text: str, problem: Problem) -> float:
    """The dataset's own `score_answer` on the completion's answer: `inflight.tasks.reasoning_gym:reward_fn`."""
    metadata = problem.columns.get("metadata") or {}
    name = metadata.get("source_dataset")
    if name is None:
        raise ValueError(
            f"problem {problem.id} has no metadata.source_dataset column: this reward scores Reasoning Gym entries "
            "(--task reasoning-gym:<dataset>)"
        )
    scorer = _SCORERS.get(name)
    if scorer is None:  # entries from elsewhere (a saved table of them): the dataset with its default config
        scorer = _SCORERS[name] = import_reasoning_gym("--reward reasoning_gym").create_dataset(name)
    return float(scorer.score_answer(extract_answer(completion_text), problem.columns))
