"""Serial vs overlapped tiered optimizer step on CPU (``offload_optimizer.overlap_step_with_forward``).

    python benchmarks/tiered_overlap_cpu.py --nvme-path /tmp/tiered-nvme \\
        --out benchmarks/results/tiered_overlap_cpu_2026-12-04.json

partita's GPT (fp32) trains on the CPU with ``offload_optimizer.device "auto"`` and an explicit
split over the three tiers (``--fractions``; on a CPU-only machine the "accelerator" tier is host
memory too, but each tier runs its real path: the NVMe tier's Adam moments are in swap files at
``--nvme-path``). The model is sized so that the host + NVMe step is comparable to the forward +
backward. Both settings run in one process, alternating (serial, overlapped, serial, ...) so that
a noisy neighbour hits both alike; per step the script times the forward, the backward and
``step()`` and keeps the swapper's counters (NVMe bytes, busy seconds).

Reported: the step time (forward + backward + step, median over the steps after the first two)
of each setting; the parts of the serial step (forward + backward = the "GPU time" here, the
optimizer step, the NVMe traffic per step); the disk's bandwidth measured here with partita's own
swap store (O_DIRECT where the filesystem takes it); the bound max(forward + backward, host
compute of the step, NVMe bytes / disk bandwidth) and each setting's fraction of it; and whether
the two settings' losses are bit-identical (they must be).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
from common import git_commit, hardware_summary, versions  # noqa: E402
from output_paths import output_dir, output_file  # noqa: E402

GIB = 2**30


def disk_bandwidth(path: str, mib: int, repeats: int = 3) -> dict:
    """Sequential write and read GB/s of one ``mib`` MiB tensor through partita's swap store."""
    from partita.offload.config import AioConfig
    from partita.offload.nvme import NvmeSwapStore

    aio = AioConfig()
    store = NvmeSwapStore(path, aio=aio, buffer_count=4, tag="bandwidth")
    try:
        numel = mib * 2**20 // 4
        from partita.offload.buffer_pool import PinnedBufferPool

        with PinnedBufferPool(count=1, numel=numel, dtype=torch.float32, pin=False, name="bandwidth") as pool:
            tensor = pool.acquire()
            tensor.uniform_()
            store.allocate({"probe": (numel, torch.float32)})
            writes, reads = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                store.write_sync("probe", tensor)
                os.sync()  # buffered fallback: count the data on the disk, not in the page cache
                writes.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                store.read_sync("probe", tensor)
                reads.append(time.perf_counter() - t0)
            pool.release(tensor)
        nbytes = numel * 4
        return {"bytes": nbytes, "direct_io": store.direct_io, "write_gb_s": nbytes / statistics.median(writes) / 1e9,
                "read_gb_s": nbytes / statistics.median(reads) / 1e9, "aio": aio.model_dump()}
    finally:
        store.close()


def _config(args: argparse.Namespace, overlap: bool) -> dict:
    fractions = dict(zip(("accelerator", "cpu", "nvme"), (float(v) for v in args.fractions.split(","))))
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 2,
            "sub_group_size": args.sub_group_size,
            "offload_optimizer": {"device": "auto", "nvme_path": args.nvme_path, "buffer_count": args.buffer_count,
                                  "pipeline_read": True, "pipeline_write": args.pipeline_write,
                                  "overlap_step_with_forward": overlap, "tiers": {"fractions": fractions}},
        },
    }


def run(args: argparse.Namespace, overlap: bool) -> dict:
    import partita
    from partita.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=args.layers,
                       n_head=max(1, args.d_model // 64), n_embd=args.d_model, dropout=0.0, bias=True)
    torch.manual_seed(0)
    model = GPT(config)
    engine, optimizer, _, _ = partita.initialize(model=model, config=_config(args, overlap))
    batch = torch.randint(0, config.vocab_size, (args.micro_batch, config.block_size + 1),
                          generator=torch.Generator().manual_seed(1))
    x, y = batch[:, :-1], batch[:, 1:]
    swapper = optimizer.swapper
    rows, losses = [], []
    for _ in range(args.steps):
        io_before = swapper.store.io_counters()
        t0 = time.perf_counter()
        _, loss = engine(x, y)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        io = swapper.store.io_counters() - io_before
        stats = swapper.last_step
        rows.append({"forward_s": t1 - t0, "backward_s": t2 - t1, "step_call_s": t3 - t2, "total_s": t3 - t0,
                     "nvme_bytes": io.bytes_read + io.bytes_written, "disk_busy_s": io.busy_s,
                     "swap_compute_s": stats.compute_s, "swap_read_wait_s": stats.read_wait_s,
                     "swap_write_wait_s": stats.write_wait_s})
        losses.append(loss.item())
    engine.finish_pending_step()
    tiers = {"accelerator": 0, "cpu": 0, "nvme": 0}
    swapped = set(swapper.swapped_groups)
    for g, group in enumerate(optimizer.groups):
        tier = "nvme" if g in swapped else "cpu" if group.offloaded else "accelerator"
        tiers[tier] += group.master.numel()
    engine.destroy()
    return {"overlap": overlap, "rows": rows, "losses": losses, "tier_elements": tiers,
            "params": sum(p.numel() for p in model.parameters())}


def _median(rows: list[dict], key: str, skip: int) -> float:
    return statistics.median(r[key] for r in rows[skip:])


def summarize(runs: list[dict], bandwidth: dict, skip: int) -> dict:
    by = {flag: [r for r in runs if r["overlap"] is flag] for flag in (False, True)}
    rows = {flag: [row for r in rs for row in r["rows"][skip:]] for flag, rs in by.items()}
    serial, overlapped = rows[False], rows[True]
    fwd_bwd = statistics.median(r["forward_s"] + r["backward_s"] for r in serial)
    step = statistics.median(r["step_call_s"] for r in serial)
    nvme_bytes = statistics.median(r["nvme_bytes"] for r in serial)
    # The disk reads and writes concurrently; its time per step is bounded by the larger direction.
    nvme_s = (nvme_bytes / 2) / min(bandwidth["read_gb_s"], bandwidth["write_gb_s"]) / 1e9
    # The step's host compute: the serial step() less its waits for the disk.
    host = statistics.median(r["step_call_s"] - r["swap_read_wait_s"] - r["swap_write_wait_s"] for r in serial)
    bound = max(fwd_bwd, host, nvme_s)
    out = {
        "serial_step_s": statistics.median(r["total_s"] for r in serial),
        "overlapped_step_s": statistics.median(r["total_s"] for r in overlapped),
        "serial_parts_s": {"forward": statistics.median(r["forward_s"] for r in serial),
                           "backward": statistics.median(r["backward_s"] for r in serial), "step": step},
        "overlapped_parts_s": {"forward": statistics.median(r["forward_s"] for r in overlapped),
                               "backward": statistics.median(r["backward_s"] for r in overlapped),
                               "step": statistics.median(r["step_call_s"] for r in overlapped)},
        "host_compute_s": host, "nvme_bytes_per_step": nvme_bytes, "nvme_s_at_disk_bandwidth": nvme_s,
        "disk_busy_s_serial": statistics.median(r["disk_busy_s"] for r in serial),
        "bound_s": bound,
        "losses_bit_identical": all(a["losses"] == b["losses"] for a, b in zip(by[False], by[True])),
    }
    out["speedup"] = out["serial_step_s"] / out["overlapped_step_s"]
    out["serial_fraction_of_bound"] = bound / out["serial_step_s"]
    out["overlapped_fraction_of_bound"] = bound / out["overlapped_step_s"]
    return out


def markdown(report: dict) -> str:
    s, m = report["summary"], report["model"]
    lines = [
        f"# Tiered optimizer step, serial vs overlapped with the next forward (CPU, {report['date']})",
        "",
        f"Command: `{report['command']}` at commit {report['commit']}.",
        "",
        f"partita GPT d {m['d_model']} x {m['layers']} layers, vocab {m['vocab']}, sequence {m['seq_len']}, micro-batch "
        f"{m['micro_batch']}: {m['params'] / 1e6:.1f} M parameters, fp32, ZeRO-2 on one process; optimizer state split "
        f"(elements) accelerator/cpu/nvme = {m['tier_elements']['accelerator']}/{m['tier_elements']['cpu']}/"
        f"{m['tier_elements']['nvme']} (on a CPU-only machine the accelerator tier is host memory too); "
        f"sub_group_size {m['sub_group_size']}, pipeline_read on, pipeline_write {m['pipeline_write']}, "
        f"torch threads {m['threads']}. {m['repeats']} runs of each setting, alternating, {m['steps']} steps each, "
        f"median over the steps after the first {m['skip']}.",
        "",
        f"Disk at `{report['nvme_path']}` (partita's swap store, O_DIRECT {report['disk']['direct_io']}): "
        f"write {report['disk']['write_gb_s']:.2f} GB/s, read {report['disk']['read_gb_s']:.2f} GB/s "
        f"({report['disk']['bytes'] / 2**20:.0f} MiB, median of 3).",
        "",
        "| | serial | overlapped |",
        "|---|---|---|",
        f"| step time (forward + backward + step) | {s['serial_step_s'] * 1e3:.0f} ms | {s['overlapped_step_s'] * 1e3:.0f} ms |",
        f"| forward | {s['serial_parts_s']['forward'] * 1e3:.0f} ms | {s['overlapped_parts_s']['forward'] * 1e3:.0f} ms |",
        f"| backward | {s['serial_parts_s']['backward'] * 1e3:.0f} ms | {s['overlapped_parts_s']['backward'] * 1e3:.0f} ms |",
        f"| step() call | {s['serial_parts_s']['step'] * 1e3:.0f} ms | {s['overlapped_parts_s']['step'] * 1e3:.0f} ms |",
        f"| fraction of the bound | {s['serial_fraction_of_bound']:.2f} | {s['overlapped_fraction_of_bound']:.2f} |",
        "",
        f"Speed-up {s['speedup']:.2f}x. NVMe traffic {s['nvme_bytes_per_step'] / 1e6:.0f} MB per step "
        f"({s['nvme_s_at_disk_bandwidth'] * 1e3:.0f} ms at the disk's bandwidth); bound = max(forward + backward "
        f"{(s['serial_parts_s']['forward'] + s['serial_parts_s']['backward']) * 1e3:.0f} ms, the step's host compute "
        f"{s['host_compute_s'] * 1e3:.0f} ms, NVMe time) = {s['bound_s'] * 1e3:.0f} ms. Losses bit-identical between the "
        f"settings: {s['losses_bit_identical']}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the medians (state creation)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fractions", default="0.2,0.3,0.5", help="accelerator,cpu,nvme shares")
    parser.add_argument("--sub-group-size", type=int, default=1_000_000)
    parser.add_argument("--buffer-count", type=int, default=4)
    parser.add_argument("--pipeline-write", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the training thread")
    parser.add_argument("--disk-mib", type=int, default=256)
    parser.add_argument("--nvme-path", type=output_dir, default=None, help="swap directory (default: a temporary one)")
    parser.add_argument("--out", type=output_file, required=True, help="JSON file; a .md of the same name is written too")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    temporary = None
    if args.nvme_path is None:
        temporary = tempfile.mkdtemp(prefix="partita-tiered-overlap-")
        args.nvme_path = temporary
    bandwidth = disk_bandwidth(args.nvme_path, args.disk_mib)
    runs = []
    for _ in range(args.repeats):
        for overlap in (False, True):
            runs.append(run(args, overlap))
            print(json.dumps({"overlap": overlap, "step_s": _median(runs[-1]["rows"], "total_s", args.skip)}), flush=True)
    report = {
        "benchmark": "tiered_overlap_cpu", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(str(Path(__file__).resolve().parent.parent)), "hardware": hardware_summary(),
        "versions": versions(), "command": " ".join(["python", *sys.argv]), "nvme_path": args.nvme_path,
        "model": {"d_model": args.d_model, "layers": args.layers, "vocab": args.vocab, "seq_len": args.seq_len,
                  "micro_batch": args.micro_batch, "params": runs[0]["params"], "tier_elements": runs[0]["tier_elements"],
                  "sub_group_size": args.sub_group_size, "pipeline_write": args.pipeline_write, "threads": args.threads,
                  "steps": args.steps, "skip": args.skip, "repeats": args.repeats},
        "disk": bandwidth, "summary": summarize(runs, bandwidth, args.skip), "runs": runs,
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    Path(args.out).with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    if temporary is not None:
        import shutil

        shutil.rmtree(temporary, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
