"""Which worker this process is when several fill one cache, and the device it should compute on.

Launchers announce a process's place in its environment: `torchrun` (and torchelastic) set RANK,
WORLD_SIZE and LOCAL_RANK; Lightning's own DDP launcher sets LOCAL_RANK, NODE_RANK and WORLD_SIZE in
the processes it starts; a SLURM step started with `srun` sets SLURM_PROCID, SLURM_NTASKS and
SLURM_LOCALID. The heavy stages use this only to pick a device and to spread their first claims over
the shards: which shard a process computes is decided by the shard locks of `ShardedArtifact`, so a
wrong or missing rank costs at most some waiting, never a wrong result.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping, Sequence, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str = "single"  # "torchrun", "lightning", "slurm" or "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int_var(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be a non-negative integer") from None
    if value < 0:
        raise ValueError(f"environment variable {name}={raw!r} must be a non-negative integer")
    return value


def rank_info(environ: Mapping[str, str] | None = None) -> RankInfo:
    """This process's rank, the number of ranks and its rank on its node, from the launcher's environment."""
    env = os.environ if environ is None else environ
    rank, world, local = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE"), _int_var(env, "LOCAL_RANK")
    if rank is not None:
        info = RankInfo(rank, world or 1, local if local is not None else rank, "torchrun")
    elif local is not None and world is not None:
        # Lightning's launcher gives no global rank; with one node (NODE_RANK 0) it is the local one.
        node = _int_var(env, "NODE_RANK") or 0
        per_node = _int_var(env, "LOCAL_WORLD_SIZE") or (world if node == 0 else None)
        if per_node is None:
            raise ValueError(f"NODE_RANK={node} without RANK or LOCAL_WORLD_SIZE: cannot tell this process's rank")
        info = RankInfo(node * per_node + local, world, local, "lightning")
    elif (_int_var(env, "SLURM_NTASKS") or 1) > 1:
        # Only a multi-task step: every job of a submitit sweep is a 1-task job, independent of the others.
        info = RankInfo(_int_var(env, "SLURM_PROCID") or 0, _int_var(env, "SLURM_NTASKS") or 1,
                        _int_var(env, "SLURM_LOCALID") or 0, "slurm")
    else:
        return RankInfo()
    if info.world_size < 1 or info.rank >= info.world_size:
        raise ValueError(f"rank {info.rank} is outside a world of {info.world_size} processes ({info.launcher} "
                         f"environment); check RANK / WORLD_SIZE (or SLURM_PROCID / SLURM_NTASKS)")
    return info


def rank_device(info: RankInfo | None = None) -> str:
    """`cuda:<local rank>` when CUDA is available (one device per rank on a node), else `cpu`."""
    import torch

    info = info or rank_info()
    if not torch.cuda.is_available():
        return "cpu"
    count = torch.cuda.device_count()
    if info.local_rank >= count:
        raise ValueError(f"local rank {info.local_rank} has no GPU of its own: this node shows {count} CUDA "
                         f"device(s); start at most {count} processes per node")
    return f"cuda:{info.local_rank}"


def warn_if_more_ranks_than_shards(num_shards: int, what: str, info: RankInfo | None = None) -> bool:
    """Log a warning when some ranks cannot get a shard of `what` (they wait for the others); True if so."""
    info = info or rank_info()
    if info.world_size <= num_shards:
        return False
    if info.is_main:
        log.warning("%s has %d shard(s) for %d ranks: %d rank(s) have nothing to compute and wait for the others "
                    "(a smaller shard size spreads the work further)", what, num_shards, info.world_size,
                    info.world_size - num_shards)
    return True


def spread(items: Sequence[T], info: RankInfo | None = None) -> list[T]:
    """`items` rotated so that each rank starts at its own share: the ranks begin with different shards
    instead of all contending for the first one."""
    info = info or rank_info()
    if info.world_size <= 1 or not items:
        return list(items)
    start = info.rank * len(items) // info.world_size
    return list(items[start:]) + list(items[:start])
