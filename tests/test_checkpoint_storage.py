"""The raw-bytes DCP storage layer: round trip, checksums computed while writing, damaged files refused,
torch-written checkpoints still readable, and optimizer state created without an optimizer step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import _init_optim_state

from relaytrain.checkpoint import checksums, dcp_io
from relaytrain.checkpoint.state import create_adam_state
from relaytrain.checkpoint.storage import RAW, ChecksumMismatch, RawWriter
from relaytrain.errors import UserError


def sample() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(300, 70, generator=g),
        "half": torch.randn(33, 5, generator=g).to(torch.bfloat16),
        "ids": torch.arange(17, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "strided": torch.randn(40, 30, generator=g).t(),  # not contiguous
        "empty": torch.empty(0, 4),
        "lr": 0.25,  # a non-tensor entry (DCP pickles it)
    }


def blank(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0.0 for k, v in state.items()}


def save(path, state) -> RawWriter:
    writer = RawWriter(path)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


def test_round_trip_is_exact_and_checksums_are_computed_while_writing(tmp_path):
    state = sample()
    writer = save(tmp_path, state)
    shards = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__0_1.distcp"]  # one file per writer thread
    assert writer.checksums == {name: checksums.file_checksum(tmp_path / name) for name in shards}
    meta = dcp_io.read_metadata(tmp_path)
    assert {tuple(info.transform_descriptors or ()) for info in meta.storage_data.values()} == {(RAW,), ()}
    # tensors stored as bare bytes; the pickled float is one torch.save record (~1 kB; one per tensor before)
    tensor_bytes = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    assert tensor_bytes < sum((tmp_path / n).stat().st_size for n in shards) < tensor_bytes + 1500
    loaded = blank(state)
    checked = dcp_io.load(loaded, tmp_path, expected=writer.checksums)
    assert checked == set(shards)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value


def test_flipped_byte_is_refused_and_truncation_is_one_line(tmp_path):
    state = sample()
    writer = save(tmp_path, state)
    shard = max(tmp_path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match=f"{shard.name} does not match its checksum"):
        dcp_io.load(blank(state), tmp_path, expected=writer.checksums)
    # checkpoint.verify = false: no checksum is computed, the changed bytes load, nothing counts as checked
    assert dcp_io.load(blank(state), tmp_path) == set()
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(UserError) as err:
        dcp_io.load(blank(state), tmp_path)
    assert "truncated" in str(err.value) and shard.name in str(err.value)
    assert "\n" not in str(err.value)


def test_torch_written_checkpoints_still_load_and_torch_refuses_raw_files(tmp_path):
    state = sample()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "torch"), no_dist=True)
    loaded = blank(state)
    assert dcp_io.load(loaded, tmp_path / "torch") == set()  # read the stock way, checked by the caller
    assert all(torch.equal(loaded[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
    save(tmp_path / "raw", state)
    with pytest.raises(BaseException, match=RAW):  # never misread as torch.save records
        dcp.load(blank(state), storage_reader=dcp.FileSystemReader(tmp_path / "raw"), no_dist=True)


@pytest.mark.parametrize(
    "cls, options",
    [(torch.optim.AdamW, {}), (torch.optim.Adam, {"amsgrad": True}), (torch.optim.AdamW, {"foreach": False})],
)
def test_created_adam_state_has_the_structure_of_a_zero_lr_step(cls, options):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].bias.requires_grad_(False)
    stepped = cls(model.parameters(), lr=1e-3, **options)
    created = cls(model.parameters(), lr=1e-3, **options)
    before = [p.detach().clone() for p in model.parameters()]
    _init_optim_state(stepped)
    create_adam_state([created])
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    a, b = stepped.state_dict(), created.state_dict()
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for index, entry in a["state"].items():
        assert entry.keys() == b["state"][index].keys()
        for name, value in entry.items():
            other = b["state"][index][name]
            assert (value.dtype, value.shape, value.device) == (other.dtype, other.shape, other.device)
