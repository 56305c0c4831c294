"""`KVDistillConfig`: every `TrainingArguments` field plus the distillation settings.

One YAML file + command-line overrides (CLI wins). Values are checked in `__post_init__`
so a bad config fails before any model loads, with a message that names the fix.
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser, TrainingArguments

from kvdistill.align.aligner import DIRECTIONS
from kvdistill.align.aligner import MODES as HEAD_MODES
from kvdistill.align.projectors import PROJECTOR_KINDS as PROJECTORS
from kvdistill.align.time import TIME_MODES
from kvdistill.data import DEFAULT_TEMPLATE
from kvdistill.fusion import FUSIONS
from kvdistill.losses import LOSSES

# the config's names for the layer map: "cka" reads each teacher's JSON (the aligner's "json" kind)
LAYER_MAPS = ("proportional", "last_k", "cka")
KV_LOSSES = tuple(LOSSES)
LOGIT_KD = ("forward_kl", "reverse_kl", "jsd")


class ConfigError(ValueError):
    """A configuration problem, raised before anything loads."""


@dataclass
class TeacherConfig:
    """One teacher. Unset projector fields inherit the run-wide ones."""

    path: str
    name: str | None = None
    weight: float = 1.0
    dtype: str = "auto"
    quantization: str | None = None
    tokenizer: str | None = None  # None: the teacher's own (from `path`); "student": share the student's
    rationale_field: str | None = None
    layer_map: str | None = None  # JSON from `kvdistill layer-map` (needed when layer_map: cka)
    projector: str | None = None
    mlp_ratio: float | None = None
    projector_dropout: float | None = None
    projector_init: str | None = None

    def __post_init__(self) -> None:
        if self.name is None:
            self.name = Path(str(self.path).rstrip("/")).name
        if self.weight < 0:
            raise ConfigError(f"teacher {self.name}: weight must be >= 0, got {self.weight}")
        if self.quantization not in (None, "4bit", "8bit"):
            raise ConfigError(f"teacher {self.name}: quantization must be null, 4bit or 8bit")


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default.copy(), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class KVDistillConfig(TrainingArguments):
    """Training arguments of `kvdistill train` (TrainingArguments names kept)."""

    # ---- models and data
    student: str | None = _f(None, "Student model: Hub id or local directory.")
    teachers: None | str | list = _f([], "List of teachers: {path, name, weight, dtype, quantization, tokenizer, "
                           "rationale_field, layer_map, projector, mlp_ratio, ...}.")
    student_dtype: str = _f("auto", "Student weights dtype (auto|fp32|bf16|fp16); use bf16/fp16 flags for AMP.")
    data: str = _f("synthetic", "Training data: Hub id, local jsonl/json/parquet file or directory, or 'synthetic'.")
    data_split: str = _f("train", "Split to train on.")
    field_map: None | str | dict = _f(None, "Column mapping {question: col, answer: col} or a name (gsm8k, svamp, math).")
    max_samples: int | None = _f(None, "Use only the first N training records.")
    max_length: int = _f(512, "Maximum tokens per example (longer ones are cut, with a warning).")
    prompt_template: str = _f(DEFAULT_TEMPLATE, "Prompt template with {question}.")
    use_chat_template: bool = _f(False, "Format prompts with the tokenizer's chat template.")
    # ---- alignment
    time_mode: str = _f("segment", f"Time alignment: {TIME_MODES}.")
    layer_map: str = _f("proportional", f"Layer mapping: {LAYER_MAPS} (cka reads each teacher's layer_map JSON).")
    layer_map_k: int = _f(1, "k for layer_map: last_k.")
    ignore_layer_map_hash: bool = _f(False, "Accept a layer map computed for other model configs.")
    head_mode: str = _f("flat", f"Head alignment: {HEAD_MODES}.")
    projector: str = _f("linear", f"Dim projector: {PROJECTORS}.")
    mlp_ratio: float = _f(1.0, "Elastic bottleneck width ratio r (0.5 / 1 / 2 by teacher size).")
    projector_dropout: float = _f(0.0, "Dropout inside the elastic projector.")
    projector_init: str = _f("xavier", "Projector init: xavier | orthogonal | identity.")
    share_layers: bool = _f(True, "One K and one V projector shared across layers (else one per layer).")
    projector_trainable: bool = _f(True, "Train projectors and head mixers (False: fixed at their init, so the "
                                   "projector cannot chase the student and only the student moves).")
    direction: str = _f("teacher_to_student", f"Which side is projected: {DIRECTIONS}.")
    key_space: str = _f("post_rope", "Keys as cached (post_rope) or before RoPE (pre_rope).")
    # ---- losses
    kv_loss: str = _f("mercator", f"KV loss: {KV_LOSSES}.")
    kv_weight: float = _f(0.1, "Weight of the KV loss (0 = SFT only). Small weights worked best in the pilot.")
    kv_warmup_steps: int = _f(100, "Linear warm-up of the KV weight over this many optimizer steps.")
    mercator_alpha: float = _f(1.0, "Mercator direction weight alpha.")
    mercator_beta: float = _f(0.0, "Mercator log-norm weight beta (0 or 0.01).")
    hybrid_weight: float = _f(0.8, "Mercator share in the hybrid loss.")
    normalize_target: bool = _f(False, "Layer-wise std normalisation of the teacher target (KaVa).")
    segment_weights: None | str | dict = _f(None, "KV loss weight per segment {prompt: w, reasoning: w, answer: w}.")
    ce_weight: float = _f(1.0, "Weight of the student's LM loss.")
    allow_kv_only: bool = _f(False, "Allow ce_weight 0 (a KV-only loss can collapse to a trivial high cos-sim).")
    codi_weight: float = _f(0.0, "Weight of the CODI hidden-state loss at the answer marker.")
    logit_kd_weight: float = _f(0.0, "Weight of logit KD (only for teachers sharing the student's vocabulary).")
    logit_kd_kind: str = _f("forward_kl", f"Logit KD divergence: {LOGIT_KD}.")
    logit_kd_temperature: float = _f(1.0, "Softmax temperature of logit KD.")
    # ---- teachers
    fusion: str = _f("loss_sum", f"Multi-teacher fusion: {FUSIONS}.")
    teacher_offload: bool = _f(False, "Keep teachers on CPU; move one at a time to the device for its forward.")
    untrained_teacher_control: bool = _f(False, "Control: replace teachers by random-init copies.")
    aligner_learning_rate: float = _f(1e-3, "Learning rate of projectors / aligners / fusion weights.")
    # ---- TrainingArguments defaults of the seed prototype
    output_dir: str | None = _f("runs/kvdistill", "Where checkpoints, logs and the final student go.")
    learning_rate: float = _f(5e-5, "Student learning rate.")
    weight_decay: float = _f(0.01, "Weight decay.")
    per_device_train_batch_size: int = _f(2, "Batch size per device.")
    gradient_accumulation_steps: int = _f(16, "Gradient accumulation steps.")
    max_steps: int = _f(1000, "Optimizer steps.")
    logging_steps: float = _f(10, "Log every N steps.")
    save_steps: float = _f(200, "Checkpoint every N steps.")
    report_to: None | str | list[str] = _f("none", "tensorboard / wandb / none.")
    remove_unused_columns: bool = _f(False, "Must stay False: the collator needs the raw records.")

    def __post_init__(self) -> None:
        # mapping-valued options arrive as YAML objects from a file, or as strings from the CLI
        for key in ("teachers", "field_map", "segment_weights"):
            if (isinstance(getattr(self, key), str) and key != "field_map") or (
                key == "field_map" and isinstance(self.field_map, str) and self.field_map.strip()[:1] in "{["
            ):
                setattr(self, key, yaml.safe_load(getattr(self, key)))
        self.teacher_configs = [self._teacher(t) for t in (self.teachers or [])]
        self._validate()
        super().__post_init__()

    @staticmethod
    def _teacher(t: Any) -> TeacherConfig:
        if isinstance(t, TeacherConfig):
            return t
        if isinstance(t, str):
            return TeacherConfig(path=t)
        if not isinstance(t, dict):
            raise ConfigError(f"a teacher must be a path or a mapping, got {t!r}")
        names = {f.name for f in fields(TeacherConfig)}
        for key in t:
            if key not in names:
                raise ConfigError(f"unknown teacher key {key!r}{_suggest(key, names)}")
        return TeacherConfig(**t)

    def _validate(self) -> None:
        choices = {
            "time_mode": TIME_MODES, "layer_map": LAYER_MAPS, "head_mode": HEAD_MODES, "projector": PROJECTORS,
            "kv_loss": KV_LOSSES, "fusion": FUSIONS, "logit_kd_kind": LOGIT_KD, "direction": DIRECTIONS,
            "key_space": ("post_rope", "pre_rope"), "projector_init": ("xavier", "orthogonal", "identity"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(f"{key}={getattr(self, key)!r} is not one of {allowed}")
        for key in ("kv_weight", "codi_weight", "logit_kd_weight", "ce_weight", "kv_warmup_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.student is None:
            raise ConfigError("no student: set `student: <hub id or local dir>`")
        if self.ce_weight == 0 and not self.allow_kv_only:
            raise ConfigError(
                "ce_weight=0 trains on the KV loss alone, which can collapse to a high cos-sim that teaches "
                "nothing; set allow_kv_only: true if you mean it"
            )
        if (self.kv_weight > 0 or self.codi_weight > 0 or self.logit_kd_weight > 0) and not self.teacher_configs:
            raise ConfigError("kv_weight/codi_weight/logit_kd_weight > 0 need at least one teacher in `teachers` "
                              "(for SFT only, set kv_weight: 0)")
        if (self.activation_checkpointing or self.gradient_checkpointing) and self.kv_weight > 0:
            raise ConfigError("gradient (activation) checkpointing makes transformers drop the student's KV cache in "
                              "training, so the KV loss has nothing to compare; set gradient_checkpointing: false "
                              "(or kv_weight: 0); see docs/training.md")
        if self.kv_loss == "structural" and self.head_mode != "structured":
            raise ConfigError("kv_loss: structural compares heads; it needs head_mode: structured")
        if self.fusion == "kv_mean" and self.direction != "teacher_to_student":
            raise ConfigError("fusion: kv_mean averages teachers in the student's space; use direction "
                              "teacher_to_student")
        names = [t.name for t in self.teacher_configs]
        if len(set(names)) != len(names):
            raise ConfigError(f"teacher names must be unique, got {names}; set `name:` per teacher")
        for t in self.teacher_configs:
            if not _is_model_ref(t.path):
                raise ConfigError(f"teacher {t.name}: path {t.path!r} does not exist; give a local model "
                                  "directory or a Hub id")
            if self.layer_map == "cka" and self.kv_weight > 0:
                if t.layer_map is None:
                    raise ConfigError(f"layer_map: cka but teacher {t.name} has no layer_map JSON; run "
                                      "`kvdistill layer-map` and set the teacher's `layer_map:` path")
                if not Path(t.layer_map).exists():
                    raise ConfigError(f"teacher {t.name}: layer map {t.layer_map} not found")
                self._check_layer_map_counts(t)
        if not _is_model_ref(self.student):
            raise ConfigError(f"student path {self.student!r} does not exist; give a local model directory "
                              "or a Hub id")

    def _check_layer_map_counts(self, t: TeacherConfig) -> None:
        """Compare a layer map's layer counts with the models' configs (config.json only, no weights)."""
        import json

        doc = json.loads(Path(t.layer_map).read_text())
        for side, path in (("student", self.student), ("teacher", t.path)):
            cfg_file = Path(path) / "config.json"
            if not cfg_file.exists():
                continue  # a Hub id: checked when the model loads
            cfg = json.loads(cfg_file.read_text())
            layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
            if layers is not None and doc.get(f"{side}_layers") not in (None, layers):
                raise ConfigError(
                    f"layer map {t.layer_map} is for a {side} with {doc[f'{side}_layers']} layers, but {path} has "
                    f"{layers}; re-run `kvdistill layer-map` for this model pair"
                )

    def to_yaml_dict(self) -> dict:
        """The resolved config as plain YAML-able data (enums as strings, teachers as mappings)."""
        d = {k: v for k, v in self.to_dict().items() if not k.startswith("_") and k != "teacher_configs"}
        d["teachers"] = [asdict(t) for t in self.teacher_configs]
        return yaml.safe_load(yaml.safe_dump(d, default_flow_style=False, allow_unicode=True))


def _is_model_ref(ref: str) -> bool:
    """A local path that exists, or something shaped like a Hub id ("org/name" or "name")."""
    if Path(ref).exists():
        return True
    return not ref.startswith((".", "/", "~")) and ref.count("/") <= 1


def _suggest(key: str, valid: Any) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def parse_config(argv: list[str] | None = None) -> KVDistillConfig:
    """`--config x.yaml` plus `--key value` overrides -> `KVDistillConfig` (CLI wins over YAML)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser(KVDistillConfig, prog="kvdistill train")
    parser.add_argument("--config", default=None, help="YAML config file; CLI flags override its values.")
    valid = {a.dest for a in parser._actions}
    config_path = None
    if "--config" in argv:
        i = argv.index("--config")
        config_path = argv[i + 1] if i + 1 < len(argv) else None
        del argv[i : i + 2]
    defaults: dict[str, Any] = {}
    if config_path:
        if not Path(config_path).exists():
            raise ConfigError(f"config file not found: {config_path}")
        defaults = yaml.safe_load(Path(config_path).read_text()) or {}
        for key in defaults:
            if key not in valid:
                raise ConfigError(f"{config_path}: unknown key {key!r}{_suggest(key, valid)}")
        parser.set_defaults(**defaults)
    for arg in argv:
        if arg.startswith("--") and arg[2:].split("=")[0] not in valid:
            key = arg[2:].split("=")[0]
            raise ConfigError(f"unknown option --{key}{_suggest(key, valid)}")
    cfg = parser.parse_args_into_dataclasses(args=argv)[0]
    return cfg
