"""Worker of tests/train/test_distributed.py, started by `accelerate launch`: build the run as
`kvdistill train` does, train, then record on every rank where the student, the aligners and the
teachers live, and the trained state gathered to full tensors.

    accelerate launch --config_file CONFIG tests/train/dist_worker.py <kvdistill train options>

Writes into output_dir: `placement_rank<i>.json` (every rank) and `gathered.safetensors` (rank 0).
Checkpoints (`--save_steps`) are left for the resume test; nothing recorded here reads them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config
from kvdistill.train.distributed import gathered


def param_kind(p: torch.Tensor) -> str:
    """'dtensor' (an FSDP2 shard), 'zero3' (a DeepSpeed ZeRO-3 parameter) or 'plain' (a whole tensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return "dtensor"
    return "zero3" if hasattr(p, "ds_id") else "plain"


def param_facts(p: torch.Tensor) -> dict:
    """Its kind, the elements this rank stores (its shard or partition, or all) and the full count."""
    kind = param_kind(p)
    if kind == "dtensor":
        return {"kind": kind, "local": p.to_local().numel(), "full": p.numel()}
    if kind == "zero3":
        return {"kind": kind, "local": p.ds_tensor.numel(), "full": p.ds_numel}
    return {"kind": kind, "local": p.numel(), "full": p.numel()}


def teacher_facts(model: nn.Module) -> dict:
    from torch.distributed.fsdp import FSDPModule

    params = list(model.parameters())
    meta = any(p.is_meta for p in params)  # a captured teacher: no weights
    checksum = None
    if not meta:
        with gathered(params):
            checksum = sum(float(p.detach().double().sum()) for p in params)
    return {
        "meta": meta,
        "kinds": sorted({param_kind(p) for p in params}),
        "fsdp_wrapped": any(isinstance(m, FSDPModule) for m in model.modules()),
        "training": model.training,
        "requires_grad": any(p.requires_grad for p in params),
        "checksum": checksum,
    }


def placement(trainer) -> dict:
    """What this rank holds after training."""
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {
        "mode": str(trainer.accelerator.distributed_type),
        "params": {n: param_facts(p) for n, p in trainer.model.named_parameters()},
        # names resolve where the optimizer holds the model's own parameters (FSDP, DDP; not ZeRO's flat copies)
        "optimizer_groups": [{"name": g["name"], "lr": g["initial_lr"], "params": [names.get(id(p)) for p in g["params"]]}
                             for g in trainer.optimizer.param_groups],
        "teachers": {t.name: teacher_facts(t.model) for t in trainer.teachers},
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "grad_norms": [{k: v for k, v in h.items() if k.startswith("grad_norm")} for h in trainer.state.log_history
                       if "loss" in h],
    }


def main(argv: list[str]) -> None:
    cfg = parse_config(argv)
    trainer = build_trainer(cfg)
    trainer.train()
    out = Path(cfg.output_dir)
    facts = placement(trainer)
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # a collective: every rank calls it
    if trainer.is_world_process_zero():
        save_file({k: v.detach().cpu().clone() for k, v in state.items()}, out / "gathered.safetensors")
    (out / f"placement_rank{cfg.process_index}.json").write_text(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
