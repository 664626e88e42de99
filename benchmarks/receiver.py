"""A weights receiver process that plays a serve's part on the weights path, without vLLM: for the benchmarks that
measure the learner's publish (benchmarks/publish_memory.py, benchmarks/gpu_learner.py) on machines with no engine.

It says `Hello` with the served tensors (and, for a real learner, the run contract it checks), joins every weights
group the learner forms, receives every update into fresh buffers on `device` (host memory for gloo, its GPU for
NCCL), unpacks and verifies it as a serve's staging thread does (checksums from the manifest, or from the trailer of a
streamed update), answers `UpdateDone`, and keeps the CRC32 of every tensor of every version. Told to stop through its
pipe, it sends back `{version: {name: crc32}}`.
"""

from __future__ import annotations

import multiprocessing as mp


def receive_updates(address: str, specs: list[tuple[str, str, list[int]]], conn, contract=None,
                    device: str = "cpu", server_id: str = "receiver@0") -> None:  # fmt: skip
    """The process body (a `spawn` target): `address` is the learner's control socket, `specs` the served tensors as
    (name, dtype, shape), `contract` a `RunContract` or None (a bare WeightPublisher checks none)."""
    import zmq

    from inflight.wire.checksum import tensor_checksum
    from inflight.wire.control import Hello, Joined, JoinGroup, TensorSpec, UpdateDone, UpdateWeights, decode_control
    from inflight.wire.control import encode_control as encode
    from inflight.wire.group import GroupAddress, WeightsGroup
    from inflight.wire.transfer import receive_update
    from inflight.wire.weights import UpdateManifest, unpack_buckets

    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(device)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(address)
    tensors = [TensorSpec(n, d, s) for n, d, s in specs]
    sock.send(encode(Hello(server_id=server_id, model="m", workers=1, version=0, tensors=tensors, contract=contract)))
    group, crcs = None, {}
    while not conn.poll():
        if not sock.poll(100):
            continue
        message = decode_control(sock.recv(), to="serve")
        if isinstance(message, JoinGroup):
            if group is not None:
                group.close()
            group = WeightsGroup(GroupAddress(message.host, message.port, message.world_size, message.group_name,
                                              message.backend, message.timeout_s), message.rank)  # fmt: skip
            sock.send(encode(Joined(server_id=server_id, group_name=message.group_name)))
        elif isinstance(message, UpdateWeights):
            manifest = UpdateManifest.decode(message.manifest)
            got = unpack_buckets(manifest, receive_update(group, manifest, device), verify=True)
            crcs[manifest.version] = {name: tensor_checksum(t, "crc32") for name, t in got.items()}
            sock.send(encode(UpdateDone(server_id=server_id, version=manifest.version)))
    conn.send(crcs)
    if group is not None:
        group.close()


class Receiver:
    """`receive_updates` in a spawned process; `stop()` returns what it received."""

    def __init__(self, address: str, specs: list[tuple[str, str, list[int]]], contract=None, device: str = "cpu"):
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self.proc = context.Process(target=receive_updates, args=(address, specs, child, contract, device),
                                    daemon=True)  # fmt: skip
        self.proc.start()

    def stop(self, timeout_s: float = 60.0) -> dict[int, dict[str, int]]:
        """{version: {name: crc32}} of every update received; {} if the process died."""
        if not self.proc.is_alive():
            return {}
        self._conn.send("stop")
        crcs = self._conn.recv() if self._conn.poll(timeout_s) else {}
        self.proc.join(timeout_s)
        return crcs
