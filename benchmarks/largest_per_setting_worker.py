"""One trial of benchmarks/largest_per_setting.py: one GPT size, one setting, 10 steps, in its own process.

    python benchmarks/largest_per_setting_worker.py '<spec json>'   # run by the driver, one line of output
    python benchmarks/largest_per_setting_worker.py --calibrate      # host optimizer-step rates, JSON

A fresh process per trial: after an out-of-memory error torch's allocator state is not worth
trusting, and a process the kernel kills takes nothing else with it. The worker builds partita's
reference GPT (every block activation-checkpointed, sequence ``seq_len``, micro-batch 1, one
fixed batch repeated so that "the loss falls" is visible in ten steps) and trains it through:

- partita: ``partita.initialize`` with ZeRO-3 and the setting's offload sections (bf16 model built
  on the GPU; partita keeps the fp32 master);
- FSDP2 / DeepSpeed: the throughput suite's own builders (``_suite_worker._build``): FSDP2
  ``fully_shard`` per block and root with bf16 ``MixedPrecisionPolicy`` over fp32 parameters
  (``CPUOffloadPolicy`` for fsdp2-off), DeepSpeed ZeRO-3 with ``offload_optimizer`` and
  ``offload_param`` on the CPU, ``pin_memory`` true.

It prints one ``TRIAL {json}`` line: ``status`` "ok" (losses, step times, peaks) or, for a
failure it can see, "oom" (GPU), "host-oom", "disk-full" or "error", with the detail and the
phase; then leaves with ``os._exit`` (no teardown of NCCL or DeepSpeed state after a failure).
A kill by the kernel's OOM killer leaves no line; the driver reads the exit status instead.

``spec["simulate"]`` (``--tiny`` only) stands in for the capacities a CPU machine does not have:
above ``above_params`` parameters it raises a GPU ``OutOfMemoryError``, kills itself with
SIGKILL as the kernel's OOM killer would, grows its RSS past the driver's host limit, raises
ENOSPC, or hangs until the per-trial timeout.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import resource
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

GIB = 2**30
ADAMW = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}  # the suite's (_suite_worker)
_LINE = "TRIAL "


def emit(result: dict) -> None:
    print(_LINE + json.dumps(result), flush=True)


def partita_config(spec: dict, cuda: bool) -> dict:
    """ZeRO-3 with the setting's offload sections, AdamW or AdamW8bit, every block checkpointed."""
    options = spec["options"]
    zero: dict = {"stage": 3}
    nvme = os.path.join(spec["nvme_path"], "partita")
    os.makedirs(nvme, exist_ok=True)  # partita refuses an nvme_path that does not exist
    opt_device, param_device = options.get("offload_optimizer", "none"), options.get("offload_param", "none")
    if opt_device != "none":
        zero["offload_optimizer"] = {"device": opt_device, "pin_memory": cuda, "nvme_path": nvme,
                                     "buffer_count": 4, "pipeline_read": True}
    if param_device != "none":
        zero["offload_param"] = {"device": param_device, "pin_memory": cuda, "nvme_path": nvme,
                                 "gather_from_master": bool(options.get("param_gather_from_master", False))}
    if "sub_group_size" in options:
        zero["sub_group_size"] = options["sub_group_size"]
    if options.get("streamed_step"):
        zero["one_rank_gradient_fold"] = "stream"
    return {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": options.get("optimizer", "AdamW"), "params": ADAMW},
        **({"bf16": {"enabled": True}} if cuda else {}),
        "activation_checkpointing": {"policy": "every"},
        "zero_optimization": zero,
    }


def _build_gpt(spec: dict, device, dtype):
    import torch

    from partita.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=spec["vocab"], block_size=spec["seq_len"], n_layer=spec["n_layers"],
                       n_head=spec["n_heads"], n_embd=spec["d_model"], dropout=0.0, bias=True)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its training dtype where it runs: no fp32 copy on the host
    try:
        with device:
            return GPT(config)
    finally:
        torch.set_default_dtype(previous)


def build_engine(spec: dict, device):
    """(model, forward(x, y) -> loss, backward(loss), step()) for the spec's family."""
    import torch

    cuda = device.type == "cuda"
    if spec["family"] == "partita":
        import partita

        model = _build_gpt(spec, device, torch.bfloat16 if cuda else torch.float32)
        params = sum(p.numel() for p in model.parameters())
        config = partita_config(spec, cuda)
        engine, _, _, _ = partita.initialize(model=model, config=config)
        spec["_engine"] = {"partita_zero_optimization": config["zero_optimization"], "optimizer": config["optimizer"]}
        return params, (lambda x, y: engine(x, y)[1]), engine.backward, engine.step

    from partita.activation_checkpointing import apply_activation_checkpointing
    from _suite_engines import parse_engine
    from _suite_worker import _build

    # fp32 parameters on the device, as the suite builds them: FSDP2 keeps them as its master
    # copy (bf16 only for compute), DeepSpeed casts them to bf16 and keeps its fp32 master itself.
    model = _build_gpt(spec, device, torch.float32)
    params = sum(p.numel() for p in model.parameters())  # before DeepSpeed empties them in place
    apply_activation_checkpointing(model, policy="every")
    offload = spec["options"].get("offload_optimizer", "none") != "none"
    name = "fsdp2" if spec["family"] == "fsdp2" else "deepspeed3" + ("-off" if offload else "")
    args = argparse.Namespace(micro_batch=1, bucket=500_000_000)
    forward, backward, step = _build(parse_engine(name), model, args, device, cpu_offload=offload)
    spec["_engine"] = {"suite_engine": name, "cpu_offload": offload,
                       "what": ("fully_shard per block + root" + (", CPUOffloadPolicy" if offload else "")
                                if spec["family"] == "fsdp2" else
                                "ZeRO-3" + (", offload_optimizer + offload_param cpu" if offload else ""))}
    return params, forward, backward, step


def _simulate(spec: dict, params: int, stage: str) -> None:
    """--tiny stand-ins for capacities a CPU machine lacks (see the module docstring)."""
    sim = spec.get("simulate")
    if not sim or params <= sim["above_params"]:
        return
    import torch

    kind = sim["kind"]
    if kind == "host-kill" and stage == "built":
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
    if kind == "host-ballast" and stage == "built":
        ballast = bytearray(sim["ballast_bytes"])  # zero-filled: every page resident
        spec["_ballast"] = ballast
        time.sleep(30)  # the driver's watchdog kills the process well before this ends
    if kind == "disk-full" and stage == "step":
        raise OSError(errno.ENOSPC, "No space left on device (simulated, --tiny)")
    if kind == "gpu-oom" and stage == "step":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (simulated, --tiny)")
    if kind == "hang" and stage == "step":
        time.sleep(3600)


def _classify(exc: BaseException) -> str:
    """oom (GPU), host-oom, disk-full or error, looking through wrapped causes."""
    from _suite_worker import _is_oom

    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen)
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC or "No space left on device" in text:
            return "disk-full"
        if isinstance(seen, MemoryError) or any(s in text for s in ("DefaultCPUAllocator", "CUDAHostAllocator",
                                                                    "cudaHostAlloc", "pinned memory")):
            return "host-oom"  # torch reports host allocation failures as OutOfMemoryError too
        seen = seen.__cause__ or seen.__context__
    if not _is_oom(exc):
        return "error"
    # A failed pinned (page-locked) host allocation surfaces as "CUDA error: out of memory" too;
    # the line that raised it says which memory ran out.
    frames = traceback.extract_tb(exc.__traceback__)
    deepest = (frames[-1].line or "") if frames else ""
    return "host-oom" if any(k in deepest for k in ("pin_memory", "pinned", "cudaHostRegister")) else "oom"


def _gpu_figures(torch, cuda: bool) -> dict:
    if not cuda:
        return {}
    try:
        return {"peak_gpu_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
                "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
                "gpu_total_gib": torch.cuda.get_device_properties(0).total_memory / GIB}
    except RuntimeError:  # a context that can no longer answer after the failure
        return {}


def run_trial(spec: dict) -> None:
    import torch

    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    base = {"setting": spec["setting"], "d_model": spec["d_model"], "n_layers": spec["n_layers"]}
    phase, started = "build", time.perf_counter()
    losses: list[float] = []
    times: list[float] = []
    params = None
    try:
        params, forward, backward, step = build_engine(spec, device)
        _simulate(spec, params, "built")
        init_s = time.perf_counter() - started
        batch = torch.randint(0, spec["vocab"], (1, spec["seq_len"] + 1),
                              generator=torch.Generator().manual_seed(1)).to(device)
        x, y = batch[:, :-1], batch[:, 1:]
        phase = "train"
        for _ in range(spec["steps"]):
            _simulate(spec, params, "step")
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = forward(x, y)
            backward(loss)
            step()
            losses.append(float(loss.detach()))  # synchronises
            times.append(time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a result line
        from _suite_worker import _oom_detail

        kind = _classify(exc)
        detail = _oom_detail(exc) if kind == "oom" else f"{type(exc).__name__}: {str(exc)[:300]}"
        emit({**base, "status": kind, "detail": detail, "phase": phase, "params": params,
              "steps_done": len(losses), "losses": losses,
              "peak_host_rss_self_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
              **_gpu_figures(torch, cuda)})
        sys.stderr.flush()
        os._exit(3)
    steady = times[1:] or times
    emit({**base, "status": "ok", "params": params, "engine": spec.get("_engine"), "init_s": init_s, "step_s": statistics.median(steady),
          "first_step_s": times[0], "tokens_per_s": spec["seq_len"] / statistics.median(steady),
          "losses": losses, "peak_host_rss_self_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
          **_gpu_figures(torch, cuda)})
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (process groups, pinned pools): the figures are out


def calibrate(elements: int = 1 << 24, steps: int = 3) -> dict:
    """Elements per second of the host optimizer steps the offloaded settings run: torch's fused
    CPU AdamW (partita's and FSDP2's host step, close to DeepSpeed's AVX Adam) and bitsandbytes'
    AdamW8bit on CPU tensors (partita's 8-bit host step). Best of ``steps`` after one warm-up."""
    import torch

    out = {"threads": torch.get_num_threads(), "elements": elements}

    def rate(make) -> float:
        p = torch.nn.Parameter(torch.randn(elements))
        p.grad = torch.randn(elements)
        opt = make([p])
        opt.step()
        best = float("inf")
        for _ in range(steps):
            t0 = time.perf_counter()
            opt.step()
            best = min(best, time.perf_counter() - t0)
        return elements / best

    out["adamw_elements_per_s"] = rate(lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True))
    try:
        import bitsandbytes as bnb

        out["adamw8bit_elements_per_s"] = rate(lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-4))
    except Exception as exc:  # noqa: BLE001 - not installed, or no CPU path: the driver uses its default
        out["adamw8bit_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


def main() -> None:
    if sys.argv[1:] == ["--calibrate"]:
        print(json.dumps(calibrate()), flush=True)
        return
    spec = json.loads(sys.argv[1])
    try:  # when host memory runs out, the kernel's OOM killer picks this process, not the driver
        with open("/proc/self/oom_score_adj", "w", encoding="ascii") as f:
            f.write("1000")
    except OSError:
        pass
    try:  # the driver killed (a command's time limit): this trial goes too, it would hold the GPU
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if spec["family"] != "partita":
        # One process of a one-rank world for torch.distributed (FSDP2, DeepSpeed); the driver
        # gives each trial its own port.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(spec.get("port", 29511)))
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        if spec["device"] == "cpu" and spec["family"] == "deepspeed":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
    run_trial(spec)


if __name__ == "__main__":
    main()
