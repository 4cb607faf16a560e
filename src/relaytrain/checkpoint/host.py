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

Snapshots copy off the step's critical path (`copy_to_host`): on CUDA the copies run on a side stream that
first waits for an event recorded on the device's current stream (everything queued before: the optimizer
step), and end in an event of their own. The host only launches them. Whoever reads the host buffer waits
for that event (`wait`); whoever is about to change the copied tensors (the next optimizer step) makes the
device's stream wait for it when it has not fired yet (`hold_back`), so the copy runs beside the next
step's forward and backward and the host never waits. Without CUDA the copies run on the current stream,
ordered by the stream itself, and `wait` synchronises it.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
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


@dataclass
class InFlight:
    """Device-to-host copies started by `DeviceCopy.copy_to_host` and not yet waited for."""

    devices: list[torch.device]
    events: list[Any] = field(default_factory=list)  # CUDA: one per device, fired when its copies are done
    sources: list[torch.Tensor] = field(default_factory=list)  # kept alive (and unfreed) until then


class DeviceCopy:
    """The device-dependent steps. `pin`: page-locked host buffers and copies that do not wait (default:
    when CUDA is available; pinned memory needs it)."""

    def __init__(self, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._side: dict[torch.device, Any] = {}  # CUDA: the snapshot copies' stream per device

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

    # -- copies beside the next step (snapshots) -------------------------------------------------------

    def copy_to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> InFlight:
        """Start copying each device tensor `src` into its host tensor `dst`, after the work already queued
        on the sources' devices; returns at once. Read `dst` only after `wait`; change a `src` only after
        `hold_back` (or `wait`)."""
        devices = sorted({src.device for _, src in pairs}, key=str)
        flight = InFlight(devices, sources=[src for _, src in pairs])
        if not (self.pin and all(d.type == "cuda" for d in devices)):
            for dst, src in pairs:  # on the current stream: ordered after the step by the stream itself
                self.to_host(dst, src)
            return flight
        for device in devices:
            side = self._side.get(device)
            if side is None:
                side = self._side[device] = torch.cuda.Stream(device)
            after_step = torch.cuda.current_stream(device).record_event()
            side.wait_event(after_step)
            with torch.cuda.stream(side):
                for dst, src in pairs:
                    if src.device == device:
                        dst.copy_(src, non_blocking=True)
            flight.events.append(side.record_event())
        return flight

    def finished(self, flight: InFlight) -> bool:
        """Whether the copies are done (without waiting); unknown without CUDA events: False."""
        if not flight.devices:
            return True
        return bool(flight.events) and all(event.query() for event in flight.events)

    def wait(self, flight: InFlight) -> None:
        """Block the calling thread until the copies are done (then their host tensors may be read)."""
        if flight.events:
            for event in flight.events:
                event.synchronize()
        elif flight.devices:
            self.synchronize(flight.devices)
        flight.sources = []

    def hold_back(self, flight: InFlight) -> None:
        """Make what is queued next on the sources' devices (the optimizer step) wait for the copies; the
        host does not wait. Without CUDA events the copies are on the current stream: already ordered."""
        for device, event in zip(flight.devices, flight.events, strict=False):
            torch.cuda.current_stream(device).wait_event(event)


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
