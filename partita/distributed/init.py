"""Start torch.distributed from whatever launched this process.

One call, :func:`init_distributed`, works the same under ``torchrun`` / ``partita run``,
under ``srun`` on a SLURM cluster, and for a plain ``python train.py`` (a world of one).
Detection is a pure function of the environment (:func:`detect_launch_env`) so every rule
is testable without starting processes; only :func:`init_distributed` touches torch.

Precedence, first match wins:

1. torchrun variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
   ``MASTER_PORT``). They win over SLURM because ``partita run`` inside an ``srun`` step
   leaves the SLURM variables of the launcher task in every worker.
2. SLURM task variables (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
   ``SLURM_JOB_NODELIST``): one task per rank started by ``srun``. ``MASTER_ADDR`` and
   ``MASTER_PORT`` still override the address derived from the node list.
3. Nothing set: a single process with an in-process store, so no port is opened.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from partita.distributed.shutdown import install_exit_handler

__all__ = [
    "LaunchEnv",
    "current_device",
    "detect_launch_env",
    "expand_slurm_nodelist",
    "first_slurm_host",
    "init_distributed",
    "local_rank",
    "resolve_backend",
    "slurm_master_port",
]

BACKENDS = ("auto", "nccl", "gloo")
DEFAULT_MASTER_PORT = 29500

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST")

# Ports derived from the SLURM job id land in [20000, 30000): below Linux's ephemeral range
# (32768+) so an outgoing connection never holds the port, and different jobs sharing a
# node get different ports instead of all fighting over 29500.
_SLURM_PORT_BASE = 20000
_SLURM_PORT_SPAN = 10000


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as read from the environment."""

    source: Literal["torchrun", "slurm", "single"]
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None


# --------------------------------------------------------------------------- SLURM node lists


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside ``[...]`` (``a[1,2],b`` -> ``a[1,2]``, ``b``)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"SLURM node list {text!r} has an unmatched ']' at position {i}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"SLURM node list {text!r} has an unclosed '['")
    parts.append(text[start:])
    return parts


def _parse_range_set(spec: str, nodelist: str) -> list[tuple[int, int, int]]:
    """``01-03,07`` -> ``[(1, 3, 2), (7, 7, 2)]`` as (start, end, zero-padded width)."""
    ranges = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if match is None:
            raise ValueError(
                f"SLURM node list {nodelist!r}: {item!r} inside [...] is not a number or a range "
                "like 01-04"
            )
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise ValueError(f"SLURM node list {nodelist!r}: range {item!r} runs backwards")
        ranges.append((int(first), int(last), len(first)))
    return ranges


def _join(pieces: list[str | list[tuple[int, int, int]]]) -> Iterator[str]:
    """Lazy cartesian product of literals and range sets (itertools.product would
    materialize every range first)."""
    if not pieces:
        yield ""
        return
    head, rest = pieces[0], pieces[1:]
    heads = [head] if isinstance(head, str) else (
        str(n).zfill(width) for first, last, width in head for n in range(first, last + 1))
    for prefix in heads:
        for suffix in _join(rest):
            yield prefix + suffix


def expand_slurm_nodelist(nodelist: str) -> Iterator[str]:
    """Yield every hostname of a compressed SLURM node list, in order.

    Handles ``node[01-04,07],gpu5`` and several bracket groups in one name
    (``rack[1-2]-n[1-2]``). Written here because the alternative, ``scontrol show hostnames``,
    is a subprocess that may not exist inside containers. Lazy, so asking for the first host
    of a 10 000-node list costs nothing; syntax errors are raised before the first name.
    """
    text = nodelist.strip()
    if not text:
        raise ValueError("SLURM node list is empty; SLURM_JOB_NODELIST should name the nodes")
    parsed = []
    for part in _split_top_level(text):
        if not part:
            raise ValueError(f"SLURM node list {nodelist!r} has an empty entry between commas")
        # re.split with one group alternates literal, bracket body, literal, ...
        pieces = re.split(r"\[([^\]]*)\]", part)
        parsed.append([piece if i % 2 == 0 else _parse_range_set(piece, nodelist)
                       for i, piece in enumerate(pieces)])
    return (host for pieces in parsed for host in _join(pieces))


def first_slurm_host(nodelist: str) -> str:
    """The first hostname of a SLURM node list: where rank 0 runs, so the master address."""
    return next(expand_slurm_nodelist(nodelist))


def slurm_master_port(job_id: str | None) -> int:
    """A rendezvous port derived from the SLURM job id (29500 when there is no usable id).

    Two jobs sharing a node then pick different ports without coordination.
    """
    if job_id is None or not job_id.strip().isdigit():
        return DEFAULT_MASTER_PORT
    return _SLURM_PORT_BASE + int(job_id) % _SLURM_PORT_SPAN


# --------------------------------------------------------------------------- env detection


def _require(environ: Mapping[str, str], names: tuple[str, ...], launcher: str) -> None:
    missing = [name for name in names if not environ.get(name)]
    if missing:
        present = [name for name in names if environ.get(name)]
        raise ValueError(
            f"{launcher} environment is half set: {', '.join(present)} set but "
            f"{', '.join(missing)} missing. Launch with `partita run` / torchrun (which set all of "
            f"{', '.join(names)}), or unset {', '.join(present)} to run as a single process."
        )


def _int_var(environ: Mapping[str, str], name: str, *, minimum: int) -> int:
    raw = environ[name]
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def _port_var(environ: Mapping[str, str], name: str) -> int:
    port = _int_var(environ, name, minimum=1)
    if port > 65535:
        raise ValueError(f"{name}={port} is not a TCP port (1..65535)")
    return port


def _check_rank(rank_name: str, rank: int, world_name: str, world: int) -> None:
    if rank >= world:
        raise ValueError(f"{rank_name}={rank} must be < {world_name}={world}")


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank, world size and rendezvous address from the environment (see module doc).

    Raises ValueError naming the missing variables when a launcher's set is only half
    present, since guessing there would hang every other rank.
    """
    env = os.environ if environ is None else environ
    if env.get("RANK") or env.get("WORLD_SIZE") or (env.get("LOCAL_RANK") and not env.get("SLURM_PROCID")):
        _require(env, TORCHRUN_VARS, "torchrun")
        world = _int_var(env, "WORLD_SIZE", minimum=1)
        rank = _int_var(env, "RANK", minimum=0)
        _check_rank("RANK", rank, "WORLD_SIZE", world)
        return LaunchEnv("torchrun", rank, world, _int_var(env, "LOCAL_RANK", minimum=0),
                         env["MASTER_ADDR"], _port_var(env, "MASTER_PORT"))
    if env.get("SLURM_PROCID"):
        # Older SLURM releases only export SLURM_NODELIST.
        if not env.get("SLURM_JOB_NODELIST") and env.get("SLURM_NODELIST"):
            env = {**env, "SLURM_JOB_NODELIST": env["SLURM_NODELIST"]}
        _require(env, SLURM_VARS, "SLURM")
        world = _int_var(env, "SLURM_NTASKS", minimum=1)
        rank = _int_var(env, "SLURM_PROCID", minimum=0)
        _check_rank("SLURM_PROCID", rank, "SLURM_NTASKS", world)
        addr = env.get("MASTER_ADDR") or first_slurm_host(env["SLURM_JOB_NODELIST"])
        port = (_port_var(env, "MASTER_PORT") if env.get("MASTER_PORT")
                else slurm_master_port(env.get("SLURM_JOB_ID")))
        return LaunchEnv("slurm", rank, world, _int_var(env, "SLURM_LOCALID", minimum=0), addr, port)
    return LaunchEnv("single", 0, 1, 0, None, None)


# --------------------------------------------------------------------------- init


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``nccl`` with CUDA, else ``gloo``; refuse names and combinations that cannot work."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "backend='nccl' needs CUDA GPUs but torch.cuda.is_available() is False; "
            "use backend='gloo' (or 'auto') on CPU machines"
        )
    return backend


def _cuda_index(local: int) -> int:
    """GPU index for a local rank.

    When SLURM binds one GPU per task (``--gpus-per-task=1``) every process sees a single
    device 0 while its local rank is 0..N-1, so a lone visible GPU is always index 0.
    """
    count = torch.cuda.device_count()
    if local < count:
        return local
    if count == 1:
        return 0
    raise ValueError(
        f"local rank {local} has no GPU: this process sees {count} CUDA device(s). Start at most "
        f"{count} processes per node (partita run --nproc {count}) or fix CUDA_VISIBLE_DEVICES"
    )


def local_rank() -> int:
    """This process's index on its node (0 for a single process)."""
    return detect_launch_env().local_rank


def current_device() -> torch.device:
    """The device this rank computes on: ``cuda:<local rank>`` when CUDA is available, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", _cuda_index(local_rank()))
    return torch.device("cpu")


def _initialized_backends() -> set[str]:
    # get_backend() is "gloo", "nccl", or "cpu:gloo,cuda:nccl" for a per-device mix.
    names = str(dist.get_backend())
    return {item.split(":")[-1] for item in names.split(",")}


def _agent_store(launch: LaunchEnv, timeout: timedelta) -> dist.Store | None:
    """The torchrun agent's store with a prefix of its own per restart attempt, or None when
    the workers are not meant to share the agent's store (then ``env://`` is right as it is).

    ``env://`` connects to the agent's store without a prefix, on the assumption (torch's comment
    in ``_create_c10d_store``) that every restart gets a new store. The static rendezvous (``partita
    run --master-port P``, torchrun's ``--rdzv-backend=static``, the multi-node path) keeps one
    store for the life of the agent, so a restarted attempt found the previous attempt's keys:
    gloo read the dead workers' addresses and failed with ``connectFullMesh ... Connection
    refused``, or ranks hung in init, and only a second restart (past the stale keys) recovered.
    A prefix per attempt (``TORCHELASTIC_RESTART_COUNT``) keeps attempts apart on every backend.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if not attempt.isdigit():
        raise ValueError(f"TORCHELASTIC_RESTART_COUNT={attempt!r} is not a non-negative integer")
    client = dist.TCPStore(str(launch.master_addr), int(launch.master_port or 0), launch.world_size,
                           is_master=False, timeout=timeout)
    return dist.PrefixStore(f"partita/attempt_{attempt}", client)


def init_distributed(*, backend: str = "auto", timeout_seconds: float = 1800.0) -> None:
    """Initialize the default process group from the launch environment; idempotent.

    ``timeout_seconds`` bounds every collective: when a rank dies the others fail with
    torch's timeout error naming the operation instead of hanging forever.
    Calling again is a no-op, but asking explicitly for a backend other than the one already
    running raises ValueError, because silently keeping the wrong one hides a config error.
    Either way the process gets partita's exit path (:mod:`partita.distributed.shutdown`), which
    tears the process groups down before the interpreter finalizes, so that a finished rank does
    not die of SIGABRT in gloo's teardown.
    """
    if not timeout_seconds > 0:
        raise ValueError(f"timeout_seconds={timeout_seconds!r} must be > 0 (seconds per collective)")
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed support")
    if dist.is_initialized():
        if backend != "auto" and backend not in _initialized_backends():
            raise ValueError(
                f"torch.distributed is already initialized with backend {dist.get_backend()!r} but "
                f"backend={backend!r} was requested; request 'auto' or the running backend, or "
                "initialize only once"
            )
        install_exit_handler()  # a group the user started: still ours to end cleanly
        return

    chosen = resolve_backend(backend)
    launch = detect_launch_env()
    timeout = timedelta(seconds=timeout_seconds)
    kwargs: dict = {"backend": chosen, "timeout": timeout}
    if chosen == "nccl":
        device = torch.device("cuda", _cuda_index(launch.local_rank))
        # Set before init so NCCL and every later .cuda() use this rank's GPU, not GPU 0.
        torch.cuda.set_device(device)
        kwargs["device_id"] = device

    if launch.source == "torchrun":
        store = _agent_store(launch, timeout)
        if store is not None:
            dist.init_process_group(store=store, rank=launch.rank, world_size=launch.world_size, **kwargs)
        else:
            dist.init_process_group(init_method="env://", **kwargs)
    elif launch.source == "slurm":
        host = f"[{launch.master_addr}]" if ":" in str(launch.master_addr) else launch.master_addr
        dist.init_process_group(init_method=f"tcp://{host}:{launch.master_port}",
                                rank=launch.rank, world_size=launch.world_size, **kwargs)
    else:
        # In-process store: a plain `python train.py` opens no port and cannot collide.
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    install_exit_handler()
