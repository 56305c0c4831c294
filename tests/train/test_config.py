"""Config: YAML + CLI, defaults of the seed prototype, errors before any model loads."""

import json

import pytest
import yaml

from kvdistill.runs import differing
from kvdistill.train.config import BOOKKEEPING, ConfigError, KVDistillConfig, parse_config
from kvdistill.train.trainer import kv_warmup_factor


def test_yaml_plus_cli_override(tiny_world, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "student": str(tiny_world.models["student"]),
        "teachers": [{"path": str(tiny_world.models["qwen2_teacher"]), "weight": 2.0}],
        "learning_rate": 3e-4, "kv_weight": 0.2,
    }))
    cfg = parse_config(["--config", str(path), "--learning_rate", "1e-4", "--output_dir", str(tmp_path / "o")])
    assert cfg.learning_rate == 1e-4 and cfg.kv_weight == 0.2
    assert cfg.teacher_configs[0].weight == 2.0 and cfg.teacher_configs[0].name == "qwen2_teacher"


def test_seed_prototype_defaults(tiny_world):
    cfg = parse_config(["--student", str(tiny_world.models["student"]), "--kv_weight", "0"])
    assert (cfg.max_length, cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps) == (512, 2, 16)
    assert (cfg.max_steps, cfg.weight_decay, cfg.learning_rate, cfg.aligner_learning_rate) == (1000, 0.01, 5e-5, 1e-3)


@pytest.mark.parametrize("value", ["tensorboard,wandb", "[tensorboard, wandb]"])
def test_report_to_takes_several_names_on_the_cli(tiny_world, value):
    cfg = parse_config(["--student", str(tiny_world.models["student"]), "--kv_weight", "0", "--report_to", value])
    assert cfg.report_to == ["tensorboard", "wandb"]


@pytest.mark.parametrize("argv, match", [
    (["--kv_wieght", "1"], "did you mean 'kv_weight'"),
    (["--kv_weight", "-1"], "kv_weight must be >= 0"),
    (["--time_mode", "warp"], "time_mode"),
    (["--teachers", "[{path: /no/such/teacher}]"], "does not exist"),
    (["--teachers", "[{path: /tmp, wieght: 1}]"], "did you mean 'weight'"),
    (["--ce_weight", "0"], "allow_kv_only"),
    (["--kv_loss", "structural"], "head_mode: structured"),
    (["--accuracy_stop", "0.9"], "set accuracy_eval_steps > 0"),
])
def test_bad_config_fails_with_a_fix(tiny_world, argv, match, monkeypatch):
    import kvdistill.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    base = ["--student", str(tiny_world.models["student"]),
            "--teachers", f"[{{path: {tiny_world.models['qwen2_teacher']}}}]"]
    with pytest.raises(ConfigError, match=match):
        parse_config(base + argv)


def test_unknown_yaml_key_suggests(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("studnet: x\n")
    with pytest.raises(ConfigError, match="did you mean 'student'"):
        parse_config(["--config", str(path)])


def test_layer_map_for_other_models_fails_early(tiny_world, tmp_path):
    lm = tmp_path / "map.json"
    lm.write_text(json.dumps({"student_layers": 5, "teacher_layers": 4, "matrix": [[1, 0, 0, 0]] * 5}))
    with pytest.raises(ConfigError, match="re-run `kvdistill layer-map`"):
        parse_config(["--student", str(tiny_world.models["student"]), "--layer_map", "cka",
                      "--teachers", f"[{{path: {tiny_world.models['qwen2_teacher']}, layer_map: {lm}}}]"])


def test_warmup_schedule():
    assert [kv_warmup_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert kv_warmup_factor(0, 0) == 1.0


def test_config_is_training_arguments(tiny_world):
    from transformers import TrainingArguments

    cfg = parse_config(["--student", str(tiny_world.models["student"]), "--kv_weight", "0"])
    assert isinstance(cfg, KVDistillConfig) and isinstance(cfg, TrainingArguments)
    assert yaml.safe_load(yaml.safe_dump(cfg.to_yaml_dict()))["student"] == str(tiny_world.models["student"])


def test_differing_settings_ignore_bookkeeping_and_options_newer_than_the_run():
    saved = {"kv_weight": 0.1, "max_steps": 10, "output_dir": "a", "save_steps": 5, "old_option": 1}
    now = {"kv_weight": 0.1, "max_steps": 20, "output_dir": "b", "save_steps": 9, "new_option": True}
    assert differing(saved, now, BOOKKEEPING) == ["max_steps", "new_option", "old_option"]
    assert differing(saved, now, BOOKKEEPING, common_only=True) == ["max_steps"]
    assert differing(saved, {**saved, "teacher_capture": "c", "report_to": "none"}, BOOKKEEPING) == []


# ---- option roles (one declaration per option: what it changes, its card section, its valid range)

def _own_fields(cls):
    import inspect
    from dataclasses import fields

    own = set(inspect.get_annotations(cls))
    return [f for f in fields(cls) if f.name in own]


@pytest.mark.parametrize("cls", ["KVDistillConfig", "TeacherConfig"])
def test_every_option_declares_its_role_and_every_number_its_range(cls):
    import kvdistill.train.config as config
    from kvdistill.config import ROLES

    for f in _own_fields(getattr(config, cls)):
        assert f.metadata.get("affects") in ROLES, f"{cls}.{f.name}: option(..., affects=<one of {list(ROLES)}>)"
        numeric = any(t in str(f.type) for t in ("int", "float")) and "bool" not in str(f.type)
        if numeric:
            assert "valid" in f.metadata, f"{cls}.{f.name}: a number needs option(..., valid='>= 0' or similar)"


def test_roles_give_the_teacher_signals_bookkeeping_and_card_sections():
    from kvdistill.train.config import TEACHER_SIGNALS, card_sections

    assert TEACHER_SIGNALS == ("kv_weight", "codi_weight", "logit_kd_weight")
    assert {"output_dir", "save_strategy", "save_steps", "save_total_limit", "logging_steps",
                           "disable_tqdm", "report_to", "teacher_capture", "overwrite_output_dir", "resume_from_checkpoint",
            "allow_low_memory"} == BOOKKEEPING
    sections = card_sections()
    assert "kv_weight" in sections["signals"] and "seed" in sections["training"] and "data" in sections["data"]


def _numeric_rules():
    from kvdistill.train.config import INHERITED_RANGES

    rules = {f.name: f.metadata["valid"] for f in _own_fields(KVDistillConfig) if "valid" in f.metadata}
    return {**INHERITED_RANGES, **rules}


# one value outside each rule (NaN and inf are tried for every option)
OUTSIDE = {">= 0": -1, "> 0": 0, ">= 1": 0, ">= 8": 7, "in (0, 1]": 1.5, "in [0, 1)": 1, "in [0, 1]": 2,
           ">= 1 or -1": -5}


@pytest.mark.parametrize("name", sorted(_numeric_rules()))
@pytest.mark.parametrize("bad", ["nan", "inf", "outside"])
def test_numeric_options_refuse_nan_inf_and_out_of_range_naming_the_option(name, bad, tmp_path):
    rule = _numeric_rules()[name]
    value = OUTSIDE[rule] if bad == "outside" else float(bad)
    if name == "max_length" and bad == "outside":
        pytest.skip("refused by its own message (test_options)")
    path = tmp_path / "c.yaml"  # YAML: a value the CLI's int parser would refuse before the check
    path.write_text(yaml.safe_dump({"student": "org/student", "kv_weight": 0, name: value}))
    with pytest.raises(ConfigError, match=rf"^{name} must be .*got") as err:
        parse_config(["--config", str(path)])
    assert rule in str(err.value) and "\n" not in str(err.value)


def test_a_teacher_option_out_of_range_is_named_with_its_teacher():
    with pytest.raises(ConfigError, match=r"teacher t: weight must be >= 0, got nan"):
        parse_config(["--student", "org/student", "--teachers", "[{path: org/t, weight: .nan}]"])


@pytest.mark.parametrize("value", ["null", "none", "~", "[]"])
def test_teachers_null_on_the_cli_is_no_teacher_as_in_yaml(tiny_world, value):
    """Not a Hub model named "null": the CLI value reads as YAML `teachers: null` does."""
    cfg = parse_config(["--student", str(tiny_world.models["student"]), "--kv_weight", "0", "--teachers", value])
    assert cfg.teacher_configs == []


@pytest.mark.parametrize("teacher, allowed", [
    ("{path: STUDENT}", False), ("{path: STUDENT/}", False),  # the same directory, spelled another way
    ("{path: STUDENT, control: untrained}", True),  # a random-init copy of its architecture
    ("{path: STUDENT, rationale_field: rationale}", True),  # the student as a privileged teacher
])
def test_the_student_as_its_own_teacher_is_refused_unless_it_reads_otherwise_or_is_allowed(tiny_world, teacher,
                                                                                           allowed):
    student = str(tiny_world.models["student"])
    argv = ["--student", student, "--kv_weight", "0.1", "--teachers", f"[{teacher.replace('STUDENT', student)}]"]
    if allowed:
        assert parse_config(argv).teacher_configs
    else:
        with pytest.raises(ConfigError, match=r"is the student itself.*--allow_self_teacher true"):
            parse_config(argv)
    assert parse_config([*argv, "--allow_self_teacher", "true"]).teacher_configs


def test_lmbda_1_without_logit_kd_is_kv_only_and_needs_allow_kv_only(tiny_world):
    m = tiny_world.models
    argv = ["--student", str(m["student"]), "--teachers", f"[{{path: {m['qwen2_teacher']}}}]", "--kv_weight", "0.1",
            "--lmbda", "1"]
    with pytest.raises(ConfigError, match=r"lmbda 1 puts every step on-policy.*allow_kv_only"):
        parse_config(argv)
    assert parse_config([*argv, "--allow_kv_only", "true"]).lmbda == 1
    assert parse_config([*argv, "--logit_kd_weight", "1"]).lmbda == 1  # GKD: logit KD on the student's samples
    assert parse_config([*argv[:-1], "0.5"]).lmbda == 0.5  # the other steps keep the LM loss
