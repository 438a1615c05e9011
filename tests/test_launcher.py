"""The ``partita`` command: hostfiles, SLURM allocations, torchrun argv, env report, a real run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from partita.launcher.cli import main
from partita.launcher.env_report import EXTRA_PACKAGES
from partita.launcher.hostfile import HostfileLayout, HostSlots, hostfile_layout, parse_hostfile
from partita.launcher.plan import RunOptions, build_torchrun_argv, resolve_plan
from partita.launcher.slurm import SlurmAllocation, slurm_allocation

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def plan_argv(opts: RunOptions, **kwargs) -> list[str]:
    kwargs.setdefault("cuda_device_count", 0)
    return build_torchrun_argv(resolve_plan(opts, **kwargs))


# ----------------------------------------------------------------------------- hostfile

HOSTFILE = """
# cluster A
worker-0 slots=4   # first node is the master
worker-1   slots = 4

worker-2.cluster.local slots=4
"""


def test_parse_hostfile() -> None:
    assert parse_hostfile(HOSTFILE) == [
        HostSlots("worker-0", 4), HostSlots("worker-1", 4), HostSlots("worker-2.cluster.local", 4)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a slots=2\nb\n", r"hostfile:2: 'b' is not 'HOST slots=N'"),
        ("a slots=0\n", r"hostfile:1: slots='0' must be a positive integer"),
        ("a slots=x\n", r"slots='x' must be a positive integer"),
        ("a slots=2\na slots=2\n", r"hostfile:2: host 'a' is already listed on line 1"),
        ("# only a comment\n", "lists no hosts"),
    ],
)
def test_bad_hostfile(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_hostfile(text)


def test_hostfile_layout_finds_this_node() -> None:
    hosts = parse_hostfile(HOSTFILE)
    assert hostfile_layout(hosts, this_host={"worker-1"}) == HostfileLayout(3, 4, "worker-0", 1)
    # A short hostname matches a fully qualified entry.
    assert hostfile_layout(hosts, this_host={"worker-2"}).node_rank == 2
    assert hostfile_layout(hosts, this_host={"elsewhere"}, node_rank=0).node_rank == 0


def test_hostfile_layout_errors() -> None:
    hosts = parse_hostfile(HOSTFILE)
    with pytest.raises(ValueError, match=r"this machine \(elsewhere\) is not in the hostfile .*--node-rank"):
        hostfile_layout(hosts, this_host={"elsewhere"})
    with pytest.raises(ValueError, match=r"--node-rank 3 must be in \[0, 3\)"):
        hostfile_layout(hosts, node_rank=3)
    with pytest.raises(ValueError, match=r"slots differ between hosts \(a=2, b=4\)"):
        hostfile_layout([HostSlots("a", 2), HostSlots("b", 4)], this_host={"a"})


# ----------------------------------------------------------------------------- SLURM allocation

SLURM_JOB = {"SLURM_JOB_ID": "777", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
             "SLURM_JOB_NODELIST": "gpu[03-06]"}


def test_slurm_allocation() -> None:
    assert slurm_allocation({}) is None
    assert slurm_allocation({"SLURM_JOB_ID": "777"}) is None  # salloc shell without node info
    assert slurm_allocation(SLURM_JOB) == SlurmAllocation(4, 2, "gpu03", 20777)
    single = {"SLURM_JOB_ID": "9", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "gpu07"}
    assert slurm_allocation(single) == SlurmAllocation(1, 0, "gpu07", 20009)


def test_slurm_allocation_errors() -> None:
    no_node_id = {k: v for k, v in SLURM_JOB.items() if k != "SLURM_NODEID"}
    with pytest.raises(ValueError, match="SLURM_NODEID is not set.*--ntasks-per-node=1"):
        slurm_allocation(no_node_id)
    many_tasks = {**SLURM_JOB, "SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_NUM_NODES": "4"}
    with pytest.raises(ValueError, match="running as 16 SLURM tasks on 4 node"):
        slurm_allocation(many_tasks)


# ----------------------------------------------------------------------------- torchrun argv


def test_local_cpu_default(script: str) -> None:
    assert plan_argv(RunOptions(script, ("--lr", "3"))) == [
        "--nnodes=1", "--nproc-per-node=2", "--standalone", "--max-restarts=0", script, "--lr", "3"]


def test_local_gpus_default_and_explicit_nproc(script: str) -> None:
    assert plan_argv(RunOptions(script), cuda_device_count=8)[1] == "--nproc-per-node=8"
    assert plan_argv(RunOptions(script, nproc=3), cuda_device_count=8)[1] == "--nproc-per-node=3"


def test_explicit_multinode(script: str) -> None:
    opts = RunOptions(script, nproc=8, nnodes=2, node_rank=1, master_addr="n0", master_port=6000,
                      max_restarts=3)
    assert plan_argv(opts) == [
        "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=static", "--node-rank=1",
        "--master-addr=n0", "--master-port=6000", "--max-restarts=3", script]


def test_module_mode_needs_no_file() -> None:
    assert plan_argv(RunOptions("pkg.train", ("-x",), module=True))[-3:] == ["--module", "pkg.train", "-x"]


def test_hostfile_mode(script: str) -> None:
    layout = HostfileLayout(nnodes=3, nproc_per_node=4, master_addr="worker-0", node_rank=2)
    assert plan_argv(RunOptions(script, hostfile="hosts"), hostfile=layout) == [
        "--nnodes=3", "--nproc-per-node=4", "--rdzv-backend=static", "--node-rank=2",
        "--master-addr=worker-0", "--master-port=29500", "--max-restarts=0", script]


def test_slurm_mode_and_flag_overrides(script: str) -> None:
    alloc = SlurmAllocation(nnodes=4, node_rank=2, master_addr="gpu03", master_port=20777)
    assert plan_argv(RunOptions(script), cuda_device_count=8, slurm=alloc) == [
        "--nnodes=4", "--nproc-per-node=8", "--rdzv-backend=static", "--node-rank=2",
        "--master-addr=gpu03", "--master-port=20777", "--max-restarts=0", script]
    argv = plan_argv(RunOptions(script, master_port=7000), slurm=alloc)
    assert "--master-port=7000" in argv and "--master-addr=gpu03" in argv
    # A one-node allocation runs like a laptop: private rendezvous on a free port.
    single = SlurmAllocation(nnodes=1, node_rank=0, master_addr="gpu03", master_port=20777)
    assert "--standalone" in plan_argv(RunOptions(script), slurm=single)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(nproc=0), "--nproc 0 must be >= 1"),
        (dict(nnodes=2), "--nnodes 2 needs --master-addr"),
        (dict(nnodes=2, master_addr="n0"), r"--nnodes 2 needs --node-rank \(0..1\)"),
        (dict(nnodes=2, node_rank=2, master_addr="n0"), "--node-rank 2 must be < --nnodes 2"),
        (dict(node_rank=1), "--node-rank 1 needs --nnodes > 1"),
        (dict(master_port=0), "--master-port 0 is not a TCP port"),
        (dict(max_restarts=-1), "--max-restarts -1 must be >= 0"),
        (dict(hostfile="h", nnodes=2), "--hostfile already gives the node count"),
    ],
)
def test_bad_run_options(script: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_plan(RunOptions(script, **kwargs), cuda_device_count=0)


def test_missing_script_and_hostfile_nproc_conflict(tmp_path: Path, script: str) -> None:
    with pytest.raises(ValueError, match="training script '.*nope.py' does not exist"):
        resolve_plan(RunOptions(str(tmp_path / "nope.py")), cuda_device_count=0)
    layout = HostfileLayout(nnodes=2, nproc_per_node=4, master_addr="a", node_rank=0)
    with pytest.raises(ValueError, match="--nproc 2 disagrees with the hostfile's slots=4"):
        resolve_plan(RunOptions(script, nproc=2, hostfile="h"), cuda_device_count=0, hostfile=layout)


def test_cli_dry_run_and_usage_error(script: str, tmp_path: Path, capsys: pytest.CaptureFixture,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLURM_JOB_ID", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    assert main(["run", "--dry-run", "--hostfile", str(hostfile), "--node-rank", "1", script, "-v"]) == 0
    assert capsys.readouterr().out.strip() == (
        "torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=static --node-rank=1 "
        f"--master-addr=worker-0 --master-port=29500 --max-restarts=0 {script} -v")
    assert main(["run", "--nproc", "0", script]) == 2
    assert capsys.readouterr().err.strip() == "partita run: error: --nproc 0 must be >= 1 (processes per node)"


def test_cli_reads_the_slurm_allocation_from_the_environment(script: str, capsys: pytest.CaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # `srun --ntasks-per-node=1 partita run train.py` on node 1 of a 2-node job, no flags.
    for name in ("MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"SLURM_JOB_ID": "777", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
                        "SLURM_JOB_NODELIST": "gpu[03-04]"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(["run", "--dry-run", script]) == 0
    assert capsys.readouterr().out.strip() == (
        "torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=static --node-rank=1 "
        f"--master-addr=gpu03 --master-port=20777 --max-restarts=0 {script}")


# ----------------------------------------------------------------------------- real processes


def partita_command() -> list[str]:
    console = Path(sys.executable).with_name("partita")
    return [str(console)] if console.exists() else [sys.executable, "-m", "partita.launcher.cli"]


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO)]))
    return env


def test_env_command_prints_versions() -> None:
    result = subprocess.run([*partita_command(), "env"], env=child_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert re.search(rf"^  torch \.+ {re.escape(torch.__version__)}$", result.stdout, re.M), result.stdout
    assert re.search(r"^  gloo \.+ True$", result.stdout, re.M)
    assert re.search(rf"^  python \.+ {sys.version.split()[0]} ", result.stdout, re.M)
    assert re.search(r"^  wandb \.+ ", result.stdout, re.M)
    # Every section of the report, each optional extra with a version or "not installed".
    headings = [line for line in result.stdout.splitlines() if not line.startswith(" ")]
    assert headings == ["partita environment", "packages", "devices", "distributed backends", "optional extras"]
    assert re.search(rf"^  cpu \.+ {os.cpu_count()} logical cores, torch threads \d+$", result.stdout, re.M)
    assert re.search(r"^  CUDA available \.+ (True|False)$", result.stdout, re.M)
    assert re.search(r"^  nccl \.+ ", result.stdout, re.M) and re.search(r"^  mpi \.+ (True|False)$", result.stdout, re.M)
    for package in ("pydantic", "safetensors"):
        assert re.search(rf"^  {package} \.+ \d\S*$", result.stdout, re.M), package
    for package in EXTRA_PACKAGES:
        assert re.search(rf"^  {package} \.+ (\d\S*|not installed) \((extra '\w+'|benchmarks only)\)$",
                         result.stdout, re.M), package
    assert re.search(r"^  matplotlib \.+ .* \(extra 'plot'\)$", result.stdout, re.M)


WORKER = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from partita.distributed import build_topology, init_distributed
    init_distributed()
    topo = build_topology(device_type="cpu")
    x = torch.tensor([float(topo.data_rank)])
    dist.all_reduce(x, group=topo.data_group)
    with open(f"{sys.argv[1]}/rank{topo.rank}.txt", "w") as f:
        f.write(f"{topo.world_size} {topo.data_size} {x.item()}")
    with open(f"{sys.argv[1]}/rank{topo.rank}.alloc", "w") as f:
        f.write(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "unset"))
    dist.barrier()
    # Ends as users' scripts do: partita's exit path tears the groups down (no gloo abort).
""")


def test_partita_run_two_cpu_ranks_all_reduce(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = {k: v for k, v in child_env().items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    result = subprocess.run([*partita_command(), "run", "--nproc", "2", str(worker), str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "terminate called" not in result.stderr
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "2 2 1.0"
        # partita run gives its ranks expandable allocator segments (partita/launcher/allocator.py).
        assert (tmp_path / f"rank{rank}.alloc").read_text() == "expandable_segments:True"


def test_allocator_default_keeps_the_users_setting() -> None:
    from partita.launcher.allocator import prepare_allocator

    env: dict[str, str] = {}
    prepare_allocator(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    prepare_allocator(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}


def test_partita_run_reports_the_failed_rank_exit_code(tmp_path: Path) -> None:
    worker = tmp_path / "fail.py"
    worker.write_text("import os, sys\nsys.exit(7 if os.environ['RANK'] == '1' else 0)\n")
    result = subprocess.run([*partita_command(), "run", "--nproc", "2", str(worker)],
                            env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 7, result.stdout + result.stderr
    assert "rank      : 1 (local_rank: 1)" in result.stderr


CRASH_ONCE = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from partita.distributed import init_distributed
    init_distributed(backend="gloo", timeout_seconds=120)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    x = torch.ones(1)
    dist.all_reduce(x)
    if attempt == 0 and dist.get_rank() == 1:
        sys.exit(5)  # one rank fails once, after the group is up (its keys are in the store)
    dist.all_reduce(x)
    with open(f"{sys.argv[1]}/attempt{attempt}-rank{dist.get_rank()}.txt", "w") as f:
        f.write(str(x.item()))
""")


def test_static_rendezvous_recovers_after_exactly_one_restart(tmp_path: Path) -> None:
    # The multi-node path (torchrun's static rendezvous, one store for the agent's life): the
    # restarted attempt used to read the failed attempt's keys and fail in gloo's connectFullMesh
    # ("Connection refused") or hang; partita's init keeps each attempt's keys apart.
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    worker = tmp_path / "crash_once.py"
    worker.write_text(CRASH_ONCE)
    result = subprocess.run([*partita_command(), "run", "--nproc", "2", "--master-addr", "127.0.0.1",
                             "--master-port", str(port), "--max-restarts", "1", str(worker), str(tmp_path)],
                            env=child_env(), capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.glob("attempt*")) == ["attempt1-rank0.txt", "attempt1-rank1.txt"]
    assert (tmp_path / "attempt1-rank0.txt").read_text() == "4.0"
    assert "connectFullMesh" not in result.stderr
