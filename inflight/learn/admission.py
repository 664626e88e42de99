"""ServeCheck: whether a serve that says Hello can take this learner's updates and samples under its run contract.

Called by `inflight/learn/membership.py:Membership` on every `Hello` (as its `check`): the serve's tensors (name, dtype,
shape) against what the learner sends, then its `RunContract` (group size, temperature, top-p/top-k, compute dtype)
against what the learner trains for; on an `Ask` (a serve whose engine has not started yet), the contract alone. The
answer is '' or the first mismatch in words, which the serve receives in `Refused` before any bucket moves
(docs/ARCHITECTURE.md "Channels").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from inflight.wire.contract import ADAPTER_FIELDS, RunContract
from inflight.wire.control import Ask, Hello
from inflight.wire.weights import DTYPES

log = logging.getLogger("inflight.learn")

TensorLayout = dict[str, tuple[str, list[int]]]  # name -> (dtype, shape), in the learner's order


class ServeCheck:
    """What this learner sends (`expected`) and trains for (`contract`); either None = not checked (unit tests)."""

    def __init__(self) -> None:
        self.expected: TensorLayout | None = None
        self.contract: RunContract | None = None
        self._head_warned: set[str] = set()  # serves warned about a differing LM head precision (once each)

    def set_model(self, state: Mapping[str, torch.Tensor], contract: RunContract | None = None) -> None:
        """What this learner sends and (with `contract`) trains for; serves announcing anything else are refused."""
        self.expected = {n: (str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in state.items()}
        self.contract = contract

    def __call__(self, hello: Hello | Ask) -> str:
        """'' if the serve's tensors can take the learner's update and its contract is the learner's, else the first
        mismatch in words (the model first: a serve of another model is that, whatever its contract says). An `Ask`
        has no tensors yet: its contract alone."""
        if isinstance(hello, Ask):
            return self._contract_mismatch(hello)
        problem = self._contract_mismatch(hello, ADAPTER_FIELDS) or self._tensor_mismatch(hello)
        problem = problem or self._contract_mismatch(hello)
        if not problem and self.contract is not None and hello.contract is not None:
            warning = hello.contract.head_warning(self.contract, hello.server_id)
            if warning and hello.server_id not in self._head_warned:
                self._head_warned.add(hello.server_id)
                log.warning("%s", warning)
        return problem

    def _contract_mismatch(self, hello: Hello | Ask, fields: tuple[str, ...] = ()) -> str:
        if self.contract is None:
            return ""
        if hello.contract is None:
            return f"serve {hello.server_id} announced no run contract (group size, temperature, dtype) to check"
        return hello.contract.mismatch(self.contract, hello.server_id, fields)

    def _tensor_mismatch(self, hello: Hello) -> str:
        if self.expected is None:
            return ""
        served = {t.name: (t.dtype, list(t.shape)) for t in hello.tensors}
        for name, (_, shape) in self.expected.items():
            if name not in served:
                other = "another --lora-targets" if ".lora_" in name else "different model"
                return f"the learner's tensor {name!r} is not served by {hello.server_id} ({other}?)"
            if list(served[name][1]) != list(shape):
                return f"tensor {name}: learner shape {list(shape)}, serve {hello.server_id} has {served[name][1]}"
            if served[name][0] not in DTYPES:
                return f"tensor {name}: serve dtype {served[name][0]!r} cannot be sent"
        extra = sorted(set(served) - set(self.expected))
        return f"serve {hello.server_id} has tensor {extra[0]!r} the learner does not train" if extra else ""
