"""One engine, one torchrun job: the worker side of benchmarks/gpu_throughput.py.

Every engine trains the same GPT on the same random tokens with the same optimizer settings
(AdamW through torch's fused kernel, clipping 1.0, no accumulation). On CUDA: bf16 (autocast
for plain torch, bf16 parameters with fp32 reduction for FSDP2, the ``bf16`` section for partita
and DeepSpeed) over NCCL. On CPU (``--device cpu``, the smoke mode that exercises the suite's
logic without a GPU): fp32 over gloo, the same code otherwise.

Each timed step is split into the three phases every engine has — forward, backward and the
optimizer step (clipping, update, zeroing) — timed with CUDA events on GPUs (the GPU time
between the points where the host enqueued each phase) and with the host clock on CPU.

Rank 0 prints one ``RESULT {json}`` line. A rank that runs out of memory prints its own
``RESULT`` line with ``status: "oom"`` and the memory at failure, then exits at once with a
non-zero code: torchrun then stops the other ranks (which would otherwise wait forever in the
next collective), and the driver reads the OOM line instead of treating the job as a crash.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _suite_engines import EngineSpec, parse_engine  # noqa: E402

SIMULATED_OOM = "simulated out of memory (--simulate-oom-engine)"


def _rank_world() -> tuple[int, int]:
    # From the launch environment: valid before (and after) any process group exists.
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _emit(result: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def _host_rss_gib() -> tuple[float, float]:
    """(current, peak) resident memory of this process in GiB (CPU runs have no allocator stats)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        current = peak
    return current, peak


def _is_oom(exc: BaseException) -> bool:
    """An out-of-memory error, also when another layer wrapped it (torch.compile re-raises
    failures of its backend, NCCL reports a failed cudaMalloc as a plain RuntimeError)."""
    import torch

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, torch.OutOfMemoryError):
            return True
        if isinstance(seen, RuntimeError) and ("CUDA out of memory" in str(seen) or "CUDA error: out of memory" in str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _oom_detail(exc: BaseException) -> str:
    """The part of an OOM message worth a table note: CUDA's names the failed allocation in a
    paragraph of advice; keep the allocation, or the first 200 characters of anything else."""
    text = str(exc)
    match = re.search(r"Tried to allocate [\d.]+ \w+", text)
    return match.group(0) if match else text[:200]


class PhaseClock:
    """Marks the four points of each step (start, after forward, after backward, after the
    optimizer step) and turns them into mean milliseconds per phase.

    CUDA events instead of host timestamps on GPUs: the host runs ahead of the GPU, so a host
    clock would time how long enqueuing took, not how long the work took.
    """

    def __init__(self, device: Any, steps: int) -> None:
        import torch

        self.cuda = device.type == "cuda"
        if self.cuda:
            self.events = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(steps)]
        else:
            self.times = [[0.0] * 4 for _ in range(steps)]

    def mark(self, step: int, point: int) -> None:
        if self.cuda:
            self.events[step][point].record()
        else:
            self.times[step][point] = time.perf_counter()

    def phase_ms(self) -> tuple[float, float, float]:
        """Mean forward, backward and optimizer-step milliseconds (call after synchronizing)."""
        if self.cuda:
            spans = [[e[i].elapsed_time(e[i + 1]) for i in range(3)] for e in self.events]
        else:
            spans = [[1000.0 * (t[i + 1] - t[i]) for i in range(3)] for t in self.times]
        n = len(spans)
        fwd, bwd, opt = (sum(s[i] for s in spans) / n for i in range(3))
        return fwd, bwd, opt


def _build(spec: EngineSpec, model: Any, args: argparse.Namespace, device: Any, *,
           cpu_offload: bool = False) -> tuple[Callable, Callable, Callable]:
    """Wrap ``model`` in the engine ``spec`` names; return its (forward, backward, step).

    ``cpu_offload`` (benchmarks/largest_per_setting.py): FSDP2 with ``CPUOffloadPolicy`` on every
    ``fully_shard``; DeepSpeed ZeRO-3 ``-off`` with ``offload_param`` on the CPU as well.
    """
    import torch
    import torch.distributed as dist

    cuda = device.type == "cuda"
    backend = "nccl" if cuda else "gloo"
    adamw = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    base_cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
    }
    if cuda:
        base_cfg["bf16"] = {"enabled": True}

    def compile_blocks_in_place() -> None:
        # Plain torch / FSDP2: each block becomes its own compiled region; hooks added afterwards
        # (fully_shard's) sit on the wrapper, outside the compiled code (torchtitan's recipe).
        for index, block in enumerate(model.blocks):
            model.blocks[index] = torch.compile(block)

    if spec.family in ("torch", "fsdp2"):
        if spec.compiled:
            compile_blocks_in_place()
        dist.init_process_group(backend)
        if spec.family == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if cuda else {}
            if cpu_offload:
                from torch.distributed.fsdp import CPUOffloadPolicy

                kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=cuda)
            for block in model.blocks:
                fully_shard(block, **kwargs)
            fully_shard(model, **kwargs)
            wrapped = model
        else:
            # One rank: plain torch. Several: DDP, the plain-torch way to data-parallel.
            wrapped = model
            if dist.get_world_size() > 1:
                wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **{**adamw, "betas": tuple(adamw["betas"])})
        autocast = cuda and spec.family == "torch"  # FSDP2 casts through its policy instead

        def forward(x: Any, y: Any) -> Any:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                return wrapped(x, y)[1]

        def backward(loss: Any) -> None:
            loss.backward()

        def step() -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return forward, backward, step

    if spec.family == "partita":
        import partita

        cfg = {**base_cfg, "optimizer": {"type": "AdamW", "params": adamw},
               "zero_optimization": {"stage": spec.stage, "reduce_bucket_size": args.bucket,
                                     "allgather_bucket_size": args.bucket}}
        if spec.compiled:
            cfg["compile"] = {"enabled": True, "backend": "inductor"}
        if spec.offload:
            cfg["zero_optimization"]["offload_optimizer"] = {
                "device": "cpu", "pin_memory": cuda, "delayed_param_update": spec.offload in ("delayed", "delayed-overlap"),
                "overlap_step_with_forward": spec.offload in ("overlap", "delayed-overlap"),
                "host_step_16bit_grads": spec.host_16bit_grads}
        args.predicted_peak_gib = _predicted_peak_gib(model, cfg)
        engine, _, _, _ = partita.initialize(model=model, config=cfg)
    else:
        import deepspeed

        if not cuda:
            # DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu, set by the driver) adopts an existing
            # gloo group instead of asking for oneCCL.
            dist.init_process_group("gloo")
        deepspeed.init_distributed(dist_backend=backend)
        cfg = {**base_cfg, "optimizer": {"type": "AdamW", "params": {**adamw, "torch_adam": True, "fused": True}},
               "zero_optimization": {"stage": spec.stage, "reduce_bucket_size": args.bucket,
                                     "allgather_bucket_size": args.bucket, "overlap_comm": cuda}}
        if spec.offload:
            # DeepSpeed's offload steps with its own AVX CPU Adam (JIT-built), not torch's.
            cfg["optimizer"]["params"] = dict(adamw)
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
            if cpu_offload and spec.stage == 3:
                cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": cuda}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def engine_forward(x: Any, y: Any) -> Any:
        return engine(x, y)[1]

    return engine_forward, engine.backward, engine.step


def _predicted_peak_gib(model: Any, cfg: dict) -> float | str:
    """partita's own estimate of this run's per-rank peak (``partita estimate``), to record beside
    the measured one; a failure is reported as text, never fatal to the benchmark."""
    import torch.distributed as dist

    from partita.estimate import GPTShape, Setup, estimate_memory

    try:
        c = model.config
        shape = GPTShape(d_model=c.n_embd, n_layers=c.n_layer, n_heads=c.n_head, vocab=c.vocab_size,
                         seq_len=c.block_size, bias=c.bias, dropout=c.dropout)
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        setup = Setup.from_config(cfg, world_size=world)
        return estimate_memory(shape, setup, micro_batch=cfg["train_micro_batch_size_per_gpu"]).peak_accelerator / 2**30
    except Exception as error:  # noqa: BLE001 - the measurement matters more than the estimate
        return f"estimate failed: {type(error).__name__}: {error}"


def run_worker(args: argparse.Namespace) -> None:
    """Train ``args.engine`` for warm-up + timed steps and print the RESULT line(s)."""
    import torch
    import torch.distributed as dist

    from partita.models.gpt import GPT, GPTConfig

    spec = parse_engine(args.engine)
    rank, world = _rank_world()
    cuda = args.device == "cuda"
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    simulate_oom = args.simulate_oom_engine == args.engine and rank == world - 1
    phase = "setup"
    try:
        torch.manual_seed(0)
        gpt_cfg = getattr(GPTConfig, args.model)()
        with torch.device(device):
            model = GPT(gpt_cfg)
        seq, micro = gpt_cfg.block_size, args.micro_batch
        # Counted before any engine shards the parameters (DeepSpeed ZeRO-3 empties them in place).
        flops_per_token, num_params = model.flops_per_token(seq_len=seq), model.num_parameters()
        forward, backward, step = _build(spec, model, args, device)
        gen = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
        x = torch.randint(0, gpt_cfg.vocab_size, (micro, seq), device=device, generator=gen)
        y = torch.randint(0, gpt_cfg.vocab_size, (micro, seq), device=device, generator=gen)
        phase = "warm-up"
        for _ in range(args.warmup):
            if simulate_oom:
                # The one failure a GPU run must survive, raised where a real one would surface.
                raise torch.OutOfMemoryError(SIMULATED_OOM)
            backward(forward(x, y))
            step()
        phase = "timed steps"
        clock = PhaseClock(device, args.steps)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        start = time.perf_counter()
        for i in range(args.steps):
            clock.mark(i, 0)
            loss = forward(x, y)
            clock.mark(i, 1)
            backward(loss)
            clock.mark(i, 2)
            step()
            clock.mark(i, 3)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        fwd_ms, bwd_ms, opt_ms = clock.phase_ms()
        # GPUs: peak allocated by the caching allocator during the timed steps. CPU: peak RSS of
        # the process (the whole run; there are no allocator statistics on CPU).
        peak_value = torch.cuda.max_memory_allocated() / 2**30 if cuda else _host_rss_gib()[1]
        peak = torch.tensor([peak_value], device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    except Exception as exc:  # noqa: BLE001 - anything but an out-of-memory error is re-raised
        if not _is_oom(exc):
            raise
        if cuda:
            try:
                allocated = torch.cuda.memory_allocated() / 2**30
                peak_gib = torch.cuda.max_memory_allocated() / 2**30
                total = torch.cuda.get_device_properties(device).total_memory / 2**30
            except RuntimeError:  # a CUDA context that can no longer answer: report the OOM without figures
                allocated = peak_gib = total = None
        else:
            (allocated, peak_gib), total = _host_rss_gib(), None
        _emit({"engine": args.engine, "model": args.model, "world": world, "device": args.device,
               "status": "oom", "error": "out of memory", "detail": _oom_detail(exc),
               "phase": phase, "rank": rank, "memory_at_failure_gib": allocated, "peak_gib": peak_gib,
               "device_total_gib": total})
        # Skip interpreter teardown: destroying a process group whose peers are mid-collective
        # can hang, and torchrun stops the peers as soon as this rank exits non-zero.
        os._exit(3)
    if rank == 0:
        tps = args.steps * micro * seq * world / elapsed
        _emit({
            "engine": args.engine, "model": args.model, "world": world, "device": args.device, "status": "ok",
            "micro_batch": micro, "seq": seq, "params": num_params, "flops_per_token": flops_per_token,
            "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / world, "step_ms": 1000 * elapsed / args.steps,
            "forward_ms": fwd_ms, "backward_ms": bwd_ms, "optimizer_ms": opt_ms,
            "mfu": tps / world * flops_per_token / (args.peak_tflops * 1e12) if cuda else None,
            "peak_gib": float(peak), "final_loss": float(loss.detach()),
            "predicted_peak_gib": getattr(args, "predicted_peak_gib", None),
        })
    dist.destroy_process_group()
