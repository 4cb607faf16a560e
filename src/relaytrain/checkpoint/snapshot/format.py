"""One rank's snapshot as bytes: a JSON header, then every tensor's raw bytes. Reading it runs no code.

Layout: ``RLTSNAP1`` (8 bytes), the header's length (8 bytes, little endian), the header (UTF-8 JSON),
then the tensor bytes, each at a 64-byte aligned offset from the start of the data. The header holds
the state tree with every tensor replaced by ``{"__tensor__": i}`` and a table of (dtype, shape,
offset, nbytes). Dicts are written as ``{"__dict__": [[key, value], ...]}`` (keys may be ints) and
tuples as ``{"__tuple__": [...]}``; anything else than these, tensors, lists, str, int, float, bool and
None is refused when writing, and a header naming anything else is refused when reading.

`Staging` keeps one host buffer for a rank's tensors and reuses it for every snapshot whose tensor
layout is unchanged (the usual case): the copy into it is what blocks training; no page faults of a
fresh allocation each time. Off the host (a GPU), the buffer is pinned and every tensor's copy is issued
without waiting; one synchronisation after the last makes them all visible before the buffer is handed
to the thread that writes it (checkpoint.host.DeviceCopy).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from relaytrain.checkpoint.host import DeviceCopy

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


@dataclass
class Staged:
    """A snapshot held in host memory, ready to be written: header bytes and the tensor data."""

    header: bytes
    data: torch.Tensor  # uint8, the staging buffer (shared with the next snapshot: write it before then)

    @property
    def size(self) -> int:
        return len(self.header) + self.data.numel()

    def chunks(self) -> list[memoryview]:
        return [memoryview(self.header), memoryview(self.data.numpy())]


class Staging:
    """Copies a state tree into one reusable host buffer (the blocking part of a snapshot)."""

    def __init__(self, copy: DeviceCopy | None = None):
        self.copy = copy or DeviceCopy()
        self._buffer: torch.Tensor | None = None
        self._layout: list[tuple[str, tuple[int, ...]]] | None = None

    def stage(self, tree: Any, meta: dict[str, Any]) -> Staged:
        tensors: list[torch.Tensor] = []
        encoded = _encode(tree, tensors)
        layout = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors]
        table, offset = [], 0
        for (dtype, shape), t in zip(layout, tensors, strict=True):
            if dtype not in _DTYPES:
                raise TypeError(f"a snapshot cannot hold a {dtype} tensor")
            nbytes = t.numel() * t.element_size()
            table.append({"dtype": dtype, "shape": list(shape), "offset": offset, "nbytes": nbytes})
            offset += -(-nbytes // _ALIGN) * _ALIGN
        if self._buffer is None or layout != self._layout:
            # pinned only for tensors off the host (page-locking gigabytes for a CPU run costs memory)
            self._buffer = self.copy.empty(offset, pin=any(t.device.type != "cpu" for t in tensors))
            self._layout = layout
        flat = self._buffer.numpy()
        devices = set()
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
                self.copy.to_host(self._buffer[start:end].view(t.dtype).view(t.shape), t)
                devices.add(t.device)
        if devices:
            self.copy.synchronize(sorted(devices, key=str))  # the copies above did not wait
        body = json.dumps({"meta": meta, "tree": encoded, "tensors": table}).encode()
        header = MAGIC + struct.pack("<Q", len(body)) + body
        return Staged(header, self._buffer)


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
