"""The disk's sequential bandwidth, measured two ways, for benchmarks/nvme_step.py's bound.

1. Through partita's own swap path (:class:`~partita.offload.nvme.NvmeSwapStore`): the same
   O_DIRECT block requests, ``aio`` settings, tensor size (one sub-group's state) and number of
   operations outstanding (``buffer_count``) as the NVMe optimizer uses, on page-aligned buffers
   (not page-locked, as the optimizer's). Write, read, and both at once (half the tensors read while the other
   half are written), which says whether the disk serves reads and writes in parallel.
2. Raw, for reference: ``dd`` with 64 MiB O_DIRECT blocks (the kernel splits each into many
   device requests, so one ``dd`` keeps a deep queue), writing then reading one file. dd writes
   zeros (a random source would be slower than the disk); the store's test writes random data,
   so a device that treats zero blocks specially shows up as a gap between the two.

O_DIRECT bypasses the page cache, so the figures are the device's, not memory's; the files are
removed afterwards.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections import deque
from typing import Any

GB = 1e9


def store_bandwidth(path: str, *, aio: dict, numel: int, count: int, buffer_count: int, pin: bool) -> dict[str, Any]:
    """Write ``count`` tensors of ``numel`` fp32 elements through one store, read them back, then
    read half while writing the other half; GB/s (10^9 bytes) of each, and the store's counters."""
    import torch

    from partita.offload.buffer_pool import PinnedBufferPool
    from partita.offload.config import AioConfig
    from partita.offload.nvme import NvmeSwapStore

    keys = [f"t{i}" for i in range(count)]
    with NvmeSwapStore(path, aio=AioConfig(**aio), buffer_count=buffer_count, tag="bandwidth") as store, \
            PinnedBufferPool(count=buffer_count, numel=numel, dtype=torch.float32, pin=pin, name="bandwidth") as pool:
        store.allocate({k: (numel, torch.float32) for k in keys})
        buffers = [pool.acquire() for _ in range(buffer_count)]
        for b in buffers:
            b.uniform_()  # not zeros: some devices compress or skip zero blocks

        def run(ops: list[tuple[str, str]]) -> float:
            # At most buffer_count operations outstanding, each on its own buffer, as the optimizer.
            pending: deque = deque()
            free = deque(buffers)
            start = time.perf_counter()
            for kind, key in ops:
                if not free:
                    future, buffer = pending.popleft()
                    future.result()
                    free.append(buffer)
                buffer = free.popleft()
                submit = store.write if kind == "write" else store.read
                pending.append((submit(key, buffer), buffer))
            for future, _ in pending:
                future.result()
            return time.perf_counter() - start

        nbytes = numel * 4
        write_s = run([("write", k) for k in keys])
        before = store.io_counters()
        read_s = run([("read", k) for k in keys])
        half = count // 2
        mixed_ops = [op for i in range(half) for op in (("read", keys[i]), ("write", keys[half + i]))]
        mixed_s = run(mixed_ops)
        counters = store.io_counters()
        return {
            "path": "NvmeSwapStore", "aio": aio, "tensor_bytes": nbytes, "tensors": count, "buffer_count": buffer_count,
            "direct_io": store.direct_io, "pinned": pool.pinned,
            "write_gb_s": count * nbytes / write_s / GB, "read_gb_s": count * nbytes / read_s / GB,
            "mixed_gb_s": 2 * half * nbytes / mixed_s / GB,
            "write_s": write_s, "read_s": read_s, "mixed_s": mixed_s,
            "read_busy_s": (counters - before).read_busy_s, "direct_requests": counters.direct_requests,
            "buffered_requests": counters.buffered_requests,
        }


_DD_RE = re.compile(r"^(\d+) bytes .* copied, ([\d.]+) s", re.MULTILINE)


def dd_bandwidth(path: str, *, total_bytes: int, block_mib: int = 64) -> dict[str, Any]:
    """``dd oflag=direct`` then ``dd iflag=direct`` of one file; GB/s from dd's own byte and second counts."""
    target = os.path.join(path, f"partita-dd-{os.getpid()}.bin")
    count = max(1, total_bytes // (block_mib * 2**20))
    out: dict[str, Any] = {"path": f"dd bs={block_mib}M O_DIRECT", "bytes": count * block_mib * 2**20}
    try:
        for kind, cmd in (
            ("write", ["dd", "if=/dev/zero", f"of={target}", f"bs={block_mib}M",
                       f"count={count}", "oflag=direct", "conv=fdatasync"]),
            ("read", ["dd", f"if={target}", "of=/dev/null", f"bs={block_mib}M", "iflag=direct"]),
        ):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            match = _DD_RE.search(done.stderr)
            if done.returncode != 0 or match is None:
                out[f"{kind}_error"] = done.stderr.strip()[-300:]
                continue
            out[f"{kind}_gb_s"] = int(match.group(1)) / float(match.group(2)) / GB
    except (OSError, subprocess.TimeoutExpired) as error:
        out["error"] = f"{type(error).__name__}: {error}"
    finally:
        try:
            os.unlink(target)
        except OSError:
            pass
    return out
