"""Layer mapping: builders, einsum application, JSON round trip and its checks."""

from __future__ import annotations

import json

import pytest
import torch

from kvdistill.align.layer_map import (
    apply_layer_map,
    build_layer_map,
    last_k_map,
    load_layer_map,
    mapped_rows,
    proportional_map,
    save_layer_map,
    sparse_layer_map,
)


def test_proportional_picks_documented_layers():
    M = proportional_map(24, 28)  # Qwen2.5-0.5B <- Qwen2-1.5B
    torch.testing.assert_close(M.sum(1), torch.ones(24))
    picks = M.argmax(1).tolist()
    # round(l * 27 / 23), half up: 0, 1.17, 2.35, 3.52, ... 23 -> 27
    assert picks[:5] == [0, 1, 2, 4, 5] and picks[12] == 14 and picks[-1] == 27
    assert proportional_map(4, 7).argmax(1).tolist() == [0, 2, 4, 6]  # 0, 2, 4, 6 exactly
    assert proportional_map(3, 4).argmax(1).tolist() == [0, 2, 3]  # 1.5 rounds half up
    assert proportional_map(1, 5).argmax(1).tolist() == [4]
    torch.testing.assert_close(proportional_map(6, 6), torch.eye(6))


def test_last_k_maps_top_layers_only():
    M = last_k_map(5, 8, 2)
    assert mapped_rows(M).tolist() == [3, 4]
    assert M[4, 7] == 1 and M[3, 6] == 1 and M[:3].sum() == 0
    with pytest.raises(ValueError, match="k=9"):
        last_k_map(5, 8, 9)


def test_apply_layer_map_is_weighted_sum_over_axis_0():
    x = torch.randn(3, 2, 4, 5)  # [L_t, B, T, F]
    M = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.25, 0.75]])
    out = apply_layer_map(M, x)
    torch.testing.assert_close(out[0], 0.5 * x[0] + 0.5 * x[1])
    torch.testing.assert_close(out[1], 0.25 * x[1] + 0.75 * x[2])
    with pytest.raises(ValueError, match=r"expects 3 teacher layers.*\(4, 2\)"):
        apply_layer_map(M, torch.randn(4, 2))


def test_json_round_trip_and_pairs(tmp_path):
    M = torch.tensor([[0.7, 0.3, 0.0], [0.0, 0.0, 1.0]])
    sim = torch.rand(2, 3)
    path = tmp_path / "map.json"
    save_layer_map(path, M, similarity=sim, provenance={"student_config_hash": "s1", "k": 2})
    doc = json.loads(path.read_text())
    assert doc["format"] == "kvdistill.layer_map/v1"
    assert (doc["student_layers"], doc["teacher_layers"]) == (2, 3)
    assert doc["pairs"][0] == {"student": 0, "teacher": [0, 1], "weight": pytest.approx([0.7, 0.3])}
    torch.testing.assert_close(load_layer_map(path, 2, 3), M)
    torch.testing.assert_close(build_layer_map("json", 2, 3, path=path), M)
    # a document holding only pairs is accepted too
    doc["matrix"] = None
    path.write_text(json.dumps(doc))
    torch.testing.assert_close(load_layer_map(path, 2, 3), M)


def test_load_rejects_other_layer_counts_naming_both(tmp_path):
    path = tmp_path / "map.json"
    save_layer_map(path, proportional_map(4, 6))
    with pytest.raises(ValueError, match=r"4 student x 6 teacher.*5 x 6.*kvdistill layer-map"):
        load_layer_map(path, 5, 6)


def test_hash_mismatch_names_override_flag(tmp_path):
    path = tmp_path / "map.json"
    save_layer_map(path, proportional_map(2, 3), provenance={"teacher_config_hash": "aaa"})
    with pytest.raises(ValueError, match="--ignore_layer_map_hash"):
        load_layer_map(path, 2, 3, teacher_hash="bbb")
    load_layer_map(path, 2, 3, teacher_hash="bbb", check_hashes=False)
    load_layer_map(path, 2, 3, teacher_hash="aaa")
    load_layer_map(path, 2, 3, student_hash="anything")  # no saved student hash: nothing to compare


def test_malformed_maps_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"rows \[0\]"):
        save_layer_map(tmp_path / "m.json", torch.tensor([[0.5, 0.2], [0.0, 1.0]]))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something/else"}))
    with pytest.raises(ValueError, match="not a layer map"):
        load_layer_map(bad, 2, 2)
    with pytest.raises(FileNotFoundError, match="kvdistill layer-map"):
        load_layer_map(tmp_path / "missing.json", 2, 2)
    with pytest.raises(ValueError, match="unknown layer map kind"):
        build_layer_map("cka", 2, 2)


def test_sparse_layer_map_lists_each_rows_layers_and_weights():
    layers, weights = sparse_layer_map(proportional_map(3, 5))  # one-hot: one layer per row
    assert layers.tolist() == [[0], [2], [4]] and weights.tolist() == [[1.0], [1.0], [1.0]]
    M = torch.tensor([[0.0, 0.25, 0.75], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])  # top-2, unmapped, one layer
    layers, weights = sparse_layer_map(M)
    assert layers.shape == weights.shape == (3, 2)
    dense = torch.zeros(3, 3).scatter_add_(1, layers, weights)  # back to the matrix: padding adds 0
    torch.testing.assert_close(dense, M)
    assert weights[1].tolist() == [0.0, 0.0] and weights[2].tolist() == [1.0, 0.0]
