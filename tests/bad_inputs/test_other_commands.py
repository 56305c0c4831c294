"""`kvdistill ablate`, `demo`, `profile`, `dry-run` and `gen-data` refuse bad input in one line.

Each case: `pytest.param(argv builder, substrings of the error line, id=...)`.
"""

from __future__ import annotations

import pytest
import torch

SUBPROCESS = pytest.mark.subprocess
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the case is about a machine without CUDA")


def ablate(c, base: str | None = "student: s\nkv_weight: 0\n", **keys) -> list:
    """`kvdistill ablate --config ablation.yaml` with `keys` as YAML (and a base config unless None)."""
    lines = [f"output_dir: {c.out}", *(f"{k}: {v}" for k, v in keys.items())]
    if base is not None:
        lines.append(f"base_config: {c.file('base.yaml', base)}")
    return ["ablate", "--config", c.file("ablation.yaml", "\n".join(lines) + "\n")]


def profile(c, **overrides) -> list:
    """`kvdistill profile` args: the world's teacher and student, a JSON report into `c.out`."""
    args = {"teacher": c.world.teacher, "student": c.world.student, "json": c.out / "profile.json", **overrides}
    return ["profile", *(x for k, v in args.items() for x in (f"--{k}", v))]


ABLATE = [
    pytest.param(lambda c: ablate(c, base=None), ("`base_config:`", "is required"), id="ablate_without_base_config"),
    pytest.param(lambda c: ["ablate", "--config", c.file("a.yaml", "base_config: nowhere.yaml\n")],
                 ("base_config nowhere.yaml not found",), id="ablate_base_config_missing"),
    pytest.param(lambda c: ablate(c, base="student: [x\n"), ("base.yaml is not valid YAML at line", "fix the syntax"),
                 id="ablate_base_config_broken_yaml", marks=SUBPROCESS),
    pytest.param(lambda c: ablate(c, variants="[baseline, kv_fancy]"), ("kv_fancy",), id="ablate_unknown_variant"),
    pytest.param(lambda c: ablate(c, seeds="[1, 1]"), ("seeds must be a non-empty list of distinct ints",),
                 id="ablate_duplicate_seeds"),
    pytest.param(lambda c: ablate(c, eval="{splits: test}"), ("eval: unknown keys ['splits']", "allowed"),
                 id="ablate_unknown_eval_key"),
    pytest.param(lambda c: ablate(c, workers=0), ("workers and threads must be >= 1",), id="ablate_workers_0"),
]

DEMO = [
    pytest.param(lambda c: ["demo", "--gate", "2", "--output_dir", c.out], ("gate 2.0 is not an accuracy",
                                                                           "between 0 and 1"),
                 id="demo_gate_above_1", marks=SUBPROCESS),
    pytest.param(lambda c: ["demo", "--workers", "0", "--output_dir", c.out], ("workers must be >= 1, got 0",),
                 id="demo_workers_0"),
    pytest.param(lambda c: ["demo", "--quick", "--output_dir", c.file("out", "a file")],
                 ("output_dir", "is a file, not a directory"), id="demo_output_dir_is_a_file"),
]

PROFILE = [
    pytest.param(lambda c: ["profile", "--student", c.world.student], ("pass both --teacher and --student",),
                 id="profile_without_teacher"),
    pytest.param(lambda c: profile(c, batch_size=0), ("need --batch_size >= 1", "got 0"), id="profile_batch_size_0",
                 marks=SUBPROCESS),
    pytest.param(lambda c: profile(c, max_length=0), ("--max_length >= 8",), id="profile_max_length_0"),
    pytest.param(lambda c: profile(c, mode="diagonal"), ("mode='diagonal' is not one of",), id="profile_unknown_mode"),
    pytest.param(lambda c: profile(c, loss="l3"), ("loss='l3' is not one of", "mercator"), id="profile_unknown_loss"),
    pytest.param(lambda c: profile(c, dtype="fp8"), ("unknown dtype 'fp8'",), id="profile_unknown_dtype"),
    pytest.param(lambda c: profile(c, layer_map=c.file("trunc.json", '{"format": "kvdistill.layer_map/v1", "ma')),
                 ("trunc.json is not valid JSON", "write it again with `kvdistill layer-map`"),
                 id="profile_layer_map_truncated"),
    pytest.param(lambda c: profile(c, teacher=c.model("teacher", drop=("tokenizer.json", "tokenizer_config.json"))),
                 ("teacher_copy holds no tokenizer",), id="profile_teacher_without_tokenizer"),
    pytest.param(lambda c: profile(c, max_length=4096), ("--max_length 4096 is longer than the 512 positions",),
                 id="profile_max_length_longer_than_the_model"),
    pytest.param(lambda c: profile(c, device="cuda"), ("sees no CUDA GPU", "--device cpu"),
                 id="profile_device_without_cuda", marks=NO_CUDA),
]

def dry_run(c, **overrides) -> list:
    """`kvdistill dry-run` args: the world's student and teacher, a KV run, its report into `c.out`."""
    args = {"student": c.world.student, "teachers": f"[{{path: {c.world.teacher}}}]", "kv_weight": 0.1,
            "output_dir": c.out, **overrides}
    return ["dry-run", *(x for k, v in args.items() for x in (f"--{k}", v))]


TRUNCATED_CONFIG = '{"model_type": "qwen2", "hidden_si'
DRY_RUN = [
    pytest.param(lambda c: dry_run(c, teachers=f"[{{path: {c.file('t/config.json', TRUNCATED_CONFIG).parent}}}]"),
                 ("t/config.json is not a model config transformers can read", "not a valid JSON file",
                  "copy the model's config.json again"), id="dry_run_teacher_config_not_json"),
    pytest.param(lambda c: dry_run(c, output_dir=c.file("out", "a file")), ("output_dir", "is a file, not a directory"),
                 id="dry_run_output_dir_is_a_file"),
]

GEN_DATA = [
    pytest.param(lambda c: ["gen-data", "--output_dir", c.out, "--max_value", "1"], ("max_value >= 2",),
                 id="gen_data_max_value_1"),
    pytest.param(lambda c: ["gen-data", "--output_dir", c.out, "--n_train", "600", "--max_value", "2",
                            "--min_steps", "1", "--max_steps", "1"], ("could only make", "raise max_value"),
                 id="gen_data_more_problems_than_exist"),
    pytest.param(lambda c: ["gen-data", "--output_dir", c.file("out", "a file")], ("is a file, not a directory",),
                 id="gen_data_output_dir_is_a_file"),
]


@pytest.mark.parametrize("argv, expect", [*ABLATE, *DEMO, *PROFILE, *DRY_RUN, *GEN_DATA])
def test_command_refuses(argv, expect, refused):
    refused(argv, expect)
