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
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

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
        info = RankInfo(
            _int_var(env, "SLURM_PROCID") or 0,
            _int_var(env, "SLURM_NTASKS") or 1,
            _int_var(env, "SLURM_LOCALID") or 0,
            "slurm",
        )
    else:
        return RankInfo()
    if info.world_size < 1 or info.rank >= info.world_size:
        raise ValueError(
            f"rank {info.rank} is outside a world of {info.world_size} processes ({info.launcher} "
            f"environment); check RANK / WORLD_SIZE (or SLURM_PROCID / SLURM_NTASKS)"
        )
    return info


def rank_device(info: RankInfo | None = None) -> str:
    """`cuda:<local rank>` when CUDA is available (one device per rank on a node), else `cpu`."""
    import torch

    info = info or rank_info()
    if not torch.cuda.is_available():
        return "cpu"
    count = torch.cuda.device_count()
    if info.local_rank >= count:
        raise ValueError(
            f"local rank {info.local_rank} has no GPU of its own: this node shows {count} CUDA "
            f"device(s); start at most {count} processes per node"
        )
    return f"cuda:{info.local_rank}"


def warn_if_more_ranks_than_shards(num_shards: int, what: str, info: RankInfo | None = None) -> bool:
    """Log a warning when some ranks cannot get a shard of `what` (they wait for the others); True if so."""
    info = info or rank_info()
    if info.world_size <= num_shards:
        return False
    if info.is_main:
        log.warning(
            "%s has %d shard(s) for %d ranks: %d rank(s) have nothing to compute and wait for the others "
            "(a smaller shard size spreads the work further)",
            what,
            num_shards,
            info.world_size,
            info.world_size - num_shards,
        )
    return True


def spread(items: Sequence[T], info: RankInfo | None = None) -> list[T]:
    """`items` rotated so that each rank starts at its own share: the ranks begin with different shards
    instead of all contending for the first one."""
    info = info or rank_info()
    if info.world_size <= 1 or not items:
        return list(items)
    start = info.rank * len(items) // info.world_size
    return list(items[start:]) + list(items[:start])


# --- one run folder for every rank -------------------------------------------------------------------

RUN_ID_VARIABLE = "CONFRAG_RUN_ID"  # set it to give every process of a launch one run folder by hand
STAMP_KEY = "confrag/run_stamp"
STAMP_TIMEOUT_SECONDS = 60.0


def launch_stamp(pattern: str, environ: Mapping[str, str] | None = None, now: datetime | None = None) -> str:
    """The name of this launch's run folder, the same string in every rank of a multi-process launch.

    Hydra names a run folder by the time each process resolves it, and the ranks of one launch start
    microseconds or seconds apart: without this each rank would get a folder of its own. In order:
    `$CONFRAG_RUN_ID` verbatim (any launcher); a single process: its own time formatted with `pattern`;
    torchrun: the time of whichever rank asks first, agreed through the rendezvous store the torchrun
    agent hosts at MASTER_ADDR:MASTER_PORT (a restarted attempt of the same launch gets the same folder);
    a multi-task SLURM step: `slurm-<job>.<step>`; otherwise the process's own time, with a warning."""
    env = os.environ if environ is None else environ
    own = (now or datetime.now()).strftime(pattern)
    given = (env.get(RUN_ID_VARIABLE) or "").strip()
    if given:
        if "/" in given or given in (".", ".."):
            raise ValueError(f"{RUN_ID_VARIABLE}={given!r} must be a folder name (no '/')")
        return given
    info = rank_info(env)
    if info.world_size <= 1:
        return own
    if info.launcher == "torchrun" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        try:
            return _agreed_through_store(env["MASTER_ADDR"], int(env["MASTER_PORT"]), own)
        except (KeyError, ValueError, RuntimeError, OSError) as err:
            _say(f"confrag: could not agree on one run folder through the torchrun store ({err})")
    elif info.launcher == "slurm" and env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}"
    _say(
        f"confrag: rank {info.rank} of {info.world_size} ({info.launcher}) names its run folder by its own clock, "
        f"so the ranks may write to different folders; set {RUN_ID_VARIABLE} (the same value in every rank) or "
        "hydra.run.dir=... to give them one"
    )
    return own


def _agreed_through_store(host: str, port: int, proposal: str) -> str:
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STAMP_TIMEOUT_SECONDS))
    # compare_set on a missing key with expected "" stores the proposal; on a present key it returns what
    # is there: the first rank to ask decides, and every rank reads the same value.
    return store.compare_set(STAMP_KEY, "", proposal).decode()


def _say(message: str) -> None:
    # Run-folder names are resolved before Hydra configures logging: stderr is the place to be seen.
    print(message, file=sys.stderr, flush=True)


def rank_suffix(info: RankInfo | None = None) -> str:
    """`""` for the main (or only) process, `_rank<r>` for the others: for per-rank file names in a run
    folder the ranks share (Hydra's job log, its saved config)."""
    info = info or rank_info()
    return "" if info.is_main else f"_rank{info.rank}"


# --- trainers under a multi-process launch -----------------------------------------------------------


def trainer_processes(devices: Any, num_nodes: Any = 1) -> int | None:
    """How many processes a Lightning trainer with `devices` and `num_nodes` trains in; None when it is
    decided at run time ("auto", -1)."""
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, bool) or devices in (None, "auto", -1):
        return None
    if isinstance(devices, int):
        count = devices
    elif isinstance(devices, str):  # "0,1": a list of device indices
        count = len([d for d in devices.split(",") if d.strip()])
    else:
        count = len(list(devices))
    nodes = int(num_nodes) if num_nodes not in (None, "") else 1
    return count * max(nodes, 1)


def check_ddp_trainer(devices: Any, num_nodes: Any, strategy: Any, key: str, info: RankInfo | None = None) -> None:
    """A trainer that every rank of this launch runs together (the probe task's) must train across exactly
    this launch's processes. With one device every rank would train its own copy of the model and write
    the same files (on GPUs all of them on cuda:0); Lightning raises nothing, or something obscure."""
    info = info or rank_info()
    if info.world_size <= 1:
        return
    processes = trainer_processes(devices, num_nodes)
    launch = f"this process is rank {info.rank} of a {info.world_size}-process {info.launcher} launch"
    if processes == 1 or str(strategy) in ("single_device", "single_xla"):
        raise ValueError(
            f"{key}: {launch}, but the trainer trains on one device ({key}.devices={devices!r}, "
            f"{key}.strategy={strategy!r}). Use trainer=ddp trainer.devices=<processes per node> "
            f"(and trainer.num_nodes=<nodes>), or start one process: python train.py ..."
        )
    if processes is not None and processes != info.world_size:
        raise ValueError(
            f"{key}: {launch}, but {key}.devices={devices!r} x {key}.num_nodes={num_nodes!r} = "
            f"{processes} processes; they must multiply to {info.world_size}"
        )


def check_one_device_trainer(
    devices: Any, num_nodes: Any, strategy: Any, key: str, info: RankInfo | None = None
) -> None:
    """A trainer that runs on one rank while the others wait (a later task trains its probe and rerankers
    under a lock, "train it if it is missing") must be a one-process trainer: a multi-process one would
    wait for ranks that wait for it."""
    info = info or rank_info()
    if info.world_size <= 1:
        return
    processes = trainer_processes(devices, num_nodes)
    if processes == 1 and str(strategy) not in ("ddp", "ddp_spawn", "fsdp", "deepspeed"):
        return
    raise ValueError(
        f"{key}: this process is rank {info.rank} of a {info.world_size}-process {info.launcher} "
        f"launch, where this task trains on whichever rank comes first while the others wait for "
        f"its result; a multi-process trainer ({key}.devices={devices!r}, {key}.strategy="
        f"{strategy!r}) would wait for them. Use a one-device trainer ({key}.devices=1, "
        f"{key}.strategy=auto)"
    )


def rank_trainer_devices(accelerator: Any, devices: Any, info: RankInfo | None = None) -> Any:
    """The `devices` of a one-device GPU trainer run by one rank of a multi-process launch: that rank's
    own GPU (`[local rank]`) instead of Lightning's choice, GPU 0, which rank 0's LLM may be using."""
    info = info or rank_info()
    if info.world_size > 1 and str(accelerator) in ("gpu", "cuda") and str(devices) == "1":
        return [info.local_rank]  # an explicit list of devices is the user's choice and kept
    return devices
