"""Linear CKA between every student layer and every teacher layer, streamed; top-k layer maps.

CKA (Kornblith et al. 2019) compares two representations of the same `n` inputs, `X [n, d_x]`
and `Y [n, d_y]`, through their Gram matrices `K = X Xᵀ`, `L = Y Yᵀ` (both `[n, n]`):

    CKA(X, Y) = HSIC(K, L) / sqrt(HSIC(K, K) · HSIC(L, L))

**Why minibatch CKA on Gram matrices (Nguyen et al. 2021), not streamed cross-covariances.**
Exact streaming of the full-batch statistic needs `Σ Xᵀ Y` for every layer pair: for a 24-layer
896-dim student and a 28-layer 3584-dim teacher that is `[24, 28, 896, 3584]` = 2.2 G numbers
(17 GB in float64). Storing the features instead (100 samples × 512 tokens) is ~25 GB. So we
average HSIC over minibatches of `n_b` rows: each minibatch costs one Gram `[L, n_b, n_b]` per
model (`(24 + 28) · 1024² · 8 B` = 436 MB in float64 at `n_b = 1024`) and all `L_s × L_t` pairs
come from one matmul of the flattened Grams `[L_s, n_b²] @ [n_b², L_t]`; only `[L_s, L_t]`,
`[L_s]` and `[L_t]` sums survive a minibatch.

**Cost.** The Gram matmuls (`2 n_b² d` flops per layer) are nearly all of it: the features are
centred one layer at a time (a centred copy of a whole 28 x 3584-dim minibatch would be 411 MB
to write and read back), a Gram of centred features is already double-centred (so the plain
estimator needs no further centring), and the pair products are one matmul accumulated in float64
over cache-sized column chunks (no float64 copy of the Grams). With `debiased=True` each minibatch uses the
unbiased HSIC estimator (Song et al. 2012), so the average is an unbiased estimate of the
population HSIC whatever `n_b` is; the biased (plain) estimator carries an `O(1/n_b)` bias.

**Outliers.** Pretrained LMs carry massive activations: the first token (BOS / attention sink) and a
few residual channels hold nearly all of a hidden state's variance (SmolLM2-135M: the first token
98 % of the centred variance from layer 12 on, three channels 99 %), so linear CKA of hidden states
measures where the spike is, not what the layers compute (docs/real_pair_layer_map.md).
`drop_first_tokens` takes the first tokens out of the rows; `standardize=True` gives every channel
unit variance per minibatch (CKA of correlations: invariant to per-channel scale).

`StreamingCKA` buffers incoming rows and cuts them into minibatches of exactly `minibatch_size`
rows, so its result does not depend on how the data was chunked into `update` calls; with
`minibatch_size >= n` it equals the one-shot full-batch CKA (`cka_matrix`).

Example:
    >>> acc = StreamingCKA(debiased=True)
    >>> for hs_student, hs_teacher, mask in batches:  # [L, B, T, d] each, mask [B, T]
    ...     acc.update(pool_features(hs_student, mask), pool_features(hs_teacher, mask))
    >>> S = acc.compute()  # [L_s, L_t]
    >>> M = topk_layer_map(S, k=2, monotonic=True)  # [L_s, L_t], rows sum to 1
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from torch import Tensor

Pooling = Literal["tokens", "mean"]
POOLINGS = ("tokens", "mean")

# a monotonic top-k search holds L_t**k scores per student layer; refuse beyond this many
_MAX_MONOTONIC_STATES = 1 << 22


# --------------------------------------------------------------------------- Gram statistics


def gram(x: Tensor, *, dtype: torch.dtype = torch.float64, standardize: bool = False) -> Tensor:
    """Linear-kernel Gram matrices of column-centred (optionally standardised) features.

    Centring the features first keeps large shared offsets out of the Gram, so `dtype=float32`
    stays accurate; HSIC is translation invariant, so the result is unchanged. The mean is taken
    twice (of the features, then of what is left after subtracting it), so the columns are centred
    to the rounding of their own values, not of the offset; the Gram is then double-centred
    already (`H K H = K`: its row and column means are zero). One matrix at a time: only one
    centred `[n, d]` copy exists at once.

    Args:
        x: `[..., n, d]` features (any dtype; upcast).
        dtype: computation dtype.
        standardize: scale every centred column to unit norm (a constant one stays 0), so no
            channel outweighs another; CKA is scale-free, so unit norm is unit variance.

    Returns:
        `[..., n, n]` Gram matrices `Xc Xcᵀ`.
    """
    n, d = x.shape[-2:]
    xs = x.reshape(-1, n, d)  # [M, n, d]
    out = torch.empty(xs.shape[0], n, n, dtype=dtype, device=x.device)  # [M, n, n]
    for i in range(xs.shape[0]):
        xc = xs[i].to(dtype)  # [n, d]
        xc = xc - xc.mean(dim=0)
        xc -= xc.mean(dim=0)  # the residual: the first mean's rounding error, |offset| * eps
        if standardize:  # unit-norm columns; one that is only rounding noise of a constant stays 0
            nrm = xc.norm(dim=0)  # [d]
            xc *= torch.where(nrm > 100 * torch.finfo(dtype).eps * nrm.max(), 1 / nrm, 0.0)  # [n, d]
        torch.mm(xc, xc.T, out=out[i])
    return out.view(*x.shape[:-2], n, n)


def center_gram(k: Tensor, *, debiased: bool = False) -> Tensor:
    """Centre Gram matrices so that `HSIC(K, L) = <center(K), center(L)>_F / norm(n)`.

    Plain: double centring `H K H` with `H = I - 11ᵀ/n`. Debiased: U-centring (Székely & Rizzo
    2014), which zeroes the diagonal and removes row/column means computed without it; the
    Frobenius product of two U-centred Grams divided by `n (n - 3)` is the unbiased HSIC estimator
    of Song et al. (2012).

    Args:
        k: `[..., n, n]` symmetric Gram matrices.
        debiased: U-centring instead of double centring.

    Returns:
        `[..., n, n]` centred Grams (same dtype).
    """
    n = k.shape[-1]
    if not debiased:
        row = k.mean(dim=-1, keepdim=True)  # [..., n, 1]
        col = k.mean(dim=-2, keepdim=True)  # [..., 1, n]
        return k - row - col + k.mean(dim=(-2, -1), keepdim=True)
    if n < 4:
        raise ValueError(f"the debiased HSIC estimator needs at least 4 rows, got {n}")
    eye = torch.eye(n, dtype=torch.bool, device=k.device)
    k = k.masked_fill(eye, 0.0)  # [..., n, n] zero diagonal
    row = k.sum(dim=-1, keepdim=True) / (n - 2)  # [..., n, 1]
    col = k.sum(dim=-2, keepdim=True) / (n - 2)  # [..., 1, n]
    total = k.sum(dim=(-2, -1), keepdim=True) / ((n - 1) * (n - 2))  # [..., 1, 1]
    return (k - row - col + total).masked_fill(eye, 0.0)


def _hsic_norm(n: int, debiased: bool) -> float:
    return float(n * (n - 3)) if debiased else float((n - 1) ** 2)


# columns of the flattened Grams per float64 product chunk (a few MB: the upcast stays in cache)
_PRODUCT_CHUNK = 1 << 14


def hsic_matrix(kx: Tensor, ky: Tensor, *, debiased: bool = False) -> Tensor:
    """HSIC between every pair of centred Grams, in one matmul (float64).

    Args:
        kx: `[L_x, n, n]` Grams centred with `center_gram(..., debiased=debiased)` (or, plain
            estimator, Grams of centred features: `gram`'s output).
        ky: `[L_y, n, n]` likewise.

    Returns:
        `[L_x, L_y]` float64 HSIC estimates. Lower-precision Grams are multiplied in float64 one
        column chunk at a time, so no float64 copy of a whole stack is made.
    """
    a, b = kx.flatten(1), ky.flatten(1)  # [L_x, n²], [L_y, n²]
    if a.dtype == b.dtype == torch.float64:
        hsic = a @ b.T  # [L_x, n²] @ [n², L_y] -> [L_x, L_y]
    else:
        hsic = a.new_zeros(a.shape[0], b.shape[0], dtype=torch.float64)
        for c in range(0, a.shape[1], _PRODUCT_CHUNK):
            hsic.addmm_(a[:, c : c + _PRODUCT_CHUNK].double(), b[:, c : c + _PRODUCT_CHUNK].double().T)
    return hsic / _hsic_norm(kx.shape[-1], debiased)


def _self_hsic(kc: Tensor, debiased: bool) -> Tensor:
    """`[L]` float64 HSIC(K_l, K_l) of centred Grams `[L, n, n]` (the diagonal of `hsic_matrix`)."""
    a = kc.flatten(1)  # [L, n²]
    total = a.new_zeros(a.shape[0], dtype=torch.float64)
    for c in range(0, a.shape[1], _PRODUCT_CHUNK):
        total += a[:, c : c + _PRODUCT_CHUNK].double().pow(2).sum(1)
    return total / _hsic_norm(kc.shape[-1], debiased)


def _hsic_stats(
    x: Tensor, y: Tensor, debiased: bool, dtype: torch.dtype, standardize: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """`(HSIC(X, Y) [L_x, L_y], HSIC(X, X) [L_x], HSIC(Y, Y) [L_y])` of features `[L, n, d]`, float64.

    One Gram matmul per layer; the plain estimator uses the Grams of centred features as they are
    (already double-centred), the debiased one U-centres them.
    """
    kx = gram(x, dtype=dtype, standardize=standardize)  # [L_x, n, n]
    ky = gram(y, dtype=dtype, standardize=standardize)  # [L_y, n, n]
    if debiased:
        kx, ky = center_gram(kx, debiased=True), center_gram(ky, debiased=True)
    return hsic_matrix(kx, ky, debiased=debiased), _self_hsic(kx, debiased), _self_hsic(ky, debiased)


def _cka_from_sums(hsic_xy: Tensor, hsic_xx: Tensor, hsic_yy: Tensor) -> Tensor:
    """`[L_x, L_y]` CKA from HSIC sums; a constant (zero-variance) layer gets similarity 0."""
    denom = (hsic_xx.clamp_min(0)[:, None] * hsic_yy.clamp_min(0)[None, :]).sqrt()  # [L_x, L_y]
    return torch.where(denom > 0, hsic_xy / denom.clamp_min(torch.finfo(denom.dtype).tiny), 0.0)


def cka_matrix(
    x: Tensor, y: Tensor, *, debiased: bool = False, dtype: torch.dtype = torch.float64,
    standardize: bool = False,
) -> Tensor:
    """One-shot linear CKA between every layer of `x` and every layer of `y` on the same rows.

    Args:
        x: `[L_x, n, d_x]` features of `n` rows (tokens or samples) per layer.
        y: `[L_y, n, d_y]` features of the same rows.
        debiased: use the unbiased HSIC estimator (needs `n >= 4`).
        dtype: Gram computation dtype (HSIC sums always in float64).
        standardize: unit-variance channels first (see `gram`).

    Returns:
        `[L_x, L_y]` CKA similarities (float64).
    """
    if x.dim() != 3 or y.dim() != 3 or x.shape[1] != y.shape[1]:
        raise ValueError(
            f"expected x [L_x, n, d_x] and y [L_y, n, d_y]; got {tuple(x.shape)}, {tuple(y.shape)}"
        )
    return _cka_from_sums(*_hsic_stats(x, y, debiased, dtype, standardize))


def linear_cka(x: Tensor, y: Tensor, *, debiased: bool = False, dtype: torch.dtype = torch.float64) -> Tensor:
    """Linear CKA of one pair `x [n, d_x]`, `y [n, d_y]` (scalar float64 tensor)."""
    return cka_matrix(x[None], y[None], debiased=debiased, dtype=dtype)[0, 0]


# --------------------------------------------------------------------------- streaming


class StreamingCKA:
    """Minibatch linear CKA between all layers of two models, accumulated batch by batch.

    Rows arrive through `update` in any chunking; they are buffered and cut into minibatches of
    exactly `minibatch_size` rows (the last, shorter one is used by `compute` if it has enough
    rows). Per minibatch `b` of `n_b` rows we add `n_b · HSIC_b` to float64 sums, and

        CKA = Σ_b n_b HSIC_b(X, Y) / sqrt(Σ_b n_b HSIC_b(X, X) · Σ_b n_b HSIC_b(Y, Y)).

    Memory: the buffer (< `minibatch_size` rows in the caller's dtype, plus one update), one
    layer of one minibatch upcast to `dtype` and the minibatch's Grams `[L, n_b, n_b]` in `dtype`;
    nothing grows with the number of rows seen. 24 x 28 layers, `n_b = 1024`: 436 MB of Grams at
    float64, 218 MB at float32 (plus the debiased estimator's U-centred copy).

    Args:
        minibatch_size: rows per minibatch; `None` keeps every row and computes full-batch CKA
            (only for small data, e.g. mean-pooled samples).
        debiased: unbiased HSIC estimator per minibatch.
        dtype: Gram computation dtype (float64 default; float32 halves memory and time).
        standardize: unit-variance channels per minibatch (see `gram`).
    """

    def __init__(
        self,
        minibatch_size: int | None = 1024,
        *,
        debiased: bool = False,
        dtype: torch.dtype = torch.float64,
        standardize: bool = False,
    ):
        min_rows = 4 if debiased else 2
        if minibatch_size is not None and minibatch_size < min_rows:
            raise ValueError(
                f"minibatch_size must be >= {min_rows} (debiased={debiased}), got {minibatch_size}"
            )
        self.minibatch_size = minibatch_size
        self.debiased = debiased
        self.dtype = dtype
        self.standardize = standardize
        self.min_rows = min_rows
        self.reset()

    def reset(self) -> None:
        self._buf_x: list[Tensor] = []
        self._buf_y: list[Tensor] = []
        self._buffered = 0
        self.hsic_xy: Tensor | None = None  # [L_x, L_y] float64
        self.hsic_xx: Tensor | None = None  # [L_x]
        self.hsic_yy: Tensor | None = None  # [L_y]
        self.num_minibatches = 0
        self.num_rows = 0  # rows seen (buffered or reduced)

    def _minibatch_stats(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n = x.shape[1]
        xy, xx, yy = _hsic_stats(x, y, self.debiased, self.dtype, self.standardize)  # [L_x, L_y] [L_x] [L_y]
        return n * xy, n * xx, n * yy

    def _add(self, x: Tensor, y: Tensor) -> None:
        xy, xx, yy = self._minibatch_stats(x, y)
        if self.hsic_xy is None:
            self.hsic_xy, self.hsic_xx, self.hsic_yy = xy, xx, yy
        else:
            self.hsic_xy += xy
            self.hsic_xx += xx
            self.hsic_yy += yy
        self.num_minibatches += 1

    @torch.no_grad()
    def update(self, x: Tensor, y: Tensor) -> None:
        """Add rows. `x [L_x, n, d_x]`, `y [L_y, n, d_y]`: the same `n` rows seen by both models."""
        if x.dim() != 3 or y.dim() != 3 or x.shape[1] != y.shape[1]:
            raise ValueError(
                f"expected x [L_x, n, d_x] and y [L_y, n, d_y] with equal n; got {tuple(x.shape)}, {tuple(y.shape)}"
            )
        if self._buf_x and (
            x.shape[::2] != self._buf_x[0].shape[::2] or y.shape[::2] != self._buf_y[0].shape[::2]
        ):
            raise ValueError("layer count or feature dim changed between updates")
        if x.shape[1] == 0:
            return
        # rows are kept in the caller's dtype (bf16 features stay bf16) and upcast per minibatch
        x, y = x.detach(), y.detach()  # [L_x, n, d_x], [L_y, n, d_y]
        self._buffered += x.shape[1]
        self.num_rows += x.shape[1]
        mb = self.minibatch_size
        if mb is None or self._buffered < mb:  # the rows wait: keep a copy the caller cannot change
            self._buf_x.append(x.clone())
            self._buf_y.append(y.clone())
            return
        self._buf_x.append(x)
        self._buf_y.append(y)
        bx = torch.cat(self._buf_x, dim=1) if len(self._buf_x) > 1 else x  # [L_x, buffered, d_x]
        by = torch.cat(self._buf_y, dim=1) if len(self._buf_y) > 1 else y  # [L_y, buffered, d_y]
        full = (self._buffered // mb) * mb
        for start in range(0, full, mb):
            self._add(bx[:, start : start + mb], by[:, start : start + mb])
        rest = self._buffered - full
        self._buf_x = [bx[:, full:].clone()] if rest else []
        self._buf_y = [by[:, full:].clone()] if rest else []
        self._buffered = rest

    @torch.no_grad()
    def compute(self) -> Tensor:
        """`[L_x, L_y]` CKA (float64) over everything seen so far; does not change the state.

        A leftover buffer of at least 4 (debiased) / 2 rows counts as one more minibatch; a
        smaller one is skipped with a warning (it only happens when more than one minibatch ran).
        """
        xy, xx, yy = self.hsic_xy, self.hsic_xx, self.hsic_yy
        if self._buffered >= self.min_rows:
            bx, by = torch.cat(self._buf_x, dim=1), torch.cat(self._buf_y, dim=1)
            rxy, rxx, ryy = self._minibatch_stats(bx, by)
            xy, xx, yy = (rxy, rxx, ryy) if xy is None else (xy + rxy, xx + rxx, yy + ryy)
        elif self._buffered:
            if xy is None:
                raise ValueError(f"CKA needs at least {self.min_rows} rows, got {self._buffered}")
            warnings.warn(
                f"StreamingCKA: skipping the last {self._buffered} row(s), fewer than {self.min_rows}",
                stacklevel=2,
            )
        if xy is None:
            raise ValueError("StreamingCKA.compute() called before any update()")
        return _cka_from_sums(xy, xx, yy)


# --------------------------------------------------------------------------- features


def pool_features(h: Tensor, mask: Tensor, pooling: Pooling = "tokens") -> Tensor:
    """Per-layer features `[L, n, d]` from a batch `[L, B, T, d]`, padding masked out.

    Args:
        h: `[L, B, T, d]` hidden states (or flattened K / V `[L, B, T, H·D]`).
        mask: `[B, T]` 1 real token / 0 padding.
        pooling: "tokens" keeps every valid token as a row (`n = mask.sum()`); "mean" averages
            each sample's valid tokens (`n = B`, float32 accumulation).

    Returns:
        `[L, n, d]` features.
    """
    if h.dim() != 4 or tuple(mask.shape) != tuple(h.shape[1:3]):
        raise ValueError(
            f"expected h [L, B, T, d] and mask [B, T]; got {tuple(h.shape)}, {tuple(mask.shape)}"
        )
    m = mask.to(device=h.device).bool()
    if pooling == "tokens":
        return h[:, m]  # [L, n_valid, d]
    if pooling == "mean":
        w = m.to(torch.float32)  # [B, T]
        total = torch.einsum("lbtd,bt->lbd", h.to(torch.float32), w)  # [L, B, d]
        return total / w.sum(dim=1).clamp_min(1.0)[None, :, None]
    raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")


def drop_first_tokens(mask: Tensor, n: int) -> Tensor:
    """`mask [B, T]` without each sample's first `n` valid tokens (bool; any padding side).

    The first token of a real LM is an attention sink with massive activations (and a BOS on one
    side is paired with a word on the other): as a CKA row it can outweigh all the others.
    """
    m = mask.bool()
    return m & (m.cumsum(dim=1) > n)  # [B, T]


# --------------------------------------------------------------------------- top-k maps


def normalize_weights(scores: Tensor, temperature: float | None = None) -> Tensor:
    """Weights `β` over the last axis from similarities.

    `temperature=None` (or 0): plain normalisation `max(s, 0) / Σ max(s, 0)` (uniform if all
    are <= 0); otherwise `softmax(s / temperature)`.
    """
    scores = scores.to(torch.float64)
    if temperature:
        if temperature < 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        return torch.softmax(scores / temperature, dim=-1)
    pos = scores.clamp_min(0.0)
    total = pos.sum(dim=-1, keepdim=True)
    uniform = torch.full_like(pos, 1.0 / pos.shape[-1])
    return torch.where(total > 0, pos / total.clamp_min(torch.finfo(pos.dtype).tiny), uniform)


def _monotonic_choice(similarity: Tensor, k: int) -> Tensor:
    """`[L_s, k]` sorted teacher layers maximising the total similarity, monotone in depth.

    Constraint: with each row's chosen layers sorted, `chosen[l + 1][i] >= chosen[l][i]` for every
    rank `i` (for k = 1: a non-decreasing path). Solved exactly by dynamic programming over the
    `L_t**k` grid of index tuples: the best predecessor of a tuple `b` is the max over the box
    `a <= b`, i.e. a cumulative max along each of the `k` grid axes.
    """
    S = similarity.to(torch.float64)
    L_s, L_t = S.shape
    if L_t**k > _MAX_MONOTONIC_STATES:
        raise ValueError(
            f"monotonic top-{k} over {L_t} teacher layers needs {L_t**k} states; use a smaller k"
        )
    grid = torch.zeros((L_s,) + (L_t,) * k, dtype=torch.float64)  # [L_s, L_t, ..., L_t]
    for axis in range(k):  # score of tuple (i_0..i_{k-1}) = Σ S[l, i_a]
        shape = [L_s] + [1] * k
        shape[axis + 1] = L_t
        grid = grid + S.view(shape)
    idx = torch.arange(L_t)
    valid = torch.ones((L_t,) * k, dtype=torch.bool)
    for a in range(k - 1):  # strictly increasing tuples only
        lo = idx.view([L_t if i == a else 1 for i in range(k)])
        hi = idx.view([L_t if i == a + 1 else 1 for i in range(k)])
        valid = valid & (lo < hi)
    grid = grid.masked_fill(~valid, float("-inf"))

    best = torch.empty_like(grid)  # [L_s, L_t^k] best total ending in each tuple at row l
    best[0] = grid[0]
    for row in range(1, L_s):
        prev = best[row - 1]
        for axis in range(k):
            prev = prev.cummax(dim=axis).values  # max over the dominated box a <= b
        best[row] = grid[row] + prev

    choice = torch.empty(L_s, k, dtype=torch.long)
    flat = int(best[-1].flatten().argmax())
    choice[-1] = torch.stack(torch.unravel_index(torch.tensor(flat), (L_t,) * k))
    for row in range(L_s - 2, -1, -1):  # backtrack inside the box the next row allows
        box = best[row][tuple(slice(0, int(b) + 1) for b in choice[row + 1])]
        pos = int(box.flatten().argmax())
        choice[row] = torch.stack(torch.unravel_index(torch.tensor(pos), box.shape))
    return choice


def topk_layer_map(
    similarity: Tensor,
    k: int = 2,
    *,
    temperature: float | None = None,
    monotonic: bool = False,
) -> Tensor:
    """The mapping matrix `M [L_s, L_t]` from a similarity matrix `S [L_s, L_t]`.

    Each student layer keeps its `k` most similar teacher layers with weights
    `β = normalize_weights(S[l, chosen], temperature)`; the other entries are 0, rows sum to 1.
    With `monotonic=True` the choice maximises the total similarity subject to depth order:
    a deeper student layer never takes a shallower teacher layer than the one above it (rank by
    rank in sorted order); when plain top-k is already monotone it is returned unchanged.

    Args:
        similarity: `[L_s, L_t]` CKA similarities.
        k: teacher layers per student layer, `1 <= k <= L_t`.
        temperature: softmax temperature for `β`; None = plain normalisation.
        monotonic: enforce the depth-order constraint.

    Returns:
        `[L_s, L_t]` float32 mapping matrix.

    Example:
        >>> topk_layer_map(torch.eye(3), k=1)  # identity map
    """
    if similarity.dim() != 2:
        raise ValueError(f"similarity must be [L_s, L_t], got {tuple(similarity.shape)}")
    L_s, L_t = similarity.shape
    if not 1 <= k <= L_t:
        raise ValueError(f"top-k needs 1 <= k <= L_t = {L_t}, got k={k}")
    S = similarity.detach().cpu().to(torch.float64)
    S = torch.nan_to_num(S, nan=-1.0)
    if monotonic:
        chosen = _monotonic_choice(S, k)  # [L_s, k]
    else:
        chosen = S.topk(k, dim=1).indices  # [L_s, k]
    beta = normalize_weights(S.gather(1, chosen), temperature)  # [L_s, k]
    M = torch.zeros(L_s, L_t, dtype=torch.float64)
    M.scatter_(1, chosen, beta)
    return M.float()
