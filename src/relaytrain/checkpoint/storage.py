"""DCP data files at the disk's speed: raw tensor bytes, several writer threads, a checksum while writing.

torch's ``FileSystemWriter`` runs ``torch.save`` (a pickle and a zip record) for every tensor from one
thread, and its reader ``torch.load``s every tensor into a fresh buffer before copying it into place.
`RawWriter` keeps DCP's planning, metadata and file naming (so resharding to any world size and layout
works as before) and replaces only how the bytes go to disk: each rank's items are split into
`thread_count` files written in parallel, every tensor as its contiguous bytes in one ``write`` (no
pickle, no copy), and each file's checksum (checksums.Checksum) is computed over the bytes as they are
written, so the COMPLETE
manifest needs no second read. Tensor entries carry the transform descriptor `RAW` in ``.metadata``;
torch's own reader refuses them (unknown extension) instead of misreading them.

`RawReader` reads such files with ``readinto`` straight into the tensors being loaded where a saved chunk
maps onto one contiguous target (the common same-layout resume), else into one scratch buffer that is
narrowed and copied (resharding). A file read from its first byte to its last has its checksum computed on
the way and compared with the manifest before any non-tensor entry from it is unpickled; a mismatch
raises `ChecksumMismatch`. Files written by torch's writer (older checkpoints) are read the stock way.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import queue
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from relaytrain.checkpoint.checksums import Checksum
from relaytrain.checkpoint.host import DeviceCopy, HostStage, on_host
from relaytrain.errors import UserError
from relaytrain.job import marks
from relaytrain.torch_private import narrow_tensor_by_index, split_write_items, storage_info

RAW = "relaytrain-raw-v1"  # transform descriptor of a tensor stored as its bare bytes
WRITER_THREADS = 2


class ChecksumMismatch(UserError):
    """A data file's content differs from the checksum its COMPLETE manifest recorded."""


class RawWriter(dcp.FileSystemWriter):
    """DCP storage writer for raw tensor bytes; `checksums` holds file name -> checksum after the write."""

    def __init__(
        self,
        path: str | os.PathLike,
        thread_count: int = WRITER_THREADS,
        stages: list[HostStage] | None = None,
    ):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=thread_count)
        self.checksums: dict[str, str] = {}
        # host buffers for tensors off the host, one per writer thread (pass the same list to every save
        # to reuse them: pinned allocations are slow)
        self.stages = stages if stages is not None else [HostStage() for _ in range(thread_count)]

    def write_data(self, plan, planner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        buckets = [b for b in split_write_items(self.thread_count, plan.items) if b] or [[]]
        names = [f"{prefix}{i}{DEFAULT_SUFFIX}" for i in range(len(buckets))]
        with ThreadPoolExecutor(len(buckets), thread_name_prefix="relaytrain-ckpt-write") as pool:
            stages = self.stages[: len(names)]
            parts = list(pool.map(self._write_file, names, buckets, [planner] * len(names), stages))
        done: Future[list[WriteResult]] = Future()
        done.set_result([r for part in parts for r in part])
        return done

    def _write_file(self, name: str, items: list, planner, stage: HostStage) -> list[WriteResult]:
        results, checksum, offset = [], Checksum(), 0
        entries = ((item, planner.resolve_data(item)) for item in items)
        # each thread writes its file alongside the others: a tensor's share of the save's estimate is its
        # share of this file (progress marked per tensor written, ``job/marks.py``)
        total = sum(_item_bytes(item) for item in items) or 1
        with open(Path(self.path) / name, "wb") as f:
            # host tensors as they are; device tensors copied to the host buffer a fill at a time
            for batch in stage.batches(entries):
                for item, buf in batch:
                    f.write(buf)  # file writes and the checksum release the GIL: the threads overlap
                    checksum.update(buf)
                    raw = None if item.type == WriteItemType.BYTE_IO else [RAW]
                    info = storage_info(name, offset, len(buf), transform_descriptors=raw)
                    results.append(WriteResult(index=item.index, size_in_bytes=len(buf), storage_data=info))
                    offset += len(buf)
                    marks.mark(share=len(buf) / total)
            f.flush()
            os.fsync(f.fileno())
        self.checksums[name] = checksum.text()
        return results


def _item_bytes(item) -> int:
    """A write item's bytes (a tensor's shape and dtype; a pickled entry counts as small)."""
    data = getattr(item, "tensor_data", None)
    if data is None:
        return 1
    return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize


class LiveStager(AsyncStager):
    """Async "staging" of state that is already in host memory: none. The background write reads the live
    tensors; the caller must not change them in place until that rank's write is done (CheckpointManager
    makes its optimizers' next step wait for it). Saves a full host copy of the state, in memory and time.
    """

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def close(self) -> None:
        pass


def _read_exact(f, offset: int, buf: memoryview, name: str) -> None:
    f.seek(offset)
    done = 0
    while done < len(buf):
        n = f.readinto(buf[done:])
        if not n:
            raise UserError(
                f"checkpoint file {name} ends at byte {offset + done}, before the {len(buf)}-byte entry at "
                f"{offset}; it is truncated: resume from an older checkpoint"
            )
        done += n


class RawReader(dcp.FileSystemReader):
    """DCP storage reader for `RawWriter` files (and torch's, the stock way).

    `expected`: file name -> checksum from the manifest (a file it does not list is not compared); None:
    no checksum is computed at all (`checkpoint.verify = false`). After `read_data`, `verified` names the
    files read whole whose checksum matched (or had none to compare); empty when `expected` is None."""

    def __init__(
        self,
        path: str | os.PathLike,
        expected: dict[str, str] | None = None,
        threads: int = 2,
        copy: DeviceCopy | None = None,
    ):
        super().__init__(path)
        self.copy = copy or DeviceCopy()
        self._stages: queue.SimpleQueue[HostStage] = queue.SimpleQueue()  # host buffers, one per thread
        self.checking = expected is not None
        self.expected = dict(expected or {})
        self.threads = threads
        self.verified: set[str] = set()
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.Size, torch.dtype]] = {}

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks = {
            (fqn, tuple(chunk.offsets)): (chunk.sizes, md.properties.dtype)
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
            for chunk in md.chunks
        }

    def _is_legacy(self, req) -> bool:
        info = self.storage_data[req.storage_index]
        return req.type != LoadItemType.BYTE_IO and RAW not in (info.transform_descriptors or ())

    def read_data(self, plan, planner) -> Future[None]:
        legacy = [r for r in plan.items if self._is_legacy(r)]
        if legacy:
            super().read_data(dataclasses.replace(plan, items=legacy), planner)
        per_file: dict[str, list] = {}
        for req in plan.items:
            if not self._is_legacy(req):
                per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        workers = max(1, min(self.threads, len(per_file)))
        with ThreadPoolExecutor(workers, thread_name_prefix="relaytrain-ckpt-read") as pool:
            list(pool.map(lambda kv: self._read_file(*kv, planner), per_file.items()))
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, name: str, reqs: Iterable, planner) -> None:
        stage = self._stages.get() if not self._stages.empty() else HostStage(self.copy)
        try:
            self._read_entries(name, reqs, planner, stage)
        finally:
            stage.settle()  # every copy to a device has finished before the load returns
            self._stages.put(stage)

    def _read_entries(self, name: str, reqs: Iterable, planner, stage: HostStage) -> None:
        groups: dict[Any, list] = {}
        for req in reqs:
            groups.setdefault(req.storage_index, []).append(req)
        entries = sorted(groups.items(), key=lambda kv: self.storage_data[kv[0]].offset)
        deferred_bytes = []  # unpickled only once the whole file's checksum is known to match
        covered = 0  # bytes read from the start without a gap (-1 after a gap)
        checksum = self._checksum_for(name) if self.checking else None
        with open(Path(self.path) / name, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for index, group in entries:
                info = self.storage_data[index]
                if info.offset + info.length > size:
                    raise UserError(
                        f"checkpoint file {name} has {size} bytes but its entry {index.fqn} ends at byte "
                        f"{info.offset + info.length}; it is truncated: resume from an older checkpoint"
                    )
                if group[0].type == LoadItemType.BYTE_IO:
                    buf = memoryview(bytearray(info.length))
                    _read_exact(f, info.offset, buf, name)
                    deferred_bytes += [(req, buf) for req in group]
                else:
                    buf = self._read_tensor(f, name, index, info, group, planner, stage)
                marks.mark(share=info.length / size if size else None)  # per tensor read
                if checksum is None:
                    continue
                if covered == info.offset:
                    checksum.update(buf)
                    covered += info.length
                else:
                    covered = -1
        whole = checksum is not None and covered == size
        if whole and self.expected.get(name, checksum.text()) != checksum.text():
            raise ChecksumMismatch(
                f"checkpoint file {name} does not match its checksum (its content changed after the save)"
            )
        if whole:
            self.verified.add(name)
        for req, buf in deferred_bytes:
            planner.load_bytes(req, io.BytesIO(buf.tobytes()))

    def _checksum_for(self, name: str) -> Checksum:
        try:
            return Checksum.like(self.expected.get(name))
        except ValueError:
            raise ChecksumMismatch(
                f"checkpoint file {name} has a checksum of a kind this relaytrain does not know "
                f"({self.expected[name].partition(':')[0]!r}); resume from another checkpoint"
            ) from None

    def _read_tensor(self, f, name: str, index, info, group: list, planner, stage: HostStage) -> memoryview:
        sizes, dtype = self._chunks[(index.fqn, tuple(index.offset))]
        target = planner.resolve_tensor(group[0]).detach() if len(group) == 1 else None
        whole_chunk = len(group) == 1 and all(o == 0 for o in group[0].storage_offsets)
        direct = (  # read straight into the target: a host tensor that is the whole saved chunk
            target is not None
            and on_host(target)
            and whole_chunk
            and list(group[0].lengths) == list(sizes)
            and target.is_contiguous()
            and target.dtype == dtype
            and target.numel() * target.element_size() == info.length
        )
        if direct:
            dest = target
        else:  # into host memory, then narrowed and copied to the targets (on the device or the host)
            numel = 1
            for n in sizes:
                numel *= n
            dest = stage.scratch(numel * dtype.itemsize).view(dtype).view(sizes)
        buf = memoryview(dest.reshape(-1).view(torch.uint8).numpy())
        if len(buf) != info.length:
            raise UserError(
                f"checkpoint file {name}: entry {index.fqn} has {info.length} bytes, its metadata says "
                f"{len(buf)}; the checkpoint is damaged"
            )
        _read_exact(f, info.offset, buf, name)
        for req in group:
            if direct:
                planner.commit_tensor(req, target)
                continue
            piece = narrow_tensor_by_index(dest, req.storage_offsets, req.lengths)
            into = planner.resolve_tensor(req).detach()
            if into.size() != piece.size():
                raise UserError(
                    f"checkpoint file {name}: entry {index.fqn} has shape {list(piece.size())} where the "
                    f"model needs {list(into.size())}; the checkpoint does not fit this model"
                )
            stage.to_device(into, piece)
            planner.commit_tensor(req, into)
        return buf
