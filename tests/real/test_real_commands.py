"""Every read-only command of the README's real-pair quick start, on the real weights, as a user types it
(short inputs: a few seconds each on one core). Training, capture and the layer map have their own files."""

import json

import pytest

from kvdistill import cli

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("real_cmd_data")
    assert cli.main(["gen-data", "--output_dir", str(out), "--n_train", "8", "--n_dev", "4", "--n_test", "4"]) == 0
    return out


def test_dry_run_reports_the_pairs_shapes(real_pair, data_dir, tmp_path, capsys):
    argv = ["dry-run", "--student", real_pair["student"], "--teachers", f"[{{path: {real_pair['teacher']}}}]",
            "--data", str(data_dir), "--max_length", "128", "--per_device_train_batch_size", "2",
            "--output_dir", str(tmp_path / "run"), "--use_cpu", "true"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "[30, 3, 128, 64]" in out and "[18, 1, 128, 256]" in out  # [L, H_kv, T, D] of each side
    assert "134,515,008" in out and "268,098,176" in out


def test_eval_scores_base_and_run_on_one_prompt(real_pair, data_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    argv = ["eval", "--model", real_pair["student"], "--data", str(data_dir), "--limit", "2",
            "--max_new_tokens", "8", "--no_perplexity", "true", "--output_dir", str(out)]
    assert cli.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    # the Instruct student has a chat template; its base score uses training's prompt (no template) by default
    assert summary["chat_template"] is False and summary["n"] == 2
    assert "chat template off" in capsys.readouterr().out


def test_generate_samples_from_the_teacher(real_pair, data_dir, tmp_path):
    out = tmp_path / "transfer.jsonl"
    argv = ["generate", "--model", real_pair["teacher"], "--data", str(data_dir), "--limit", "1",
            "--max_new_tokens", "8", "--output", str(out), "--no_filter_correct"]
    assert cli.main(argv) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["answer"].strip()


def test_profile_runs_every_alignment_stage(real_pair, data_dir, capsys):
    argv = ["profile", "--teacher", real_pair["teacher"], "--student", real_pair["student"], "--data",
            str(data_dir), "--batch_size", "1", "--max_length", "32", "--device", "cpu"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "L=18 B=1 H_kv=1" in out and "L=30 B=1 H_kv=3" in out and "backward" in out


def test_probe_reads_the_teachers_keys(real_pair, tmp_path):
    data = tmp_path / "binding"
    assert cli.main(["gen-data", "--task", "binding", "--output_dir", str(data), "--n_train", "8", "--n_dev", "4",
                     "--n_test", "16"]) == 0
    out = tmp_path / "probe"
    argv = ["probe", "--model", real_pair["teacher"], "--data", str(data), "--split", "test", "--target",
            "number_value", "--rows", "all", "--samples", "12", "--batch_size", "4", "--dtype", "fp32",
            "--device", "cpu", "--no_progress", "true", "--output_dir", str(out)]
    assert cli.main(argv) == 0
    assert (out / "probe.json").is_file() and (out / "probe.png").is_file()
