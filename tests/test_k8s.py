"""Kubernetes: ``partita k8s`` manifests validated offline, and ``partita run`` reading a pod's environment.

Validation, all offline:
- core objects (PersistentVolumeClaim) and every pod template (as a ``v1/PodTemplate``) and
  JobSet Job template (as a ``batch/v1`` Job) against the Kubernetes API's JSON schemas in
  ``kubernetes-validate``, strict (unknown fields fail);
- the PyTorchJob body against the Kubeflow training-operator SDK's own API models
  (``kubeflow-training``: every field name and type, recursively down to the core types);
- the JobSet body's own fields against a schema of the JobSet v1alpha2 API written here
  (no package ships the JobSet CRD's schema).
"""

from __future__ import annotations

import copy
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from partita.launcher.cli import main
from partita.launcher.k8s import K8sJob, jobset_manifests, pytorchjob_manifests, render_yaml
from partita.launcher.kubernetes_env import KubernetesLayout, kubernetes_layout
from partita.launcher.plan import RunOptions, build_torchrun_argv, resolve_plan
from tests.test_launcher import child_env, partita_command

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate ('test' extra)")
kubeflow_models = pytest.importorskip("kubeflow.training.models", reason="pip install kubeflow-training ('test' extra)")
jsonschema = pytest.importorskip("jsonschema")
yaml = pytest.importorskip("yaml")

K8S_VERSION = kubernetes_validate.latest_version()
JOB = K8sJob(name="gpt-1b", image="registry.example/gpt:1", script="train.py", script_args=("--config", "ds.json"),
             nnodes=4, gpus_per_node=8, cpu="32", memory="512Gi", shm_size="64Gi", grace_period_s=600)


# ----------------------------------------------------------------------------- validators

def validate_core(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def validate_pod_template(template: dict[str, Any]) -> None:
    validate_core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template})


_PRIMITIVES = {"str": str, "int": int, "bool": bool}
_PYTORCHJOB_ENUMS = {  # values the training-operator's API documents for these fields
    "restartPolicy": {"Always", "OnFailure", "Never", "ExitCode"},
    "rdzvBackend": {"c10d", "etcd", "etcd-v2"},
    "cleanPodPolicy": {"All", "Running", "None"},
}


def validate_sdk_model(value: Any, type_name: str, path: str) -> None:
    """Check a dict against a kubeflow-training model: field names, types, nested models."""
    if type_name in _PRIMITIVES:
        if not isinstance(value, _PRIMITIVES[type_name]) or isinstance(value, bool) != (type_name == "bool"):
            raise ValueError(f"{path}: {value!r} is not {type_name}")
        return
    if type_name.startswith("list["):
        assert isinstance(value, list), path
        for i, item in enumerate(value):
            validate_sdk_model(item, type_name[5:-1], f"{path}[{i}]")
        return
    if type_name.startswith("dict(str, "):
        assert isinstance(value, dict), path
        for key, item in value.items():
            validate_sdk_model(item, type_name[len("dict(str, "):-1], f"{path}.{key}")
        return
    if type_name == "V1PodTemplateSpec":
        validate_pod_template(value)
        return
    if type_name == "V1ObjectMeta":
        validate_core({"apiVersion": "v1", "kind": "ConfigMap", "metadata": value})
        return
    model = getattr(kubeflow_models, type_name)
    by_json = {json_key: model.openapi_types[attr] for attr, json_key in model.attribute_map.items()}
    if not isinstance(value, dict):
        raise ValueError(f"{path}: {value!r} is not an object ({type_name})")
    for key, item in value.items():
        if key not in by_json:
            raise ValueError(f"{path}: unknown field {key!r} for {type_name} (known: {sorted(by_json)})")
        if key in _PYTORCHJOB_ENUMS and item not in _PYTORCHJOB_ENUMS[key]:
            raise ValueError(f"{path}.{key}: {item!r} is not one of {sorted(_PYTORCHJOB_ENUMS[key])}")
        validate_sdk_model(item, by_json[key], f"{path}.{key}")


def _strict(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


# The JobSet v1alpha2 API (sigs.k8s.io/jobset api/jobset/v1alpha2): the JobSet's own fields.
_JOBSET_SCHEMA = _strict({
    "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
    "kind": {"const": "JobSet"},
    "metadata": {"type": "object"},
    "spec": _strict({
        "replicatedJobs": {"type": "array", "minItems": 1, "items": _strict({
            "name": {"type": "string", "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$"},
            "groupName": {"type": "string"},
            "replicas": {"type": "integer", "minimum": 0},
            "dependsOn": {"type": "array"},
            "template": _strict({"metadata": {"type": "object"}, "spec": {"type": "object"}}, ("spec",)),
        }, ("name", "template"))},
        "network": _strict({"enableDNSHostnames": {"type": "boolean"}, "subdomain": {"type": "string"},
                            "publishNotReadyAddresses": {"type": "boolean"}}),
        "successPolicy": {"type": "object"},
        "failurePolicy": _strict({"maxRestarts": {"type": "integer", "minimum": 0},
                                  "restartStrategy": {"enum": ["Recreate", "BlockingRecreate"]},
                                  "rules": {"type": "array"}}),
        "startupPolicy": {"type": "object"},
        "suspend": {"type": "boolean"},
        "coordinator": {"type": "object"},
        "managedBy": {"type": "string"},
        "ttlSecondsAfterFinished": {"type": "integer"},
    }, ("replicatedJobs",)),
}, ("apiVersion", "kind", "metadata", "spec"))


def validate_jobset(doc: dict[str, Any]) -> None:
    jsonschema.validate(doc, _JOBSET_SCHEMA)
    for rjob in doc["spec"]["replicatedJobs"]:
        validate_core({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"}, **rjob["template"]})


def validate(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if doc["kind"] == "PyTorchJob":
            validate_sdk_model(doc, "KubeflowOrgV1PyTorchJob", "PyTorchJob")
        elif doc["kind"] == "JobSet":
            validate_jobset(doc)
        else:
            validate_core(doc)


# ----------------------------------------------------------------------------- manifests

def test_pytorchjob_manifests_validate_and_say_what_was_asked() -> None:
    claim, job = pytorchjob_manifests(JOB)
    validate([claim, job])
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    spec = job["spec"]
    assert spec["elasticPolicy"] == {"rdzvBackend": "c10d", "rdzvPort": 29400, "rdzvId": "gpt-1b",
                                     "minReplicas": 4, "maxReplicas": 4, "maxRestarts": 3}
    assert spec["nprocPerNode"] == "8" and set(spec["pytorchReplicaSpecs"]) == {"Worker"}
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4 and worker["restartPolicy"] == "ExitCode"
    pod = worker["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # ExitCode: the operator, not the kubelet, recreates the pod
    assert pod["terminationGracePeriodSeconds"] == 600
    (container,) = pod["containers"]
    assert container["name"] == "pytorch"  # the operator looks for this container and port name
    assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 29400, "protocol": "TCP"}]
    assert container["command"] == ["partita", "run", "--nproc", "8", "train.py", "--config", "ds.json"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "8"}, "requests": {"cpu": "32", "memory": "512Gi"}}
    assert pod["volumes"][0] == {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "gpt-1b-checkpoints"}}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]


def test_jobset_manifests_validate_and_expose_the_jobset_annotations() -> None:
    job = K8sJob(**{**JOB.__dict__, "pvc": "shared-ckpt", "max_restarts": 5})
    (body,) = jobset_manifests(job)  # an existing claim: no PersistentVolumeClaim written
    validate([body])
    spec = body["spec"]
    assert spec["network"]["subdomain"] == "gpt-1b" and spec["failurePolicy"] == {"maxRestarts": 5}
    (rjob,) = spec["replicatedJobs"]
    assert rjob["replicas"] == 4 and rjob["template"]["spec"]["completions"] == 1
    pod = rjob["template"]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") or e["valueFrom"]["fieldRef"]["fieldPath"] for e in pod["containers"][0]["env"]}
    assert env["JOB_INDEX"] == "metadata.annotations['jobset.sigs.k8s.io/job-index']"
    assert env["REPLICATED_JOB_REPLICAS"] == "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-replicas']"
    assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "shared-ckpt"}


def test_the_validators_reject_wrong_manifests() -> None:
    """Each validator fails on a broken copy, so the passes above mean something."""
    claim, job = pytorchjob_manifests(JOB)
    broken = copy.deepcopy(job)
    broken["spec"]["nprocPerNod"] = "8"
    with pytest.raises(ValueError, match=r"PyTorchJob.spec: unknown field 'nprocPerNod'"):
        validate([broken])
    broken = copy.deepcopy(job)
    broken["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] = "Sometimes"
    with pytest.raises(ValueError, match=r"restartPolicy: 'Sometimes' is not one of"):
        validate([broken])
    broken = copy.deepcopy(job)
    broken["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["terminationGracePeriodSeconds"] = "600"
    with pytest.raises(kubernetes_validate.ValidationError, match="'600' is not of type"):
        validate([broken])
    (jobset,) = jobset_manifests(K8sJob(**{**JOB.__dict__, "pvc": "c"}))
    broken = copy.deepcopy(jobset)
    broken["spec"]["replicatedJobs"][0]["template"]["spec"]["completionMode"] = 1
    with pytest.raises(kubernetes_validate.ValidationError, match="1 is not of type"):
        validate([broken])
    broken = copy.deepcopy(jobset)
    broken["spec"]["failurePolicy"]["maxRestart"] = 1
    with pytest.raises(jsonschema.ValidationError, match="'maxRestart' was unexpected"):
        validate([broken])


@pytest.mark.parametrize(
    ("changes", "kind", "message"),
    [
        ({"name": "GPT_1b"}, "jobset", r"--name 'GPT_1b' must be a DNS-1035 label"),
        ({"name": "a" * 56}, "jobset", r"pod hostname 'a{56}-node-3-0' exceeds 63 characters"),
        ({"min_nnodes": 2}, "jobset", r"--min-nnodes needs an elastic operator"),
        ({"min_nnodes": 5}, "pytorchjob", r"--min-nnodes 5 must be in \[1, --nnodes 4\]"),
        ({"nproc_per_node": 4}, "pytorchjob", r"--nproc 4 with --gpus 8: partita runs one process per GPU"),
        ({"memory": "lots"}, "pytorchjob", r"--memory 'lots' is not a Kubernetes quantity"),
        ({"checkpoint_dir": "ckpt"}, "jobset", r"--checkpoint-dir 'ckpt' must be an absolute path"),
    ],
)
def test_bad_manifest_inputs(changes: dict, kind: str, message: str) -> None:
    build = pytorchjob_manifests if kind == "pytorchjob" else jobset_manifests
    with pytest.raises(ValueError, match=message):
        build(K8sJob(**{**JOB.__dict__, **changes}))


def test_k8s_command_writes_yaml_that_reads_back(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "job.yaml"
    assert main(["k8s", "pytorchjob", "--name", "gpt-1b", "--image", "registry.example/gpt:1", "--nnodes", "4",
                 "--min-nnodes", "2", "--gpus", "8", "--grace-period", "900", "--env", "NCCL_DEBUG=WARN",
                 "-o", str(out), "train.py", "--config", "ds.json"]) == 0
    assert capsys.readouterr().err.strip() == f"wrote {out}: PersistentVolumeClaim, PyTorchJob"
    docs = list(yaml.safe_load_all(out.read_text()))
    validate(docs)
    job = K8sJob(**{**JOB.__dict__, "min_nnodes": 2, "cpu": None, "memory": None, "shm_size": None,
                    "grace_period_s": 900, "env": (("NCCL_DEBUG", "WARN"),)})
    assert docs == pytorchjob_manifests(job)
    assert render_yaml(docs) == out.read_text()
    assert main(["k8s", "jobset", "--name", "Bad", "--image", "i", "train.py"]) == 2
    assert "partita k8s: error: --name 'Bad' must be a DNS-1035 label" in capsys.readouterr().err


def test_grace_period_is_checked_against_the_configs_save_deadline(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    from partita.checkpoint.config import CheckpointConfig

    if "signal_save_deadline_seconds" not in CheckpointConfig.model_fields:
        pytest.skip("checkpoint.signal_save_deadline_seconds (preemption saves) is not in this tree")
    config = tmp_path / "ds.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 1, "checkpoint": {"signal_save_deadline_seconds": 120}}')
    argv = ["k8s", "jobset", "--name", "j", "--image", "i", "--config", str(config), "train.py"]
    assert main(argv[:2] + ["--grace-period", "120"] + argv[2:]) == 2
    assert capsys.readouterr().err.strip() == (
        "partita k8s: error: --grace-period 120 s is not above checkpoint.signal_save_deadline_seconds 120 s: the "
        "kubelet would SIGKILL the pod before partita's save on SIGTERM may finish; give a grace period of at least "
        "the deadline plus one training step")
    assert main(argv[:2] + ["--grace-period", "180"] + argv[2:]) == 0


# ----------------------------------------------------------------------------- the pod's environment

def operator_env_for_pytorchjob(doc: dict[str, Any]) -> dict[str, str]:
    """What the training-operator sets in a Worker pod of this elastic PyTorchJob (its envvar rules)."""
    policy, name = doc["spec"]["elasticPolicy"], doc["metadata"]["name"]
    return {
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "PET_RDZV_ENDPOINT": f"{name}-worker-0:{policy['rdzvPort']}",
        "PET_RDZV_BACKEND": policy["rdzvBackend"],
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
        "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
        "PET_NPROC_PER_NODE": doc["spec"]["nprocPerNode"],
        "PET_RDZV_ID": policy["rdzvId"],
    }


def jobset_pod_env(doc: dict[str, Any], job_index: int) -> dict[str, str]:
    """The container's variables in Job ``job_index`` of this JobSet, downward API resolved."""
    rjob = doc["spec"]["replicatedJobs"][0]
    annotations = {
        "jobset.sigs.k8s.io/jobset-name": doc["metadata"]["name"],
        "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
        "jobset.sigs.k8s.io/job-index": str(job_index),
        "jobset.sigs.k8s.io/replicatedjob-replicas": str(rjob["replicas"]),
    }
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "0"}
    for var in rjob["template"]["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = annotations[path.removeprefix("metadata.annotations['").removesuffix("']")]
    return env


def argv_in_pod(env: dict[str, str], nproc: int | None = 8) -> list[str]:
    layout = kubernetes_layout(env, cuda_device_count=8)
    return build_torchrun_argv(resolve_plan(RunOptions(script="train.py", nproc=nproc, module=True),
                                            cuda_device_count=8, kubernetes=layout))


def test_partita_run_in_a_pytorchjob_pod_uses_the_operators_c10d_rendezvous() -> None:
    (_, doc) = pytorchjob_manifests(K8sJob(**{**JOB.__dict__, "min_nnodes": 2}))
    assert argv_in_pod(operator_env_for_pytorchjob(doc)) == [
        "--nnodes=2:4", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=gpt-1b-worker-0:29400",
        "--rdzv-id=gpt-1b", "--max-restarts=3", "--module", "train.py"]


def test_partita_run_in_a_jobset_pod_rendezvous_at_the_first_pods_hostname() -> None:
    (_, doc) = jobset_manifests(JOB)
    layouts = [kubernetes_layout(jobset_pod_env(doc, i)) for i in range(4)]
    assert [layout.node_rank for layout in layouts] == [0, 1, 2, 3]
    assert argv_in_pod(jobset_pod_env(doc, 2)) == [
        "--nnodes=4", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=gpt-1b-node-0-0.gpt-1b:29400",
        "--rdzv-id=gpt-1b", "--max-restarts=0", "--module", "train.py"]


def test_static_pytorchjob_env_and_legacy_variables() -> None:
    pet = {"PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456", "PET_NNODES": "3", "PET_NODE_RANK": "2",
           "PET_NPROC_PER_NODE": "gpu"}
    assert kubernetes_layout(pet, cuda_device_count=4) == KubernetesLayout(
        operator="pytorchjob", nnodes=3, min_nnodes=3, nproc_per_node=4, node_rank=2, master_addr="job-master-0",
        master_port=23456, rdzv_endpoint=None, rdzv_backend="static", rdzv_id=None, rdzv_conf=None, max_restarts=None)
    # Operators before the PET_* variables: WORLD_SIZE and RANK count pods (one per node).
    legacy = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
              "WORLD_SIZE": "3", "RANK": "1"}
    assert argv_in_pod(legacy, nproc=None) == [
        "--nnodes=3", "--nproc-per-node=8", "--rdzv-backend=static", "--node-rank=1", "--master-addr=job-master-0",
        "--master-port=23456", "--max-restarts=0", "--module", "train.py"]
    # Outside a pod the same variables are torchrun's own (a worker's), not an operator's.
    assert kubernetes_layout({k: v for k, v in legacy.items() if k != "KUBERNETES_SERVICE_HOST"}) is None
    assert kubernetes_layout({}) is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PET_RDZV_ENDPOINT": "h:1", "PET_NNODES": "4:2"}, r"PET_NNODES='4:2' needs 1 <= MIN <= MAX"),
        ({"PET_RDZV_ENDPOINT": "h:1", "PET_NNODES": "two"}, r"PET_NNODES='two' is neither N nor MIN:MAX"),
        ({"PET_RDZV_ENDPOINT": "h:1"}, r"PET_RDZV_ENDPOINT is set but PET_NNODES is not"),
        ({"PET_NNODES": "2", "PET_NODE_RANK": "0"}, r"this PyTorchJob pod lacks PET_MASTER_ADDR"),
        ({"PET_MASTER_ADDR": "m", "PET_NNODES": "2", "PET_NODE_RANK": "2"}, r"PET_NODE_RANK=2 must be < PET_NNODES=2"),
        ({"PET_RDZV_ENDPOINT": "h:1", "PET_NNODES": "1", "PET_NPROC_PER_NODE": "gpu"}, r"PET_NPROC_PER_NODE=gpu but"),
        ({"JOBSET_NAME": "j"}, r"REPLICATED_JOB_NAME, JOB_INDEX, REPLICATED_JOB_REPLICAS are not"),
        ({"JOBSET_NAME": "j", "REPLICATED_JOB_NAME": "node", "JOB_INDEX": "0", "REPLICATED_JOB_REPLICAS": "2",
          "JOB_COMPLETION_INDEX": "1"}, r"JOB_COMPLETION_INDEX=1: partita reads a JobSet with one pod per Job"),
    ],
)
def test_bad_pod_environment(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kubernetes_layout(env, cuda_device_count=0)


def test_nproc_flag_must_agree_with_the_operator() -> None:
    env = {"PET_RDZV_ENDPOINT": "h:29400", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "8"}
    with pytest.raises(ValueError, match=r"--nproc 4 disagrees with the pytorchjob's 8 processes per node"):
        argv_in_pod(env, nproc=4)


def test_partita_run_with_pytorchjob_variables_trains_through_c10d(tmp_path: Path) -> None:
    """A real one-node c10d rendezvous from PET_* variables alone: no layout flags."""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent("""
        import os, sys
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        x = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(x)
        with open(f"{sys.argv[1]}/rank{dist.get_rank()}.txt", "w") as f:
            f.write(f"{dist.get_world_size()} {x.item()} {os.environ['TORCHELASTIC_RUN_ID']}")
        dist.barrier()
        os._exit(0)
    """))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**child_env(), "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}", "PET_RDZV_BACKEND": "c10d", "PET_NNODES": "1",
           "PET_NPROC_PER_NODE": "2", "PET_RDZV_ID": "k8s-test"}
    result = subprocess.run([*partita_command(), "run", str(worker), str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "2 1.0 k8s-test"


def test_run_dry_run_reads_the_pod_environment(tmp_path: Path, capsys: pytest.CaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    (_, doc) = jobset_manifests(JOB)
    for name, value in jobset_pod_env(doc, 1).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert main(["run", "--dry-run", str(script)]) == 0
    assert capsys.readouterr().out.strip() == (
        "torchrun --nnodes=4 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=gpt-1b-node-0-0.gpt-1b:29400 "
        f"--rdzv-id=gpt-1b --max-restarts=0 {script}")
