"""One setting of benchmarks/fp8_gpu.py in its own torchrun job: build, warm up, time, print RESULT.

Every setting trains the same GPT (same seed, same random tokens, same AdamW settings, clipping
1.0) compiled per block with bf16 compute:

- ``partita_*``: ``partita.initialize`` with the ``bf16``, ``compile`` and (6.7B)
  ``activation_checkpointing`` sections, plus the ``fp8`` section for the FP8 settings;
- ``fsdp2_*``: torch's ``fully_shard`` per block and on the root (bf16 parameters, fp32
  reduction), each block wrapped by torch's ``checkpoint_wrapper`` (6.7B) and ``torch.compile``;
  ``fsdp2_fp8_tensorwise`` first runs torchao's ``convert_to_float8_training`` with torchao's own
  auto-filter for the recipe (torchtitan's order: convert, checkpoint, compile, shard).

The driver (benchmarks/fp8_gpu.py) passes the shape and setting; this file only measures. Rank 0
prints one ``RESULT {json}`` line; a rank that runs out of memory prints a ``status: "oom"`` line
and exits at once (torchrun then stops the others), as benchmarks/_suite_worker.py does.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import resource
import time
import warnings
from typing import Any, Callable

ADAMW = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
TINY_FILTER = ["blocks.*"]  # the tiny model's linears are below torchao's auto-filter sizes


def _emit(result: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def _is_oom(exc: BaseException) -> bool:
    """An out-of-memory error, also when compile or NCCL wrapped it in another exception."""
    import torch

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, torch.OutOfMemoryError):
            return True
        if isinstance(seen, RuntimeError) and "out of memory" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _partita(spec: dict, model: Any, args: argparse.Namespace, device: Any) -> tuple[Callable, Callable, Callable, Any]:
    import partita

    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,  # no step log in the timed region
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": ADAMW},
        "zero_optimization": {"stage": spec["stage"], "reduce_bucket_size": 500_000_000,
                              "allgather_bucket_size": 500_000_000},
        "compile": {"enabled": True, "backend": args.compile_backend},
    }
    if args.tiny and spec["stage"] == 3:
        # The tiny weights are below ZeRO-3's default persistence threshold (kept whole, never unit-gathered);
        # 0 gathers them per unit as the large models' weights are, so the FP8 wire is exercised.
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if args.checkpoint:
        cfg["activation_checkpointing"] = {"policy": "every"}
    if spec["recipe"] is not None:
        section: dict[str, Any] = {"enabled": True, "recipe": spec["recipe"]}
        if args.tiny:
            section.update(emulate=True, filter=TINY_FILTER)
        if spec.get("all_gather"):
            section["all_gather"] = True
        cfg["fp8"] = section
    engine, _, _, _ = partita.initialize(model=model, config=cfg)

    def forward(x: Any, y: Any) -> Any:
        return engine(x, y)[1]

    return forward, engine.backward, engine.step, engine.module


def _fsdp2(spec: dict, model: Any, args: argparse.Namespace, device: Any) -> tuple[Callable, Callable, Callable, Any]:
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if spec["recipe"] is not None:
        from torchao.float8 import Float8LinearConfig, _auto_filter_for_recipe, convert_to_float8_training

        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(spec["recipe"]), emulate=args.tiny)
        if args.tiny:
            def keep(module: Any, fqn: str) -> bool:
                return any(fnmatch.fnmatchcase(fqn, p) for p in TINY_FILTER)
        else:
            keep = _auto_filter_for_recipe(spec["recipe"], filter_fqns=[])
        convert_to_float8_training(model, config=config, module_filter_fn=keep)
    names = _fp8_names(model)  # read before the wrappers change the module names
    for index, block in enumerate(model.blocks):
        if args.checkpoint:
            block = checkpoint_wrapper(block)
        model.blocks[index] = torch.compile(block, backend=args.compile_backend)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), fused=True, lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]),
                            eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])

    def forward(x: Any, y: Any) -> Any:
        return model(x, y)[1]

    def backward(loss: Any) -> None:
        loss.backward()

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return forward, backward, step, names


def _fp8_names(model: Any) -> list[str]:
    from partita.precision.fp8 import fp8_linears

    return fp8_linears(model)


def _linear_count(model: Any) -> int:
    """nn.Linear layers of the model (torchao's Float8Linear is one), the denominator of 'converted'."""
    from torch import nn

    return sum(1 for name, m in model.named_modules() if isinstance(m, nn.Linear) and name)


def _comm_bytes_one_step(forward: Callable, backward: Callable, step: Callable, x: Any, y: Any) -> dict[str, int]:
    """Bytes per collective kind of one more (untimed) step, from partita's comms logger: turned
    on only here so it adds nothing to the timed steps."""
    from partita.monitor.comms_logger import COMMS_LOGGER

    COMMS_LOGGER.reset()
    COMMS_LOGGER.enabled = True
    try:
        backward(forward(x, y))
        step()
        records = COMMS_LOGGER.records()
    finally:
        COMMS_LOGGER.enabled = False
    out: dict[str, int] = {}
    for record in records:
        key = f"{record.op}: {record.purpose.split(' (')[0]}"
        out[key] = out.get(key, 0) + record.message_bytes
    return out


def _versions(device: Any) -> dict[str, Any]:
    import platform

    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda}
    try:
        import torchao

        out["torchao"] = torchao.__version__
    except ImportError:
        out["torchao"] = "not installed"
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return out


def run_worker(args: argparse.Namespace, spec: dict) -> None:
    """Train ``spec`` (a setting of the driver's table) for warm-up + timed steps; print RESULT."""
    import torch
    import torch.distributed as dist

    from partita.models.gpt import GPT, GPTConfig

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = not args.tiny
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    base = {"setting": args.setting, "shape": args.shape, "world": world}
    phase = "setup"
    t0 = time.perf_counter()
    try:
        torch.manual_seed(0)
        gpt_cfg = dataclasses.replace(getattr(GPTConfig, args.preset)(), block_size=args.seq) if not args.tiny else \
            GPTConfig(vocab_size=256, block_size=args.seq, n_layer=2, n_head=2, n_embd=64)
        with torch.device(device):
            model = GPT(gpt_cfg)
        flops_per_token, params = model.flops_per_token(seq_len=args.seq), model.num_parameters()
        linears = _linear_count(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fp8 without compile etc. cannot happen here; keep the log short
            if spec["family"] == "partita":
                forward, backward, step, module = _partita(spec, model, args, device)
                fp8_names = _fp8_names(module)
            else:
                forward, backward, step, fp8_names = _fsdp2(spec, model, args, device)
        gen = torch.Generator(device=device).manual_seed(1 + rank)
        x = torch.randint(0, gpt_cfg.vocab_size, (args.micro_batch, args.seq), device=device, generator=gen)
        y = torch.randint(0, gpt_cfg.vocab_size, (args.micro_batch, args.seq), device=device, generator=gen)
        setup_s = time.perf_counter() - t0
        phase = "warm-up (compile)"
        t1 = time.perf_counter()
        first_step_s = None
        for i in range(args.warmup):
            backward(forward(x, y))
            step()
            if i == 0:
                if cuda:
                    torch.cuda.synchronize()
                first_step_s = time.perf_counter() - t1
        phase = "timed steps"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = forward(x, y)
            backward(loss)
            step()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        peak_value = (torch.cuda.max_memory_allocated() if cuda
                      else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30
        peak = torch.tensor([peak_value], device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        last_loss = float(loss.detach())
        comm = None
        if spec["family"] == "partita" and world > 1:
            phase = "counted step (comms logger)"
            comm = _comm_bytes_one_step(forward, backward, step, x, y)
    except Exception as exc:  # noqa: BLE001 - anything but out-of-memory is re-raised (the driver records it)
        if not _is_oom(exc):
            raise
        try:
            at = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        except RuntimeError:  # a CUDA context that can no longer answer: report the OOM without the figure
            at = None
        _emit({**base, "status": "oom", "phase": phase, "rank": rank, "peak_gib": at, "error": str(exc)[:300]})
        os._exit(3)  # peers may sit in a collective; torchrun stops them when this rank exits
    if rank == 0:
        tokens = args.steps * args.micro_batch * args.seq * world
        _emit({
            **base, "status": "ok", "device": "cuda" if cuda else "cpu", "micro_batch": args.micro_batch,
            "seq": args.seq, "checkpointed": args.checkpoint, "zero_stage": spec.get("stage"),
            "recipe": spec["recipe"], "all_gather": bool(spec.get("all_gather")), "params": params,
            "flops_per_token": flops_per_token, "steps": args.steps, "warmup": args.warmup,
            "tokens_per_s": tokens / elapsed, "step_s": elapsed / args.steps, "peak_gib": float(peak),
            "last_loss": last_loss, "setup_s": setup_s, "first_step_s": first_step_s,
            "tflops_per_gpu": tokens / elapsed / world * flops_per_token / 1e12,
            "fp8_linears": len(fp8_names), "linears": linears, "fp8_linear_names": fp8_names,
            "comm_bytes_per_step": comm, "versions": _versions(device),
        })
    dist.destroy_process_group()
