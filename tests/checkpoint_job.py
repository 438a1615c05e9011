"""A training job for tests/test_checkpoint_recovery.py, launched with ``partita run --nproc 2 --max-restarts 1``.

It checkpoints every EVERY steps into --save-dir and resumes through the config
(``checkpoint.resume: "latest"``), so a restarted attempt continues where the last complete
checkpoint left off. ``--kill run`` makes rank 1 SIGKILL itself once in the middle of a step;
``--kill save`` once in the middle of writing its checkpoint file. A marker file makes the
kill happen in the first attempt only. Rank 0 writes the final fp32 parameters to --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import signal
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file

import partita
from tests.tiny_models import build_model, make_batches, param_groups

STEPS, EVERY, KILL_STEP, GLOBAL_BATCH = 6, 2, 3, 8


def _die_once(marker: Path) -> None:
    if not marker.exists():
        marker.write_text("killed\n")
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> str:
    """Train, checkpoint and (rank 0) write the parameters; returns rank 0's summary line (printed
    too). Also called in-process by the test's uninterrupted reference run (no kill)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill", choices=["none", "run", "save"], default="none")
    parser.add_argument("--marker", default=None)
    args = parser.parse_args(argv)
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 60},
        "steps_per_print": 1000,
        "checkpoint": {"save_dir": args.save_dir, "resume": "latest"},
    }
    if args.kill == "save":
        # Rank 0 outlives the kill waiting in the checkpoint's store handshake for the dead rank 1;
        # torchrun stops it with SIGTERM and SIGKILLs it only 30 s later (a fixed timeout of its
        # restart path). With save_on_signal's handler installed, SIGTERM is only recorded, so
        # every run sat out those 30 s; without it, SIGTERM ends rank 0 at once. (Resuming is
        # what this test checks; saving on a signal is tests/test_preemption.py's subject.)
        config["checkpoint"]["save_on_signal"] = []
    model = build_model()
    engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    marker = Path(args.marker) if args.marker else None
    if args.kill == "save" and rank == 1:
        import partita.checkpoint.save as save_module

        original = save_module.write_safetensors

        def write_then_die(path, entries, **kwargs):
            if engine.global_steps == 2 * EVERY:  # the second save: a complete one exists already
                Path(path).write_bytes(b"half a file")
                _die_once(marker)
            return original(path, entries, **kwargs)

        save_module.write_safetensors = write_then_die
    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(engine.global_steps, STEPS):
        for m in range(engine.gradient_accumulation_steps()):
            lo = (m * world + rank) * micro
            engine.backward(engine(xs[step][lo : lo + micro], ys[step][lo : lo + micro]))
            if args.kill == "run" and rank == 1 and step == KILL_STEP and m == 1:
                _die_once(marker)  # between backward and step: a crash mid-step
            engine.step()
        if (step + 1) % EVERY == 0:
            engine.save_checkpoint()
    summary = f"finished at step {engine.global_steps}, resumed from {engine.loaded_checkpoint and engine.loaded_checkpoint[0]}"
    if rank == 0:
        save_file({n: p.detach().clone() for n, p in model.named_parameters()}, args.out)
        print(summary)
    return summary


if __name__ == "__main__":
    main()
    # Skip gloo's destructors: torch 2.13's ProcessGroupGloo sometimes aborts at teardown
    # ("terminate called without an active exception") after all the work is done.
    sys.stdout.flush()
    os._exit(0)
