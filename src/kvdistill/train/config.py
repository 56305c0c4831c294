"""`KVDistillConfig`: every `TrainingArguments` field plus the distillation settings.

One YAML file + command-line overrides (CLI wins). Values are checked in `__post_init__`
so a bad config fails before any model loads, with a message that names the fix.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import TrainingArguments

from kvdistill.align.aligner import DIRECTIONS
from kvdistill.align.aligner import MODES as HEAD_MODES
from kvdistill.align.compress import COMPRESSIONS
from kvdistill.align.projectors import PROJECTOR_KINDS as PROJECTORS
from kvdistill.align.time import TIME_MODES
from kvdistill.config import ConfigError, check_choice, option, suggest, to_plain
from kvdistill.config import parse_config as parse_command_config
from kvdistill.data import DEFAULT_TEMPLATE, FIELD_MAPS, parse_student_input
from kvdistill.fusion import FUSIONS
from kvdistill.losses import LOGIT_KD_KINDS, LOSSES

# the config's names for the layer map: "cka" reads each teacher's JSON (the aligner's "json" kind)
LAYER_MAPS = ("proportional", "last_k", "cka")
KV_LOSSES = (*LOSSES, "relation")  # relation: MiniLMv2 self-relations, no projector (losses/relation.py)
TEACHER_CONTROLS = ("none", "untrained", "shuffled")
ON_NONFINITE = ("stop", "skip")
LOGIT_KD = LOGIT_KD_KINDS
DESCRIPTION = """Multi-teacher KV-cache distillation on transformers.Trainer.

  kvdistill train --config configs/tiny.yaml [--key value ...]

Options come from one YAML file (--config) plus command-line flags, which win. The kvdistill
options are listed first; every transformers TrainingArguments option follows and keeps its name."""


# the loss weights that read teachers: a run with all of them 0 loads none
TEACHER_SIGNALS = ("kv_weight", "codi_weight", "logit_kd_weight")
# how often and where a run writes, not what it learns: may change between a run and its resumption
# (a run dir copied into another ablation's output_dir is reused there)
BOOKKEEPING = frozenset({"output_dir", "save_strategy", "save_steps", "save_total_limit", "logging_steps",
                         "disable_tqdm", "report_to", "teacher_capture"})


def changed_settings(saved: dict[str, Any], now: dict[str, Any], common_only: bool = False) -> list[str]:
    """The options (bookkeeping aside) in which two train configs, as YAML data, differ: a finished
    run is reused only where this is empty. `common_only` compares only the options both hold: two
    full configs (`kvdistill_config.yaml`) written by different versions, where an option added
    since the run is no change of its settings."""
    keys = saved.keys() & now.keys() if common_only else saved.keys() | now.keys()
    return sorted(k for k in keys - BOOKKEEPING if saved.get(k) != now.get(k))


@dataclass
class TeacherConfig:
    """One teacher (an entry of `teachers:`). Unset projector fields inherit the run-wide ones."""

    path: str = option(None, "Teacher model: Hub id or local directory. Required.")
    name: str | None = option(None, "Name in logs, checkpoints and layer-map files (default: last part of path).")
    weight: float = option(1.0, "Fusion weight (normalised over teachers).")
    dtype: str = option("auto", "Weights dtype: auto | fp32 | bf16 | fp16.")
    quantization: str | None = option(None, "null | 4bit | 8bit (bitsandbytes); never applied unless asked.")
    tokenizer: str | None = option(None, "Tokenizer: null (the teacher's own, from path), 'student', or a path.")
    rationale_field: str | None = option(None, "Data column with this teacher's own rationale (its chain of thought).")
    layer_map: str | None = option(None, "Layer-map JSON from `kvdistill layer-map` (needed with layer_map: cka).")
    projector: str | None = option(None, "Dim projector for this teacher (default: the run's `projector`).")
    mlp_ratio: float | None = option(None, "Elastic projector width ratio (default: the run's `mlp_ratio`).")
    projector_dropout: float | None = option(None, "Elastic projector dropout (default: the run's).")
    projector_init: str | None = option(None, "Projector init (default: the run's `projector_init`).")

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("a teacher needs a `path:` (Hub id or local model directory)")
        if self.name is None:
            self.name = Path(str(self.path).rstrip("/")).name
        if self.weight < 0:
            raise ConfigError(f"teacher {self.name}: weight must be >= 0, got {self.weight}")
        if self.quantization not in (None, "4bit", "8bit"):
            raise ConfigError(f"teacher {self.name}: quantization must be null, 4bit or 8bit")


@dataclass
class KVDistillConfig(TrainingArguments):
    """Training arguments of `kvdistill train` (TrainingArguments names kept)."""

    # ---- models and data
    student: str | None = option(None, "Student model: Hub id or local directory.")
    teachers: None | str | list = option([], "List of teachers: {path, name, weight, dtype, quantization, tokenizer, "
                           "rationale_field, layer_map, projector, mlp_ratio, ...}.")
    student_dtype: str = option("auto", "Student weights dtype (auto|fp32|bf16|fp16); use bf16/fp16 flags for AMP.")
    data: str = option("synthetic", "Training data: Hub id, local jsonl/json/parquet file or directory, or 'synthetic'.")
    data_split: str = option("train", "Split to train on.")
    field_map: None | str | dict = option(None, "Column mapping {question: col, answer: col} or a name (gsm8k, svamp, math).")
    max_samples: int | None = option(None, "Use only the first N training records.")
    transfer_data: str | None = option(None, "Transfer set (Hinton et al.): records the student gets no LM loss "
                                       "on, only the teacher signals (KV, relation, logit KD, CODI). Their "
                                       "`answer` is read, not learned as a label: e.g. teacher-written completions "
                                       "of unlabelled questions. Same formats as `data`; unused without a teacher "
                                       "signal.")
    transfer_split: str = option("train", "Split of transfer_data.")
    transfer_field_map: None | str | dict = option(None, "Column mapping of transfer_data (default: field_map); "
                                                   "an eval's items.jsonl is a transfer set with "
                                                   "{question: question, answer: prediction}.")
    transfer_max_samples: int | None = option(None, "Use only the first N transfer records.")
    transfer_batch_size: int = option(0, "Transfer records added to every micro-batch of labelled ones (drawn at "
                                      "random, seeded by the batch, so a resumed run draws the same); 0: "
                                      "per_device_train_batch_size.")
    max_length: int = option(512, "Maximum tokens per example (longer ones are cut, with a warning).")
    prompt_template: str = option(DEFAULT_TEMPLATE, "Prompt template with {question}.")
    use_chat_template: bool = option(False, "Format prompts with the tokenizer's chat template.")
    accuracy_eval_steps: int = option(0, "Every N optimizer steps (and at the end), greedy-decode the "
                                      "accuracy_eval_split and log `eval_accuracy` (accuracy-vs-steps curves); 0: off.")
    accuracy_eval_split: str = option("dev", "Split of `data` for the accuracy curve (never the test split you "
                                      "report on).")
    accuracy_eval_limit: int = option(200, "Items of accuracy_eval_split per curve point.")
    accuracy_eval_max_new_tokens: int = option(64, "Generation budget per item for the accuracy curve.")
    # ---- alignment
    time_mode: str = option("segment", f"Time alignment: {TIME_MODES}.")
    layer_map: str = option("proportional", f"Layer mapping: {LAYER_MAPS} (cka reads each teacher's layer_map JSON).")
    layer_map_k: int = option(1, "k for layer_map: last_k.")
    ignore_layer_map_hash: bool = option(False, "Accept a layer map computed for other model configs.")
    head_mode: str = option("flat", f"Head alignment: {HEAD_MODES}.")
    projector: str = option("linear", f"Dim projector: {PROJECTORS}.")
    mlp_ratio: float = option(1.0, "Elastic bottleneck width ratio r (0.5 / 1 / 2 by teacher size).")
    projector_dropout: float = option(0.0, "Dropout inside the elastic projector.")
    projector_init: str = option("xavier", "Projector init: xavier | orthogonal | identity.")
    share_layers: bool = option(True, "One K and one V projector shared across layers (else one per layer).")
    projector_trainable: bool = option(True, "Train projectors and head mixers (False: fixed at their init, so the "
                                   "projector cannot chase the student and only the student moves).")
    direction: str = option("teacher_to_student", f"Which side is projected: {DIRECTIONS}.")
    key_space: str = option("auto", "Keys as cached (post_rope) or before RoPE (pre_rope); auto: pre_rope for "
                            "kv_loss relation (relations of rotated keys depend on position), else post_rope.")
    # ---- losses
    kv_loss: str = option("mercator", f"KV loss: {KV_LOSSES}.")
    kv_weight: float = option(0.1, "Weight of the KV loss (0 = SFT only). Small weights worked best in the pilot.")
    kv_warmup_steps: int = option(100, "Linear warm-up of the KV weight over this many optimizer steps.")
    relation_heads: int = option(8, "kv_loss relation: relation heads R (each side's H*D split into R chunks).")
    relation_temperature: float = option(1.0, "kv_loss relation: softmax temperature of the relation matrices.")
    relation_chunk_size: int | None = option(None, "kv_loss relation: query rows per chunk (memory O(L*B*R*C*T) "
                                             "instead of O(L*B*R*T^2)); null: all rows at once.")
    relation_compile: bool = option(True, "kv_loss relation: compile the row softmaxes (torch.compile; 28 -> 22 "
                                    "ms per term on CPU at the demo's shapes; the eager ops where it cannot build).")
    mercator_alpha: float = option(1.0, "Mercator direction weight alpha.")
    mercator_beta: float = option(0.0, "Mercator log-norm weight beta (0 or 0.01).")
    hybrid_weight: float = option(0.8, "Mercator share in the hybrid loss.")
    normalize_target: bool = option(False, "Layer-wise std normalisation of the teacher target (KaVa).")
    segment_weights: None | str | dict = option(None, "KV loss weight per segment {prompt: w, reasoning: w, answer: w}.")
    ce_weight: float = option(1.0, "Weight of the student's LM loss.")
    allow_kv_only: bool = option(False, "Allow ce_weight 0 (a KV-only loss can collapse to a trivial high cos-sim).")
    codi_weight: float = option(0.0, "Weight of the CODI hidden-state loss at the answer marker.")
    logit_kd_weight: float = option(0.0, "Weight of logit KD (only for teachers sharing the student's vocabulary).")
    logit_kd_kind: str = option("forward_kl", f"Logit KD divergence: {LOGIT_KD}.")
    logit_kd_temperature: float = option(1.0, "Softmax temperature of logit KD.")
    # ---- teachers
    fusion: str = option("loss_sum", f"Multi-teacher fusion: {FUSIONS}.")
    teacher_offload: bool = option(False, "Keep teachers on CPU; move one at a time to the device for its forward.")
    teacher_cache: bool = option(False, "Keep every training record's teacher outputs in CPU memory, so each "
                                 "teacher runs once per record (many epochs over a small dataset).")
    teacher_capture: str | None = option(None, "Directory of a `kvdistill capture` made with this config: every "
                                         "teacher's outputs are read from it and no teacher weights are loaded. "
                                         "A capture of other data, tokenizer, max_length or teacher is refused.")
    capture_dtype: str = option("fp32", "dtype `kvdistill capture` stores the teacher cache in: fp32 | bf16 | fp16.")
    capture_layers: str = option("all", "Teacher layers `kvdistill capture` stores: all | mapped (only those the "
                                 "run's layer map reads; a run with another layer map refuses the capture).")
    capture_keep: float = option(1.0, "Fraction of each teacher rationale's positions `kvdistill capture` stores (the "
                                 "prompt and answer are kept whole); 1 stores every position. Segment time alignment "
                                 "reads the kept ones (needs time_mode: segment, no logit KD).")
    capture_compression: str = option("uniform", f"How capture_keep < 1 picks the rationale positions: {COMPRESSIONS} "
                                      "(rkv: attention importance minus key redundancy, as teacher_compression).")
    teacher_control: str = option("none", f"Control run {TEACHER_CONTROLS}: untrained = random-init copies of the "
                                  "teachers; shuffled = each sample gets another sample's teacher (a derangement "
                                  "within the batch). A gain must beat both to count as knowledge transfer.")
    # ---- privileged teacher (KaVa)
    student_input: str = option("full", "What the student reads of the rationale: full | no_rationale | "
                                "short_rationale:K (its first K lines) | latent:N (N latent slot tokens in its place, "
                                "KaVa-style). Teachers always read the full rationale (privileged information).")
    teacher_compression: str = option("rkv", f"With a shortened student input: how each teacher's rationale is "
                                      f"cut to the student's reasoning slots: {COMPRESSIONS} or none (proportional "
                                      "time alignment only).")
    compression_lambda: float = option(0.1, "R-KV: weight of key redundancy against attention importance.")
    on_nonfinite: str = option("stop", f"A NaN/inf loss or gradient: {ON_NONFINITE}. stop = end the run with a "
                               "message naming the tensor (teacher, layer, keys/values) where it first appeared; "
                               "skip = warn, give the step zero gradient and go on (counted as nonfinite_skipped).")
    aligner_learning_rate: float = option(1e-3, "Learning rate of projectors / aligners / fusion weights.")
    # ---- TrainingArguments defaults of the seed prototype
    output_dir: str | None = option("runs/kvdistill", "Where checkpoints, logs and the final student go.")
    learning_rate: float = option(5e-5, "Student learning rate.")
    weight_decay: float = option(0.01, "Weight decay.")
    per_device_train_batch_size: int = option(2, "Batch size per device.")
    gradient_accumulation_steps: int = option(16, "Gradient accumulation steps.")
    max_steps: int = option(1000, "Optimizer steps.")
    logging_steps: float = option(10, "Log every N steps.")
    save_steps: float = option(200, "Checkpoint every N steps.")
    report_to: None | str | list[str] = option("none", "tensorboard / wandb / none.")
    remove_unused_columns: bool = option(False, "Must stay False: the collator needs the raw records.")

    def __post_init__(self) -> None:
        # mapping-valued options arrive as YAML objects from a file, or as strings from the CLI
        for key in ("teachers", "field_map", "transfer_field_map", "segment_weights"):
            setattr(self, key, to_plain(getattr(self, key)))
        if isinstance(self.report_to, str) and "," in self.report_to:  # CLI: `tensorboard,wandb` or `[a, b]`
            self.report_to = [r.strip() for r in self.report_to.strip("[]").split(",") if r.strip()]
        if isinstance(self.teachers, (str, dict)):  # one teacher, given as a path or a mapping
            self.teachers = [self.teachers]
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
                raise ConfigError(f"unknown teacher key {key!r}{suggest(key, names)}")
        return TeacherConfig(**t)

    def _validate(self) -> None:
        choices = {
            "time_mode": TIME_MODES, "layer_map": LAYER_MAPS, "head_mode": HEAD_MODES, "projector": PROJECTORS,
            "kv_loss": KV_LOSSES, "fusion": FUSIONS, "logit_kd_kind": LOGIT_KD, "direction": DIRECTIONS,
            "key_space": ("auto", "post_rope", "pre_rope"), "projector_init": ("xavier", "orthogonal", "identity"),
            "teacher_control": TEACHER_CONTROLS, "teacher_compression": (*COMPRESSIONS, "none"),
            "on_nonfinite": ON_NONFINITE, "capture_dtype": ("fp32", "bf16", "fp16"), "capture_layers": ("all", "mapped"),
            "capture_compression": COMPRESSIONS,
        }
        for key, allowed in choices.items():
            check_choice(key, getattr(self, key), allowed)
        for key in ("kv_weight", "codi_weight", "logit_kd_weight", "ce_weight", "kv_warmup_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.student is None:
            raise ConfigError("no student: set `student: <hub id or local dir>`")
        if self.max_length < 8:
            raise ConfigError(f"max_length {self.max_length} leaves no room for a question and its answer; set "
                              "max_length >= 8 (512 is the default)")
        if self.max_steps == 0:
            raise ConfigError("max_steps 0 would still run one step; set max_steps >= 1, or -1 to train "
                              "num_train_epochs epochs")
        if self.fp16 and (self.use_cpu or not torch.cuda.is_available()):
            raise ConfigError("fp16 mixed precision needs a CUDA GPU (on CPU it would be silently ignored); drop "
                              "--fp16, or use --bf16 on CPU")
        # one model read the same way twice is one teacher counted twice (another rationale is not)
        views = [(str(Path(str(t.path)).resolve()) if Path(str(t.path)).exists() else str(t.path), t.tokenizer,
                  t.rationale_field, t.dtype, t.quantization) for t in self.teacher_configs]
        repeated = [v[0] for v in views if views.count(v) > 1]
        if repeated:
            raise ConfigError(f"teacher {repeated[0]} is listed twice with the same settings; list it once (its "
                              "`weight` sets how much it counts)")
        if self.ce_weight == 0 and not self.allow_kv_only:
            raise ConfigError(
                "ce_weight=0 trains on the KV loss alone, which can collapse to a high cos-sim that teaches "
                "nothing; set allow_kv_only: true if you mean it"
            )
        if self.teacher_signal and not self.teacher_configs:
            raise ConfigError("kv_weight/codi_weight/logit_kd_weight > 0 need at least one teacher in `teachers` "
                              "(for SFT only, set kv_weight: 0)")
        if (self.activation_checkpointing or self.gradient_checkpointing) and self.kv_weight > 0:
            raise ConfigError("gradient (activation) checkpointing makes transformers drop the student's KV cache in "
                              "training, so the KV loss has nothing to compare; set activation_checkpointing: false "
                              "(or kv_weight: 0); see docs/training.md")
        if self.accuracy_eval_steps < 0 or self.accuracy_eval_limit < 1:
            raise ConfigError("accuracy_eval_steps must be >= 0 and accuracy_eval_limit >= 1")
        for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "max_samples", "transfer_max_samples"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.learning_rate <= 0 or self.aligner_learning_rate < 0:
            raise ConfigError(f"learning_rate must be > 0 and aligner_learning_rate >= 0, got {self.learning_rate} "
                              f"and {self.aligner_learning_rate}")
        if self.key_space == "auto":
            self.key_space = "pre_rope" if self.kv_loss == "relation" else "post_rope"
        try:
            parse_student_input(self.student_input)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.kv_loss == "relation" and (self.relation_heads < 1 or self.relation_temperature <= 0):
            raise ConfigError("kv_loss relation needs relation_heads >= 1 and relation_temperature > 0")
        if self.kv_loss == "relation" and self.fusion == "kv_mean":
            raise ConfigError("fusion: kv_mean averages projected teacher KVs; kv_loss relation has no projector, "
                              "use fusion: loss_sum (or learned / correctness)")
        if self.teacher_control == "shuffled" and self.per_device_train_batch_size < 2:
            raise ConfigError("teacher_control: shuffled pairs each sample with another sample of its batch; set "
                              "per_device_train_batch_size >= 2")
        if self.logit_kd_weight > 0 and (self.teacher_control == "shuffled" or self.student_input != "full"):
            raise ConfigError("logit KD compares teacher and student on the same tokens; it cannot run with "
                              "teacher_control: shuffled or a shortened student_input (set logit_kd_weight: 0)")
        for key in ("field_map", "transfer_field_map"):
            value = getattr(self, key)
            if isinstance(value, str) and value not in FIELD_MAPS:
                raise ConfigError(f"{key} {value!r} is not a known name {sorted(FIELD_MAPS)}; give a mapping "
                                  "{question: <column>, answer: <column>}")
        if self.transfer_batch_size < 0:
            raise ConfigError("transfer_batch_size must be >= 0 (0: per_device_train_batch_size)")
        self.transfer_batch_size = self.transfer_batch_size or self.per_device_train_batch_size
        if self.transfer_data and self.fusion == "correctness":
            raise ConfigError("fusion: correctness weighs teachers by their answers to the labelled records; the "
                              "transfer set has no gold answers: use fusion loss_sum or learned with transfer_data")
        if self.capture_layers == "mapped" and self.student_input != "full" and self.teacher_compression == "rkv":
            raise ConfigError("capture_layers: mapped drops teacher layers that teacher_compression: rkv scores "
                              "tokens with; use capture_layers: all, or teacher_compression uniform / random / none")
        if not 0 < self.capture_keep <= 1:
            raise ConfigError(f"capture_keep must be in (0, 1], got {self.capture_keep}: the fraction of rationale "
                              "positions a capture stores (1: all)")
        if self.capture_keep < 1 and self.time_mode != "segment":
            raise ConfigError(f"capture_keep < 1 drops rationale positions, which time_mode: {self.time_mode} would "
                              "misalign; use time_mode: segment (each segment maps onto its kept positions)")
        if self.capture_keep < 1 and self.logit_kd_weight > 0:
            raise ConfigError("capture_keep < 1 drops teacher positions that logit KD compares token by token; set "
                              "capture_keep: 1 or logit_kd_weight: 0")
        if self.teacher_capture and self.fusion == "correctness":
            raise ConfigError("fusion: correctness lets each teacher answer the questions, which a captured teacher "
                              "(no weights) cannot; use loss_sum or learned with teacher_capture")
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
        try:
            doc = json.loads(Path(t.layer_map).read_text())
        except ValueError as err:  # not JSON or not UTF-8 (a truncated copy): name the file
            raise ConfigError(f"teacher {t.name}: layer map {t.layer_map} is not valid JSON ({err}); re-run "
                              "`kvdistill layer-map`") from None
        doc = doc if isinstance(doc, dict) else {}  # the format is checked when the map is loaded
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

    @property
    def teacher_signal(self) -> bool:
        """A teacher signal is on (a weight of `TEACHER_SIGNALS` > 0): the run reads its teachers."""
        return any(getattr(self, k) > 0 for k in TEACHER_SIGNALS)

    def teacher_outputs(self, shares_student_tokens: bool) -> tuple[str, bool, bool]:
        """What training reads from a teacher: `(key_space, hidden states?, logits?)`. Hidden states for
        CODI; logits for logit KD, only from a teacher that shares the student's tokens."""
        return self.key_space, self.codi_weight > 0, self.logit_kd_weight > 0 and shares_student_tokens

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


def parse_config(argv: list[str] | None = None, prog: str = "kvdistill train",
                 description: str = DESCRIPTION) -> KVDistillConfig:
    """`--config x.yaml` plus `--key value` overrides -> `KVDistillConfig` (CLI wins over YAML)."""
    return parse_command_config(KVDistillConfig, argv, prog, description, first=TrainingArguments)
