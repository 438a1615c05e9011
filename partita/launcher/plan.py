"""Turn ``partita run`` options plus the environment into torchrun's argument list.

Pure functions: the caller passes in the GPU count, the SLURM allocation, the Kubernetes
operator's layout and the hostfile contents, so every mode is testable without starting a
process. Precedence, strongest first: explicit flags, then ``--hostfile``, then a Kubernetes
PyTorchJob / JobSet pod's environment, then the SLURM allocation, then "this machine only".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from partita.launcher.hostfile import HostfileLayout
from partita.launcher.kubernetes_env import KubernetesLayout
from partita.launcher.slurm import SlurmAllocation

__all__ = ["LaunchPlan", "RunOptions", "build_torchrun_argv", "default_nproc", "resolve_plan"]

DEFAULT_MASTER_PORT = 29500
CPU_DEFAULT_NPROC = 2


@dataclass(frozen=True)
class RunOptions:
    """What the user typed after ``partita run`` (None = not given)."""

    script: str
    script_args: tuple[str, ...] = ()
    nproc: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    hostfile: str | None = None
    max_restarts: int = 0
    module: bool = False
    # Elastic launch by flags: --nnodes MIN:MAX with --rdzv-backend c10d --rdzv-endpoint HOST:PORT.
    min_nnodes: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None


@dataclass(frozen=True)
class LaunchPlan:
    """A fully resolved launch. ``standalone`` means one node with a private rendezvous."""

    script: str
    script_args: tuple[str, ...]
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    max_restarts: int
    module: bool
    standalone: bool = field(default=False)
    # c10d rendezvous (Kubernetes operators): "host:port", and --nnodes MIN:MAX when min < nnodes.
    rdzv_endpoint: str | None = None
    rdzv_backend: str = "static"
    rdzv_id: str | None = None
    rdzv_conf: str | None = None
    min_nnodes: int | None = None


def default_nproc(cuda_device_count: int) -> int:
    """All local GPUs, or two CPU processes on a machine without one (enough to exercise gloo)."""
    return cuda_device_count if cuda_device_count > 0 else CPU_DEFAULT_NPROC


def _check_options(opts: RunOptions) -> None:
    if not opts.script:
        raise ValueError("no training script given: partita run [options] script.py [args...]")
    if not opts.module and not Path(opts.script).is_file():
        raise ValueError(
            f"training script {opts.script!r} does not exist (pass --module to run a module by name)"
        )
    if opts.nproc is not None and opts.nproc < 1:
        raise ValueError(f"--nproc {opts.nproc} must be >= 1 (processes per node)")
    if opts.nnodes is not None and opts.nnodes < 1:
        raise ValueError(f"--nnodes {opts.nnodes} must be >= 1")
    if opts.node_rank is not None and opts.node_rank < 0:
        raise ValueError(f"--node-rank {opts.node_rank} must be >= 0")
    if opts.master_port is not None and not 1 <= opts.master_port <= 65535:
        raise ValueError(f"--master-port {opts.master_port} is not a TCP port (1..65535)")
    if opts.max_restarts < 0:
        raise ValueError(f"--max-restarts {opts.max_restarts} must be >= 0")
    if opts.hostfile is not None and (opts.nnodes is not None or opts.master_addr is not None):
        raise ValueError(
            "--hostfile already gives the node count and master address; drop --nnodes/--master-addr "
            "or drop --hostfile"
        )
    _check_rendezvous(opts)


def _check_rendezvous(opts: RunOptions) -> None:
    elastic = opts.min_nnodes is not None and opts.min_nnodes != opts.nnodes
    if opts.min_nnodes is not None and not 1 <= opts.min_nnodes <= (opts.nnodes or 0):
        raise ValueError(f"--nnodes {opts.min_nnodes}:{opts.nnodes}: need 1 <= MIN <= MAX")
    if opts.rdzv_backend not in (None, "static", "c10d"):
        raise ValueError(f"--rdzv-backend {opts.rdzv_backend!r}: use c10d (elastic) or static")
    if elastic and opts.rdzv_backend != "c10d":
        raise ValueError(
            f"--nnodes {opts.min_nnodes}:{opts.nnodes} (an elastic node count) needs --rdzv-backend c10d "
            "--rdzv-endpoint HOST:PORT; the static rendezvous has a fixed node count"
        )
    if opts.rdzv_backend == "c10d":
        if not opts.rdzv_endpoint or ":" not in opts.rdzv_endpoint:
            raise ValueError(
                f"--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT (the same on every node; the agent on HOST "
                f"serves the rendezvous), got {opts.rdzv_endpoint!r}"
            )
        if opts.node_rank is not None or opts.hostfile is not None or opts.master_addr is not None:
            raise ValueError(
                "--rdzv-backend c10d assigns node ranks itself; drop --node-rank, --master-addr and --hostfile"
            )


def _c10d_plan(opts: RunOptions, *, cuda_device_count: int) -> LaunchPlan:
    """torchrun's c10d rendezvous from flags: nodes may join, leave and be replaced between attempts."""
    nnodes = 1 if opts.nnodes is None else opts.nnodes
    return LaunchPlan(
        script=opts.script, script_args=tuple(opts.script_args),
        nproc_per_node=default_nproc(cuda_device_count) if opts.nproc is None else opts.nproc,
        nnodes=nnodes, node_rank=0, master_addr=None, master_port=None, max_restarts=opts.max_restarts,
        module=opts.module, rdzv_endpoint=opts.rdzv_endpoint, rdzv_backend="c10d", rdzv_id=opts.rdzv_id,
        rdzv_conf=opts.rdzv_conf, min_nnodes=opts.min_nnodes,
    )


def resolve_plan(
    opts: RunOptions,
    *,
    cuda_device_count: int,
    slurm: SlurmAllocation | None = None,
    hostfile: HostfileLayout | None = None,
    kubernetes: KubernetesLayout | None = None,
) -> LaunchPlan:
    """Combine flags with the hostfile / Kubernetes / SLURM layout; ValueError with the fix on bad input."""
    _check_options(opts)
    if opts.rdzv_backend == "c10d":
        return _c10d_plan(opts, cuda_device_count=cuda_device_count)
    if kubernetes is not None and opts.hostfile is None and opts.nnodes is None and opts.master_addr is None:
        return _kubernetes_plan(opts, kubernetes, cuda_device_count=cuda_device_count)
    nnodes, node_rank, addr, port = opts.nnodes, opts.node_rank, opts.master_addr, opts.master_port
    nproc = opts.nproc
    if opts.hostfile is not None and hostfile is None:
        raise ValueError(f"--hostfile {opts.hostfile!r} was given but not read; pass its hostfile_layout()")
    if hostfile is not None:
        if nproc is not None and nproc != hostfile.nproc_per_node:
            raise ValueError(
                f"--nproc {nproc} disagrees with the hostfile's slots={hostfile.nproc_per_node}; "
                "drop --nproc or edit the slots"
            )
        nproc, nnodes, addr = hostfile.nproc_per_node, hostfile.nnodes, hostfile.master_addr
        node_rank = hostfile.node_rank
    elif slurm is not None and nnodes is None and slurm.nnodes > 1:
        nnodes = slurm.nnodes
        node_rank = slurm.node_rank if node_rank is None else node_rank
        addr = slurm.master_addr if addr is None else addr
        port = slurm.master_port if port is None else port

    nproc = default_nproc(cuda_device_count) if nproc is None else nproc
    nnodes = 1 if nnodes is None else nnodes
    common = dict(script=opts.script, script_args=tuple(opts.script_args), nproc_per_node=nproc,
                  nnodes=nnodes, max_restarts=opts.max_restarts, module=opts.module)

    if nnodes == 1 and addr is None and port is None:
        # One node and no address asked for: torchrun picks a free port itself, so two jobs
        # on one machine never collide on 29500.
        if node_rank not in (None, 0):
            raise ValueError(f"--node-rank {node_rank} needs --nnodes > {node_rank}")
        return LaunchPlan(node_rank=0, master_addr=None, master_port=None, standalone=True, **common)

    if nnodes > 1 and addr is None:
        raise ValueError(
            f"--nnodes {nnodes} needs --master-addr (the host of node rank 0), or use --hostfile, "
            "or run under SLURM with `srun --ntasks-per-node=1 partita run ...`"
        )
    if nnodes > 1 and node_rank is None:
        raise ValueError(f"--nnodes {nnodes} needs --node-rank (0..{nnodes - 1}) on every node")
    node_rank = 0 if node_rank is None else node_rank
    if node_rank >= nnodes:
        raise ValueError(f"--node-rank {node_rank} must be < --nnodes {nnodes}")
    return LaunchPlan(node_rank=node_rank, master_addr=addr or "127.0.0.1",
                      master_port=DEFAULT_MASTER_PORT if port is None else port, **common)


def _kubernetes_plan(opts: RunOptions, k8s: KubernetesLayout, *, cuda_device_count: int) -> LaunchPlan:
    """The operator's layout; ``--nproc`` / ``--max-restarts`` given on the command line still win."""
    if opts.nproc is not None and k8s.nproc_per_node is not None and opts.nproc != k8s.nproc_per_node:
        raise ValueError(
            f"--nproc {opts.nproc} disagrees with the {k8s.operator}'s {k8s.nproc_per_node} processes per node; "
            "drop --nproc or change the manifest"
        )
    nproc = opts.nproc or k8s.nproc_per_node or default_nproc(cuda_device_count)
    restarts = opts.max_restarts if opts.max_restarts or k8s.max_restarts is None else k8s.max_restarts
    common = dict(script=opts.script, script_args=tuple(opts.script_args), nproc_per_node=nproc,
                  nnodes=k8s.nnodes, max_restarts=restarts, module=opts.module)
    if k8s.rdzv_endpoint is None:
        return LaunchPlan(node_rank=k8s.node_rank or 0, master_addr=k8s.master_addr,
                          master_port=DEFAULT_MASTER_PORT if k8s.master_port is None else k8s.master_port, **common)
    return LaunchPlan(node_rank=0, master_addr=None, master_port=None, rdzv_endpoint=k8s.rdzv_endpoint,
                      rdzv_backend=k8s.rdzv_backend, rdzv_id=k8s.rdzv_id, rdzv_conf=k8s.rdzv_conf,
                      min_nnodes=k8s.min_nnodes, **common)


def build_torchrun_argv(plan: LaunchPlan) -> list[str]:
    """The argument list for ``torch.distributed.run.main`` (what follows ``torchrun``)."""
    nnodes = f"{plan.min_nnodes}:{plan.nnodes}" if plan.min_nnodes not in (None, plan.nnodes) else f"{plan.nnodes}"
    argv = [f"--nnodes={nnodes}", f"--nproc-per-node={plan.nproc_per_node}"]
    if plan.rdzv_endpoint is not None:
        # c10d: the agent on the endpoint's host serves the store; node ranks come from the
        # rendezvous, so a rescheduled pod with a new IP rejoins under the same endpoint name.
        argv += [f"--rdzv-backend={plan.rdzv_backend}", f"--rdzv-endpoint={plan.rdzv_endpoint}"]
        if plan.rdzv_id is not None:
            argv.append(f"--rdzv-id={plan.rdzv_id}")
        if plan.rdzv_conf is not None:
            argv.append(f"--rdzv-conf={plan.rdzv_conf}")
    elif plan.standalone:
        argv.append("--standalone")
    else:
        # Static rendezvous: fixed node ranks and a master address, as in `deepspeed` / torchrun
        # multi-node docs; no etcd or c10d rendezvous server to run.
        argv += ["--rdzv-backend=static", f"--node-rank={plan.node_rank}",
                 f"--master-addr={plan.master_addr}", f"--master-port={plan.master_port}"]
    argv.append(f"--max-restarts={plan.max_restarts}")
    if plan.module:
        argv.append("--module")
    argv.append(plan.script)
    argv.extend(plan.script_args)
    return argv
