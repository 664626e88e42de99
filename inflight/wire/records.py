"""The run directory's metrics lines as typed records, shared by the processes that write them and the code that reads
them (the run report, the benchmarks, the simulator's calibration).

- `<run_dir>/metrics.jsonl`: one `StepMetrics` per learner step, written by `inflight/learn/app.py:Learner._log`.
- `serve-metrics.jsonl` (the serve's `--metrics`): `ServeProgress` every `--progress-s` seconds, one `UpdateEvent`
  per weight update and one `EvalResult` per held-out eval, written by `inflight/serve/progress.py:ProgressReporter`;
  the `event` field tells them apart.

Writers build the Struct and encode it with `encode_line`; readers decode each line into it with `read_steps` /
`read_serve_events`. A field renamed on one side, missing, of the wrong type or unknown therefore raises `RecordError`
naming the file, the line and the field where the line is read, instead of quietly leaving a figure empty.

Compatibility: the lines are the JSON objects the writers wrote before these records existed (same keys, same
values), so older run directories load. msgspec writes NaN and ±inf as `null` where `json.dumps` wrote `NaN`; the
values a diverging step can make non-finite are therefore `float | None` (None: not finite), and lines with the old
`NaN` tokens are still read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


class RecordError(ValueError):
    """A metrics line does not match its record (a field renamed, missing, unknown or of the wrong type)."""


class StepMetrics(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """One learner step, appended to `<run_dir>/metrics.jsonl` by learner rank 0 after the step (and its publish).

    Counts cover the whole step's batch unless marked rank-local (rank 0's slice of it). Seconds are wall-clock
    durations; `time` is `time.time()` when the line was written. Optional fields are absent from the line when None.
    """

    step: int  # optimizer steps taken so far, this one included
    version: int  # the learner's weight version after this step (= step count, restored on --resume)
    time: float
    reward: float  # mean reward of the batch's samples
    lag_histogram: dict[int, int]  # lag (learner version at training − generating version) → tokens, gated ones too
    groups: list[str]  # the group ids trained in this step
    lengths: list[int]  # completion tokens of each sample
    # Trained (unmasked) tokens of rank 0's slice, as `learner/losses.py:policy_loss` counts them. The batch's tokens,
    # gated ones included, are `sum(lag_histogram.values())`.
    tokens: float
    gated_fraction: float  # gated tokens / all tokens of the batch (the staleness gate, --max-lag)
    wait_s: float  # waiting for complete groups before the step
    step_s: float  # the whole step: wait, train, publish
    tokens_per_s: float  # train_tokens / train_s
    rejected: dict[str, int]  # rollouts refused so far by reason; "wire:<reason>" = refused by the rollout socket
    # From `learner/step.py:train_step`:
    loss: float | None  # whole-batch loss
    grad_norm: float | None  # global gradient norm before clipping
    normalizer: float  # the loss's global token (or sequence) count
    clip_fraction: float  # rank-local fraction of tokens whose ratio hit the trust region (tis cap, ppo clip, mask)
    ess: float | None  # rank-local effective sample size of the token importance weights, in (0, 1]
    mean_abs_logratio: float | None  # rank-local mean |logπθ − logμ| over trained tokens
    probe_abs_logratio_sum: float | None = None  # rank-local Σ |logπθ − logμ| over the lag-0 probe tokens
    probe_tokens: float | None = None  # rank-local lag-0 probe tokens
    # From `inflight/learn/app.py:Learner._train`:
    train_s: float  # train_step alone
    mismatch_lag0: float | None = None  # probe_abs_logratio_sum / probe_tokens; absent with no lag-0 token
    # --routing-replay on (learner/routing_replay.py), from train_step: the token×MoE-layer pairs of rank 0's slice
    # with a recorded route and those where the learner's own top-k set equals it; the probe's Σ |logπθ − logμ| in a
    # forward routed by the learner's own router (the lag-0 mismatch replay removes); and from the learner:
    route_matches: float | None = None
    route_total: float | None = None
    probe_abs_logratio_sum_unreplayed: float | None = None
    routing_agreement: float | None = None  # route_matches / route_total
    mismatch_lag0_unreplayed: float | None = None  # mismatch_lag0 without replay (mismatch_lag0 is with it)
    route_bytes_per_token: float | None = None  # the routes' encoded bytes / prompt + completion tokens of the batch
    train_tokens: int  # trained tokens of the whole batch (all ranks)
    # From `inflight/learn/publisher.py:RankSender.publish`, only on steps that published (--publish-every):
    publish_s: float | None = None  # gather the full weights and send the update
    publish_bytes: int | None = None
    publish_serves: int | None = None  # serves the update went to
    publish_bytes_per_s: float | None = None  # over the broadcast alone
    publish_failed: list[str] | None = None  # server ids the update failed on
    publish_delta: bool | None = None  # sent as a delta on the previous version (--full-every), not in full
    # rank 0's peak extra memory while publishing (streamed full updates), on the weights device: CUDA allocator peak,
    # or the process's resident high-water mark on CPU (inflight/wire/memory.py:PeakMeter)
    publish_peak_bytes: int | None = None
    # a CUDA learner publishing over gloo: its GPU's peak extra memory too (the CUDA allocator's), since the pieces are
    # gathered on the GPU before they are cast into host buckets; None where the weights device is the learner's own
    publish_device_peak_bytes: int | None = None
    # kv lag (learner version at training − version of the oldest KV the token attended to) → tokens; >= the lag
    kv_lag_histogram: dict[int, int] | None = None
    # Multi-turn episodes (present when the batch had environment tokens): environment tokens of the batch (context,
    # never trained, not in the lag histograms), the mean policy turns per sample, and per sample (as `lengths`) its
    # policy turns and its environment tokens
    env_tokens: int | None = None
    turns_mean: float | None = None
    turns: list[int] | None = None
    env_lengths: list[int] | None = None
    # The learner's parameters (inflight/learn/adapter.py:counted_parameters): those the optimizer trains — the
    # adapter's alone with --lora-rank — and all of them
    trainable_params: int | None = None
    total_params: int | None = None


class ServeProgress(
    msgspec.Struct, tag_field="event", tag="progress", kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """A serve's progress, written every `--progress-s` seconds. Counters are cumulative since the serve started;
    `*_s` are cumulative seconds; `time` is `time.time()` when written."""

    time: float
    server_id: str
    version: int  # the weight version the engine serves
    tokens_per_s: float  # generated tokens per second since the previous progress line
    tokens: int  # generated tokens
    inflight: int  # requests being generated now
    outbox: int  # finished rollouts not yet sent
    retained: int  # sent rollouts the learner has not acknowledged
    resent: int  # rollouts sent again to a restarted learner
    rollouts_sent: int
    groups_admitted: int
    groups_consumed: int  # groups the learner has consumed from this serve (its last Progress)
    mean_reward: float  # over every rollout made
    reward_errors: int  # rewards that raised (scored 0.0)
    idle_s: float  # with nothing to generate (starved by the admission gate or waiting in blocking mode)
    stalled_s: float  # generation stalled by weight updates
    resubmitted: int  # requests aborted by abort-resume updates and submitted again
    recomputed_tokens: int  # prompt + partial tokens those resubmissions prefilled again
    # Each --reward's own mean over every sample it scored (None, "not applicable", left out); absent when empty.
    reward_means: dict[str, float] = {}
    # Episodes (inflight/serve/episodes.py), over every rollout made; absent while zero. turns / rollouts_made is the
    # turns per episode; env_tokens / (env_tokens + policy_tokens) the environment tokens' share.
    turns: int = 0  # policy turns
    env_s: float = 0.0  # seconds inside environment calls (summed over episodes, which overlap)
    env_errors: int = 0  # episodes an environment ended by raising, timing out or answering garbage (scored 0)
    tool_errors: int = 0  # malformed tool calls the environment reported (the episode went on)
    env_tokens: int = 0  # completion tokens the environment appended
    policy_tokens: int = 0  # completion tokens the policy sampled
    rollouts_made: int = 0
    env_error_kinds: dict[str, int] = {}  # env_errors by kind ("timeout before the first model call", ...)
    # Groups never sent because an episode ended with no sampled token (nothing to train:
    # inflight/serve/driver.py:dropped), and those episodes
    groups_dropped: int = 0
    untrained_episodes: int = 0
    # Groups never sent because the engine or the serve failed them (inflight/serve/driver.py:failed), and the last
    # such error ("Type: message")
    groups_failed: int = 0
    last_failure: str = ""
    # Weight updates a worker refused because they did not fit its staging arena (the plan's bytes); decoding went on
    updates_refused: int = 0


class UpdateEvent(
    msgspec.Struct, tag_field="event", tag="update", kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """One weight update on a serve, written when it finished (committed, or failed with weights unchanged)."""

    time: float
    server_id: str
    version: int  # the update's version if it committed, else the version still served
    ok: bool
    error: str  # "" when ok
    stall_s: float  # generation could not progress: the commit alone in never-stop, the whole update when paused
    total_s: float  # pause (if any), receive, commit
    receive_s: float  # receiving and verifying every bucket
    commit_s: float  # the engine-step gap of the commit
    bytes_kept: int = 0  # what one worker staged: its tensor-parallel slices, else every byte
    full_tensors: list[str] = msgspec.field(default_factory=list)  # kept whole on a TP worker: layout not known


class EvalResult(msgspec.Struct, tag_field="event", tag="eval", kw_only=True, forbid_unknown_fields=True):
    """One held-out eval (`--eval-task`, every `--eval-every` versions), written when it finished. Every token it
    scored was sampled by weights `version` (`versions` lists what the tokens carried, to show it)."""

    time: float
    server_id: str
    version: int  # the weight version that generated every scored completion
    versions: list[int]  # the distinct token versions seen (== [version] for a valid eval)
    task: str  # the --eval-task spec
    n: int  # completions scored
    mean_reward: float  # mean combined (weighted) reward
    accuracy: float  # fraction of completions with a combined reward > 0 (for a 0/1 reward: the accuracy)
    reward_means: dict[str, float] = {}  # each --reward's own mean
    temperature: float = 0.0  # 0 = greedy
    reward_errors: int = 0
    eval_s: float = 0.0  # wall-clock seconds the eval took


ServeEvent = ServeProgress | UpdateEvent | EvalResult


def encode_line(record: msgspec.Struct) -> str:
    """One JSONL line (newline included) for `record`."""
    return msgspec.json.encode(record).decode() + "\n"


def read_steps(path: Path) -> list[StepMetrics]:
    """Every step of a learner's metrics.jsonl; [] when the file does not exist."""
    return read_records(path, StepMetrics)


def read_serve_events(path: Path) -> list[ServeProgress | UpdateEvent | EvalResult]:
    """Every progress line, update event and eval result of a serve's metrics file; [] when it does not exist."""
    return read_records(path, ServeEvent)


def read_records(path: Path, kind: Any) -> list:
    """Decode each line of `path` as `kind`; raises RecordError naming file, line and field on a mismatch.

    A line that is not JSON at all is skipped: a process killed mid-write leaves one cut line (followed, after a
    resume that appends, by the next life's lines)."""
    path = Path(path)
    if not path.exists():
        return []
    decoder = msgspec.json.Decoder(kind)
    out = []
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                record = _decode_line(decoder, kind, line, f"{path}:{number}")
                if record is not None:
                    out.append(record)
    return out


def _decode_line(decoder: msgspec.json.Decoder, kind: Any, line: bytes, where: str) -> Any:
    try:
        return decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise _mismatch(where, kind, exc) from exc
    except msgspec.DecodeError:
        pass  # NaN/Infinity from json.dumps (lines written before these records), or a cut line
    try:
        values = json.loads(line)
    except ValueError:
        return None
    try:
        return msgspec.convert(values, kind, str_keys=True)  # str_keys: lag_histogram's "0" → 0, as the decoder does
    except msgspec.ValidationError as exc:
        raise _mismatch(where, kind, exc) from exc


def to_record(values: dict, kind: type[T]) -> T:
    """A writer's dict of values as `kind`, checked: an unknown, missing or mistyped field raises RecordError."""
    try:
        return msgspec.convert(values, kind)
    except msgspec.ValidationError as exc:
        raise RecordError(
            f"these values do not make a {kind.__name__}: {exc}; add or rename the field in {kind.__name__} "
            "(inflight/wire/records.py) together with the code that writes it"
        ) from exc


def _mismatch(where: str, kind: Any, exc: msgspec.ValidationError) -> RecordError:
    name = getattr(kind, "__name__", None) or " | ".join(t.__name__ for t in kind.__args__)
    return RecordError(
        f"{where}: not a {name} line: {exc}. Writer and reader disagree: read it with the inflight version that "
        f"wrote it, or update {name} in inflight/wire/records.py together with its writer"
    )
