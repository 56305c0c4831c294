"""`KVDistillModel`: the student plus everything trained with it (aligners, fusion, CODI heads).

Wrapping them in one module is what makes distributed training right: DDP/FSDP see one model,
so the aligners' gradients are synchronised together with the student's, and the student is
called through the wrapper (its gradient-sync hooks fire). Teachers are *not* submodules: they
never enter the optimizer, the gradient sync or the checkpoint's trainable state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvdistill.align.aligner import KVAligner
from kvdistill.cache import PAD, KeySpace, KVCache, forward_with_kv
from kvdistill.fusion import TeacherFusion, fuse_kv
from kvdistill.losses import (
    LABELLED,
    aligned_kv_loss,
    answer_position,
    chunked_head_loss,
    codi_sum,
    cross_vocab_kd_sum,
    kd_targets,
    logit_kd_sum,
    resolve_chunk_tokens,
    shared_boundaries,
    token_ce_sum,
)
from kvdistill.losses.attention import aligned_attention_loss
from kvdistill.losses.chunked import KDTeacher, TeacherHead
from kvdistill.losses.relation import RowKLLoss, select_rows


@dataclass
class LossWeights:
    """Weights of the terms of the total loss (the KV weight's warm-up is applied per step)."""

    ce: float = 1.0
    codi: float = 0.0
    logit_kd: float = 0.0
    logit_kd_kind: str = "forward_kl"
    temperature: float = 1.0
    transfer_lm: float = 0.0  # LM loss on transfer records (sequence-level KD)
    chunk_tokens: int | None = 0  # CE + logit KD from hidden states in chunks (`resolve_chunk_tokens`); 0: off
    beta: float = 0.5  # generalized JSD beta of logit_kd_kind jsd


@dataclass
class LogitTeacher:
    """How one teacher's logits teach the student (`teachers.resolve_logit_kd`): `same_vocab`, or
    `cross_vocab` with the shared vocabulary `[K]` ids (`teachers.vocab_map`) and its tokenizer's real size."""

    mode: str
    student_ids: Tensor | None = None
    teacher_ids: Tensor | None = None
    vocab: int | None = None


class KVDistillModel(nn.Module):
    """Student + per-teacher aligners + fusion (+ CODI projectors), computing the whole loss.

    `forward` returns `{"loss": Tensor, "metrics": dict}`; the loss is normalised by the *global*
    token counts it is given, so gradient accumulation and data parallelism do not change it.
    """

    def __init__(
        self,
        student: nn.Module,
        aligners: dict[str, KVAligner],
        fusion: TeacherFusion,
        kv_loss: nn.Module,
        weights: LossWeights,
        *,
        key_space: KeySpace = "post_rope",
        codi_dims: dict[str, tuple[int, int]] | None = None,
        kv_segments: tuple[int, ...] = (0, 1, 2),
        logit_teachers: dict[str, LogitTeacher] | None = None,
        vocab_size: int | None = None,
        kv_rows: str = "all",
        logit_kd_rows: str = LABELLED,
    ):
        super().__init__()
        self.student = student
        self.teacher_names = list(aligners)  # the fused teachers, in the fusion's order
        self.aligners = _by_module_key(aligners)
        self.fusion = fusion
        self.kv_loss = kv_loss
        self.weights = weights
        self.key_space = key_space
        self.kv_segments = kv_segments
        self.logit_teachers = logit_teachers or {}  # teachers absent here give same-vocab logits
        self.vocab_size = vocab_size  # the student tokenizer's real size: logits past it are padding rows
        self.kv_rows = kv_rows  # relation_rows: the query rows of relation / attention, the tokens of element losses
        self.logit_kd_rows = logit_kd_rows  # the positions whose distributions logit KD compares (`losses.kd_targets`)
        self.queries = getattr(kv_loss, "name", None) == "attention"  # the attention loss reads queries
        # CODI: teacher hidden (d_t) -> student hidden (d_s) at the answer marker
        self.codi = _by_module_key({n: nn.Linear(dt, ds) for n, (dt, ds) in (codi_dims or {}).items()})

    @property
    def config(self):  # Trainer and accelerate read model.config
        return self.student.config

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs) -> None:
        self.student.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs, **kwargs)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None, **kwargs) -> None:
        # transformers >= 5 calls this (with every_n_layers, offload) instead of gradient_checkpointing_enable
        self.student.activation_checkpointing_enable(
            activation_checkpointing_kwargs=activation_checkpointing_kwargs, **kwargs
        )

    def kv_mask(self, segment_ids: Tensor, attention_mask: Tensor, token_fields: dict | None = None,
                rows: bool = True) -> Tensor:
        """`[B, T]` 1 where the KV loss applies: real tokens in the chosen segments and (`rows`) among the
        query rows `relation_rows` selects (read from the batch's `token_fields` for `field:<name>`)."""
        seg = torch.isin(segment_ids, torch.tensor(self.kv_segments, device=segment_ids.device))
        mask = (seg & (attention_mask > 0) & (segment_ids != PAD)).float()
        sel = select_rows(self.kv_rows, segment_ids, token_fields) if rows else None
        return mask if sel is None else mask * sel

    def kd_targets(self, input_ids: Tensor, labels: Tensor, attention_mask: Tensor, segment_ids: Tensor,
                   token_fields: dict | None = None) -> Tensor:
        """`[B, T]` the targets logit KD reads, as labels (`losses.kd_targets` of `logit_kd_rows`): the model's
        KD sums and the trainer's global count read the same. Without logit KD, `labels` (no field is read)."""
        if self.weights.logit_kd == 0:
            return labels
        return kd_targets(self.logit_kd_rows, input_ids, labels, attention_mask, segment_ids, token_fields)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        labels: Tensor,
        segment_ids: Tensor,
        index: Tensor,
        teacher_kvs: dict[str, KVCache],
        teacher_logits: dict[str, Tensor | TeacherHead] | None = None,
        kv_scale: float = 0.0,
        labelled: Tensor | None = None,
        num_ce_tokens: Tensor | float | None = None,
        num_kv_tokens: Tensor | float | None = None,
        num_sequences: Tensor | float | None = None,
        num_kd_tokens: Tensor | float | None = None,
        num_transfer_tokens: Tensor | float | None = None,
        char_ends: Tensor | None = None,
        teacher_char_ends: dict[str, Tensor] | None = None,
        token_fields: dict[str, Tensor] | None = None,
    ) -> dict:
        w = self.weights
        need_kv = kv_scale > 0 and len(self.aligners) > 0
        teacher_logits = (teacher_logits or {}) if w.logit_kd > 0 else {}  # the teachers whose logits teach
        # transfer records (labelled False) have targets for logit KD but no LM loss
        ce_labels = labels if labelled is None else labels.masked_fill(~labelled[:, None], -100)  # [B, T]
        kd_labels = self.kd_targets(input_ids, labels, attention_mask, segment_ids, token_fields)  # [B, T]
        n_ce_local, n_kd_local, n_tr_local = target_counts(labels, labelled, kd_labels)
        # > 0: no [B, T, V] logits; the losses read the final hidden states at the rows they read
        chunk = self._chunk_tokens(labels, int(n_kd_local) if teacher_logits else None)
        head_out = {"logits_to_keep": 1, "output_hidden_states": True} if chunk else {"output_hidden_states": w.codi > 0}
        if need_kv:
            out, skv = forward_with_kv(
                self.student, input_ids, attention_mask, segment_ids,
                key_space=self.key_space, queries=self.queries, **head_out,
            )
            skv.char_ends = char_ends  # teachers that read this text in other tokens pair with it by characters
            hidden = skv.hidden_states
        else:  # no KV term, no cache: this path also works under activation checkpointing (which drops it)
            out = self.student(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **head_out)
            hidden = torch.stack(out.hidden_states) if w.codi > 0 else None  # [L+1, B, T, d]
        n_ce = num_ce_tokens if num_ce_tokens is not None else n_ce_local.clamp(min=1)
        tr_labels = labels if labelled is None else labels.masked_fill(labelled[:, None], -100)  # transfer targets
        n_tr = num_transfer_tokens if num_transfer_tokens is not None else n_tr_local.clamp(min=1)
        n_kd_local = n_kd_local.clamp(min=1)
        n_kd = num_kd_tokens if num_kd_tokens is not None else n_kd_local
        sample_w = self.fusion.sample_weights(index)  # [B, N]
        names = self.teacher_names
        pairs = self._cross_pairs(kd_labels, char_ends, teacher_char_ends or {}, teacher_logits)
        if chunk:  # CE, transfer LM and logit KD in one pass over chunks of the head
            lab = torch.ones_like(index, dtype=torch.bool) if labelled is None else labelled  # [B]
            ce_w = torch.where(lab, w.ce / n_ce, w.transfer_lm / n_tr)[:, None]  # [B, 1] per record
            lm_labels = labels if w.transfer_lm > 0 else ce_labels
            final = out.hidden_states[-1]  # [B, T, d] after the last norm: what the head reads
            loss, ce_sum, kd = self._chunked_head(final, lm_labels, kd_labels, ce_w, teacher_logits, pairs, sample_w,
                                                  names, n_kd, chunk)
        elif w.ce > 0:
            ce_sum = token_ce_sum(out.logits, ce_labels)
            loss = w.ce * ce_sum / n_ce
        else:  # CE only logged: no fp32 [B, T, V] log-probs kept for a backward that would scale them by 0
            with torch.no_grad():
                ce_sum = token_ce_sum(out.logits, ce_labels)
            loss = out.logits.sum() * 0.0  # [] zero in the graph: a step with no other term yet still backpropagates
        if not chunk and w.transfer_lm > 0:
            loss = loss + w.transfer_lm * token_ce_sum(out.logits, tr_labels) / n_tr
        # chunked with transfer_lm > 0: the logged CE also holds the transfer records' tokens
        metrics: dict[str, Tensor | float] = {"ce": (ce_sum / n_ce_local.clamp(min=1)).detach()}
        if need_kv:
            base = self.kv_mask(segment_ids, attention_mask, rows=False)  # [B, T_s] keys (and candidate rows)
            rows = select_rows(self.kv_rows, segment_ids, token_fields)  # [B, T_s] rows read, or None: all
            n_local = (base if rows is None else base * rows).sum().clamp(min=1)
            n_kv = num_kv_tokens if num_kv_tokens is not None else n_local
            kv_sum = self._kv_losses(names, teacher_kvs, skv, base, sample_w, metrics, rows)
            loss = loss + kv_scale * kv_sum / n_kv
            metrics["kv_loss"] = (kv_sum / n_local).detach()
        if w.codi > 0:
            codi = self._codi(names, teacher_kvs, hidden, segment_ids, sample_w)  # sum over samples
            loss = loss + w.codi * codi / (num_sequences if num_sequences is not None else input_ids.shape[0])
            metrics["codi"] = (codi / input_ids.shape[0]).detach()
        if teacher_logits:
            if not chunk:  # chunked: the KD is in the loss already
                kd = sum(
                    logit_kd_sum(out.logits, full_logits(t), kd_labels, w.logit_kd_kind, w.temperature,
                                 logit_weights(n, sample_w, names), beta=w.beta, vocab_size=self.vocab_size)
                    for n, t in teacher_logits.items() if n not in pairs
                ) + self._cross_vocab_kd(out.logits, pairs, teacher_logits, sample_w, names)
                loss = loss + w.logit_kd * kd / n_kd
            metrics["logit_kd"] = (kd / n_kd_local).detach()
            for n, (_, _, shared) in pairs.items():
                metrics[f"logit_kd_shared/{n}"] = shared
        for i, n in enumerate(names):
            metrics[f"fusion_w/{n}"] = sample_w[:, i].mean().detach()
        return {"loss": loss, "metrics": metrics}

    @torch.no_grad()
    def find_nonfinite(self, input_ids: Tensor, attention_mask: Tensor, segment_ids: Tensor,
                       teacher_kvs: dict[str, KVCache], teacher_logits: dict[str, Tensor] | None = None) -> str:
        """Where a non-finite loss first appears, walking the loss path in order: each teacher's cache
        and logits, the student's logits and cache, each aligned teacher, each teacher's KV loss.
        Recomputes the step under no_grad, so it is only called once the loss is already NaN/inf."""
        for n, kv in teacher_kvs.items():
            for part in ("keys", "values"):
                if (layer := _first_nonfinite(getattr(kv, part))) is not None:  # [L_t, B, H, T, D]
                    return f"teacher {n}: its cache's {part} at layer {layer}"
        for n, logits in (teacher_logits or {}).items():
            if not torch.isfinite(logits if torch.is_tensor(logits) else logits[0]).all():  # logits or hidden
                return f"teacher {n}: its logits"
        out, skv = forward_with_kv(self.student, input_ids, attention_mask, segment_ids, key_space=self.key_space,
                                   queries=self.queries)
        if not torch.isfinite(out.logits).all():
            return "the student: its logits"
        for part in ("keys", "values"):
            if (layer := _first_nonfinite(getattr(skv, part))) is not None:
                return f"the student: its cache's {part} at layer {layer}"
        for n in teacher_kvs:
            if n not in self.teacher_names:
                continue
            a = self._align(n, teacher_kvs[n], skv)
            for part in ("teacher_keys", "teacher_values", "teacher_queries"):
                x = getattr(a, part, None)  # [L_m, B, T_s, F]; AlignedKV has no queries, AlignedQK no values
                if x is not None and (layer := _first_nonfinite(x)) is not None:
                    return f"teacher {n}: the aligner's output ({part}) at student layer {layer}"
            loss, m = self._pair_loss(a, None)
            if not torch.isfinite(loss):
                per_layer = next((m[k] for k in ("cos_sim_per_layer", "relation_kl_per_layer",
                                                 "attention_kl_per_layer") if k in m), None)
                layer = None if per_layer is None else _first_nonfinite(per_layer)
                return f"teacher {n}: its KV loss" + ("" if layer is None else f" at student layer {layer}")
        return "the CE / logit-KD / CODI terms (every cache and KV loss is finite)"

    def _align(self, name: str, tkv: KVCache, skv: KVCache):
        """One teacher aligned to the student: K/V (`AlignedKV`), or queries and keys (`AlignedQK`, attention)."""
        aligner = self.aligners[module_key(name)]
        return aligner.attention_inputs(tkv, skv) if self.queries else aligner(tkv, skv)

    def _pair_loss(self, aligned, rows: Tensor | None) -> tuple[Tensor, dict]:
        """The KV loss of one aligned pair: the attention-map loss, or the mean of K and V losses. `rows [B, T]`
        (None: all) are the query rows of the relation and attention losses, the tokens of an element loss."""
        if self.queries:
            return aligned_attention_loss(self.kv_loss, aligned, rows)
        if rows is None:
            return aligned_kv_loss(self.kv_loss, aligned)
        if isinstance(self.kv_loss, RowKLLoss):  # relation: rows are the query rows, every valid token a key
            return aligned_kv_loss(partial(self.kv_loss, rows=rows), aligned)
        # an element loss (mse, cosine, mercator, ...) compares token by token: the rows are the tokens it reads
        return aligned_kv_loss(self.kv_loss, replace(aligned, mask=aligned.mask * rows))

    def _kv_losses(self, names, teacher_kvs, skv, base, sample_w, metrics, rows=None) -> Tensor:
        """Sum over teachers of the (K + V)/2 loss sums, each teacher's mask scaled by its weights."""
        aligned = [self._align(n, teacher_kvs[n], skv) for n in names]
        masks = torch.stack([a.mask.float() * base for a in aligned])  # [N, B, T]
        if self.fusion.kind == "kv_mean":
            tk, m = fuse_kv(torch.stack([a.teacher_keys for a in aligned]), masks, sample_w)
            tv, _ = fuse_kv(torch.stack([a.teacher_values for a in aligned]), masks, sample_w)
            fused = replace(aligned[0], teacher_keys=tk, teacher_values=tv, mask=m)
            loss, m_fused = self._pair_loss(fused, rows)
            self._log_teacher(metrics, "fused", m_fused)
            return loss
        total = base.new_zeros(())
        for i, (n, a) in enumerate(zip(names, aligned)):
            # the fusion weight is folded into the mask: losses stay plain masked sums
            loss, m = self._pair_loss(replace(a, mask=masks[i] * sample_w[:, i : i + 1]), rows)
            total = total + loss
            self._log_teacher(metrics, n, m)
        return total

    def _chunk_tokens(self, labels: Tensor, kd_rows: int | None) -> int:
        """Tokens per chunk of the head's losses (`resolve_chunk_tokens` of the option and the `kd_rows` logit KD
        reads, None: no logit KD), 0: the model's logits. A head whose weight is not one `[V, d]` matrix (FSDP
        flattens its shards) keeps the model's logits."""
        weight = getattr(self.student.get_output_embeddings(), "weight", None)
        if self.weights.chunk_tokens == 0 or weight is None or weight.dim() != 2:
            return 0
        return resolve_chunk_tokens(self.weights.chunk_tokens, labels.numel(), *weight.shape, rows=kd_rows)

    def _cross_pairs(self, kd_labels: Tensor, char_ends: Tensor | None, teacher_char_ends: dict[str, Tensor],
                     teacher_logits: dict) -> dict[str, tuple[Tensor, Tensor, float]]:
        """Per cross-vocab teacher `(teacher_pos [B, T_s], at [B, T_s] bool, shared)`: the teacher position each
        student position reads, the positions it is distilled at (a target in `kd_labels` and both tokenizations
        ending a token at the same character) and their share of the KD targets."""
        has_target = F.pad(kd_labels[:, 1:] != -100, (0, 1), value=False)  # [B, T]
        pairs = {}
        for n in teacher_logits:
            lt = self.logit_teachers.get(n)
            if lt is None or lt.mode != "cross_vocab":
                continue
            if char_ends is None:
                raise ValueError("cross-vocab logit KD needs the batch's char_ends (kvdistill.data.tokenize_example)")
            t_pos, shared = shared_boundaries(char_ends, teacher_char_ends.get(n, char_ends))  # [B, T_s]
            at = shared & has_target
            pairs[n] = (t_pos, at, float(at.sum()) / max(float(has_target.sum()), 1.0))
        return pairs

    def _chunked_head(self, final, lm_labels, kd_labels, ce_w, teacher_logits, pairs, sample_w, names, n_kd, chunk
                      ) -> tuple[Tensor, Tensor, Tensor]:
        """`chunked_head_loss` at the positions a loss reads (position t predicts the target at t + 1), the others
        never through the head: `(loss, CE sum, KD sum)`. CE on `lm_labels`' targets, weighted per record by
        `ce_w [B, 1]`; KD on every target of `kd_labels` (a cross-vocab teacher's at its shared boundaries,
        `pairs`), from each teacher's logits `[B, T, V]` or its final hidden states and head (`TeacherHead`: its
        logits too are made a chunk at a time), its rows read in place through an index: no `[B, T, V]` copy."""
        w = self.weights
        B, T = lm_labels.shape
        shift = lambda x: F.pad(x[:, 1:], (0, 1), value=-100).flatten()  # noqa: E731  [B·T] the target each predicts
        targets, kd_at = shift(lm_labels), shift(kd_labels) != -100  # [B·T]
        teachers, kd_w = [], []
        for n, t in teacher_logits.items():
            at = kd_at if n not in pairs else pairs[n][1].flatten()  # [B·T]
            kd_w.append(at * logit_weights(n, sample_w, names).repeat_interleave(T))  # [B·T]
            if n not in pairs:
                teachers.append(KDTeacher(_flat_head(t)))
                continue
            lt, t_pos = self.logit_teachers[n], pairs[n][0]  # [B, T] the teacher's position, in its own time
            t_len = (t if torch.is_tensor(t) else t[0]).shape[1]
            rows = (t_pos + torch.arange(B, device=t_pos.device)[:, None] * t_len).flatten()  # [B·T] its flat rows
            dev = t_pos.device
            teachers.append(KDTeacher(_flat_head(t), rows, lt.student_ids.to(dev), lt.teacher_ids.to(dev), lt.vocab))
        kd_w = torch.stack(kd_w) if kd_w else None  # [K, B·T]
        read = targets != -100 if kd_w is None else (targets != -100) | (kd_w > 0).any(0)  # [B·T]
        idx = read.nonzero()[:, 0]  # [M] the rows a loss reads
        for t in teachers:
            t.rows = idx if t.rows is None else t.rows[idx]
        head = self.student.get_output_embeddings()
        return chunked_head_loss(
            final.flatten(0, 1)[idx], head.weight, head.bias, targets[idx], teachers,
            None if kd_w is None else kd_w[:, idx], ce_weights=ce_w.expand(B, T).flatten()[idx],
            kd_scale=w.logit_kd / n_kd, kind=w.logit_kd_kind, beta=w.beta, temperature=w.temperature,
            vocab_size=self.vocab_size, chunk_tokens=chunk,
        )

    def _cross_vocab_kd(self, student, pairs, teacher_logits, sample_w, names) -> Tensor | int:
        """Sum over cross-vocab teachers of `cross_vocab_kd_sum` on the student's logits `[B, T, V]` at the
        positions `pairs` (`_cross_pairs`) distils."""
        w, total = self.weights, 0
        for n, (t_pos, at, _) in pairs.items():
            lt = self.logit_teachers[n]
            b, i = at.nonzero(as_tuple=True)  # [M]
            t_logits = full_logits(teacher_logits[n])
            dev = t_logits.device
            total = total + cross_vocab_kd_sum(
                student[b, i], t_logits[b, t_pos[b, i]], lt.student_ids.to(dev), lt.teacher_ids.to(dev),
                logit_weights(n, sample_w, names)[b], w.logit_kd_kind, w.temperature, beta=w.beta,
                student_vocab=self.vocab_size, teacher_vocab=lt.vocab,
            )
        return total

    @staticmethod
    def _log_teacher(metrics: dict, name: str, m: dict) -> None:
        """Agreement per teacher: cos-sim and norm ratio (projected losses) or relation KL (relation loss)."""
        for key in ("cos_sim", "k_cos_sim", "v_cos_sim", "norm_ratio", "relation_kl", "k_relation_kl",
                    "v_relation_kl", "relation_kl_selected", "relation_kl_other", "attention_kl",
                    "attention_kl_selected", "attention_kl_other"):
            if key in m:
                metrics[f"{key}/{name}"] = _item(m[key])
        for per_layer, prefix in (("cos_sim_per_layer", "cos_layer"), ("relation_kl_per_layer", "relation_layer"),
                                  ("attention_kl_per_layer", "attention_layer")):
            for layer, c in enumerate(m[per_layer].tolist() if per_layer in m else []):
                metrics[f"{prefix}/{name}/{layer}"] = c

    def _codi(self, names, teacher_kvs, hidden, segment_ids, sample_w) -> Tensor:
        """CODI (`losses.codi_sum`) summed over teachers, each fusion-weighted per sample."""
        pos_s, has_s = answer_position(segment_ids)
        b = torch.arange(pos_s.shape[0], device=pos_s.device)
        h_s = hidden[-1][b, pos_s]  # [B, d_s]
        total = h_s.new_zeros((), dtype=torch.float32)
        for i, n in enumerate(names):
            tkv = teacher_kvs[n]
            pos_t, has_t = answer_position(tkv.segment_ids)
            h_t = self.codi[module_key(n)](tkv.hidden_states[-1][b, pos_t].float())  # [B, d_s]
            total = total + codi_sum(h_s, h_t, (has_s & has_t).float() * sample_w[:, i])
        return total


def module_key(name: str) -> str:
    """A teacher's key among the model's submodules (`aligners`, `codi`): its name with each '.' as '_'. torch
    reads a '.' in a module name as a path (the state dict's separator) and refuses it, and a teacher is named
    after its directory by default (`Qwen2.5-0.5B`); the teacher keeps its name everywhere else."""
    return name.replace(".", "_")


def _by_module_key(modules: dict[str, nn.Module]) -> nn.ModuleDict:
    """`modules` (by teacher name) as a `ModuleDict` keyed by `module_key`."""
    keys = [module_key(n) for n in modules]
    if len(set(keys)) < len(keys):
        raise ValueError(f"teacher names {list(modules)} give the same module keys {keys} ('.' is read as '_'); "
                         "give one of them another `name:`")
    return nn.ModuleDict(dict(zip(keys, modules.values())))


def target_counts(labels: Tensor, labelled: Tensor | None, kd_labels: Tensor | None = None) -> Tensor:
    """`[3]` next-token targets of a batch: CE (labelled records), logit KD (the targets of `kd_labels`,
    `KVDistillModel.kd_targets`, in every record; None: `labels`') and the transfer LM term (transfer
    records). The model's local counts and the trainer's global ones."""
    targets = labels[:, 1:] != -100  # [B, T-1]
    n = targets.sum()
    kd = n if kd_labels is None else (kd_labels[:, 1:] != -100).sum()
    if labelled is None:  # no record marked: each one counts for every term
        return torch.stack([n, kd, n])
    ce = (targets & labelled[:, None]).sum()
    return torch.stack([ce, kd, n - ce])


def logit_weights(name: str, sample_w: Tensor, names: list[str]) -> Tensor:
    """`[B]` how much teacher `name`'s logit KD counts per sample: its fusion weight (`sample_w [B, N]` over the
    fused teachers `names`), or 1 for a teacher outside the fusion (weight 0: logits only), whose logit KD
    counts as in a run with it alone."""
    return sample_w[:, names.index(name)] if name in names else sample_w.new_ones(sample_w.shape[0])


def full_logits(t: Tensor | TeacherHead) -> Tensor:
    """A same-vocab teacher's logits `[B, T, V]`: as given, or its final hidden states through its head (a run
    whose head losses are chunked, at a batch too small to chunk, or a student head FSDP flattened)."""
    return t if torch.is_tensor(t) else F.linear(*t)


def _flat_head(t: Tensor | TeacherHead) -> TeacherHead:
    """A teacher as `chunked_head_loss` takes it: logits `[B, T, V]` -> `([B·T, V], None, None)`;
    `(hidden [B, T, d], weight, bias)` -> `(hidden [B·T, d], weight, bias)`."""
    return (t.flatten(0, 1), None, None) if torch.is_tensor(t) else (t[0].flatten(0, 1), *t[1:])


def _item(x) -> float:
    return float(x.detach().float().mean()) if torch.is_tensor(x) else float(x)


def _first_nonfinite(x: Tensor) -> int | None:
    """Index along dim 0 (the layer axis) of the first slice holding a NaN/inf, or None."""
    bad = ~torch.isfinite(x.reshape(x.shape[0], -1)).all(1)  # [L]
    return int(bad.nonzero()[0]) if bad.any() else None
