"""A run directory given where a model dir is asked for (eval, layer-map, probe): its final model, else
its newest complete checkpoint, said in one line; never a checkpoint cut short (no completion marker).

The runs are built by hand, no training: a copy of the world's student as `checkpoint-N/` (with or
without `checkpoint_complete.json`) or as the final model at the run's top level.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvdistill.config import ConfigError
from kvdistill.runs import COMPLETE_FILE, METRICS, TRAIN_CONFIG, resolve_model
from tests.bad_inputs.conftest import Ctx, assert_refused, run_in_process

SUBPROCESS = pytest.mark.subprocess


def run_dir(c, complete: tuple[int, ...] = (), cut: tuple[int, ...] = (), final: bool = False) -> Path:
    """`c.tmp/run`: checkpoints `complete` (with the marker), `cut` (without it, their weights halved as a
    save stopped midway leaves them) and, if `final`, the final model at top level."""
    run = c.tmp / "run"
    run.mkdir()
    (run / METRICS).write_text('{"step": 1, "loss": 1.0}\n')
    for step in (*complete, *cut):
        ckpt = run / f"checkpoint-{step}"
        shutil.copytree(c.world.student, ckpt)
        (ckpt / TRAIN_CONFIG).write_text("seed: 0\n")
        if step in complete:
            (ckpt / COMPLETE_FILE).write_text(f'{{"global_step": {step}}}')
        else:
            weights = (ckpt / "model.safetensors").read_bytes()
            (ckpt / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    if final:
        shutil.copytree(c.world.student, run, dirs_exist_ok=True)
        (run / TRAIN_CONFIG).write_text("seed: 0\n")
    return run


def ev(c, model: Path) -> list:
    return ["eval", "--model", model, "--data", c.world.data, "--limit", 1, "--max_new_tokens", 2, "--no_perplexity",
            "--no_answer_nll", "--no_progress", "--output_dir", c.out]


NO_FINAL = ("run", "has no final model and no complete checkpoint", f"checkpoint-4 incomplete: no {COMPLETE_FILE}",
            "train it to the end", "or pass another model dir")

CASES = [
    pytest.param(lambda c: ev(c, run_dir(c, cut=(4,))), NO_FINAL, id="eval_only_incomplete_checkpoints",
                 marks=SUBPROCESS),
    pytest.param(lambda c: ev(c, run_dir(c, complete=(2,), cut=(4,)) / "checkpoint-4"),
                 ("checkpoint-4 is incomplete", "the run stopped while saving it", "checkpoint-2 instead"),
                 id="eval_incomplete_checkpoint_named"),
    pytest.param(lambda c: ["layer-map", "--student", c.world.student, "--teacher", run_dir(c, cut=(4,)),
                            "--data", c.world.data, "--samples", 2, "--output_file", c.out / "map.json", "--no_progress"],
                 NO_FINAL, id="layer_map_teacher_only_incomplete_checkpoints"),
    pytest.param(lambda c: ["probe", "--model", run_dir(c, cut=(4,)), "--data", c.world.data, "--samples", 3,
                            "--output_dir", c.out, "--no_progress"], NO_FINAL, id="probe_only_incomplete_checkpoints"),
]


@pytest.mark.parametrize("argv, expect", CASES)
def test_run_dir_refused(argv, expect, refused):
    refused(argv, expect)


@pytest.mark.parametrize("final", [False, True], ids=["newest_complete_checkpoint", "final_model"])
def test_eval_of_a_run_dir_says_which_model(final, world, tmp_path, capsys):
    """The newest checkpoint was cut short: eval takes the final model when the run has one, else the
    newest complete checkpoint, and says which in one line. In process (`kvdistill.cli.main`, the console
    script's dispatcher): the child-process path of the same resolution is `eval_only_incomplete_checkpoints`."""
    c = Ctx(world, tmp_path, lambda: None)
    run = run_dir(c, complete=(2,), cut=(4,), final=final)
    rc, out, err = run_in_process(ev(c, run), capsys)
    assert rc == 0, err[-2000:]
    said = (f"evaluating {run} (the run's final model)" if final else
            f"evaluating {run / 'checkpoint-2'} (newest complete checkpoint; the run has no final model)")
    assert said in out.splitlines()
    assert (c.out / "summary.json").is_file()


def over_an_old_final_model(c) -> list:
    """`--overwrite_output_dir` into a run dir holding a final model (a checkpoint's files at its top level),
    on a disk with room for 80 KB: the new weights fail halfway over the old ones."""
    shutil.copytree(c.checkpoint(), c.out)
    return c.train(overwrite_output_dir="true", save_strategy="no")


@pytest.mark.parametrize("argv", [pytest.param(over_an_old_final_model, id="over_a_final_model",
                                               marks=pytest.mark.subprocess(fsize_limit=80_000))])
def test_a_final_save_cut_short_over_an_old_one_is_no_final_model(argv, children, request):
    rc, _, err, ctx, _, _ = children.result(request.node.nodeid)
    assert_refused(rc, err, "train", ("no space left on the device", "out failed (File too large"))
    assert not (ctx.out / TRAIN_CONFIG).exists()  # the old model's marker went before the new weights began
    with pytest.raises(ConfigError, match="has no final model and no complete checkpoint"):
        resolve_model(ctx.out, "evaluating")
