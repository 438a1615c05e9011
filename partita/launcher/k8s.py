"""``partita k8s``: Kubernetes manifests for a multi-node partita job.

Two operators, one pod per node, each pod running ``partita run`` (which reads the
operator's environment, :mod:`partita.launcher.kubernetes_env`, and starts torchrun with a
c10d rendezvous):

- ``pytorchjob``: a Kubeflow training-operator ``PyTorchJob`` (``kubeflow.org/v1``) with an
  ``elasticPolicy`` and Worker replicas only. The operator points every pod at
  ``<name>-worker-0:<port>`` (``PET_RDZV_ENDPOINT``) and sets the node count; with
  ``--min-nnodes`` the job keeps training on fewer nodes when one is lost.
- ``jobset``: a ``JobSet`` (``jobset.x-k8s.io/v1alpha2``) of ``nnodes`` one-pod Indexed
  Jobs; the JobSet controller creates the headless service that gives each pod the stable
  name ``<name>-node-<i>-0.<name>``, and restarts every Job together on a failure.

Both mount a shared PersistentVolumeClaim for checkpoints (``ReadWriteMany``: every node
writes its shards, and a rescheduled pod reads them back), ``/dev/shm`` from memory (NCCL
and data-loader workers need more than the container's 64 MiB default), request GPUs as
``nvidia.com/gpu``, and set ``terminationGracePeriodSeconds`` so that the SIGTERM a
preempted pod receives leaves time to finish the step and save a checkpoint before the
kubelet's SIGKILL.

Manifests are plain dicts; YAML is written with PyYAML when it is installed and as JSON
otherwise (JSON is valid YAML, and ``kubectl apply -f`` reads both).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from partita.launcher.kubernetes_env import DEFAULT_RDZV_PORT

__all__ = ["K8sJob", "add_k8s_parser", "jobset_manifests", "pytorchjob_manifests", "render_yaml", "run_k8s_command"]

# Default time between SIGTERM and SIGKILL. Kubernetes' own default is 30 s, too short for a
# checkpoint of a large model. On SIGTERM partita finishes the step, saves, and exits (code 200)
# within checkpoint.signal_save_deadline_seconds (default 60); the grace period must be longer,
# or the kubelet's SIGKILL cuts the save short. --config checks it.
DEFAULT_GRACE_PERIOD_S = 300
CONTAINER = "pytorch"  # the PyTorchJob operator finds its port on the container of this name
PYTORCHJOB_PORT_NAME = "pytorchjob-port"  # ... and on the port of this name
_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
_RESTART_POLICIES = ("OnFailure", "ExitCode", "Never")


@dataclass(frozen=True)
class K8sJob:
    """What the manifests describe. ``nproc_per_node`` None: one process per requested GPU."""

    name: str
    image: str
    script: str
    script_args: tuple[str, ...] = ()
    module: bool = False
    nnodes: int = 1
    min_nnodes: int | None = None
    gpus_per_node: int = 1
    nproc_per_node: int | None = None
    cpu: str | None = None
    memory: str | None = None
    pvc: str | None = None
    pvc_size: str = "100Gi"
    storage_class: str | None = None
    checkpoint_dir: str = "/checkpoints"
    shm_size: str | None = None
    grace_period_s: int = DEFAULT_GRACE_PERIOD_S
    max_restarts: int = 3
    restart_policy: str = "ExitCode"
    rdzv_port: int = DEFAULT_RDZV_PORT
    namespace: str | None = None
    env: tuple[tuple[str, str], ...] = field(default=())

    @property
    def nproc(self) -> int:
        return self.nproc_per_node if self.nproc_per_node is not None else max(self.gpus_per_node, 1)

    @property
    def claim_name(self) -> str:
        return self.pvc or f"{self.name}-checkpoints"


def _check(job: K8sJob, *, kind: str) -> None:
    if len(job.name) > 63 or not _DNS1035.fullmatch(job.name):
        raise ValueError(
            f"--name {job.name!r} must be a DNS-1035 label (lowercase letters, digits and '-', starting with a "
            "letter, ending with a letter or digit, at most 63 characters), e.g. 'gpt-1b'"
        )
    longest_host = f"{job.name}-worker-{job.nnodes - 1}" if kind == "pytorchjob" else f"{job.name}-node-{job.nnodes - 1}-0"
    if len(longest_host) > 63:
        raise ValueError(f"--name {job.name!r} is too long: pod hostname {longest_host!r} exceeds 63 characters")
    if not job.image:
        raise ValueError("--image is empty; give the container image that has partita and the training script")
    if job.nnodes < 1:
        raise ValueError(f"--nnodes {job.nnodes} must be >= 1")
    if job.min_nnodes is not None:
        if kind != "pytorchjob":
            raise ValueError("--min-nnodes needs an elastic operator: use 'partita k8s pytorchjob' (a JobSet has a fixed size)")
        if not 1 <= job.min_nnodes <= job.nnodes:
            raise ValueError(f"--min-nnodes {job.min_nnodes} must be in [1, --nnodes {job.nnodes}]")
    if job.gpus_per_node < 0:
        raise ValueError(f"--gpus {job.gpus_per_node} must be >= 0 (GPUs per pod)")
    if job.nproc_per_node is not None and job.nproc_per_node < 1:
        raise ValueError(f"--nproc {job.nproc_per_node} must be >= 1")
    if job.gpus_per_node and job.nproc_per_node not in (None, job.gpus_per_node):
        raise ValueError(
            f"--nproc {job.nproc_per_node} with --gpus {job.gpus_per_node}: partita runs one process per GPU; "
            "drop --nproc or make them equal"
        )
    for flag, value in (("--cpu", job.cpu), ("--memory", job.memory), ("--pvc-size", job.pvc_size),
                        ("--shm-size", job.shm_size)):
        if value is not None and not _QUANTITY.fullmatch(value):
            raise ValueError(f"{flag} {value!r} is not a Kubernetes quantity (e.g. 8, 500m, 64Gi)")
    if job.grace_period_s < 1:
        raise ValueError(f"--grace-period {job.grace_period_s} must be >= 1 second")
    if job.max_restarts < 0:
        raise ValueError(f"--max-restarts {job.max_restarts} must be >= 0")
    if job.restart_policy not in _RESTART_POLICIES:
        raise ValueError(f"--restart-policy {job.restart_policy!r} must be one of {', '.join(_RESTART_POLICIES)}")
    if not 1 <= job.rdzv_port <= 65535:
        raise ValueError(f"--rdzv-port {job.rdzv_port} is not a TCP port (1..65535)")
    if not job.checkpoint_dir.startswith("/"):
        raise ValueError(f"--checkpoint-dir {job.checkpoint_dir!r} must be an absolute path in the container")


def _labels(job: K8sJob) -> dict[str, str]:
    return {"app.kubernetes.io/name": job.name, "app.kubernetes.io/component": "partita-training"}


def _metadata(job: K8sJob, name: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name or job.name, "labels": _labels(job)}
    if job.namespace:
        meta["namespace"] = job.namespace
    return meta


def _command(job: K8sJob) -> list[str]:
    argv = ["partita", "run", "--nproc", str(job.nproc)]
    if job.module:
        argv.append("--module")
    return argv + [job.script, *job.script_args]


def _container(job: K8sJob, *, port_name: str, env: list[dict[str, Any]]) -> dict[str, Any]:
    resources: dict[str, dict[str, str]] = {}
    if job.gpus_per_node:
        # Extended resources are requested through limits (requests default to them).
        resources["limits"] = {"nvidia.com/gpu": str(job.gpus_per_node)}
    requests = {k: v for k, v in (("cpu", job.cpu), ("memory", job.memory)) if v is not None}
    if requests:
        resources["requests"] = requests
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": job.image,
        "command": _command(job),
        "env": env + [{"name": k, "value": v} for k, v in job.env],
        "ports": [{"name": port_name, "containerPort": job.rdzv_port, "protocol": "TCP"}],
        "volumeMounts": [
            {"name": "checkpoints", "mountPath": job.checkpoint_dir},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    if resources:
        container["resources"] = resources
    return container


def _pod_spec(job: K8sJob, container: dict[str, Any], *, restart_policy: str) -> dict[str, Any]:
    shm: dict[str, Any] = {"medium": "Memory"}
    if job.shm_size:
        shm["sizeLimit"] = job.shm_size
    return {
        "restartPolicy": restart_policy,
        # SIGTERM first, SIGKILL after this: the time partita has to finish the step and save.
        "terminationGracePeriodSeconds": job.grace_period_s,
        "containers": [container],
        "volumes": [
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": job.claim_name}},
            {"name": "dshm", "emptyDir": shm},
        ],
    }


def _claim(job: K8sJob) -> list[dict[str, Any]]:
    """A ReadWriteMany claim for the checkpoints, unless --pvc names an existing one."""
    if job.pvc is not None:
        return []
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": job.pvc_size}}}
    if job.storage_class:
        spec["storageClassName"] = job.storage_class
    return [{"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _metadata(job, job.claim_name),
             "spec": spec}]


def pytorchjob_manifests(job: K8sJob) -> list[dict[str, Any]]:
    """A checkpoint claim (unless --pvc) and a Kubeflow PyTorchJob with an elastic c10d policy."""
    _check(job, kind="pytorchjob")
    container = _container(job, port_name=PYTORCHJOB_PORT_NAME, env=[])
    # ExitCode (default): the operator recreates a pod that exited 128-255 (killed by a signal,
    # or partita's preemption exits 200-202) and fails the job on 1-127 (a bug would only fail
    # again); OnFailure restarts the container on any non-zero exit.
    pod_restart = "OnFailure" if job.restart_policy == "OnFailure" else "Never"
    worker = {
        "replicas": job.nnodes,
        "restartPolicy": job.restart_policy,
        "template": {"metadata": {"labels": _labels(job)},
                     "spec": _pod_spec(job, container, restart_policy=pod_restart)},
    }
    body = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(job),
        "spec": {
            "nprocPerNode": str(job.nproc),
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "rdzvPort": job.rdzv_port,
                "rdzvId": job.name,
                "minReplicas": job.min_nnodes or job.nnodes,
                "maxReplicas": job.nnodes,
                # torchrun's --max-restarts: worker processes restarted in place.
                "maxRestarts": job.max_restarts,
            },
            "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": job.max_restarts},
            "pytorchReplicaSpecs": {"Worker": worker},
        },
    }
    return _claim(job) + [body]


def _downward(name: str, annotation: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{annotation}']"}}}


def jobset_manifests(job: K8sJob) -> list[dict[str, Any]]:
    """A checkpoint claim (unless --pvc) and a JobSet of ``nnodes`` one-pod Indexed Jobs."""
    _check(job, kind="jobset")
    env = [
        _downward("JOBSET_NAME", "jobset.sigs.k8s.io/jobset-name"),
        _downward("REPLICATED_JOB_NAME", "jobset.sigs.k8s.io/replicatedjob-name"),
        _downward("JOB_INDEX", "jobset.sigs.k8s.io/job-index"),
        _downward("REPLICATED_JOB_REPLICAS", "jobset.sigs.k8s.io/replicatedjob-replicas"),
        {"name": "JOBSET_SUBDOMAIN", "value": job.name},
        {"name": "PARTITA_RDZV_PORT", "value": str(job.rdzv_port)},
    ]
    container = _container(job, port_name="rdzv", env=env)
    node_job = {
        "parallelism": 1,
        "completions": 1,
        "completionMode": "Indexed",
        # A failed pod fails its Job at once; the JobSet then recreates every Job (failurePolicy),
        # and the new pods rendezvous afresh and resume from the newest checkpoint.
        "backoffLimit": 0,
        "template": {"metadata": {"labels": _labels(job)},
                     "spec": _pod_spec(job, container, restart_policy="Never")},
    }
    body = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": _metadata(job),
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": job.name, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": job.max_restarts},
            "replicatedJobs": [{"name": "node", "replicas": job.nnodes, "template": {"spec": node_job}}],
        },
    }
    return _claim(job) + [body]


def render_yaml(documents: Sequence[dict[str, Any]]) -> str:
    """Multi-document YAML (PyYAML when installed, else JSON documents, which are valid YAML)."""
    try:
        import yaml
    except ImportError:
        return "---\n".join(json.dumps(doc, indent=2) + "\n" for doc in documents)
    return "---\n".join(yaml.safe_dump(doc, sort_keys=False, default_flow_style=False) for doc in documents)


_EPILOG = """\
examples:
  partita k8s pytorchjob --name gpt-1b --image registry.example/gpt:1 --nnodes 4 --gpus 8 \\
      train.py --config ds.json > job.yaml && kubectl apply -f job.yaml
  partita k8s jobset --name gpt-1b --image registry.example/gpt:1 --nnodes 4 --gpus 8 --pvc shared-ckpt \\
      -o jobset.yaml train.py --config ds.json

Set the config's checkpoint.save_dir below --checkpoint-dir (default /checkpoints) so that a rescheduled
pod resumes from the shared volume.
"""


def add_k8s_parser(commands: Any) -> None:
    """Add the ``k8s`` subcommand to the ``partita`` parser's subparsers."""
    p = commands.add_parser(
        "k8s", help="write Kubernetes manifests (Kubeflow PyTorchJob or JobSet) that run partita on N nodes",
        description="Write Kubernetes manifests for a multi-node partita job: one pod per node, torchrun's c10d "
                    "rendezvous, a restart policy, a shared checkpoint volume and a termination grace period.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("kind", choices=("pytorchjob", "jobset"), help="the operator that runs the pods")
    p.add_argument("--name", required=True, help="job name (DNS-1035 label)")
    p.add_argument("--image", required=True, help="container image with partita and the training script")
    p.add_argument("--namespace", default=None)
    p.add_argument("--nnodes", type=int, default=1, help="pods (nodes); default 1")
    p.add_argument("--min-nnodes", type=int, default=None, help="pytorchjob: keep training on at least this many")
    p.add_argument("--gpus", type=int, default=1, help="nvidia.com/gpu per pod (default 1; 0 for CPU pods)")
    p.add_argument("--nproc", type=int, default=None, help="processes per pod (default: one per GPU)")
    p.add_argument("--cpu", default=None, help="CPU request per pod, e.g. 32")
    p.add_argument("--memory", default=None, help="memory request per pod, e.g. 512Gi")
    p.add_argument("--pvc", default=None, help="existing ReadWriteMany claim for checkpoints (default: write one)")
    p.add_argument("--pvc-size", default="100Gi", help="size of the claim written without --pvc (default 100Gi)")
    p.add_argument("--storage-class", default=None, help="storage class of the written claim")
    p.add_argument("--checkpoint-dir", default="/checkpoints", help="where the claim is mounted (default /checkpoints)")
    p.add_argument("--shm-size", default=None, help="size limit of the in-memory /dev/shm (default: none)")
    p.add_argument("--grace-period", type=int, default=DEFAULT_GRACE_PERIOD_S,
                   help=f"seconds between SIGTERM and SIGKILL, time for the preemption save (default {DEFAULT_GRACE_PERIOD_S})")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts before the job fails (default 3)")
    p.add_argument("--restart-policy", choices=_RESTART_POLICIES, default="ExitCode",
                   help="pytorchjob replica restart policy (default ExitCode: retry exits 128-255, fail on 1-127)")
    p.add_argument("--config", default=None,
                   help="the training config: check --grace-period against its checkpoint save deadline")
    p.add_argument("--rdzv-port", type=int, default=DEFAULT_RDZV_PORT, help=f"c10d port (default {DEFAULT_RDZV_PORT})")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra container variable")
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module")
    p.add_argument("-o", "--output", default=None, help="write the YAML here instead of stdout")
    p.add_argument("script", help="training script inside the image (or module with --module)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def check_grace_period(grace_period_s: int, config: Any) -> None:
    """Refuse a grace period that ends before the config's preemption-save deadline."""
    from partita.config import load_config

    deadline = getattr(load_config(config).checkpoint, "signal_save_deadline_seconds", None)
    if deadline is not None and grace_period_s <= deadline:
        raise ValueError(
            f"--grace-period {grace_period_s} s is not above checkpoint.signal_save_deadline_seconds {deadline:g} s: "
            "the kubelet would SIGKILL the pod before partita's save on SIGTERM may finish; give a grace period of "
            "at least the deadline plus one training step"
        )


def _job_from_args(args: argparse.Namespace) -> K8sJob:
    env = []
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env {item!r} is not KEY=VALUE")
        env.append((key, value))
    return K8sJob(
        name=args.name, image=args.image, script=args.script, script_args=tuple(args.script_args),
        module=args.module, nnodes=args.nnodes, min_nnodes=args.min_nnodes, gpus_per_node=args.gpus,
        nproc_per_node=args.nproc, cpu=args.cpu, memory=args.memory, pvc=args.pvc, pvc_size=args.pvc_size,
        storage_class=args.storage_class, checkpoint_dir=args.checkpoint_dir, shm_size=args.shm_size,
        grace_period_s=args.grace_period, max_restarts=args.max_restarts, restart_policy=args.restart_policy,
        rdzv_port=args.rdzv_port, namespace=args.namespace, env=tuple(env),
    )


def run_k8s_command(args: argparse.Namespace) -> int:
    """Print (or write) the manifests; a wrong input is one error line and status 2."""
    try:
        job = _job_from_args(args)
        if args.config is not None:
            check_grace_period(job.grace_period_s, args.config)
        docs = pytorchjob_manifests(job) if args.kind == "pytorchjob" else jobset_manifests(job)
    except (ValueError, OSError) as error:  # ConfigError is a ValueError
        print(f"partita k8s: error: {error}", file=sys.stderr)
        return 2
    text = render_yaml(docs)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output}: {', '.join(d['kind'] for d in docs)}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
