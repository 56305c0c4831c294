"""Head (H) alignment: flat `H*D` features, or structured per-head mixing ("anti-flatten").

Flat mode folds the heads into the feature axis, `[L, B, H, T, D] -> [L, B, T, H*D]`, and leaves
everything else to one dim projector. Structured mode keeps `[L, B, T, H, D]`: a learned head
mixing matrix `W [H_out, H_in]` (initialised so the input heads are split evenly over the output
heads, rows summing to 1) followed by a per-head `D_in -> D_out` projector, shared across heads or
one per head.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def flatten_heads(x: Tensor) -> Tensor:
    """`[L, B, H, T, D] -> [L, B, T, H*D]` (heads folded into the feature axis)."""
    L, B, H, T, D = x.shape
    return x.transpose(2, 3).reshape(L, B, T, H * D)  # [L, B, T, H*D]


def time_major(x: Tensor) -> Tensor:
    """`[L, B, H, T, D] -> [L, B, T, H, D]` (the structured layout handed to losses)."""
    return x.transpose(2, 3)


def uniform_head_mix(h_out: int, h_in: int) -> Tensor:
    """`[h_out, h_in]`: input heads split evenly over output heads; rows sum to 1.

    Output head j covers the interval `[j, j+1) * h_in / h_out` of input heads and weights each
    input head by its overlap: 4 -> 2 averages pairs (0,1) and (2,3); 2 -> 4 copies each input head
    twice; 3 -> 2 gives rows (2/3, 1/3, 0), (0, 1/3, 2/3); equal counts give the identity.
    """
    if h_out < 1 or h_in < 1:
        raise ValueError(f"head counts must be >= 1, got h_out={h_out}, h_in={h_in}")
    j = torch.arange(h_out, dtype=torch.float64).unsqueeze(1)  # [h_out, 1]
    i = torch.arange(h_in, dtype=torch.float64).unsqueeze(0)  # [1, h_in]
    start, end = j * h_in / h_out, (j + 1) * h_in / h_out
    overlap = (torch.minimum(end, i + 1) - torch.maximum(start, i)).clamp(min=0)  # [h_out, h_in]
    return (overlap / overlap.sum(1, keepdim=True)).float()


class HeadMixer(nn.Module):
    """Learned head mixing `[L, B, T, H_in, D] -> [L, B, T, H_out, D]`.

    Args:
        h_in, h_out: head counts.
        groups: 1 shares one matrix across layers; `groups = L` keeps one per layer (the input's
            axis 0 must then be L).
        trainable: False freezes the matrix at its uniform initialisation.
    """

    def __init__(self, h_in: int, h_out: int, *, groups: int = 1, trainable: bool = True):
        super().__init__()
        self.h_in, self.h_out, self.groups = h_in, h_out, groups
        init = uniform_head_mix(h_out, h_in)
        weight = init if groups == 1 else init.expand(groups, h_out, h_in).clone()
        self.weight = nn.Parameter(weight, requires_grad=trainable)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 5 or x.shape[3] != self.h_in:
            raise ValueError(f"head mixer expects [L, B, T, H={self.h_in}, D], got {tuple(x.shape)}")
        w = self.weight.to(x.dtype)
        if self.groups == 1:
            return torch.einsum("lbthd,oh->lbtod", x, w)  # [L, B, T, H_out, D]
        if x.shape[0] != self.groups:
            raise ValueError(f"per-layer head mixer has {self.groups} layers, input has {x.shape[0]}")
        return torch.einsum("lbthd,loh->lbtod", x, w)  # [L, B, T, H_out, D]

    def extra_repr(self) -> str:
        g = f", per-layer x{self.groups}" if self.groups > 1 else ""
        return f"{self.h_in} -> {self.h_out} heads{g}"


class HeadwiseProjector(nn.Module):
    """Apply a dim projector to `[L, B, T, H, D_in] -> [L, B, T, H, D_out]`, shared or not.

    The wrapped projector must have been built with `groups` = 1 (shared across layers and heads),
    L (per layer), H (per head) or L*H (per layer and head); this module moves the matching axes
    to the front so all groups run in one batched matmul.
    """

    def __init__(self, projector: nn.Module, *, share_layers: bool = True, share_heads: bool = True):
        super().__init__()
        self.projector = projector
        self.share_layers, self.share_heads = share_layers, share_heads

    def forward(self, x: Tensor) -> Tensor:
        L, B, T, H, D = x.shape
        if self.share_heads:  # shared, or grouped over axis 0 (layers)
            return self.projector(x)
        if self.share_layers:  # one projector per head
            y = self.projector(x.permute(3, 0, 1, 2, 4))  # [H, L, B, T, D_out]
            return y.permute(1, 2, 3, 0, 4)  # [L, B, T, H, D_out]
        y = self.projector(x.permute(0, 3, 1, 2, 4).reshape(L * H, B, T, D))  # [L*H, B, T, D_out]
        return y.view(L, H, B, T, -1).permute(0, 2, 3, 1, 4)  # [L, B, T, H, D_out]

    def extra_repr(self) -> str:
        return f"share_layers={self.share_layers}, share_heads={self.share_heads}"
