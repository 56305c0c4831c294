"""On-policy distillation in the trainer: what each teacher reads, token counts, seeding, resume, the CLI."""

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from kvdistill.cache import PROMPT
from kvdistill.commands.train import main as train_main
from kvdistill.config import ConfigError
from kvdistill.onpolicy import tokenize_completion, write_completions
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config

ON_POLICY = {"lmbda": 1.0, "logit_kd_weight": 1.0, "logit_kd_kind": "jsd", "beta": 0.5, "kv_weight": 0.1,
             "temperature": 1.0, "max_new_tokens": 12}


@pytest.fixture
def two_tok_args(base_args, tiny_world):
    """base_args with two teachers: one sharing the student's tokenizer, one with another."""
    m = tiny_world.models
    teachers = f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}}}]"
    return lambda **kw: base_args(**{"teachers": teachers, **ON_POLICY, **kw})


@pytest.fixture
def trainer(two_tok_args):
    return build_trainer(parse_config(two_tok_args(per_device_train_batch_size=2)))


def _gold(trainer, n=2, start=0):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(start, start + n)])


def _completion_text(tok, enc, i):
    """Row `i`'s decoded text after the prompt, padding and special tokens dropped."""
    keep = enc["attention_mask"][i].bool() & (enc["segment_ids"][i] > 0)
    return tok.decode(enc["input_ids"][i][keep], skip_special_tokens=True)


def test_every_teacher_reads_the_students_completion_not_the_gold_one(trainer, monkeypatch):
    gold = _gold(trainer)
    written = trainer.written_batch(gold, 0, True)
    records = [trainer.train_dataset[i] for i in range(2)]
    args = trainer.args
    expected = write_completions(trainer.distill_model.student, trainer.processing_class, records,
                                 template=args.prompt_template, temperature=args.temperature, top_p=args.top_p,
                                 max_new_tokens=args.max_new_tokens, max_length=args.max_length,
                                 seed=trainer._sampling_seed(0))
    seen = {}
    forward = trainer.teachers.forward

    def spy(name, ids, mask, seg, **kw):
        seen[name] = {"input_ids": ids, "attention_mask": mask, "segment_ids": seg}
        return forward(name, ids, mask, seg, **kw)

    monkeypatch.setattr(trainer.teachers, "forward", spy)
    trainer.compute_loss(trainer.model, trainer._prepare_inputs(written))
    assert set(seen) == {"qwen2_teacher", "llama_teacher_alt_tok"}
    toks = {"qwen2_teacher": trainer.processing_class,
            "llama_teacher_alt_tok": trainer.teachers.teachers["llama_teacher_alt_tok"].tokenizer}
    for i, (r, e) in enumerate(zip(records, expected)):
        gold_text = r["answer"].split("####")[0].strip()
        assert _completion_text(trainer.processing_class, written, i) == e["answer"]
        for name, tok in toks.items():
            text = _completion_text(tok, seen[name], i)
            assert text == e["answer"], name  # what the student wrote...
            assert gold_text not in text
            real = seen[name]["attention_mask"][i].bool()
            sampled = tok is trainer.processing_class  # the student's tokens: the ids it sampled, not its text's
            own = tokenize_completion(tok, e, args.max_length, args.prompt_template, sampled=sampled)["input_ids"]
            assert torch.equal(seen[name]["input_ids"][i][real], own), name  # ...in this teacher's own tokens
            if sampled:
                assert own[-len(e["ids"]):].tolist() == e["ids"]
    assert not written["labelled"].any()  # no LM loss on the student's own text


def test_token_counts_are_the_global_completion_counts(trainer):
    gold = [_gold(trainer, 2, 0), _gold(trainer, 2, 2)]  # two micro-batches of one optimizer step
    samples, counts = trainer.get_batch_samples(iter(gold), 2, torch.device("cpu"))
    completion_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in samples)
    gold_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in gold)
    assert completion_tokens != gold_tokens
    assert counts[3] == completion_tokens  # logit KD normalised by what it is computed on
    assert counts[0] == 1  # no CE tokens (clamped to 1): the student's own text is not a label
    assert counts[1] == sum(int(trainer.distill_model.kv_mask(b["segment_ids"], b["attention_mask"]).sum())
                            for b in samples)


def test_completions_fit_max_length_for_every_reader(trainer):
    gold = _gold(trainer)
    n_prompt = int((gold["segment_ids"] == PROMPT).sum(1).max())
    trainer.args.max_length = n_prompt + 3  # max_new_tokens is 12: the budget must shrink to fit
    written = trainer.written_batch(gold, 0, True)
    for enc in (written, *written["teacher_inputs"].values()):
        assert enc["input_ids"].shape[1] <= n_prompt + 3
    assert (written["labels"] != -100).sum(1).min() >= 1  # every row still has a completion token


def test_same_step_samples_the_same_other_steps_and_ranks_differ(trainer, monkeypatch):
    gold = _gold(trainer)
    first = trainer.written_batch(gold, 0, True)
    assert torch.equal(first["input_ids"], trainer.written_batch(gold, 0, True)["input_ids"])  # a resume replays
    trainer.state.global_step = 5
    later = trainer.written_batch(gold, 0, True)
    monkeypatch.setattr(type(trainer.args), "process_index", property(lambda self: 1))
    other_rank = trainer.written_batch(gold, 0, True)
    texts = [[_completion_text(trainer.processing_class, b, i) for i in range(2)] for b in (first, later, other_rank)]
    assert texts[0] != texts[1] and texts[1] != texts[2]


def test_seq_kd_learns_the_first_teachers_text(two_tok_args):
    trainer = build_trainer(parse_config(two_tok_args(per_device_train_batch_size=2, lmbda=0.0, seq_kd="true")))
    gold = _gold(trainer)
    samples, _ = trainer.get_batch_samples(iter([gold]), 1, torch.device("cpu"))
    teacher = trainer.teachers.teachers["qwen2_teacher"]
    args = trainer.args
    expected = write_completions(teacher.model, teacher.tokenizer, [trainer.train_dataset[i] for i in range(2)],
                                 template=args.prompt_template, temperature=args.temperature, top_p=args.top_p,
                                 max_new_tokens=args.max_new_tokens, max_length=args.max_length,
                                 seed=trainer._sampling_seed(0))
    assert [_completion_text(trainer.processing_class, samples[0], i) for i in range(2)] == [
        e["answer"] for e in expected]
    assert samples[0]["labelled"].all()  # sequence-level KD: the teacher's text is learned as a label


@pytest.mark.parametrize("lmbda", [1.0, 0.5])
def test_cli_run_with_two_tokenizers(base_args, tiny_world, tmp_path, lmbda):
    # the on-policy options and teachers from a YAML file, the rest from the command line
    m = tiny_world.models
    (tmp_path / "onpolicy.yaml").write_text(yaml.safe_dump({
        **ON_POLICY, "lmbda": lmbda,
        "teachers": [{"path": str(m["qwen2_teacher"])}, {"path": str(m["llama_teacher_alt_tok"])}]}))
    out = tmp_path / "run"
    argv = base_args(output_dir=out, max_steps=4, logging_steps=1, per_device_train_batch_size=2,
                     gradient_accumulation_steps=2)
    i = argv.index("--teachers")
    assert train_main(["--config", str(tmp_path / "onpolicy.yaml"), *argv[:i], *argv[i + 2:]]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(rows) == 4 and all(r["logit_kd"] > 0 and r["kv_loss"] > 0 for r in rows)
    on = [r["on_policy"] for r in rows]
    assert on == [1.0] * 4 if lmbda == 1 else 0 < sum(on) < 4
    assert (out / "model.safetensors").exists()


def test_resume_replays_the_sampling(two_tok_args, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    kw = {"lmbda": 1.0, "max_steps": 4, "save_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 2,
          "max_new_tokens": 6, "max_samples": 8}
    assert train_main(two_tok_args(output_dir=full, **kw)) == 0
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    assert train_main(two_tok_args(output_dir=resumed, resume_from_checkpoint=resumed / "checkpoint-2", **kw)) == 0
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)


@pytest.mark.parametrize("overrides, match", [
    ({"lmbda": 1.5}, "lmbda"),
    ({"beta": -0.1}, "beta"),
    ({"temperature": 0.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"logit_kd_kind": "forward_kl", "beta": 0.2}, "beta applies to logit_kd_kind jsd"),
    ({"teacher_cache": "true"}, "teacher_cache"),
    # allow_kv_only: lmbda 1 without logit KD is refused on its own (the KV loss alone)
    ({"student_input": "no_rationale", "logit_kd_weight": 0.0, "allow_kv_only": True}, "student_input"),
    ({"kv_weight": 0.0, "logit_kd_weight": 0.0, "teachers": "[]"}, "teacher signal"),
])
def test_bad_on_policy_options_are_refused(two_tok_args, overrides, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(two_tok_args(**overrides))


def test_sharded_generation_is_refused_before_anything_loads(two_tok_args):
    with pytest.raises(ConfigError, match="FSDP"):
        parse_config(two_tok_args(fsdp="full_shard"))
