"""Issue 35: what used to exit 0 having done something other than what was asked, run as a user runs
it (`python -m kvdistill.cli ...` in a child process): a NaN loss weight, a second training into an
output_dir of another run, options that cannot act in the run."""

from __future__ import annotations

from kvdistill.cli import main as cli


def test_a_nan_loss_weight_is_refused_not_off(child, train_args, tmp_path):
    rc, _, err = child(*train_args(output_dir=tmp_path / "out", kv_weight="nan"))
    assert rc == 2 and err[-1].startswith("kvdistill train: error: kv_weight must be >= 0, got nan")
    assert not (tmp_path / "out").exists()


def test_training_into_the_output_dir_of_a_run_with_other_settings_is_refused(child, train_args, tmp_path):
    out = tmp_path / "run"
    assert cli(train_args(output_dir=out)) == 0  # a finished run (in process: fast)
    weights = (out / "model.safetensors").read_bytes()
    rc, _, err = child(*train_args(output_dir=out, learning_rate=0.01))
    assert rc == 2 and not any("Traceback" in line for line in err)
    line = err[-1]
    assert "learning_rate differ" in line and "than this training asks" in line
    assert all(flag in line for flag in ("--overwrite_output_dir", "--output_dir", "--resume_from_checkpoint last"))
    assert (out / "model.safetensors").read_bytes() == weights  # the old run is untouched
    assert cli(train_args(output_dir=out)) == 0  # the same settings: trained again, as before


def _ablation(tmp_path, world, variants, **extra) -> str:
    import yaml

    (tmp_path / "train.yaml").write_text(yaml.safe_dump({
        "student": str(world.student), "data": str(world.data), "kv_weight": 0, "max_steps": 1,
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "max_length": 128, "use_cpu": True,
        "save_steps": 1000, "report_to": "none"}))
    path = tmp_path / "ablation.yaml"
    path.write_text(yaml.safe_dump({"base_config": "train.yaml", "output_dir": str(tmp_path / "abl"), "seeds": [0],
                                    "variants": variants, **extra}))
    return str(path)


def test_ablate_checks_every_variants_overrides_before_the_first_run(child, world, tmp_path):
    config = _ablation(tmp_path, world, [{"name": "sft", "overrides": {"max_steps": 1}},
                                         {"name": "typo", "overrides": {"kv_wieght": 0.1}}])
    rc, _, err = child("ablate", "--config", config)
    assert rc == 2 and err[-1].startswith("kvdistill ablate: error: variant typo: unknown key 'kv_wieght'")
    assert "did you mean 'kv_weight'" in err[-1]
    assert not (tmp_path / "abl" / "runs" / "sft" / "seed_0" / "train_summary.json").exists()  # nothing trained


def test_ablate_report_only_over_no_runs_is_an_error(child, world, tmp_path):
    config = _ablation(tmp_path, world, [{"name": "sft", "overrides": {"max_steps": 1}}])
    rc, _, err = child("ablate", "--config", config, "--report_only")
    assert rc == 2 and "holds no finished run" in err[-1] and "--report_only" in err[-1]
    assert not (tmp_path / "abl" / "ablation.md").exists()


def test_options_that_cannot_act_are_named(child, world, train_args, tmp_path):
    teacher = f"[{{path: {world.teacher}, layer_map: {tmp_path / 'map.json'}}}]"
    rc, _, err = child(*train_args(output_dir=tmp_path / "a", kv_weight=0.1, teachers=teacher, max_steps=1))
    assert rc == 0 and any("its layer_map JSON is not read: layer_map is proportional" in line for line in err)
    rc, _, err = child(*train_args(output_dir=tmp_path / "b", transfer_data=world.data, use_chat_template="true"))
    assert rc == 0
    assert any(f"transfer_data {world.data} is not read: this run has no teacher signal" in line for line in err)
    assert any("use_chat_template: the student's tokenizer" in line and "has no chat template" in line for line in err)
