"""`kvdistill train` (and `capture`, which reads the same config) refuses bad input in one line.

Each case: `pytest.param(argv builder, substrings of the error line, id=...)`; the builder gets a
`Ctx` (the tiny world, the case's temp dir, `ctx.out` where nothing may be left).
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

from kvdistill.align.layer_map import LAYER_MAP_FORMAT

LONG_QUESTION = "Tom has 3 apples and gives 1 away, then buys 2 more at the shop. " * 76  # > 1,300 tokens
NO_MARKER = {"question": "Sam has 2 pens and buys 2 more. How many pens?", "answer": "2 + 2 = 4.\nSo Sam has 4."}
SUBPROCESS = pytest.mark.subprocess
FULL_DISK = pytest.mark.subprocess(fsize_limit=4096)  # a write past 4 KiB fails: a full disk
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the case is about a machine without CUDA")
NO_BNB = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed")


def layer_map_file(c, name: str, L_s: int, L_t: int, **provenance) -> str:
    """A valid layer-map JSON `[L_s, L_t]` (one-hot rows) with `provenance`."""
    rows = [[1.0 if t == round(s * (L_t - 1) / max(L_s - 1, 1)) else 0.0 for t in range(L_t)] for s in range(L_s)]
    doc = {"format": LAYER_MAP_FORMAT, "student_layers": L_s, "teacher_layers": L_t, "matrix": rows,
           "provenance": provenance}
    return str(c.file(name, json.dumps(doc)))


def resume(c, damage=None, **overrides) -> list:
    """Train args resuming from a copy of the session's checkpoint, damaged by `damage(copy)`."""
    ckpt = c.tmp / "checkpoint-1"
    shutil.copytree(c.checkpoint(), ckpt)
    if damage:
        damage(ckpt)
    args = {"kv_weight": 0.1, "teachers": c.teachers(c.world.teacher), "max_steps": 2, **overrides}
    return c.train(resume_from_checkpoint=ckpt, **args)


def truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def kv(c, *paths, **overrides) -> list:
    """Train args of a KV run with these teachers (default: the world's teacher)."""
    return c.train(kv_weight=0.1, teachers=c.teachers(*(paths or [c.world.teacher])), **overrides)


def cka(c, layer_map) -> list:
    """Train args of a KV run whose teacher reads the layer map at `layer_map`."""
    return c.train(kv_weight=0.1, layer_map="cka", teachers=c.teachers(c.world.teacher, layer_map=layer_map))


def edited(c, which: str, config_from: str | None = None, **changes) -> str:
    """A model dir of world model `which`: its files linked, its config.json that of `config_from` (another
    world model) or its own, with `changes` merged in."""
    src, path = getattr(c.world, which), c.tmp / f"{which}_edited"
    path.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (path / f.name).symlink_to(f)
    config = json.loads((getattr(c.world, config_from or which) / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return str(path)


# the world teacher (Qwen2, 4 layers) with 64-token sliding windows on its first two layers
WINDOWED = {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0,
            "layer_types": ["sliding_attention"] * 2 + ["full_attention"] * 2}


NO_TOKENIZER = ("tokenizer.json", "tokenizer_config.json")

CONFIG = [
    pytest.param(lambda c: ["train", "--config", c.tmp / "missing.yaml"],
                 ("missing.yaml: no such file", "existing YAML file"), id="config_file_missing"),
    pytest.param(lambda c: ["train", "--config", c.file("broken.yaml", "student: x\nteachers: [a, b\nkv_weight: 1\n")],
                 ("broken.yaml is not valid YAML at line", "fix the syntax"), id="config_broken_yaml",
                 marks=SUBPROCESS),
    pytest.param(lambda c: ["train", "--config", c.file("latin1.yaml", b"student: caf\xe9\n")],
                 ("latin1.yaml is not UTF-8", "save it as UTF-8"), id="config_not_utf8"),
    pytest.param(lambda c: ["train", "--config", c.file("list.yaml", "- a\n- b\n")],
                 ("list.yaml holds a list, not a mapping", "option: value"), id="config_not_a_mapping"),
    pytest.param(lambda c: ["train", "--config", c.file("typo.yaml", "kv_wieght: 0.1\n")],
                 ("typo.yaml: unknown key 'kv_wieght'", "did you mean 'kv_weight'"), id="config_unknown_key"),
    pytest.param(lambda c: [*c.train(), "--kv_wieght", "1"],
                 ("unknown option --kv_wieght", "did you mean 'kv_weight'"), id="unknown_option"),
    pytest.param(lambda c: [*c.train(), "--max_steps", "3", "4"],
                 ("values without an option: ['4']", "each option takes one value"), id="stray_value"),
    pytest.param(lambda c: c.train(max_steps="ten"), ("--max_steps", "invalid int value: 'ten'"),
                 id="number_not_a_number"),
    pytest.param(lambda c: c.train(kv_loss="l3"), ("kv_loss='l3' is not one of", "mercator"), id="unknown_kv_loss"),
    pytest.param(lambda c: c.train(optim="adamw_fast"), ("--optim", "invalid choice: 'adamw_fast'"),
                 id="unknown_optimizer"),
    pytest.param(lambda c: c.train(kv_weight=-1), ("kv_weight must be >= 0",), id="negative_kv_weight"),
    pytest.param(lambda c: c.train(max_length=0), ("max_length 0 leaves no room", "max_length >= 8"),
                 id="max_length_0"),
    pytest.param(lambda c: c.train(max_steps=0), ("max_steps 0 would still run one step", "max_steps >= 1"),
                 id="max_steps_0"),
    pytest.param(lambda c: c.train(per_device_train_batch_size=0), ("per_device_train_batch_size must be >= 1",),
                 id="batch_size_0"),
    pytest.param(lambda c: c.train(gradient_accumulation_steps=0), ("gradient_accumulation_steps must be >= 1",),
                 id="grad_accumulation_0"),
    pytest.param(lambda c: c.train(learning_rate=-0.001), ("learning_rate must be > 0",), id="negative_learning_rate"),
    pytest.param(lambda c: c.train(max_samples=0), ("max_samples must be >= 1, got 0",), id="max_samples_0"),
    pytest.param(lambda c: c.train(fp16="true"), ("fp16 mixed precision needs a CUDA GPU", "--bf16"),
                 id="fp16_on_cpu", marks=NO_CUDA),
    pytest.param(lambda c: c.train(student_input="latent:0"), ("student_input 'latent:0' is not one of", "latent:N"),
                 id="student_input_latent_0"),
    pytest.param(lambda c: kv(c, lmbda=1, max_new_tokens=8),
                 ("lmbda 1 puts every step on-policy", "allow_kv_only: true"), id="lmbda_1_without_logit_kd"),
    pytest.param(lambda c: kv(c, segment_weights="{prompt: -1}"),
                 ("segment_weights prompt: -1 is not a weight >= 0", "0 leaves it out"), id="segment_weight_negative"),
    pytest.param(lambda c: kv(c, segment_weights="{promt: 0}"),
                 ("segment_weights: unknown segment 'promt'", "did you mean 'prompt'"), id="segment_weight_typo"),
    pytest.param(lambda c: c.train(kv_weight=0.1, teachers="null"), ("need at least one teacher", "kv_weight: 0"),
                 id="teachers_null_is_no_teacher"),
]

TEACHERS = [
    pytest.param(lambda c: c.train(kv_weight=0.1, teachers=f"[{{path: {c.world.teacher}, name: a}}, "
                                                           f"{{path: {c.world.teacher}, name: b, weight: 2}}]"),
                 ("is listed twice with the same settings", "list it once"), id="same_teacher_under_two_names"),
    pytest.param(lambda c: kv(c, c.tmp / "no_such_teacher"), ("no_such_teacher' does not exist", "Hub id"),
                 id="teacher_missing"),
    pytest.param(lambda c: c.train(kv_weight=0.1), ("need at least one teacher", "kv_weight: 0"),
                 id="kv_weight_without_a_teacher"),
    pytest.param(lambda c: kv(c, c.file("teacher.bin", "weights")),
                 ("teacher.bin is a file, not a model directory", "config.json"), id="teacher_path_is_a_file"),
    pytest.param(lambda c: kv(c, c.model("teacher", drop=NO_TOKENIZER)),
                 ("teacher_copy holds no tokenizer", "save_pretrained"), id="teacher_without_tokenizer"),
    pytest.param(lambda c: c.train(kv_weight=0.1, teachers=c.teachers(c.world.teacher, dtype="fp8")),
                 ("unknown dtype 'fp8'", "choose one of"), id="teacher_unknown_dtype"),
    pytest.param(lambda c: c.train(kv_weight=0.1, teachers=c.teachers(c.world.teacher, quantization="4bit")),
                 ("needs bitsandbytes", "pip install"), id="teacher_4bit_without_bitsandbytes", marks=NO_BNB),
    pytest.param(lambda c: c.train(kv_weight=0.1, teachers=c.teachers(c.world.teacher, tokenizer=c.world.alt_tokenizer)),
                 ("tokenizer of teacher qwen2_teacher has 461 tokens but the model embeds only 320",
                  "use the tokenizer the model was trained with"),
                 id="teacher_tokenizer_beyond_its_vocabulary"),
    pytest.param(lambda c: cka(c, c.file("trunc.json", f'{{"format": "{LAYER_MAP_FORMAT}", "student_la')),
                 ("trunc.json is not valid JSON", "re-run `kvdistill layer-map`"), id="layer_map_truncated"),
    pytest.param(lambda c: cka(c, layer_map_file(c, "m23.json", 2, 3)),
                 ("is for a teacher with 3 layers", "has 4", "re-run `kvdistill layer-map`"),
                 id="layer_map_of_other_layer_counts"),
    pytest.param(lambda c: cka(c, layer_map_file(c, "other.json", 2, 4, student_config_hash="0123456789abcdef")),
                 ("other.json was computed for another student model", "--ignore_layer_map_hash"),
                 id="layer_map_of_another_model_pair"),
    pytest.param(lambda c: kv(c, c.world.student), ("is the student itself", "--allow_self_teacher"),
                 id="teacher_is_the_student"),
    pytest.param(lambda c: kv(c, edited(c, "teacher", **WINDOWED)),
                 ("teacher teacher_edited", "sliding window of 64 tokens", "set max_length <= 63"),
                 id="max_length_beyond_a_sliding_window"),
    pytest.param(lambda c: kv(c, c.world.teacher_alt_tok, time_mode="index"),
                 ("time_mode index", "llama_teacher_alt_tok", "time_mode segment"), id="time_mode_index_two_tokenizers"),
]

MODELS = [
    pytest.param(lambda c: c.train(student=c.model(drop=NO_TOKENIZER)),
                 ("student_copy holds no tokenizer", "save_pretrained"), id="student_without_tokenizer"),
    pytest.param(lambda c: c.train(student=c.model(truncate="model.safetensors")),
                 ("its weights are damaged or incomplete", "save or copy the model again"),
                 id="student_truncated_safetensors"),
    pytest.param(lambda c: c.train(student=c.world.gpt2, max_length=2048,  # GPT-2 indexes past its position table
                                   data=c.data({"question": LONG_QUESTION, "answer": "#### 4"})),
                 ("max_length 2048 is longer than the 512 positions", "set max_length <= 512"),
                 id="sequence_longer_than_the_model"),
    pytest.param(lambda c: c.train(student=edited(c, "student", config_from="teacher_alt_tok")),
                 ("student_edited", "belong to another architecture than its config.json"),
                 id="config_json_of_another_architecture"),
]

DATA = [
    pytest.param(lambda c: c.train(data=c.tmp / "missing.jsonl"), ("missing.jsonl", "check the path"),
                 id="data_file_missing"),
    pytest.param(lambda c: c.train(data=c.data(split="dev")), ("no train.jsonl", "write one"),
                 id="data_dir_without_the_split"),
    pytest.param(lambda c: c.train(data=c.data('{"question": "2+2?", "answer": ')),
                 ("train.jsonl line 4 is not valid JSON", "fix or remove that line"), id="data_malformed_jsonl",
                 marks=SUBPROCESS),
    pytest.param(lambda c: c.train(data=c.data(b'{"question": "caf\xe9?", "answer": "#### 1"}')),
                 ("train.jsonl line 4 is not UTF-8", "save the file as UTF-8"), id="data_not_utf8"),
    pytest.param(lambda c: c.train(data=c.data('["2+2?", "#### 4"]')),
                 ("train.jsonl line 4 holds a JSON list, not an object",), id="data_line_not_an_object"),
    pytest.param(lambda c: c.train(data=c.data({"question": "What is 2 + 2?"})),
                 ("train.jsonl line 4 has no 'answer' value", "give every record one"), id="data_record_without_answer"),
    pytest.param(lambda c: c.train(data=c.data(NO_MARKER, good=0)),
                 ("train.jsonl line 1: its answer has 2 lines and no '####' marker", "end every answer with '#### "),
                 id="data_answer_without_marker"),
    pytest.param(lambda c: c.train(data=c.data({"question": "2+2?", "answer": "2 + 2 = 4.\n####"})),
                 ("line 4 has no final answer", "#### 42"), id="data_answer_marker_without_final"),
    pytest.param(lambda c: c.train(data=c.data({"question": " ", "answer": "#### 4"})),
                 ("train.jsonl line 4 has an empty 'question'",), id="data_empty_question"),
    pytest.param(lambda c: c.train(data=c.data(good=0)), ("holds no train records", "at least one"),
                 id="data_empty_file"),
    pytest.param(lambda c: kv(c, c.world.teacher_alt_tok, data=c.data(NO_MARKER, good=0)),
                 ("no '####' marker", "end every answer with"), id="data_without_marker_cross_tokenizer_teacher"),
]

OUTPUT_AND_RESUME = [
    pytest.param(lambda c: c.train(output_dir=c.file("out", "not a dir")), ("output_dir", "is a file, not a directory"),
                 id="output_dir_is_a_file"),
    pytest.param(lambda c: c.train(), ("output_dir", "is not writable (File too large)", "free space"),
                 id="output_dir_full", marks=FULL_DISK),
    pytest.param(lambda c: c.train(resume_from_checkpoint=c.tmp / "checkpoint-9"),
                 ("checkpoint-9 does not exist", "`last`"), id="resume_missing_checkpoint"),
    pytest.param(lambda c: resume(c, teachers=c.teachers(c.world.teacher_alt_tok)),
                 ("was trained with teachers", "resume with the same teachers"),
                 id="resume_checkpoint_of_other_teachers"),
    pytest.param(lambda c: resume(c, damage=lambda p: truncate(p / "model.safetensors")),
                 ("cannot be read", "resume from another checkpoint"), id="resume_truncated_checkpoint"),
    pytest.param(lambda c: resume(c, damage=lambda p: (p / "checkpoint_complete.json").unlink()),
                 ("is incomplete", "resume from an earlier checkpoint"), id="resume_incomplete_checkpoint"),
]

CAPTURE = [
    pytest.param(lambda c: ["capture", *kv(c)[1:]], ("set --teacher_capture DIR",), id="capture_without_directory",
                 marks=SUBPROCESS),
    pytest.param(lambda c: ["capture", *c.train(teachers=c.teachers(c.world.teacher), teacher_capture=c.out / "cap")[1:]],
                 ("nothing to capture",), id="capture_without_teacher_signal"),
    pytest.param(lambda c: ["capture", *kv(c, teacher_capture=c.file("cap", "x"))[1:]],
                 ("teacher_capture", "is a file, not a directory"), id="capture_directory_is_a_file"),
    pytest.param(lambda c: kv(c, teacher_capture=c.tmp / "nocap"), ("no capture at", "run `kvdistill capture`"),
                 id="train_from_missing_capture"),
    pytest.param(lambda c: kv(c, teacher_capture=c.file("cap/qwen2_teacher/manifest.json", '{"settings": {"te').parents[1]),
                 ("manifest.json cannot be read", "capture again"), id="train_from_damaged_capture"),
    pytest.param(lambda c: kv(c, teacher_capture=c.tmp / "cap", fusion="correctness"),
                 ("captured teacher", "use loss_sum or learned"), id="capture_with_correctness_fusion"),
]


@pytest.mark.parametrize("argv, expect", [*CONFIG, *TEACHERS, *MODELS, *DATA, *OUTPUT_AND_RESUME, *CAPTURE])
def test_train_refuses(argv, expect, refused):
    refused(argv, expect)
