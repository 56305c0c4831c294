"""`KVDistillTrainer`: `transformers.Trainer` with a distillation `compute_loss`.

The library runs the loop, gradient accumulation, mixed precision, checkpoints and multi-device;
this class adds: teacher forwards under no_grad, the KV warm-up, loss normalisation by the
*global* token counts, two optimizer param groups, extra metrics, and a checkpoint layout where
the student is a plain HF model directory.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from kvdistill.align.compress import compress_cache
from kvdistill.cache import REASONING, KVCache
from kvdistill.card import write_card
from kvdistill.config import UserError
from kvdistill.controls import oracle_cache
from kvdistill.io import nbytes, read_jsonl, write_json_atomic, write_text_atomic, writing
from kvdistill.models import num_layers
from kvdistill.onpolicy import completion_batch, on_policy_step, sampling_seed, write_completions
from kvdistill.runs import COMPLETE_FILE, METRICS, TEACHERS_FILE, TRAIN_CONFIG, complete_checkpoints
from kvdistill.teachers import TeacherSet, derangement
from kvdistill.train.config import ConfigError, KVDistillConfig, card_sections
from kvdistill.train.console import use_console_callbacks
from kvdistill.train.model import KVDistillModel, target_counts

MODULES_FILE = "kvdistill_modules.safetensors"  # aligners, fusion logits, CODI heads

logger = logging.getLogger(__name__)


class NonFiniteError(UserError, RuntimeError):
    """A loss or gradient became NaN/inf; the message names where it first appeared."""


def resolve_checkpoint(run_dir: str | Path, resume: str | bool | None) -> str | None:
    """The checkpoint to resume from: `last`/`true` -> the newest complete one (None: start fresh);
    a path -> itself, refused when it is missing or was not saved to the end."""
    if resume in (None, False, "", "false", "False", "none"):
        return None
    if resume in (True, "true", "True", "last"):
        done = complete_checkpoints(run_dir)
        if done:
            logger.info("resuming from %s, the newest complete checkpoint", done[-1])
        return str(done[-1]) if done else None
    path = Path(resume)
    if not path.is_dir():
        raise ConfigError(f"resume_from_checkpoint {path} does not exist; pass a checkpoint-N directory of this "
                          f"run, or `last` for its newest complete checkpoint")
    if not (path / COMPLETE_FILE).is_file():
        raise ConfigError(f"checkpoint {path} is incomplete (no {COMPLETE_FILE}: the run stopped while saving it); "
                          f"resume from an earlier checkpoint, or pass `last` to pick the newest complete one")
    return str(path)


def kv_warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warm-up of the KV term: (step+1)/warmup_steps, capped at 1; 1 when warmup_steps is 0."""
    return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)


class MetricsFileCallback(TrainerCallback):
    """Append every log record to `metrics.jsonl` (main process only)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def on_train_begin(self, args, state, control, **kwargs):
        # a resumed run replays the steps after its checkpoint: drop their old rows (all rows on a fresh start)
        if state.is_world_process_zero and self.path.exists():
            keep = [r for r in read_jsonl(self.path) if r.get("step", 0) <= state.global_step]
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            line = json.dumps({"step": state.global_step, **logs}) + "\n"
            with writing(self.path, len(line)), self.path.open("a") as f:  # a full disk: one line naming the file
                f.write(line)


class AccuracyCallback(TrainerCallback):
    """Greedy-decode held-out items every `every` optimizer steps and at the end; log `eval_accuracy`, and
    end training at the first point >= `accuracy_stop`.

    Runs on the main process only (the student is unwrapped; other ranks wait at the next sync).
    """

    def __init__(self, trainer: KVDistillTrainer, records: list[dict], every: int, max_new_tokens: int):
        self.trainer, self.records, self.every, self.max_new_tokens = trainer, records, every, max_new_tokens

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step % self.every and step != state.max_steps:
            return
        accelerator = self.trainer.accelerator
        if state.is_world_process_zero:
            accuracy = self.evaluate(args, control)
            if 0 < args.accuracy_stop <= accuracy:
                accelerator.set_trigger()
        # every rank stops at the same step: one that trained on alone would wait at its next all-reduce forever
        if args.accuracy_stop > 0 and accelerator.check_trigger():
            logger.info("step %d: dev accuracy >= accuracy_stop %s: training stops", step, args.accuracy_stop)
            control.should_training_stop = True  # the Trainer saves and ends as at max_steps

    def evaluate(self, args, control) -> float:
        from kvdistill.evaluate.scoring import evaluate_model

        student = self.trainer.distill_model.student
        was_training = student.training
        result = evaluate_model(
            student, self.trainer.processing_class, self.records, batch_size=100,
            max_new_tokens=self.max_new_tokens, template=args.prompt_template,
            chat_template="auto" if args.use_chat_template else "off", perplexity=False, progress=False,
        )
        student.train(was_training)
        should_log = control.should_log  # Trainer.log clears it: the step's own loss row must still be written
        self.trainer.log({"eval_accuracy": result["accuracy"]})
        control.should_log = should_log
        return result["accuracy"]


def oracle_targets(teachers: TeacherSet, inputs: dict, token_fields: dict | None, args: KVDistillConfig,
                   width: int) -> dict[str, KVCache]:
    """`teacher_control: oracle`: in place of each teacher, a cache coding the class field
    (`controls.oracle_cache`), on the student's own tokens (time alignment maps it 1:1) and with that
    teacher's layer count, so the teacher's layer map decides which student layers it reaches. The
    relation loss splits it into `relation_heads` heads; an element loss reads it through the projector,
    so one head holds the code (the projector learns its scale)."""
    classes = (token_fields or {}).get(args.oracle_field)
    if classes is None:
        raise ConfigError(f"teacher_control: oracle needs the per-token field {args.oracle_field!r} in every batch; "
                          "this one has none (set oracle_field, or use data whose records carry it)")
    heads = args.relation_heads if args.kv_loss == "relation" else 1
    return {t.name: oracle_cache(classes, inputs["attention_mask"], inputs["segment_ids"], layers=num_layers(t.model),
                                 heads=heads, width=width, temperature=args.relation_temperature,
                                 code=args.oracle_code)
            for t in teachers}


class KVDistillTrainer(Trainer):
    """`transformers.Trainer` that distils a student from the KV caches (and logits) of several teachers.

    Built from objects, as TRL's trainers are::

        from kvdistill import KVDistillConfig, KVDistillTrainer, TeacherConfig

        trainer = KVDistillTrainer(
            model=student,                       # a PreTrainedModel (or PeftModel)
            args=KVDistillConfig(output_dir="runs/x", max_steps=100, kv_weight=0.1),
            train_dataset=dataset,               # datasets.Dataset or list of {"question", "answer"} dicts
            processing_class=student_tokenizer,
            teachers=[TeacherConfig(model=teacher, tokenizer=teacher_tokenizer, weight=1.0)],
            peft_config=None,                    # or peft.LoraConfig(...): only the adapters (and aligners) train
        )
        trainer.train()

    (docs/api.md). The objects go through the path `kvdistill train` takes after loading its paths
    (`train.build.object_inputs` -> `prepare_run`, `trainer_inputs`), so a config naming the same models by
    path gives the same run. A LoRA student saves as a peft adapter directory (its base model is `model`'s).

    Args:
        model: the student: a `PreTrainedModel` or `PeftModel`, or the wired `KVDistillModel` (then `teachers` is
            a `TeacherSet`, as `build_trainer` passes them).
        args: `KVDistillConfig`; its `student` / `teachers` paths are replaced by the objects. Default:
            `KVDistillConfig()`.
        train_dataset: a `datasets.Dataset` or list of dicts with the `field_map` columns (default question /
            answer, GSM8K format: `<rationale> #### <final answer>`); extra columns are kept only when a teacher's
            `rationale_field` names them. Default: `args.data`.
        eval_dataset: records for the accuracy curve (`accuracy_eval_steps` > 0); default: `args.data`'s
            `accuracy_eval_split`.
        processing_class: the student's tokenizer (default: loaded from the model's name_or_path).
        teachers: list of `TeacherConfig` (`model=` a loaded model, `tokenizer=` its tokenizer or "student", and the
            options of a `teachers:` entry: weight, layer_map, projector, logit_kd, control, ...), loaded models,
            paths or mappings. Default: `args.teachers`.
        peft_config: a `peft.LoraConfig` (TRL's manner); default: `args.use_peft` with the `lora_*` options.
    """

    # compute_loss normalises by global token counts itself: Trainer must not divide again
    loss_is_scaled_for_ga = True

    def __init__(self, model: Any = None, args: KVDistillConfig | None = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None, *,
                 teachers: TeacherSet | list | None = None, peft_config: Any = None,
                 layer_maps: dict[str, Any] | None = None, accuracy_records: list[dict] | None = None,
                 oracle_width: int = 0, **kwargs: Any):
        from kvdistill.train.distributed import check_launch, enable_cpu_fsdp

        if not isinstance(model, KVDistillModel):  # a student model: wired as `build_trainer` wires its loaded one
            from kvdistill.train.build import object_inputs

            if data_collator is not None:
                raise ConfigError("KVDistillTrainer builds its collator from the config (prompt_template, max_length, "
                                  "each teacher's tokenizer); pass no data_collator")
            wired = object_inputs(model, args, train_dataset, processing_class, teachers, peft_config, eval_dataset)
            model, args, train_dataset, data_collator = wired.model, wired.args, wired.train_dataset, wired.data_collator
            processing_class, teachers, layer_maps = wired.processing_class, wired.teachers, wired.layer_maps
            accuracy_records, oracle_width, eval_dataset = wired.accuracy_records, wired.oracle_width, None
        elif not isinstance(teachers, TeacherSet):
            raise ConfigError("a wired KVDistillModel comes with its TeacherSet (train.build.trainer_inputs); to build "
                              "from a student model and teacher specs, pass the student model itself")
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, **kwargs)
        if enable_cpu_fsdp(self.accelerator):
            self.is_fsdp_enabled = True  # Trainer read it before the plugin was put back; it wraps the model later
        check_launch(self.accelerator)
        if (self.args.lmbda > 0 or self.args.seq_kd) and self.is_fsdp_enabled:
            raise ConfigError("lmbda > 0 / seq_kd generate every step, which under FSDP steps every rank's sharded "
                              "forward in lockstep (untested); launch with DDP or DeepSpeed ZeRO-1/2, or set lmbda: 0 "
                              "and seq_kd: false")
        self.teachers = teachers
        self._records: dict[int, dict] | None = None  # index -> record, for on-policy prompts
        self.layer_maps = layer_maps or {}
        self.oracle_width = oracle_width  # teacher_control oracle: the class code's width (controls.oracle_width)
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self.add_callback(MetricsFileCallback(Path(self.args.output_dir) / METRICS))
        use_console_callbacks(self)  # one short line per logging step; every figure in metrics.jsonl
        if accuracy_records and self.args.accuracy_eval_steps > 0:
            self.add_callback(AccuracyCallback(self, accuracy_records, self.args.accuracy_eval_steps,
                                               self.args.accuracy_eval_max_new_tokens))
        if getattr(self.accelerator.state, "deepspeed_plugin", None) is not None:
            self.teachers.prepare_deepspeed(self.accelerator)

    @property
    def distill_model(self) -> KVDistillModel:
        return self.accelerator.unwrap_model(self.model)

    # ------------------------------------------------------------------ optimisation
    def create_optimizer(self, model=None):
        """Two learning rates: the student's (`learning_rate`) and the aligners' (`aligner_learning_rate`)."""
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        # by identity, not name: under FSDP the optimizer is built on the wrapped model, whose names
        # carry `_fsdp_wrapped_module.` prefixes
        student = {id(p) for p in self.distill_model.student.parameters()}
        groups = []
        for part, lr in (("student", self.args.learning_rate), ("aligner", self.args.aligner_learning_rate)):
            for use_decay in (True, False):
                params = [
                    p for n, p in opt_model.named_parameters()
                    if p.requires_grad and ((id(p) in student) == (part == "student")) and (n in decay) == use_decay
                ]
                if params:
                    wd = self.args.weight_decay if use_decay else 0.0
                    groups.append({"params": params, "lr": lr, "weight_decay": wd, "name": part})
        cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        self.optimizer = cls(groups, **kwargs)
        return self.optimizer

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | None:
        """Global (all micro-batches, all ranks) counts `[5]`: CE tokens (labelled records), KV tokens,
        sequences, logit-KD targets (of `logit_kd_rows`, in every record), transfer-LM tokens (transfer records)."""
        if not batch_samples or "labels" not in batch_samples[0]:
            return None
        m = self.distill_model
        kd_targets = [m.kd_targets(b["input_ids"], b["labels"], b["attention_mask"], b["segment_ids"],
                                   b.get("token_fields")) for b in batch_samples]  # what the model's KD reads
        ce, kd, tr = (float(x) for x in sum(target_counts(b["labels"], b["labelled"], k)
                                            for b, k in zip(batch_samples, kd_targets)))
        kv = sum(float(m.kv_mask(b["segment_ids"], b["attention_mask"], b.get("token_fields")).sum())
                 for b in batch_samples)
        seqs = sum(float(b["input_ids"].shape[0]) for b in batch_samples)  # per-sample terms (CODI)
        counts = torch.tensor([ce, kv, seqs, kd, tr], device=device)
        if self.args.world_size > 1:
            counts = self.accelerator.gather(counts[None]).sum(0)
        return counts.clamp(min=1)

    # ------------------------------------------------------------------ the loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args: KVDistillConfig = self.args
        inputs = dict(inputs)
        teacher_inputs = inputs.pop("teacher_inputs", {})
        # where each teacher's tokens end in the text: cross-vocab logit KD pairs positions by them
        teacher_char_ends = {n: v["char_ends"] for n, v in teacher_inputs.items() if "char_ends" in v}
        token_fields = inputs.pop("token_fields", None)  # a task's per-token facts (fields.py): read by row
        # selection (relation_rows) and controls
        warm = kv_warmup_factor(self.state.global_step, args.kv_warmup_steps)
        kv_scale = args.kv_weight * warm
        use_teachers = len(self.teachers) > 0 and (kv_scale > 0 or args.codi_weight > 0 or args.logit_kd_weight > 0)
        teacher_kvs, teacher_logits = {}, {}
        if use_teachers:
            teacher_kvs, teacher_logits = self.teacher_targets(inputs, teacher_inputs, token_fields)
        counts = num_items_in_batch
        out = model(
            **inputs,
            teacher_kvs=teacher_kvs,
            teacher_logits=teacher_logits,
            kv_scale=kv_scale if use_teachers else 0.0,
            num_ce_tokens=None if counts is None else counts[0],
            num_kv_tokens=None if counts is None else counts[1],
            num_sequences=None if counts is None else counts[2],
            num_kd_tokens=None if counts is None else counts[3],
            num_transfer_tokens=None if counts is None else counts[4],
            teacher_char_ends=teacher_char_ends,
            token_fields=token_fields,
        )
        loss = out["loss"]
        if not torch.isfinite(loss):  # one sync a step; the metrics below sync anyway
            where = self.distill_model.find_nonfinite(inputs["input_ids"], inputs["attention_mask"],
                                                      inputs["segment_ids"], teacher_kvs, teacher_logits)
            loss = self._nonfinite(f"loss is {float(loss.detach())}, first non-finite in {where}", model)
        if counts is not None:
            # counts are global; DDP averages gradients over ranks, so undo that average
            loss = loss * self.accelerator.num_processes
        if model.training:
            for k, v in out["metrics"].items():
                self._metrics[k].append(float(v))
            self._metrics["kv_warmup"].append(warm)
        return (loss, out) if return_outputs else loss

    # ------------------------------------------------------------------ on-policy (GKD)
    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """Trainer's micro-batches of one optimizer step. On an on-policy step (probability `lmbda`) or with
        `seq_kd`, each is rewritten (`written_batch`) *before* the token counts are taken, so the loss is
        divided by the global count of the tokens it is computed on: the completions'."""
        samples, counts = super().get_batch_samples(epoch_iterator, num_batches, device)
        args: KVDistillConfig = self.args
        on_policy = on_policy_step(args.seed, self.state.global_step, args.lmbda)
        if args.lmbda > 0:
            self._metrics["on_policy"].append(float(on_policy))
        if not samples or not (on_policy or args.seq_kd):
            return samples, counts
        samples = [self.written_batch(b, m, on_policy) for m, b in enumerate(samples)]
        return samples, self._get_num_items_in_batch(samples, device)

    def _sampling_seed(self, micro_batch: int) -> int:
        return sampling_seed(self.args.seed, self.state.global_step, self.args.process_index, micro_batch)

    def written_batch(self, batch: dict, micro_batch: int, on_policy: bool) -> dict:
        """`batch` with every answer rewritten: sampled by the student (`on_policy`: no LM loss on its own text,
        the teacher signals only) or by the first teacher (`seq_kd`: sequence-level KD, the LM loss learns the
        teacher's text). Every reader (student, each teacher) gets the new text in its own tokens."""
        args: KVDistillConfig = self.args
        if self._records is None:
            self._records = {int(r["index"]): r for r in [*self.train_dataset, *self.data_collator.transfer]}
        records = [self._records[int(i)] for i in batch["index"]]
        if on_policy:
            model, tokenizer = self.distill_model.student, self.processing_class
        else:
            teacher = next(iter(self.teachers))
            model, tokenizer = teacher.model, teacher.tokenizer
        written = write_completions(model, tokenizer, records, template=args.prompt_template,
                                    use_chat_template=args.use_chat_template, temperature=args.temperature,
                                    top_p=args.top_p, max_new_tokens=args.max_new_tokens, max_length=args.max_length,
                                    seed=self._sampling_seed(micro_batch))
        readers = {name: view.tokenizer for name, view in self.data_collator.teachers.items()}
        labelled = batch["labelled"].cpu() & (not on_policy)
        return completion_batch(written, self.processing_class, readers, labelled, max_length=args.max_length,
                                template=args.prompt_template, use_chat_template=args.use_chat_template,
                                sampled=on_policy)

    def _step_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator seeded by (seed, step, rank): controls and random compression replay exactly."""
        g = torch.Generator(device=device)
        return g.manual_seed(self.args.seed * 1_000_003 + self.state.global_step * 7919 + self.args.process_index)

    @torch.no_grad()
    def teacher_targets(self, inputs: dict, teacher_inputs: dict, token_fields: dict | None = None
                        ) -> tuple[dict[str, KVCache], dict[str, Any]]:
        """Every teacher's detached KV (and logits for logit KD: `[B, T, V]`, or a same-vocab teacher's final
        hidden states and head when the run's head losses are chunked, `Teacher.head_hidden`) on this batch,
        controls applied (each teacher's own `control`, else the run's `teacher_control`).

        - `shuffled`: the teacher reads another sample of the batch (one derangement per step, shared
          by the shuffled teachers); the time alignment handles the lengths.
        - `teacher_control: oracle`: no teacher runs; each gets the oracle target (`oracle_targets`).
          (`permuted` is applied by the collator, on the text each teacher reads.)
        - a teacher of weight 0 gives logits only: its KV is read by no aligner, so none is returned.
        - a shortened `student_input`: each teacher's rationale is compressed onto the student's
          reasoning slots (`align.compress.compress_cache`, in that teacher's own time axis).
        """
        args: KVDistillConfig = self.args
        if args.teacher_control == "oracle":
            return oracle_targets(self.teachers, inputs, token_fields, args, self.oracle_width), {}
        device = inputs["input_ids"].device
        B = inputs["input_ids"].shape[0]
        controls = args.teacher_controls
        shuffled = derangement(B, self._step_generator()).to(device) if "shuffled" in controls.values() else None
        slots = (inputs["segment_ids"] == REASONING).sum(1)  # [B] the student's reasoning tokens
        compress = args.student_input != "full" and args.teacher_compression != "none"
        need_kv = args.kv_weight > 0 or args.codi_weight > 0
        kvs, logits = {}, {}
        for t in self.teachers:
            if t.logit_kd == "off" and not (need_kv and t.weight > 0):
                continue  # this teacher gives nothing the loss reads
            perm = shuffled if controls[t.name] == "shuffled" else None  # [B] whose text each sample's teacher reads
            index = inputs["index"] if perm is None else inputs["index"][perm]
            src = teacher_inputs.get(t.name, inputs)
            ids, mask, seg = (src[k] if perm is None else src[k][perm] for k in ("input_ids", "attention_mask",
                                                                                  "segment_ids"))
            key_space, hidden, want_logits, queries = args.teacher_outputs(t.logit_kd)
            # the logits come with the KV of one forward (whose cache and capture keys are any run's)
            kv, out_logits = self.teachers.forward(
                t.name, ids, mask, seg, key_space=key_space, output_hidden_states=hidden,
                return_logits=want_logits, queries=queries, index=index,
            )
            if out_logits is not None:
                logits[t.name] = out_logits
            if t.weight == 0:  # logits only: no aligner reads its KV
                continue
            # the student's text in other tokens: the time alignment pairs positions by characters (a capture_keep
            # capture holds a subset of the positions: those keep the proportional pairing of `align.time`)
            if perm is None and t.same_text and src is not inputs and kv.seq_len == src["char_ends"].shape[1]:
                kv = replace(kv, char_ends=src["char_ends"])
            if compress:
                kv, _ = compress_cache(kv, slots, method=args.teacher_compression, lam=args.compression_lambda,
                                       generator=self._step_generator(device))
            kvs[t.name] = kv
        return kvs, logits

    def _nonfinite(self, what: str, model: torch.nn.Module) -> Tensor:
        """`on_nonfinite: stop` -> raise naming `what`; `skip` -> warn and return a zero loss that still
        reaches every parameter (so DDP's gradient sync completes) with zero gradient."""
        message = f"step {self.state.global_step + 1}: {what}"  # the step in progress, as it will be logged
        if self.args.on_nonfinite == "stop":
            raise NonFiniteError(f"{message}; lower the learning rate, run teachers in bf16/fp32 rather than fp16, "
                                 "or set on_nonfinite: skip to skip such steps")
        logger.warning("%s; step skipped (on_nonfinite: skip)", message)
        self._metrics["nonfinite_skipped"].append(1.0)
        return sum(p.reshape(-1)[0] for p in model.parameters() if p.requires_grad) * 0.0

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not self.accelerator.sync_gradients:
            return loss
        if self.is_deepspeed_enabled:
            self._check_deepspeed_step()
            return loss
        # the accumulated (and synced) gradient the optimizer will use: one norm per part, which serves both
        # the non-finite check and the grad_norm/<part> logs
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        parts = {"student": [], "aligner": []}
        for n, g in grads.items():
            parts["student" if ".student." in f".{n}" else "aligner"].append(g)
        norms = {k: float(torch.nn.utils.get_total_norm(v)) if v else 0.0 for k, v in parts.items()}
        if not all(math.isfinite(v) for v in norms.values()):
            bad = [n for n, g in grads.items() if not torch.isfinite(g).all()]
            self._nonfinite(f"gradient of {bad[0]} is non-finite ({len(bad)} parameters)", model)
            for g in grads.values():
                g.zero_()
            norms = dict.fromkeys(norms, 0.0)  # what the optimizer gets (on_nonfinite: skip)
        if (self.state.global_step + 1) % max(int(self.args.logging_steps), 1) == 0:
            for part, norm in norms.items():
                self._metrics[f"grad_norm/{part}"].append(norm)
        return loss

    def _check_deepspeed_step(self) -> None:
        """DeepSpeed keeps gradients in its own buffers and steps inside `backward`, so per-part norms
        cannot be read (they are not logged, rather than logged as 0) and a bad step cannot be undone:
        a non-finite global norm ends the run whatever `on_nonfinite` says. fp16 is left to DeepSpeed's
        loss scaler, which skips overflowing steps itself."""
        norm = self.model_wrapped.get_global_grad_norm()
        if self.args.fp16 or norm is None or math.isfinite(float(norm)):
            return
        raise NonFiniteError(f"step {self.state.global_step + 1}: the gradient norm is {float(norm)} and DeepSpeed "
                             "has already applied the step; lower the learning rate, or run teachers in bf16/fp32 "
                             "rather than fp16")

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._metrics:
            logs = {**logs, **{k: sum(v) / len(v) for k, v in self._metrics.items() if v}}
            self._metrics.clear()
        super().log(logs, start_time)

    # ------------------------------------------------------------------ checkpoints
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        """`Trainer.train`, resuming only from complete checkpoints (`last` picks the newest one) made with
        the same teachers (checked here for every backend: DeepSpeed loads its checkpoints itself)."""
        ckpt = resolve_checkpoint(self.args.output_dir, resume_from_checkpoint)
        if ckpt is not None:
            self._check_teachers(Path(ckpt))
        return super().train(resume_from_checkpoint=ckpt, **kwargs)

    def _check_teachers(self, ckpt: Path) -> None:
        saved = json.loads((ckpt / TEACHERS_FILE).read_text()) if (ckpt / TEACHERS_FILE).exists() else []
        now = self.teachers.manifest()
        key = lambda ts: [(t["name"], t["config_hash"]) for t in ts]  # noqa: E731
        if key(saved) != key(now):
            raise ConfigError(
                f"checkpoint {ckpt} was trained with teachers {key(saved)}, this run has {key(now)}; resume with "
                "the same teachers, or start a new run (a new output_dir) without --resume_from_checkpoint"
            )

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint, then the completeness marker, then the rotation of old checkpoints, in
        that order: a kill at any point leaves the previous complete checkpoint in place."""
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # Trainer would rotate before the marker exists
        ckpt = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        # a failed save (full disk) removes the checkpoint dir and stops in one line naming it
        size = nbytes(self.distill_model.state_dict()) + nbytes(getattr(self.optimizer, "state", {}))
        with writing(ckpt, size) if self.args.should_save else nullcontext():
            if self.args.should_save:  # saving over an old checkpoint (--overwrite_output_dir): incomplete until done
                (ckpt / COMPLETE_FILE).unlink(missing_ok=True)
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self.args.save_total_limit = limit
            self.accelerator.wait_for_everyone()  # every rank's files are on disk before the marker
            if self.args.should_save:
                write_json_atomic(ckpt / COMPLETE_FILE, {"global_step": self.state.global_step})
        if self.args.should_save:
            rotate_checkpoints(str(ckpt.parent), limit, self.state.best_model_checkpoint, use_mtime=True)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Student as a plain HF model dir; aligners etc. as safetensors; config + teacher manifest."""
        if not self.args.should_save:  # FSDP / DeepSpeed call this on every rank; the main one writes
            return
        out = Path(output_dir or self.args.output_dir)
        wrapper = self.distill_model
        state_dict = wrapper.state_dict() if state_dict is None else state_dict
        with writing(out, nbytes(state_dict)):  # a failed save leaves none of the files it began
            self._write_model(out, state_dict)

    def _write_model(self, out: Path, state_dict: dict) -> None:
        out.mkdir(parents=True, exist_ok=True)
        # TRAIN_CONFIG, written last, marks a finished model (runs.resolve_model): a save over an old one
        # (--overwrite_output_dir) cut short must not leave the old marker beside half-new weights
        (out / TRAIN_CONFIG).unlink(missing_ok=True)
        wrapper = self.distill_model
        student_sd = {k[len("student.") :]: v for k, v in state_dict.items() if k.startswith("student.")}
        wrapper.student.save_pretrained(out, state_dict=student_sd)
        extra = {k: v.detach().contiguous().cpu() for k, v in state_dict.items() if not k.startswith("student.")}
        if extra:
            save_file(extra, out / MODULES_FILE)
        for name, aligner in wrapper.aligners.items():  # from the (gathered) state dict, not the live shards
            prefix = f"aligners.{name}."
            aligner.save(out / "aligners" / name,
                         state={k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)})
        if self.processing_class is not None:
            self.processing_class.save_pretrained(out)
        write_json_atomic(out / TEACHERS_FILE, self.teachers.manifest())
        write_text_atomic(out / TRAIN_CONFIG, yaml.safe_dump(self.args.to_yaml_dict(), sort_keys=False))
        torch.save(self.args, out / "training_args.bin")
        write_card(out, self.args.to_yaml_dict(), self.teachers.manifest(), card_sections(),
                   step=self.state.global_step, layer_maps=self.layer_maps)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        ckpt = Path(resume_from_checkpoint)
        wrapper = self.distill_model
        student = wrapper.student
        try:  # a file damaged after the save (truncated copy, full disk): name it, not the parser's internals
            if hasattr(student, "peft_config"):  # a LoRA student: the checkpoint holds its adapters only
                from peft import set_peft_model_state_dict
                from peft.utils import load_peft_weights

                set_peft_model_state_dict(student, load_peft_weights(str(ckpt)))
                loaded = student
            else:
                loaded = type(student).from_pretrained(ckpt, dtype=next(student.parameters()).dtype)
            extra = load_file(ckpt / MODULES_FILE) if (ckpt / MODULES_FILE).exists() else None
        except Exception as err:
            raise ConfigError(f"checkpoint {ckpt} cannot be read ({type(err).__name__}: {err}); resume from "
                              "another checkpoint, or start a new run") from err
        full = {f"student.{k}": v for k, v in loaded.state_dict().items()} | (extra or {})
        if self.is_fsdp_enabled:  # the live parameters are DTensor shards: each rank takes its part
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            missing, unexpected = set_model_state_dict(
                self.model, full, options=StateDictOptions(full_state_dict=True, strict=False))
        else:
            missing, unexpected = wrapper.load_state_dict(full, strict=False)
        missing = [k for k in missing if not k.startswith("student.")]
        if missing or unexpected:
            raise ConfigError(f"checkpoint {ckpt} does not match this run's aligners: missing {missing}, "
                              f"unexpected {unexpected}; resume with the same alignment settings")
