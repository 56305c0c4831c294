"""A capture's identity is derived from the options' roles: changing any option that changes what a
teacher reads (`teacher_inputs`) or computes (`teacher_outputs`) makes an old capture refused."""

import json

import pytest

from kvdistill.config import ConfigError
from kvdistill.train.build import capture_settings, load_run
from kvdistill.train.config import KVDistillConfig, TeacherConfig, option_names, parse_config

SPLITS = ("train", "test")


@pytest.fixture(scope="module")
def data_dirs(tiny_world, tmp_path_factory):
    """Two data dirs with extra columns (a rephrased question, a teacher rationale); `b` holds `a`'s
    splits swapped, so pointing `data` at it changes the records."""
    root = tmp_path_factory.mktemp("identity_data")
    rows = {s: [json.loads(x) for x in (tiny_world.data_dir / f"{s}.jsonl").read_text().splitlines()] for s in SPLITS}
    for r in (r for split in rows.values() for r in split):
        r["question2"] = "Please solve: " + r["question"]
        r["rationale"] = "Step by step.\n" + r["answer"]
        r["text"] = f"{r['question']} {r['answer']}"  # auto reads question/answer; dataset_format text this
    for name, order in (("a", SPLITS), ("b", SPLITS[::-1])):
        (root / name).mkdir()
        for split, source in zip(SPLITS, order):
            (root / name / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[source]))
    return root / "a", root / "b"


def _teachers(tiny_world, first: str = "", second: str = "") -> str:
    m = tiny_world.models
    return f"[{{path: {m['qwen2_teacher']}{first}}}, {{path: {m['llama_teacher_alt_tok']}{second}}}]"


def _recipes(tiny_world, b) -> dict[str, tuple[dict, dict]]:
    """`{option: (settings it needs to act, a change of it)}` for every teacher_inputs/teacher_outputs option."""
    m = tiny_world.models
    swapped = (f"[{{path: {m['llama_teacher_alt_tok']}, name: qwen2_teacher}}, "
               f"{{path: {m['qwen2_teacher']}, name: llama_teacher_alt_tok}}]")
    keep = {"logit_kd_weight": 0, "capture_keep": 0.5}
    permuted = {"logit_kd_weight": 0, "teacher_control": "permuted", "permute": "numbers", "permute_vocab": "0..30"}
    return {
        "teachers": ({}, {"teachers": swapped}),
        "max_length": ({}, {"max_length": 120}),
        "key_space": ({}, {"key_space": "post_rope"}),
        "capture_dtype": ({}, {"capture_dtype": "bf16"}),
        "capture_layers": ({}, {"capture_layers": "mapped"}),
        "capture_keep": ({"logit_kd_weight": 0}, {"capture_keep": 0.5}),
        "capture_compression": (keep, {"capture_compression": "rkv"}),
        "compression_lambda": ({**keep, "capture_compression": "rkv"}, {"compression_lambda": 0.3}),
        "teacher_control": ({}, {"teacher_control": "untrained"}),
        "data": ({}, {"data": str(b)}),
        "data_split": ({}, {"data_split": "test"}),
        "field_map": ({}, {"field_map": "{question: question2, answer: answer}"}),
        "max_samples": ({}, {"max_samples": 12}),
        "dataset_format": ({}, {"dataset_format": "text"}),
        "transfer_data": ({}, {"transfer_data": str(b)}),
        "transfer_split": ({}, {"transfer_split": "train"}),
        "transfer_field_map": ({}, {"transfer_field_map": "{question: question2, answer: answer}"}),
        "transfer_max_samples": ({}, {"transfer_max_samples": 4}),
        "prompt_template": ({}, {"prompt_template": "Q: {question}\nA:"}),
        "use_chat_template": ({}, {"use_chat_template": True}),
        "teacher.path": ({}, {"teachers": swapped}),
        "teacher.name": ({}, {"teachers": _teachers(tiny_world, ", name: renamed")}),
        "teacher.dtype": ({}, {"teachers": _teachers(tiny_world, ", dtype: bf16")}),
        "teacher.quantization": ({}, {"teachers": _teachers(tiny_world, ", quantization: 8bit")}),
        "teacher.tokenizer": ({}, {"teachers": _teachers(tiny_world, second=", tokenizer: student")}),
        "teacher.rationale_field": ({"logit_kd_weight": 0}, {"teachers": _teachers(tiny_world, ", rationale_field: rationale")}),
        "teacher.logit_kd": ({}, {"teachers": _teachers(tiny_world, ", logit_kd: off")}),
        "teacher.control": ({}, {"teachers": _teachers(tiny_world, ", control: untrained")}),
        "teacher.template": ({}, {"teachers": _teachers(tiny_world, ', template: "Context only I read. {question}"')}),
        "permute": (permuted, {"permute_vocab": "0..15"}),
        "permute_vocab": (permuted, {"permute_vocab": "0..15"}),
    }


IDENTITY = [*(n for role in ("teacher_outputs", "teacher_inputs") for n in option_names(KVDistillConfig, affects=role)),
            *(f"teacher.{n}" for role in ("teacher_outputs", "teacher_inputs")
              for n in option_names(TeacherConfig, affects=role))]
NO_EFFECT_HERE = {"use_chat_template": "the tiny tokenizers have no chat template, so the option cannot act"}
# on-policy text changes every step: a run with it refuses teacher_capture, so no capture can be stale
NO_CAPTURE = {"lmbda", "temperature", "top_p", "max_new_tokens", "seq_kd"}


def test_every_identity_option_has_a_recipe(tiny_world, data_dirs):
    missing = set(IDENTITY) - set(_recipes(tiny_world, data_dirs[1])) - NO_CAPTURE
    assert not missing, (f"{sorted(missing)} change what teachers read or compute: add a recipe to _recipes "
                         "(settings it needs to act, a change of it) so a test proves an old capture is refused")
    assert set(_recipes(tiny_world, data_dirs[1])) <= set(IDENTITY)


@pytest.mark.parametrize("name", IDENTITY)
def test_changing_an_identity_option_refuses_an_old_capture(name, base_args, tiny_world, data_dirs):
    if name in NO_EFFECT_HERE:
        pytest.skip(NO_EFFECT_HERE[name])
    if name in NO_CAPTURE:
        with pytest.raises(ConfigError, match="teacher_capture"):  # never read from a capture
            parse_config(base_args(teacher_capture="c", **{"lmbda": 0.5} if name != "seq_kd" else {"seq_kd": True}))
        return
    a, b = data_dirs
    needs, change = _recipes(tiny_world, b)[name]
    args = {"max_samples": 16, "kv_weight": 1, "kv_loss": "relation", "logit_kd_weight": 1.0,
            "teachers": _teachers(tiny_world), "data": str(a), "transfer_data": str(a), "transfer_split": "test",
            "transfer_max_samples": 8, **needs}

    def settings(**kw):
        cfg = parse_config(base_args(**{**args, **kw}))
        return capture_settings(cfg, load_run(cfg, teacher_weights=False))

    before, after = settings(), settings(**change)
    assert before != after  # a capture stores its settings; an old one with other settings is refused
