"""Device tensors to and from host memory for checkpoint files and snapshots (one owner of the staging).

Files are written from host memory (``.numpy()`` works on host tensors only) and read into it. A tensor
on an accelerator passes through a reused host buffer: pinned (page-locked) when CUDA is present, so
every device-to-host copy is a DMA issued without waiting (``non_blocking=True``), and one stream
synchronisation per buffer fill makes all of them visible before a byte of the buffer is read; the way
back, bytes read from a file into the buffer are copied to the device without waiting and the buffer is
reused only after a synchronisation. Host tensors are never copied: their own bytes are written, and a
load reads straight into them.

`DeviceCopy` holds the steps that depend on the device (allocation, the two copies, the
synchronisation); tests replace it to run the device branch without an accelerator.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from typing import Any

import torch

ALIGN = 64  # every tensor's bytes start at a multiple of this in a host buffer (any dtype's alignment)
STAGE_BYTES = 128 << 20  # host buffer per writer/reader thread; a larger tensor grows it


def on_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


def host_bytes(data: torch.Tensor | io.BytesIO) -> memoryview:
    """The bytes of a host tensor (contiguous copy if it is strided) or of a BytesIO, without a copy."""
    if isinstance(data, io.BytesIO):
        return data.getbuffer()
    tensor = data.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def nbytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class DeviceCopy:
    """The device-dependent steps. `pin`: page-locked host buffers and copies that do not wait (default:
    when CUDA is available; pinned memory needs it)."""

    def __init__(self, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin

    def empty(self, nbytes: int, pin: bool = True) -> torch.Tensor:
        """A host buffer; pinned when `pin` and this copier pins (`pin=False`: only host tensors use it)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin and pin)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Start copying device tensor `src` into host tensor `dst` (same dtype and shape)."""
        dst.copy_(src, non_blocking=self.pin)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Start copying host tensor `src` into device tensor `dst`."""
        dst.copy_(src, non_blocking=self.pin)

    def synchronize(self, devices: Iterable[torch.device]) -> None:
        """Wait until every copy started on these devices' current streams has finished."""
        for device in devices:
            torch.get_device_module(device.type).current_stream(device).synchronize()


class HostStage:
    """One reused host buffer that device tensors pass through (one per thread: not thread-safe)."""

    def __init__(self, copy: DeviceCopy | None = None, capacity: int = STAGE_BYTES):
        self.copy = copy or DeviceCopy()
        self.capacity = capacity
        self._buffer: torch.Tensor | None = None
        self._used = 0
        self._devices: set[torch.device] = set()

    def _take(self, nbytes: int) -> torch.Tensor | None:
        """`nbytes` of the buffer, or None when they do not fit behind what it holds (settle first)."""
        size = aligned(nbytes)
        if self._used and self._used + size > max(self.capacity, len(self._buffer)):
            return None
        if self._buffer is None or size > len(self._buffer):
            self._buffer = self.copy.empty(max(self.capacity, size))  # an empty buffer may be replaced
        start, self._used = self._used, self._used + size
        return self._buffer[start : start + nbytes]

    def settle(self) -> None:
        """Wait for every copy in flight; the whole buffer is free again afterwards."""
        if self._devices:
            self.copy.synchronize(sorted(self._devices, key=str))
        self._devices.clear()
        self._used = 0

    def batches(self, entries: Iterable[tuple[Any, Any]]) -> Iterator[list[tuple[Any, memoryview]]]:
        """For (key, tensor or BytesIO) entries: lists of (key, bytes) in the same order. A device tensor's
        bytes lie in the buffer, copied and synchronised; they stay valid until the next list is asked for.
        """
        batch: list[tuple[Any, memoryview]] = []
        for key, data in entries:
            if isinstance(data, io.BytesIO) or on_host(data):
                batch.append((key, host_bytes(data)))
                continue
            tensor = data.detach()
            room = self._take(nbytes_of(tensor))
            if room is None:
                self.settle()
                yield batch
                batch = []
                room = self._take(nbytes_of(tensor))
            if tensor.numel():
                self.copy.to_host(room.view(tensor.dtype).view(tensor.shape), tensor)
                self._devices.add(tensor.device)
            batch.append((key, memoryview(room.numpy())))
        self.settle()
        yield batch

    def scratch(self, nbytes: int) -> torch.Tensor:
        """Host bytes to read a file's entry into; copies from earlier scratch space are waited for first
        when the buffer is full."""
        room = self._take(nbytes)
        if room is None:
            self.settle()
            room = self._take(nbytes)
        return room

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host `src` (scratch space) into `dst`; on a device without waiting (`settle` before the
        scratch space is reused: `scratch` and the end of a read do)."""
        if on_host(dst):
            dst.copy_(src)
            return
        self.copy.to_device(dst, src)
        self._devices.add(dst.device)
