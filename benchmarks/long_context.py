"""Long-context benchmarks: longest trainable sequence, tokens/s, sparse attention, sequence parallelism.

    # One H200, issue 16's figures in budgeted runs (JSON rewritten after every row):
    python benchmarks/long_context.py one-gpu --out r.json                 # all phases, --budget-s 480
    # in three commands of under 10 minutes each (docs/performance.md):
    python benchmarks/long_context.py one-gpu --skip-plain --skip-levers --budget-s 470 --out a.json
    python benchmarks/long_context.py one-gpu --skip-throughput --skip-sparse --search-steps 2 \
        --lever-seqs 262144 --budget-s 470 --out b.json
    python benchmarks/long_context.py one-gpu --skip-throughput --skip-sparse --skip-plain \
        --lever-seqs 524288 --search-steps 1 --budget-s 560 --out c.json  # the 512k headline
    python benchmarks/long_context.py one-gpu --tiny --out /tmp/t.json     # CPU check of the script
    # One H200, the older per-question commands:
    python benchmarks/long_context.py search --model gpt-1.3b --systems torch,fsdp2,deepspeed,partita --out r.json
    python benchmarks/long_context.py search --model gpt-7b --systems torch,partita --start 16384 --out r7.json
    python benchmarks/long_context.py throughput --model gpt-1.3b --seqs 8192,32768,131072 --out t.json
    python benchmarks/long_context.py sparse --seqs 16384,65536 --out s.json
    python benchmarks/long_context.py kernels --seq 4096 --out k.json   # ring block kernels vs SDPA
    # CPU, tiny sizes (what CI-sized machines can run):
    python benchmarks/long_context.py search --device cpu --model tiny --start 128 --max-seq 1024
    python benchmarks/long_context.py sparse --device cpu --seqs 256,512 --heads 2 --head-dim 16
    python benchmarks/long_context.py sp-steps --device cpu --world 4 --seq 512

``search``: for each system, the longest sequence that trains one optimizer step at micro-batch 1
(bf16 on GPU, every block checkpointed, AdamW), doubling from ``--start`` and then halving the gap
down to ``--granularity``. Each attempt runs in a fresh subprocess, so an out-of-memory attempt
leaves nothing behind for the next. Systems: ``torch`` (what users run: fp32 weights, bf16
autocast, fused AdamW), ``fsdp2`` (``fully_shard`` on one rank, bf16 mixed precision), ``deepspeed`` (ZeRO-3, bf16; only if
installed), ``partita`` (ZeRO-3, bf16, plus ``--partita-config`` JSON merged in for the
long-context options). The reference GPT's learned position table grows with the sequence
(``block_size`` = the sequence); it is included in every system alike.

``one-gpu``: four phases, each skippable (``--skip-throughput``, ``--skip-sparse``, ``--skip-plain``,
``--skip-levers``), within ``--budget-s`` for the whole run. *throughput*: partita with the
long-context levers (every block checkpointed, checkpoints in CPU memory, ``sequence_tiling``
loss and MLP tiles ``--loss-tile`` / ``--mlp-tile``) at ``--throughput-seqs``, tokens/s of the
median step after the first. *sparse*: the ``sparse`` command at ``--sparse-seqs``. *plain*: plain
torch (every block checkpointed, nothing else) at ``--plain-seqs`` ascending, up to its first
failure. *levers*: partita with the levers at ``--lever-seqs`` ascending, up to the first failure.
A length "trains" when, after one priming step at ``--prime-seq`` tokens (so optimizer states and
gradient buffers exist and the peak is a steady-state step's), ``--search-steps`` steps at the
length run with every loss finite; when the budget is short the step count drops (to 1), and an
attempt predicted not to fit is skipped (step time scaled by the square of the length from the
longest attempt done). An attempt cut off at the budget keeps its progress lines (build, priming,
each forward and step with the peak memory so far). ``--tiny``: CPU, the tiny model, tiny lengths.

``throughput``: partita's tokens/s at each of ``--seqs`` (median step after warm-up).
``sparse``: forward + backward time of ``SparseSelfAttention`` (fixed, bigbird; FlexAttention,
compiled on CUDA) against dense causal SDPA at each length.
``sp-steps``: ``--world`` gloo processes train the tiny GPT with ``sequence_parallel_size`` =
world, Ulysses and ring; median step time each.
``kernels``: ring attention's fused block kernels checked against SDPA on this device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import math
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # partita from this checkout, in every trial process too
GIB = 2**30


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
    command = [sys.executable, os.path.abspath(__file__), "trial", "--system", system, "--seq", str(seq),
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


def search(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for system in args.systems.split(","):
        attempts, good, bad = [], None, None
        seq = args.start
        while seq <= args.max_seq:  # doubling until the first failure
            row = _attempt(args, system, seq, steps=2)
            attempts.append(row)
            print(json.dumps({"system": system, **row}), flush=True)
            if not row["ok"]:
                bad = seq
                break
            good, seq = seq, seq * 2
        while good is not None and bad is not None and bad - good > args.granularity:  # halve the gap
            mid = (good + bad) // 2 // args.granularity * args.granularity
            if mid in (good, bad):
                break
            row = _attempt(args, system, mid, steps=2)
            attempts.append(row)
            print(json.dumps({"system": system, **row}), flush=True)
            good, bad = (mid, bad) if row["ok"] else (good, mid)
        results[system] = {"longest_seq": good, "first_failure": bad, "attempts": attempts}
    return results


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
    command = [sys.executable, os.path.abspath(__file__), "sparse", "--device", args.device, "--seqs",
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


def throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        row = _attempt(args, "partita", seq, steps=args.steps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def sparse(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    from partita.ops.sparse_attention import BigBirdSparsityConfig, FixedSparsityConfig, SparseSelfAttention

    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        patterns = {
            "fixed": FixedSparsityConfig(num_heads=args.heads, block=args.block, attention="unidirectional"),
            "bigbird": BigBirdSparsityConfig(num_heads=args.heads, block=args.block, attention="unidirectional"),
        }
        layers: dict[str, Any] = {"dense_sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
        for name, pattern in patterns.items():
            layers[name] = SparseSelfAttention(pattern, max_seq_length=seq)
        for name, layer in layers.items():
            q, k, v = (torch.randn(1, args.heads, seq, args.head_dim, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))  # fmt: skip
            times = []
            for _ in range(args.steps + 1):
                _sync(device)
                start = time.perf_counter()
                layer(q, k, v).sum().backward()
                _sync(device)
                times.append(time.perf_counter() - start)
            density = None if name == "dense_sdpa" else float(layer.layout(seq).float().mean())
            rows.append({"seq": seq, "attention": name, "fwd_bwd_ms": 1e3 * statistics.median(times[1:]),
                         "block_density": density})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def kernels(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Ring attention's block-kernel contract on this device, without a ring: keys and values cut in
    two blocks, each block's (out, lse) merged, then each block's backward given the merged out and
    lse; outputs and gradients against SDPA on the whole sequence. The GPU check for the fused CUDA
    kernels, which CPU CI cannot reach."""
    import torch.nn.functional as F

    from partita.sequence.block_kernels import pick_kernel
    from partita.sequence.ring import _merge

    device = args.device
    rows = []
    for dtype in (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,):
        for prefer_math in (False, True):
            gen = torch.Generator(device=device).manual_seed(0)
            shape = (2, args.heads, args.seq, args.head_dim)
            q, k, v, dout = (torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(4))
            kernel = pick_kernel(q, prefer_math=prefer_math)
            scale = args.head_dim**-0.5
            half = args.seq // 2
            # Queries of the second half: causal against their own block, full against the first.
            q2 = q[:, :, half:].contiguous()
            blocks = [(k[:, :, :half].contiguous(), v[:, :, :half].contiguous(), False),
                      (k[:, :, half:].contiguous(), v[:, :, half:].contiguous(), True)]  # fmt: skip
            out = torch.zeros(q2.shape, device=device, dtype=torch.float32)
            lse = torch.full(q2.shape[:-1], float("-inf"), device=device)
            for kb, vb, causal in blocks:
                _merge(out, lse, *kernel.forward(q2, kb, vb, causal=causal, scale=scale))
            out = out.to(dtype)
            dq = torch.zeros(q2.shape, device=device, dtype=torch.float32)
            dkv = []
            for kb, vb, causal in blocks:
                g = kernel.backward(dout[:, :, half:].contiguous(), q2, kb, vb, out, lse, causal=causal, scale=scale)
                dq += g[0]
                dkv.append((g[1], g[2]))
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*inputs, is_causal=True)
            ref.backward(torch.cat([torch.zeros_like(dout[:, :, :half]), dout[:, :, half:]], dim=2))
            ref_dk, ref_dv = inputs[1].grad, inputs[2].grad
            err = {
                "out": float((out.float() - ref.detach()[:, :, half:].float()).abs().max()),
                "dq": float((dq - inputs[0].grad[:, :, half:].float()).abs().max()),
                "dk": float((torch.cat([dkv[0][0], dkv[1][0]], 2).float() - ref_dk.float()).abs().max()),
                "dv": float((torch.cat([dkv[0][1], dkv[1][1]], 2).float() - ref_dv.float()).abs().max()),
            }
            rows.append({"dtype": str(dtype), "kernel": kernel.name, "max_abs_error": err})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _sp_worker(rank: int, world: int, port: int, seq: int, steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(1)
    import torch.distributed as dist

    import partita
    from partita.models.gpt import GPT

    out = {}
    for mode in ("ulysses", "ring"):
        torch.manual_seed(0)
        model = GPT(_model_config("tiny", seq))
        cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
               "sequence_parallel_size": world, "sequence_parallel": {"mode": mode}, "steps_per_print": 10**9}  # fmt: skip
        engine, *_ = partita.initialize(model=model, config=cfg)
        x = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(1))
        times = []
        for _ in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            _, loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - start)
        out[mode] = {"step_ms": 1e3 * statistics.median(times[1:]), "loss": float(loss.detach())}
    queue.put((rank, out))
    dist.destroy_process_group()


def sp_steps(args: argparse.Namespace) -> dict[str, Any]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_sp_worker, args=(r, args.world, port, args.seq, args.steps, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=args.trial_timeout) for _ in procs)
    for p in procs:
        p.join()
    row = {"world": args.world, "seq": args.seq, "model": "tiny (2 layers, 4 heads, d 64)", **results[0]}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("one-gpu", "search", "throughput", "sparse", "sp-steps", "kernels", "trial"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--model", default="gpt-1.3b", help="tiny, gpt-1.3b or gpt-7b")
    parser.add_argument("--systems", default="torch,fsdp2,deepspeed,partita")
    parser.add_argument("--system", default="partita", help="(trial) the one system to run")
    parser.add_argument("--seq", type=int, default=2048, help="(trial, sp-steps) the sequence length")
    parser.add_argument("--seqs", default="8192,32768,131072", help="(throughput, sparse) lengths to time")
    parser.add_argument("--start", type=int, default=32768)
    parser.add_argument("--max-seq", type=int, default=2**21)
    parser.add_argument("--granularity", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--partita-config", default="{}", help="JSON merged into partita's config (search, throughput)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=128, help="(sparse) block size of the patterns")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--trial-timeout", type=float, default=1800)
    parser.add_argument("--out", default=None)
    levers = parser.add_argument_group("one-gpu (and trial)")
    levers.add_argument("--tiny", action="store_true", help="CPU, the tiny model and tiny lengths: a check of the script")
    levers.add_argument("--budget-s", type=float, default=480, help="wall-clock budget of the whole one-gpu run")
    levers.add_argument("--throughput-seqs", default="8192,32768,131072")
    levers.add_argument("--throughput-systems", default="partita", help="comma list: partita (with levers), torch, torch-levers")
    levers.add_argument("--sparse-seqs", default="16384,65536")
    levers.add_argument("--plain-seqs", default="131072,262144", help="plain torch's lengths, ascending")
    levers.add_argument("--lever-seqs", default="262144,524288,786432,1048576", help="ascending; stops at the first failure")
    levers.add_argument("--lever-systems", default="partita", help="comma list: partita, torch-levers")
    levers.add_argument("--search-steps", type=int, default=3, help="steps per length (fewer when the budget is short)")
    levers.add_argument("--prime-seq", type=int, default=1024, help="a first step at this length allocates optimizer states")
    levers.add_argument("--loss-tile", type=int, default=8192, help="sequence_tiling.loss_tile_tokens")
    levers.add_argument("--mlp-tile", type=int, default=16384, help="sequence_tiling.mlp_tile_tokens")
    levers.add_argument("--progress", default=None, help="(trial) JSON-lines progress file")
    for phase in ("throughput", "sparse", "plain", "levers"):
        levers.add_argument(f"--skip-{phase}", action="store_true")
    args = parser.parse_args(argv)
    if args.what == "one-gpu" and args.tiny:
        args.device, args.model = "cpu", "tiny"
        for name, value in (("throughput_seqs", "64,128"), ("sparse_seqs", "256"), ("plain_seqs", "128,256"),
                            ("lever_seqs", "256,512"), ("loss_tile", 48), ("mlp_tile", 40), ("prime_seq", 32),
                            ("heads", 2), ("head_dim", 16), ("block", 16), ("steps", 2), ("search_steps", 2)):  # fmt: skip
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    if args.what == "one-gpu":
        one_gpu(args)
        return
    if args.what == "trial":
        print(json.dumps(trial(args)), flush=True)
        return
    run = {"search": search, "throughput": throughput, "sparse": sparse, "sp-steps": sp_steps, "kernels": kernels}[args.what]
    result = {"what": args.what, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "model": args.model, "result": run(args)}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
