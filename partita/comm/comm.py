"""DeepSpeed's ``deepspeed.comm`` calls over ``torch.distributed``, with DeepSpeed's signatures.

Why a facade and not "use torch.distributed": DeepSpeed scripts write ``import deepspeed.comm
as dist`` and call ``dist.get_rank()``, ``dist.all_reduce(t)``, ``dist.barrier()`` with
DeepSpeed's argument names (``prof``, ``log_name`` ...); with ``import partita as deepspeed``
those calls must land somewhere. Each one is torch's call with the same meaning. The four
collectives partita's comms logger knows (all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, broadcast) are recorded by it when ``comms_logger`` is enabled, like
partita's own; a failing collective raises :class:`partita.distributed.collective_errors.CollectiveError`
naming the call. DeepSpeed's per-call ``prof`` / ``log_name`` / ``debug`` keywords are accepted
and have no effect (the comms_logger section decides what is recorded).

:func:`init_distributed` starts the default process group: from the launcher's environment
through :func:`partita.distributed.init.init_distributed` (torchrun / ``partita run``, SLURM,
or a world of one), or from an explicit ``init_method`` / ``rank`` / ``world_size``.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from partita.distributed.collective_errors import explain_collective_failure

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "configure",
    "destroy_process_group",
    "gather",
    "get_all_ranks_from_group",
    "get_backend",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "inference_all_reduce",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]

logger = logging.getLogger("partita")

DEFAULT_TIMEOUT = timedelta(minutes=30)  # DeepSpeed's default_pg_timeout
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
_BACKENDS = {None: "auto", "nccl": "nccl", "gloo": "gloo"}
# Variables mpirun / MPICH / MVAPICH set in every process; torchrun's RANK is then absent.
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


# ---------------------------------------------------------------------------- start-up


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    verbose: bool = True,
    timeout: timedelta = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Start torch.distributed as DeepSpeed's ``init_distributed`` does; a no-op when it runs already.

    Args:
        dist_backend: "nccl", "gloo", or None (nccl with CUDA, else gloo). DeepSpeed's other
            backends (ccl, mpi, hccl) are refused: partita runs on NCCL or gloo.
        auto_mpi_discovery: DeepSpeed finds ranks through mpi4py under ``mpirun``. partita does
            not: started by mpirun without torchrun's variables it raises NotImplementedError
            instead of silently running every process as a world of one.
        distributed_port: used by DeepSpeed only for MPI discovery; accepted, no effect here.
        verbose: log the start on rank 0.
        timeout: the timeout of every collective (a ``timedelta``, DeepSpeed's default 30 minutes).
        init_method, rank, world_size: an explicit rendezvous (``"tcp://host:port"``,
            ``"file:///path"``, or ``"env://"``), as torch's ``init_process_group`` takes them.
            Without them the launcher's environment decides (torchrun, SLURM, or a world of one).
        dist_init_required: False leaves torch.distributed alone (DeepSpeed's meaning).
        config: a DeepSpeed-style config (dict or path) whose ``comms_logger`` section is applied now.
    """
    if dist_backend not in _BACKENDS:
        raise ValueError(
            f"init_distributed(dist_backend={dist_backend!r}): partita runs on 'nccl' (GPUs) or 'gloo' (CPUs); "
            "pass one of those or None for the device's default"
        )
    if not isinstance(timeout, timedelta):
        raise ValueError(f"init_distributed(timeout={timeout!r}) needs a datetime.timedelta, e.g. timedelta(minutes=30)")
    if config is not None:
        configure(deepspeed_config=config)
    if dist_init_required is False:
        return
    backend = _BACKENDS[dist_backend]
    from partita.distributed import init as partita_init

    explicit = init_method is not None or rank >= 0 or world_size >= 0
    if dist.is_initialized() or not explicit:
        if not dist.is_initialized() and auto_mpi_discovery:
            _refuse_bare_mpirun()
        partita_init.init_distributed(backend=backend, timeout_seconds=timeout.total_seconds())
    else:
        _init_explicit(backend, timeout, init_method, rank, world_size)
    if verbose and dist.get_rank() == 0:
        logger.info("torch.distributed is up: backend %s, world size %d", dist.get_backend(), dist.get_world_size())


def _refuse_bare_mpirun() -> None:
    if os.environ.get("RANK") or os.environ.get("SLURM_PROCID"):
        return
    sizes = {name: os.environ[name] for name in _MPI_SIZE_VARS if os.environ.get(name, "").isdigit()}
    if any(int(size) > 1 for size in sizes.values()):
        found = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise NotImplementedError(
            f"this process was started by an MPI launcher ({found}) without torchrun's RANK/WORLD_SIZE: DeepSpeed's "
            "MPI discovery (init_distributed(auto_mpi_discovery=True), through mpi4py) is not implemented in partita. "
            "Launch with `partita run` / torchrun or srun, or pass init_distributed(init_method='tcp://HOST:PORT', "
            "rank=..., world_size=...)"
        )


def _init_explicit(backend: str, timeout: timedelta, init_method: str | None, rank: int, world_size: int) -> None:
    from partita.distributed import init as partita_init

    method = init_method or "env://"
    if method != "env://" and (rank < 0 or world_size < 1):
        raise ValueError(
            f"init_distributed(init_method={method!r}) needs rank= and world_size= too (got rank={rank}, "
            f"world_size={world_size}); only 'env://' reads them from RANK and WORLD_SIZE"
        )
    chosen = partita_init.resolve_backend(backend)
    kwargs: dict[str, Any] = {"backend": chosen, "init_method": method, "timeout": timeout}
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size >= 0:
        kwargs["world_size"] = world_size
    if chosen == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank if rank >= 0 else 0))
        device = torch.device("cuda", local % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)  # before init, so NCCL uses this rank's GPU
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)


def configure(
    deepspeed_config: Any = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """Set up the comms logger from a config's ``comms_logger`` section and/or the keywords given."""
    from partita.monitor.comms_logger import COMMS_LOGGER
    from partita.monitor.config import CommsLoggerConfig

    if deepspeed_config is not None:
        from partita.config import load_config

        section = load_config(deepspeed_config).comms_logger
    else:
        section = CommsLoggerConfig()
    overrides = {k: v for k, v in dict(enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose, debug=debug).items()
                 if v is not None}
    if overrides:
        section = CommsLoggerConfig(**{**section.model_dump(), **overrides})
    COMMS_LOGGER.configure(section)


def log_summary(show_straggler: bool = False) -> str:
    """Log (rank 0) and return the comms logger's table (needs the comms logger enabled)."""
    from partita.monitor.comms_logger import COMMS_LOGGER

    text = COMMS_LOGGER.summary().format()
    if get_rank() == 0:
        logger.info("%s", text)
    return text


# ---------------------------------------------------------------------------- queries


def _require_init(call: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            f"partita.comm.{call}() needs torch.distributed to be running: call partita.init_distributed() "
            "or partita.initialize(...) first"
        )


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group: Any = None) -> int:
    _require_init("get_rank")
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    _require_init("get_world_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's index on its node, from the launcher (LOCAL_RANK, SLURM_LOCALID), else 0."""
    from partita.distributed.init import local_rank

    return local_rank()


def get_global_rank(group: Any, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


def get_world_group() -> Any:
    _require_init("get_world_group")
    return dist.group.WORLD


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def get_backend(group: Any = None) -> str:
    return dist.get_backend(group)


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
    return dist.new_group(ranks, **kwargs)


def destroy_process_group(group: Any = None) -> None:
    dist.destroy_process_group(group)


# ---------------------------------------------------------------------------- collectives


def _logged(op: str, tensor: torch.Tensor, nbytes: int, group: Any, run) -> Any:
    """Run a collective the comms logger knows, recorded under ``op`` when it is enabled."""
    from partita.monitor.comms_logger import COMMS_LOGGER

    purpose = f"partita.comm.{op} (user code)"
    token = COMMS_LOGGER.start(op, nbytes, tensor, group, purpose)
    with explain_collective_failure(purpose):
        work = run()
    COMMS_LOGGER.finish(token, work)
    return work


def _plain(op: str, run) -> Any:
    with explain_collective_failure(f"partita.comm.{op}"):
        return run()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_reduce", debug: Any = None) -> Any:
    """Reduce ``tensor`` over ``group`` in place (sum by default)."""
    return _logged("all_reduce", tensor, _nbytes(tensor), group,
                   lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
                         prof: bool = False, log_name: str = "inference_all_reduce", debug: Any = None) -> Any:
    """DeepSpeed's shared-memory all-reduce for inference; here the ordinary one."""
    return all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False,
                           prof: bool = False, log_name: str = "all_gather_into_tensor", debug: Any = None) -> Any:
    """Concatenate every rank's ``tensor`` into ``output_tensor`` (rank order)."""
    return _logged("all_gather_into_tensor", output_tensor, _nbytes(output_tensor), group,
                   lambda: dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op))


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
                          async_op: bool = False, prof: bool = False, log_name: str = "reduce_scatter_tensor",
                          debug: Any = None) -> Any:
    """Reduce ``tensor`` over ``group``; rank r keeps chunk r in ``output_tensor``."""
    return _logged("reduce_scatter_tensor", tensor, _nbytes(tensor), group,
                   lambda: dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op))


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False,
              prof: bool = False, log_name: str = "broadcast", debug: Any = None) -> Any:
    """Copy global rank ``src``'s ``tensor`` to every rank of ``group``."""
    return _logged("broadcast", tensor, _nbytes(tensor), group,
                   lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op))


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_gather", debug: Any = None) -> Any:
    return _plain("all_gather", lambda: dist.all_gather(tensor_list, tensor, group=group, async_op=async_op))


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False, prof: bool = False, log_name: str = "reduce_scatter", debug: Any = None) -> Any:
    return _plain("reduce_scatter", lambda: dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op))


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False,
                      prof: bool = False, log_name: str = "all_to_all_single", debug: Any = None) -> Any:
    return _plain("all_to_all_single", lambda: dist.all_to_all_single(
        output, tensor, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
        group=group, async_op=async_op))


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
           prof: bool = False, log_name: str = "reduce", debug: Any = None) -> Any:
    return _plain("reduce", lambda: dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op))


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, group: Any = None,
           async_op: bool = False, prof: bool = False, log_name: str = "gather", debug: Any = None) -> Any:
    return _plain("gather", lambda: dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op))


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, group: Any = None,
            async_op: bool = False, prof: bool = False, log_name: str = "scatter", debug: Any = None) -> Any:
    return _plain("scatter", lambda: dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op))


def barrier(group: Any = None, async_op: bool = False, device_ids: list[int] | None = None,
            prof: bool = False, log_name: str = "barrier", debug: Any = None) -> Any:
    return _plain("barrier", lambda: dist.barrier(group=group, async_op=async_op, device_ids=device_ids))


def monitored_barrier(group: Any = None, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> Any:
    return _plain("monitored_barrier", lambda: dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks))


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "send", debug: Any = None) -> None:
    _plain("send", lambda: dist.send(tensor, dst=dst, group=group, tag=tag))


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "recv", debug: Any = None) -> int:
    return _plain("recv", lambda: dist.recv(tensor, src=src, group=group, tag=tag))


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
          log_name: str = "isend", debug: Any = None) -> Any:
    return _plain("isend", lambda: dist.isend(tensor, dst=dst, group=group, tag=tag))


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, prof: bool = False,
          log_name: str = "irecv", debug: Any = None) -> Any:
    return _plain("irecv", lambda: dist.irecv(tensor, src=src, group=group, tag=tag))


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None) -> None:
    _plain("broadcast_object_list", lambda: dist.broadcast_object_list(object_list, src=src, group=group, device=device))


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    _plain("all_gather_object", lambda: dist.all_gather_object(object_list, obj, group=group))
