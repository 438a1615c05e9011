"""The memory estimator against the GPU: predicted vs measured allocated and reserved peaks.

Issue 32 item 7. Each setting trains partita's reference GPT for ``--steps`` steps (bf16, fused
AdamW, one process) in a fresh subprocess, so one setting's cached blocks never shape the next
one's peaks, under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` as ``partita run`` gives
its ranks (one setting runs torch's fixed segments instead). Per setting it records
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over the whole run (the first
step allocates the optimizer states), the allocator's counters (retries, OOMs, peak inactive
split bytes) and a snapshot summary (segments, reserved, largest free block), next to
``partita estimate``'s allocated peak and predicted reserved memory for the setup that ran (the
one-rank gradient fold read back from the engine), and the relative error of each. The loop keeps
the logits until backward, as the estimate assumes (``logits, loss = engine(x, y)``).

The settings cover stages 0-3, micro-batches 1-64, checkpointing none / selective / every, GPT
125M to 1.3B, frozen parameters built under ``zero.Init`` at ZeRO-3, sequence tiling (tiled loss
and MLP) and the fixed-segment allocator. Designed for one H200 within about 6 minutes
(``--budget-s``, default 330: settings that would start after it are skipped and listed).

    python benchmarks/estimator_accuracy_gpu.py --out $OUT/estimator_accuracy.json
    python benchmarks/estimator_accuracy_gpu.py --settings s0_125m_mb64,s3_350m_frozen --out $OUT/a.json
    python benchmarks/estimator_accuracy_gpu.py --cpu-dry-run --out /tmp/dry.json   # CPU, tiny shapes

``--cpu-dry-run`` (or ``--tiny``) runs the same path on CPU (gloo, fp32, each setting's features at a
tiny GPT shape): the prediction, the engine, the steps and the JSON, with ``null`` for the CUDA counters.

The last four settings run ``examples/train_gpt.py``'s loop, the one whose ``partita tune`` trials ran
out of memory at micro-batch 128 (an evaluation forward first, the previous logits held through the
next forward): each habit alone at micro-batch 64, then both at the largest micro-batches the tuner
launches on an H200. Each row carries the tuner's guard (``partita.autotune.tuner.guard_bytes``),
whether the tuner would launch the point, and, for an out-of-memory error, the allocator's figures
(``partita.autotune.runner.oom_figures``); ``summary.over_tune_guard`` lists launched points that ran
out of memory or reserved more than the guard.
Goal (issue 32): every reserved prediction within 5% of the measurement; no launched point over the
tuner's guard.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
from output_paths import output_file  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
GOAL = 0.05
TUNE_HEADROOM = 0.95  # partita tune --headroom 0.05 (partita/autotune/cli.py)


@dataclass(frozen=True)
class Setting:
    """One run: a GPT shape and what partita does with it."""

    name: str
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    stage: int
    micro_batch: int
    checkpointing: str = "none"
    frozen_blocks: int = 0  # the first blocks frozen (requires_grad False), built under zero.Init
    loss_tile_tokens: int | None = None
    mlp_tile_tokens: int | None = None
    alloc_conf: str = "expandable_segments:True"
    vocab: int = 50304
    # examples/train_gpt.py's loop, the one partita tune's out-of-memory trials ran: an evaluation
    # forward (no_grad) of one micro-batch before training (``evaluate``, --eval-batches 1), and the
    # previous step's logits kept through the next forward (``logits, loss = engine(x, y)``, no del).
    eval_first: bool = False
    hold_logits: bool = False
    extra: dict = field(default_factory=dict)

    def tiny(self) -> Setting:
        """The same features at a CPU-sized shape (--cpu-dry-run)."""
        tiles = {"loss_tile_tokens": 24 if self.loss_tile_tokens else None,
                 "mlp_tile_tokens": 16 if self.mlp_tile_tokens else None}
        return replace(self, d_model=32, n_layers=2, n_heads=2, seq_len=64, vocab=256,
                       micro_batch=min(self.micro_batch, 2), frozen_blocks=min(self.frozen_blocks, 1), **tiles)


SETTINGS: tuple[Setting, ...] = (
    Setting("s0_125m_mb16", 768, 12, 12, 1024, 0, 16),
    Setting("s1_125m_mb32", 768, 12, 12, 1024, 1, 32),
    Setting("s0_125m_mb64", 768, 12, 12, 1024, 0, 64),  # activation-dominated, as the tune sweep's OOM
    Setting("s1_125m_mb32_fixed", 768, 12, 12, 1024, 1, 32, alloc_conf=""),  # torch's fixed segments
    Setting("s2_350m_mb8_every", 1024, 24, 16, 1024, 2, 8, "every"),
    Setting("s3_350m_mb8", 1024, 24, 16, 1024, 3, 8),
    Setting("s3_350m_frozen", 1024, 24, 16, 1024, 3, 8, "every", frozen_blocks=12),
    Setting("s1_760m_mb4_selective", 1536, 24, 16, 2048, 1, 4, "selective"),
    Setting("s2_760m_tiled", 1536, 24, 16, 8192, 2, 1, "every", loss_tile_tokens=2048, mlp_tile_tokens=4096),
    Setting("s2_1.3b_mb2", 2048, 24, 16, 2048, 2, 2),
    Setting("s3_1.3b_mb4_every", 2048, 24, 16, 2048, 3, 4, "every"),
    Setting("s0_1.3b_mb1_every", 2048, 24, 16, 2048, 0, 1, "every"),
    # The tune sweep's pattern: s0_125m_mb64 under examples/train_gpt.py's loop, one habit at a time,
    # then both at the largest micro-batch partita tune launches on an H200 at stages 0 and 3 (guards 125.0 GiB <
    # 132.8 GiB; 120 is pruned at 133.8): an out-of-memory error there is a tune sweep that would fail.
    Setting("s0_125m_mb64_eval", 768, 12, 12, 1024, 0, 64, eval_first=True),
    Setting("s0_125m_mb64_held", 768, 12, 12, 1024, 0, 64, hold_logits=True),
    Setting("s0_125m_mb112_example", 768, 12, 12, 1024, 0, 112, eval_first=True, hold_logits=True),
    Setting("s3_125m_mb112_example", 768, 12, 12, 1024, 3, 112, eval_first=True, hold_logits=True),
)


def _config(s: Setting, *, cuda: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": s.micro_batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": s.stage, **s.extra},
    }
    if cuda:
        cfg["bf16"] = {"enabled": True}
    if s.checkpointing != "none":
        cfg["activation_checkpointing"] = {"policy": s.checkpointing}
    if s.loss_tile_tokens or s.mlp_tile_tokens:
        cfg["sequence_tiling"] = {"loss_tile_tokens": s.loss_tile_tokens, "mlp_tile_tokens": s.mlp_tile_tokens}
    return cfg


def _build(s: Setting, cfg: dict, device):
    """The GPT on ``device``; with frozen blocks, built under zero.Init (their weights arrive sharded)."""
    import torch

    import partita
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=s.vocab, block_size=s.seq_len, n_layer=s.n_layers, n_head=s.n_heads,
                       n_embd=s.d_model)
    with torch.device(device):
        if s.frozen_blocks:
            with partita.zero.Init(config_dict_or_path=cfg):
                model = GPT(config)
        else:
            model = GPT(config)
    for block in list(model.blocks)[: s.frozen_blocks]:
        block.requires_grad_(False)
    return model


def _snapshot_summary() -> dict[str, Any]:
    """Segments, reserved bytes and the largest free block at the end of the run."""
    import torch

    segments = torch.cuda.memory_snapshot()
    free = [b["size"] for seg in segments for b in seg["blocks"] if b["state"] == "inactive"]
    return {"segments": len(segments), "reserved_gib": sum(seg["total_size"] for seg in segments) / GIB,
            "largest_free_block_gib": max(free, default=0) / GIB, "free_blocks": len(free),
            "expandable": any(seg.get("is_expandable", False) for seg in segments)}


def run_setting(s: Setting, *, steps: int, cuda: bool) -> dict[str, Any]:
    """Train ``s`` for ``steps`` steps in this process; predicted and measured peaks."""
    import torch
    import torch.distributed as dist

    import partita
    from partita.estimate import GPTShape, Setup, estimate_memory
    from partita.estimate.allocator import allocator_from_conf
    from partita.estimate.model_info import model_info

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    cfg = _config(s, cuda=cuda)
    model = _build(s, cfg, device)
    groups = model.optimizer_param_groups(0.1)
    shape = GPTShape(s.d_model, s.n_layers, s.n_heads, s.vocab, s.seq_len)
    info = model_info(model, param_groups=groups)  # before initialize: zero.Init's shards are still known
    from dataclasses import replace as _replace

    info = _replace(info, gpt=shape)  # the reference GPT: its activations are counted
    engine, _, _, _ = partita.initialize(model=model, model_parameters=groups, config=cfg)
    fold = engine.config.zero_optimization.one_rank_gradient_fold  # what initialize chose runs
    setup = Setup.from_config(cfg, world_size=1, fold_gradients_at_end=fold in ("end", "stream"),
                              streamed_step=fold == "stream", allocator=allocator_from_conf(s.alloc_conf).kind,
                              logits_held_to_next_step=s.hold_logits)
    estimate = estimate_memory(info, setup)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, s.vocab, (s.micro_batch, s.seq_len), device=device, generator=gen)
    y = torch.randint(0, s.vocab, (s.micro_batch, s.seq_len), device=device, generator=gen)
    status, losses, start = "ok", [], time.perf_counter()
    # Running peaks after each step: the held logits' hole can only appear from the second step on.
    per_step: list[tuple[float, float]] = []
    try:
        if s.eval_first:  # examples/train_gpt.py's evaluate(): a no_grad forward, its outputs dropped
            engine.eval()
            with torch.no_grad():
                engine(x, y)
            engine.train()
        for _ in range(steps):
            logits, loss = engine(x, y)  # the logits held until backward, as the estimate assumes
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            if cuda:
                per_step.append((torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB))
            if not s.hold_logits:  # the example keeps them until the next forward returns
                logits = loss = None
        logits = loss = None
        if cuda:
            torch.cuda.synchronize()
    except torch.OutOfMemoryError as error:
        from partita.autotune.runner import oom_figures

        status = "oom: " + str(error).splitlines()[0][:200]
        oom = oom_figures(str(error))  # requested, allocated, cached but unusable, capacity (bytes)
    else:
        oom = None
    predicted_alloc, predicted_res = estimate.peak_accelerator, estimate.reserved_accelerator
    from partita.autotune.tuner import guard_bytes

    guard = guard_bytes(info, setup)  # what partita tune requires free for this point
    row: dict[str, Any] = {
        "setting": s.name, "status": status, "fold": fold, "steps": len(losses), "losses": losses,
        "seconds": time.perf_counter() - start, "config": cfg, "alloc_conf": s.alloc_conf,
        "predicted": {"allocated_gib": predicted_alloc / GIB, "reserved_gib": predicted_res / GIB,
                      "phase": estimate.peak("accelerator")[1],
                      "reserved_parts": estimate.reserved.to_dict() if estimate.reserved else None,
                      "tune_guard_gib": guard / GIB},
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, "oom": oom,
    }
    if cuda:
        stats = torch.cuda.memory_stats()
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        row["measured"] = {"allocated_gib": allocated / GIB, "reserved_gib": reserved / GIB,
                           "num_alloc_retries": stats.get("num_alloc_retries", 0), "num_ooms": stats.get("num_ooms", 0),
                           "inactive_split_peak_gib": stats.get("inactive_split_bytes.all.peak", 0) / GIB,
                           "running_peaks_per_step_gib": per_step,  # (allocated, reserved) after each step
                           "snapshot": _snapshot_summary()}
        row["error"] = {"allocated": predicted_alloc / allocated - 1.0, "reserved": predicted_res / reserved - 1.0,
                        "tune_guard": guard / reserved - 1.0}
        # partita tune's budget on this GPU (the device's memory less its default 5% headroom).
        row["tune_launches"] = guard <= TUNE_HEADROOM * torch.cuda.get_device_properties(device).total_memory
    else:
        row["measured"], row["error"] = None, None
    dist.destroy_process_group()
    return row


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(s: Setting, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PYTORCH_CUDA_ALLOC_CONF": s.alloc_conf, "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))}
    command = [sys.executable, __file__, "--worker", s.name, "--steps", str(args.steps)]
    command += ["--cpu-dry-run"] * args.cpu_dry_run
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        return {"setting": s.name, "status": f"timed out after {args.timeout_s} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        return {"setting": s.name, "status": f"failed ({done.returncode})", "stderr": done.stderr[-3000:]}
    return json.loads(lines[-1][len("RESULT "):])


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Worst errors over the measured rows and how many reserved predictions meet the 5% goal."""
    measured = [r for r in rows if r.get("error")]
    worst = {k: max((abs(r["error"][k]) for r in measured), default=None) for k in ("allocated", "reserved")}
    return {"settings": len(rows), "measured": len(measured),
            "within_goal_reserved": sum(abs(r["error"]["reserved"]) <= GOAL for r in measured),
            "under_predicted_reserved": [r["setting"] for r in measured if r["error"]["reserved"] < 0],
            "worst_abs_error": worst, "oom": [r["setting"] for r in rows if str(r.get("status", "")).startswith("oom")],
            # partita tune would launch these, and they ran out of memory or reserved more than its guard.
            "over_tune_guard": [r["setting"] for r in measured if r.get("tune_launches") and (
                r["error"].get("tune_guard", 0.0) < 0 or str(r.get("status", "")).startswith("oom"))],
            "not_ok": [r["setting"] for r in rows if r.get("status") != "ok"]}


def _print_row(r: dict[str, Any]) -> None:
    p, m = r.get("predicted"), r.get("measured")
    if m:
        print(f"{r['setting']:<24} {r['status']:<4} alloc {m['allocated_gib']:7.2f} (est {p['allocated_gib']:7.2f}, "
              f"{r['error']['allocated']:+.3f})  reserved {m['reserved_gib']:7.2f} (est {p['reserved_gib']:7.2f}, "
              f"{r['error']['reserved']:+.3f})  tune guard {p['tune_guard_gib']:7.2f} "
              f"({'launched' if r.get('tune_launches') else 'pruned'})", flush=True)
    elif p:
        print(f"{r['setting']:<24} {r['status']:<4} est alloc {p['allocated_gib']:.4f} GiB, reserved "
              f"{p['reserved_gib']:.4f} GiB ({r['steps']} steps, losses {r['losses']})", flush=True)
    else:
        print(f"{r['setting']:<24} {r['status']}\n{r.get('stderr', '')}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=None, help="comma-separated names (default: all): "
                        + ", ".join(s.name for s in SETTINGS))
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per setting (default 3)")
    parser.add_argument("--budget-s", type=float, default=330.0, help="no setting starts after this (default 330)")
    parser.add_argument("--timeout-s", type=int, default=150, help="seconds per setting (default 150)")
    parser.add_argument("--cpu-dry-run", "--tiny", dest="cpu_dry_run", action="store_true",
                        help="CPU, gloo, fp32, tiny shapes: the same code path (a smoke run)")
    parser.add_argument("--out", type=output_file, default=None, help="JSON written after every setting")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    by_name = {s.name: s for s in SETTINGS}
    if args.worker:
        s = by_name[args.worker]
        print("RESULT " + json.dumps(run_setting(s.tiny() if args.cpu_dry_run else s, steps=args.steps,
                                                 cuda=not args.cpu_dry_run)), flush=True)
        return 0
    names = args.settings.split(",") if args.settings else list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        parser.error(f"unknown setting(s) {unknown}; choose from {', '.join(by_name)}")
    if not args.cpu_dry_run:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device: run on a GPU, or pass --cpu-dry-run to check the script on CPU")
    started, rows, skipped = time.monotonic(), [], []
    report: dict[str, Any] = {"benchmark": "estimator_accuracy_gpu", "date_utc": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                              "cpu_dry_run": args.cpu_dry_run, "settings": [asdict(by_name[n]) for n in names]}
    for name in names:
        if time.monotonic() - started > args.budget_s:
            skipped.append(name)
            continue
        rows.append(_launch(by_name[name], args))
        _print_row(rows[-1])
        report.update(rows=rows, skipped_for_budget=skipped, summary=summarize(rows))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
    report.update(rows=rows, skipped_for_budget=skipped, summary=summarize(rows),
                  elapsed_s=time.monotonic() - started)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"]), flush=True)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
