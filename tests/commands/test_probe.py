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
    untrained_v = [c for c in res["cells"] if c["model"] == "llama_teacher (untrained)" and c["kind"] == "v"]
    assert [c["score"] for c in teacher_v] != [c["score"] for c in untrained_v]  # other weights, same config
    assert res["models"][0]["config_hash"] == res["models"][1]["config_hash"]
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


def test_yaml_options_with_cli_overrides(tmp_path):
    from kvdistill.commands.probe import ProbeConfig
    from kvdistill.config import parse_config

    cfg = tmp_path / "probe.yaml"
    cfg.write_text("model: [a, b]\nkinds: [v, hidden]\ntarget: next_answer_token\noutput_dir: out\nuntrained: true\n")
    a = parse_config(ProbeConfig, ["--config", str(cfg), "--target", "field:chain", "--rows", "results"], "probe")
    assert (a.model, a.kinds, a.target, a.rows, a.untrained) == (["a", "b"], ["v", "hidden"], "field:chain",
                                                                   "results", True)
    one = parse_config(ProbeConfig, ["--model", "a", "--kinds", "k_pre", "k_post", "--output_dir", "o"], "probe")
    assert (one.model, one.kinds) == (["a"], ["k_pre", "k_post"])
    with pytest.raises(ConfigError, match="each kind must be one of"):
        parse_config(ProbeConfig, ["--model", "a", "--kinds", "keys", "--output_dir", "o"], "probe")
