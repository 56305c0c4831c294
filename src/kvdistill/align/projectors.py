"""Hidden-dim projectors `d_in -> d_out`: `linear` and `elastic` (Elastic Bottleneck).

One projector maps the last axis of a tensor `[..., d_in] -> [..., d_out]`. The aligner keeps a
separate projector for keys and for values, shared across layers (and heads) by default.

Unshared projectors (one per layer, or per head) are *grouped*: `groups=G` stores `G` independent
weight sets stacked on a leading axis, and the input must then be `[G, ..., d_in]` (the caller
moves the grouped axis to the front). All groups run in one batched matmul, never a Python loop.

Reference sizes (seed 001, 5120 -> 1536, K + V projectors):
    linear (one)      5120*1536 + 1536                                    =  7.87 M  (K+V: 15.73 M)
    elastic (r = 1)   2 x (2*5120 + 5120*5120 + 5120 + 5120*1536 + 1536)  = 68.19 M
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PROJECTOR_KINDS = ("linear", "elastic")
INIT_KINDS = ("xavier", "orthogonal", "identity", "identity-scale")  # "identity" == "identity-scale"


def identity_scale_(weight: Tensor) -> Tensor:
    """Fill `weight [d_out, d_in]` (or `[G, d_out, d_in]`) with a scaled truncated identity, in place.

    `W = eye(d_out, d_in) * sqrt(max(1, d_in / d_out))`: the exact identity when `d_in == d_out`;
    when shrinking, it keeps the first `d_out` coordinates, scaled so an isotropic input keeps its
    expected norm; when growing, it copies the input and pads with zeros (norm kept exactly).
    """
    d_out, d_in = weight.shape[-2], weight.shape[-1]
    scale = math.sqrt(max(1.0, d_in / d_out))
    eye = torch.eye(d_out, d_in, dtype=weight.dtype, device=weight.device) * scale
    with torch.no_grad():
        weight.copy_(eye.expand_as(weight))
    return weight


def _identity_skip(x: Tensor, d_out: int) -> Tensor:
    """Parameter-free `x @ identity_scale(d_out, d_in).T` without materialising the matrix."""
    d_in = x.shape[-1]
    if d_out == d_in:
        return x
    if d_out < d_in:
        return x[..., :d_out] * math.sqrt(d_in / d_out)
    return F.pad(x, (0, d_out - d_in))


def _init_weight_(weight: Tensor, init: str) -> None:
    """Initialise a `[d_out, d_in]` or grouped `[G, d_out, d_in]` weight."""
    if init == "xavier":
        for w in weight.view(-1, *weight.shape[-2:]):  # per group: fan in/out of one matrix
            nn.init.xavier_uniform_(w)
    elif init == "orthogonal":
        for w in weight.view(-1, *weight.shape[-2:]):
            nn.init.orthogonal_(w)
    elif init in ("identity", "identity-scale"):
        identity_scale_(weight)
    else:
        raise ValueError(f"unknown init {init!r}; expected one of {INIT_KINDS}")


class GroupedLinear(nn.Module):
    """`Linear(d_in -> d_out)`, or `G` independent ones applied to `[G, ..., d_in]` at once.

    With `groups == 1` the parameters are named and shaped like `nn.Linear` (`weight [d_out, d_in]`,
    `bias [d_out]`); with `groups > 1` they are `weight [G, d_out, d_in]`, `bias [G, d_out]`.
    """

    def __init__(self, d_in: int, d_out: int, *, groups: int = 1, bias: bool = True, init: str = "xavier"):
        super().__init__()
        if groups < 1:
            raise ValueError(f"groups must be >= 1, got {groups}")
        self.d_in, self.d_out, self.groups = d_in, d_out, groups
        lead = () if groups == 1 else (groups,)
        self.weight = nn.Parameter(torch.empty(*lead, d_out, d_in))
        self.bias = nn.Parameter(torch.zeros(*lead, d_out)) if bias else None
        _init_weight_(self.weight.data, init)

    def forward(self, x: Tensor, bags: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """`[..., d_in] -> [..., d_out]`; with `bags` (`bag_linear`, which checks the shapes), `x` is
        the row table and the input the bags' weighted gathers. Bags run through this module call too:
        DeepSpeed ZeRO-3 gathers a module's weights in the hooks of its call, for forward and backward."""
        if bags is not None:
            rows, weights = bags  # [G, N, H, K]
            G, N, H, K = rows.shape
            if H == 1 and self.groups == 1 and x.shape[0] < G * N:
                # fewer table rows than gathered rows (a teacher with fewer layers x tokens than the student's):
                # project them first, W(sum_j w_j x_j) + b = sum_j w_j (W x_j) + b, then gather the narrower result
                p = F.linear(x.to(self.weight.dtype), self.weight)  # [V, d_out]
                y = F.embedding_bag(rows.reshape(-1, K), p, per_sample_weights=weights.reshape(-1, K).to(p.dtype),
                                    mode="sum").view(G, N, self.d_out)
                return y if self.bias is None else y + self.bias
            return _BagLinear.apply(x, rows, weights, self.weight, self.bias)
        if x.shape[-1] != self.d_in:
            raise ValueError(f"projector expects last dim {self.d_in}, got input {tuple(x.shape)}")
        if self.groups == 1:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] != self.groups:
            raise ValueError(
                f"grouped projector expects [G={self.groups}, ..., {self.d_in}], got {tuple(x.shape)}"
            )
        flat = x.reshape(self.groups, -1, self.d_in)  # [G, N, d_in]
        out = torch.bmm(flat, self.weight.transpose(1, 2))  # [G, N, d_out]
        if self.bias is not None:
            out = out + self.bias[:, None, :]
        return out.reshape(*x.shape[:-1], self.d_out)

    def extra_repr(self) -> str:
        g = f", groups={self.groups}" if self.groups > 1 else ""
        return f"{self.d_in} -> {self.d_out}{g}, bias={self.bias is not None}"


# rows of the gathered input per chunk of `bag_linear` on CPU: 2**19 fp32 numbers (2 MiB) stay in
# cache between the gather and the matmul; a whole [L, B, T, H*D] teacher copy does not
_BAG_CHUNK_NUMEL = 1 << 19


class _BagLinear(torch.autograd.Function):
    """`y[l] = embedding_bag(rows[l], table, weights[l]) @ W[l]ᵀ + b[l]`, chunk by chunk.

    The gathered input is never stored: the forward gathers a chunk, projects it and drops it;
    the backward gathers it again for the weight gradient. No gradient reaches `table`. It is applied
    inside `GroupedLinear`'s call (`bag_linear`), whose hooks are where DeepSpeed ZeRO-3 gathers `weight`
    before the forward and again before this backward, which reads it.
    """

    @staticmethod
    def forward(ctx, table: Tensor, rows: Tensor, weights: Tensor, weight: Tensor, bias: Tensor | None):
        G, N, H, _ = rows.shape  # [G, N, H, K]: G groups (layers), N tokens, H bags of K rows per token
        F_in, F_out = H * table.shape[1], weight.shape[-2]
        W = weight.expand(G, F_out, F_in) if weight.dim() == 2 else weight  # [G, F_out, F_in]
        out = torch.empty(G, N, F_out, dtype=weight.dtype, device=weight.device)
        for g, lo, hi in _bag_chunks(table, G, N, F_in):
            x = _gather(table, rows[g, lo:hi], weights[g, lo:hi]).to(weight.dtype)  # [n, F_in]
            if bias is None:
                torch.mm(x, W[g].t(), out=out[g, lo:hi])
            else:
                b = bias if bias.dim() == 1 else bias[g]
                torch.addmm(b, x, W[g].t(), out=out[g, lo:hi])
        ctx.save_for_backward(table, rows, weights, weight)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        table, rows, weights, weight = ctx.saved_tensors
        G, N, H, _ = rows.shape
        grad_w = grad_b = None
        if ctx.needs_input_grad[3]:
            grad_w = torch.zeros_like(weight)
            gw = grad_w.expand(G, *weight.shape[-2:]) if weight.dim() == 2 else grad_w  # a view per group
            for g, lo, hi in _bag_chunks(table, G, N, H * table.shape[1]):
                x = _gather(table, rows[g, lo:hi], weights[g, lo:hi]).to(weight.dtype)  # [n, F_in]
                gw[g].addmm_(grad_out[g, lo:hi].t(), x)  # [F_out, F_in]
        if ctx.has_bias and ctx.needs_input_grad[4]:
            grad_b = grad_out.sum(1) if weight.dim() == 3 else grad_out.sum((0, 1))  # [G, F_out] or [F_out]
        return None, None, None, grad_w, grad_b


def _gather(table: Tensor, rows: Tensor, weights: Tensor) -> Tensor:
    """`[n, H, K]` bags of rows of `table [V, D]` -> `[n, H*D]` weighted sums."""
    n, H, K = rows.shape
    x = F.embedding_bag(
        rows.reshape(-1, K), table, per_sample_weights=weights.reshape(-1, K).to(table.dtype), mode="sum"
    )
    return x.view(n, H * table.shape[1])


def _bag_chunks(table: Tensor, G: int, N: int, F_in: int):
    """`(group, first token, end token)` of each chunk; on CUDA one chunk per group (no cache to fit)."""
    step = N if table.is_cuda else max(1, _BAG_CHUNK_NUMEL // F_in)
    for g in range(G):
        for lo in range(0, N, step):
            yield g, lo, min(N, lo + step)


def bag_linear(table: Tensor, rows: Tensor, weights: Tensor, linear: GroupedLinear) -> Tensor:
    """`linear` applied to weighted gathers of `table` rows, without storing the gathered input.

    The time + layer alignment of a teacher cache (`kv_bags`) followed by a linear projector: the
    aligned teacher `[L, B, T, H*D]` is the largest tensor of the step, so it is built and
    projected one cache-sized chunk at a time (in `table`'s dtype, cast per chunk), and gathered
    again for the weight gradient. Same result as `linear(embedding_bag(...).view(...))`. With one
    weight set, bags of one row each (`H == 1`) and fewer table rows than gathered rows, the table is
    projected first and the projection gathered (the same sums, on fewer matmul rows).

    Args:
        table: `[V, D]` source rows (a KV stack viewed `[L*B*H*T, D]`, or time-major `[L*B*T, H*D]` with
            `H == 1` bags); receives no gradient.
        rows, weights: `[G, N, H, K]` bags: token `n` of group `g` concatenates `H` weighted sums
            of `K` rows each (its features `H*D` = `linear.d_in`).
        linear: the projector; with `groups > 1`, `G == groups` and group `g` uses weight set `g`.

    Returns:
        `[G, N, linear.d_out]`.
    """
    G, N, H, K = rows.shape
    if H * table.shape[1] != linear.d_in:
        raise ValueError(f"projector expects {linear.d_in} features, the bags give {H} x {table.shape[1]}")
    if linear.groups > 1 and linear.groups != G:
        raise ValueError(f"grouped projector has {linear.groups} groups, the bags have {G}")
    if linear.groups == 1:  # one weight set: chunks may span groups (small inputs run as one chunk)
        rows, weights = rows.reshape(1, G * N, H, K), weights.reshape(1, G * N, H, K)
    out = linear(table.detach(), bags=(rows, weights))  # [G or 1, ..., d_out]
    return out.view(G, N, -1)


class GroupedLayerNorm(nn.Module):
    """`LayerNorm(d)` with one affine `(weight, bias)` per group when `groups > 1`."""

    def __init__(self, d: int, *, groups: int = 1, eps: float = 1e-5):
        super().__init__()
        self.d, self.groups, self.eps = d, groups, eps
        lead = () if groups == 1 else (groups,)
        self.weight = nn.Parameter(torch.ones(*lead, d))
        self.bias = nn.Parameter(torch.zeros(*lead, d))

    def forward(self, x: Tensor) -> Tensor:
        if self.groups == 1:
            return F.layer_norm(x, (self.d,), self.weight, self.bias, self.eps)
        y = F.layer_norm(x, (self.d,), None, None, self.eps)
        shape = (self.groups,) + (1,) * (x.dim() - 2) + (self.d,)  # broadcast over [G, ..., d]
        return y * self.weight.view(shape) + self.bias.view(shape)

    def extra_repr(self) -> str:
        g = f", groups={self.groups}" if self.groups > 1 else ""
        return f"{self.d}{g}"


class LinearProjector(nn.Module):
    """One `Linear(d_in -> d_out)` (per group). `init="identity"`: scaled truncated identity, zero bias.

    Example:
        >>> proj = LinearProjector(256, 128)
        >>> proj(torch.randn(4, 10, 256)).shape
        torch.Size([4, 10, 128])
    """

    kind = "linear"

    def __init__(self, d_in: int, d_out: int, *, init: str = "xavier", groups: int = 1):
        super().__init__()
        self.d_in, self.d_out, self.init = d_in, d_out, init
        self.proj = GroupedLinear(d_in, d_out, groups=groups, init=init)

    def forward(self, x: Tensor) -> Tensor:  # [..., d_in] -> [..., d_out]
        return self.proj(x)


class ElasticBottleneck(nn.Module):
    """Elastic Bottleneck: `LayerNorm(d_in) -> Linear(d_in, h) -> SiLU -> Dropout -> Linear(h, d_out)`.

    `h = round(d_in * mlp_ratio)`. `layernorm=False` / `activation=False` drop the LayerNorm / SiLU
    (the "no LayerNorm" / "no SiLU" ablations).

    What `init="identity"` means here: LayerNorm and SiLU cannot both start as identities, so the
    block gets a parameter-free skip path and a zero-initialised output layer:
    `y = skip(x) + fc2(drop(silu(fc1(ln(x)))))` with `fc2 = 0` at init and `skip` the scaled
    truncated identity of `identity_scale_` (the exact identity when `d_in == d_out`). At
    initialisation the block is therefore exactly `skip(x)` (so `x` itself when dims match), in
    train and eval mode; `fc1` is Xavier-initialised so the MLP branch learns from step one (`fc2`
    receives gradient immediately). The skip is on by default only for identity init
    (`residual=None`); the prototype's architecture (xavier / orthogonal) has none. The skip adds
    no parameters, so the reference sizes hold for every init.
    """

    kind = "elastic"

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        mlp_ratio: float = 1.0,
        dropout: float = 0.1,
        init: str = "xavier",
        layernorm: bool = True,
        activation: bool = True,
        residual: bool | None = None,
        groups: int = 1,
    ):
        super().__init__()
        if mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be > 0, got {mlp_ratio}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        identity = init in ("identity", "identity-scale")
        self.d_in, self.d_out, self.init = d_in, d_out, init
        self.d_hidden = max(1, round(d_in * mlp_ratio))
        self.residual = identity if residual is None else residual
        self.norm = GroupedLayerNorm(d_in, groups=groups) if layernorm else nn.Identity()
        self.fc1 = GroupedLinear(d_in, self.d_hidden, groups=groups, init="xavier" if identity else init)
        self.act = nn.SiLU() if activation else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.fc2 = GroupedLinear(self.d_hidden, d_out, groups=groups, init=init)
        if identity and self.residual:
            nn.init.zeros_(self.fc2.weight)  # block == skip at init

    def forward(self, x: Tensor) -> Tensor:  # [..., d_in] -> [..., d_out]
        y = self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))
        return _identity_skip(x, self.d_out) + y if self.residual else y

    def extra_repr(self) -> str:
        return f"{self.d_in} -> {self.d_hidden} -> {self.d_out}, residual={self.residual}"


def build_projector(
    kind: str,
    d_in: int,
    d_out: int,
    *,
    mlp_ratio: float = 1.0,
    dropout: float = 0.1,
    init: str = "xavier",
    trainable: bool = True,
    layernorm: bool = True,
    activation: bool = True,
    residual: bool | None = None,
    groups: int = 1,
) -> nn.Module:
    """Build a `d_in -> d_out` projector by name.

    Args:
        kind: "linear" or "elastic".
        d_in, d_out: input / output size of the last axis.
        mlp_ratio, dropout, layernorm, activation, residual: Elastic Bottleneck options (ignored by linear).
        init: "xavier" | "orthogonal" | "identity" (alias "identity-scale").
        trainable: False freezes every parameter.
        groups: number of independent weight sets; `> 1` expects input `[groups, ..., d_in]`.

    Returns:
        an `nn.Module` mapping `[..., d_in] -> [..., d_out]`.

    Example:
        >>> k_proj = build_projector("elastic", 5120, 1536, mlp_ratio=1.0)
        >>> param_count(k_proj)
        34095616
    """
    if init not in INIT_KINDS:
        raise ValueError(f"unknown init {init!r}; expected one of {INIT_KINDS}")
    if kind == "linear":
        module: nn.Module = LinearProjector(d_in, d_out, init=init, groups=groups)
    elif kind == "elastic":
        module = ElasticBottleneck(
            d_in,
            d_out,
            mlp_ratio=mlp_ratio,
            dropout=dropout,
            init=init,
            layernorm=layernorm,
            activation=activation,
            residual=residual,
            groups=groups,
        )
    else:
        raise ValueError(f"unknown projector kind {kind!r}; expected one of {PROJECTOR_KINDS}")
    if not trainable:
        module.requires_grad_(False)
    return module
