"""`KVDistillConfig`: every `TrainingArguments` field plus the distillation settings.

One YAML file + command-line overrides (CLI wins). Values are checked in `__post_init__`
so a bad config fails before any model loads, with a message that names the fix.
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import asdict, dataclass, fields, replace
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
from kvdistill.cache import KEY_SPACES, SEGMENT_NAMES
from kvdistill.card import SECTIONS
from kvdistill.config import (
    ConfigError,
    check_choice,
    check_ranges,
    option,
    suggest,
    teacher_controls,
    teacher_name,
    to_plain,
    within,
)
from kvdistill.config import parse_config as parse_command_config
from kvdistill.controls import ORACLE_CODES, TextPermutation
from kvdistill.data import DEFAULT_TEMPLATE, FIELD_MAPS, parse_student_input
from kvdistill.formats import DATASET_FORMATS
from kvdistill.fusion import FUSIONS
from kvdistill.losses import LABELLED, LOGIT_KD_KINDS, LOSSES
from kvdistill.losses.relation import parse_rows
from kvdistill.models import model_dir, sliding_window
from kvdistill.teachers import LOGIT_KD_MODES

logger = logging.getLogger(__name__)
# the config's names for the layer map: "cka" reads each teacher's JSON (the aligner's "json" kind)
LAYER_MAPS = ("proportional", "last_k", "cka")
# relation: MiniLMv2 self-relations of keys/values, no projector (losses/relation.py); attention: the attention
# maps softmax(Q Kᵀ), queries from the models' own attention (losses/attention.py)
KV_LOSSES = (*LOSSES, "relation", "attention")
# controls: a gain counts as transfer only if it beats them (docs/evaluation.md; controls.py)
TEACHER_CONTROLS = ("none", "untrained", "shuffled", "oracle", "permuted", "other_task")
ON_NONFINITE = ("stop", "skip")
LOGIT_KD = LOGIT_KD_KINDS
DESCRIPTION = """Multi-teacher KV-cache distillation on transformers.Trainer.

  kvdistill train --config configs/tiny.yaml [--key value ...]

Options come from one YAML file (--config) plus command-line flags, which win; each option is
spelt --max_length or --max-length. The kvdistill options are listed by task; every transformers
TrainingArguments option is accepted under its own name too (--help-all lists them)."""


@dataclass
class TeacherConfig:
    """One teacher (an entry of `teachers:`). Unset projector fields inherit the run-wide ones."""

    path: str = option(None, "Teacher model: Hub id or local directory. Required (unless `model` is given).",
                       affects="teacher_outputs")
    name: str | None = option(None, "Name in logs, checkpoints and layer-map files (default: last part of path).",
                              affects="teacher_outputs")
    weight: float = option(1.0, "Fusion weight (normalised over the teachers of weight > 0; it scales their KV, CODI "
                           "and logit KD). 0: logits only: no KV or CODI from it (no aligner), its logit KD counted "
                           "in full, as in a run with it alone.", affects="student_loss", valid=">= 0")
    dtype: str = option("auto", "Weights dtype: auto | fp32 | bf16 | fp16.", affects="teacher_outputs")
    quantization: str | None = option(None, "null | 4bit | 8bit (bitsandbytes); never applied unless asked.",
                                      affects="teacher_outputs")
    tokenizer: Any = option(None, "Tokenizer: null (the teacher's own, from path), 'student', or a path (Python "
                            "API: or a loaded tokenizer).", affects="teacher_inputs")
    rationale_field: str | None = option(None, "Data column with this teacher's own rationale (its chain of thought).",
                                         affects="teacher_inputs")
    layer_map: str | None = option(None, "Layer-map JSON from `kvdistill layer-map` (needed with layer_map: cka).",
                                   affects="student_loss")
    template: str | None = option(None, "Prompt template only this teacher reads, with {question} (default: the "
                                  "run's prompt_template): e.g. a few-shot prefix the student never sees (privileged "
                                  "context, as in context distillation). Its own text pairs with no student token; "
                                  "the question and all after it pair by characters, as under a chat template.",
                                  affects="teacher_inputs")
    projector: str | None = option(None, "Dim projector for this teacher (default: the run's `projector`).",
                                   affects="student_loss")
    mlp_ratio: float | None = option(None, "Elastic projector width ratio (default: the run's `mlp_ratio`).",
                                     affects="student_loss", valid="> 0")
    projector_dropout: float | None = option(None, "Elastic projector dropout (default: the run's).",
                                             affects="student_loss", valid="in [0, 1)")
    projector_init: str | None = option(None, "Projector init (default: the run's `projector_init`).",
                                        affects="student_loss")
    logit_kd: str = option("auto", "Logit KD from this teacher (with logit_kd_weight > 0): same_vocab (its tokenizer "
                           "is the student's), cross_vocab (another tokenizer: shared boundaries and tokens, "
                           "docs/training.md), off; auto: same_vocab or cross_vocab by its tokenizer, off when it "
                           "reads another text (rationale_field, permuted). Logged per teacher.",
                           affects="teacher_outputs")
    control: str | None = option(None, f"This teacher's control {tuple(c for c in TEACHER_CONTROLS if c != 'oracle')} "
                                 "(default: the run's `teacher_control`): e.g. logit KD from a teacher and the KV "
                                 "signal from its untrained copy, the same path listed twice (docs/training.md).",
                                 affects="teacher_outputs")

    # the Python API (`KVDistillTrainer(teachers=[TeacherConfig(model=..., tokenizer=...)])`); never in YAML: the
    # trainer keeps the object and its run's config names it by `path` (whose config hash the checkpoints record)
    model: Any = option(None, "A loaded teacher model (Python API only); `path` defaults to its name_or_path. Its "
                        "`dtype` and `quantization` are the model's own.", affects="bookkeeping")

    def __post_init__(self) -> None:
        if self.model is not None and isinstance(self.model, (str, Path)):
            raise ConfigError(f"teacher `model:` takes a loaded model (Python API); give {self.model!r} as `path:`")
        if not self.path and self.model is not None:
            self.path = object_ref(self.model)
        if not self.path:
            raise ConfigError("a teacher needs a `path:` (Hub id or local model directory)")
        if self.name is None:
            self.name = teacher_name(self.path)
        check_ranges(self, where=f"teacher {self.name}: ")
        if self.quantization not in (None, "4bit", "8bit"):
            raise ConfigError(f"teacher {self.name}: quantization must be null, 4bit or 8bit")
        if self.logit_kd is False:  # YAML reads a bare `off` as false
            self.logit_kd = "off"
        check_choice(f"teacher {self.name}: logit_kd", self.logit_kd, LOGIT_KD_MODES)
        if self.control == "oracle":  # no teacher runs under it: it replaces every teacher of the run
            raise ConfigError(f"teacher {self.name}: control oracle replaces every teacher, not one; set the run's "
                              "teacher_control: oracle")
        if self.control is not None:
            check_choice(f"teacher {self.name}: control", self.control, TEACHER_CONTROLS)
        if self.template is not None and self.template.count("{question}") != 1:
            raise ConfigError(f"teacher {self.name}: template must hold {{question}} once (where the record's "
                              f"question goes), got {self.template!r}")


@dataclass
class KVDistillConfig(TrainingArguments):
    """Training arguments of `kvdistill train` (TrainingArguments names kept).

    A new option is one line here: `name: type = option(default, "help", affects=<role>, group=<task>,
    card=<section>, valid=<rule>)`. `affects` is required (a key of `kvdistill.config.ROLES`: `teacher_outputs`,
    `teacher_inputs`, `teacher_signal`, `student_loss` or `bookkeeping`); it alone decides whether the option
    enters a capture's identity, the "same settings" check of a reused run and the teacher-signal rule.
    `group` is required (a key of `kvdistill.config.GROUPS`: models, data, alignment, signals, training,
    output): the `--help` section that lists it. `card` (signals / alignment / data / training) puts it on
    the model card; `valid` (e.g. ">= 0", "> 0", "in (0, 1]") is required for numbers. Tests fail when one
    is missing.
    """

    # ---- models and data
    student: str | None = option(None, "Student model: Hub id or local directory.", affects="student_loss",
                                 group="models")
    teachers: None | str | list = option([], "List of teachers: {path, name, weight, dtype, quantization, tokenizer, "
                           "rationale_field, layer_map, projector, mlp_ratio, ...}.",
                                         affects="teacher_outputs", group="models")
    student_dtype: str = option("auto", "Student weights dtype (auto|fp32|bf16|fp16); use bf16/fp16 flags for AMP. "
                                "On CPU fp16 is refused and bf16 upcast to fp32 (docs/training.md).",
                                affects="student_loss", group="models")
    data: str = option("synthetic", "Training data: Hub id, local jsonl/json/parquet file or directory, or 'synthetic'.",
                       affects="teacher_inputs", group="data", card="data")
    data_split: str = option("train", "Split to train on.", affects="teacher_inputs", group="data", card="data")
    field_map: None | str | dict = option(None, "Column mapping {question: col, answer: col} or a name (gsm8k, svamp, math).",
                                          affects="teacher_inputs", group="data", card="data")
    dataset_format: str = option("auto", "Data format: auto (detected from the columns: question/answer, messages, "
                                 "prompt/completion, text; docs/data.md) or question_answer | messages | "
                                 "prompt_completion | text.", affects="teacher_inputs", group="data", card="data")
    max_samples: int | None = option(None, "Use only the first N training records.",
                                     affects="teacher_inputs", group="data", card="data", valid=">= 1")
    transfer_data: str | None = option(None, "Transfer set (Hinton et al.): records the student gets no LM loss "
                                       "on, only the teacher signals (KV, relation, logit KD, CODI). Their "
                                       "`answer` is read, not learned as a label: e.g. teacher-written completions "
                                       "of unlabelled questions. Same formats as `data`; unused without a teacher "
                                       "signal.", affects="teacher_inputs", group="data", card="data")
    transfer_split: str = option("train", "Split of transfer_data.", affects="teacher_inputs", group="data", card="data")
    transfer_field_map: None | str | dict = option(None, "Column mapping of transfer_data (default: field_map); "
                                                   "an eval's items.jsonl is a transfer set with "
                                                   "{question: question, answer: prediction}.",
                                                   affects="teacher_inputs", group="data")
    transfer_max_samples: int | None = option(None, "Use only the first N transfer records.",
                                              affects="teacher_inputs", group="data", card="data", valid=">= 1")
    transfer_batch_size: int = option(0, "Transfer records added to every micro-batch of labelled ones (drawn at "
                                      "random, seeded by the batch, so a resumed run draws the same); 0: "
                                      "per_device_train_batch_size.", affects="student_loss", group="data", valid=">= 0")
    max_length: int = option(512, "Maximum tokens per example (longer ones are cut, with a warning).",
                             affects="teacher_outputs", group="data", card="data", valid=">= 8")
    prompt_template: str = option(DEFAULT_TEMPLATE, "Prompt template with {question}.",
                                  affects="teacher_inputs", group="data", card="data")
    use_chat_template: bool = option(False, "Format prompts with the tokenizer's chat template.",
                                     affects="teacher_inputs", group="data", card="data")
    accuracy_eval_steps: int = option(0, "Every N optimizer steps (and at the end), greedy-decode the "
                                      "accuracy_eval_split and log `eval_accuracy` (accuracy-vs-steps curves); 0: off.",
                                      affects="student_loss", group="training", valid=">= 0")
    accuracy_eval_split: str = option("dev", "Split of `data` for the accuracy curve (never the test split you "
                                      "report on).", affects="student_loss", group="training")
    accuracy_eval_limit: int = option(200, "Items of accuracy_eval_split per curve point.",
                                      affects="student_loss", group="training", valid=">= 1")
    accuracy_eval_max_new_tokens: int = option(64, "Generation budget per item for the accuracy curve.",
                                               affects="student_loss", group="training", valid=">= 1")
    accuracy_stop: float = option(0.0, "Stop training at the first accuracy-curve point >= this (a teacher "
                                  "trained to a quality gate stops once it passes it); 0: train max_steps.",
                                  affects="student_loss", group="training", valid="in [0, 1]")
    # ---- alignment
    time_mode: str = option("segment", f"Time alignment: {TIME_MODES}.",
                            affects="student_loss", group="alignment", card="alignment")
    layer_map: str = option("proportional", f"Layer mapping: {LAYER_MAPS} (cka reads each teacher's layer_map JSON).",
                            affects="student_loss", group="alignment", card="alignment")
    layer_map_k: int = option(1, "k for layer_map: last_k.",
                              affects="student_loss", group="alignment", card="alignment", valid=">= 1")
    ignore_layer_map_hash: bool = option(False, "Accept a layer map computed for other model configs.",
                                         affects="student_loss", group="alignment")
    head_mode: str = option("flat", f"Head alignment: {HEAD_MODES}.",
                            affects="student_loss", group="alignment", card="alignment")
    projector: str = option("linear", f"Dim projector: {PROJECTORS}.",
                            affects="student_loss", group="alignment", card="alignment")
    mlp_ratio: float = option(1.0, "Elastic bottleneck width ratio r (0.5 / 1 / 2 by teacher size).",
                              affects="student_loss", group="alignment", card="alignment", valid="> 0")
    projector_dropout: float = option(0.0, "Dropout inside the elastic projector.",
                                      affects="student_loss", group="alignment", valid="in [0, 1)")
    projector_init: str = option("xavier", "Projector init: xavier | orthogonal | identity.",
                                 affects="student_loss", group="alignment")
    share_layers: bool = option(True, "One K and one V projector shared across layers (else one per layer).",
                                affects="student_loss", group="alignment", card="alignment")
    projector_trainable: bool = option(True, "Train projectors and head mixers (False: fixed at their init, so the "
                                   "projector cannot chase the student and only the student moves).",
                                       affects="student_loss", group="alignment")
    direction: str = option("teacher_to_student", f"Which side is projected: {DIRECTIONS}.",
                            affects="student_loss", group="alignment", card="alignment")
    key_space: str = option("auto", "Keys as cached (post_rope) or before RoPE (pre_rope); auto: pre_rope for "
                            "kv_loss relation (relations of rotated keys depend on position), else post_rope "
                            "(kv_loss attention needs post_rope: attention reads rotated queries and keys). hidden: "
                            "the hidden state after each layer in place of keys and values, the KV term then an "
                            "intermediate-state loss (Minitron's) through the same layer map, aligner and kv_loss.",
                            affects="teacher_outputs", group="alignment", card="alignment")
    # ---- losses
    kv_loss: str = option("mercator", f"KV loss: {KV_LOSSES}.", affects="student_loss", group="signals", card="signals")
    kv_weight: float = option(0.1, "Weight of the KV loss (0 = SFT only). Small weights worked best in the pilot.",
                              affects="teacher_signal", group="signals", card="signals", valid=">= 0")
    kv_warmup_steps: int = option(100, "Linear warm-up of the KV weight over this many optimizer steps.",
                                  affects="student_loss", group="signals", card="signals", valid=">= 0")
    relation_heads: int = option(8, "kv_loss relation: relation heads R (each side's H*D split into R chunks).",
                                 affects="student_loss", group="signals", valid=">= 1")
    relation_temperature: float = option(1.0, "kv_loss relation: softmax temperature of the relation matrices.",
                                         affects="student_loss", group="signals", valid="> 0")
    relation_rows: str = option("all", "The rows the KV loss reads (kv_loss relation / attention: its query rows, "
                                "every valid token stays a key; an element loss: the tokens it compares): all | answer "
                                "| segment names, comma-separated (prompt,reasoning,answer) | field:<name> (the "
                                "tokens where the data's per-token field <name> is > 0). For relation / attention the "
                                "KL on the rows read and on the other rows is logged either way "
                                "(<loss>_kl_selected / _other).",
                                affects="student_loss", group="signals", card="signals")
    relation_chunk_size: int | None = option(None, "kv_loss relation / attention: query rows per chunk (memory "
                                             "O(L*B*R*C*T) "
                                             "instead of O(L*B*R*T^2)); null: all rows at once.",
                                             affects="student_loss", group="signals", valid=">= 1")
    relation_compile: bool = option(True, "kv_loss relation: compile the row softmaxes (torch.compile; 28 -> 22 "
                                    "ms per term on CPU at the demo's shapes; the eager ops where it cannot build).",
                                    affects="student_loss", group="signals")
    mercator_alpha: float = option(1.0, "Mercator direction weight alpha.",
                                   affects="student_loss", group="signals", valid=">= 0")
    mercator_beta: float = option(0.0, "Mercator log-norm weight beta (0 or 0.01).",
                                  affects="student_loss", group="signals", valid=">= 0")
    hybrid_weight: float = option(0.8, "Mercator share in the hybrid loss.",
                                  affects="student_loss", group="signals", valid="in [0, 1]")
    normalize_target: bool = option(False, "Layer-wise std normalisation of the teacher target (KaVa).",
                                    affects="student_loss", group="alignment", card="alignment")
    segment_weights: None | str | dict = option(None, "KV loss weight per segment {prompt: w, reasoning: w, answer: w}.",
                                                affects="student_loss", group="signals", card="alignment")
    ce_weight: float = option(1.0, "Weight of the student's LM loss.",
                              affects="student_loss", group="signals", card="signals", valid=">= 0")
    allow_kv_only: bool = option(False, "Allow a loss without the student's LM loss: ce_weight 0, or lmbda 1 without "
                                 "logit KD (a KV-only loss can collapse to a trivial high cos-sim).",
                                 affects="student_loss", group="signals")
    codi_weight: float = option(0.0, "Weight of the CODI hidden-state loss at the answer marker.",
                                affects="teacher_signal", group="signals", card="signals", valid=">= 0")
    logit_kd_weight: float = option(0.0, "Weight of logit KD (from each teacher as its `logit_kd` says).",
                                    affects="teacher_signal", group="signals", card="signals", valid=">= 0")
    logit_kd_kind: str = option("forward_kl", f"Logit KD divergence: {LOGIT_KD}.",
                                affects="student_loss", group="signals", card="signals")
    logit_kd_temperature: float = option(1.0, "Softmax temperature of logit KD.",
                                         affects="student_loss", group="signals", card="signals", valid="> 0")
    # student_loss, not teacher_outputs: a capture stores a teacher's logits (or final hidden states) at every
    # position, so one capture serves every choice of rows
    logit_kd_rows: str = option(LABELLED, "The positions whose next-token distributions logit KD compares. "
                                "labels: those that predict the labelled tokens CE learns (reasoning and answer, "
                                "as before) | all: every real position whose next token is real, prompt included | "
                                "a row selection as relation_rows takes it (answer | segment names, comma-separated "
                                "| field:<name>): the distribution at each selected row, the row a KV loss with the "
                                "same selection reads. N_kd counts them.", affects="student_loss", group="signals",
                                card="signals")
    logit_chunk_tokens: int | None = option(None, "CE and logit KD (same and cross vocabulary) from the student's "
                                            "final hidden states at the rows they read, this many tokens at a "
                                            "time (never the B×T×V logits; losses/chunked.py); 0: off (the "
                                            "model's logits); unset: chunks of hidden size / 4 tokens (at least "
                                            "128) when tokens × vocab > 2^26 or logit KD reads fewer rows than "
                                            "B×T, else off.",
                                            affects="student_loss", group="signals", valid=">= 0")
    transfer_lm_weight: float = option(0.0, "Weight of the student's LM loss on transfer records (sequence-level KD: "
                                       "learn the text a teacher wrote, e.g. by `kvdistill generate`); 0: transfer "
                                       "records teach through teacher signals only.",
                                       affects="student_loss", group="signals", card="signals", valid=">= 0")
    # ---- on-policy distillation (GKD; TRL's names; docs/training.md section 12)
    beta: float = option(0.5, "Generalized JSD beta of logit_kd_kind jsd (TRL's name): 0 = forward KL(teacher || "
                         "student), 1 = reverse KL(student || teacher), 0.5 = Jensen-Shannon.",
                         affects="student_loss", group="signals", card="signals", valid="in [0, 1]")
    lmbda: float = option(0.0, "Share of optimizer steps on which the student samples the completions it is taught "
                          "on (on-policy, GKD), drawn per step from a generator seeded by (seed, step); 0: the "
                          "data's answers only. On those steps the student gets no LM loss, only the teacher "
                          "signals, which every teacher computes on the student's text.",
                          affects="teacher_inputs", group="training", card="training", valid="in [0, 1]")
    temperature: float = option(0.9, "Sampling temperature of on-policy / seq_kd generation (TRL's name); the "
                                "logit-KD loss's softmax temperature is logit_kd_temperature.",
                                affects="teacher_inputs", group="training", card="training", valid="> 0")
    top_p: float = option(1.0, "Nucleus-sampling top_p of on-policy / seq_kd generation (top_k is off).",
                          affects="teacher_inputs", group="training", card="training", valid="in (0, 1]")
    max_new_tokens: int = option(128, "Completion budget of on-policy / seq_kd generation (lowered so prompt + "
                                 "completion fit max_length).", affects="teacher_inputs", group="training",
                                 card="training",
                                 valid=">= 1")
    seq_kd: bool = option(False, "Sequence-level KD (GKD's seq_kd): on the steps that are not on-policy the first "
                          "teacher samples the completions, and the student learns them (LM loss + teacher "
                          "signals).", affects="teacher_inputs", group="training", card="training")
    # ---- teachers
    fusion: str = option("loss_sum", f"Multi-teacher fusion: {FUSIONS}.",
                         affects="student_loss", group="signals", card="alignment")
    allow_self_teacher: bool = option(False, "Allow a teacher that is the student's own model read the same way (no "
                                      "control, rationale_field or shortened student_input): its targets are the "
                                      "student's own outputs at the start, a pull back to its initial weights.",
                                      affects="student_loss", group="models")
    teacher_offload: bool = option(False, "Keep teachers on CPU; move one at a time to the device for its forward.",
                                   affects="student_loss", group="models")
    teacher_cache: bool = option(False, "Keep every training record's teacher outputs in CPU memory, so each "
                                 "teacher runs once per record (many epochs over a small dataset).",
                                 affects="student_loss", group="models")
    teacher_capture: str | None = option(None, "Directory of a `kvdistill capture` made with this config: every "
                                         "teacher's outputs are read from it and no teacher weights are loaded. "
                                         "A capture of other data, tokenizer, max_length or teacher is refused.",
                                         affects="bookkeeping", group="models", card="alignment")
    capture_dtype: str = option("fp32", "dtype `kvdistill capture` stores the teacher cache in: fp32 | bf16 | fp16.",
                                affects="teacher_outputs", group="models")
    capture_layers: str = option("all", "Teacher layers `kvdistill capture` stores: all | mapped (only those the "
                                 "run's layer map reads; a run with another layer map refuses the capture).",
                                 affects="teacher_outputs", group="models")
    capture_keep: float = option(1.0, "Fraction of each teacher rationale's positions `kvdistill capture` stores (the "
                                 "prompt and answer are kept whole); 1 stores every position. Segment time alignment "
                                 "reads the kept ones (needs time_mode: segment, no logit KD).",
                                 affects="teacher_outputs", group="models", valid="in (0, 1]")
    capture_compression: str = option("uniform", f"How capture_keep < 1 picks the rationale positions: {COMPRESSIONS} "
                                      "(rkv: attention importance minus key redundancy, as teacher_compression).",
                                      affects="teacher_outputs", group="models")
    teacher_control: str = option("none", f"Control run {TEACHER_CONTROLS}: untrained = random-init copies of the "
                                  "teachers; shuffled = each sample gets another sample's teacher (a derangement "
                                  "within the batch); oracle = a cache coding the data's class field "
                                  "(oracle_field) in place of each teacher (its layer count and layer map kept, no "
                                  "weights loaded): a relation target, or through the projector a per-token code; permuted = teachers read the text with "
                                  "`permute` applied (the student the original); other_task = the listed teachers "
                                  "are trained on a related task without the knowledge (run as usual, labelled a "
                                  "control). A gain must beat the controls to count as knowledge transfer.",
                                  affects="teacher_outputs", group="models", card="alignment")
    oracle_field: str = option("class", "teacher_control oracle: the per-token class field of the data (token_fields): "
                               "tokens of one class relate, others do not (never captured: no teacher runs).",
                               affects="student_loss", group="models", card="alignment")
    oracle_code: str = option("onehot", f"teacher_control oracle: how oracle_field's values are coded {ORACLE_CODES}: "
                              "onehot = tokens of one class relate, others do not; fourier = the field holds numbers "
                              "0..p-1, placed on a circle (relation logit ∝ cos 2π(a-b)/p: a number layout).",
                              affects="student_loss", group="models", card="alignment")
    permute: str | None = option(None, "teacher_control permuted: numbers (every integer in permute_vocab) | names "
                                 "(every whole word in permute_vocab), mapped through one bijection seeded by `seed`.",
                                 affects="teacher_inputs", group="models", card="alignment")
    permute_vocab: None | str | list = option(None, "teacher_control permuted: what is permuted: a range `lo..hi` or "
                                              "a list of integers (numbers; others are kept), or a list of names.",
                                              affects="teacher_inputs", group="models", card="alignment")
    # ---- privileged teacher (KaVa)
    student_input: str = option("full", "What the student reads of the rationale: full | no_rationale | "
                                "short_rationale:K (its first K lines) | latent:N (N latent slot tokens in its place, "
                                "KaVa-style). Teachers always read the full rationale (privileged information).",
                                affects="student_loss", group="data", card="alignment")
    teacher_compression: str = option("rkv", f"With a shortened student input: how each teacher's rationale is "
                                      f"cut to the student's reasoning slots: {COMPRESSIONS} or none (proportional "
                                      "time alignment only).", affects="student_loss", group="alignment",
                                      card="alignment")
    compression_lambda: float = option(0.1, "R-KV: weight of key redundancy against attention importance.",
                                       affects="teacher_outputs", group="alignment", valid=">= 0")
    on_nonfinite: str = option("stop", f"A NaN/inf loss or gradient: {ON_NONFINITE}. stop = end the run with a "
                               "message naming the tensor (teacher, layer, keys/values) where it first appeared; "
                               "skip = warn, give the step zero gradient and go on (counted as nonfinite_skipped).",
                               affects="student_loss", group="training")
    aligner_learning_rate: float = option(1e-3, "Learning rate of projectors / aligners / fusion weights.",
                                          affects="student_loss", group="training", card="training", valid=">= 0")
    # ---- TrainingArguments defaults of the seed prototype
    output_dir: str | None = option("runs/kvdistill", "Where checkpoints, logs and the final student go.",
                                    affects="bookkeeping", group="output")
    overwrite_output_dir: bool = option(False, "Train into an output_dir that holds a run made with other settings "
                                        "(refused otherwise: its checkpoints would mix with this run's).",
                                        affects="bookkeeping", group="output")
    allow_low_memory: bool = option(False, "Train on CPU even when the estimated peak memory (`kvdistill dry-run`'s "
                                    "total) exceeds the machine's available memory (refused otherwise, before "
                                    "any weight loads).", affects="bookkeeping", group="output")
    learning_rate: float = option(5e-5, "Student learning rate.",
                                  affects="student_loss", group="training", card="training", valid="> 0")
    weight_decay: float = option(0.01, "Weight decay.", affects="student_loss", group="training", card="training",
                                 valid=">= 0")
    per_device_train_batch_size: int = option(2, "Batch size per device.",
                                              affects="student_loss", group="training", card="training", valid=">= 1")
    gradient_accumulation_steps: int = option(16, "Gradient accumulation steps.",
                                              affects="student_loss", group="training", card="training", valid=">= 1")
    max_steps: int = option(1000, "Optimizer steps.",
                            affects="student_loss", group="training", card="training", valid=">= 1 or -1")
    logging_steps: float = option(10, "Log every N steps.", affects="bookkeeping", group="output", valid="> 0")
    save_steps: float = option(200, "Checkpoint every N steps.", affects="bookkeeping", group="output", valid="> 0")
    report_to: None | str | list[str] = option("none", "tensorboard / wandb / none.", affects="bookkeeping",
                                               group="output")
    remove_unused_columns: bool = option(False, "Must stay False: the collator needs the raw records.",
                                         affects="student_loss", group="data")

    # ---- PEFT / LoRA student (TRL ModelConfig's names; needs the `peft` extra: pip install 'kvdistill[peft]').
    # The Python API takes `KVDistillTrainer(peft_config=LoraConfig(...))` instead, which wins over these.
    use_peft: bool = option(False, "Train LoRA adapters on the student instead of all its weights (the aligners "
                            "train in full either way).", affects="student_loss", group="models")
    lora_r: int = option(16, "use_peft: LoRA rank.", affects="student_loss", group="models", valid=">= 1")
    lora_alpha: int = option(32, "use_peft: LoRA alpha (the update is scaled by alpha / r).",
                             affects="student_loss", group="models", valid="> 0")
    lora_dropout: float = option(0.05, "use_peft: dropout on the LoRA input.", affects="student_loss",
                                 group="models", valid="in [0, 1)")
    lora_target_modules: None | str | list = option(None, "use_peft: the student modules that get adapters: names "
                                                    "(comma-separated or a list) or all-linear; null: peft's default "
                                                    "for the architecture.", affects="student_loss", group="models")

    def __post_init__(self) -> None:
        # mapping-valued options arrive as YAML objects from a file, or as strings from the CLI
        for key in ("teachers", "field_map", "transfer_field_map", "segment_weights", "permute_vocab"):
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
            "dataset_format": DATASET_FORMATS,
            "time_mode": TIME_MODES, "layer_map": LAYER_MAPS, "head_mode": HEAD_MODES, "projector": PROJECTORS,
            "kv_loss": KV_LOSSES, "fusion": FUSIONS, "logit_kd_kind": LOGIT_KD, "direction": DIRECTIONS,
            "key_space": ("auto", *KEY_SPACES), "projector_init": ("xavier", "orthogonal", "identity"),
            "teacher_control": TEACHER_CONTROLS, "teacher_compression": (*COMPRESSIONS, "none"),
            "on_nonfinite": ON_NONFINITE, "capture_dtype": ("fp32", "bf16", "fp16"), "capture_layers": ("all", "mapped"),
            "capture_compression": COMPRESSIONS, "oracle_code": ORACLE_CODES,
        }
        for key, allowed in choices.items():
            check_choice(key, getattr(self, key), allowed)
        # no student: the models come as objects (Python API, `KVDistillTrainer(model=..., teachers=[...])`), which
        # the trainer names in a copy of this config, checked then; the command line needs one (`parse_config`)
        named = self.student is not None
        if isinstance(self.max_length, int) and self.max_length < 8:
            raise ConfigError(f"max_length {self.max_length} leaves no room for a question and its answer; set "
                              "max_length >= 8 (512 is the default)")
        if self.max_steps == 0:
            raise ConfigError("max_steps 0 would still run one step; set max_steps >= 1, or -1 to train "
                              "num_train_epochs epochs")
        check_ranges(self, INHERITED_RANGES)  # every number finite and in its declared range
        self._check_segment_weights()
        if self.logging_strategy == "steps" and self.max_steps > 0 and self.logging_steps > self.max_steps:
            # no step would log: metrics.jsonl and the summary empty. Clamped rather than refused: the default (10)
            # and the shipped configs' values meet a short --max_steps (demo --quick) the user set alone
            logger.warning("logging_steps %g is more than max_steps %d, so no step would be logged; logging every "
                           "%d steps instead", self.logging_steps, self.max_steps, self.max_steps)
            self.logging_steps = self.max_steps
        if self.accuracy_stop > 0 and self.accuracy_eval_steps == 0:
            raise ConfigError(f"accuracy_stop {self.accuracy_stop} reads the accuracy curve, which is off; set "
                              "accuracy_eval_steps > 0 (every how many steps to check) or accuracy_stop: 0")
        if self.fp16 and (self.use_cpu or not torch.cuda.is_available()):
            raise ConfigError("fp16 mixed precision needs a CUDA GPU (on CPU it would be silently ignored); drop "
                              "--fp16, or use --bf16 on CPU")
        # one model read the same way twice is one teacher counted twice (another rationale is not)
        views = [(_resolved(t.path), t.tokenizer, t.rationale_field, t.template, t.dtype, t.quantization,
                  self.teacher_controls[t.name]) for t in self.teacher_configs]
        repeated = [v[0] for v in views if views.count(v) > 1]
        if repeated:
            raise ConfigError(f"teacher {repeated[0]} is listed twice with the same settings; list it once (its "
                              "`weight` sets how much it counts)")
        # the student's own model reading its text: its targets are the student's outputs (a typo, most often)
        own = [t for t in self.active_teachers if named and _resolved(t.path) == _resolved(self.student) and
               t.tokenizer in (None, "student") and t.rationale_field is None and t.template is None
               and self.student_input == "full"
               and self.teacher_controls[t.name] == "none"]
        if own and not self.allow_self_teacher:
            raise ConfigError(f"teacher {own[0].name} is the student itself ({own[0].path}), reading the same text: "
                              "its targets are the student's own outputs, a pull back to its initial weights; give "
                              "another teacher, or pass --allow_self_teacher true if you mean it")
        if self.ce_weight == 0 and not self.allow_kv_only:
            raise ConfigError(
                "ce_weight=0 trains on the KV loss alone, which can collapse to a high cos-sim that teaches "
                "nothing; set allow_kv_only: true if you mean it"
            )
        if named and self.teacher_signal and not self.teacher_configs:
            raise ConfigError("kv_weight/codi_weight/logit_kd_weight > 0 need at least one teacher in `teachers` "
                              "(for SFT only, set kv_weight: 0)")
        if (self.activation_checkpointing or self.gradient_checkpointing) and self.kv_weight > 0:
            raise ConfigError("gradient (activation) checkpointing makes transformers drop the student's KV cache in "
                              "training, so the KV loss has nothing to compare; set activation_checkpointing: false "
                              "(or kv_weight: 0); see docs/training.md")
        if self.key_space == "auto":
            self.key_space = "pre_rope" if self.kv_loss == "relation" else "post_rope"
        self._check_attention()
        try:
            parse_student_input(self.student_input)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self._check_control()
        if self.kv_loss == "relation" and self.fusion == "kv_mean":
            raise ConfigError("fusion: kv_mean averages projected teacher KVs; kv_loss relation has no projector, "
                              "use fusion: loss_sum (or learned / correctness)")
        if "shuffled" in self.teacher_controls.values() and self.per_device_train_batch_size < 2:
            raise ConfigError("teacher_control: shuffled pairs each sample with another sample of its batch; set "
                              "per_device_train_batch_size >= 2")
        if self.logit_kd_weight > 0 and self.student_input != "full":
            raise ConfigError("logit KD compares teacher and student on the same tokens; it cannot run with a "
                              "shortened student_input (set logit_kd_weight: 0)")
        self._check_on_policy()
        for key in ("field_map", "transfer_field_map"):
            value = getattr(self, key)
            if isinstance(value, str) and value not in FIELD_MAPS:
                raise ConfigError(f"{key} {value!r} is not a known name {sorted(FIELD_MAPS)}; give a mapping "
                                  "{question: <column>, answer: <column>}")
        self.transfer_batch_size = self.transfer_batch_size or self.per_device_train_batch_size
        if self.transfer_lm_weight > 0 and not self.transfer_data:
            raise ConfigError("transfer_lm_weight > 0 learns the text of a transfer set; set transfer_data (e.g. "
                              "written by `kvdistill generate`) or transfer_lm_weight: 0")
        if self.transfer_data and self.fusion == "correctness":
            raise ConfigError("fusion: correctness weighs teachers by their answers to the labelled records; the "
                              "transfer set has no gold answers: use fusion loss_sum or learned with transfer_data")
        if self.capture_layers == "mapped" and self.student_input != "full" and self.teacher_compression == "rkv":
            raise ConfigError("capture_layers: mapped drops teacher layers that teacher_compression: rkv scores "
                              "tokens with; use capture_layers: all, or teacher_compression uniform / random / none")
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
        self._check_options_act()
        names = [t.name for t in self.teacher_configs]
        if len(set(names)) != len(names):
            raise ConfigError(f"teacher names must be unique, got {names}; set `name:` per teacher")
        for t in self.teacher_configs:
            if not _is_model_ref(t.path):
                raise ConfigError(f"teacher {t.name}: path {t.path!r} does not exist; give a local model "
                                  "directory or a Hub id")
            if self.layer_map == "cka" and self.kv_weight > 0 and t.weight > 0:  # weight 0: no KV read
                if t.layer_map is None:
                    raise ConfigError(f"layer_map: cka but teacher {t.name} has no layer_map JSON; run "
                                      "`kvdistill layer-map` and set the teacher's `layer_map:` path")
                if not Path(t.layer_map).exists():
                    raise ConfigError(f"teacher {t.name}: layer map {t.layer_map} not found")
                self._check_layer_map_counts(t)
        if not named:
            return
        if not _is_model_ref(self.student):
            raise ConfigError(f"student path {self.student!r} does not exist; give a local model directory "
                              "or a Hub id")
        self._check_windows()

    def _check_segment_weights(self) -> None:
        """segment_weights: a mapping of segment names to weights >= 0 (a negative weight would reward distance)."""
        weights = self.segment_weights
        if weights is None:
            return
        if not isinstance(weights, dict):
            raise ConfigError(f"segment_weights must be a mapping {{prompt: w, reasoning: w, answer: w}}, got "
                              f"{weights!r}")
        names = tuple(SEGMENT_NAMES.values())
        for name, w in weights.items():
            if name not in names:
                raise ConfigError(f"segment_weights: unknown segment {name!r}{suggest(str(name), names)}; the "
                                  f"segments are {', '.join(names)}")
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not within(w, ">= 0"):
                raise ConfigError(f"segment_weights {name}: {w} is not a weight >= 0; give each segment a weight "
                                  ">= 0 (0 leaves it out of the KV loss)")

    def _check_windows(self) -> None:
        """max_length fits the KV cache of every model whose KV the run reads: transformers keeps only the last
        `sliding_window - 1` tokens of a sliding-window layer, and layers of two lengths cannot be stacked
        (config.json only, no weights)."""
        if self.kv_weight == 0:
            return
        readers = [("student", self.student), *((f"teacher {t.name}", t.path) for t in self.teacher_configs
                                                 if t.weight > 0 and self.teacher_control != "oracle")]
        for who, path in readers:
            window = sliding_window(path)
            if window is not None and self.max_length > window - 1:
                raise ConfigError(f"max_length {self.max_length}: {who} ({path}) has layers with a sliding window of "
                                  f"{window} tokens, whose KV cache keeps only the last {window - 1}; set max_length "
                                  f"<= {window - 1}")

    def _check_control(self) -> None:
        """The options of the oracle / permuted / other_task controls (run-wide or per teacher), what they
        cannot run with, and the teachers of weight 0 (logits only)."""
        c = self.teacher_control
        used = {c, *self.teacher_controls.values()}
        for d in ("oracle", "permuted", "other_task"):
            if d in used and not self.teacher_signal:
                raise ConfigError(f"teacher_control: {d} controls a teacher signal; set kv_weight (or codi_weight / "
                                  "logit_kd_weight) > 0")
        if "permuted" not in used and (self.permute is not None or self.permute_vocab is not None):
            raise ConfigError("permute / permute_vocab apply only with teacher_control: permuted; set it or drop them")
        if c != "oracle" and self.oracle_code != "onehot":
            raise ConfigError("oracle_code applies only with teacher_control: oracle; set it or drop oracle_code")
        if "permuted" in used:
            try:
                TextPermutation.seeded(self.permute, self.permute_vocab, self.seed)
            except ValueError as err:
                raise ConfigError(f"teacher_control: permuted: {err}") from None
        for t in self.teacher_configs:
            own = self.teacher_controls[t.name]
            # a shuffled teacher reads another sample, a permuted one another text: no position of its logits
            # predicts the student's token (an untrained teacher's logits are a control of logit KD itself)
            if own in ("shuffled", "permuted") and self.logit_kd_weight > 0 and t.logit_kd != "off":
                raise ConfigError(f"teacher {t.name}: logit KD compares teacher and student on the same tokens, "
                                  f"which a {own} teacher does not read; set its logit_kd: off (or logit_kd_weight: 0)")
            if self.teacher_signal and t.weight == 0 and not (self.logit_kd_weight > 0 and t.logit_kd != "off"):
                raise ConfigError(f"teacher {t.name} has weight 0 (logits only: no KV or CODI) but gives no logits "
                                  "(logit_kd off or logit_kd_weight 0); give it a weight > 0 or drop it")
        if (self.kv_weight > 0 or self.codi_weight > 0) and self.teacher_configs and \
                all(t.weight == 0 for t in self.teacher_configs):
            raise ConfigError("every teacher has weight 0 (logits only), so kv_weight / codi_weight read none; give "
                              "a teacher weight > 0, or set kv_weight: 0 and codi_weight: 0")
        if c == "oracle":
            if any(t.control is not None for t in self.teacher_configs):
                raise ConfigError("teacher_control: oracle replaces every teacher; drop the teachers' own `control`")
            if self.kv_loss == "attention" or self.kv_weight <= 0:
                raise ConfigError("teacher_control: oracle is a key/value target (no queries, no attention map); set "
                                  "kv_weight > 0 and a kv_loss other than attention")
            if self.logit_kd_weight > 0 or self.codi_weight > 0:
                raise ConfigError("teacher_control: oracle has no logits or hidden states; set logit_kd_weight: 0 "
                                  "and codi_weight: 0")
            if self.teacher_capture or self.fusion == "correctness":
                raise ConfigError("teacher_control: oracle runs no teacher (nothing to capture or to answer with); "
                                  "drop teacher_capture and use fusion loss_sum or learned")

    def _check_on_policy(self) -> None:
        """What on-policy / seq_kd generation cannot run with (their ranges are their `valid` rules)."""
        if self.beta != 0.5 and self.logit_kd_kind != "jsd":
            raise ConfigError(f"beta applies to logit_kd_kind jsd (generalized JSD), not {self.logit_kd_kind}; set "
                              "logit_kd_kind: jsd (beta 0 = forward KL, 1 = reverse KL), or drop beta")
        if not (self.lmbda > 0 or self.seq_kd):
            return
        what = "lmbda > 0" if self.lmbda > 0 else "seq_kd"
        if self.lmbda > 0 and self.transfer_lm_weight > 0:  # its samples are unlabelled rows, as transfer records
            raise ConfigError("lmbda > 0 with transfer_lm_weight > 0 would give the student an LM loss on its own "
                              "samples; set transfer_lm_weight: 0 (on-policy steps teach through teachers only) or "
                              "lmbda: 0 (seq_kd learns a teacher's text)")
        if not self.teacher_signal:
            raise ConfigError(f"{what} teaches the student from its teachers on generated text; set a teacher signal "
                              "(logit_kd_weight, kv_weight or codi_weight > 0) with at least one teacher")
        if self.lmbda == 1 and self.logit_kd_weight == 0 and not self.allow_kv_only:  # as ce_weight 0 is refused
            raise ConfigError("lmbda 1 puts every step on-policy, where the student gets no LM loss: without logit KD "
                              "it trains on the KV loss alone, which can collapse to a high cos-sim that teaches "
                              "nothing; set lmbda < 1 or logit_kd_weight > 0, or allow_kv_only: true if you mean it")
        if self.teacher_cache or self.teacher_capture:
            raise ConfigError(f"{what}: teacher_cache / teacher_capture store teacher outputs per record, but the "
                              "generated text changes every step; set teacher_cache: false and no teacher_capture")
        if self.student_input != "full":
            raise ConfigError(f"{what}: the student writes its whole completion, so student_input must be full, got "
                              f"{self.student_input}")
        if {"permuted", "oracle"} & {self.teacher_control, *self.teacher_controls.values()}:
            raise ConfigError(f"{what}: teacher_control permuted / oracle reads per-record facts of the data's "
                              "text, which generated text does not have; use none, untrained or shuffled")
        own = [t.name for t in self.active_teachers if t.template is not None]
        if own:  # the completions' teachers read the run's prompt: a teacher's own one would be dropped unasked
            raise ConfigError(f"{what}: teacher {own[0]} has its own template, which generated completions are not "
                              "read with (teachers read them under prompt_template); drop its template, or lmbda: 0 "
                              "and seq_kd: false")
        if self.fsdp:
            raise ConfigError(f"{what} generates every step, which under FSDP steps every rank's sharded forward in "
                              "lockstep (untested); use DDP or DeepSpeed ZeRO-1/2, or lmbda: 0 and seq_kd: false")

    def _check_options_act(self) -> None:
        """An option this run's other settings leave without effect is named in a one-line warning (a
        shared base config sets it for every run, and a run overrides what makes it act)."""
        for t in self.teacher_configs:
            if t.layer_map and self.layer_map != "cka" and self.kv_weight > 0:
                logger.warning("teacher %s: its layer_map JSON is not read: layer_map is %s (set layer_map: cka to "
                               "use it)", t.name, self.layer_map)
        # build.py reads the transfer set for a teacher signal or for its LM loss (sequence-level KD)
        if self.transfer_data and not self.teacher_signal and not self.transfer_lm_weight > 0:
            logger.warning("transfer_data %s is not read: this run has no teacher signal (kv_weight, codi_weight, "
                           "logit_kd_weight all 0) and transfer_lm_weight is 0, and transfer records teach only "
                           "through teachers or their LM loss", self.transfer_data)

    def _check_layer_map_counts(self, t: TeacherConfig) -> None:
        """Compare a layer map's layer counts with the models' configs (config.json only, no weights)."""
        try:
            doc = json.loads(Path(t.layer_map).read_text())
        except ValueError as err:  # not JSON or not UTF-8 (a truncated copy): name the file
            raise ConfigError(f"teacher {t.name}: layer map {t.layer_map} is not valid JSON ({err}); re-run "
                              "`kvdistill layer-map`") from None
        doc = doc if isinstance(doc, dict) else {}  # the format is checked when the map is loaded
        for side, path in (("student", self.student), ("teacher", t.path)):
            cfg_file = Path(model_dir(path)) / "config.json"
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

    @property
    def teacher_controls(self) -> dict[str, str]:
        """`{teacher name: its control}`: a teacher's own `control`, else the run's `teacher_control`."""
        return teacher_controls([{"name": t.name, "control": t.control} for t in self.teacher_configs],
                                self.teacher_control)

    @property
    def active_teachers(self) -> list[TeacherConfig]:
        """The teachers this run reads: all of them under a teacher signal, none without one."""
        return self.teacher_configs if self.teacher_signal else []

    def teacher_outputs(self, logit_kd: str) -> tuple[str, bool, bool, bool]:
        """What training reads from a teacher: `(key_space, hidden states?, logits?, queries?)`. Hidden
        states for CODI; logits for logit KD, from a teacher whose resolved `logit_kd` mode (`Teacher.logit_kd`)
        is not off; post-RoPE queries for kv_loss attention."""
        return (self.key_space, self.codi_weight > 0, self.logit_kd_weight > 0 and logit_kd != "off",
                self.kv_loss == "attention")

    def _check_attention(self) -> None:
        """relation_rows, logit_kd_rows and kv_loss attention: what they need and cannot run with."""
        rows = {"relation_rows": self.relation_rows}
        if self.logit_kd_rows != LABELLED:  # else a row selection, as relation_rows'
            rows["logit_kd_rows"] = self.logit_kd_rows
        for name, spec in rows.items():
            try:
                parse_rows(spec, name)
            except ValueError as err:
                raise ConfigError(str(err) + ("" if name == "relation_rows" else f", or {LABELLED}")) from None
            if spec.strip().startswith("field:") and (self.lmbda > 0 or self.seq_kd):
                raise ConfigError(f"{name} field:<name> reads the data's per-token fields, which generated "
                                  "completions (lmbda > 0, seq_kd) do not carry; use segment rows (e.g. answer) or "
                                  "turn generation off")
        if self.kv_loss != "attention":
            return
        if self.key_space != "post_rope":
            raise ConfigError("kv_loss attention compares softmax(Q Kᵀ) of rotated queries and keys; set key_space: "
                              "post_rope (or auto)")
        if self.fusion == "kv_mean":
            raise ConfigError("fusion: kv_mean averages projected teacher KVs; kv_loss attention has no projector, "
                              "use fusion: loss_sum (or learned / correctness)")
        if self.student_input != "full" or self.capture_keep < 1:
            raise ConfigError("kv_loss attention needs the teacher's queries at every position; a shortened "
                              "student_input or capture_keep < 1 drops positions: use student_input: full and "
                              "capture_keep: 1")

    def to_yaml_dict(self) -> dict:
        """The resolved config as plain YAML-able data (enums as strings, teachers as mappings)."""
        d = {k: v for k, v in self.to_dict().items() if not k.startswith("_") and k != "teacher_configs"}
        # a teacher's control is written only when set: configs written before it existed still compare equal
        d["teachers"] = [{k: v for k, v in asdict(replace(t, model=None)).items()
                          if k != "model" and (k != "control" or v is not None)} for t in self.teacher_configs]
        return yaml.safe_load(yaml.safe_dump(d, default_flow_style=False, allow_unicode=True))


# Options inherited from TrainingArguments carry no metadata: their roles, card sections and valid
# ranges are declared here. One not listed changes what the student learns, and a number must be finite.
INHERITED: dict[str, dict[str, str]] = {
    "save_strategy": {"affects": "bookkeeping"}, "save_total_limit": {"affects": "bookkeeping"},
    "disable_tqdm": {"affects": "bookkeeping"}, "resume_from_checkpoint": {"affects": "bookkeeping"},
    "seed": {"card": "training", "valid": ">= 0"},
    "bf16": {"card": "training"}, "fp16": {"card": "training"}, "num_train_epochs": {"valid": "> 0"},
    "warmup_steps": {"valid": ">= 0"}, "max_grad_norm": {"valid": ">= 0"}, "adam_beta1": {"valid": "in [0, 1)"},
    "adam_beta2": {"valid": "in [0, 1)"}, "adam_epsilon": {"valid": ">= 0"},
    "label_smoothing_factor": {"valid": "in [0, 1)"},
}
INHERITED_RANGES = {k: v["valid"] for k, v in INHERITED.items() if "valid" in v}


def option_meta(name: str, cls: type = KVDistillConfig) -> dict[str, Any]:
    """The metadata (`affects`, `card`, `valid`, `help`) of option `name` of `cls`."""
    if name in inspect.get_annotations(cls) or cls is TeacherConfig:
        return dict(cls.__dataclass_fields__[name].metadata)
    return {"affects": "student_loss", **INHERITED.get(name, {})}


def option_names(cls: type = KVDistillConfig, **meta: str) -> tuple[str, ...]:
    """The options of `cls` whose metadata holds `meta` (e.g. `affects="teacher_outputs"`): its own in
    declaration order, then the inherited ones."""
    own = list(inspect.get_annotations(cls))
    names = own + [f.name for f in fields(cls) if f.name not in own]
    return tuple(n for n in names if all(option_meta(n, cls).get(k) == v for k, v in meta.items()))


def card_sections() -> dict[str, tuple[str, ...]]:
    """The options each section of a student's model card shows (`card.py`), as declared by `card=`."""
    return {section: option_names(card=section) for section in SECTIONS}


# the loss weights that read teachers: a run with all of them 0 loads none
TEACHER_SIGNALS = option_names(affects="teacher_signal")
# how often and where a run writes, not what it learns: may change between a run and its resumption
# (a run dir copied into another ablation's output_dir is reused there)
BOOKKEEPING = frozenset(option_names(affects="bookkeeping"))


def _resolved(ref: str) -> str:
    """A model path as one directory, whatever the spelling (`./m`, `m/`, a link); a Hub id as given."""
    return str(Path(str(ref)).resolve()) if Path(str(ref)).exists() else str(ref)


def _is_model_ref(ref: str) -> bool:
    """A local path that exists, or something shaped like a Hub id ("org/name" or "name")."""
    if Path(ref).exists():
        return True
    return not ref.startswith((".", "/", "~")) and ref.count("/") <= 1


def parse_config(argv: list[str] | None = None, prog: str = "kvdistill train",
                 description: str = DESCRIPTION) -> KVDistillConfig:
    """`--config x.yaml` plus `--key value` overrides -> `KVDistillConfig` (CLI wins over YAML)."""
    cfg = parse_command_config(KVDistillConfig, argv, prog, description, first=TrainingArguments)
    if cfg.student is None:  # only the Python API gives its student as an object
        raise ConfigError("no student: set `student: <hub id or local dir>`")
    return cfg


def object_ref(model: Any) -> str:
    """How a config names a loaded model: its `name_or_path` (the directory or Hub id it was loaded from), else
    its class and identity (a model built in memory), so one object given twice is one model."""
    return getattr(model, "name_or_path", "") or f"{type(model).__name__}@{id(model):x}"
