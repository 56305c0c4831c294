"""Issue 35: what used to exit 0 having done something other than what was asked: a NaN loss weight, a
second training into an output_dir of another run, options that cannot act in the run. The cases marked
`subprocess` run as a user runs them (`python -m kvdistill.cli ...` in a child process), started ahead
with the session's other child processes (`conftest.Children`); the test reads each one's result. The
second training runs in process, after the first: it needs that finished run, and it is refused before
any model loads."""

from __future__ import annotations

import pytest

from kvdistill.cli import main as cli
from tests.bad_inputs.conftest import assert_refused, run_in_process

SUBPROCESS = pytest.mark.subprocess


def _ablation(c, variants, **extra) -> str:
    """An ablation config of 1-step SFT variants on the world, written into the case's dir `c.tmp`."""
    import yaml

    (c.tmp / "train.yaml").write_text(yaml.safe_dump({
        "student": str(c.world.student), "data": str(c.world.data), "kv_weight": 0, "max_steps": 1,
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "max_length": 128, "use_cpu": True,
        "save_steps": 1000, "report_to": "none"}))
    path = c.tmp / "ablation.yaml"
    path.write_text(yaml.safe_dump({"base_config": "train.yaml", "output_dir": str(c.tmp / "abl"), "seeds": [0],
                                    "variants": variants, **extra}))
    return str(path)


SFT = {"name": "sft", "overrides": {"max_steps": 1}}
REFUSED = [
    pytest.param(lambda c: c.train(kv_weight="nan"), ("kv_weight must be >= 0, got nan",),
                 id="nan_loss_weight_not_off", marks=SUBPROCESS),
    # every variant's overrides are checked before the first run trains
    pytest.param(lambda c: ["ablate", "--config", _ablation(c, [SFT, {"name": "typo", "overrides": {"kv_wieght": 0.1}}])],
                 ("variant typo: unknown key 'kv_wieght'", "did you mean 'kv_weight'"),
                 id="ablate_variant_typo_before_the_first_run", marks=SUBPROCESS),
    pytest.param(lambda c: ["ablate", "--config", _ablation(c, [SFT]), "--report_only"],
                 ("holds no finished run", "--report_only"), id="ablate_report_only_over_no_runs", marks=SUBPROCESS),
]


@pytest.mark.parametrize("argv, expect", REFUSED)
def test_refused_not_silent(argv, expect, children, request):
    rc, _, err, ctx, args, _ = children.result(request.node.nodeid)
    assert rc == 2
    assert_refused(rc, err, args[0], expect)
    assert not ctx.out.exists()  # nothing trained: no output_dir, no ablation run, no report
    assert not any((ctx.tmp / "abl").rglob("train_summary.json")) and not (ctx.tmp / "abl" / "ablation.md").exists()


def test_training_into_the_output_dir_of_a_run_with_other_settings_is_refused(train_args, tmp_path, capsys):
    """In process, through the CLI's dispatcher and error policy (the refusal comes before any model loads:
    a child process would add only its imports)."""
    out = tmp_path / "run"
    assert cli(train_args(output_dir=out)) == 0  # a finished run
    weights = (out / "model.safetensors").read_bytes()
    rc, _, err = run_in_process(train_args(output_dir=out, learning_rate=0.01), capsys)
    assert rc == 2 and "Traceback" not in err
    line = [line for line in err.splitlines() if line.strip()][-1]
    assert "learning_rate differ" in line and "than this training asks" in line
    assert all(flag in line for flag in ("--overwrite_output_dir", "--output_dir", "--resume_from_checkpoint last"))
    assert (out / "model.safetensors").read_bytes() == weights  # the old run is untouched
    assert cli(train_args(output_dir=out)) == 0  # the same settings: trained again, as before


CANNOT_ACT = [
    pytest.param(lambda c: c.train(kv_weight=0.1, max_steps=1,
                                   teachers=f"[{{path: {c.world.teacher}, layer_map: {c.tmp / 'map.json'}}}]"),
                 [("its layer_map JSON is not read: layer_map is proportional",)], id="teacher_layer_map_unread",
                 marks=SUBPROCESS),
    pytest.param(lambda c: c.train(transfer_data=c.world.data, use_chat_template="true"),
                 [("transfer_data {data} is not read: this run has no teacher signal",),
                  ("use_chat_template: the student's tokenizer", "has no chat template")],
                 id="transfer_data_and_chat_template_unread", marks=SUBPROCESS),
]


@pytest.mark.parametrize("argv, expect", CANNOT_ACT)
def test_options_that_cannot_act_are_named(argv, expect, children, request):
    """The run trains (exit 0) and a stderr line names each option that cannot act (`expect`: the parts
    of each such line)."""
    rc, _, err, ctx, _, _ = children.result(request.node.nodeid)
    assert rc == 0, err[-2000:]
    for parts in expect:
        parts = [p.format(data=ctx.world.data) for p in parts]
        assert any(all(p in line for p in parts) for line in err.splitlines()), parts


@pytest.mark.parametrize("signal, lm_weight, warned", [(False, 0.0, True), (False, 0.5, False), (True, 0.0, False)])
def test_transfer_data_is_named_unread_only_without_a_teacher_signal_and_its_lm_loss(signal, lm_weight, warned, caplog):
    """build.py reads the transfer set when a teacher signal is on or transfer_lm_weight > 0 (sequence-level
    KD: the LM loss on teacher completions): only with neither is it named unread."""
    import logging
    from types import SimpleNamespace

    from kvdistill.train.config import KVDistillConfig

    cfg = SimpleNamespace(teacher_configs=[], transfer_data="gen.jsonl", teacher_signal=signal,
                          transfer_lm_weight=lm_weight)
    with caplog.at_level(logging.WARNING, logger="kvdistill.train.config"):
        KVDistillConfig._check_options_act(cfg)
    assert any("transfer_data gen.jsonl is not read" in r.getMessage() for r in caplog.records) == warned


@pytest.mark.parametrize("argv", [pytest.param(lambda c: c.train(max_steps=2, logging_steps=5), marks=SUBPROCESS,
                                               id="logging_steps_beyond_max_steps")])
def test_logging_steps_beyond_max_steps_log_the_last_step_and_say_so(argv, children, request):
    """No step would log (metrics.jsonl empty, every final value null): logging_steps is clamped, in one line."""
    import json

    rc, _, err, ctx, _, _ = children.result(request.node.nodeid)
    assert rc == 0, err[-2000:]
    assert any("logging_steps 5 is more than max_steps 2" in line and "logging every 2 steps instead" in line
               for line in err.splitlines()), err[-2000:]
    final = json.loads((ctx.out / "train_summary.json").read_text())["final"]
    assert final["ce"] is not None, final  # an SFT run: its LM loss logged (no teacher: no KV values)
