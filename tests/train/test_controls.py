"""The oracle, permuted and other_task controls in a run: config refusals, the oracle trained end to end,
the permuted teacher's view and captures, the other_task label from train_summary to ablate's report."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml

from kvdistill.capture import CaptureError
from kvdistill.commands import capture as capture_cmd
from kvdistill.commands.ablate import load_ablation_config, run_ablation
from kvdistill.config import ConfigError
from kvdistill.controls import TextPermutation
from kvdistill.data import DataError
from kvdistill.teachers import is_captured
from kvdistill.train.build import build_trainer, load_run
from kvdistill.train.config import parse_config


def binding_data(root: Path, n: int = 16) -> Path:
    """Programs `b=7. k=b. q=4. m=q. What is k?` with each variable token's chain as field `chain`."""
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        a, b, c, d = rng.sample("bkqmzxyw", 4)
        v1, v2 = rng.randint(0, 9), rng.randint(0, 9)
        q, spans = "", []
        for lhs, rhs, chain in ((a, str(v1), 0), (b, a, 0), (c, str(v2), 1), (d, c, 1)):
            spans.append([len(q), len(q) + 1, chain])
            if rhs.isalpha():
                spans.append([len(q) + 2, len(q) + 3, chain])
            q += f"{lhs}={rhs}. "
        q += f"What is {b}?"
        spans.append([len(q) - 2, len(q) - 1, 0])
        rows.append({"question": q, "answer": f"#### {v1}", "token_fields": {"chain": spans}})
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


ORACLE = {"kv_loss": "relation", "kv_weight": 1.0, "relation_heads": 1, "relation_compile": False, "teacher_control": "oracle",
          "oracle_field": "chain", "max_steps": 3, "logging_steps": 1}


@pytest.mark.parametrize("change, match", [
    ({**ORACLE, "logit_kd_weight": 1.0}, "oracle has no logits"),
    ({**ORACLE, "kv_loss": "attention"}, "oracle is a key/value target"),
    ({**ORACLE, "teacher_capture": "somewhere"}, "oracle runs no teacher"),
    ({"teacher_control": "oracle", "kv_weight": 0.0}, "controls a teacher signal"),
    ({"teacher_control": "permuted"}, "permute must be one of"),
    ({"teacher_control": "permuted", "permute": "names", "permute_vocab": "[a]"}, "at least 2"),
    ({"teacher_control": "permuted", "permute": "numbers", "permute_vocab": "0..9", "logit_kd_weight": 1.0},
     "permuted teacher does not read"),
    ({"permute": "numbers", "permute_vocab": "0..9"}, "only with teacher_control: permuted"),
    ({"teacher_control": "other_task", "kv_weight": 0.0}, "controls a teacher signal"),
])
def test_impossible_combinations_are_refused_in_one_line(base_args, change, match):
    with pytest.raises(ConfigError, match=match) as err:
        parse_config(base_args(**change))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("loss", [{}, {"kv_loss": "cosine", "relation_heads": 8, "key_space": "pre_rope",
                                      "direction": "student_to_teacher", "relation_rows": "field:chain"}])
def test_oracle_run_trains_end_to_end_on_the_class_field(base_args, tmp_path, loss):
    """The oracle as a relation target, and as a per-token code an element loss reads through the projector
    (one head holds the code whatever relation_heads says: only the relation loss splits heads)."""
    data = binding_data(tmp_path / "binding")
    trainer = build_trainer(parse_config(base_args(data=str(data), **{**ORACLE, **loss})))
    assert all(is_captured(t) for t in trainer.teachers)  # the oracle reads no teacher weights
    assert trainer.oracle_width == 2  # chains 0 and 1
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    kvs, logits = trainer.teacher_targets(batch, batch.get("teacher_inputs", {}), batch["token_fields"])
    L_t = trainer.teachers.teachers[trainer.teachers.names[0]].model.config.num_hidden_layers
    classes = batch["token_fields"]["chain"]  # [B, T], in the student's tokens
    for kv in kvs.values():
        assert kv.keys.shape == (L_t, *classes.shape[:1], 1, *classes.shape[1:], 2) and not logits
        code = kv.keys[0, :, 0]  # [B, T, C]: one-hot of the class, zero without one
        assert torch.equal(code.argmax(-1)[classes >= 0], classes[classes >= 0])
        assert torch.all(code[classes < 0] == 0)
    trainer.train()
    rows = [h for h in trainer.state.log_history if "loss" in h]
    assert len(rows) == 3 and all(r["kv_loss"] > 0 and torch.isfinite(torch.tensor(r["loss"])) for r in rows)


def test_oracle_run_without_the_field_is_refused(base_args, tiny_world):
    with pytest.raises(DataError, match="field 'chain', which record 0 lacks"):
        build_trainer(parse_config(base_args(data=str(tiny_world.data_dir), **ORACLE)))


RELATION = {"kv_loss": "relation", "kv_weight": 1.0, "relation_heads": 1, "relation_compile": False, "max_samples": 8,
            "max_steps": 2}
PERMUTED = {**RELATION, "teacher_control": "permuted", "permute": "numbers", "permute_vocab": "0..99"}


def test_permuted_teacher_reads_the_mapped_text_and_the_student_the_original(base_args, tmp_path):
    run = load_run(parse_config(base_args(**PERMUTED)))
    plain = load_run(parse_config(base_args(**RELATION)))
    batch, ref = run.collator(run.records[:2]), plain.collator(plain.records[:2])
    assert torch.equal(batch["input_ids"], ref["input_ids"])  # the student's input is unchanged
    perm = TextPermutation.seeded("numbers", "0..99", seed=0)
    t = run.teachers[0]
    view = batch["teacher_inputs"][t.name]
    text = t.tokenizer.decode(view["input_ids"][0][view["attention_mask"][0].bool()])
    assert perm(run.records[0])["question"] in text and run.records[0]["question"] not in text


def test_a_capture_made_under_one_control_is_refused_for_another(base_args, tmp_path):
    def argv(options: dict, capture: str) -> list[str]:
        return base_args(**{**options, "teacher_capture": str(tmp_path / capture)})

    capture_cmd.run_capture(parse_config(argv(PERMUTED, "permuted")), log=lambda _: None)
    capture_cmd.run_capture(parse_config(argv(RELATION, "plain")), log=lambda _: None)
    for options, capture in ((RELATION, "permuted"), (PERMUTED, "plain"), ({**PERMUTED, "seed": 1}, "permuted")):
        with pytest.raises(CaptureError, match=r"does not match this run: .*tokens"):
            build_trainer(parse_config(argv(options, capture)))
    build_trainer(parse_config(argv(PERMUTED, "permuted"))).train()  # its own capture serves it


def test_other_task_control_is_labelled_in_summary_card_and_report(base_args, tiny_world, tmp_path):
    """A real tiny ablation (training in process, a stub eval): the control's label reaches the report."""
    args = base_args(**RELATION)
    base = {k.removeprefix("--"): yaml.safe_load(v) for k, v in zip(args[::2], args[1::2])}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(base))
    other = {"teacher_control": "other_task", "teachers": [{"path": str(tiny_world.models["llama_teacher"])}]}
    (tmp_path / "ablation.yaml").write_text(yaml.safe_dump({
        "base_config": "train.yaml", "output_dir": str(tmp_path / "out"), "seeds": [0], "n_resamples": 100,
        "variants": ["relation", {"name": "other", "base": "relation", "overrides": other,
                                  "label": "+Relation, depth-1 teacher"}]}))

    def stub_eval(model_dir: str, out_dir: str, settings) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "items.jsonl").write_text(json.dumps({"index": 0, "correct": True}) + "\n")
        (out / "summary.json").write_text(json.dumps({"accuracy": 1.0, "ci_low": 0, "ci_high": 1, "n": 1}))

    report = run_ablation(load_ablation_config(tmp_path / "ablation.yaml"), eval_fn=stub_eval, log=lambda _: None)
    rdir = tmp_path / "out" / "runs" / "other" / "seed_0"
    assert json.loads((rdir / "train_summary.json").read_text())["teacher_control"] == "other_task"
    assert yaml.safe_load((rdir / "kvdistill_config.yaml").read_text())["teacher_control"] == "other_task"
    assert "**Control run** (`teacher_control: other_task`)" in (rdir / "README.md").read_text()
    row = report["variants"]["other"]
    assert row["teacher_control"] == "other_task"
    assert row["label"] == "+Relation, depth-1 teacher [control: other-task teacher]"
    assert "| +Relation, depth-1 teacher [control: other-task teacher] |" in (tmp_path / "out" / "ablation.md").read_text()
    assert report["variants"]["relation"]["label"] == "+Relation"  # not a control: no tag
