"""Time (T) alignment: the teacher's sequence resampled onto the student's token positions.

Teacher and student tokenise the same text differently (other tokenizer, other rationale), so
their caches have different lengths. `time_index` decides, for every student token, which two
teacher tokens it reads and with what interpolation weight; `resample` applies that to any tensor
with a batch and a time axis (KV `[L, B, H, T, D]`, hidden states `[L+1, B, T, d]`).

Modes:
    segment (default): per sample and per segment (prompt / reasoning / answer), the i-th of the
        student's `n_s` tokens of that segment maps to `u = i / (n_s - 1) * (n_t - 1)` among the
        teacher's `n_t` tokens of the same segment, and reads
        `(1 - lam) * x[floor(u)] + lam * x[floor(u) + 1]` with `lam = u - floor(u)`.
        A segment with one student token reads the centre of the teacher's segment,
        `u = (n_t - 1) / 2`. A segment empty on the teacher side makes its student tokens invalid.
        Tokens are located from the masks and segment ids, never assumed contiguous or
        left-aligned, so left padding, right padding and per-sample lengths all work.
        If neither side has segment ids this is the same as `global`.
    global: the same proportional map over all valid tokens, ignoring segments.
    index: position t reads position t (no interpolation); both lengths must be equal.

With both sides' character ends (`char_ends` of `kvdistill.data`, in the coordinates every reader of
a record shares), `segment` and `global` pair by characters instead: a student token reads the
teacher token holding its last character, so the two always overlap in the text, whatever the
tokenizers do with digits, spaces, emoji or byte pieces (several student pieces of one character read
its one teacher token). Tokens without characters (BOS, EOS) pair among themselves by the
proportional rule above, and a chat template's own text (`UNSHARED`) has no teacher token to read.
Only for a teacher that reads the student's text (same rationale, full student input, no rewrite).

Everything is batched: a few `cumsum` / `scatter` / `gather` ops over `[B, T]`, no loop over
samples, segments or layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

TimeMode = Literal["segment", "global", "index"]
TIME_MODES = ("segment", "global", "index")
NO_CHAR = -1  # `char_ends` of a token without characters: `kvdistill.data.NO_CHAR` (a sibling layer: not imported)


@dataclass
class TimeIndex:
    """Where each student (target) token reads the teacher (source) sequence.

    Attributes:
        lo: `[B, T_s]` source position of the left neighbour.
        hi: `[B, T_s]` source position of the right neighbour (== lo at segment ends).
        lam: `[B, T_s]` float interpolation weight of `hi` in [0, 1).
        valid: `[B, T_s]` bool: the target token is real and has a source to read from.
        exact: True when `lam` is zero everywhere (index mode), so `resample` skips the lerp.
    """

    lo: Tensor
    hi: Tensor
    lam: Tensor
    valid: Tensor
    exact: bool = False

    def to(self, device: torch.device | str) -> TimeIndex:
        """The same index on `device`."""
        return TimeIndex(*(f.to(device) for f in (self.lo, self.hi, self.lam, self.valid)), self.exact)


def _segments_or_global(mask: Tensor, segments: Tensor | None, use_segments: bool) -> tuple[Tensor, Tensor]:
    """Validity `[B, T]` bool and segment ids `[B, T]` long (all 0 when segments are ignored)."""
    valid = mask.bool()
    if not use_segments or segments is None:
        return valid, torch.zeros_like(mask, dtype=torch.long)
    seg = segments.long()
    return valid & (seg >= 0), seg


def _ranks(valid: Tensor, seg: Tensor, num_segments: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rank of each valid token inside its segment, and the token count of every segment.

    Returns:
        seg_c: `[B, T]` segment id clamped into [0, S) (safe for gathers; invalid tokens -> 0).
        rank: `[B, T]` 0-based rank of the token among its sample's tokens of that segment.
        count: `[B, S]` number of valid tokens per segment.
    """
    S = num_segments
    seg_or_dump = torch.where(valid, seg, torch.full_like(seg, S))  # invalid tokens -> extra class S
    onehot = F.one_hot(seg_or_dump, S + 1)[..., :S]  # [B, T, S]
    count = onehot.sum(1)  # [B, S]
    seg_c = seg_or_dump.clamp(max=S - 1)
    rank = (onehot.cumsum(1) - 1).gather(2, seg_c.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return seg_c, rank, count


def time_index(
    src_mask: Tensor,
    src_segments: Tensor | None,
    tgt_mask: Tensor,
    tgt_segments: Tensor | None,
    mode: TimeMode = "segment",
    src_ends: Tensor | None = None,
    tgt_ends: Tensor | None = None,
) -> TimeIndex:
    """Map every target (student) token to source (teacher) positions.

    Args:
        src_mask: `[B, T_t]` teacher attention mask (1 real, 0 pad).
        src_segments: `[B, T_t]` teacher segment ids (-1 pad) or None.
        tgt_mask: `[B, T_s]` student attention mask.
        tgt_segments: `[B, T_s]` student segment ids or None.
        mode: "segment" | "global" | "index" (see the module docstring).
        src_ends, tgt_ends: `[B, T_t]`, `[B, T_s]` character ends of both sides' tokens (`char_ends`):
            pair tokens by the text they cover (module docstring). Ignored in index mode.

    Returns:
        `TimeIndex` with `[B, T_s]` fields.

    Example:
        >>> idx = time_index(t_mask, t_seg, s_mask, s_seg)
        >>> teacher_at_student_t = resample(teacher_keys, idx, time_dim=3)  # [L, B, H, T_s, D]
    """
    if mode not in TIME_MODES:
        raise ValueError(f"unknown time mode {mode!r}; expected one of {TIME_MODES}")
    if src_mask.dim() != 2 or tgt_mask.dim() != 2:
        raise ValueError(
            f"masks must be [B, T]; got teacher {tuple(src_mask.shape)}, student {tuple(tgt_mask.shape)}"
        )
    (B, T_t), (B_s, T_s) = src_mask.shape, tgt_mask.shape
    if src_mask.shape[0] != tgt_mask.shape[0]:
        raise ValueError(f"teacher batch size {B} != student batch size {B_s}")
    device = tgt_mask.device
    src_mask = src_mask.to(device)

    if mode == "index":
        if T_s != T_t:
            raise ValueError(
                f"time mode 'index' needs equal lengths, got teacher T={T_t} and student T={T_s}; "
                "use time mode 'segment' or 'global' for different tokenisations"
            )
        pos = torch.arange(T_s, device=device).expand(B, T_s)
        valid = tgt_mask.bool() & src_mask.bool()
        return TimeIndex(pos, pos, torch.zeros(B, T_s, device=device), valid, exact=True)

    use_segments = mode == "segment"
    if use_segments and (src_segments is None) != (tgt_segments is None):
        side = "teacher" if src_segments is None else "student"
        raise ValueError(f"time mode 'segment' needs segment ids on both sides; the {side} cache has none")
    src_valid, src_seg = _segments_or_global(src_mask, src_segments, use_segments)
    tgt_valid, tgt_seg = _segments_or_global(tgt_mask, tgt_segments, use_segments)
    src_seg = src_seg.to(device)
    if src_ends is None or tgt_ends is None:
        return _proportional(src_valid, src_seg, tgt_valid, tgt_seg)
    src_ends, tgt_ends = src_ends.to(device), tgt_ends.to(device)
    # tokens without characters (BOS, EOS) pair among themselves, segment by segment
    idx = _proportional(src_valid & (src_ends == NO_CHAR), src_seg, tgt_valid & (tgt_ends == NO_CHAR), tgt_seg)
    # the first teacher token ending at or after a character holds it (the ends cover the text in order);
    # cummax makes the ends of specials and padding, anywhere in the row, non-decreasing for the search
    key = torch.where(src_valid & (src_ends >= 0), src_ends, NO_CHAR).cummax(1).values  # [B, T_t]
    pos = torch.searchsorted(key, tgt_ends.contiguous())  # [B, T_s]
    chars = tgt_valid & (tgt_ends >= 0) & (pos < T_t)  # a character past a truncated teacher has no token
    pos = pos.clamp(max=T_t - 1)
    return TimeIndex(torch.where(chars, pos, idx.lo), torch.where(chars, pos, idx.hi),
                     torch.where(chars, 0.0, idx.lam), chars | idx.valid)


def _proportional(src_valid: Tensor, src_seg: Tensor, tgt_valid: Tensor, tgt_seg: Tensor) -> TimeIndex:
    """The proportional map of the valid target tokens of each segment onto the source's (module docstring)."""
    (B, T_t), device = src_valid.shape, tgt_valid.device
    S = int(torch.maximum(src_seg.max(), tgt_seg.max()).clamp(min=0).item()) + 1  # segment classes

    src_seg_c, src_rank, src_count = _ranks(src_valid, src_seg, S)  # [B, T_t], [B, T_t], [B, S]
    tgt_seg_c, tgt_rank, tgt_count = _ranks(tgt_valid, tgt_seg, S)  # [B, T_s], [B, T_s], [B, S]

    # table[b, s, k] = teacher position of the k-th token of segment s; invalid tokens write to a dump slot
    dump = B * S * T_t
    b_off = torch.arange(B, device=device).unsqueeze(1) * S  # [B, 1]
    slot = torch.where(src_valid, (b_off + src_seg_c) * T_t + src_rank, torch.full_like(src_rank, dump))
    table = torch.zeros(dump + 1, dtype=torch.long, device=device)
    positions = torch.arange(T_t, device=device).expand(B, T_t)
    table.scatter_(0, slot.reshape(-1), positions.reshape(-1))
    table = table[:dump].view(B, S * T_t)  # [B, S*T_t]

    n_t = src_count.gather(1, tgt_seg_c)  # [B, T_s] teacher tokens in this student token's segment
    n_s = tgt_count.gather(1, tgt_seg_c)  # [B, T_s]
    last = (n_t - 1).clamp(min=0)
    # integer numerator, one division: exact whenever u is an integer
    u = torch.where(
        n_s > 1,
        (tgt_rank * last).float() / (n_s - 1).clamp(min=1).float(),
        last.float() / 2,  # a one-token segment reads the centre of the teacher's segment
    )
    lo_r = u.floor().long().clamp(min=0)
    lo_r = torch.minimum(lo_r, last)
    hi_r = torch.minimum(lo_r + 1, last)
    lam = (u - lo_r.float()).clamp(0, 1)

    valid = tgt_valid & (n_t > 0)
    base = tgt_seg_c * T_t
    lo = torch.where(valid, table.gather(1, base + lo_r), 0)
    hi = torch.where(valid, table.gather(1, base + hi_r), 0)
    lam = torch.where(valid & (hi != lo), lam, 0.0)
    return TimeIndex(lo, hi, lam, valid)


def resample(x: Tensor, index: TimeIndex, time_dim: int, batch_dim: int = 1) -> Tensor:
    """Read `x` at the student positions of `index`, with linear interpolation.

    Args:
        x: a tensor with a batch axis and a source time axis, e.g. `[L, B, H, T_t, D]`
            (`time_dim=3`) or hidden states `[L+1, B, T_t, d]` (`time_dim=2`).
        index: from `time_index`, fields `[B, T_s]`.
        time_dim, batch_dim: axes of `x` holding T and B.

    Returns:
        `x` with its time axis replaced by the student's `T_s`. Positions where `index.valid` is
        False hold source position 0: mask them.
    """
    time_dim, batch_dim = time_dim % x.dim(), batch_dim % x.dim()
    B, T_s = index.lo.shape
    if x.shape[batch_dim] != B:
        raise ValueError(f"resample: x has batch {x.shape[batch_dim]} on axis {batch_dim}, index has {B}")
    xm = x.movedim((batch_dim, time_dim), (0, 1))  # [B, T_t, *rest]
    b = torch.arange(B, device=x.device).unsqueeze(1)  # [B, 1]
    lo = index.lo.to(x.device)
    out = xm[b, lo]  # [B, T_s, *rest]
    if not index.exact:
        w = index.lam.to(device=x.device, dtype=x.dtype).view(B, T_s, *([1] * (xm.dim() - 2)))
        x_hi = xm[b, index.hi.to(x.device)]  # [B, T_s, *rest]
        # in place when no graph is recorded: one buffer less (teacher KV is the big tensor here)
        out = out.lerp_(x_hi, w) if not torch.is_grad_enabled() or not x.requires_grad else out.lerp(x_hi, w)
    return out.movedim((0, 1), (batch_dim, time_dim))


def kv_bags(
    shape: tuple[int, ...] | torch.Size,
    index: TimeIndex,
    layers: Tensor | None = None,
    layer_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Which rows of a KV stack each aligned row sums, and with what weights (time + layer alignment).

    Output row `[m, b, t, h]` is `Σ_j Σ_side w * x[layers[m, j], b, h, position]`: the two teacher
    positions of the lerp (one in index mode) in each teacher layer that layer-map row reads.

    Args:
        shape: `[L, B, H, T_t, D]` of the KV stack (keys and values share their bags).
        index: from `time_index`, fields `[B, T_s]`.
        layers: `[L_m]` or `[L_m, k]` teacher layers per output layer (default: all `L`, one each);
            `sparse_layer_map` turns a layer map into this form.
        layer_weights: `[L_m, k]` weights of those layers (default 1).

    Returns:
        `rows [L_m, B, T_s, H, K]` (int64 row ids into the stack viewed `[L*B*H*T_t, D]`) and
        `weights [L_m, B, T_s, H, K]` float32, `K = k * (2 or 1)`.
    """
    L, B, H, T, _ = shape
    dev = index.lo.device
    layers = torch.arange(L, device=dev) if layers is None else layers.to(dev)
    layers = layers.view(layers.shape[0], -1)  # [L_m, k]
    L_m, k = layers.shape
    lw = torch.ones(L_m, k, device=dev) if layer_weights is None else layer_weights.to(dev).view(L_m, k)
    if index.exact:  # one position per token
        pos, tw = index.lo.unsqueeze(-1), torch.ones(*index.lo.shape, 1, device=dev)  # [B, T_s, 1]
    else:
        lam = index.lam.float()
        pos, tw = torch.stack((index.lo, index.hi), -1), torch.stack((1 - lam, lam), -1)  # [B, T_s, 2]
    n = pos.shape[-1]
    row = (layers.view(L_m, 1, 1, 1, k, 1) * B + torch.arange(B, device=dev).view(1, B, 1, 1, 1, 1)) * H
    row = (row + torch.arange(H, device=dev).view(1, 1, 1, H, 1, 1)) * T + pos.view(1, B, -1, 1, 1, n)
    weight = lw.float().view(L_m, 1, 1, 1, k, 1) * tw.view(1, B, -1, 1, 1, n)  # [L_m, B, T_s, 1, k, n]
    bag = (*row.shape[:4], k * n)
    return row.reshape(bag), weight.expand(row.shape).reshape(bag)


def resample_kv(
    x: Tensor, index: TimeIndex, layers: Tensor | None = None, layer_weights: Tensor | None = None
) -> Tensor:
    """Time and layer alignment of a KV stack in one weighted gather, time-major.

    One `embedding_bag` over `kv_bags` (gather, multiply and add in a single pass) writes the
    result straight into the layout the head stage wants: no copy of the (large) teacher cache per
    layer or per lerp neighbour, and only the layers the layer map reads are touched. Equal to
    `apply_layer_map(M, resample(x, index, time_dim=3)).transpose(2, 3)` up to rounding.

    Args:
        x: `[L, B, H, T_t, D]` keys or values.
        index, layers, layer_weights: as in `kv_bags`.

    Returns:
        `[L_m, B, T_s, H, D]` in `x`'s dtype. Positions where `index.valid` is False hold source
        position 0: mask them.
    """
    rows, weights = kv_bags(x.shape, index.to(x.device), layers, layer_weights)  # [L_m, B, T_s, H, K]
    out = F.embedding_bag(
        rows.flatten(0, -2),
        x.reshape(-1, x.shape[-1]),  # [L*B*H*T_t, D], a view when x is contiguous (stacked caches are)
        per_sample_weights=weights.flatten(0, -2).to(x.dtype),
        mode="sum",
    )  # [L_m*B*T_s*H, D]
    return out.view(*rows.shape[:-1], x.shape[-1])
