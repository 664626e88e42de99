"""Experiment tracking (`--report-to none|tensorboard|wandb`): the learner's step metrics, the serve's progress and a
table of sample completions, mirrored to TensorBoard or Weights & Biases.

`<run_dir>/metrics.jsonl` stays the source of truth: `inflight/learn/service.py:LearnerService.write_step` writes the
line first and only then hands the record to `Reporting.step`, and a tracker that fails is logged and counted, never
raised into the training loop. One process logs: learner rank 0 (the launcher's `--report-to` is passed to it), so a
W&B run has one writer.

What is logged, at the learner's step:
- `train/<field>` for every numeric field of `StepMetrics` (inflight/wire/records.py; `time` is the wall time of every
  point) and `train/<field>/<key>` for every entry of its dicts (`train/rejected/<reason>`, the lag histograms as
  tokens per lag: `train/lag_histogram/<lag>`, `train/kv_lag_histogram/<lag>`), plus `train/lag_mean` and
  `train/length_mean`;
- `serve/<field>` for each `ServeProgress` line, `update/<field>` for each `UpdateEvent` and `eval/<field>` for each
  `EvalResult` that the serve appended to `<run_dir>/serve-metrics.jsonl` since the last step, dicts flattened the
  same way (`serve/reward_means/<reward>`, `eval/reward_means/<reward>`); where `inflight.run` has the serve write
  them; a serve on another host writes its own file, which is not followed;
- every `--log-samples-every` steps, table `samples`: prompt, completion, reward, advantage and the weight versions
  that sampled the completion.

TensorBoard event files go to `<run_dir>/tensorboard` (torch's SummaryWriter); W&B's run to `<run_dir>/wandb`, offline
unless `WANDB_MODE` says otherwise (offline needs no account and no network: `wandb sync` uploads it later). Both
packages are imported only when asked for (`pip install 'inflight[track]'`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from collections.abc import Callable
from pathlib import Path

import msgspec

from inflight.wire.records import EvalResult, ServeEvent, ServeProgress, StepMetrics, UpdateEvent

log = logging.getLogger("inflight.learn")
REPORT_TO = ("none", "tensorboard", "wandb")
INSTALL_HINT = "pip install 'inflight[track]'"
SAMPLE_COLUMNS = ("prompt", "completion", "reward", "advantage", "versions")
MAX_SAMPLE_ROWS = 64  # a step's batch is 32 samples by default; a bigger one is cut to its first rows


def check_installed(report_to: str) -> None:
    """ValueError naming the package and the install command when `--report-to` needs one that is missing."""
    package = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(report_to)
    if package and importlib.util.find_spec(package) is None:
        raise ValueError(
            f"--report-to {report_to} needs the {package} package, which is not installed: "
            f"{INSTALL_HINT}, or --report-to none"
        )


@dataclasses.dataclass
class SampleRow:
    """One completion as the samples table shows it; `versions` are the distinct weight versions of its tokens."""

    prompt: str
    completion: str
    reward: float
    advantage: float
    versions: str


def record_scalars(record: msgspec.Struct, prefix: str) -> dict[str, float]:
    """Every number of `record` (bools as 0/1) as `<prefix>/<field>`, and every dict of numbers flattened to
    `<prefix>/<field>/<key>`: the lag histograms and per-reward means are metrics too, and a tracker takes only
    scalars. Absent fields are left out; `time` is the point's wall time, not a value; lists are left to the caller."""
    out = {}
    for name in record.__struct_fields__:
        value = getattr(record, name)
        if name == "time":
            continue
        if isinstance(value, int | float):
            out[f"{prefix}/{name}"] = float(value)
        elif isinstance(value, dict):
            out.update({f"{prefix}/{name}/{key}": float(n) for key, n in value.items() if isinstance(n, int | float)})
    return out


def step_scalars(record: StepMetrics) -> dict[str, float]:
    """`record` as `train/...` scalars (`record_scalars`: fields, histogram counts per lag, refused rollouts by
    reason), with the lag and length means."""
    out = record_scalars(record, "train")
    tokens = sum(record.lag_histogram.values())
    if tokens:
        out["train/lag_mean"] = sum(lag * n for lag, n in record.lag_histogram.items()) / tokens
    if record.lengths:
        out["train/length_mean"] = sum(record.lengths) / len(record.lengths)
    return out


def serve_scalars(event: ServeProgress | UpdateEvent | EvalResult) -> dict[str, float]:
    """A serve line as `serve/...` (progress), `update/...` (update) or `eval/...` (a held-out eval, whose `version`
    field says which weights it scored) scalars, per-reward means included (`record_scalars`)."""
    prefix = {ServeProgress: "serve", UpdateEvent: "update", EvalResult: "eval"}[type(event)]
    return record_scalars(event, prefix)


class Tracker:
    """Where metrics go: `log_step`, `log_serve` and `log_samples` in terms of the three calls a subclass implements
    (`scalars`, `table`, `close`); the base's do nothing."""

    def scalars(self, values: dict[str, float], step: int, wall_time: float) -> None:
        pass

    def table(self, name: str, columns: tuple[str, ...], rows: list[list], step: int) -> None:
        pass

    def close(self) -> None:
        pass

    def log_step(self, record: StepMetrics) -> None:
        self.scalars(step_scalars(record), record.step, record.time)

    def log_serve(self, event: ServeProgress | UpdateEvent | EvalResult, step: int) -> None:
        self.scalars(serve_scalars(event), step, event.time)

    def log_samples(self, rows: list[SampleRow], step: int) -> None:
        self.table("samples", SAMPLE_COLUMNS, [list(dataclasses.astuple(r)) for r in rows], step)


class NoTracker(Tracker):
    """`--report-to none`: nothing leaves metrics.jsonl."""


class TensorBoardTracker(Tracker):
    """Event files under `<run_dir>/tensorboard`; the samples table as a markdown text summary."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), flush_secs=10)

    def scalars(self, values: dict[str, float], step: int, wall_time: float) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step, walltime=wall_time)

    def table(self, name: str, columns: tuple[str, ...], rows: list[list], step: int) -> None:
        def cell(value) -> str:  # one markdown cell: pipes escaped, newlines as <br>
            return str(value).replace("|", "\\|").replace("\n", "<br>")

        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self.writer.add_text(name, "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A W&B run in `<run_dir>/wandb`, named after the run directory, with the learner's config; offline unless
    `WANDB_MODE` is set (project: `WANDB_PROJECT`, default `inflight`)."""

    def __init__(self, run_dir: Path, config: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "inflight"),
            dir=str(run_dir),
            name=Path(run_dir).resolve().name,
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
            settings=wandb.Settings(console="off"),
        )

    def scalars(self, values: dict[str, float], step: int, wall_time: float) -> None:
        self.run.log(values, step=step)

    def table(self, name: str, columns: tuple[str, ...], rows: list[list], step: int) -> None:
        self.run.log({name: self.wandb.Table(columns=list(columns), data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


def open_tracker(report_to: str, run_dir: Path, config: dict) -> Tracker:
    """The tracker `--report-to` names (its package imported only now)."""
    if report_to == "tensorboard":
        return TensorBoardTracker(run_dir)
    if report_to == "wandb":
        return WandbTracker(run_dir, config)
    return NoTracker()


class ServeMetricsTail:
    """Follows a serve's metrics file from where it ended when opened: `read` returns the complete lines appended
    since the last call as records (a line cut by a concurrent write waits for the next call; an unreadable one is
    skipped)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self.decoder = msgspec.json.Decoder(ServeEvent)

    def read(self) -> list[ServeProgress | UpdateEvent]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        events = []
        for line in complete.splitlines():
            try:
                events.append(self.decoder.decode(line))
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # not ours to judge: the run report reads the file strictly (inflight/wire/records.py)
        return events


def sample_rows(
    samples, rewards: list[float], gate_version: int, decode: Callable[[list[int]], str]
) -> list[SampleRow]:
    """The samples table of one step: `samples` are the step's GatedSamples (inflight/learn/samples.py), `rewards`
    their rewards in the same order, `gate_version` the learner version they were gated at (a token's version is
    gate_version − its lag)."""
    rows = []
    for sample, reward in list(zip(samples, rewards, strict=True))[:MAX_SAMPLE_ROWS]:
        policy = sample.policy or [True] * len(sample.lags)  # environment tokens have no version
        versions = sorted({gate_version - lag for lag, p in zip(sample.lags, policy, strict=True) if p})
        rows.append(
            SampleRow(
                decode(sample.prompt_ids),
                decode(sample.completion_ids),
                float(reward),
                float(sample.advantage),
                ",".join(map(str, versions)),
            )
        )
    return rows


class Reporting:
    """Learner rank 0's tracking: the tracker `--report-to` names, the serve's metrics file followed, the tokenizer
    for the samples table loaded on first use. No method raises: a tracker failure is logged (the first one with its
    traceback) and counted in `failures`, and training goes on."""

    def __init__(self, report_to: str, run_dir: Path, config: dict, model: str, samples_every: int):
        self.failures, self.samples_every, self.model, self.last_step = 0, samples_every, model, 0
        self.serve = ServeMetricsTail(Path(run_dir) / "serve-metrics.jsonl")
        self._decode: Callable[[list[int]], str] | None = None
        self.tracker: Tracker = NoTracker()
        self._guard("open", lambda: setattr(self, "tracker", open_tracker(report_to, Path(run_dir), config)))
        self.active = report_to != "none" and not self.failures

    def step(self, record: StepMetrics) -> None:
        """The serve lines appended since the last step, then the step's metrics, at `record.step`."""
        if self.active:
            self.last_step = record.step
            self._guard("serve progress", self._serve_lines)
            self._guard("step metrics", lambda: self.tracker.log_step(record))

    def _serve_lines(self) -> None:
        for event in self.serve.read():
            self.tracker.log_serve(event, self.last_step)

    def samples(self, samples, rewards: list[float], gate_version: int, step: int) -> None:
        """The samples table, on every `samples_every`-th step."""
        if self.active and self.samples_every and step % self.samples_every == 0:
            self._guard(
                "samples",
                lambda: self.tracker.log_samples(sample_rows(samples, rewards, gate_version, self.decoder()), step),
            )

    def decoder(self) -> Callable[[list[int]], str]:
        if self._decode is None:
            from transformers import AutoTokenizer

            from inflight.models import resolve_model

            self._decode = AutoTokenizer.from_pretrained(resolve_model(self.model)).decode
        return self._decode

    def close(self) -> None:
        """The serve lines written since the last step (the last update's commit), at that step; then the tracker."""
        if self.active and self.last_step:
            self._guard("serve progress", self._serve_lines)
        self._guard("close", self.tracker.close)
        if self.failures:
            log.warning("tracking: %d failures (metrics.jsonl is complete)", self.failures)

    def _guard(self, what: str, action: Callable[[], object]) -> None:
        try:
            action()
        except Exception as exc:  # a tracker must never stop training
            self.failures += 1
            log.warning("tracking: %s failed (%d so far): %r", what, self.failures, exc, exc_info=self.failures == 1)
