"""`kvdistill probe` end to end on the tiny models: JSON + heatmap, the untrained row, and bad input refused."""

from __future__ import annotations

import json

import pytest

from kvdistill.cli import main as cli_main
from kvdistill.commands.probe import main
from kvdistill.config import ConfigError
from kvdistill.data import DataError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
pytestmark = pytest.mark.filterwarnings("ignore:.*was cut to max_length")


def _argv(tiny_world, out, *extra: str) -> list[str]:
    return ["--model", str(tiny_world.models["llama_teacher"]), "--data", str(tiny_world.data_dir), "--split", "test",
            "--samples", "16", "--max_length", "96", "--output_dir", str(out), "--no_progress", *extra]


def test_command_writes_json_and_heatmap_with_the_untrained_row(tiny_world, tmp_path, capsys):
    out = tmp_path / "probe"
    argv = _argv(tiny_world, out, "--untrained", "--target", "number_value", "--rows", "results", "--kinds",
                 "[k_pre, v, hidden]")
    argv[1:2] = [str(tiny_world.models["llama_teacher"]), str(tiny_world.models["student"])]
    assert main(argv) == 0
    res = json.loads((out / "probe.json").read_text())
    assert (out / "probe.png").read_bytes()[:8] == PNG_MAGIC
    assert res["format"] == "kvdistill-probe/1" and res["metric"] == "accuracy"
    names = [m["name"] for m in res["models"]]
    assert names == ["llama_teacher", "llama_teacher (untrained)", "student", "student (untrained)"]
    assert [m["untrained"] for m in res["models"]] == [False, True, False, True]
    # 3 kinds x (3 layers for the teacher, 2 for the student), each with its controls and counts
    assert len(res["cells"]) == 2 * 3 * 3 + 2 * 3 * 2
    for cell in res["cells"]:
        assert 0 <= cell["score"] <= 1 and 0 <= cell["shuffled"] <= 1 and 0 <= cell["baseline"] <= 1
        assert cell["n_train"] > 0 and cell["n_test"] > 0
        assert ("heads" in cell) == (cell["kind"] != "hidden")
    teacher_v = [c for c in res["cells"] if c["model"] == "llama_teacher" and c["kind"] == "v"]
    assert len(teacher_v[0]["heads"]["score"]) == 2  # the teacher's 2 KV heads
    prov = res["provenance"]
    assert prov["seed"] == 0 and prov["samples"] == 16 and "torch" in prov["environment"]
    printed = capsys.readouterr().out
    assert "student (untrained)" in printed and "shuffled" in printed


def test_regression_readout_and_the_same_rows_for_an_untrained_copy(tiny_world, tmp_path):
    out = tmp_path / "reg"
    assert main(_argv(tiny_world, out, "--untrained", "--target", "number_value", "--readout", "regression",
                      "--kinds", "[hidden]")) == 0
    res = json.loads((out / "probe.json").read_text())
    assert res["metric"] == "R²"
    trained, untrained = res["models"]
    assert (trained["n_train"], trained["n_test"]) == (untrained["n_train"], untrained["n_test"])
    assert all(c["score"] <= 1 for c in res["cells"])


@pytest.mark.parametrize("extra, error, match", [
    (["--target", "next_token"], ConfigError, "--target: target 'next_token' is not one of"),
    (["--rows", "answers"], ConfigError, "--rows: rows 'answers' is not one of"),
    (["--target", "next_answer_token", "--readout", "regression"], ConfigError, "not a quantity"),
    (["--target", "field:value"], DataError, "no record carries the per-token field 'value'"),
    (["--samples", "3", "--train_fraction", "0.4"], DataError, "too few rows to fit"),
])
def test_bad_input_is_refused_before_anything_is_written(tiny_world, tmp_path, extra, error, match):
    out = tmp_path / "bad"
    with pytest.raises(error, match=match):
        main(_argv(tiny_world, out, *extra))
    assert not (out / "probe.json").exists() and not (out / "probe.png").exists()


def test_a_directory_that_is_not_a_model_is_one_line_and_exit_2(tiny_world, tmp_path, capsys):
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    argv = _argv(tiny_world, tmp_path / "out")
    argv[1] = str(empty)
    assert cli_main(["probe", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not_a_model" in err and err.startswith("kvdistill probe: error:")
