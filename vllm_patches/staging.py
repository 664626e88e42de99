"""StagedUpdate: one weight update being received, off the engine thread, into buffers outside the model.

Owned by the worker extension. `start()` returns at once; a daemon thread receives every bucket over the weights group,
then views and verifies every tensor (size, CRC32). Forward passes keep running the whole time because nothing here
touches the live parameters; only `worker_extension.commit_staged` does, between two engine steps.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from enum import Enum

import torch

from inflight.wire.group import WeightsGroup
from inflight.wire.transfer import receive_update
from inflight.wire.weights import UpdateManifest, unpack_buckets


class StageState(str, Enum):
    RECEIVING = "receiving"
    STAGED = "staged"
    FAILED = "failed"
    COMMITTED = "committed"


class StagedUpdate:
    """Receives `manifest`'s buckets from `group` on a background thread and holds the verified tensors."""

    def __init__(self, manifest: UpdateManifest, group: WeightsGroup, device: torch.device | str = "cpu"):
        self.manifest, self.group, self.device = manifest, group, device
        self.state = StageState.RECEIVING
        self.error: str | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.bytes_received = 0
        self.started = time.perf_counter()
        self.started_at = time.time()  # wall clock, comparable with the client's token timestamps
        self.staged_at = 0.0
        self.receive_s = self.verify_s = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"inflight-stage-v{manifest.version}", daemon=True)

    def start(self) -> StagedUpdate:
        self._thread.start()
        return self

    def _count(self, index: int, nbytes: int) -> None:
        self.bytes_received += nbytes
        _maybe_stall(index, self.manifest.version)

    def _run(self) -> None:
        try:
            buckets = receive_update(self.group, self.manifest, self.device, on_bucket=self._count)
            self.receive_s = time.perf_counter() - self.started
            self.tensors = unpack_buckets(self.manifest, buckets, verify=True)
            self.verify_s = time.perf_counter() - self.started - self.receive_s
            self.staged_at = time.time()
            self.state = StageState.STAGED
        except Exception as exc:  # any failure must surface as a status, never kill the worker
            self.error = f"{type(exc).__name__}: {exc}"
            self.tensors = {}
            self.state = StageState.FAILED
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def status(self) -> dict:
        return {
            "version": self.manifest.version,
            "state": self.state.value,
            "error": self.error,
            "bytes_received": self.bytes_received,
            "bytes_total": self.manifest.total_bytes,
            "receive_s": self.receive_s,
            "verify_s": self.verify_s,
            "started_at": self.started_at,
            "staged_at": self.staged_at,
        }


def _maybe_stall(index: int, version: int) -> None:
    """Fault injection for tests, off unless INFLIGHT_FAULT_RECEIVE_STALL="<bucket>:<seconds>[:<version>]" is set:
    after receiving that bucket of any update (or only of that version), hold the transfer for that long, so a test
    can kill this serve or cut its link mid-transfer on cue."""
    spec = os.environ.get("INFLIGHT_FAULT_RECEIVE_STALL", "")
    if not spec:
        return
    bucket, seconds, *only = spec.split(":")
    if index == int(bucket) and (not only or int(only[0]) == version):
        print(f"inflight fault injection: stalling the receive of v{version} after bucket {index} for {seconds}s",
              file=sys.stderr, flush=True)  # fmt: skip
        time.sleep(float(seconds))
