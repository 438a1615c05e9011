"""Count aborts at process exit over many launches of a plain 2-rank partita script.

The failure this measures: on torch 2.13 a rank that has finished its work sometimes dies with
SIGABRT while the interpreter shuts down (``terminate called without an active exception``); a
gloo worker thread drops the last reference to a finished collective and needs the GIL to
release its tensors' Python objects, but the interpreter is already finalizing, so the thread is
unwound through a ``noexcept`` destructor. torchrun then reports the finished job as failed.

Each launch runs :data:`WORKER` (a tiny model, a few steps, optional asynchronous checkpoint and
monitors, then the last loss averaged over the ranks and printed) through ``partita run --nproc 2``. The script ends as most users' scripts do: no
``engine.destroy()``, no ``dist.destroy_process_group()``, no ``os._exit``. Launches cycle through
ZeRO 0-3 x {plain, async checkpoint, csv_monitor, tensorboard, async checkpoint + both
monitors}. A launch counts as an abort when its stderr holds "terminate called" or a rank died
of SIGABRT (exit code 134 from ``partita run``), and as a failure for any other non-zero exit.

    python benchmarks/exit_abort_stress.py --launches 50            # the issue's goal: 0 aborts
    python benchmarks/exit_abort_stress.py --launches 20 --raw      # plain torch, no partita

``--raw`` launches a script that starts the process group with ``partita.distributed.init_distributed``
and then uses torch.distributed alone (a few all-reduces, a barrier, exit): the abort is torch's
(``dist.init_process_group`` in its place aborts as often), and this is the script that hits it
most often, since its last collective comes right before the end. Needs no GPU; results go
to stdout, one line per launch and a summary (also as JSON with ``--json PATH``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
from output_paths import output_file  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

WORKER = textwrap.dedent(
    """
    import json, sys
    import torch
    import partita

    stage, async_save, csv, tb, out = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1", sys.argv[4] == "1", sys.argv[5]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    if csv:
        config["csv_monitor"] = {"enabled": True, "output_path": out, "job_name": "csv"}
    if tb:
        config["tensorboard"] = {"enabled": True, "output_path": out, "job_name": "tb"}
    engine, _, _, _ = partita.initialize(model=model, config=config)
    for step in range(3):
        x = torch.randn(4, 16)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    if async_save:
        engine.save_checkpoint(out + "/ckpt", async_save=True)
    # Report the last loss averaged over ranks, as training scripts do at the end.
    final = loss.detach().clone()
    torch.distributed.all_reduce(final)
    if torch.distributed.get_rank() == 0:
        print("final loss", final.item() / torch.distributed.get_world_size())
    # The script ends here: no engine.destroy(), no destroy_process_group(), no os._exit().
    """
)

RAW_WORKER = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from partita.distributed import init_distributed
    init_distributed(backend="gloo")
    t = torch.ones(1000)
    for _ in range(5):
        dist.all_reduce(t)
    dist.barrier()
    """
)

STAGES = (0, 1, 2, 3)
# (async checkpoint, csv_monitor, tensorboard)
EXTRAS = ((False, False, False), (True, False, False), (False, True, False), (False, False, True), (True, True, True))


def variants() -> itertools.cycle:
    """ZeRO stage x extras, interleaved so any prefix of the launches covers every stage."""
    combos = [(stage, *extra) for extra in EXTRAS for stage in STAGES]
    return itertools.cycle(combos)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    return env


def launch(script: Path, args: list[str], *, timeout_s: float) -> dict:
    """One ``partita run --nproc 2`` of ``script``; its exit code, time and whether it aborted."""
    cmd = [sys.executable, "-m", "partita.launcher.cli", "run", "--nproc", "2", str(script), *args]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout_s)
        code, stderr = done.returncode, done.stderr
    except subprocess.TimeoutExpired as expired:
        code = "timeout"
        stderr = (expired.stderr or b"").decode(errors="replace") if isinstance(expired.stderr, bytes) else (expired.stderr or "")
    aborted = "terminate called" in stderr or code == 134 or "SIGABRT" in stderr
    return {"code": code, "aborted": aborted, "seconds": round(time.perf_counter() - start, 1),
            "stderr_tail": stderr[-2000:] if (code != 0 or aborted) else ""}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=50)
    parser.add_argument("--raw", action="store_true", help="init_distributed + plain torch.distributed collectives")
    parser.add_argument("--offset", type=int, default=0, help="start the variant cycle at this index (0-19)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per launch before it counts as a hang")
    parser.add_argument("--json", type=output_file, default=None, help="also write the per-launch records here")
    args = parser.parse_args(argv)

    records = []
    with tempfile.TemporaryDirectory(prefix="partita-exit-stress-") as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(RAW_WORKER if args.raw else WORKER)
        combos = variants()
        for _ in range(args.offset):
            next(combos)
        for index in range(args.launches):
            if args.raw:
                label, script_args = "raw", []
            else:
                stage, async_save, csv, tb = next(combos)
                out = Path(tmp) / f"run{index}"
                label = f"zero{stage}" + ("+async" if async_save else "") + ("+csv" if csv else "") + ("+tb" if tb else "")
                script_args = [str(stage), str(int(async_save)), str(int(csv)), str(int(tb)), str(out)]
            record = {"launch": index, "variant": label, **launch(script, script_args, timeout_s=args.timeout)}
            records.append(record)
            status = "ABORT" if record["aborted"] else ("ok" if record["code"] == 0 else f"FAILED ({record['code']})")
            print(f"{index + 1:3d}/{args.launches} {label:<22s} {status:<14s} {record['seconds']:6.1f} s", flush=True)
            if record["stderr_tail"]:
                print(textwrap.indent(record["stderr_tail"], "      | "), flush=True)

    aborts = sum(r["aborted"] for r in records)
    failures = sum(r["code"] != 0 and not r["aborted"] for r in records)
    print(f"launches={len(records)} aborts={aborts} other_failures={failures} "
          f"mean_s={sum(r['seconds'] for r in records) / max(len(records), 1):.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 1 if aborts or failures else 0


if __name__ == "__main__":
    sys.exit(main())
