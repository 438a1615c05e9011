"""The largest GPT that trains on one GPU with the optimizer state spread over GPU, host and NVMe.

    python benchmarks/largest_tiered.py --sizes 5120x40,5120x44,5120x48 --nvme-path /local_nvme \\
        --out benchmarks/results/largest_tiered.json          # one H200
    python benchmarks/largest_tiered.py --tiny --out /tmp/largest_tiered.json   # CPU check of the script
    python benchmarks/largest_tiered.py --sizes 5120x48 --nvme-path /local_nvme --overlap --pipeline-write \
        --out benchmarks/results/largest_tiered_overlap.json   # the host and NVMe steps beside the next forward

For each size (``d_model x n_layers``, 128-wide heads, vocab 50304, sequence ``--seq-len``) a fresh
process builds partita's GPT in bf16 on the accelerator and trains it ``--steps`` steps through
``partita.initialize`` with ``offload_optimizer.device "auto"``: partita's estimator splits the
optimizer state (fp32 master, gradient partition, moments) over the accelerator, host memory and
NVMe swap files at ``--nvme-path`` for the capacities it measures. Every block is checkpointed;
the batch is one fixed batch repeated, so "trains" (the issue's definition: ``--steps`` steps,
loss falling, no out-of-memory on GPU or host) is visible in ten steps.

Reported per size, appended to ``--out`` as soon as the size finishes (a later out-of-memory
kill cannot lose earlier rows): the split partita chose (elements per tier), the estimator's
bound (usable capacity / bytes per parameter), peak GPU memory (``max_memory_allocated`` and
``max_memory_reserved``), peak host memory (the process's peak RSS, pinned buffers included,
and the drop of the system's MemAvailable), peak disk use (bytes of the swap files, sampled
every 0.2 s), tokens/s (median over the steps after the first), and the losses. A size that
fails records its exit status and the tail of its error output, and the next size still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
from output_paths import output_dir, output_file  # noqa: E402

GIB = 2**30
VOCAB = 50304
HEAD_DIM = 128
_RESULT = "LARGEST_TIERED_RESULT "


# ----------------------------------------------------------------------------- worker (one size)


class _Sampler:
    """Peak host MemAvailable drop and swap-file bytes, sampled in a background thread."""

    def __init__(self, nvme_path: str) -> None:
        from partita.offload.capacity import host_available_bytes

        self._available = host_available_bytes
        self._nvme_path = nvme_path
        self.start_available = host_available_bytes()
        self.min_available = self.start_available
        self.peak_disk = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _disk_bytes(self) -> int:
        total = 0
        for root, _, files in os.walk(self._nvme_path):
            for name in files:
                try:
                    total += os.path.getsize(os.path.join(root, name))
                except OSError:
                    pass  # removed while walking
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.sample()

    def sample(self) -> None:
        self.min_available = min(self.min_available, self._available())
        self.peak_disk = max(self.peak_disk, self._disk_bytes())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def _tier_elements(optimizer) -> dict[str, int]:
    swapped = set(optimizer.swapper.swapped_groups) if optimizer.swapper is not None else set()
    out = {"accelerator": 0, "cpu": 0, "nvme": 0}
    for g, group in enumerate(optimizer.groups):
        tier = "nvme" if g in swapped else "cpu" if group.offloaded else "accelerator"
        out[tier] += sum(p.numel() for p in group.params)
    return out


def _engine_config(spec: dict) -> dict:
    tiers: dict = {"headroom": spec["headroom"]}
    if spec.get("capacity_gib"):
        tiers["capacity_gib"] = spec["capacity_gib"]
    if spec.get("fractions"):
        tiers["fractions"] = dict(zip(("accelerator", "cpu", "nvme"), spec["fractions"]))
    return {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        **({"bf16": {"enabled": True}} if spec["device"] == "cuda" else {}),
        "activation_checkpointing": {"policy": "every"},
        "zero_optimization": {
            "stage": spec["stage"],
            "sub_group_size": spec["sub_group_size"],
            "offload_optimizer": {"device": "auto", "nvme_path": spec["nvme_path"],
                                  "buffer_count": spec.get("buffer_count", 4), "pipeline_read": True,
                                  "pipeline_write": spec.get("pipeline_write", False),
                                  "overlap_step_with_forward": spec.get("overlap", False), "tiers": tiers},
        },
    }


def run_worker(spec: dict) -> dict:
    import torch

    import partita
    from partita.models import GPT, GPTConfig

    device = torch.device(spec["device"])
    config = GPTConfig(vocab_size=spec["vocab"], block_size=spec["seq_len"], n_layer=spec["n_layers"],
                       n_head=max(1, spec["d_model"] // spec["head_dim"]), n_embd=spec["d_model"], dropout=0.0,
                       bias=True)
    sampler = _Sampler(spec["nvme_path"])
    torch.manual_seed(0)
    # Built where it runs and in its training dtype: a 13 B model in fp32 on the host would take
    # 52 GB of the memory the host tier is measured from.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = GPT(config)
    finally:
        torch.set_default_dtype(previous)
    params = sum(p.numel() for p in model.parameters())
    started = time.perf_counter()
    engine, optimizer, _, _ = partita.initialize(model=model, config=_engine_config(spec))
    init_s = time.perf_counter() - started
    batch = torch.randint(0, config.vocab_size, (spec["micro_batch"], config.block_size + 1),
                          generator=torch.Generator().manual_seed(1)).to(device)
    x, y = batch[:, :-1], batch[:, 1:]
    times, losses = [], []
    for _ in range(spec["steps"]):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    sampler.stop()
    tokens = spec["micro_batch"] * config.block_size
    steady = times[1:] or times
    row = {
        "d_model": spec["d_model"], "n_layers": spec["n_layers"], "params": params,
        "tier_elements": _tier_elements(optimizer),
        "init_s": round(init_s, 2),
        "tokens_per_s": tokens / statistics.median(steady),
        "step_s_median": statistics.median(steady),
        "losses": losses,
        "overlap": spec.get("overlap", False),
        # The swapper's last step: NVMe bytes and the seconds its reads were waited for.
        "nvme_last_step": (optimizer.swapper.last_step.log_metrics() if optimizer.swapper is not None
                           and optimizer.swapper.last_step is not None else None),
        "loss_fell": losses[-1] < losses[0],
        "peak_host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
        "peak_host_drop_gib": (sampler.start_available - sampler.min_available) / GIB,
        "peak_disk_gib": sampler.peak_disk / GIB,
    }
    if device.type == "cuda":
        row["peak_gpu_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        row["peak_gpu_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    row["trained"] = row["loss_fell"] and len(losses) == spec["steps"]
    engine.destroy()
    return row


# ----------------------------------------------------------------------------- driver


def _bound(spec: dict) -> dict:
    """The estimator's split and the machine's bound for this size (no allocation: a meta model)."""
    from partita.estimate import GPTShape, Setup
    from partita.estimate.model_info import model_info
    from partita.estimate.tiers import TierFitError, describe_split, plan_tiers
    from partita.offload.capacity import measure_capacities

    import torch

    shape = GPTShape(spec["d_model"], spec["n_layers"], max(1, spec["d_model"] // spec["head_dim"]), spec["vocab"],
                     spec["seq_len"])
    setup = Setup(dtype="bf16" if spec["device"] == "cuda" else "fp32", stage=spec["stage"],
                  micro_batch=spec["micro_batch"], checkpointing="every", offload_optimizer="auto",
                  sub_group_size=spec["sub_group_size"])
    given = spec.get("capacity_gib") or {}
    capacities = measure_capacities(torch.device(spec["device"]), nvme_path=spec["nvme_path"],
                                    overrides_gib=tuple(given.get(t) for t in ("accelerator", "cpu", "nvme")),
                                    headroom=spec["headroom"])
    try:
        if spec.get("fractions"):
            plan = describe_split(model_info(shape), setup.replace(offload_tiers=tuple(spec["fractions"])), capacities)
        else:
            plan = plan_tiers(model_info(shape), setup, capacities)
    except TierFitError as error:
        return {"fits": False, "why": str(error), "usable_gib": [c / GIB for c in capacities.as_tuple()]}
    return {"fits": True, **plan.to_dict()}


def run_size(spec: dict, timeout_s: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout_s, cwd=str(Path(__file__).resolve().parent.parent))
    for line in proc.stdout.splitlines():
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT):])
    return {"d_model": spec["d_model"], "n_layers": spec["n_layers"], "trained": False, "exit_status": proc.returncode,
            # SIGKILL (-9) without a Python traceback: most likely the kernel's out-of-memory killer.
            "error_tail": (proc.stderr or proc.stdout)[-3000:]}


def _sizes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        d, _, n = item.strip().partition("x")
        out.append((int(d), int(n)))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="5120x40,5120x44,5120x48",
                        help="d_model x n_layers, comma separated, smallest first (heads of --head-dim)")
    parser.add_argument("--tiny", action="store_true", help="CPU check: two tiny GPTs, a temporary nvme_path")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--sub-group-size", type=int, default=100_000_000,
                        help="elements per NVMe sub-group (its buffers: 4 x 4 B x this, pinned)")
    parser.add_argument("--nvme-path", type=output_dir, default=None, help="swap directory (default: a temporary directory)")
    parser.add_argument("--headroom", type=float, default=0.1)
    parser.add_argument("--tier-capacity", default=None, help="GiB overrides, e.g. cpu=128,nvme=64")
    parser.add_argument("--fractions", default=None, help="an explicit split a,c,n instead of the automatic one")
    parser.add_argument("--overlap", action="store_true",
                        help="offload_optimizer.overlap_step_with_forward: the host and NVMe steps run beside the next forward")
    parser.add_argument("--pipeline-write", action="store_true", help="offload_optimizer.pipeline_write (NVMe writes behind)")
    parser.add_argument("--buffer-count", type=int, default=4,
                        help="offload_optimizer.buffer_count (pipeline_read and pipeline_write together need 4 for AdamW)")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--out", type=output_file, default=None, help="JSON file, rewritten after every size (required)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(_RESULT + json.dumps(run_worker(json.loads(args.worker))), flush=True)
        return 0
    if args.out is None:
        parser.error("--out is required")

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import git_commit, hardware_summary, versions  # noqa: E402 (benchmarks/ is not a package)

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    sizes = [(64, 2), (96, 3)] if args.tiny else _sizes(args.sizes)
    seq_len, vocab = (64, 512) if args.tiny else (args.seq_len, VOCAB)
    temporary = None
    nvme_path = args.nvme_path
    if nvme_path is None:
        temporary = tempfile.mkdtemp(prefix="partita-largest-tiered-")
        nvme_path = temporary
    capacity = {}
    for item in filter(None, (args.tier_capacity or "").split(",")):
        name, _, value = item.partition("=")
        capacity[name.strip()] = float(value)
    report = {
        "benchmark": "largest_tiered", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": git_commit(str(Path(__file__).resolve().parent.parent)), "hardware": hardware_summary(),
        "versions": versions(), "device": device, "nvme_path": nvme_path,
        "disk_free_gib": shutil.disk_usage(nvme_path).free / GIB,
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "runs": [],
    }
    if device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    out = Path(args.out)
    try:
        for d_model, n_layers in sizes:
            spec = {"device": device, "d_model": d_model, "n_layers": n_layers, "head_dim": 32 if args.tiny else HEAD_DIM,
                    "vocab": vocab, "seq_len": seq_len, "micro_batch": args.micro_batch, "steps": args.steps,
                    "stage": args.stage, "sub_group_size": 4096 if args.tiny else args.sub_group_size,
                    "nvme_path": nvme_path, "headroom": args.headroom, "capacity_gib": capacity,
                    "fractions": [float(v) for v in args.fractions.split(",")] if args.fractions else None,
                    "overlap": args.overlap, "pipeline_write": args.pipeline_write, "buffer_count": args.buffer_count}
            row = {"plan": _bound(spec), **run_size(spec, args.timeout_s)}
            report["runs"].append(row)
            out.write_text(json.dumps(report, indent=2))  # incrementally: a later kill keeps this row
            print(json.dumps({k: row.get(k) for k in ("d_model", "n_layers", "params", "trained", "tier_elements",
                                                       "tokens_per_s", "peak_gpu_allocated_gib", "peak_host_rss_gib",
                                                       "peak_disk_gib", "exit_status")}), flush=True)
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
