"""Export to Hugging Face / torch, import-hf, and load_model, checked against transformers' Llama."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from relaytrain.checkpoint import load_model, read_full_state
from relaytrain.checkpoint.export import export_checkpoint, import_hf
from relaytrain.checkpoint.hf import parse_size, permute_from_hf, permute_to_hf, write_safetensors
from relaytrain.cli import main as cli_main
from relaytrain.errors import UserError

import needs

sys.path.insert(0, str(Path(__file__).parent))
from test_checkpoint import make, train_step  # noqa: E402

transformers = needs.module("transformers")

ATOL = 1e-4  # fp32 logits; observed differences are ~1e-6 (summation order in RMSNorm/attention)
GQA_TIED = dict(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=64, tie_embeddings=True
)


def trained_checkpoint(tmp_path: Path, model: dict | None = None, tokenizer: str = "byte") -> Path:
    mgr, parts, opt, state = make(tmp_path, model=model, tokenizer=tokenizer)
    for step in range(2):
        train_step(parts, opt, state, step)
    mgr.save(2)
    return tmp_path / "run"


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def test_permutation_round_trips():
    w = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    assert torch.equal(permute_from_hf(permute_to_hf(w, 2), 2), w)
    assert not torch.equal(permute_to_hf(w, 2), w)
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size("100") == 100


@pytest.mark.parametrize("model", [None, GQA_TIED], ids=["untied", "gqa-tied"])
def test_hf_export_matches_transformers_logits(tmp_path, model):
    run = trained_checkpoint(tmp_path, model)
    out = export_checkpoint(run, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_key_value_heads"] == (model or {}).get("n_kv_heads", 2)
    assert config["tie_word_embeddings"] == bool(model) and (out / "generation_config.json").is_file()
    assert "byte tokenizer" in (out / "README.md").read_text()
    tokens = torch.randint(0, config["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    ours = load_model(run)
    assert not ours.training
    with torch.no_grad():
        expected = ours(tokens)
    torch.testing.assert_close(hf_logits(out, tokens), expected, atol=ATOL, rtol=0)
    # the export itself loads back through load_model
    with torch.no_grad():
        torch.testing.assert_close(load_model(out)(tokens), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("max_shard_bytes", [1 << 30, 8])
def test_exported_weights_get_the_mode_of_any_file_the_user_writes(tmp_path, max_shard_bytes):
    import os

    state = {"a": torch.zeros(4), "b": torch.ones(4)}
    old = os.umask(0o022)
    try:
        names = write_safetensors(state, tmp_path, max_shard_bytes)  # safetensors alone leaves 0600
    finally:
        os.umask(old)
    assert {oct((tmp_path / n).stat().st_mode & 0o777) for n in names} == {"0o644"}


def test_sharded_export_with_index_and_import_round_trip(tmp_path):
    run = trained_checkpoint(tmp_path)
    rc = cli_main(["export", str(run), "--out", str(tmp_path / "hf"), "--max-shard-size", "40KB"])
    assert rc == 0
    out = tmp_path / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((out / s).is_file() for s in shards)
    assert not (out / "model.safetensors").exists()
    tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(out, tokens), load_model(run)(tokens), atol=ATOL, rtol=0)

    assert cli_main(["import-hf", str(out), "--out", str(tmp_path / "imported")]) == 0
    imported = tmp_path / "imported"
    assert (imported / "COMPLETE").is_file() and (imported / "config.toml").is_file()
    _, original, _ = read_full_state(run)
    _, back, info = read_full_state(imported)
    assert info["metadata"]["reason"] == "import-hf" and back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    # an import cannot be resumed (no optimizer/train state), only started from
    with pytest.raises(UserError, match="init_from"):
        make(tmp_path / "resume", resume=str(imported))[0].load()
    mgr, parts, opt, _ = make(tmp_path / "ft", seed=9, init_from=str(imported))
    assert mgr.load() is None
    assert all(torch.equal(v, original[k]) for k, v in parts[0].state_dict().items())


def test_import_of_a_transformers_model(tmp_path):
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=80,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "src")
    import_hf(tmp_path / "src", tmp_path / "ckpt")
    tokens = torch.randint(0, 80, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            load_model(tmp_path / "ckpt")(tokens), model(tokens).logits, atol=ATOL, rtol=0
        )
    with pytest.raises(UserError, match="not empty"):
        import_hf(tmp_path / "src", tmp_path / "ckpt")


def test_torch_export_is_standalone(tmp_path):
    run = trained_checkpoint(tmp_path)
    target = export_checkpoint(run / "checkpoints/step_2", tmp_path / "model.pt", fmt="torch")
    blob = torch.load(target, weights_only=True)
    assert blob["model_config"]["dim"] == 32 and "layers.1.attention.wq.weight" in blob["state_dict"]
    tokens = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        assert torch.equal(load_model(target)(tokens), load_model(run)(tokens))


def test_export_carries_the_runs_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1} | {f"w{i}": i + 2 for i in range(62)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    run = trained_checkpoint(tmp_path, tokenizer=str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer.json").unlink()  # the checkpoint keeps its own copy
    out = export_checkpoint(run, tmp_path / "hf", dtype="bfloat16")
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["torch_dtype"]) == (0, 1, "bfloat16")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.eos_token == "</s>" and hf_tok("w3 w5")["input_ids"][-2:] == [5, 7]


def test_export_errors_are_user_errors(tmp_path, capsys):
    assert cli_main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "hfdir").mkdir()
    (tmp_path / "hfdir/config.json").write_text(json.dumps({"model_type": "mistral"}))
    (tmp_path / "hfdir/model.safetensors").write_bytes(b"")
    assert cli_main(["import-hf", str(tmp_path / "hfdir"), "--out", str(tmp_path / "y")]) == 2
    assert "only 'llama'" in capsys.readouterr().err


def test_export_and_import_say_where_they_wrote_once(tmp_path):
    from conftest import run_cli

    run = trained_checkpoint(tmp_path)
    proc = run_cli(["export", str(run), "--format", "torch", "--out", str(tmp_path / "m.pt")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout + proc.stderr).count("exported") == 1, proc.stdout + proc.stderr
    proc = run_cli(["export", str(run), "--out", str(tmp_path / "hf")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout + proc.stderr).count("exported") == 1, proc.stdout + proc.stderr
    proc = run_cli(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout + proc.stderr).count("imported") == 1, proc.stdout + proc.stderr
