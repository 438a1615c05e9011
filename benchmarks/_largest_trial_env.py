"""The machine side of benchmarks/largest_per_setting.py: capacities, the trial-time model, the
watch over a running trial, and the --tiny stand-ins for capacities a CPU machine lacks."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from typing import Any

from _largest_search import Setting, gpt_params

GIB = 2**30
MIB = 2**20
H200_GPU_BYTES = int(139.8 * GIB)  # what torch reports on the lent H200s (docs/performance/index.md)
# --tiny: capacities in the range of the tiny ladder's estimates (d 64, 2-9 layers, fp32), so
# that the estimator's starting rung differs between settings.
TINY_CAPACITIES = {"gpu_bytes": int(4.6 * MIB), "host_bytes": 260 * MIB, "disk_bytes": 120 * MIB}


def probe_capacities(args: Any, nvme_root: str) -> dict:
    """GPU, host and disk bytes the estimator's prediction is compared with, and their sources."""
    if args.tiny:
        return {**TINY_CAPACITIES, "sources": "tiny (artificial)"}
    sources = []
    gpu = None if args.gpu_gib is None else int(args.gpu_gib * GIB)
    if gpu is not None:
        sources.append("gpu given")
    else:
        try:  # not torch: a CUDA context in the driver would hold GPU memory for the whole search
            text = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, check=True, timeout=30).stdout
            # less the ~0.6 GiB CUDA context every trial's process holds
            gpu = int(float(text.split()[0]) * MIB) - int(0.6 * GIB)
            sources.append("gpu nvidia-smi total - 0.6 GiB")
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            gpu = H200_GPU_BYTES
            sources.append("gpu H200 default 139.8 GiB")
    host = None if args.host_gib is None else int(args.host_gib * GIB)
    sources.append("host given" if host is not None else "host MemAvailable at start")
    disk = None if args.disk_gib is None else int(args.disk_gib * GIB)
    sources.append("disk given" if disk is not None else "disk free at --nvme-path")
    return {"gpu_bytes": gpu, "host_bytes": host if host is not None else mem_available(),
            "disk_bytes": disk if disk is not None else shutil.disk_usage(nvme_root).free, "sources": ", ".join(sources)}


def mem_available() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def predict_trial_s(setting: Setting, params: int, host_bytes: int, rates: dict, *, seq_len: int, steps: int,
                    first_deepspeed: bool, tiny: bool, expected_fit: bool = True) -> dict:
    """Seconds one trial should take, from serial (pessimistic: no overlap) parts per step.

    - start-up: interpreter, imports, CUDA context, model build (20 s on the H200), plus the host
      state allocated and pinned at ~4 GiB/s (benchmarks/largest_tiered.py: 29 s for ~120 GiB);
      DeepSpeed adds 20 s, and 90 s in the first DeepSpeed trial of a run (JIT build of its CPU Adam);
    - GPU: 8 x params x tokens FLOPs (forward, recomputed forward, backward) at ``gpu_tflops``;
    - host optimizer step: params at the measured fused-AdamW or AdamW8bit elements/s;
    - PCIe at ``pcie_gbps``: 4 B/param for a host optimizer (bf16 gradients down, parameters up),
      6 B/param more with the parameters on the host (three bf16 gathers: forward, recompute,
      backward); FSDP2's CPUOffloadPolicy moves fp32: 12 B up and 4 B down;
    - NVMe at ``nvme_gbps``: 16 B/param with the optimizer states there (both moments read and
      written), 8 B/param with the parameters there.

    A rung the estimator says does not fit (``expected_fit`` False) is expected to fail while
    allocating or in its first step: start-up and one step.
    """
    opt = setting.options.get("offload_optimizer", "none")
    par = setting.options.get("offload_param", "none")
    gpu_s = 8 * params * seq_len / (rates["gpu_tflops"] * 1e12)
    host_s = 0.0
    if opt != "none":
        rate = rates["adamw8bit_elements_per_s"] if setting.eight_bit else rates["adamw_elements_per_s"]
        host_s = params / rate
    pcie = 0.0
    if setting.family == "fsdp2" and opt != "none":
        pcie = 16 * params
    else:
        pcie = (4 * params if opt != "none" else 0) + (6 * params if par != "none" else 0)
    nvme = (16 * params if opt == "nvme" else 0) + (8 * params if par == "nvme" else 0)
    step_s = gpu_s + host_s + pcie / (rates["pcie_gbps"] * 1e9) + nvme / (rates["nvme_gbps"] * 1e9)
    startup = (4.0 if tiny else 20.0) + host_bytes / (4 * GIB)
    if setting.family == "deepspeed":
        startup += 6.0 if tiny else 20.0 + (90.0 if first_deepspeed else 0.0)
    # One step more than ``steps``: the first step also pays for allocator growth and hooks.
    total = startup + ((steps + 1) if expected_fit else 1) * step_s
    return {"startup_s": startup, "step_s": step_s, "total_s": total, "expected_fit": expected_fit,
            "parts_s": {"gpu": gpu_s, "host_step": host_s, "pcie": pcie / (rates["pcie_gbps"] * 1e9),
                        "nvme": nvme / (rates["nvme_gbps"] * 1e9)}}


class TreeWatch:
    """Peaks of a trial's process tree (its session: the worker and anything it starts), the
    machine's MemAvailable, and the bytes under its swap directory; stops the trial on a host
    floor, an RSS limit or the timeout."""

    def __init__(self, sid: int, disk_dir: str, *, min_available: float, rss_limit: float | None,
                 period_s: float = 0.25) -> None:
        self.sid, self.disk_dir, self.min_available, self.rss_limit = sid, disk_dir, min_available, rss_limit
        self.period_s = period_s
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak_rss = self.peak_disk = 0
        self.start_available = self.low_available = mem_available()

    def tree_rss(self) -> int:
        total = 0
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # exited while listing
            if int(fields[3]) == self.sid:  # fields[3]: session id; fields[21]: resident pages
                total += int(fields[21]) * self.page
        return total

    def disk_bytes(self) -> int:
        total = 0
        for root, _, files in os.walk(self.disk_dir):
            for name in files:
                try:
                    total += os.stat(os.path.join(root, name)).st_blocks * 512  # allocated, not apparent, size
                except OSError:
                    pass
        return total

    def sample(self) -> None:
        self.peak_rss = max(self.peak_rss, self.tree_rss())
        self.low_available = min(self.low_available, mem_available())
        self.peak_disk = max(self.peak_disk, self.disk_bytes())

    def follow(self, proc: subprocess.Popen, timeout_s: float) -> str | None:
        """Wait for ``proc``; None when it exited by itself, else why the driver stopped it."""
        deadline = time.monotonic() + timeout_s
        reason = None
        while proc.poll() is None:
            self.sample()
            if self.low_available < self.min_available:
                reason = "host-floor"
            elif self.rss_limit is not None and self.peak_rss > self.rss_limit:
                reason = "host-limit"
            elif time.monotonic() > deadline:
                reason = "timeout"
            if reason is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the worker's session only
                except ProcessLookupError:
                    pass
                break
            time.sleep(self.period_s)
        proc.wait()
        return reason

    def peaks(self) -> dict:
        return {"peak_host_rss_gib": self.peak_rss / GIB, "start_available_gib": self.start_available / GIB,
                "min_available_gib": self.low_available / GIB, "peak_disk_gib": self.peak_disk / GIB}


# --tiny: (what fails, rungs above the estimator's start where it starts failing). Chosen so the
# run shows every path: pass then fail, fail then pass, two passes, each failure kind.
TINY_FAILURES = {
    "p-none": ("gpu-oom", 0), "p-none-8b": ("gpu-oom", -1), "p-opt": ("host-kill", 1),
    "p-opt-8b": ("host-ballast", 0), "p-optp": ("hang", 0), "p-optp-gm": ("host-kill", 0), "p-optp-8b": ("gpu-oom", 0),
    "p-nvme": ("disk-full", 0), "p-nvme-8b": ("host-kill", -1), "fsdp2": ("gpu-oom", 0),
    "fsdp2-off": ("host-kill", -1), "ds-off": ("gpu-oom", 0),
}


def tiny_simulation(setting: Setting, start: int, rungs: list[tuple[int, int]]) -> dict:
    kind, offset = TINY_FAILURES[setting.name]
    edge = start + offset
    above = 0 if edge < 0 else gpt_params(*rungs[min(edge, len(rungs) - 1)], vocab=512, seq_len=64)
    return {"kind": kind, "above_params": above, "ballast_bytes": int(1.5 * GIB)}


def measure_disk_gbps(directory: str, nbytes: int = 1 << 30) -> dict:
    """Sequential write (fsync'd) and read (page cache dropped first) GB/s of a file under
    ``directory``: what the NVMe part of the trial-time model divides by. One GiB, ~1 s."""
    path = os.path.join(directory, "bandwidth-probe")
    chunk = os.urandom(64 << 20)
    count = max(1, nbytes // len(chunk))
    try:
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for _ in range(count):
                f.write(chunk)
            os.fsync(f.fileno())
        write_s = time.perf_counter() - start
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the disk, not from memory
            start = time.perf_counter()
            while os.read(fd, len(chunk)):
                pass
            read_s = time.perf_counter() - start
        finally:
            os.close(fd)
    finally:
        if os.path.exists(path):
            os.remove(path)
    total = count * len(chunk)
    write, read = total / write_s / 1e9, total / read_s / 1e9
    # Equal bytes read and written per step: their combined rate is the harmonic mean.
    return {"write_gbps": write, "read_gbps": read, "nvme_gbps": 2 / (1 / write + 1 / read)}
