"""GGUF files as a model source: converted once, cached by hash, one-line errors for what goes wrong."""

import os
import shutil

import numpy as np
import pytest
import torch

from kvdistill import cli, gguf
from kvdistill.gguf import DONE, GGUFError, gguf_to_hf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDISTILL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def _write_gguf(path, arch: str = "foo"):
    import gguf as reader

    w = reader.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_file_that_is_not_gguf_is_named(cache, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip, not a gguf")
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        gguf_to_hf(bad)
    with pytest.raises(GGUFError, match="no such GGUF file"):
        gguf_to_hf(tmp_path / "missing.gguf")
    assert not cache.exists() or not any(cache.iterdir())  # nothing half-written


def test_a_missing_gguf_package_names_the_extra(cache, tmp_path, monkeypatch):
    path = _write_gguf(tmp_path / "m.gguf")
    real = gguf.importlib.util.find_spec
    monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    with pytest.raises(GGUFError, match=r"pip install 'kvdistill\[gguf\]'"):
        gguf_to_hf(path)


def test_an_architecture_transformers_cannot_read_is_refused_in_one_line(cache, tmp_path, capsys):
    path = _write_gguf(tmp_path / "m.gguf", arch="foo")
    assert cli.main(["eval", "--model", str(path), "--data", "synthetic"]) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert len(errors) == 1 and "architecture foo is not supported" in errors[0] and "llama" in errors[0]
    assert not [p for p in cache.iterdir() if p.is_dir()]  # the failed conversion left no directory


@pytest.mark.real
def test_a_truncated_file_is_called_damaged(cache, tmp_path, real_pair):
    from kvdistill.real_pair import gguf_files

    src = next(p for n, p in gguf_files().items() if "smollm2" in n)
    cut = tmp_path / "cut.gguf"
    with src.open("rb") as f:
        cut.write_bytes(f.read(5_000_000))
    with pytest.raises(GGUFError, match="damaged or incomplete"):
        gguf_to_hf(cut)
    assert not [p for p in cache.iterdir() if p.is_dir()]  # the failed conversion left no directory


@pytest.mark.real
def test_a_conversion_is_cached_by_hash_and_an_interrupted_one_redone(cache, tmp_path, real_pair, monkeypatch):
    from kvdistill.models import load_model
    from kvdistill.real_pair import gguf_files

    src = next(p for n, p in gguf_files().items() if "smollm2" in n)
    link = tmp_path / "student.gguf"
    os.symlink(src, link)
    calls = []

    def convert(path, out):  # the real conversion is ~25 s: stand in with a copy of the session's result
        calls.append(path)
        shutil.copytree(real_pair["student"], out, ignore=shutil.ignore_patterns(DONE))

    monkeypatch.setattr(gguf, "_convert", convert)
    first = gguf_to_hf(link)
    assert calls and (first / DONE).is_file() and first.parent == cache
    assert gguf_to_hf(link) == first and len(calls) == 1  # cached: no second conversion
    (first / DONE).unlink()  # an interrupted conversion has no marker: it is redone
    assert gguf_to_hf(link) == first and len(calls) == 2
    # a .gguf path loads the model its directory holds, through the ordinary loader
    a, b = load_model(link, dtype="fp32"), load_model(real_pair["student"], dtype="fp32")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
