"""Depth pruning (`kvdistill.prune`, `kvdistill prune`): the pruned model runs exactly the kept layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from kvdistill.align.layer_map import load_layer_map
from kvdistill.cli import main as cli_main
from kvdistill.config import ConfigError
from kvdistill.models import config_hash, load_tokenizer, save_random_model
from kvdistill.prune import LAYER_MAP, LAYER_MAP_HIDDEN, MANIFEST, keep_indices, prune, prune_model

GEMMA_TYPES = ["sliding_attention"] * 5 + ["full_attention"]  # Gemma 3's pattern: 5 local layers, then 1 global


@pytest.fixture(scope="module")
def tiny_gemma(tiny_world, tmp_path_factory) -> Path:
    """A 6-layer Gemma-3-style model with a 4-token window: a 12-token text tells local layers from global."""
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                           max_position_embeddings=64, layer_types=GEMMA_TYPES)
    return save_random_model(cfg, load_tokenizer(tiny_world.tokenizers["bpe"]), tmp_path_factory.mktemp("gemma") / "g")


def reference_logits(model, keep: list[int], ids: torch.Tensor, types: list[str] | None = None) -> torch.Tensor:
    """The source model run by hand through `keep`'s layers only: its embedding, each kept layer with the
    mask and rotary embedding of that layer's own type (causal, or causal within the sliding window; `types`:
    others, one per source layer), its final norm and head. `[1, T]` ids -> `[1, T, V]` logits."""
    body, cfg = model.model, model.config
    T = ids.shape[1]
    pos = torch.arange(T)[None]  # [1, T]
    causal = pos <= pos.T  # [T, T] query row, key column
    allowed = {"full_attention": causal, "sliding_attention": causal & (pos.T - pos < (getattr(cfg, "sliding_window", None) or T))}
    types = types or getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    h = body.embed_tokens(ids)  # [1, T, d]
    for i in keep:
        kind = types[i]
        mask = torch.zeros(T, T).masked_fill(~allowed[kind], float("-inf"))[None, None]  # [1, 1, T, T]
        rope = body.rotary_emb(h, pos, kind) if isinstance(cfg, Gemma3TextConfig) else body.rotary_emb(h, pos)
        h = body.layers[i](h, attention_mask=mask, position_embeddings=rope, position_ids=pos)
    return model.lm_head(body.norm(h))


@pytest.mark.parametrize("which, keep", [("llama", [0, 2]), ("gemma", [1, 3, 5]), ("gemma", "every_other")])
def test_pruned_forward_runs_the_kept_layers(tiny_world, tiny_gemma, which, keep) -> None:
    source = AutoModelForCausalLM.from_pretrained(
        tiny_world.models["llama_teacher"] if which == "llama" else tiny_gemma).eval()
    pruned = prune_model(source, keep).eval()
    kept = keep_indices(keep, source.config.num_hidden_layers)
    ids = torch.randint(0, 320, (1, 12))
    with torch.no_grad():
        assert torch.allclose(pruned(ids).logits, reference_logits(source, kept, ids), atol=1e-5)
        # not a vacuous match: the full model gives other logits, and so would the kept layers run with the
        # source's first layer types (the config's list not cut to the kept layers)
        assert not torch.allclose(source(ids).logits, pruned(ids).logits, atol=1e-3)
        if keep == [1, 3, 5]:
            uncut = GEMMA_TYPES[:3] + GEMMA_TYPES[:3]  # layer 5 would run as a sliding-window layer
            assert not torch.allclose(reference_logits(source, kept, ids, uncut), pruned(ids).logits, atol=1e-3)
    assert [layer.self_attn.layer_idx for layer in pruned.model.layers] == list(range(len(kept)))


def test_pruned_configs(tiny_world, tiny_gemma) -> None:
    """Llama-style: the layer count; Gemma-style: the per-layer types follow the kept layers (a kept global layer
    stays global), and the rest of the config is the source's."""
    llama = prune_model(AutoModelForCausalLM.from_pretrained(tiny_world.models["llama_teacher"]), [0, 2])
    assert llama.config.num_hidden_layers == 2 and llama.config.hidden_size == 96
    gemma = AutoModelForCausalLM.from_pretrained(tiny_gemma)
    small = prune_model(gemma, [1, 3, 5])
    assert small.config.num_hidden_layers == 3
    assert small.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert gemma.config.layer_types == GEMMA_TYPES  # the source's config is untouched
    assert small.config.sliding_window == 4 and small.config.vocab_size == gemma.config.vocab_size
    assert prune_model(gemma, "every_other").config.layer_types == ["sliding_attention"] * 3


def test_prune_cli_end_to_end(tiny_gemma, tmp_path: Path, capsys) -> None:
    out = tmp_path / "gemma_half"
    assert cli_main(["prune", "--model", str(tiny_gemma), "--keep", "1,3,5", "--output_dir", str(out)]) == 0
    assert "kept layers [1, 3, 5] of 6" in capsys.readouterr().out
    assert json.loads((out / MANIFEST).read_text())["kept_layers"] == [1, 3, 5]
    saved = json.loads((out / "config.json").read_text())
    assert saved["num_hidden_layers"] == 3 and saved["layer_types"][-1] == "full_attention"
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    source = AutoModelForCausalLM.from_pretrained(tiny_gemma).eval()
    ids = torch.randint(0, 320, (1, 12))
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, reference_logits(source, [1, 3, 5], ids), atol=1e-5)
    assert load_tokenizer(out).get_vocab() == load_tokenizer(tiny_gemma).get_vocab()
    assert not list(tmp_path.glob(".*tmp"))  # the scratch copy was renamed into place
    # the pruning's layer map: student layer j -> source layer keep[j], read back for these two models
    M = load_layer_map(out / LAYER_MAP, 3, 6, student_hash=config_hash(reloaded), teacher_hash=config_hash(source))
    assert M.tolist() == [[0, 1, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 1]]
    H = load_layer_map(out / LAYER_MAP_HIDDEN, 3, 6, student_hash=config_hash(reloaded), teacher_hash=config_hash(source))
    assert H.argmax(1).tolist() == [2, 4, 5]  # each output stands in for the source's before the next kept layer


@pytest.mark.parametrize("keep, message", [
    ("0,9", "layer 9 is out of range (the model has 3 layers, 0..2)"),
    ("", "names no layer"),
    ("2,0", "increasing order"),
    ("1,1", "increasing order"),
    ("first", "neither every_other nor comma-separated layer indices"),
])
def test_bad_keep_is_one_line_and_writes_nothing(tiny_world, tmp_path: Path, capsys, keep, message) -> None:
    out = tmp_path / "pruned"
    argv = ["prune", "--model", str(tiny_world.models["llama_teacher"]), "--keep", keep, "--output_dir", str(out)]
    assert cli_main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not the load's progress bar
    assert len(errors) == 1 and errors[0].startswith("kvdistill prune: error: ") and message in errors[0]
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no scratch copy


def test_existing_output_dir_is_refused(tiny_world, tmp_path: Path, capsys) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["prune", "--model", str(tiny_world.models["llama_teacher"]), "--output_dir", str(out)]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvdistill prune: error: ") and "already exists and is not empty" in err
    assert len(err.splitlines()) == 1  # refused before anything loads
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory is fine: the pruned model takes its place
    assert prune(tiny_world.models["llama_teacher"], [1], empty) == empty and (empty / "config.json").is_file()


def test_a_failed_save_leaves_nothing(tiny_world, tmp_path: Path, monkeypatch) -> None:
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("transformers.PreTrainedTokenizerBase.save_pretrained", full_disk)
    with pytest.raises(OSError):
        prune(tiny_world.models["llama_teacher"], "every_other", tmp_path / "pruned")
    assert list(tmp_path.iterdir()) == []


def test_keep_indices() -> None:
    assert keep_indices("every_other", 5) == [0, 2, 4] and keep_indices(" 0, 3 ", 4) == [0, 3]
    with pytest.raises(ConfigError, match="out of range"):
        keep_indices([4], 4)
