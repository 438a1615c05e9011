"""Read a Kubernetes pod's environment for ``partita run``: Kubeflow PyTorchJob or JobSet.

Both operators start one pod per node; ``partita run`` in each pod then starts that node's
workers through torchrun. What each operator tells the pod:

- **Kubeflow PyTorchJob** (training-operator). With ``elasticPolicy`` (what
  ``partita k8s pytorchjob`` writes) the operator sets torchrun's own ``PET_*`` variables:
  ``PET_RDZV_ENDPOINT`` (``<job>-worker-0:<port>``), ``PET_RDZV_BACKEND`` (c10d by default),
  ``PET_NNODES`` (``N`` or ``MIN:MAX``), ``PET_NPROC_PER_NODE``, ``PET_MAX_RESTARTS``,
  ``PET_RDZV_ID``. With a Master replica and no elastic policy it sets ``MASTER_ADDR``,
  ``MASTER_PORT``, ``WORLD_SIZE`` (the number of *pods*) and ``RANK`` (the pod's index), and
  newer operators also ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, ``PET_NNODES``,
  ``PET_NODE_RANK``: a static rendezvous.
- **JobSet** (``jobset.x-k8s.io``). The controller labels and annotates every pod with
  ``jobset.sigs.k8s.io/jobset-name``, ``replicatedjob-name``, ``job-index`` and
  ``replicatedjob-replicas``; ``partita k8s jobset`` exposes them as ``JOBSET_NAME``,
  ``REPLICATED_JOB_NAME``, ``JOB_INDEX`` and ``REPLICATED_JOB_REPLICAS`` through the
  downward API (recent JobSet versions inject the same names themselves). The layout is one
  pod per Job, so a node's rank is its Job index and the node count is the number of Jobs.
  Pod hostnames come from JobSet's headless service,
  ``<jobset>-<replicated job>-<job index>-<pod index>.<subdomain>``; the subdomain is the
  JobSet's name unless ``JOBSET_SUBDOMAIN`` says otherwise. The rendezvous endpoint is the
  first pod, port ``PARTITA_RDZV_PORT`` (default 29400).

Both use torchrun's c10d rendezvous (an agent-hosted store, no etcd), so node ranks are
assigned by the rendezvous and a replacement pod can rejoin. Pure functions of a mapping,
like :mod:`partita.launcher.slurm`, so every case is testable without a cluster.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DEFAULT_RDZV_PORT", "KubernetesLayout", "kubernetes_layout"]

DEFAULT_RDZV_PORT = 29400  # torchrun's documented c10d port


@dataclass(frozen=True)
class KubernetesLayout:
    """What the operator's environment says about this node.

    ``rdzv_endpoint`` set means a c10d rendezvous (``min_nnodes:nnodes`` nodes, node ranks
    assigned by the rendezvous); otherwise ``master_addr``/``node_rank`` are a static one.
    ``nproc_per_node`` None means "not given" (partita's default applies); ``max_restarts``
    None likewise.
    """

    operator: str  # "pytorchjob" or "jobset"
    nnodes: int
    min_nnodes: int
    nproc_per_node: int | None
    node_rank: int | None
    master_addr: str | None
    master_port: int | None
    rdzv_endpoint: str | None
    rdzv_backend: str
    rdzv_id: str | None
    rdzv_conf: str | None
    max_restarts: int | None


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    text = env[name]
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer (set by the Kubernetes operator or the manifest)") from None
    if value < minimum:
        raise ValueError(f"{name}={text!r} must be >= {minimum}")
    return value


def _nnodes(env: Mapping[str, str], name: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (torchrun's --nnodes syntax) as (min, max)."""
    text = env[name]
    low, sep, high = text.partition(":")
    try:
        lo, hi = (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise ValueError(f"{name}={text!r} is neither N nor MIN:MAX (torchrun's --nnodes forms)") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"{name}={text!r} needs 1 <= MIN <= MAX")
    return lo, hi


def _nproc(env: Mapping[str, str], name: str, cuda_device_count: int) -> int | None:
    """torchrun's --nproc-per-node forms: an integer, "gpu", "cpu" or "auto" (None: partita's default)."""
    text = env.get(name)
    if not text or text == "auto":
        return None
    if text == "gpu":
        if cuda_device_count < 1:
            raise ValueError(f"{name}=gpu but this pod sees no GPU; request nvidia.com/gpu in the pod's resources")
        return cuda_device_count
    if text == "cpu":
        return os.cpu_count() or 1
    return _int(env, name, minimum=1)


def _pytorchjob(env: Mapping[str, str], cuda_device_count: int) -> KubernetesLayout:
    nproc = _nproc(env, "PET_NPROC_PER_NODE", cuda_device_count)
    restarts = _int(env, "PET_MAX_RESTARTS") if env.get("PET_MAX_RESTARTS") else None
    if env.get("PET_RDZV_ENDPOINT"):
        if not env.get("PET_NNODES"):
            raise ValueError("PET_RDZV_ENDPOINT is set but PET_NNODES is not; the PyTorchJob needs a Worker replica count")
        low, high = _nnodes(env, "PET_NNODES")
        return KubernetesLayout(
            operator="pytorchjob", nnodes=high, min_nnodes=low, nproc_per_node=nproc, node_rank=None,
            master_addr=None, master_port=None, rdzv_endpoint=env["PET_RDZV_ENDPOINT"],
            rdzv_backend=env.get("PET_RDZV_BACKEND") or "c10d", rdzv_id=env.get("PET_RDZV_ID") or None,
            rdzv_conf=env.get("PET_RDZV_CONF") or None, max_restarts=restarts,
        )
    # Static rendezvous: the Master replica is node 0. PET_* first (they count nodes), then the
    # operator's older MASTER_ADDR / WORLD_SIZE / RANK, which count pods: one pod per node.
    addr = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR")
    port_name = "PET_MASTER_PORT" if env.get("PET_MASTER_PORT") else "MASTER_PORT"
    nodes_name = "PET_NNODES" if env.get("PET_NNODES") else "WORLD_SIZE"
    rank_name = "PET_NODE_RANK" if env.get("PET_NODE_RANK") else "RANK"
    missing = [n for n in (nodes_name, rank_name) if not env.get(n)] + ([] if addr else ["PET_MASTER_ADDR"])
    if missing:
        raise ValueError(
            f"this PyTorchJob pod lacks {', '.join(missing)}; give the job a Master replica or an elasticPolicy "
            "(partita k8s pytorchjob writes one), or pass --nnodes/--node-rank/--master-addr"
        )
    low, high = _nnodes(env, nodes_name)
    if low != high:
        raise ValueError(f"{nodes_name}={env[nodes_name]!r}: a range of nodes needs an elasticPolicy (c10d rendezvous)")
    rank = _int(env, rank_name)
    if rank >= high:
        raise ValueError(f"{rank_name}={rank} must be < {nodes_name}={high}")
    return KubernetesLayout(
        operator="pytorchjob", nnodes=high, min_nnodes=high, nproc_per_node=nproc, node_rank=rank,
        master_addr=addr, master_port=_int(env, port_name, minimum=1) if env.get(port_name) else None,
        rdzv_endpoint=None, rdzv_backend="static", rdzv_id=None, rdzv_conf=None, max_restarts=restarts,
    )


def _jobset(env: Mapping[str, str], cuda_device_count: int) -> KubernetesLayout:
    missing = [n for n in ("REPLICATED_JOB_NAME", "JOB_INDEX", "REPLICATED_JOB_REPLICAS") if not env.get(n)]
    if missing:
        raise ValueError(
            f"JOBSET_NAME is set but {', '.join(missing)} are not; expose the pod's jobset.sigs.k8s.io annotations "
            "as environment variables (partita k8s jobset writes them), or pass --nnodes/--node-rank/--master-addr"
        )
    if env.get("JOB_COMPLETION_INDEX") not in (None, "", "0"):
        raise ValueError(
            f"JOB_COMPLETION_INDEX={env['JOB_COMPLETION_INDEX']}: partita reads a JobSet with one pod per Job "
            "(replicas = nodes, completions = parallelism = 1, as partita k8s jobset writes); for several pods per "
            "Job pass --nnodes/--node-rank/--master-addr"
        )
    nnodes = _int(env, "REPLICATED_JOB_REPLICAS", minimum=1)
    rank = _int(env, "JOB_INDEX")
    if rank >= nnodes:
        raise ValueError(f"JOB_INDEX={rank} must be < REPLICATED_JOB_REPLICAS={nnodes}")
    name, job = env["JOBSET_NAME"], env["REPLICATED_JOB_NAME"]
    subdomain = env.get("JOBSET_SUBDOMAIN") or name  # JobSet's default headless service name
    port = _int(env, "PARTITA_RDZV_PORT", minimum=1) if env.get("PARTITA_RDZV_PORT") else DEFAULT_RDZV_PORT
    return KubernetesLayout(
        operator="jobset", nnodes=nnodes, min_nnodes=nnodes,
        nproc_per_node=_nproc(env, "PARTITA_NPROC_PER_NODE", cuda_device_count), node_rank=rank,
        master_addr=None, master_port=None, rdzv_endpoint=f"{name}-{job}-0-0.{subdomain}:{port}",
        rdzv_backend="c10d", rdzv_id=name, rdzv_conf=None, max_restarts=None,
    )


def kubernetes_layout(environ: Mapping[str, str] | None = None, *, cuda_device_count: int = 0) -> KubernetesLayout | None:
    """This pod's layout under a PyTorchJob or a JobSet, or None elsewhere.

    "Under a PyTorchJob": a ``PET_*`` layout variable is set, or (older operators) the pod
    is in Kubernetes (``KUBERNETES_SERVICE_HOST``) with ``MASTER_ADDR``, ``WORLD_SIZE`` and
    ``RANK``. "Under a JobSet": ``JOBSET_NAME`` is set. Raises ValueError naming the variable
    for a value that cannot be read.
    """
    env = os.environ if environ is None else environ
    if any(env.get(n) for n in ("PET_RDZV_ENDPOINT", "PET_NNODES", "PET_MASTER_ADDR", "PET_NODE_RANK")):
        return _pytorchjob(env, cuda_device_count)
    if env.get("JOBSET_NAME"):
        return _jobset(env, cuda_device_count)
    if env.get("KUBERNETES_SERVICE_HOST") and all(env.get(n) for n in ("MASTER_ADDR", "WORLD_SIZE", "RANK")):
        return _pytorchjob(env, cuda_device_count)
    return None
