"""What `accelerate launch` sets up on a machine without GPUs: FSDP put back, lone workers refused.

On CPU, pass `--use_cpu true` to `kvdistill train` for every launch config (DDP, FSDP, DeepSpeed).
accelerate 1.x picks the distributed mode from the devices it finds, and on CPU it quietly drops
what the launch asked for in two cases:

- FSDP config: the workers build the FSDP plugin, then `AcceleratorState` turns only GPU-like process
  groups (MULTI_GPU, MULTI_XPU, ...) into FSDP, never MULTI_CPU (gloo), so the run becomes DDP.
  torch's FSDP2 (`fully_shard`) does run on CPU over gloo (FSDP1 does not: its collectives are not
  gloo's), so `enable_cpu_fsdp` restores the plugin.
- Without `--use_cpu true`, no CPU process group is made (or, with `--ddp_backend gloo`, one that
  accelerate does not use for DDP/FSDP), and every worker trains alone. `check_launch` refuses that.

On any device, under DeepSpeed ZeRO-3 models are loaded already partitioned: `gathered` gives a model
its whole weights for a forward outside the DeepSpeed engine (the probe that sizes the aligners).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import Any

from torch import nn

from kvdistill.config import ConfigError


def enable_cpu_fsdp(accelerator: Any) -> bool:
    """Make a CPU (gloo) multi-process run use the launcher's FSDP plugin; True when it did.

    A no-op unless the process was launched with an FSDP config and runs on CPU processes.
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU or os.environ.get("ACCELERATE_USE_FSDP") != "true":
        return False
    plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables
    if plugin.fsdp_version != 2:
        raise ConfigError("FSDP on CPU processes needs `fsdp_version: 2` in the accelerate config (FSDP1's "
                          "collectives do not run on gloo); configs/accelerate/fsdp.yaml has it")
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    # both shared states: AcceleratorState copies the process state's fields each time it is built
    PartialState().distributed_type = state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    return True


def check_launch(accelerator: Any) -> None:
    """Raise `ConfigError` when several processes were launched but each would train alone."""
    from accelerate.utils import DistributedType

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    kind = accelerator.distributed_type
    if launched > 1 and (accelerator.num_processes != launched or kind == DistributedType.NO):
        raise ConfigError(f"{launched} processes were launched, but accelerate set up {kind} over "
                          f"{accelerator.num_processes} process(es), so each would train alone; on a machine "
                          "without GPUs pass `--use_cpu true`")


def gathered(params: Iterable[nn.Parameter]) -> contextlib.AbstractContextManager:
    """Context in which DeepSpeed ZeRO-3 parameters hold their whole values, read-only (a no-op for
    any other kind). A collective: every rank enters it with the same parameters.

    Under ZeRO-3, transformers loads every model inside `deepspeed.zero.Init` (the training arguments
    register the config), so outside a DeepSpeed engine's forward a model's weights are empty partitions.
    """
    params = list(params)
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed  # only ZeRO-3 parameters carry a ds_id

    return deepspeed.zero.GatheredParameters(params)
