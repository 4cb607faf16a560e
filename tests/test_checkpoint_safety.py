"""Loading a checkpoint never runs code from it, never reads or copies a file outside it, and never
loads a file whose content changed after the save."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from relaytrain.checkpoint import checksums, choose, dcp_io, files, load_model
from relaytrain.checkpoint.export import export_checkpoint
from relaytrain.checkpoint.hf import read_safetensors
from relaytrain.errors import UserError

from conftest import run_cli

sys.path.insert(0, str(Path(__file__).parent))
from test_checkpoint import make, train_step  # noqa: E402


class _Exploit:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def saved(tmp_path: Path, steps=(1,), **ckpt) -> Path:
    mgr, parts, opt, state = make(tmp_path, **ckpt)
    for step in steps:
        train_step(parts, opt, state, step)
        mgr.save(step)
    mgr.close()
    return tmp_path / "run/checkpoints" / f"step_{steps[-1]}"


def poison_metadata(step_dir: Path, marker: Path) -> None:
    """What someone preparing a checkpoint to share would do: a .metadata that runs a command, and a
    COMPLETE manifest rewritten to match it."""
    (step_dir / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    checksums.write_complete(step_dir)


def test_hostile_metadata_is_refused_by_every_load_path(tmp_path):
    step_dir = saved(tmp_path)
    marker = tmp_path / "pwned"
    poison_metadata(step_dir, marker)
    for load in (
        lambda: load_model(step_dir),
        lambda: export_checkpoint(step_dir, tmp_path / "x.pt", fmt="torch"),
        lambda: make(tmp_path / "b", resume=str(step_dir))[0].load(),
        lambda: make(tmp_path / "c", init_from=str(step_dir))[0].load(),
        lambda: dcp_io.load({"model": {}}, step_dir),
    ):
        with pytest.raises(UserError, match=r"refuses to unpickle posix\.system from .*: not a DCP"):
            load()
    assert not marker.exists()


def test_cli_export_and_resume_of_a_hostile_checkpoint_print_one_line(tmp_path, tiny_args):
    step_dir = saved(tmp_path)
    marker = tmp_path / "pwned"
    poison_metadata(step_dir, marker)
    proc = run_cli(["export", str(step_dir), "--format", "torch", "--out", str(tmp_path / "o.pt")], tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "refuses to unpickle posix.system" in lines[0], proc.stderr
    proc = run_cli(["train", *tiny_args, "--train.max_steps=2", f"--checkpoint.resume={step_dir}"], tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "refuses to unpickle posix.system" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()


def test_non_tensor_entries_are_read_without_running_code(tmp_path):
    """DCP's own planner reads byte entries with torch.load(weights_only=False); ours does not."""
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(_Exploit(marker), buf)
    (tmp_path / "__0_0.distcp").write_bytes(buf.getvalue())
    index = MetadataIndex("model.x")
    meta = Metadata(
        state_dict_metadata={"model.x": BytesStorageMetadata()},
        storage_data={index: _StorageInfo("__0_0.distcp", 0, len(buf.getvalue()))},
    )
    (tmp_path / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(UserError, match="stores model.x as a pickle that is not plain data"):
        dcp_io.load({"model": {"x": 1.0}}, tmp_path)
    assert not marker.exists()


def test_metadata_naming_a_data_file_outside_is_refused(tmp_path):
    step_dir = saved(tmp_path)
    meta = dcp_io.read_metadata(step_dir)
    for info in meta.storage_data.values():
        info.relative_path = "../../../etc/passwd"
    (step_dir / ".metadata").write_bytes(pickle.dumps(meta))
    checksums.write_complete(step_dir)
    with pytest.raises(UserError, match=r"names the data file '\.\./\.\./\.\./etc/passwd'"):
        load_model(step_dir)


def test_export_copies_no_tokenizer_from_outside_the_checkpoint(tmp_path, caplog):
    step_dir = saved(tmp_path)
    secret = tmp_path / "secret" / "tokenizer.json"
    secret.parent.mkdir()
    secret.write_text("private")
    meta = json.loads((step_dir / "metadata.json").read_text())
    for spec in (str(secret), "../../../secret/tokenizer.json"):
        meta["tokenizer"] = spec
        (step_dir / "metadata.json").write_text(json.dumps(meta))
        checksums.write_complete(step_dir)
        out = tmp_path / f"out{len(spec)}.pt"
        with caplog.at_level(logging.WARNING, logger="relaytrain.checkpoint"):
            export_checkpoint(step_dir, out, fmt="torch")
        assert not (out.parent / "tokenizer.json").exists() and "carries no tokenizer.json" in caplog.text
    # a tokenizer.json inside that is a symbolic link out is not followed either
    (step_dir / "tokenizer.json").symlink_to(secret)
    export_checkpoint(step_dir, tmp_path / "sub" / "o.pt", fmt="torch")
    assert not (tmp_path / "sub" / "tokenizer.json").exists()
    checksums.write_complete(step_dir)  # listed in the manifest, the link makes the checkpoint damaged
    with pytest.raises(UserError, match="names 'tokenizer.json', which is not a file inside it"):
        export_checkpoint(step_dir, tmp_path / "sub2" / "o.pt", fmt="torch")


def test_hf_index_cannot_name_weights_outside(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf/config.json").write_text(json.dumps({"model_type": "llama"}))
    for name in ("../other/model.safetensors", "/etc/passwd"):
        index = {"weight_map": {"model.embed_tokens.weight": name}}
        (tmp_path / "hf/model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(UserError, match="which is not a file inside"):
            read_safetensors(tmp_path / "hf")


def test_latest_and_manifest_cannot_point_outside(tmp_path, caplog):
    step_dir = saved(tmp_path, steps=(1, 2))
    ckpt = step_dir.parent
    outside = tmp_path / "elsewhere" / "step_7"
    outside.parent.mkdir()
    os.symlink(step_dir, outside, target_is_directory=True)
    for target in (str(outside), "../elsewhere/step_7"):
        (ckpt / "latest").unlink()
        os.symlink(target, ckpt / "latest")
        with caplog.at_level(logging.WARNING, logger="relaytrain.checkpoint"):
            assert files.read_latest(ckpt) is None
            assert choose.choose_resume(ckpt)[0] == ckpt / "step_2"
        assert "not to a step_<N> directory beside it" in caplog.text
    complete = json.loads((step_dir / "COMPLETE").read_text())
    for name in ("../step_1/config.toml", "/etc/hostname"):
        (step_dir / "COMPLETE").write_text(json.dumps({"files": complete["files"] | {name: {"size": 1}}}))
        assert checksums.damaged_problems(step_dir) == [
            f"its COMPLETE manifest names {name!r}, which is not a file inside it"
        ]


def test_flipped_byte_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    step_dir = saved(tmp_path, steps=(1, 2))
    listed = json.loads((step_dir / "COMPLETE").read_text())["files"]
    assert all(entry["checksum"].startswith("xxh3_64:") for entry in listed.values())
    shard = step_dir / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="relaytrain.checkpoint"):
        assert make(tmp_path, seed=3)[0].load() == 1
    assert "skipping damaged checkpoint" in caplog.text and "__0_0.distcp does not match" in caplog.text
    # checkpoint.verify=false trusts sizes only and loads the flipped one
    assert make(tmp_path, seed=3, verify=False)[0].load() == 2


def test_async_save_records_checksums_and_old_manifests_still_load(tmp_path):
    step_dir = saved(tmp_path, steps=(1,), mode="async")
    listed = json.loads((step_dir / "COMPLETE").read_text())["files"]
    assert listed["__0_0.distcp"]["checksum"] == checksums.file_checksum(step_dir / "__0_0.distcp")
    # a manifest from before checksums (path -> size) is still accepted
    (step_dir / "COMPLETE").write_text(json.dumps({"files": {k: v["size"] for k, v in listed.items()}}))
    assert checksums.damaged_problems(step_dir) == []
    assert make(tmp_path, seed=3)[0].load() == 1


def test_crc32_manifests_of_older_checkpoints_are_still_verified(tmp_path, caplog):
    """Checkpoints written before xxh3_64 record crc32: they load, and a flipped byte is still caught."""
    step_dir = saved(tmp_path, steps=(1, 2))
    for step in (step_dir.parent / "step_1", step_dir):
        complete = json.loads((step / "COMPLETE").read_text())
        for rel, entry in complete["files"].items():
            entry["checksum"] = checksums.file_checksum(step / rel, like="crc32:0")
            assert entry["checksum"].startswith("crc32:")
        (step / "COMPLETE").write_text(json.dumps(complete))
    assert checksums.damaged_problems(step_dir) == []
    assert make(tmp_path, seed=3)[0].load() == 2
    shard = step_dir / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x10
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="relaytrain.checkpoint"):
        assert make(tmp_path, seed=3)[0].load() == 1
    assert "__0_0.distcp does not match" in caplog.text


def test_a_checksum_of_an_unknown_kind_counts_as_damage(tmp_path):
    step_dir = saved(tmp_path, steps=(1,))
    complete = json.loads((step_dir / "COMPLETE").read_text())
    complete["files"]["config.toml"]["checksum"] = "md5:0123"
    (step_dir / "COMPLETE").write_text(json.dumps(complete))
    assert checksums.damaged_problems(step_dir) == [
        "config.toml does not match its checksum (its content changed after the save)"
    ]
