"""Config -> trainer: everything that turns a `KVDistillConfig` into models, data, teachers, aligners
and a `KVDistillTrainer`, and a capture's identity. The commands (`train`, `capture`, `dry_run`)
and the benchmarks call it; no command imports another for these.

Two doors, one path: `load_run` loads the objects a config names by path, `KVDistillTrainer(model=<student>,
teachers=[TeacherConfig(model=...)], ...)` is given them (`object_inputs`); both hand them to `prepare_run`
(every check, teacher, collator) and `trainer_inputs` (aligners, fusion, `KVDistillModel`).

    run = load_run(cfg)                      # student, tokenizer, records, teachers, collator
    settings = capture_settings(cfg, run)    # what a teacher capture of this run must match
    trainer = build_trainer(cfg)             # all of the above, wired
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from transformers import set_seed
from transformers.integrations import is_deepspeed_zero3_enabled

from kvdistill.align.aligner import KVAligner, cache_dims
from kvdistill.align.layer_map import build_layer_map
from kvdistill.cache import SEGMENT_NAMES, extract_kv, query_modules
from kvdistill.capture import (
    CaptureReader,
    mapped_layers,
    tokenizer_hash,
    update_token_hash,
    weights_fingerprint,
)
from kvdistill.config import ConfigError
from kvdistill.controls import TextPermutation, oracle_width
from kvdistill.data import (
    DataError,
    DistillCollator,
    TeacherView,
    add_latent_token,
    describe_format,
    load_records,
    prompt_reads,
    records_from_dataset,
    require_finals,
    teacher_view,
)
from kvdistill.fields import FIELD_KEY
from kvdistill.fusion import TeacherFusion
from kvdistill.io import read_json, write_json_atomic
from kvdistill.losses import LABELLED, RelationKVLoss, build_kv_loss, resolve_chunk_tokens
from kvdistill.losses.attention import AttentionMapLoss
from kvdistill.losses.relation import parse_rows
from kvdistill.memory import Component, aligner_dims, codi_params, estimate, kv_dims, meta_aligner
from kvdistill.models import (
    check_length,
    check_vocab,
    config_hash,
    load_model,
    load_tokenizer,
    max_positions,
    num_layers,
)
from kvdistill.runs import resolve_model
from kvdistill.teachers import Teacher, TeacherSet, load_teacher, resolve_logit_kd, vocab_map
from kvdistill.train.config import KVDistillConfig, TeacherConfig, object_ref, option_names
from kvdistill.train.distributed import gathered
from kvdistill.train.model import KVDistillModel, LogitTeacher, LossWeights
from kvdistill.train.trainer import KVDistillTrainer, oracle_targets

logger = logging.getLogger(__name__)
SEGMENT_KEYS = {name: sid for sid, name in SEGMENT_NAMES.items()}


def _segment_weights(cfg: KVDistillConfig) -> dict[int, float]:
    """`segment_weights` with segment names resolved to ids: `{"prompt": 0}` -> `{0: 0.0}`."""
    return {SEGMENT_KEYS.get(k, k): float(v) for k, v in (cfg.segment_weights or {}).items()}


def _kv_loss(cfg: KVDistillConfig):
    segment_weights = _segment_weights(cfg)
    if cfg.kv_loss == "relation":
        return RelationKVLoss(relation_heads=cfg.relation_heads, temperature=cfg.relation_temperature,
                              reduction="sum", segment_weights=segment_weights, chunk_size=cfg.relation_chunk_size,
                              compile=cfg.relation_compile)
    if cfg.kv_loss == "attention":
        return AttentionMapLoss(reduction="sum", segment_weights=segment_weights, chunk_size=cfg.relation_chunk_size,
                                compile=cfg.relation_compile)
    kwargs = {"reduction": "sum", "normalize_target": cfg.normalize_target}
    if cfg.kv_loss in ("mercator", "hybrid"):
        kwargs.update(alpha=cfg.mercator_alpha, beta=cfg.mercator_beta)
    if cfg.kv_loss == "hybrid":
        kwargs["weight"] = cfg.hybrid_weight
    if segment_weights:
        kwargs["segment_weights"] = segment_weights
    return build_kv_loss(cfg.kv_loss, **kwargs)


def check_relation_heads(cfg: KVDistillConfig, name: str, dims: dict[str, int]) -> None:
    """kv_loss relation splits each side's H*D (`cache_dims`) into `relation_heads` chunks: say so
    before training starts."""
    for side in ("student", "teacher"):
        F = dims[f"{side}_heads"] * dims[f"{side}_key_dim"]
        if F % cfg.relation_heads:
            raise ConfigError(f"relation_heads={cfg.relation_heads} does not divide the {side}'s H*D = {F} "
                              f"(teacher {name}); pick a divisor of {F}")


def make_aligner(cfg: KVDistillConfig, spec: TeacherConfig, layer_map: torch.Tensor) -> KVAligner:
    """One teacher's aligner with the run's options (the teacher's own projector options win)."""
    return KVAligner(
        mode=cfg.head_mode, time_mode=cfg.time_mode, layer_map=layer_map,
        projector="none" if cfg.kv_loss in ("relation", "attention") else (spec.projector or cfg.projector),
        mlp_ratio=spec.mlp_ratio if spec.mlp_ratio is not None else cfg.mlp_ratio,
        dropout=spec.projector_dropout if spec.projector_dropout is not None else cfg.projector_dropout,
        init=spec.projector_init or cfg.projector_init, share_layers=cfg.share_layers, direction=cfg.direction,
        trainable=cfg.projector_trainable,
    )


# ----------------------------------------------------------------------------- the plan on the meta device
# (what `kvdistill dry-run` prints and `kvdistill train` checks on CPU before loading: `kvdistill.memory`)


def micro_batch(cfg: KVDistillConfig) -> int:
    """Sequences in one micro-batch: the labelled ones and, with a transfer set and teachers, its records."""
    return cfg.per_device_train_batch_size + (cfg.transfer_batch_size if cfg.transfer_data and cfg.active_teachers
                                              else 0)


def meta_aligners(cfg: KVDistillConfig, specs: list[TeacherConfig], comps: list[Component]
                  ) -> dict[str, tuple[KVAligner, dict[str, int], int]]:
    """Each teacher's aligner as `build_trainer` builds it, on the meta device, with the dims it aligns and its
    CODI head's parameter count: `{name: (aligner, dims, codi)}`. `comps`: `memory.build_components`' student
    then `specs`' teachers; a teacher of weight 0 has none (logits only, as `build_trainer`). `layer_map: cka`
    gets a proportional map of the same shape [L_s, L_t]: it maps every student layer, as a CKA top-k map does."""
    student, out = comps[0], {}
    kind = "proportional" if cfg.layer_map == "cka" else cfg.layer_map
    for t, spec in zip(comps[1:], specs):
        if spec.weight == 0:
            continue
        dims = aligner_dims(kv_dims(t.model), kv_dims(student.model))
        if cfg.kv_loss == "relation":
            check_relation_heads(cfg, t.name, dims)
        layer_map = build_layer_map(kind, dims["student_layers"], dims["teacher_layers"], k=cfg.layer_map_k)  # [L_s, L_t]
        out[t.name] = (meta_aligner(make_aligner(cfg, spec, layer_map), dims), dims,
                       codi_params(t, student, cfg.codi_weight > 0))
    return out


def planned_memory(cfg: KVDistillConfig, comps: list[Component],
                   aligners: dict[str, tuple[KVAligner, dict[str, int], int]], *, mixed: str | None,
                   offload: bool) -> list[dict[str, Any]]:
    """`memory.estimate`'s items for the run `cfg` names: one micro-batch (`micro_batch`) of `max_length` tokens,
    the models of `comps` and the aligners (and CODI heads) of `meta_aligners`."""
    counts = [(a.param_counts(), codi) for a, _, codi in aligners.values()]
    return estimate(comps[0], comps[1:], B=micro_batch(cfg), T=cfg.max_length, mixed=mixed,
                    logits=cfg.logit_kd_weight > 0, hidden=cfg.codi_weight > 0, offload=offload,
                    captured=bool(cfg.teacher_capture), aligner_params=sum(c["total"] + codi for c, codi in counts),
                    aligner_trainable=sum(c["trainable"] + codi for c, codi in counts), key_space=cfg.key_space)


def _logit_teachers(tokenizer: Any, teachers: list[Teacher]) -> dict[str, LogitTeacher]:
    """Each logit-giving teacher's mode; a cross_vocab one with the tokens both vocabularies share."""
    out = {}
    for t in teachers:
        if t.logit_kd == "cross_vocab":
            out[t.name] = LogitTeacher("cross_vocab", *vocab_map(tokenizer, t.tokenizer), len(t.tokenizer))
            shared = len(out[t.name].student_ids)
            logger.info("teacher %s: cross-vocabulary logit KD at the positions where both tokenizers end a token "
                        "at the same character; %s tokens are in both vocabularies (%.0f%% of the student's %s, "
                        "%.0f%% of the teacher's %s): a divergence on those, sorted-probability L1 on the rest",
                        t.name, f"{shared:,}", 100 * shared / len(tokenizer), f"{len(tokenizer):,}",
                        100 * shared / len(t.tokenizer), f"{len(t.tokenizer):,}")
        elif t.logit_kd == "same_vocab":
            out[t.name] = LogitTeacher("same_vocab")
    return out


def _kv_segments(cfg: KVDistillConfig) -> tuple[int, ...]:
    """Segments the KV loss counts tokens in (those not weighted 0)."""
    w = _segment_weights(cfg)
    return tuple(s for s in SEGMENT_NAMES if w.get(s, 1.0) > 0)


def _layer_map(cfg: KVDistillConfig, spec, student, teacher) -> torch.Tensor:
    L_s, L_t = num_layers(student), num_layers(teacher)
    kind = {"cka": "json"}.get(cfg.layer_map, cfg.layer_map)
    try:
        return build_layer_map(
            kind, L_s, L_t, k=cfg.layer_map_k, path=spec.layer_map,
            student_hash=config_hash(student), teacher_hash=config_hash(teacher),
            check_hashes=not cfg.ignore_layer_map_hash,
        )
    except (OSError, ValueError) as err:  # the builders name the file and the fix
        raise ConfigError(f"teacher {spec.name}: {err}") from None


def teacher_correctness(cfg: KVDistillConfig, teachers: Iterable[Teacher], records: list[dict]) -> torch.Tensor:
    """`[num_records, N]` 0/1: did each teacher's greedy answer match the gold one (cached on disk).

    Under several processes the main one answers and writes the cache first; the others wait
    (`main_process_first`) and read it, so no two ranks write the file at once.
    """
    from kvdistill.evaluate.scoring import evaluate_model

    state = PartialState()
    cache = Path(cfg.output_dir) / "teacher_correctness.json"
    cols = []
    with state.main_process_first():
        stored = read_json(cache, {})
        for t in teachers:
            key = f"{t.name}:{t.config_hash}:{len(records)}"
            if key not in stored:
                logger.info("fusion=correctness: answering %d training problems with teacher %s",
                            len(records), t.name)
                res = evaluate_model(t.model, t.tokenizer, records, batch_size=16, max_new_tokens=cfg.max_length,
                                     template=cfg.prompt_template, perplexity=False)
                stored[key] = [int(it["correct"]) for it in res["items"]]
                if state.is_main_process:
                    write_json_atomic(cache, stored, indent=None)
            cols.append(torch.tensor(stored[key], dtype=torch.float32))
    return torch.stack(cols, 1)


def check_zero3(cfg: KVDistillConfig) -> None:
    """Refuse, before anything loads, what has the main process generate alone: under ZeRO-3 on several
    processes `generate` steps in sync over the ranks (transformers' `synced_gpus`), so it would wait
    forever for the others."""
    if cfg.world_size == 1 or not is_deepspeed_zero3_enabled():
        return
    why = "which under ZeRO-3 on several processes waits forever for the others"
    if cfg.fusion == "correctness":
        raise ConfigError(f"fusion: correctness has the main process answer with each teacher before training, "
                          f"{why}; use fusion loss_sum or learned, or ZeRO-2")
    if cfg.accuracy_eval_steps > 0:
        raise ConfigError(f"accuracy_eval_steps has the main process decode with the student during training, {why}; "
                          "set accuracy_eval_steps 0 and run `kvdistill eval` on the checkpoints, or use ZeRO-2")
    if cfg.lmbda > 0 or cfg.seq_kd:
        raise ConfigError("lmbda > 0 / seq_kd generate every step, which under ZeRO-3 steps every rank's partitioned "
                          "forward in lockstep (untested); use ZeRO-1/2 or DDP, or lmbda: 0 and seq_kd: false")


@dataclass
class RunInputs:
    """What a run reads before any training: tokenizer, student, records, teachers, collator."""

    tokenizer: Any
    student: Any
    records: list[dict]  # labelled records, index 0..n-1
    transfer: list[dict]  # transfer records, index n..n+m-1
    teachers: list[Teacher]
    specs: list[TeacherConfig]
    collator: DistillCollator


def cpu_student_dtype(student: torch.nn.Module, cfg: KVDistillConfig) -> torch.nn.Module:
    """On CPU, a student whose weights load in fp16 (asked, or `auto` from an fp16 checkpoint) is refused:
    it diverges within a few steps; bf16 weights are upcast to fp32 with a warning: bf16 rounds away
    updates below ~1/256 of a weight (docs/training.md, "dtype on CPU", has the measurements)."""
    if cfg.device.type != "cpu" or student.dtype not in (torch.float16, torch.bfloat16):
        return student
    if student.dtype == torch.float16:
        raise ConfigError(f"student {cfg.student} loads in fp16 (student_dtype {cfg.student_dtype}), which overflows "
                          "on CPU within a few steps (fp16 training needs a GPU's loss scaling); set "
                          "--student_dtype fp32 (add --bf16 for bf16 compute)")
    logger.warning("student_dtype %s gives bf16 weights, upcast to fp32 on CPU: bf16 weights drop updates below "
                   "~1/256 of a weight (at lr 5e-5 45%% of them never moved in 20 steps); for bf16 compute keep fp32 "
                   "weights and add --bf16 (autocast)", cfg.student_dtype)
    return student.float()


def _rationale_fields(cfg: KVDistillConfig) -> list[str]:
    return [t.rationale_field for t in cfg.teacher_configs if t.rationale_field]


def config_records(cfg: KVDistillConfig) -> list[dict]:
    """The labelled records `cfg.data` names (learned: each answer must say which part is the final answer)."""
    return load_records(cfg.data, cfg.data_split, cfg.field_map, cfg.max_samples, extra_fields=_rationale_fields(cfg),
                        require_final=True, dataset_format=cfg.dataset_format)


def dataset_records(dataset: Any, cfg: KVDistillConfig, labelled: bool = True, name: str = "train_dataset"
                    ) -> list[dict]:
    """A `datasets.Dataset` (or a list of dicts) as the records `load_records` makes of a file: each row checked
    and converted in the data's format (`dataset_format`, detected by default), `max_samples` applied to the
    labelled ones."""
    if not hasattr(dataset, "__len__"):  # a streaming IterableDataset: records are indexed (teacher cache, fusion)
        raise DataError(f"{name} has no length (an IterableDataset?); give a datasets.Dataset or a list of dicts, "
                        "e.g. Dataset.from_list(list(ds.take(n)))")
    if not len(dataset):
        raise DataError(f"{name} holds no records; give at least one record (docs/data.md lists the formats)")
    return records_from_dataset(dataset, field_map=cfg.field_map, limit=cfg.max_samples if labelled else None,
                                extra_fields=_rationale_fields(cfg), require_final=labelled,
                                dataset_format=cfg.dataset_format, source=name)


def load_run(cfg: KVDistillConfig, teacher_weights: bool = True, log: Callable[[str], None] = print) -> RunInputs:
    """Load student, data and teachers as `cfg` names them (`teacher_weights=False`: teachers on
    the meta device, their outputs to come from a capture), then `prepare_run`. A run dir named as the
    student or a teacher gives its final model, else its newest complete checkpoint (`log` says which)."""
    set_seed(cfg.seed)
    if cfg.student is None:
        raise ConfigError("no student: set `student: <hub id or local dir>` (or give the model to "
                          "KVDistillTrainer(model=...))")
    student_dir = resolve_model(cfg.student, "student: loading", log)
    records = config_records(cfg)
    tokenizer = load_tokenizer(student_dir)
    student = load_model(student_dir, dtype=cfg.student_dtype)
    return prepare_run(cfg, student, tokenizer, records, cfg.active_teachers, teacher_weights, log, lora_config(cfg))


def prepare_run(cfg: KVDistillConfig, student: Any, tokenizer: Any, records: list[dict], specs: list[TeacherConfig],
                teacher_weights: bool = True, log: Callable[[str], None] = print, peft_config: Any = None
                ) -> RunInputs:
    """What every run does with its loaded student, tokenizer and records, however they came: the teachers
    (`load_teacher`: from each spec's path, or its loaded `model`), every check on the models, the latent
    token, the LoRA adapters (`peft_config`), the text each teacher reads, the transfer set and the collator."""
    specs = [s if s.model is not None else replace(s, path=resolve_model(s.path, f"teacher {s.name}: loading", log))
             for s in specs]
    for i, r in enumerate(records):
        r["index"] = i  # row id, for per-sample teacher weights
    # these read a question and its final answer: question/answer records only (docs/data.md), refused before loading
    for purpose, used in (("accuracy_eval_steps", cfg.accuracy_eval_steps > 0), ("fusion correctness",
                          cfg.fusion == "correctness"), ("lmbda > 0 (on-policy prompts)", cfg.lmbda > 0),
                          ("seq_kd", cfg.seq_kd)):
        if used:
            require_finals(records, purpose)
    if cfg.use_chat_template and not getattr(tokenizer, "chat_template", None):
        logger.warning("use_chat_template: the student's tokenizer (%s) has no chat template; prompts are formatted "
                       "with prompt_template", cfg.student)
    student = cpu_student_dtype(student, cfg)
    controls = cfg.teacher_controls  # each teacher's own control, else the run's
    # the oracle control runs no teacher: only its architecture (layer count) is read, on the meta device
    teachers = [load_teacher(s, tokenizer, untrained=controls[s.name] == "untrained", seed=cfg.seed,
                             weights=teacher_weights and cfg.teacher_control != "oracle") for s in specs]
    # before the latent slot token joins the student's tokenizer (teachers never read it)
    for name, model, tok in [(f"student {cfg.student}", student, tokenizer),
                             *((f"teacher {t.name}", t.model, t.tokenizer) for t in teachers)]:
        check_vocab(model, tok, name)
        check_length(model, cfg.max_length, name, f"max_length {cfg.max_length}",
                     f"set max_length <= {max_positions(model)}")
        if cfg.kv_loss == "attention" and cfg.kv_weight > 0:  # it reads every model's post-RoPE queries
            try:
                query_modules(model)
            except ValueError as err:
                raise ConfigError(f"{name}: {err}") from None
    if cfg.student_input.startswith("latent:") and add_latent_token(tokenizer):
        # the slot token is new to the student: one more embedding row (mean-initialised)
        student.resize_token_embeddings(len(tokenizer))
    student = peft_student(student, peft_config)  # after the resize: the adapters wrap the final embeddings
    # privileged teachers read the full rationale, permuted ones their rewritten text: never the student's tokens
    for t in teachers:
        if cfg.student_input != "full" or controls[t.name] == "permuted":
            t.shares_student_tokens = False
        if cfg.time_mode == "index" and cfg.kv_weight > 0 and t.weight > 0 and not t.shares_student_tokens:
            raise ConfigError(f"time_mode index pairs token t of the student with token t of each teacher, but teacher "
                              f"{t.name} reads other tokens (another tokenizer or text), of other lengths; use "
                              "time_mode segment (or global), or give it the student's tokenizer")
    rewrite = (TextPermutation.seeded(cfg.permute, cfg.permute_vocab, cfg.seed)
               if "permuted" in controls.values() else None)
    views = {
        t.name: TeacherView(t.tokenizer, s.rationale_field, rewrite if controls[t.name] == "permuted" else None,
                            s.template)
        for t, s in zip(teachers, specs) if not t.shares_student_tokens
    }
    for t, s in zip(teachers, specs):  # how each teacher's logits teach (resolved at any weight: captures read it)
        same_text = s.rationale_field is None and cfg.student_input == "full" and controls[t.name] != "permuted"
        t.same_text = same_text
        t.logit_kd, why = resolve_logit_kd(s.logit_kd, t.name, t.shares_student_tokens, same_text)
        t.head_hidden = head_hidden(cfg, t)
        if cfg.logit_kd_weight > 0:
            logger.info("teacher %s: logit KD %s (%s)", t.name, t.logit_kd, why)
    transfer = []
    # without a teacher signal or transfer_lm_weight a transfer record teaches nothing
    if (teachers or cfg.transfer_lm_weight > 0) and cfg.transfer_data:
        transfer = load_records(cfg.transfer_data, cfg.transfer_split, cfg.transfer_field_map or cfg.field_map,
                                cfg.transfer_max_samples, extra_fields=_rationale_fields(cfg),
                                dataset_format=cfg.dataset_format)
        for i, r in enumerate(transfer):
            r["index"] = len(records) + i  # after the labelled ids: one teacher-cache id space
    collator = DistillCollator(tokenizer, cfg.max_length, cfg.prompt_template, cfg.use_chat_template, views,
                               cfg.student_input, transfer, cfg.transfer_batch_size, cfg.seed)
    log(describe_format(records, "train_dataset" if cfg.data is None else str(cfg.data)))
    log(prompt_reads(tokenizer, {t.name: None if t.shares_student_tokens else t.tokenizer for t in teachers},
                     cfg.prompt_template, cfg.use_chat_template, example=records[0],
                     own_templates={t.name: s.template for t, s in zip(teachers, specs) if s.template}))
    return RunInputs(tokenizer, student, records, transfer, teachers, specs, collator)


def cache_key(cfg: KVDistillConfig, teacher: Teacher) -> tuple:
    """The teacher-cache key of what training reads from `teacher`: KV, hidden states for CODI,
    logits for logit KD (only from teachers that share the student's tokens)."""
    return TeacherSet.cache_key(teacher.name, *cfg.teacher_outputs(teacher.logit_kd))


def head_hidden(cfg: KVDistillConfig, teacher: Teacher) -> bool:
    """A teacher with logit KD gives its final hidden states `[B, T, d]` and head instead of its logits when the
    run's head losses are chunked (`resolve_chunk_tokens` of a full micro-batch, transfer records included, > 0),
    so no `[B, T, V]` tensor is made (a smaller batch the model does not chunk gets the logits through the head: `model.full_logits`).
    The rows a batch's KD reads are not known here: a batch the model chunks for them alone reads the teacher's
    logits at those rows. A head that is not one `[V, d]` matrix (ZeRO-3 partitions it) keeps the logits."""
    weight = getattr(teacher.model.get_output_embeddings(), "weight", None)
    if cfg.logit_kd_weight == 0 or teacher.logit_kd == "off" or weight is None or weight.dim() != 2:
        return False
    tokens = (cfg.per_device_train_batch_size + (cfg.transfer_batch_size if cfg.transfer_data else 0)) * cfg.max_length
    return resolve_chunk_tokens(cfg.logit_chunk_tokens, tokens, *weight.shape) > 0


def teacher_batches(run: RunInputs, batch_size: int, start: int = 0, stop: int | None = None):
    """The records `[start, stop)` (default: every one, labelled then transfer) in order, in batches from
    `start`, collated without transfer draws."""
    plain = replace(run.collator, transfer=())
    every = [*run.records, *run.transfer][start:stop]
    for a in range(0, len(every), batch_size):
        yield plain(every[a : a + batch_size])


def capture_settings(cfg: KVDistillConfig, run: RunInputs) -> dict[str, dict]:
    """What each teacher's capture depends on (`{teacher name: settings}`): equal settings <=> the
    stored tensors are this run's. Derived from the options' roles: the `teacher_inputs` options
    through a hash of the tokens each teacher reads (tokenised once for all teachers), the
    `teacher_outputs` ones by value, except those `capture_forms` turns into what they change."""
    hashes = {t.name: hashlib.sha256() for t in run.teachers}
    for batch in teacher_batches(run, 256):
        for t in run.teachers:
            src = teacher_view(batch, t.name)
            update_token_hash(hashes[t.name], src["input_ids"].masked_fill(src["attention_mask"] == 0, -1))
    settings = {}
    for t, spec in zip(run.teachers, run.specs):
        _, _, hidden, logits, queries = cache_key(cfg, t)
        forms = capture_forms(cfg, run, t, spec)
        settings[t.name] = {
            "tokenizer": tokenizer_hash(t.tokenizer), "tokens": hashes[t.name].hexdigest()[:16],
            # "final_hidden": the final hidden states a chunked head reads (`head_hidden`), `[T, d]` per token
            "records": len(run.records) + len(run.transfer), "hidden_states": hidden,
            "logits": "final_hidden" if logits and t.head_hidden else logits,
            **{k: getattr(cfg, k) for k in option_names(affects="teacher_outputs") if k not in forms},
            **{k: getattr(spec, k) for k in option_names(TeacherConfig, affects="teacher_outputs") if k not in forms},
        }
        for value in forms.values():
            settings[t.name].update(value)
        if queries:  # kv_loss attention: the capture holds post-RoPE queries beside K/V (absent otherwise, so
            settings[t.name]["queries"] = True  # captures made before queries existed keep their identity)
    return settings


def capture_forms(cfg: KVDistillConfig, run: RunInputs, t: Teacher, spec: TeacherConfig) -> dict[str, dict]:
    """`{option: its entries in a capture's settings}` for the `teacher_outputs` options whose value
    alone would say too much or too little (every other one enters the settings as its value)."""
    weights = weights_fingerprint(spec.path)
    if cfg.teacher_controls[spec.name] == "untrained":  # random-init copies, drawn from the seed
        weights += f":untrained:{cfg.seed}"
    positions = {}
    if cfg.capture_keep < 1:  # a share of each rationale's positions, picked by one method
        positions = {"keep": cfg.capture_keep, "method": cfg.capture_compression}
        if cfg.capture_compression == "rkv":
            positions["lambda"] = cfg.compression_lambda
        elif cfg.capture_compression == "random":
            positions["seed"] = cfg.seed
    return {
        "teachers": {},  # each teacher's own options below
        "path": {"config_hash": t.config_hash, "weights": weights},
        "teacher_control": {}, "control": {},  # in `weights` (untrained) or `tokens` (permuted)
        "name": {"teacher": t.name},
        "dtype": {"dtype": str(spec.dtype)},
        # the teacher layers this run's layer map reads, and no other
        "capture_layers": {"capture_layers": mapped_layers(_layer_map(cfg, spec, run.student, t.model))}
        if cfg.capture_layers == "mapped" else {},
        "capture_keep": {"capture_positions": positions} if positions else {},
        "capture_compression": {}, "compression_lambda": {},  # in `capture_positions`
    }


def captured_head(cfg: KVDistillConfig, spec: TeacherConfig, tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head `(weight [V, d], bias)` of a teacher read from a capture of final hidden states (`head_hidden`;
    its model has no weights). The teacher is loaded once on the CPU as `load_run` loads it (untrained control,
    tied embeddings and quantization included) and only its head is kept: one code path, rather than a head
    stored in every capture (V × d, 1 GB for a 7B teacher) or picked out of the checkpoint's files by name.
    The capture's settings hold the weights' fingerprint, so this is the head the capture was made with."""
    untrained = cfg.teacher_controls[spec.name] == "untrained"
    model = load_teacher(spec, tokenizer, untrained=untrained, seed=cfg.seed).model
    lm = model.get_output_embeddings()
    return lm.weight.to(cfg.device), None if lm.bias is None else lm.bias.to(cfg.device)


PEFT_MISSING = "use_peft / peft_config need the peft package: pip install 'kvdistill[peft]'"


def lora_config(cfg: KVDistillConfig) -> Any:
    """`use_peft`'s `peft.LoraConfig` from the `lora_*` options (TRL ModelConfig's names); None without it."""
    if not cfg.use_peft:
        return None
    try:
        from peft import LoraConfig
    except ImportError:
        raise ConfigError(PEFT_MISSING) from None
    targets = cfg.lora_target_modules
    if isinstance(targets, str) and targets != "all-linear":  # `q_proj,v_proj` from the command line
        targets = [t.strip() for t in targets.strip("[]").split(",") if t.strip()]
    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets or None, task_type="CAUSAL_LM")


def peft_student(student: torch.nn.Module, peft_config: Any) -> torch.nn.Module:
    """The student with `peft_config`'s adapters (only they train; its own weights are frozen); as it is
    without one. The KV hooks find its attention modules through the wrapper (`cache._attentions`)."""
    if peft_config is None:
        return student
    try:
        from peft import PeftModel, get_peft_model
    except ImportError:
        raise ConfigError(PEFT_MISSING) from None
    if isinstance(student, PeftModel):
        raise ConfigError("the student already has peft adapters; pass it without peft_config (its adapters train), "
                          "or pass its base model with peft_config")
    return get_peft_model(student, peft_config)


@dataclass
class TrainerInputs:
    """The arguments of `KVDistillTrainer`'s wired form (a `KVDistillModel`, a `TeacherSet`)."""

    model: KVDistillModel
    args: KVDistillConfig
    train_dataset: list[dict]
    data_collator: DistillCollator
    processing_class: Any
    teachers: TeacherSet
    layer_maps: dict[str, torch.Tensor]
    accuracy_records: list[dict] | None
    oracle_width: int


def build_trainer(cfg: KVDistillConfig) -> KVDistillTrainer:
    """Load everything the config names (`load_run`) and wire it into a `KVDistillTrainer`."""
    check_zero3(cfg)
    return KVDistillTrainer(**vars(trainer_inputs(cfg, load_run(cfg, teacher_weights=not cfg.teacher_capture))))


def teacher_spec(teacher: Any) -> TeacherConfig:
    """An entry of `KVDistillTrainer(teachers=[...])` as a `TeacherConfig`: one already, a loaded model, a path or a
    mapping (as `teachers:` in YAML)."""
    if isinstance(teacher, torch.nn.Module):
        return TeacherConfig(model=teacher)
    return KVDistillConfig._teacher(teacher)


def named_config(args: KVDistillConfig | None, model: Any, teachers: list[TeacherConfig] | None,
                 tokenizer: Any) -> KVDistillConfig:
    """A copy of `args` that names the given objects (`config.object_ref`) and is checked with them as a config
    naming paths is: the run's config (checkpoints, model card, capture identity). It holds no model object."""
    args = KVDistillConfig(student=None) if args is None else args
    if teachers is None:
        return replace(args, student=object_ref(model))
    if args.teacher_configs:
        raise ConfigError(f"teachers are given twice: in the config ({[t.name for t in args.teacher_configs]}) and "
                          "as KVDistillTrainer(teachers=...); give them in one place")

    def entry(t: TeacherConfig) -> dict:
        d = {f: getattr(t, f) for f in t.__dataclass_fields__ if f != "model"}
        if t.tokenizer is not None and not isinstance(t.tokenizer, str):  # a loaded tokenizer, named
            d["tokenizer"] = "student" if t.tokenizer is tokenizer else getattr(t.tokenizer, "name_or_path", None)
            d["tokenizer"] = None if d["tokenizer"] in ("", t.path) else d["tokenizer"]
        return d

    return replace(args, student=object_ref(model), teachers=[entry(t) for t in teachers])


def object_inputs(model: Any, args: KVDistillConfig | None, train_dataset: Any = None, processing_class: Any = None,
                  teachers: Any = None, peft_config: Any = None, eval_dataset: Any = None) -> TrainerInputs:
    """`KVDistillTrainer(model=<a student model>, ...)`, TRL's manner: the given objects through the path
    `build_trainer` takes after loading (`prepare_run`, `trainer_inputs`).

    `train_dataset` (a `datasets.Dataset` or list of dicts; default: `args.data`) becomes the records `data`
    makes; `eval_dataset` the accuracy curve's (`accuracy_eval_steps`); `teachers` a list of `TeacherConfig`
    (or loaded models, paths, mappings; default: `args.teachers`); `peft_config` (default: `args.use_peft`'s)
    wraps the student in LoRA adapters."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a loaded student model (a transformers PreTrainedModel or PeftModel), got "
                          f"{type(model).__name__}; for a path, load it with AutoModelForCausalLM.from_pretrained")
    specs = None if teachers is None else [teacher_spec(t) for t in
                                           (teachers if isinstance(teachers, (list, tuple)) else [teachers])]
    if processing_class is None:
        processing_class = load_tokenizer(object_ref(model))
    cfg = named_config(args, model, specs, processing_class)
    check_zero3(cfg)
    set_seed(cfg.seed)
    records = config_records(cfg) if train_dataset is None else dataset_records(train_dataset, cfg)
    if specs is None:  # the config's own teachers, by path
        specs = cfg.active_teachers
    elif not cfg.teacher_signal:  # as `active_teachers`: a run without a teacher signal loads none
        specs = []
    run = prepare_run(cfg, model, processing_class, records, specs, teacher_weights=not cfg.teacher_capture,
                      peft_config=peft_config if peft_config is not None else lora_config(cfg))
    accuracy = None if eval_dataset is None else dataset_records(eval_dataset, cfg, labelled=False, name="eval_dataset")
    return trainer_inputs(cfg, run, accuracy)


def trainer_inputs(cfg: KVDistillConfig, run: RunInputs, accuracy_records: list[dict] | None = None
                   ) -> TrainerInputs:
    """The run's loaded objects wired: row-selection checks, the teacher set (and its capture), one aligner
    per teacher sized from a probe batch, the fusion and the `KVDistillModel`."""
    tokenizer, student, records, teachers, specs = run.tokenizer, run.student, run.records, run.teachers, run.specs
    # a row selection field:<name> reads that field in every batch
    for name, weight in (("relation_rows", cfg.kv_weight), ("logit_kd_rows", cfg.logit_kd_weight)):
        field = None if getattr(cfg, name) == LABELLED else parse_rows(getattr(cfg, name))
        if isinstance(field, str) and weight > 0:
            every = [*records, *run.transfer]
            missing = sum(field not in dict(r.get(FIELD_KEY) or ()) for r in every)
            if missing:
                raise ConfigError(f"{name} field:{field}: {missing} of {len(every)} records have no token field "
                                  f"{field!r}; write it under {FIELD_KEY} in every record, or choose other {name}")
    collator = run.collator
    teacher_set = TeacherSet(teachers, cfg.device, offload=cfg.teacher_offload,
                             cache=cfg.teacher_cache or bool(cfg.teacher_capture))
    if cfg.teacher_capture and teachers:
        settings = capture_settings(cfg, run)
        for t, spec in zip(teachers, specs):
            captured = CaptureReader(Path(cfg.teacher_capture) / t.name, settings[t.name])
            teacher_set.cache.read_from(cache_key(cfg, t), captured)
            logger.info("teacher %s: %d records in the capture %s", t.name, len(captured), cfg.teacher_capture)
            if t.head_hidden:
                t.head = captured_head(cfg, spec, tokenizer)

    # size the aligners from one probe batch (dims are read from the caches, so any pair works); under
    # ZeRO-3 the models were loaded partitioned: each is gathered whole for its probe, one at a time
    aligners, layer_maps, codi_dims = {}, {}, {}
    width = oracle_width([*records, *run.transfer], cfg.oracle_field) if cfg.teacher_control == "oracle" else 0
    if teachers:
        probe = collator(records[:2])
        student.to(cfg.device)
        with gathered(student.parameters()):
            skv = extract_kv(student, probe["input_ids"].to(cfg.device), probe["attention_mask"].to(cfg.device),
                             probe["segment_ids"].to(cfg.device), key_space=cfg.key_space)
        for t, s in zip(teachers, specs):
            if t.weight == 0:  # logits only: outside the fusion, no aligner
                continue
            src = teacher_view(probe, t.name)
            # the outputs training reads (so a captured teacher serves the probe from its capture)
            _, key_space, hidden, logits, queries = cache_key(cfg, t)
            inputs = (src[k].to(cfg.device) for k in ("input_ids", "attention_mask", "segment_ids"))
            index = probe["index"] if cfg.teacher_capture else None
            if cfg.teacher_control == "oracle":  # the target training reads in place of the teacher
                tkv = oracle_targets(teacher_set, probe, probe.get("token_fields"), cfg, width)[t.name]
            else:
                with gathered(t.model.parameters()):
                    tkv, _ = teacher_set.forward(t.name, *inputs, key_space=key_space, output_hidden_states=hidden,
                                                 return_logits=logits, queries=queries, index=index)
            layer_maps[t.name] = _layer_map(cfg, s, student, t.model)
            aligner = make_aligner(cfg, s, layer_maps[t.name])
            aligner.setup(tkv, skv)
            if cfg.kv_loss == "relation":
                check_relation_heads(cfg, t.name, cache_dims(tkv, skv))
            aligners[t.name] = aligner
            if cfg.codi_weight > 0:
                codi_dims[t.name] = (t.model.config.hidden_size, student.config.hidden_size)
    fused = [t for t in teachers if t.weight > 0]  # the fusion's teachers, in the aligners' order
    correctness = teacher_correctness(cfg, fused, records) if cfg.fusion == "correctness" and fused else None
    fusion = TeacherFusion(cfg.fusion if fused else "loss_sum", [t.weight for t in fused] or [1.0], correctness)
    model = KVDistillModel(
        student, aligners, fusion, _kv_loss(cfg),
        LossWeights(cfg.ce_weight, cfg.codi_weight, cfg.logit_kd_weight, cfg.logit_kd_kind, cfg.logit_kd_temperature,
                    transfer_lm=cfg.transfer_lm_weight, chunk_tokens=cfg.logit_chunk_tokens, beta=cfg.beta),
        key_space=cfg.key_space, codi_dims=codi_dims, kv_segments=_kv_segments(cfg), kv_rows=cfg.relation_rows,
        logit_kd_rows=cfg.logit_kd_rows,
        logit_teachers=_logit_teachers(tokenizer, teachers), vocab_size=len(tokenizer),
    )
    if cfg.accuracy_eval_steps > 0 and accuracy_records is None:
        accuracy_records = load_records(cfg.data, cfg.accuracy_eval_split, cfg.field_map, cfg.accuracy_eval_limit,
                                        dataset_format=cfg.dataset_format)
    return TrainerInputs(
        # a plain list, not an Arrow table: records reach the collator as loaded (token_fields' nested tuples)
        model=model, args=cfg, train_dataset=records, data_collator=collator, processing_class=tokenizer,
        teachers=teacher_set, layer_maps=layer_maps, accuracy_records=accuracy_records, oracle_width=width,
    )
