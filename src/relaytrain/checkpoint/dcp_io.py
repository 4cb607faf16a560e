"""Reading torch.distributed.checkpoint (DCP) files without ever executing code from them.

torch's ``FileSystemReader`` reads ``.metadata`` with a plain ``pickle.load``, and its default load
planner reads non-tensor entries with ``torch.load(weights_only=False)``: a prepared checkpoint
directory could run any command as the user. Checkpoints get downloaded and shared, so every DCP read in
relaytrain goes through `load` / `read_metadata` here: ``.metadata`` is unpickled by an unpickler that
only builds the classes DCP metadata consists of, every data file it names must be a plain file name in
the checkpoint directory, and non-tensor entries are read with ``weights_only=True``. The data files
themselves are read by storage.RawReader (raw tensor bytes, checksummed on the way).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from relaytrain.checkpoint.storage import ChecksumMismatch, RawReader
from relaytrain.errors import UserError
from relaytrain.torch_private import set_state_element

DCP_METADATA = ".metadata"

# Every global a DCP .metadata pickle refers to, found by unpickling the metadata of plain, FSDP2,
# tensor-parallel, asynchronous and optimizer-holding saves with a recording unpickler (torch 2.13).
# Dtypes are checked by type below rather than listed.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # layout by name: torch.strided, torch.sparse_coo, ...
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UserError(
            f"relaytrain refuses to unpickle {module}.{name} from {self.source}: not a DCP metadata "
            "class (the checkpoint was tampered with or is not a torch.distributed.checkpoint); "
            "only load checkpoints from sources you trust"
        )


def _unsafe_name(name: Any) -> bool:
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        return True
    parts = PurePosixPath(name).parts
    return PurePosixPath(name).is_absolute() or len(parts) != 1 or parts[0] in (".", "..")


def read_metadata(step_dir: Path) -> Metadata:
    """The checkpoint's DCP metadata, read with the restricted unpickler and checked for confinement."""
    path = Path(step_dir) / DCP_METADATA
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(io.BytesIO(f.read()), path).load()
    except UserError:
        raise
    except Exception as exc:  # truncated or garbled pickles raise anything
        raise UserError(
            f"checkpoint {step_dir} has an unreadable {DCP_METADATA} file ({type(exc).__name__}); it is "
            "damaged: resume from an older one with --checkpoint.resume=<older step dir>"
        ) from None
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise UserError(f"{path} is not DCP metadata; the checkpoint is damaged or not a relaytrain one")
    safe: set[str] = set()  # a few distinct file names among thousands of entries: check each once
    for info in (meta.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if isinstance(name, str) and name in safe:
            continue
        if _unsafe_name(name):
            raise UserError(
                f"{path} names the data file {name!r}, which is not a file in the checkpoint directory; "
                "the checkpoint was tampered with: refusing to read it"
            )
        safe.add(name)
    return meta


class SafeReader(RawReader):
    """A RawReader whose metadata comes from `read_metadata` above (`metadata`: already read by it)."""

    def __init__(self, path: Path, expected: dict[str, str] | None = None, metadata: Metadata | None = None):
        super().__init__(path, expected)
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        meta, self.metadata = self.metadata or read_metadata(Path(self.path)), None
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class SafeLoadPlanner(DefaultLoadPlanner):
    """Reads non-tensor entries (optimizer hyper-parameters) with ``weights_only=True``."""

    def __init__(self, source: Path):
        super().__init__()
        self.source = source

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UserError(
                f"checkpoint {self.source} stores {read_item.dest_index.fqn} as a pickle that is not plain "
                "data; relaytrain refuses to unpickle it (the checkpoint was tampered with)"
            ) from None
        if self.flatten_state_dict:
            set_state_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load(
    state: dict[str, Any],
    step_dir: Path,
    *,
    process_group=None,
    no_dist: bool = True,
    expected: dict[str, str] | None = None,
) -> set[str]:
    """`dcp.load` of `state` from `step_dir` through the safe reader and planner (in place).

    `expected`: file -> checksum (the manifest's); a file this rank reads whole is compared with it, and
    a mismatch on any rank raises `ChecksumMismatch` on every rank. Returns the data files this rank read
    whole (and so checked)."""
    # read here: a refusal raised inside dcp.load would reach the caller wrapped and vague
    reader = SafeReader(step_dir, expected, read_metadata(step_dir))
    try:
        dcp.load(
            state,
            storage_reader=reader,
            planner=SafeLoadPlanner(Path(step_dir)),
            process_group=process_group,
            no_dist=no_dist,
        )
    except CheckpointException as exc:
        # A BaseException holding every rank's traceback: hand on this process's cause, as an Exception.
        causes = [cause for cause, _trace in exc.failures.values()]
        for cause in causes:
            if isinstance(cause, ChecksumMismatch):
                raise ChecksumMismatch(str(cause)) from None
        for cause in causes:
            if isinstance(cause, UserError):
                raise UserError(str(cause)) from None
        first = causes[0] if causes else exc
        raise RuntimeError(f"{type(first).__name__}: {first}") from None
    return reader.verified
