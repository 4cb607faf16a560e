"""One rank's snapshot as bytes: a JSON header, then every tensor's raw bytes. Reading it runs no code.

Layout: ``RLTSNAP1`` (8 bytes), the header's length (8 bytes, little endian), the header (UTF-8 JSON),
then the tensor bytes, each at a 64-byte aligned offset from the start of the data. The header holds
the state tree with every tensor replaced by ``{"__tensor__": i}`` and a table of (dtype, shape,
offset, nbytes). Dicts are written as ``{"__dict__": [[key, value], ...]}`` (keys may be ints) and
tuples as ``{"__tuple__": [...]}``; anything else than these, tensors, lists, str, int, float, bool and
None is refused when writing, and a header naming anything else is refused when reading.

`Staging` keeps one host buffer for a rank's tensors, allocated once per run (`reserve`: in the background
at start-up, sized from the state) and reused for every snapshot it holds (the usual case: the layout is
fixed once the optimizer has state); only a larger state allocates again. Host tensors are copied into it
at once. Tensors off the host (a GPU) are copied into a pinned buffer by copies the host only launches
(checkpoint.host.DeviceCopy.copy_to_host: a side stream, ordered after the optimizer step): a `Staged`
snapshot is read only after `Staged.wait`, and the tensors it copies change only after
`Staged.hold_back`, which the next optimizer step calls (only when the copies are still running).
"""

from __future__ import annotations

import json
import logging
import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from relaytrain.checkpoint.host import DeviceCopy, InFlight

log = logging.getLogger("relaytrain.checkpoint")

MAGIC = b"RLTSNAP1"
_ALIGN = 64  # part of the file format
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


class SnapshotFormatError(ValueError):
    """The bytes are not a snapshot this relaytrain wrote (damaged, truncated, or something else)."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; a plain tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if to_local is not None else tensor).detach()


def _encode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(_local(value))
        return {"__tensor__": len(tensors) - 1}
    if isinstance(value, dict):
        return {"__dict__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"a snapshot cannot hold a {type(value).__name__}")


def _decode(node: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if isinstance(node, dict):
        if set(node) == {"__tensor__"}:
            return tensors[node["__tensor__"]]
        if set(node) == {"__tuple__"}:
            return tuple(_decode(v, tensors) for v in node["__tuple__"])
        if set(node) == {"__dict__"}:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in node["__dict__"]}
        raise SnapshotFormatError(f"unknown entry {sorted(node)[:3]} in the header")
    return node


def layout_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the tensor data of a snapshot holding `tensors` (each at an aligned offset)."""
    return sum(-(-(t.numel() * t.element_size()) // _ALIGN) * _ALIGN for t in tensors)


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """The tensors of a state tree as a snapshot holds them (a DTensor's local shard)."""
    tensors: list[torch.Tensor] = []
    _encode(tree, tensors)
    return tensors


@dataclass
class Staged:
    """A snapshot held in host memory, ready to be written once its copies are done (`wait`): header bytes
    and the tensor data."""

    header: bytes
    data: torch.Tensor  # uint8, in the staging buffer (shared with the next snapshot: write it before then)
    copies: InFlight | None = None  # device-to-host copies still in flight
    copy: DeviceCopy | None = None

    @property
    def size(self) -> int:
        return len(self.header) + self.data.numel()

    def finished(self) -> bool:
        """Whether every copy into `data` is done (without waiting)."""
        copies = self.copies
        return copies is None or self.copy.finished(copies)

    def wait(self) -> None:
        """Block until every copy into `data` is done (before any byte of it is read)."""
        copies = self.copies
        if copies is not None:
            self.copy.wait(copies)
            self.copies = None

    def hold_back(self) -> bool:
        """Before the copied tensors change (the next optimizer step): when the copies still run, the
        device's next work waits for them (the host does not). Whether they were still running."""
        copies = self.copies
        if copies is None or self.copy.finished(copies):
            return False
        self.copy.hold_back(copies)
        return True

    def chunks(self) -> list[memoryview]:
        self.wait()
        return [memoryview(self.header), memoryview(self.data.numpy())]


class Staging:
    """Copies a state tree into one reusable host buffer (what a snapshot blocks the step for: the host
    copies and the launch of the device copies)."""

    def __init__(self, copy: DeviceCopy | None = None):
        self.copy = copy or DeviceCopy()
        self._buffer: torch.Tensor | None = None
        self._pinned = False
        self._reserving: threading.Thread | None = None
        self._reserved: tuple[torch.Tensor, bool] | None = None
        self.allocations = 0  # host buffers allocated (one per run while the state keeps its size)

    def reserve(self, nbytes: int, pin: bool) -> None:
        """Allocate the buffer for a state of `nbytes` in the background (pinning gigabytes takes seconds);
        the first `stage` takes it, waiting for it if it is not ready."""
        if self._reserving is not None or (self._buffer is not None and len(self._buffer) >= nbytes):
            return

        def allocate() -> None:
            try:
                self._reserved = (self._allocate(nbytes, pin), pin)
            except (RuntimeError, MemoryError) as exc:  # the first snapshot allocates instead
                log.warning("could not allocate the snapshot buffer (%d bytes) at start-up: %s", nbytes, exc)

        self._reserving = threading.Thread(target=allocate, name="relaytrain-snapshot-alloc", daemon=True)
        self._reserving.start()

    def _allocate(self, nbytes: int, pin: bool) -> torch.Tensor:
        self.allocations += 1
        return self.copy.empty(nbytes, pin=pin)

    def _room(self, nbytes: int, pin: bool) -> torch.Tensor:
        """`nbytes` of the buffer: the reserved one, the one in use, or (too small) a new one."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
            if self._reserved is not None:
                (self._buffer, self._pinned), self._reserved = self._reserved, None
        if self._buffer is None or len(self._buffer) < nbytes or (pin and not self._pinned):
            # pinned only for tensors off the host (page-locking gigabytes for a CPU run costs memory)
            self._buffer, self._pinned = None, False  # the old one goes before the new one is allocated
            self._buffer, self._pinned = self._allocate(nbytes, pin), pin
        return self._buffer[:nbytes]

    def stage(self, tree: Any, meta: dict[str, Any]) -> Staged:
        """Copy `tree`'s tensors into the buffer: host tensors at once, device tensors by copies started
        here (`Staged.wait` before reading it). The buffer must hold no snapshot still to be written."""
        tensors: list[torch.Tensor] = []
        encoded = _encode(tree, tensors)
        table, offset = [], 0
        for t in tensors:
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise TypeError(f"a snapshot cannot hold a {dtype} tensor")
            nbytes = t.numel() * t.element_size()
            table.append({"dtype": dtype, "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
            offset += -(-nbytes // _ALIGN) * _ALIGN
        data = self._room(offset, pin=any(t.device.type != "cpu" for t in tensors))
        flat = data.numpy()
        on_device = []
        for entry, t in zip(table, tensors, strict=True):
            start, end = entry["offset"], entry["offset"] + entry["nbytes"]
            if not entry["nbytes"]:
                continue
            if t.device.type == "cpu":
                # numpy's copy: torch's copy_ wakes its thread pool for every tensor, 5-8 ms each on a
                # busy CPU (0.1 ms this way), which multiplied by hundreds of tensors was most of a step.
                source = t if t.is_contiguous() else t.contiguous()
                np.copyto(flat[start:end], source.reshape(-1).view(torch.uint8).numpy())
            else:
                on_device.append((data[start:end].view(t.dtype).view(t.shape), t))
        copies = self.copy.copy_to_host(on_device) if on_device else None  # launched, not waited for
        body = json.dumps({"meta": meta, "tree": encoded, "tensors": table}).encode()
        header = MAGIC + struct.pack("<Q", len(body)) + body
        return Staged(header, data, copies, self.copy)


def read_meta(blob: bytes | memoryview) -> dict[str, Any]:
    """The `meta` a snapshot was written with (step, rank, world size, ...), without its tensors."""
    return _header(blob)[0]["meta"]


def _header(blob) -> tuple[dict[str, Any], int]:
    view = memoryview(blob)
    if len(view) < 16 or bytes(view[:8]) != MAGIC:
        raise SnapshotFormatError("not a relaytrain snapshot (no RLTSNAP1 magic)")
    (length,) = struct.unpack("<Q", view[8:16])
    if 16 + length > len(view):
        raise SnapshotFormatError(f"the header claims {length} bytes but the file ends before")
    try:
        header = json.loads(bytes(view[16 : 16 + length]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotFormatError(f"unreadable header ({exc})") from None
    if not isinstance(header, dict) or not {"meta", "tree", "tensors"} <= set(header):
        raise SnapshotFormatError("the header lacks meta, tree or tensors")
    return header, 16 + length


def decode(blob) -> tuple[dict[str, Any], Any]:
    """(meta, state tree) of a snapshot's bytes (any bytes-like object: bytes, a bytearray, a memoryview,
    a mapped file). Tensors are views of `blob` when it is writable (a bytearray, a writable memoryview or
    mapping: they share its memory), else of one writable copy of it."""
    header, start = _header(blob)
    buffer = blob if not memoryview(blob).readonly else bytearray(blob)
    size = len(buffer) - start
    tensors = []
    for entry in header["tensors"]:
        dtype = _DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise SnapshotFormatError(f"unknown tensor dtype {entry.get('dtype')!r}")
        offset, nbytes, shape = int(entry["offset"]), int(entry["nbytes"]), list(entry["shape"])
        if offset < 0 or offset + nbytes > size:
            raise SnapshotFormatError("a tensor lies past the end of the file (truncated)")
        numel = 1
        for dim in shape:
            numel *= int(dim)
        if numel * dtype.itemsize != nbytes:
            raise SnapshotFormatError(f"a tensor of shape {shape} cannot have {nbytes} bytes")
        if nbytes == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
            continue
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=start + offset)
        tensors.append(raw.view(dtype).view(shape))
    return header["meta"], _decode(header["tree"], tensors)
