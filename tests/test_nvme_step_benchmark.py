"""benchmarks/nvme_step.py's arithmetic without training: the bound of a step from its exact bytes
and the measured bandwidths, the best-of bandwidth, and the markdown table; plus the store
bandwidth measurement on a few MiB of this machine's disk (exact byte and request counts)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _disk_bandwidth import store_bandwidth  # noqa: E402
from nvme_step import _best, summarize, table  # noqa: E402

GB = 1e9


def _step(warmup: bool, step_s: float, *, read: int, written: int) -> dict:
    swap = {"seconds": step_s / 2, "compute_s": 0.1, "read_wait_s": 0.2, "write_wait_s": 0.3,
            "bytes_read": read, "bytes_written": written, "prefetched": 2, "deferred": 1}
    return {"warmup": warmup, "step_s": step_s, "forward_s": 0.5, "backward_s": 1.0, "optimizer_s": step_s - 1.5,
            "swap": swap, "step_io": {"busy_s": 4.0}}


def test_bound_is_bytes_over_the_measured_bandwidth() -> None:
    read, written = 10 * 10**9, 10 * 10**9
    run = {"name": "pipelined", "sub_groups": 26,
           "steps": [_step(True, 3.0, read=0, written=written)] + [_step(False, t, read=read, written=written) for t in (9.0, 11.0, 10.0)]}
    bandwidth = {"store": {"read_gb_s": 4.0, "write_gb_s": 2.5}, "dd": {"read_gb_s": 5.0, "write_gb_s": 5.0}}
    out = summarize(run, bandwidth)
    assert out["timed_steps"] == 3 and out["step_s"] == 10.0 and out["optimizer_s"] == 8.5  # medians, warm-up left out
    assert (out["bytes_read"], out["bytes_written"]) == (read, written)
    store = out["bound_store"]
    assert store["serial_s"] == pytest.approx(10 / 4.0 + 10 / 2.5)  # 2.5 s reading + 4 s writing
    assert store["overlapped_s"] == pytest.approx(4.0)
    assert store["step_over_serial"] == pytest.approx(10.0 / 6.5)
    assert store["optimizer_over_serial"] == pytest.approx(8.5 / 6.5)
    assert out["bound_dd"]["serial_s"] == pytest.approx(4.0)
    assert out["achieved_gb_s"] == pytest.approx(20 / 4.0)  # 20 GB moved in 4 busy seconds
    text = table({"bandwidth": {k: {**v, "path": k} for k, v in bandwidth.items()}, "summary": [out]})
    assert "| pipelined | 3 | 10.00 | 1.50 | 8.50 | 5.00: 0.10 / 0.20 / 0.30 | 4.00 (5.00) | 10.00 | 10.00 | 6.50 / 4.00 | 1.54 (dd: 2.50) | 1.31 |" in text
    # A run that stopped before its first timed step says why instead of inventing a ratio.
    short = summarize({"name": "serial", "steps": [_step(True, 3.0, read=0, written=written)], "stopped": "allowance"}, bandwidth)
    assert short == {"name": "serial", "timed_steps": 0, "note": "allowance"}


def test_best_of_takes_the_faster_measurement_per_direction() -> None:
    best = _best([{"read_gb_s": 1.0, "write_gb_s": 3.0, "path": "a"}, {"read_gb_s": 2.0, "write_gb_s": 2.5, "path": "a"}])
    assert (best["read_gb_s"], best["write_gb_s"], best["samples"]) == (2.0, 3.0, 2)


def test_store_bandwidth_moves_exactly_the_bytes_it_reports(tmp_path) -> None:
    aio = {"block_size": 65536, "queue_depth": 2, "intra_op_parallelism": 1}
    out = store_bandwidth(str(tmp_path), aio=aio, numel=40_000, count=6, buffer_count=3, pin=False)
    assert out["tensor_bytes"] == 160_000 and out["tensors"] == 6
    assert out["write_gb_s"] > 0 and out["read_gb_s"] > 0 and out["mixed_gb_s"] > 0
    # 160000 bytes = 2 whole 64 KiB requests + a 28928-byte tail; 6 writes, 6 reads, 3 + 3 mixed.
    assert out["direct_requests"] + out["buffered_requests"] == 3 * (6 + 6 + 6)
    assert list(tmp_path.iterdir()) == []  # the store removed its files
