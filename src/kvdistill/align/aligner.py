"""`KVAligner`: one teacher's KV cache aligned to the student's, time -> layer -> head -> dim.

```
teacher KVCache [L_t, B, H_t, T_t, D_t]
  -> time   resample onto the student's tokens           [L_t, B, T_s, H_t, D_t]
  -> layer  M [L_s, L_t], one einsum (mapped rows only)  [L_m, B, T_s, H_t, D_t]
  -> head   flat: [L_m, B, T_s, H_t*D_t]   structured: mix H_t -> H_s, [L_m, B, T_s, H_s, D_t]
  -> dim    K and V projectors             flat: [L_m, B, T_s, H_s*D_s]   structured: [L_m, B, T_s, H_s, D_s]
```
`L_m` = student layers with a non-zero row in the layer map (all of them unless `last_k`).
Time and layer alignment are linear maps on different axes, so they commute: one weighted gather
(`resample_kv`) reads, for every student token and mapped layer, the two teacher positions of the
lerp in each teacher layer of the layer-map row (one for proportional / last_k, the top-k of a
CKA map), and writes straight into the time-major layout (flattening heads is then a view). No
layer of the teacher cache is copied or resampled unless the map reads it.
With `direction="student_to_teacher"` the head and dim stages run on the student instead, mapping
it into the teacher's space (DistillKit's choice); time and layer alignment still bring the teacher
to the student's tokens and layers.

The parameters depend on the models' shapes, so they are created lazily: `setup(teacher, student)`
(or the first `forward`) reads layers, heads and head dims from the caches. Create the optimizer
after that. `save` / `load` store the weights (safetensors) with the constructor arguments and dims
(JSON), so a saved aligner rebuilds without a probe batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from kvdistill.align.heads import HeadMixer, HeadwiseProjector, time_major
from kvdistill.align.layer_map import mapped_rows, proportional_map, sparse_layer_map, validate_layer_map
from kvdistill.align.projectors import PROJECTOR_KINDS, LinearProjector, bag_linear, build_projector
from kvdistill.align.time import TIME_MODES, TimeIndex, kv_bags, resample_kv, time_index
from kvdistill.cache import KVCache
from kvdistill.io import write_json_atomic
from kvdistill.report import param_count

ALIGNER_FORMAT = "kvdistill.aligner/v1"
MODES = ("flat", "structured")
# "none": time + layer alignment only, each side keeps its own heads and dims (relation losses)
ALIGNER_PROJECTORS = (*PROJECTOR_KINDS, "none")
DIRECTIONS = ("teacher_to_student", "student_to_teacher")
WEIGHTS_NAME, CONFIG_NAME = "aligner.safetensors", "aligner.json"


@dataclass
class AlignedKV:
    """Student and aligned teacher KV, ready for a loss (both sides have the same shape).

    Attributes:
        student_keys, student_values, teacher_keys, teacher_values: flat `[L_m, B, T_s, F]` or (each side
            in its own width F when the aligner has projector "none")
            structured `[L_m, B, T_s, H, D]`, in the student's space (or the teacher's, for
            `direction="student_to_teacher"`). Student tensors carry the autograd graph; teacher
            tensors only carry the projectors' graph (teacher_to_student) or none.
        mask: `[B, T_s]` bool: a real student token whose segment exists on the teacher side.
        segment_ids: `[B, T_s]` the student's segment ids (None if the student cache has none).
        student_layers: `[L_m]` which student layers the first axis holds.
    """

    student_keys: Tensor
    student_values: Tensor
    teacher_keys: Tensor
    teacher_values: Tensor
    mask: Tensor
    segment_ids: Tensor | None
    student_layers: Tensor


@dataclass
class AlignedQK:
    """Queries and keys of both sides at the student's positions, for the attention-map loss.

    Attributes:
        student_queries, student_keys: `[L_m, B, T_s, H_q, D_s]`, `[L_m, B, T_s, H_kv, D_s]` (with graph).
        teacher_queries, teacher_keys: `[L_u, B, T_s, H_qt, D_t]`, `[L_u, B, T_s, H_kvt, D_t]` time-aligned
            (detached), for the `L_u` teacher layers the layer map reads, not mixed: the loss mixes maps.
        layer_mix: `[L_m, L_u]` the layer map's rows over those layers.
        mask, segment_ids, student_layers: as in `AlignedKV`.
    """

    student_queries: Tensor
    student_keys: Tensor
    teacher_queries: Tensor
    teacher_keys: Tensor
    layer_mix: Tensor
    mask: Tensor
    segment_ids: Tensor | None
    student_layers: Tensor


def cache_dims(teacher: KVCache, student: KVCache) -> dict[str, int]:
    """The shape facts an aligner is built from."""
    return {
        "teacher_layers": teacher.num_layers,
        "student_layers": student.num_layers,
        "teacher_heads": teacher.num_heads,
        "student_heads": student.num_heads,
        "teacher_key_dim": teacher.keys.shape[-1],
        "teacher_value_dim": teacher.values.shape[-1],
        "student_key_dim": student.keys.shape[-1],
        "student_value_dim": student.values.shape[-1],
    }


class KVAligner(nn.Module):
    """Align one teacher's KV cache to the student's (time -> layer -> head -> dim).

    Args:
        mode: "flat" (`[L, B, T, H*D]`, one projector over H*D) or "structured"
            (`[L, B, T, H, D]`, head mixing + per-head projector).
        time_mode: "segment" | "global" | "index" (see `kvdistill.align.time`).
        layer_map: `M [L_s, L_t]`; None -> proportional, built from the first batch's layer counts.
        projector: "linear" | "elastic" | "none" (time + layer alignment only: both sides keep their
            own head counts and dims, flattened to `[L_m, B, T_s, H*D]` in flat mode; for the relation loss).
        mlp_ratio, dropout, init, layernorm, activation: projector options (`build_projector`).
        share_layers: one projector (and head mixer) for all layers; False -> one per student layer.
        share_heads: structured mode: one `D_t -> D_s` projector for all heads; False -> per head.
        direction: "teacher_to_student" (project the teacher) or "student_to_teacher".
        project_values: False leaves values without a dim projector (their dims must then match).
        trainable: False freezes projectors and head mixers.

    Example:
        >>> aligner = KVAligner(mode="flat", projector="linear")
        >>> aligner.setup(teacher_kv, student_kv)  # builds the parameters; create the optimizer after
        >>> out = aligner(teacher_kv, student_kv)
        >>> loss, metrics = build_kv_loss("mercator")(out.student_keys, out.teacher_keys, out.mask, out.segment_ids)
    """

    def __init__(
        self,
        *,
        mode: Literal["flat", "structured"] = "flat",
        time_mode: Literal["segment", "global", "index"] = "segment",
        layer_map: Tensor | None = None,
        projector: Literal["linear", "elastic"] = "linear",
        mlp_ratio: float = 1.0,
        dropout: float = 0.0,
        init: str = "xavier",
        share_layers: bool = True,
        share_heads: bool = True,
        direction: Literal["teacher_to_student", "student_to_teacher"] = "teacher_to_student",
        project_values: bool = True,
        layernorm: bool = True,
        activation: bool = True,
        trainable: bool = True,
    ):
        super().__init__()
        for name, value, allowed in (
            ("mode", mode, MODES),
            ("time_mode", time_mode, TIME_MODES),
            ("projector", projector, ALIGNER_PROJECTORS),
            ("direction", direction, DIRECTIONS),
        ):
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; expected one of {allowed}")
        self.config: dict[str, Any] = {
            "mode": mode,
            "time_mode": time_mode,
            "projector": projector,
            "mlp_ratio": mlp_ratio,
            "dropout": dropout,
            "init": init,
            "share_layers": share_layers,
            "share_heads": share_heads,
            "direction": direction,
            "project_values": project_values,
            "layernorm": layernorm,
            "activation": activation,
            "trainable": trainable,
        }
        self._dims: dict[str, int] = {}
        self.register_buffer("layer_map", None if layer_map is None else validate_layer_map(layer_map))
        self.register_buffer("layer_index", None, persistent=False)
        # the mapped rows of M as (teacher layers, weights) [L_m, k], read by the time gather
        self.register_buffer("_src_layers", None, persistent=False)
        self.register_buffer("_src_weights", None, persistent=False)
        self.k_mix: nn.Module | None = None
        self.v_mix: nn.Module | None = None
        self.k_proj: nn.Module | None = None
        self.v_proj: nn.Module | None = None
        # False runs the stages one after another (the reference path; see `teacher_aligned`)
        self.fused = True

    # ------------------------------------------------------------------ building
    @property
    def built(self) -> bool:
        return bool(self._dims)

    @property
    def dims(self) -> dict[str, int]:
        """The dims the parameters were built with (empty before `setup`)."""
        return dict(self._dims)

    @property
    def mode(self) -> str:
        return self.config["mode"]

    @property
    def direction(self) -> str:
        return self.config["direction"]

    def setup(self, teacher: KVCache, student: KVCache) -> None:
        """Build the parameters from a probe batch's shapes (no-op if built for the same dims)."""
        dims = cache_dims(teacher, student)
        if self.built:
            self._check_dims(dims)
            return
        self.build(dims, device=student.keys.device)

    def build(self, dims: dict[str, int], device: torch.device | str | None = None) -> None:
        """Create layer map buffers, head mixers and projectors for `dims` (see `cache_dims`)."""
        c, d = self.config, {k: int(v) for k, v in dims.items()}
        L_s, L_t = d["student_layers"], d["teacher_layers"]
        if self.layer_map is None:
            M = proportional_map(L_s, L_t)
        else:
            M = validate_layer_map(self.layer_map.cpu(), L_s, L_t)
        rows = mapped_rows(M)
        L_m = len(rows)
        t2s = c["direction"] == "teacher_to_student"
        src, dst = ("teacher", "student") if t2s else ("student", "teacher")
        H_in, H_out = d[f"{src}_heads"], d[f"{dst}_heads"]
        proj_kw = {
            "mlp_ratio": c["mlp_ratio"],
            "dropout": c["dropout"],
            "init": c["init"],
            "trainable": c["trainable"],
            "layernorm": c["layernorm"],
            "activation": c["activation"],
        }
        k_in, k_out = d[f"{src}_key_dim"], d[f"{dst}_key_dim"]
        v_in, v_out = d[f"{src}_value_dim"], d[f"{dst}_value_dim"]
        if c["projector"] == "none":  # no parameters: the loss compares each side in its own width
            pass
        elif c["mode"] == "flat":
            k_in, k_out, v_in, v_out = H_in * k_in, H_out * k_out, H_in * v_in, H_out * v_out
            groups = 1 if c["share_layers"] else L_m
            self.k_proj = build_projector(c["projector"], k_in, k_out, groups=groups, **proj_kw)
            self.v_proj = (
                build_projector(c["projector"], v_in, v_out, groups=groups, **proj_kw)
                if c["project_values"]
                else None
            )
        else:
            mix_groups = 1 if c["share_layers"] else L_m
            self.k_mix = HeadMixer(H_in, H_out, groups=mix_groups, trainable=c["trainable"])
            self.v_mix = HeadMixer(H_in, H_out, groups=mix_groups, trainable=c["trainable"])
            groups = (1 if c["share_layers"] else L_m) * (1 if c["share_heads"] else H_out)
            share = {"share_layers": c["share_layers"], "share_heads": c["share_heads"]}
            self.k_proj = HeadwiseProjector(
                build_projector(c["projector"], k_in, k_out, groups=groups, **proj_kw), **share
            )
            self.v_proj = (
                HeadwiseProjector(
                    build_projector(c["projector"], v_in, v_out, groups=groups, **proj_kw), **share
                )
                if c["project_values"]
                else None
            )
        if c["projector"] != "none" and self.v_proj is None and v_in != v_out:
            raise ValueError(
                f"project_values=False needs equal value feature sizes, got {src} {v_in} vs {dst} {v_out} "
                f"({c['mode']} mode); use project_values=True"
            )
        self.layer_map = M
        self.layer_index = rows
        self._src_layers, self._src_weights = sparse_layer_map(M.index_select(0, rows))  # [L_m, k] each
        self._dims = d
        if device is not None:
            self.to(device=device)

    def _check_dims(self, dims: dict[str, int]) -> None:
        diff = {k: (self._dims[k], v) for k, v in dims.items() if self._dims.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: expected {e}, got {a}" for k, (e, a) in diff.items())
            raise ValueError(
                f"KVAligner was built for other cache shapes ({detail}); "
                "use one aligner per teacher/student pair"
            )

    # ------------------------------------------------------------------ forward
    def forward(self, teacher: KVCache, student: KVCache) -> AlignedKV:
        """Align `teacher` to `student`.

        Args:
            teacher: `KVCache` keys/values `[L_t, B, H_t, T_t, D_t]` (treated as constant: detached).
            student: `KVCache` keys/values `[L_s, B, H_s, T_s, D_s]` with the student's graph.

        Returns:
            `AlignedKV` with both sides `[L_m, B, T_s, F]` (flat) or `[L_m, B, T_s, H, D]` (structured).
        """
        self.setup(teacher, student)
        if teacher.keys.shape[1] != student.keys.shape[1]:
            raise ValueError(
                f"teacher batch size {teacher.keys.shape[1]} != student batch size {student.keys.shape[1]}"
            )
        idx = self.time_index(teacher, student)
        s_k, s_v = self.student_layers(student.keys), self.student_layers(student.values)
        if self.direction == "teacher_to_student":
            t_k, t_v = self.teacher_aligned(teacher, idx)
            s_k, s_v = self._layout(s_k), self._layout(s_v)
        else:
            s_k, s_v = self.head_dim(s_k, "key"), self.head_dim(s_v, "value")
            t_k = self._layout(self.teacher_time_layer(teacher.keys, idx))
            t_v = self._layout(self.teacher_time_layer(teacher.values, idx))
        mask = student.attention_mask.bool() & idx.valid  # [B, T_s]
        return AlignedKV(s_k, s_v, t_k, t_v, mask, student.segment_ids, self.layer_index)

    def attention_inputs(self, teacher: KVCache, student: KVCache) -> AlignedQK:
        """kv_loss attention: both sides' post-RoPE queries and keys at the student's positions
        (`AlignedQK`). The teacher's are time-aligned per layer, each layer the map reads kept apart:
        the attention of mixed queries and keys is not the mix of the attentions."""
        for side, kv in (("teacher", teacher), ("student", student)):
            if kv.queries is None:
                raise ValueError(f"kv_loss attention: the {side} cache holds no queries (forward_with_kv(queries=True), "
                                 "or a capture made with kv_loss attention)")
        self.setup(teacher, student)
        idx = self.time_index(teacher, student)
        rows = self.layer_map.index_select(0, self.layer_index)  # [L_m, L_t]
        used = (rows != 0).any(0).nonzero().flatten()  # [L_u] teacher layers the map reads
        ones = torch.ones(len(used), 1, device=used.device)

        def teacher_time(x: Tensor) -> Tensor:  # [L_t, B, H, T_t, D] -> [L_u, B, T_s, H, D]
            return resample_kv(x.detach().to(used.device), idx, used[:, None], ones)

        return AlignedQK(
            self.student_layers(student.queries), self.student_layers(student.keys),
            teacher_time(teacher.queries), teacher_time(teacher.keys), rows[:, used],
            student.attention_mask.bool() & idx.valid, student.segment_ids, self.layer_index,
        )

    # the stages, also called one by one by `kvdistill profile`
    def time_index(self, teacher: KVCache, student: KVCache) -> TimeIndex:
        """Where each student token reads the teacher (`TimeIndex`, fields `[B, T_s]`)."""
        return time_index(
            teacher.attention_mask,
            teacher.segment_ids,
            student.attention_mask,
            student.segment_ids,
            self.config["time_mode"],
            teacher.char_ends,
            student.char_ends,
        )

    def teacher_time_layer(self, x: Tensor, idx: TimeIndex) -> Tensor:
        """Time + layer alignment of teacher keys or values: `[L_t, B, H_t, T_t, D_t] -> [L_m, B, T_s, H_t, D_t]`.

        Both are linear maps on different axes and commute: one weighted gather reads only the
        teacher layers the map uses and writes straight into the time-major layout.
        """
        x = x.detach().to(self.layer_map.device)
        return resample_kv(x, idx, self._src_layers, self._src_weights)  # [L_m, B, T_s, H_t, D_t]

    def teacher_aligned(self, teacher: KVCache, idx: TimeIndex) -> tuple[Tensor, Tensor]:
        """Teacher keys and values through all four stages (`direction="teacher_to_student"`).

        With `fused` (the default), a flat linear projector runs inside the time + layer gather
        (`bag_linear`): the aligned teacher `[L_m, B, T_s, H_t*D_t]`, the largest tensor of the
        step, is built and projected one chunk at a time and never stored (nor upcast whole from
        a bf16 cache). When the teacher layers the map reads hold fewer tokens than the aligned
        teacher (`L_u * T_t < L_m * T_s`, e.g. Gemma-3-270m's 18 layers for SmolLM2's 30) and one
        projector serves every layer, those rows are projected first and the narrower result
        gathered: the gather is linear, so the result is the same with fewer matmul rows.
        Otherwise, and for the other projectors, the stages run one after another.
        """
        out, bags = [], None
        used, src = self._src_layers.unique(return_inverse=True)  # [L_u], [L_m, k] indices into used
        for x, which in ((teacher.keys, "key"), (teacher.values, "value")):
            proj = self.k_proj if which == "key" else self.v_proj
            if not (self.fused and self.mode == "flat" and isinstance(proj, LinearProjector)):
                out.append(self.head_dim(self.teacher_time_layer(x, idx), which))
                continue
            x = x.detach().to(self.layer_map.device)
            L_t, B, H, T_t, _ = x.shape
            first = proj.proj.groups == 1 and len(used) * T_t < len(self.layer_index) * idx.lo.shape[1]
            if first:  # a time-major table of the used layers, heads concatenated: [L_u*B*T_t, H*D]
                x = time_major(x if len(used) == L_t else x.index_select(0, used)).reshape(-1, H * x.shape[-1])
            if bags is None:  # keys and values read the same rows
                bags = (kv_bags((len(used), B, 1, T_t, 0), idx.to(x.device), src, self._src_weights) if first else
                        kv_bags(x.shape, idx.to(x.device), self._src_layers, self._src_weights))
            L_m, B, T_s, H, K = bags[0].shape  # H is 1 when the table rows hold every head
            rows, weights = (b.view(L_m, B * T_s, H, K) for b in bags)
            table = x if first else x.reshape(-1, x.shape[-1])
            y = bag_linear(table, rows, weights, proj.proj)  # [L_m, B*T_s, F_s]
            out.append(y.view(L_m, B, T_s, -1))
        return out[0], out[1]

    def student_layers(self, x: Tensor) -> Tensor:
        """The distilled student layers, time-major: `[L_s, B, H_s, T_s, D_s] -> [L_m, B, T_s, H_s, D_s]`."""
        if len(self.layer_index) != x.shape[0]:
            x = x.index_select(0, self.layer_index.to(x.device))
        return time_major(x)

    def head_dim(self, x: Tensor, which: str) -> Tensor:
        """Head + dim alignment of the projected side (`which` = "key" | "value"), time-major input."""
        if which == "key":
            return self._project(x, self.k_mix, self.k_proj)
        return self._project(x, self.v_mix, self.v_proj)

    def _layout(self, x: Tensor) -> Tensor:
        """Time-major `[L, B, T, H, D]` -> the loss layout (flat: `[L, B, T, H*D]`), no parameters."""
        return x.flatten(3) if self.mode == "flat" else x

    def _project(self, x: Tensor, mix: nn.Module | None, proj: nn.Module | None) -> Tensor:
        """Time-major `[L, B, T, H_in, D_in]` -> head + dim alignment -> loss layout in the target space."""
        x = self._layout(x)  # [L, B, T, H*D] or [L, B, T, H, D]
        if proj is not None:
            x = x.to(self._param_dtype())
        if mix is not None:
            x = mix(x)  # [L, B, T, H_out, D_in]
        return x if proj is None else proj(x)  # [L, B, T, F_out] or [L, B, T, H_out, D_out]

    def _param_dtype(self) -> torch.dtype:
        p = next(self.parameters(), None)
        return torch.float32 if p is None else p.dtype

    # ------------------------------------------------------------------ save / load
    def save(self, path: str | Path, state: dict[str, Tensor] | None = None) -> Path:
        """Write weights (safetensors) and constructor args + dims (JSON).

        `path` is a directory (-> `aligner.safetensors` + `aligner.json` inside) or a file ending
        in `.safetensors` (-> the JSON next to it, same stem). `state`: the weights to write instead
        of the live ones (under FSDP the live modules hold shards; the gathered state is whole).
        Returns the weights path.
        """
        from safetensors.torch import save_file

        if not self.built:
            raise ValueError("KVAligner has no parameters yet: call setup(teacher, student) before save")
        weights, meta = _paths(Path(path))
        weights.parent.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in (self.state_dict() if state is None else state).items()}
        save_file(state, str(weights), metadata={"format": ALIGNER_FORMAT})
        write_json_atomic(meta, {"format": ALIGNER_FORMAT, "config": self.config, "dims": self._dims})
        return weights

    @classmethod
    def load(cls, path: str | Path, map_location: str | torch.device = "cpu") -> KVAligner:
        """Rebuild an aligner saved with `save` (directory or `.safetensors` file)."""
        from safetensors.torch import load_file

        weights, meta = _paths(Path(path))
        if not weights.is_file() or not meta.is_file():
            raise FileNotFoundError(f"no saved aligner at {path} (expected {weights} and {meta})")
        doc = json.loads(meta.read_text())
        if doc.get("format") != ALIGNER_FORMAT:
            raise ValueError(f"{meta} is not a saved KVAligner (format {doc.get('format')!r})")
        state = load_file(str(weights), device=str(map_location))
        aligner = cls(**doc["config"], layer_map=state.get("layer_map"))
        aligner.build(doc["dims"], device=map_location)
        aligner.load_state_dict(state, strict=True)
        return aligner

    @classmethod
    def from_pretrained(cls, path: str | Path, map_location: str | torch.device = "cpu") -> KVAligner:
        """Alias of `load`, for symmetry with `transformers`."""
        return cls.load(path, map_location=map_location)

    # ------------------------------------------------------------------ reporting
    def param_counts(self) -> dict[str, int]:
        """Parameters per component: key/value head mixers and projectors, and the total."""
        parts = {
            "key_head_mix": self.k_mix,
            "value_head_mix": self.v_mix,
            "key_proj": self.k_proj,
            "value_proj": self.v_proj,
        }
        counts = {name: param_count(m) for name, m in parts.items() if m is not None}
        counts["total"] = param_count(self)
        counts["trainable"] = param_count(self, trainable_only=True)
        return counts

    def summary(self) -> str:
        """A few lines: options, dims, layer map coverage, parameter counts per component."""
        c = self.config
        lines = [
            f"KVAligner mode={c['mode']} direction={c['direction']} time={c['time_mode']} "
            f"projector={c['projector']} (mlp_ratio={c['mlp_ratio']}, init={c['init']}, "
            f"share_layers={c['share_layers']}, share_heads={c['share_heads']})"
        ]
        if not self.built:
            return lines[0] + "\n  not built yet: call setup(teacher, student)"
        d = self._dims
        lines.append(
            f"  teacher L={d['teacher_layers']} H={d['teacher_heads']} Dk={d['teacher_key_dim']} "
            f"Dv={d['teacher_value_dim']} -> student L={d['student_layers']} H={d['student_heads']} "
            f"Dk={d['student_key_dim']} Dv={d['student_value_dim']}"
        )
        lines.append(
            f"  layer map: {len(self.layer_index)} of {d['student_layers']} student layers distilled"
        )
        for name, n in self.param_counts().items():
            lines.append(f"  {name:<15} {n:>14,d}")
        return "\n".join(lines)

    def extra_repr(self) -> str:
        c = self.config
        text = f"mode={c['mode']}, direction={c['direction']}, time_mode={c['time_mode']}"
        if not self.built:
            return text + ", not built"
        d = self._dims
        return (
            f"{text},\nteacher L={d['teacher_layers']} H={d['teacher_heads']} D={d['teacher_key_dim']}"
            f" -> student L={d['student_layers']} H={d['student_heads']} D={d['student_key_dim']}"
        )


def _paths(path: Path) -> tuple[Path, Path]:
    if path.suffix == ".safetensors":
        return path, path.with_suffix(".json")
    return path / WEIGHTS_NAME, path / CONFIG_NAME
