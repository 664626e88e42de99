"""Arenas: buffers sized once by the staging plan (vllm_patches/device_plan.py) and reused by every update, so an
update can hold no more than the plan says and fails alone when it would.

Runs in the serve's worker process (vllm_patches/staging.py). Two kinds:
- `DeviceArena`: one device buffer staging carves its tensors from. A staging allocation through the caching allocator
  that fails makes the allocator free every cached block, the engine's included (`num_alloc_retries`), and the
  engine's next prefill then goes to cudaMalloc and may run out; an arena overflow is refused before any allocation.
- `HostArena`: the one page-locked host buffer a GPU worker keeps its live version's whole tensors in (the `low`
  path's rollback source, a delta's base).
- `ArenaTail`: the device arena around the tensors an update keeps, where the copy commit's preparation materialises
  its layers (dropped at the commit, so the next update may lay itself out over them): past the update's pieces, and
  over a delta's payloads once they are decoded.
- `ReusingTail`: `low`'s preparation (vllm_patches/staging.py): the layers are materialised from the arena's start
  over the staged tensors the loaders are done with, the update laid out at the arena's end, so an update holds its
  checkpoint-format tensors or their kernel-format replacements, never both (1x, and one layer of room ahead).
- `BesideBaseTail`: `low`'s preparation of an update a delta may follow, whose staged tensors are kept as the
  delta's base: an `ArenaTail` (beside them), in the room the plan with deltas keeps for a delta's decoded tensors.

Why not `torch.empty(..., pin_memory=True)` per update for the host copy: torch's CachingHostAllocator rounds every
block up to a power of two and never gives a block back to the system, and the copy of update v+1 is made while v's
still lives, so a worker pinned 2x the weights rounded up (a 7B model's 291 tensors: 30-45 GB per worker) while the
plan said 1x. The arena is one allocation of exactly its bytes,
page-locked with `cudaHostRegister` (no rounding, no cache), into which each update's tensors are copied at aligned
offsets; nothing else is pinned, so the figure the plan prints is the figure the worker holds.

`StagingArenas` is what a worker owns (vllm_patches/worker_extension.py): both arenas at their planned sizes
(vllm_patches/device_plan.py:StagingPlan.arena_bytes, host_arena_bytes), the device one made when the engine starts
and the host one once something is kept, then reused by every update. 1x holds because the host copy of v lands only
once v was kept on every rank: v stays in the device arena after its commit (the next update's rollback source and
delta base), and the next update's staging thread copies it into the host arena before it receives anything into the
device arena (vllm_patches/staging.py). On CPU both arenas are plain host memory and the same code runs.
`caching_allocator_bytes` is the model of the old behaviour that the tests and scripts/gpu_check.sh compare against.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from itertools import accumulate

import torch
from torch.overrides import TorchFunctionMode

ALIGN = 64  # bytes: every tensor starts on a cache line, and any dtype's alignment holds


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def free_gaps(kept: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The byte ranges from `start` to `end` that none of `kept` (sorted (start, end) ranges) covers, each beginning
    aligned: where the copy commit's layers may go. Tensors packed at aligned offsets leave no gap between them, so a
    whole update's kept tensors leave the arena's rest and a delta's leave its read payloads too: a few gaps."""
    gaps, at = [], start
    for lo, hi in kept:
        if lo > at:
            gaps.append((at, lo))
        at = max(at, _aligned(hi))
    return [*gaps, (at, end)] if end > at else gaps


class ArenaFull(RuntimeError):
    """An update's tensors do not fit the arena its plan sized: the update is refused, decoding goes on."""


class LayersOutgrewArena(ArenaFull):
    """`low`'s prepared layers reached staged tensors still to be read (`ReusingTail`): refused, and the worker
    reloads in place from the next update on (vllm_patches/worker_extension.py:reload_after_outgrown)."""


def arena_offsets(sizes: list[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Each tensor's offset in the arena, in order, and the arena's bytes: sizes laid end to end, each aligned."""
    offsets, end = [], 0
    for size in sizes:
        start = -(-end // align) * align
        offsets.append(start)
        end = start + size
    return offsets, -(-end // align) * align


def caching_allocator_bytes(sizes: list[int], copies_alive: int = 2) -> int:
    """Pinned bytes torch's CachingHostAllocator keeps for `copies_alive` per-tensor copies of `sizes`: each block
    rounded up to a power of two, and never released (the figure the arena replaces)."""
    return copies_alive * sum(1 << max(size - 1, 0).bit_length() for size in sizes)


class Arena:
    """`nbytes` of one buffer holding one update's (or one version's) tensors at a time, laid out by `arena_offsets`."""

    kind = "arena"

    def __init__(self, buffer: torch.Tensor):
        self.buffer, self.nbytes, self.pinned = buffer, buffer.numel(), False

    def views(self, tensors: dict[str, torch.Tensor], at_end: bool = False) -> dict[str, torch.Tensor]:
        """Views of the arena shaped and typed like `tensors`, laid out by `arena_offsets` from its start (`at_end`:
        shifted to end at its end, leaving its start free); ArenaFull beyond it."""
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        offsets, needed = arena_offsets(sizes)
        if needed > self.nbytes:
            raise ArenaFull(
                f"the update's {len(sizes)} pieces need {needed} bytes of {self.kind}, the plan sized {self.nbytes}: "
                "refused before any of it was kept, the engine serves on (a delta's decoded tensors come beside its "
                "payloads: the plan counts them when the learner says it sends deltas, its --full-every > 1)"
            )
        shift = (self.nbytes - needed) // ALIGN * ALIGN if at_end else 0
        return {
            name: self.buffer[shift + offset : shift + offset + size].view(t.dtype).view(t.shape)
            for (name, t), offset, size in zip(tensors.items(), offsets, sizes, strict=True)
        }

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lies in this arena's buffer."""
        start = self.buffer.data_ptr()
        return tensor.device == self.buffer.device and start <= tensor.data_ptr() < start + self.nbytes

    def empty(self, size: int) -> torch.Tensor:
        """One `size`-byte uint8 buffer (a bucket) from the arena's start; ArenaFull beyond it."""
        return self.views({"bucket": torch.empty(size, dtype=torch.uint8, device="meta")})["bucket"]

    def copy_in(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy `tensors` (any device) over whatever the arena held, waiting for the copies; returns the views."""
        views = self.views(tensors)
        for name, t in tensors.items():
            views[name].copy_(t.reshape(views[name].shape), non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.current_stream().synchronize()
        return views


class ArenaTail(TorchFunctionMode):
    """While active on a thread, every `torch.empty_strided` for the arena's device is served from `arena` past byte
    `start`, each at the lowest aligned offset where it overlaps nothing taken and none of `keep` (tensors of the
    arena that must survive: the update's verified tensors, which the commit keeps), ArenaFull beyond its end: the
    layers the copy commit's preparation materialises (vLLM's `materialize_meta_tensor` makes each with one such
    call), so they can hold no more than the plan set aside. Only for tensors dropped at the commit: the next update
    lays itself out over them. What `keep` leaves free besides the arena's rest was read already: a delta's payloads
    (decoded by then, on the same stream) and the trailer."""

    full_error: type[ArenaFull] = ArenaFull

    def __init__(self, arena: Arena, start: int, keep: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.arena, self.used = arena, _aligned(start)  # `used`: past the highest byte taken
        kept = [(t.data_ptr() - arena.buffer.data_ptr(), t.numel() * t.element_size()) for t in keep if arena.holds(t)]
        self._gaps = free_gaps(sorted((offset, offset + n) for offset, n in kept), self.used, arena.nbytes)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty_strided and self._same_device(kwargs.get("device")):
            return self.take(*args, **kwargs)
        return func(*args, **kwargs)

    def _same_device(self, device) -> bool:
        device = torch.device(device) if device is not None else torch.get_default_device()
        return device.type == self.arena.buffer.device.type

    def take(self, size, stride, *, dtype=None, **_) -> torch.Tensor:
        """A tensor of `size` and `stride` in the arena (uninitialised, as `empty_strided`'s)."""
        dtype = dtype or torch.get_default_dtype()
        extent = 1 + sum((n - 1) * st for n, st in zip(size, stride, strict=True)) if all(size) else 0
        nbytes = extent * dtype.itemsize
        gap = next((i for i, (lo, hi) in enumerate(self._gaps) if lo + nbytes <= hi), None)
        offset = self.arena.nbytes if gap is None else self._gaps[gap][0]
        if offset + nbytes > self.limit():
            raise self.full_error(self.full_message(nbytes))
        if gap is not None:  # None: an empty tensor with every gap used, at the arena's end
            self._gaps[gap] = (_aligned(offset + nbytes), self._gaps[gap][1])
        self.used = max(self.used, _aligned(offset + nbytes))
        return self.arena.buffer[offset : offset + nbytes].view(dtype).as_strided(tuple(size), tuple(stride))

    def limit(self) -> int:
        """The byte offset materialised layers may reach now."""
        return self.arena.nbytes

    def track(self, weights: Iterable[tuple[str, torch.Tensor]], buffered: Callable) -> Iterable:
        """`weights` as the loaders are to take them: here as they are (`ReusingTail` watches them)."""
        return weights

    def left(self) -> int:
        """Bytes still free: the gaps between the kept tensors and the arena's rest."""
        return sum(max(hi - lo, 0) for lo, hi in self._gaps)

    def full_message(self, nbytes: int) -> str:
        return (
            f"the update's prepared layers need more than the {self.left()} bytes of "
            f"{self.arena.kind} left beside its tensors (a tensor of {nbytes} bytes did not fit): refused, the "
            "engine serves on. The plan sets 1x the weights aside for them; a backend that pads its layers needs "
            "more: serve with --update-memory low"
        )


class BesideBaseTail(ArenaTail):
    """`low`'s prepared layers for an update a delta may follow (its manifest's `keep_base`): its verified tensors are
    the next delta's base, so the layers go beside them (`ArenaTail` stepping over them), in the room the plan with
    deltas has for a delta's decoded tensors. Outgrowing it is `LayersOutgrewArena`: the worker reloads in place from
    then on, as with `ReusingTail`."""

    full_error = LayersOutgrewArena

    def full_message(self, nbytes: int) -> str:
        return (
            f"the update's prepared layers need more than the {self.left()} bytes of "
            f"{self.arena.kind} left beside the tensors kept as the next delta's base (a tensor of {nbytes} bytes did "
            "not fit): refused, the engine serves on and reloads in place from the next update on"
        )


class ReusingTail(ArenaTail):
    """`low`'s prepared layers (vllm_patches/staging.py lays the update out at the arena's end): each is materialised
    from the arena's start, below every staged byte the loaders may still read. vLLM's layerwise loader buffers a
    layer's tensors until its last one arrives, then materialises the layer, loads, processes and drops them; so with
    the kernel format as large as the checkpoint's (unquantised weights) the layers stay one layer behind the tensors
    they replace, and the room the plan leaves ahead of the update is its largest layer.

    What may still be read: the tensors not handed to the loaders yet, the views `track` handed out that are still
    alive (a model's `load_weights` may hold one), and whatever tensors `buffered` names (the loaders' buffers, which
    may hold a tensor derived from a view, e.g. a transpose, that outlives the view itself)."""

    full_error = LayersOutgrewArena

    def __init__(self, arena: Arena):
        super().__init__(arena, 0)
        self._reading: dict[int, tuple[int, weakref.ref]] = {}  # views handed out and alive: their byte offsets
        self._ahead = arena.nbytes  # the lowest offset of the tensors not handed out yet
        self._buffered: Callable[[], Iterable[torch.Tensor]] = tuple

    def limit(self) -> int:
        start = self.arena.buffer.data_ptr()
        buffered = (t.data_ptr() - start for t in self._buffered() if self.arena.holds(t))
        return min([self._ahead, *(offset for offset, _ in self._reading.values()), *buffered])

    def track(
        self, weights: Iterable[tuple[str, torch.Tensor]], buffered: Callable[[], Iterable[torch.Tensor]] = tuple
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`weights` (tensors of this arena, in the order the loaders take them), each handed out as a view of its
        own; `buffered`: the tensors the loaders hold between calls."""
        items, self._buffered = list(weights), buffered
        start = self.arena.buffer.data_ptr()
        offsets = [t.data_ptr() - start if self.arena.holds(t) else self.arena.nbytes for _, t in items]
        ahead = [*list(accumulate(reversed(offsets), min))[::-1], self.arena.nbytes]
        for index, (name, tensor) in enumerate(items):
            view = tensor.view(tensor.shape)
            key = id(view)
            self._reading[key] = (offsets[index], weakref.ref(view, lambda _, key=key: self._reading.pop(key, None)))
            self._ahead = ahead[index + 1]
            yield name, view
            del view
        self._ahead = self.arena.nbytes

    def full_message(self, nbytes: int) -> str:
        return (
            f"the update's prepared layers reached the staged tensors the loaders still read (a tensor of {nbytes} "
            f"bytes did not fit below byte {self.limit()} of the {self.arena.nbytes}-byte {self.arena.kind}): "
            "refused, the engine serves on and reloads in place from the next update on. The plan leaves its largest "
            "layer's room ahead of the update: a backend whose kernel format outgrows the checkpoint's, or a model "
            "whose loader holds its tensors to the end, needs the in-place reload"
        )


class DeviceArena(Arena):
    """`nbytes` on `device`, allocated once (at start, before vLLM sizes its KV cache)."""

    kind = "device arena"

    def __init__(self, nbytes: int, device: str | torch.device):
        super().__init__(torch.empty(nbytes, dtype=torch.uint8, device=device))


class HostArena(Arena):
    """`nbytes` of host memory, page-locked when `pin` (a CUDA worker) with `cudaHostRegister`: exactly `nbytes`."""

    kind = "host arena"

    def __init__(self, nbytes: int, pin: bool):
        super().__init__(torch.empty(nbytes, dtype=torch.uint8))
        if pin and nbytes:
            code = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), nbytes, 0)
            if int(code) != 0:
                raise RuntimeError(f"cudaHostRegister of the {nbytes}-byte host arena failed with CUDA error {code}")
            self.pinned = True

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False


class StagingArenas:
    """A worker's device and host arenas at their planned bytes: the device one made now on `device` (on CUDA an
    allocation that fails fails at start, not at an update), the host one once something is kept."""

    def __init__(self, device_bytes: int, host_bytes: int, device: str | torch.device):
        self.host_bytes, self.device = host_bytes, torch.device(device)
        self.staging = DeviceArena(device_bytes, self.device)
        self._host: HostArena | None = None

    def hold(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` (in the device arena) copied into the host arena, over the version it held; views of it.
        Tensors already there are returned as they are. ArenaFull, copying nothing, when they do not fit."""
        if self._host is None:
            self._host = HostArena(self.host_bytes, pin=self.device.type == "cuda")
        if all(self._host.holds(t) for t in tensors.values()):
            return tensors
        return self._host.copy_in(tensors)

    def close(self) -> None:
        if self._host is not None:
            self._host.close()
        self._host = None
