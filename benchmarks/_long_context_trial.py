"""One attempt of benchmarks/long_context.py: a system's training step at one length (plain torch,
FSDP2, DeepSpeed or partita), the ``trial`` command that runs it and reports progress lines, and
:func:`_attempt`, which runs a trial in a fresh process so an out-of-memory attempt leaves nothing
behind for the next."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

GIB = 2**30
# Trials run the benchmark's own command line (``long_context.py trial``) in a fresh process.
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "long_context.py")


def _model_config(name: str, seq: int, **tiling):
    from partita.models.gpt import GPTConfig

    if name == "tiny":
        return GPTConfig(vocab_size=256, block_size=seq, n_layer=2, n_head=4, n_embd=64, **tiling)
    shapes = {"gpt-1.3b": GPTConfig.gpt_1_3b(), "gpt-7b": GPTConfig.gpt_7b()}
    if name not in shapes:
        raise SystemExit(f"--model {name!r}: choose tiny, gpt-1.3b or gpt-7b")
    base = shapes[name]
    return GPTConfig(vocab_size=base.vocab_size, block_size=seq, n_layer=base.n_layer, n_head=base.n_head,
                     n_embd=base.n_embd, **tiling)  # fmt: skip


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / GIB if device == "cuda" else None


def _single_rank_env() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def _build(system: str, model_name: str, seq: int, device: str, partita_config: dict, levers: dict | None = None):
    """step(length) for one system: forward, backward and the optimizer once on ``length`` tokens
    (at most ``seq``, the model's block_size); returns the loss.

    ``levers`` (system ``torch-levers``): {"loss_tile_tokens", "mlp_tile_tokens"} on the plain torch
    loop, with every block's checkpoint offloaded to CPU. ``partita`` gets its levers from
    ``partita_config`` (sequence_tiling, activation_checkpointing)."""
    from partita.activation_checkpointing import apply_activation_checkpointing
    from partita.models.gpt import GPT

    torch.manual_seed(0)
    tiling = dict(levers or {}) if system == "torch-levers" else {}
    config = _model_config(model_name, seq, **tiling)
    bf16 = device == "cuda"
    with torch.device(device):
        model = GPT(config)
    if not (system == "partita" and "activation_checkpointing" in partita_config):  # else initialize does it
        apply_activation_checkpointing(model, policy="every", cpu_offload=system == "torch-levers")
    tokens = torch.randint(0, config.vocab_size, (1, seq), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    if system == "torch-levers":
        system = "torch"
    if system in ("torch", "fsdp2"):
        if system == "fsdp2":
            import torch.distributed as dist
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            _single_rank_env()
            dist.init_process_group("nccl" if device == "cuda" else "gloo")
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
            for block in model.blocks:
                fully_shard(block, **({"mp_policy": policy} if policy else {}))
            fully_shard(model, **({"mp_policy": policy} if policy else {}))
            autocast = contextlib.nullcontext()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")

        def step(length: int, on_forward=None) -> float:
            x = tokens[:, :length]
            with autocast:
                _, loss = model(x, x)
            if on_forward:
                on_forward(loss)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss)

        return step
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
        **({"bf16": {"enabled": True}} if bf16 else {}),
    }
    if system == "deepspeed":
        import deepspeed

        _single_rank_env()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    elif system == "partita":
        import partita

        _single_rank_env()
        engine, *_ = partita.initialize(model=model, config={**cfg, **partita_config})
    else:
        raise SystemExit(f"unknown system {system!r}: choose torch, torch-levers, fsdp2, deepspeed or partita")

    def engine_step(length: int, on_forward=None) -> float:
        x = tokens[:, :length]
        _, loss = engine(x, x)
        if on_forward:
            on_forward(loss)
        engine.backward(loss)
        engine.step()
        return float(loss)

    return engine_step


def _progress(path: str | None, **row: Any) -> None:
    """One line of a trial's progress (JSON lines): what is left when the attempt is cut off."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"t": round(time.time(), 1), **row}) + "\n")


def trial(args: argparse.Namespace) -> dict[str, Any]:
    """One attempt (run in its own process by ``search`` / ``one-gpu``): steps at one length, or the error.

    With ``--prime-seq`` one step at that short length runs first, so the optimizer states and
    gradient buffers exist before the long steps (their peak is then a steady-state step's, even
    with ``--steps 1``)."""
    device = args.device
    started = time.perf_counter()
    levers = {"loss_tile_tokens": args.loss_tile, "mlp_tile_tokens": args.mlp_tile}
    try:
        step = _build(args.system, args.model, args.seq, device, json.loads(args.partita_config), levers)
        _progress(args.progress, event="built", seq=args.seq, build_s=time.perf_counter() - started)
        if args.prime_seq:
            step(min(args.prime_seq, args.seq))
            _progress(args.progress, event="primed", seq=args.prime_seq, peak_gib=_peak_gib(device))
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for index in range(args.steps):
            _sync(device)
            start = time.perf_counter()
            def forward_done(loss: torch.Tensor, index: int = index) -> None:
                _progress(args.progress, event="forward", seq=args.seq, index=index, loss=float(loss.detach()),
                          forward_s=time.perf_counter() - start, peak_gib=_peak_gib(device))  # fmt: skip

            losses.append(step(args.seq, forward_done if args.progress else None))
            _sync(device)
            times.append(time.perf_counter() - start)
            _progress(args.progress, event="step", seq=args.seq, index=index, step_s=times[-1], loss=losses[-1],
                      peak_gib=_peak_gib(device))  # fmt: skip
        median = statistics.median(times[1:] if len(times) > 1 else times)
        finite = all(math.isfinite(loss) for loss in losses)
        return {"ok": finite, "seq": args.seq, "steps": args.steps, "step_s": median, "tokens_per_s": args.seq / median,
                "losses": losses, "peak_gib": _peak_gib(device), **({} if finite else {"error": "non-finite loss"})}  # fmt: skip
    except torch.OutOfMemoryError as error:
        return {"ok": False, "seq": args.seq, "error": f"out of memory: {str(error)[:200]}", "peak_gib": _peak_gib(device)}
    except RuntimeError as error:  # CPU allocators and NCCL report memory exhaustion as RuntimeError
        return {"ok": False, "seq": args.seq, "error": str(error)[:300]}


def _attempt(args: argparse.Namespace, system: str, seq: int, steps: int, *, partita_config: str | None = None,
             prime_seq: int = 0, timeout: float | None = None) -> dict[str, Any]:  # fmt: skip
    """One trial in a fresh process (an out-of-memory attempt leaves nothing behind); a trial cut
    off by ``timeout`` returns what its progress lines say it finished."""
    import tempfile

    progress = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False).name
    command = [sys.executable, SCRIPT, "trial", "--system", system, "--seq", str(seq),
               "--model", args.model, "--device", args.device, "--steps", str(steps),
               "--partita-config", partita_config or args.partita_config, "--prime-seq", str(prime_seq),
               "--loss-tile", str(args.loss_tile), "--mlp-tile", str(args.mlp_tile), "--progress", progress]  # fmt: skip
    # Both alike: fewer out-of-memory failures from fragmentation between differently sized tiles.
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout or args.trial_timeout, env=env)
    except subprocess.TimeoutExpired:
        row = {"ok": None, "seq": seq, "error": f"cut off after {timeout or args.trial_timeout:.0f} s (budget)"}
    else:
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"ok": False, "seq": seq, "error": f"exit {done.returncode}: {done.stderr[-400:]}"}
    with open(progress) as f:
        row["progress"] = [json.loads(line) for line in f if line.strip()]
    os.unlink(progress)
    row["wall_s"] = time.perf_counter() - started
    return row
