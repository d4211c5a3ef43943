"""Data-parallel training on PyTorch's own distributed stack (DESIGN.md §4).

Launch with ``torchrun --nproc-per-node N -m wide_cli prune ...`` (or ``wide prune --nproc N``,
which re-executes itself under torchrun). CPU: DDP over gloo. CUDA: FSDP2 ``fully_shard`` per
decoder layer over NCCL. Rank 0 alone logs, checkpoints and exports; every rank sees its own
shard of each global batch (``train.data_order.batch_indices``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistInfo:
    """``rank``/``world`` of this process (0/1 when not distributed) and ``local_rank``."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def dist_info() -> DistInfo:
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK)."""
    return DistInfo(
        int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    )


def init(device: str) -> DistInfo:
    """Initialise the default process group when running under torchrun (gloo on CPU, NCCL on
    CUDA); a no-op in a single process. Returns this process's DistInfo."""
    info = dist_info()
    if info.enabled and not torch.distributed.is_initialized():
        backend = "nccl" if str(device).startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(info.local_rank)
        torch.distributed.init_process_group(backend=backend)
    return info


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def wrap(model, device: str):
    """The module to call forward on: DDP (CPU/gloo) or FSDP2 ``fully_shard`` (CUDA), or the
    model itself in a single process. Frozen parameters are not synchronised; trainable ones
    (routers, LoRA) get averaged gradients."""
    info = dist_info()
    if not info.enabled:
        return None
    if str(device).startswith("cuda"):
        from torch.distributed.fsdp import fully_shard

        from wide_cli.routing.model import decoder_layers

        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        return model
    return torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)


def without_option(argv: list[str], name: str) -> list[str]:
    """``argv`` without the option ``name`` and its value, in either form (``--nproc 2`` or
    ``--nproc=2``); everything else keeps its order."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def relaunch_with_torchrun(nproc: int, argv: list[str], *, threads: int | None = None) -> int:
    """Re-execute ``wide <argv>`` under ``torch.distributed.run`` with ``nproc`` processes and
    return its exit code (the ``--nproc`` shortcut). ``threads``: CPU threads of each process,
    set in ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` before the processes import torch."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "wide_cli", *argv]
    env = dict(os.environ)
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return subprocess.call(cmd, env=env)
