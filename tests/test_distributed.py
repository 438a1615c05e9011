"""partita.distributed: launch-environment detection, SLURM node lists, init, topology.

Pure rules are tested in-process; anything that initializes torch.distributed runs in a
subprocess so the pytest process never holds a process group other tests could trip on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from partita.distributed.init import (
    LaunchEnv,
    current_device,
    detect_launch_env,
    expand_slurm_nodelist,
    first_slurm_host,
    init_distributed,
    resolve_backend,
    slurm_master_port,
)
from partita.distributed.topology import AXIS_ORDER, Axis, resolve_mesh_shape

REPO = Path(__file__).resolve().parents[1]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO)]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


# ----------------------------------------------------------------------------- SLURM node lists


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu5", ["gpu5"]),
        ("node[01-04,07],gpu5", ["node01", "node02", "node03", "node04", "node07", "gpu5"]),
        ("a,b,c", ["a", "b", "c"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("my-host-[3]", ["my-host-3"]),
    ],
)
def test_expand_slurm_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert list(expand_slurm_nodelist(nodelist)) == hosts
    assert first_slurm_host(nodelist) == hosts[0]


def test_first_host_of_huge_list_is_lazy() -> None:
    assert first_slurm_host("big[000001-999999]") == "big000001"


@pytest.mark.parametrize(
    ("nodelist", "message"),
    [
        ("node[01-04", "unclosed"),
        ("node01-04]", "unmatched"),
        ("node[04-01]", "runs backwards"),
        ("node[a-b]", "'a-b'"),
        ("a,,b", "empty entry"),
        ("  ", "empty"),
    ],
)
def test_bad_nodelist_raises(nodelist: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        list(expand_slurm_nodelist(nodelist))


def test_slurm_master_port() -> None:
    assert slurm_master_port("12345") == 22345
    assert slurm_master_port("20000") == 20000
    assert slurm_master_port(None) == 29500
    assert slurm_master_port("abc") == 29500


# ----------------------------------------------------------------------------- env detection

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "1234"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
         "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242"}


def test_no_launcher_is_single_process() -> None:
    assert detect_launch_env({}) == LaunchEnv("single", 0, 1, 0, None, None)


def test_torchrun_env() -> None:
    assert detect_launch_env(TORCHRUN) == LaunchEnv("torchrun", 3, 8, 1, "n0", 1234)


def test_torchrun_wins_over_slurm() -> None:
    # partita run inside an srun step: workers carry both sets; torchrun's describe the worker.
    assert detect_launch_env({**SLURM, **TORCHRUN}).source == "torchrun"


def test_slurm_env_derives_master() -> None:
    assert detect_launch_env(SLURM) == LaunchEnv("slurm", 5, 8, 1, "gpu07", 24242)


def test_slurm_env_honours_master_overrides() -> None:
    env = {**SLURM, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "3000"}
    assert detect_launch_env(env) == LaunchEnv("slurm", 5, 8, 1, "10.0.0.1", 3000)


def test_half_set_torchrun_env_names_missing_variables() -> None:
    with pytest.raises(ValueError) as info:
        detect_launch_env({"RANK": "0"})
    message = str(info.value)
    assert "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing" in message
    assert "RANK set" in message


def test_local_rank_alone_is_half_set() -> None:
    with pytest.raises(ValueError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT missing"):
        detect_launch_env({"LOCAL_RANK": "0"})


def test_half_set_slurm_env_names_missing_variables() -> None:
    with pytest.raises(ValueError, match="SLURM_LOCALID, SLURM_JOB_NODELIST missing"):
        detect_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"RANK": "8"}, "RANK=8 must be < WORLD_SIZE=8"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK=-1 must be >= 0"),
    ],
)
def test_bad_torchrun_values(override: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        detect_launch_env({**TORCHRUN, **override})


def test_init_distributed_half_set_env_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    if dist.is_initialized():
        pytest.skip("a process group already exists in this pytest process")
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing"):
        init_distributed(backend="gloo")
    assert not dist.is_initialized()


def test_backend_and_timeout_validation() -> None:
    with pytest.raises(ValueError, match="backend='mpi' is not supported; use one of auto, nccl, gloo"):
        resolve_backend("mpi")
    with pytest.raises(ValueError, match="timeout_seconds=0 must be > 0"):
        init_distributed(timeout_seconds=0)
    assert resolve_backend("gloo") == "gloo"
    assert resolve_backend("auto") == ("nccl" if torch.cuda.is_available() else "gloo")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_nccl_without_cuda_is_refused_and_device_is_cpu() -> None:
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA"):
        resolve_backend("nccl")
    assert current_device() == torch.device("cpu")


# ----------------------------------------------------------------------------- mesh shape


def test_axis_names_live_in_one_place() -> None:
    # Outermost to innermost: tensor last so its ranks are neighbours on one node.
    assert [axis.value for axis in AXIS_ORDER] == ["pipe", "data", "sequence", "tensor"]
    assert Axis("data") is Axis.DATA and Axis("tensor") is Axis.TENSOR


def test_resolve_mesh_shape() -> None:
    ones = {Axis.PIPE: 1, Axis.SEQUENCE: 1, Axis.TENSOR: 1}
    assert resolve_mesh_shape(world_size=4, sizes={Axis.DATA: None}) == {**ones, Axis.DATA: 4}
    assert resolve_mesh_shape(world_size=4, sizes={Axis.DATA: 4}) == {**ones, Axis.DATA: 4}
    assert resolve_mesh_shape(world_size=8, sizes={Axis.DATA: None, Axis.TENSOR: 2, Axis.PIPE: 2}) == {
        Axis.PIPE: 2, Axis.DATA: 2, Axis.SEQUENCE: 1, Axis.TENSOR: 2}
    with pytest.raises(ValueError, match=r"data=3 \(inferred.*\) x sequence=1 .* = 3 do not multiply to the world size 4"):
        resolve_mesh_shape(world_size=4, sizes={Axis.DATA: 3})
    with pytest.raises(ValueError, match="'data' has size 0"):
        resolve_mesh_shape(world_size=4, sizes={Axis.DATA: 0})
    # Every factor is named with the config key that sets it.
    with pytest.raises(ValueError) as error:
        resolve_mesh_shape(world_size=6, sizes={Axis.DATA: None, Axis.TENSOR: 4, Axis.SEQUENCE: 1, Axis.PIPE: 1})
    message = str(error.value)
    assert "world size 6 is not divisible by 4" in message
    for part in ("pipe=1 (pipeline.stages)", "data=? (inferred", "sequence=1 (sequence_parallel_size)",
                 "tensor=4 (tensor_parallel.autotp_size)"):
        assert part in message


# ----------------------------------------------------------------------------- real process groups

SINGLE = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from partita.distributed import build_topology, init_distributed
    init_distributed(timeout_seconds=30)
    init_distributed(backend="gloo")  # idempotent: same backend again is fine
    try:
        init_distributed(backend="nccl")
        mismatch = ""
    except ValueError as error:
        mismatch = str(error)
    topo = build_topology(device_type="cpu")
    x = torch.tensor([5.0])
    dist.all_reduce(x, group=topo.data_group)
    print(json.dumps({"world": dist.get_world_size(), "rank": dist.get_rank(), "backend": dist.get_backend(),
                      "data_size": topo.data_size, "data_rank": topo.data_rank, "sum": x.item(),
                      "mismatch": mismatch}))
    dist.destroy_process_group()
""")


def test_plain_python_process_is_world_one() -> None:
    result = subprocess.run([sys.executable, "-c", SINGLE], env=clean_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["world"] == 1 and out["rank"] == 0 and out["backend"] == "gloo"
    assert out["data_size"] == 1 and out["data_rank"] == 0 and out["sum"] == 5.0
    assert "already initialized with backend 'gloo' but backend='nccl' was requested" in out["mismatch"]


# Two ranks started the way `srun python train.py` starts them (SLURM task variables, no
# torchrun): all_reduce over the topology's data group, then rank 1 stops taking part and
# rank 0's next collective must fail after timeout_seconds instead of hanging.
SLURM_RANK = textwrap.dedent("""
    import json, os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from partita.distributed import build_topology, init_distributed
    # Start together: the 1.5 s below also bounds init's wait for the other rank, and on a busy
    # machine one rank can take longer than that to import torch.
    sync = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60))
    sync.add("started", 1)
    while sync.add("started", 0) < 2:
        time.sleep(0.01)
    init_distributed(timeout_seconds=1.5)
    topo = build_topology(device_type="cpu")
    x = torch.tensor([float(topo.data_rank)])
    dist.all_reduce(x, group=topo.data_group)
    out = {"rank": topo.rank, "world": topo.world_size, "data_size": topo.data_size, "sum": x.item()}
    done = sys.argv[1] + "/rank0.json"
    if topo.rank == 1:
        # Stay alive (a dead peer closes the socket, which is a different error) until rank 0
        # has seen its timeout.
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
            out["error"] = ""
        except RuntimeError as error:
            out["error"] = str(error)
        out["waited"] = time.monotonic() - start
    with open(sys.argv[1] + f"/rank{topo.rank}.tmp", "w") as f:
        json.dump(out, f)
    os.replace(sys.argv[1] + f"/rank{topo.rank}.tmp", sys.argv[1] + f"/rank{topo.rank}.json")
    os._exit(0)  # a gloo group with a failed op can abort in its destructor; the result is saved
""")


@pytest.fixture(scope="module")
def slurm_world2(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    from datetime import timedelta

    out_dir = tmp_path_factory.mktemp("slurm")
    # This process hosts the rendezvous store on a port the OS picks while binding it, and rank 0
    # joins it as a client (torch's tcp:// rendezvous honours TORCHELASTIC_USE_AGENT_STORE): a
    # port picked free first and bound later by rank 0 could be taken by another job in between.
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=90))
    procs = []
    for rank in range(2):
        env = clean_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                        SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="7", MASTER_PORT=str(store.port),
                        TORCHELASTIC_USE_AGENT_STORE="True")
        procs.append(subprocess.Popen([sys.executable, "-c", SLURM_RANK, str(out_dir)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [proc.communicate(timeout=90)[0] for proc in procs]
    del store  # only now: the ranks may read it until they exit
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log
    return {rank: json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)}


def test_slurm_ranks_all_reduce_over_data_group(slurm_world2: dict[int, dict]) -> None:
    for rank in range(2):
        assert slurm_world2[rank]["rank"] == rank
        assert slurm_world2[rank]["world"] == 2
        assert slurm_world2[rank]["data_size"] == 2
        assert slurm_world2[rank]["sum"] == 1.0


def test_dead_rank_makes_collective_time_out(slurm_world2: dict[int, dict]) -> None:
    rank0 = slurm_world2[0]
    assert "Timed out" in rank0["error"] and "1500ms" in rank0["error"], rank0["error"]
    assert 1.2 < rank0["waited"] < 15
