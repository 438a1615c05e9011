"""Two torchrun node agents on this machine (``partita run --nnodes 1:2 --rdzv-backend c10d``, two
processes each) train one job; one agent and its ranks are killed mid-training (a lost node).
The survivor re-forms the job with its two ranks (the elastic minimum), resumes from the last
checkpoint, and ends with the parameters of single-process torch on the same global batch: the
``elasticity`` section keeps the global batch at 8 (micro 2 x accumulation 1 x 4 ranks, then
micro 2 x accumulation 2 x 2 ranks), and the data loader's saved position deals the remaining
samples anew over the new ranks.

This file is also the training job (run under ``partita run`` with ``--job``-style arguments).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS, KILL_AFTER, SAMPLES = 8, 3, 64
LR, CLIP = 1e-2, 0.5
ELASTIC = {"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [1, 2], "max_gpus": 4, "version": 0.1}


def _data():
    import torch

    from tests.tiny_models import SEQ, make_batches

    xs, ys = make_batches(STEPS, SAMPLES // STEPS)
    return torch.utils.data.TensorDataset(xs.reshape(SAMPLES, SEQ), ys.reshape(SAMPLES, SEQ))


def _config(save_dir: str) -> dict:
    return {
        "elasticity": ELASTIC,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 60},
        "steps_per_print": 1000,
        "checkpoint": {"save_dir": save_dir, "resume": "latest"},
    }


# ---------------------------------------------------------------------------- the job


def _job() -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    import partita
    from partita.data.sampler import infinite_batches
    from tests.tiny_models import build_model, param_groups

    parser = argparse.ArgumentParser()
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ready", required=True)  # written once 4 ranks have a checkpoint to fall back on
    parser.add_argument("--killed", required=True)  # written by the test once it killed the other node
    args = parser.parse_args()
    model = build_model()
    engine, _, loader, _ = partita.initialize(model=model, model_parameters=param_groups(model), training_data=_data(),
                                              config=_config(args.save_dir))
    world = dist.get_world_size()
    print(f"attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT')}: world {world}, step {engine.global_steps}, "
          f"accumulation {engine.gradient_accumulation_steps()}", flush=True)
    batches = infinite_batches(loader)
    for step in range(engine.global_steps, STEPS):
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = next(batches)
            engine.backward(engine(x, y))
            engine.step()
        engine.save_checkpoint()
        if world == 4 and engine.global_steps == KILL_AFTER:
            Path(args.ready).write_text("ready\n")
            deadline = time.monotonic() + 60
            while not Path(args.killed).exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # the test kills the other node now; the next collective fails here
    if dist.get_rank() == 0:
        save_file({n: p.detach().clone() for n, p in model.named_parameters()}, args.out)
        print(f"finished on {world} ranks at step {engine.global_steps}, resumed from "
              f"{engine.loaded_checkpoint and engine.loaded_checkpoint[0]}", flush=True)
    os._exit(0)  # skip gloo's destructor (it can abort at teardown on torch 2.13)


# ---------------------------------------------------------------------------- the test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _listens_on(pid: int, port: int) -> bool:
    """True when ``pid`` holds the listening socket of ``port`` (it hosts the c10d rendezvous store)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # 0A: LISTEN
                inodes.add(cols[9])
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd).removeprefix("socket:[").removesuffix("]") in inodes:
                return True
        except OSError:
            continue
    return False


def _reference(num_steps: int) -> dict:
    """Single-process torch AdamW on the sampler's order, 8 samples a step."""
    import torch

    from tests.tiny_models import build_model, param_groups

    data = _data()
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()  # the sampler's epoch 0
    model = build_model()
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in param_groups(model)]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    for step in range(num_steps):
        x, y = data[order[step * 8 : (step + 1) * 8]]
        opt.zero_grad()
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_killed_node_agent_job_reforms_on_the_survivor_and_matches_torch(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    port = _free_port()
    files = {k: tmp_path / k for k in ("ckpt", "out.safetensors", "ready", "killed")}
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    # last_call_timeout: how long a rendezvous with fewer than 2 nodes waits for more (the first
    # formation waits for the second agent; the re-formation after the kill for a replacement).
    # keep_alive_*: the killed agent counts as gone once it missed 5 s of 1 s heartbeats (torch's
    # default, 3 x 5 s, had the survivor wait ~12 s longer to re-form; a live agent's heartbeat
    # thread is never 5 s late, even on a loaded machine).
    cmd = [sys.executable, "-m", "partita.launcher.cli", "run", "--nnodes", "1:2", "--nproc", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
           "--rdzv-conf", "last_call_timeout=8,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=5",
           "--max-restarts", "2", str(Path(__file__).resolve()),
           "--save-dir", str(files["ckpt"]), "--out", str(files["out.safetensors"]), "--ready", str(files["ready"]),
           "--killed", str(files["killed"])]
    logs = [open(tmp_path / f"agent{i}.log", "w") for i in range(2)]
    agents = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
              for log in logs]
    try:
        deadline = time.monotonic() + 150
        while not files["ready"].exists():
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), _logs(tmp_path)
            time.sleep(0.05)
        # Kill the agent that does not host the rendezvous store, with its ranks: a lost node.
        [victim] = [a for a in agents if not _listens_on(a.pid, port)]
        doomed = [victim.pid, *_children(victim.pid)]
        for pid in doomed:
            os.kill(pid, signal.SIGKILL)
        files["killed"].write_text("killed\n")
        survivor = agents[1 - agents.index(victim)]
        assert survivor.wait(timeout=150) == 0, _logs(tmp_path)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
        for log in logs:
            log.close()
    log = (tmp_path / f"agent{agents.index(survivor)}.log").read_text()
    assert "world 4, step 0, accumulation 1" in log, log[-4000:]
    # Re-formed with the survivor's 2 ranks: accumulation 2 keeps the global batch at 8.
    assert f"world 2, step {KILL_AFTER}, accumulation 2" in log, log[-4000:]
    assert f"finished on 2 ranks at step {STEPS}, resumed from {files['ckpt']}/global_step{KILL_AFTER}" in log, log[-4000:]
    got = load_file(str(files["out.safetensors"]))
    for name, want in _reference(STEPS).items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_elastic_launch_flags(tmp_path: Path) -> None:
    from partita.launcher.cli import build_parser, run_options_from_args
    from partita.launcher.plan import build_torchrun_argv, resolve_plan

    script = tmp_path / "train.py"
    script.write_text("")

    def plan(*flags: str):
        opts = run_options_from_args(build_parser().parse_args(["run", *flags, str(script)]))
        return build_torchrun_argv(resolve_plan(opts, cuda_device_count=0))

    assert plan("--nnodes", "1:4", "--nproc", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n0:29400",
                "--rdzv-id", "j1", "--max-restarts", "3") == [
        "--nnodes=1:4", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=n0:29400", "--rdzv-id=j1",
        "--max-restarts=3", str(script)]
    with pytest.raises(ValueError, match="needs --rdzv-backend c10d --rdzv-endpoint HOST:PORT"):
        plan("--nnodes", "1:2")
    with pytest.raises(ValueError, match="c10d needs --rdzv-endpoint HOST:PORT"):
        plan("--nnodes", "1:2", "--rdzv-backend", "c10d")
    with pytest.raises(ValueError, match="need 1 <= MIN <= MAX"):
        plan("--nnodes", "3:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n0:1")
    with pytest.raises(ValueError, match="assigns node ranks itself; drop --node-rank"):
        plan("--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n0:1")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--nnodes", "1:2:3", str(script)])


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("agent*.log")))


if __name__ == "__main__":
    _job()
