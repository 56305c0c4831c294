"""The trainer pairs a teacher's tokens with the student's by characters when it reads the student's text in
other tokens (`align.time`), and proportionally where the texts differ (a shuffled control) or share tokens."""

import json

import pytest

from kvdistill.config import ConfigError
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config


@pytest.mark.parametrize("control, paired", [("none", True), ("shuffled", False)])
def test_teachers_reading_the_students_text_carry_their_char_ends(base_args, tiny_world, tmp_path, control, paired):
    m = tiny_world.models
    trainer = build_trainer(parse_config(base_args(
        teachers=f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}, control: {control}}}]",
        kv_weight=1.0, logit_kd_weight=0)))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    teacher_inputs = batch.pop("teacher_inputs")
    kvs, _ = trainer.teacher_targets(batch, teacher_inputs)
    assert kvs["qwen2_teacher"].char_ends is None  # the student's own tokens: nothing to pair
    other = kvs["llama_teacher_alt_tok"]
    if not paired:  # another record's text: its characters are not the student's
        assert other.char_ends is None
        return
    assert other.char_ends is not None and other.char_ends.equal(teacher_inputs["llama_teacher_alt_tok"]["char_ends"])
    # every student token with characters reads the teacher token that holds its last character
    student_ends = batch["char_ends"]  # [B, T_s]
    skv = type(other)(other.keys[:, :, :, :1].expand(-1, -1, -1, student_ends.shape[1], -1), other.values[:, :, :, :1]
                      .expand(-1, -1, -1, student_ends.shape[1], -1), batch["attention_mask"], batch["segment_ids"],
                      char_ends=student_ends)
    idx = trainer.distill_model.aligners["llama_teacher_alt_tok"].time_index(other, skv)
    t_ends = other.char_ends.gather(1, idx.lo)  # [B, T_s] the end of the teacher token each student token reads
    t_starts = other.char_ends.gather(1, (idx.lo - 1).clamp(min=0))
    has = (student_ends >= 0) & batch["attention_mask"].bool()
    assert ((t_ends >= student_ends) & ((idx.lo == 0) | (t_starts < student_ends)))[has].all()


def test_a_teacher_with_its_own_template_reads_a_prefix_the_student_never_pairs_with(base_args, tiny_world):
    """A teacher `template` (privileged few-shot context): the same tokenizer as the student, yet its own tokens;
    its KV pairs by characters (the prefix with no student token) and its logits teach cross-vocabulary."""
    m = tiny_world.models
    own = "Example: 2 + 2 = 4.\nQuestion: {question}\nAnswer:"
    trainer = build_trainer(parse_config(base_args(
        teachers=f"[{{path: {m['qwen2_teacher']}, template: {json.dumps(own)}}}]", kv_weight=1.0, logit_kd_weight=1.0)))
    teacher = trainer.teachers.teachers["qwen2_teacher"]
    assert not teacher.shares_student_tokens and teacher.same_text and teacher.logit_kd == "cross_vocab"
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    inputs = batch["teacher_inputs"]["qwen2_teacher"]
    assert (inputs["attention_mask"].sum(1) > batch["attention_mask"].sum(1)).all()  # it reads the prefix too
    kvs, logits = trainer.teacher_targets(batch, batch.pop("teacher_inputs"))
    kv = kvs["qwen2_teacher"]
    assert kv.char_ends is not None and (kv.char_ends == -2).sum(1).ge(8).all()  # the prefix: UNSHARED
    assert trainer.train().training_loss > 0 and "qwen2_teacher" in logits


@pytest.mark.parametrize("own", ["Examples first. Answer:", "{question} and again {question}"])
def test_a_teacher_template_without_one_question_is_refused_in_one_line(base_args, tiny_world, own):
    with pytest.raises(ConfigError, match=r"teacher qwen2_teacher: template must hold \{question\} once") as err:
        parse_config(base_args(teachers=f"[{{path: {tiny_world.models['qwen2_teacher']}, template: {json.dumps(own)}}}]"))
    assert "\n" not in str(err.value)


def test_a_teacher_template_on_policy_is_refused_not_dropped(base_args, tiny_world):
    teachers = f"[{{path: {tiny_world.models['qwen2_teacher']}, template: \"Hint.\\n{{{{question}}}}\"}}]"
    with pytest.raises(ConfigError, match="lmbda > 0: teacher qwen2_teacher has its own template"):
        parse_config(base_args(teachers=teachers, lmbda=0.5, logit_kd_weight=1.0, teacher_cache=False))
