"""CPU benchmark: one MoE training step on 4 gloo processes at ep 2 and ep 4, partita's MoE
against DeepSpeed's (``deepspeed.moe.layer.MoE``) in the same processes, interleaved.

    .bench-venv/bin/python benchmarks/moe_cpu.py [--rounds 3] [--steps 6] [--json out.json]

One ``torchrun --nproc-per-node 4`` job of this file's worker (``--worker``) runs every case
round-robin (``--rounds`` times, so load from other jobs on the machine falls on every case
alike): for ep in (2, 4), for each engine (partita, DeepSpeed) and routing mode (capacity:
``drop_tokens=True``; dropless: ``drop_tokens=False``), it builds the same model
(``Linear -> tanh -> MoE -> Linear``, MSE + 0.01 * l_aux), initializes that engine at ZeRO-2 with
torch AdamW, and times forward + backward + step (after a barrier) for ``--steps`` steps after
``--warmup``. A case's figure is the median over its steps of the slowest rank's step time,
then the median over rounds.

``partita-noagree`` is a diagnostic, not a mode: partita's capacity mode with its capacity
agreement (one all-reduce max over the expert group per MoE forward, so ranks that route
different token counts still use equal all-to-all buffers) replaced by the local capacity, as
DeepSpeed assumes equal counts. It is unsafe when counts differ and exists to measure that
all-reduce's cost.

DeepSpeed's dropless mode is its ``drop_tokens=False``: every rank pads each expert's buffer
to the largest count any rank routed to any expert (an all-reduce max), then the same
equal-split all-to-all. partita's is variable-size all-to-all and grouped expert GEMMs.
The DeepSpeed rows need ``deepspeed`` importable by the python running this file (the
benchmark venv, .bench-venv); without it they record why and the partita rows still run.
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # benchmarks/ is not a package
from output_paths import output_file  # noqa: E402

SIZE = dict(d_model=128, ffn=512, experts=8, k=2, micro_batch=4, seq=64, capacity_factor=1.25)
EP_SIZES = (2, 4)
CASES = [("partita", "capacity"), ("deepspeed", "capacity"), ("partita", "dropless"), ("deepspeed", "dropless"),
         ("partita-noagree", "capacity")]


def _config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": SIZE["micro_batch"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000},
    }


def _model(engine: str, mode: str, ep: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    d, ffn = SIZE["d_model"], SIZE["ffn"]
    expert = nn.Sequential(nn.Linear(d, ffn), nn.GELU(), nn.Linear(ffn, d))
    kwargs = dict(num_experts=SIZE["experts"], ep_size=ep, k=SIZE["k"], capacity_factor=SIZE["capacity_factor"],
                  eval_capacity_factor=SIZE["capacity_factor"], drop_tokens=mode == "capacity", use_rts=False)
    if engine == "partita":
        from partita.moe.layer import MoE
    else:
        from deepspeed.moe.layer import MoE

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(d, d)
            self.moe = MoE(d, expert, **kwargs)
            self.out = nn.Linear(d, d)

        def forward(self, x, y):
            h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
            return torch.nn.functional.mse_loss(self.out(h), y) + 0.01 * l_aux

    return Net()


def _run_case(engine_name: str, mode: str, ep: int, steps: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist

    import partita.moe.layer as partita_layer

    agree = partita_layer.agree_capacity
    if engine_name == "partita-noagree":  # the diagnostic (see the module docstring)
        partita_layer.agree_capacity = lambda capacity, group, device: capacity
        try:
            return _run_case("partita", mode, ep, steps, warmup)
        finally:
            partita_layer.agree_capacity = agree
    model = _model(engine_name, mode, ep)
    if engine_name == "partita":
        import partita

        engine, *_ = partita.initialize(model=model, config=_config())
    else:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config())
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    shape = (SIZE["micro_batch"], SIZE["seq"], SIZE["d_model"])
    times = []
    for _ in range(warmup + steps):
        x, y = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        dist.barrier()
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times[warmup:], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
    if engine_name == "partita":
        from partita.moe import is_moe_param
    else:
        from deepspeed.moe.utils import is_moe_param
    expert_params = sum(p.numel() for p in model.parameters() if is_moe_param(p))  # this rank's experts
    return {"step_ms": 1e3 * statistics.median(slowest.tolist()), "final_loss": float(loss.item()),
            "moe_params_per_rank": expert_params}


def worker(rounds: int, steps: int, warmup: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # adopts the existing group
        ds_error = None
    except Exception as error:  # noqa: BLE001 - recorded in the result, the partita rows still run
        ds_error = f"{type(error).__name__}: {error}"[:300]
    results: dict[str, list] = {}
    for _ in range(rounds):
        for ep in EP_SIZES:
            for engine_name, mode in CASES:
                key = f"{engine_name} {mode} ep{ep}"
                if engine_name == "deepspeed" and ds_error is not None:
                    results[key] = [{"error": ds_error}]
                    continue
                try:
                    results.setdefault(key, []).append(_run_case(engine_name, mode, ep, steps, warmup))
                except Exception as error:  # noqa: BLE001 - one engine refusing a case is a result
                    results.setdefault(key, []).append({"error": f"{type(error).__name__}: {error}"[:300]})
                dist.barrier()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def summarize(raw: dict[str, list]) -> list[dict]:
    rows = []
    for ep in EP_SIZES:
        for engine_name, mode in CASES:
            runs = raw.get(f"{engine_name} {mode} ep{ep}", [])
            ok = [r for r in runs if "step_ms" in r]
            row = {"ep": ep, "engine": engine_name, "mode": mode, "rounds": [r["step_ms"] for r in ok]}
            if ok:
                row["step_ms"] = statistics.median(row["rounds"])
                row["moe_params_per_rank"] = ok[0]["moe_params_per_rank"]
            else:
                row["error"] = runs[0]["error"] if runs else "not run"
            rows.append(row)
    for row in rows:
        peer = next((r for r in rows if r["ep"] == row["ep"] and r["mode"] == row["mode"] and r["engine"] == "deepspeed"), None)
        if row["engine"].startswith("partita") and peer and "step_ms" in peer and "step_ms" in row:
            row["speedup_vs_deepspeed"] = peer["step_ms"] / row["step_ms"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=output_file, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=output_file, default=None, help="write the raw and summarized results here")
    parser.add_argument("--port", type=int, default=29641)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, args.steps, args.warmup, args.out)
        return
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from common import git_commit, hardware_summary, versions

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "raw.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(args.port),
               __file__, "--worker", "--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--out", out]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
        began = time.time()
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"worker job failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        raw = json.load(open(out))
    rows = summarize(raw)
    print(f"MoE step (fwd+bwd+AdamW, ZeRO-2, fp32) on 4 CPU processes: {SIZE}")
    print(f"{'ep':>3} {'engine':<17}{'mode':<10}{'step ms':>9}  {'rounds':<26}{'vs DeepSpeed':>13}")
    for r in rows:
        if "step_ms" not in r:
            print(f"{r['ep']:>3} {r['engine']:<17}{r['mode']:<10}  {r['error']}")
            continue
        rounds = "/".join(f"{v:.0f}" for v in r["rounds"])
        speed = f"{r['speedup_vs_deepspeed']:.2f}x" if "speedup_vs_deepspeed" in r else ""
        print(f"{r['ep']:>3} {r['engine']:<17}{r['mode']:<10}{r['step_ms']:>9.1f}  {rounds:<26}{speed:>13}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(began)), "size": SIZE,
                       "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
                       "command": " ".join(["python", "benchmarks/moe_cpu.py", *sys.argv[1:]]),
                       "commit": git_commit(REPO), "hardware": hardware_summary(), "versions": versions(),
                       "rows": rows, "raw": raw}, f, indent=2)


if __name__ == "__main__":
    main()
