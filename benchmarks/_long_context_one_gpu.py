"""The ``one-gpu`` command of benchmarks/long_context.py: issue 16's four phases (throughput, sparse,
plain, levers) in one budgeted run, with the JSON rewritten after every row, attempts predicted
not to fit skipped, and the longest trainable length per system."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

from _long_context_trial import SCRIPT, _attempt


class _Results:
    """The one-gpu run's JSON, rewritten after every row (atomically), so a run cut off by a
    time limit still leaves every finished row on disk."""

    def __init__(self, path: str | None, meta: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {**meta, "phases": {}}
        self.start = time.perf_counter()

    def add(self, phase: str, row: dict[str, Any]) -> None:
        self.data["phases"].setdefault(phase, []).append(row)
        self.data["elapsed_s"] = time.perf_counter() - self.start
        print(json.dumps({"phase": phase, **{k: v for k, v in row.items() if k != "progress"}}), flush=True)
        if self.path:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1)
            os.replace(tmp, self.path)


def _lever_config(args: argparse.Namespace) -> str:
    """partita's long-context options: every block checkpointed with its checkpoint in CPU memory,
    the loss and the MLPs over token tiles; ``--partita-config`` merged on top."""
    levers = {
        "activation_checkpointing": {"policy": "every", "cpu_checkpointing": True},
        "sequence_tiling": {"loss_tile_tokens": args.loss_tile, "mlp_tile_tokens": args.mlp_tile},
    }
    return json.dumps({**levers, **json.loads(args.partita_config)})


def _predicted_s(rows: list[dict[str, Any]], seq: int, steps: int) -> float | None:
    """Wall time of an attempt, from the longest successful one: start-up as measured, steps
    scaled by (seq / seq0)^2 (attention's share grows to nearly all of a step at long context,
    so this errs long)."""
    done = [r for r in rows if r.get("ok") and r.get("step_s")]
    if not done:
        return None
    last = max(done, key=lambda r: r["seq"])
    startup = max(0.0, last["wall_s"] - last["steps"] * last["step_s"])
    return startup + steps * last["step_s"] * (seq / last["seq"]) ** 2


def _longest(args: argparse.Namespace, results: _Results, phase: str, system: str, seqs: list[int],
             deadline: float, partita_config: str | None) -> None:  # fmt: skip
    """Ascending lengths until the first failure; each with as many of ``--search-steps`` steps as
    the remaining budget allows (at least one, after a priming step), else skipped."""
    rows: list[dict[str, Any]] = []
    # The same system's throughput rows (same options) predict this phase's first attempt too.
    known = [r for r in results.data["phases"].get("throughput", []) if r.get("system") == system]
    for seq in seqs:
        remaining = deadline - time.perf_counter()
        steps = args.search_steps
        while steps > 1 and (_predicted_s(known + rows, seq, steps) or 0) > remaining:
            steps -= 1
        predicted = _predicted_s(known + rows, seq, steps)
        if remaining < 20 or (predicted is not None and predicted > remaining):
            results.add(phase, {"system": system, "seq": seq, "ok": None,
                                "skipped": f"predicted {predicted or 0:.0f} s > remaining budget {remaining:.0f} s"})  # fmt: skip
            break
        row = {"system": system, **_attempt(args, system, seq, steps, partita_config=partita_config,
                                            prime_seq=args.prime_seq, timeout=remaining)}  # fmt: skip
        rows.append(row)
        results.add(phase, row)
        if not row["ok"]:
            break
    good = [r["seq"] for r in rows if r.get("ok")]
    results.add(phase, {"system": system, "longest_seq": max(good) if good else None,
                        "first_failure": next((r["seq"] for r in rows if r.get("ok") is False), None)})  # fmt: skip


def one_gpu(args: argparse.Namespace) -> dict[str, Any]:
    """Issue 16's one-GPU figures in one budgeted run; phases in order, each skippable:

    throughput (partita + levers, tokens/s per length), sparse (FlexAttention patterns vs dense
    SDPA), plain (plain torch's longest), levers (partita + levers' longest). ``--budget-s``
    bounds the whole run: an attempt predicted not to fit is skipped, one running past it is cut
    off with what its progress lines recorded."""
    if args.tiny:
        args.device, args.model = "cpu", "tiny"
    deadline = time.perf_counter() + args.budget_s
    meta = {"what": "one-gpu", "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__, "model": args.model, "budget_s": args.budget_s,
            "levers": json.loads(_lever_config(args)), "prime_seq": args.prime_seq}  # fmt: skip
    results = _Results(args.out, meta)
    levers = _lever_config(args)
    seqs = {name: [int(v) for v in getattr(args, name).split(",")] for name in
            ("throughput_seqs", "sparse_seqs", "plain_seqs", "lever_seqs")}  # fmt: skip
    if not args.skip_throughput:
        for system in args.throughput_systems.split(","):
            for seq in seqs["throughput_seqs"]:
                remaining = deadline - time.perf_counter()
                if remaining < 20:
                    results.add("throughput", {"system": system, "seq": seq, "ok": None, "skipped": "budget spent"})
                    continue
                config = levers if system == "partita" else None
                results.add("throughput", {"system": system, **_attempt(args, system, seq, args.steps,
                            partita_config=config, timeout=remaining)})  # fmt: skip
    if not args.skip_sparse:
        _sparse_phase(args, results, seqs["sparse_seqs"], deadline)
    if not args.skip_plain:
        _longest(args, results, "plain", "torch", seqs["plain_seqs"], deadline, None)
    if not args.skip_levers:
        for system in args.lever_systems.split(","):
            _longest(args, results, "levers", system, seqs["lever_seqs"], deadline, levers if system == "partita" else None)
    return results.data


def _sparse_phase(args: argparse.Namespace, results: _Results, seqs: list[int], deadline: float) -> None:
    """The ``sparse`` command in its own process (a compile failure or a timeout ends only it)."""
    remaining = deadline - time.perf_counter()
    if remaining < 20:
        results.add("sparse", {"ok": None, "skipped": "budget spent"})
        return
    command = [sys.executable, SCRIPT, "sparse", "--device", args.device, "--seqs",
               ",".join(map(str, seqs)), "--heads", str(args.heads), "--head-dim", str(args.head_dim),
               "--block", str(args.block), "--steps", str(args.steps)]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=remaining)
        stdout, error = done.stdout, None if done.returncode == 0 else f"exit {done.returncode}: {done.stderr[-400:]}"
    except subprocess.TimeoutExpired as expired:
        stdout, error = expired.stdout or "", f"cut off after {remaining:.0f} s (budget)"
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
    for line in stdout.splitlines():
        if line.startswith("{"):
            results.add("sparse", json.loads(line))
    if error:
        results.add("sparse", {"ok": False, "error": error})
