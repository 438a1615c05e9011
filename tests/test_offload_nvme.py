"""NVMe swap store (partita/offload/nvme.py) and pinned staging-buffer pool (buffer_pool.py), on CPU."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import namedtuple

import pytest
import torch

from partita.config.base import ConfigError
from partita.offload.buffer_pool import BUFFER_ALIGNMENT, PinnedBufferPool
from partita.offload.config import AioConfig
from partita.offload.errors import (
    BufferPoolError,
    NvmeConfigError,
    NvmeSpaceError,
    NvmeSwapError,
    PoolExhaustedError,
)
from partita.offload.nvme import IoCounters, NvmeSwapStore


def _aio(**kw) -> AioConfig:
    return AioConfig(**{"block_size": 4096, **kw})


def _random(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-128, 128, (numel,), generator=g, dtype=torch.int64).to(dtype)


# ---- NvmeSwapStore: data ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "block_size, threads, queue_depth, single_submit, overlap_events",
    [
        (4096, 1, 1, False, True),
        (4096, 3, 2, False, True),
        (8192, 2, 8, True, True),
        (12288, 4, 3, False, False),
        (4096, 1, 8, True, False),
    ],
)
def test_round_trip_exact(tmp_path, block_size, threads, queue_depth, single_submit, overlap_events):
    aio = AioConfig(
        block_size=block_size,
        queue_depth=queue_depth,
        intra_op_parallelism=threads,
        single_submit=single_submit,
        overlap_events=overlap_events,
    )
    # Sizes chosen so the byte counts are not multiples of any block size above.
    specs = {"fp32": (10_007, torch.float32), "bf16": (6_151, torch.bfloat16), "int8": (20_001, torch.int8),
             "tiny": (3, torch.float32), "empty": (0, torch.float32)}
    with NvmeSwapStore(tmp_path, aio=aio, buffer_count=3, tag="rt") as store:
        store.allocate(specs)
        data = {k: _random(n, dt, seed=i) for i, (k, (n, dt)) in enumerate(specs.items())}
        for key, tensor in data.items():
            store.write_sync(key, tensor)
            size = os.path.getsize(store.file_path(key))
            assert size == -(-tensor.numel() * tensor.element_size() // block_size) * block_size
        for key, tensor in data.items():
            out = torch.full_like(tensor, 7)
            assert store.read_sync(key, out) is out
            assert torch.equal(out, tensor), key
        total = sum(t.numel() * t.element_size() for t in data.values())
        assert store.bytes_written == total
        assert store.bytes_read == total
        limit = threads if single_submit else threads * queue_depth
        assert 1 <= store.peak_requests_in_flight <= limit


def test_store_takes_the_aio_section_of_a_config(tmp_path):
    from partita.config import load_config

    aio = load_config({"train_batch_size": 2, "aio": {"thread_count": 3, "block_size": 8192, "queue_depth": 2}}).aio
    with NvmeSwapStore(tmp_path, aio=aio, buffer_count=2, tag="cfg") as store:
        assert (store.threads, store.block_size, store.queue_depth, store.single_submit) == (3, 8192, 2, False)
        store.allocate({"p": (9_999, torch.float32)})
        data = _random(9_999, torch.float32, seed=1)
        store.write_sync("p", data)
        out = torch.empty(9_999)
        store.read_sync("p", out)
        assert torch.equal(out, data)
        assert os.path.getsize(store.file_path("p")) == 40_960  # 39996 bytes rounded up to 8192


def test_many_overlapped_writes_and_reads(tmp_path):
    aio = _aio(queue_depth=4, intra_op_parallelism=3)
    with NvmeSwapStore(tmp_path, aio=aio, buffer_count=5, tag="many") as store:
        sizes = {f"t{i}": (1000 + 977 * i, torch.float32 if i % 2 else torch.bfloat16) for i in range(24)}
        store.allocate(sizes)
        data = {k: _random(n, dt, seed=100 + i) for i, (k, (n, dt)) in enumerate(sizes.items())}
        writes = [store.write(k, t) for k, t in data.items()]  # all in flight together, no waits
        for f in writes:
            f.result(timeout=30)
        outs = {k: torch.zeros_like(t) for k, t in data.items()}
        reads = {k: store.read(k, outs[k]) for k in data}
        for key, future in reads.items():
            assert future.result(timeout=30) is outs[key]
            assert torch.equal(outs[key], data[key]), key
        assert store.peak_requests_in_flight <= 3 * 4
        assert store.peak_requests_in_flight > 1  # requests really overlapped


def test_io_counters_count_exact_bytes_and_busy_seconds(tmp_path):
    # A known layout: bf16 and fp32 tensors of sizes that are no multiple of the block (padding is
    # not counted), plus an empty one (counted as an operation of 0 bytes).
    sizes = {"a": (3000, torch.float32), "b": (5001, torch.bfloat16), "c": (0, torch.float32)}
    nbytes = {"a": 12_000, "b": 10_002, "c": 0}
    with NvmeSwapStore(tmp_path, aio=_aio(queue_depth=2, intra_op_parallelism=2), buffer_count=3, tag="count") as store:
        store.allocate(sizes)
        zero = store.io_counters()
        assert zero == IoCounters()
        data = {k: _random(n, dt, seed=i) for i, (k, (n, dt)) in enumerate(sizes.items())}
        started = time.perf_counter()
        for f in [store.write(k, t) for k, t in data.items()]:
            f.result(timeout=30)
        written = store.io_counters()
        store.read_sync("a", torch.empty(3000))
        store.read_sync("a", torch.empty(3000))
        wall = time.perf_counter() - started
        after = store.io_counters()
        delta = after - written
    assert (written.bytes_written, written.writes, written.bytes_read, written.reads) == (22_002, 3, 0, 0)
    assert (delta.bytes_read, delta.reads, delta.bytes_written, delta.writes) == (2 * 12_000, 2, 0, 0)
    assert after.bytes_read == store.bytes_read and after.bytes_written == store.bytes_written == sum(nbytes.values())
    # 4096-byte requests: a = 3 (the last 3712 bytes), b = 3 (the last 1810): 6 per write pass, 3 per read.
    assert after.direct_requests + after.buffered_requests == 6 + 2 * 3
    assert written.read_busy_s == 0 and 0 < written.write_busy_s <= written.busy_s
    assert delta.write_busy_s == 0 and 0 < delta.read_busy_s == pytest.approx(delta.busy_s)
    assert after.busy_s <= wall and after.busy_s == pytest.approx(after.read_busy_s + after.write_busy_s)
    assert after.as_dict()["bytes_read"] == 24_000


def test_small_tensors_share_the_queue(tmp_path, monkeypatch):
    # One request per tensor: with one I/O thread, the outstanding tensors' requests are in the
    # kernel together (up to queue_depth), not one tensor after the other.
    real_pwrite = os.pwrite

    def slow_pwrite(fd, data, offset):
        time.sleep(0.05)
        return real_pwrite(fd, data, offset)

    with NvmeSwapStore(tmp_path, aio=_aio(queue_depth=3), buffer_count=4, tag="share") as store:
        store.allocate({f"k{i}": (1024, torch.float32) for i in range(4)})
        monkeypatch.setattr(os, "pwrite", slow_pwrite)
        for f in [store.write(f"k{i}", torch.full((1024,), float(i))) for i in range(4)]:
            f.result(timeout=30)
        monkeypatch.undo()
        assert store.peak_requests_in_flight == 3  # queue_depth x 1 thread, though each tensor is one request
        for i in range(4):
            assert torch.equal(store.read_sync(f"k{i}", torch.empty(1024)), torch.full((1024,), float(i)))


def test_aligned_buffers_use_direct_io(tmp_path):
    pool = PinnedBufferPool(count=1, numel=5_000, dtype=torch.float32, pin=True)
    buf = pool.acquire()
    assert buf.data_ptr() % BUFFER_ALIGNMENT == 0
    src = _random(5_000, torch.float32, seed=3)
    buf.copy_(src)
    with NvmeSwapStore(tmp_path, aio=_aio(), buffer_count=1, tag="direct") as store:
        store.allocate({"w": (5_000, torch.float32)})
        store.write_sync("w", buf)  # 20000 bytes: 4 whole 4096-byte blocks + a 3616-byte tail
        buf.zero_()
        store.read_sync("w", buf)
        assert torch.equal(buf, src)
        if store.direct_io:
            assert (store.direct_requests, store.buffered_requests) == (8, 2)
        else:  # e.g. tmpfs: everything buffered
            assert (store.direct_requests, store.buffered_requests) == (0, 10)
        # An unaligned tensor never goes direct.
        before = store.direct_requests
        unaligned = torch.empty(5_001)[1:]
        store.read_sync("w", unaligned)
        assert torch.equal(unaligned, src)
        assert store.direct_requests == before


def test_bad_tensors_and_keys_are_refused(tmp_path):
    with NvmeSwapStore(tmp_path, aio=_aio(), buffer_count=2, tag="bad") as store:
        store.allocate({"x": (100, torch.float32)})
        with pytest.raises(ValueError, match=r"'x'.*dtype torch.float16 \(allocated as torch.float32\)"):
            store.write("x", torch.zeros(100, dtype=torch.float16))
        with pytest.raises(ValueError, match=r"99 elements \(allocated as 100\)"):
            store.read("x", torch.zeros(99))
        with pytest.raises(ValueError, match="not contiguous"):
            store.write("x", torch.zeros(200)[::2])
        with pytest.raises(ValueError, match=r"swap key 'y' was not allocated.*allocated: 'x'"):
            store.read("y", torch.zeros(100))
        with pytest.raises(ValueError, match="already allocated"):
            store.allocate({"x": (5, torch.int8)})
        assert store.bytes_written == 0
    with pytest.raises(ValueError, match="tag='a/b'"):
        NvmeSwapStore(tmp_path, aio=_aio(), buffer_count=1, tag="a/b")


def test_same_tag_twice_in_one_process_is_refused(tmp_path):
    with NvmeSwapStore(tmp_path, aio=_aio(), buffer_count=1, tag="dup"):
        with pytest.raises(ValueError, match="tag 'dup' is already open"):
            NvmeSwapStore(tmp_path, aio=_aio(), buffer_count=1, tag="dup")
    with NvmeSwapStore(tmp_path, aio=_aio(), buffer_count=1, tag="dup"):  # free again after close
        pass


# ---- NvmeSwapStore: integrity ------------------------------------------------------------------


def test_removed_file_is_reported(tmp_path):
    with NvmeSwapStore(tmp_path, aio=_aio(), buffer_count=2, tag="rm", config_key="offload_param.nvme_path") as store:
        store.allocate({"layer.0.weight": (3000, torch.float32)})
        store.write_sync("layer.0.weight", torch.ones(3000))
        path = store.file_path("layer.0.weight")
        os.remove(path)
        with pytest.raises(NvmeSwapError) as info:
            store.read("layer.0.weight", torch.empty(3000)).result()
        msg = str(info.value)
        assert "key 'layer.0.weight' is missing" in msg
        assert path in msg
        assert "expected 12288 bytes, found no file" in msg
        assert "must not be touched while training" in msg
        assert "offload_param.nvme_path" in msg
        with pytest.raises(NvmeSwapError, match="is missing"):  # a write does not silently recreate it
            store.write_sync("layer.0.weight", torch.ones(3000))
        assert not os.path.exists(path)


def test_truncated_file_is_reported(tmp_path):
    with NvmeSwapStore(tmp_path, aio=_aio(), buffer_count=2, tag="trunc") as store:
        store.allocate({"m": (3000, torch.float32)})
        store.write_sync("m", torch.ones(3000))
        path = store.file_path("m")
        os.truncate(path, 5000)
        with pytest.raises(NvmeSwapError) as info:
            store.read_sync("m", torch.empty(3000))
        msg = str(info.value)
        assert f"swap file for key 'm' has the wrong size: {path} is 5000 bytes, expected 12288 bytes" in msg
        assert "must not be touched while training" in msg
        assert store.bytes_read == 0


def test_worker_errors_reach_the_future(tmp_path, monkeypatch):
    with NvmeSwapStore(tmp_path, aio=_aio(intra_op_parallelism=2), buffer_count=2, tag="eio") as store:
        store.allocate({"k": (50_000, torch.float32)})
        store.write_sync("k", torch.ones(50_000))

        def failing_preadv(fd, buffers, offset):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "preadv", failing_preadv)
        future = store.read("k", torch.empty(50_000))
        error = future.exception(timeout=30)
        assert isinstance(error, NvmeSwapError)
        assert "swap read of key 'k' failed at bytes [" in str(error)
        assert "Input/output error" in str(error)
        assert isinstance(error.__cause__, OSError)
        assert store.bytes_read == 0
        monkeypatch.undo()
        out = torch.empty(50_000)
        store.read_sync("k", out)  # the store still works afterwards
        assert torch.equal(out, torch.ones(50_000))


# ---- NvmeSwapStore: directory and space checks ---------------------------------------------


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(NvmeConfigError) as info:
        NvmeSwapStore(missing, aio=_aio(), buffer_count=1, tag="x", config_key="offload_optimizer.nvme_path")
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)
    assert f"offload_optimizer.nvme_path='{missing}': the directory does not exist" in str(info.value)
    assert not missing.exists()


def test_path_is_a_file(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(NvmeConfigError, match=r"offload_param.nvme_path=.*file': not a directory"):
        NvmeSwapStore(target, aio=_aio(), buffer_count=1, tag="x", config_key="offload_param.nvme_path")


def test_not_writable_directory(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.geteuid() == 0:  # root ignores permission bits: make access() report what a user would see
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, m: False if os.fspath(p) == str(locked) else real_access(p, m))
    with pytest.raises(NvmeConfigError, match=r"offload_optimizer.nvme_path=.*locked': the directory is not writable"):
        NvmeSwapStore(locked, aio=_aio(), buffer_count=1, tag="x")
    locked.chmod(0o700)
    assert os.listdir(locked) == []


def test_insufficient_space_is_refused_before_writing(tmp_path, monkeypatch):
    (tmp_path / "partita-old-rank0-pid1").mkdir()  # a leftover of an earlier run is pointed out
    store = NvmeSwapStore(tmp_path, aio=_aio(), buffer_count=1, tag="space")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 5000, 5000))
    with pytest.raises(NvmeSpaceError) as info:
        # 40 bytes -> one 4096-byte block; 5000 bytes -> two blocks: 12288 bytes needed.
        store.allocate({"a": (10, torch.float32), "b": (5000, torch.int8)})
    msg = str(info.value)
    assert "need 12288 bytes" in msg and "free 5000 bytes" in msg
    assert str(tmp_path) in msg and "offload_optimizer.nvme_path" in msg
    assert "partita-old-rank0-pid1" in msg
    assert isinstance(info.value, ValueError)
    assert os.listdir(store.swap_dir) == []  # nothing written
    assert store.keys() == []
    monkeypatch.undo()
    store.allocate({"a": (10, torch.float32)})  # with room it works
    assert os.path.getsize(store.file_path("a")) == 4096
    store.close()


def test_disk_full_during_preallocation_removes_partial_files(tmp_path, monkeypatch):
    calls = []

    def fallocate(fd, offset, length):
        calls.append(length)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        os.ftruncate(fd, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with NvmeSwapStore(tmp_path, aio=_aio(), buffer_count=1, tag="full") as store:
        with pytest.raises(NvmeSpaceError, match=r"need 16384 bytes .*No space left on device"):
            store.allocate({"a": (1024, torch.float32), "b": (3000, torch.float32)})
        assert calls == [4096, 12288]
        assert os.listdir(store.swap_dir) == []
        assert store.keys() == []


def test_preallocation_without_fallocate_writes_zeros(tmp_path, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    with NvmeSwapStore(tmp_path, aio=_aio(), buffer_count=1, tag="nofa") as store:
        store.allocate({"z": (2500, torch.float32)})
        path = store.file_path("z")
        with open(path, "rb") as f:
            assert f.read() == bytes(12288)
        st = os.stat(path)
        assert st.st_blocks * 512 >= 12288  # really allocated, not sparse
        data = _random(2500, torch.float32, seed=9)
        store.write_sync("z", data)
        out = torch.empty(2500)
        store.read_sync("z", out)
        assert torch.equal(out, data)


def test_large_preallocation_shows_progress_and_small_stays_silent(tmp_path, monkeypatch, capsys):
    import partita.offload.nvme as nvme

    mib = 2**20
    sizes = {"a": (mib // 4, torch.float32), "b": (mib // 4 + 1, torch.float32)}  # files of 1 and 2 MiB
    monkeypatch.setattr(nvme, "PROGRESS_MIN_BYTES", 3 * mib + 1)
    with NvmeSwapStore(tmp_path, aio=_aio(block_size=mib), buffer_count=1, tag="quiet") as store:
        store.allocate(sizes)
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(nvme, "PROGRESS_MIN_BYTES", 3 * mib)
    with NvmeSwapStore(tmp_path, aio=_aio(block_size=mib), buffer_count=1, tag="shown") as store:
        store.allocate(sizes)
        # Not a terminal (pytest captures stdout): one plain line at the end, no bar.
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"pre-allocating swap files in {store.swap_dir} (MiB): 3/3 (100%) [")


# ---- NvmeSwapStore: lifecycle ------------------------------------------------------------------


def test_close_waits_for_io_and_removes_everything(tmp_path):
    store = NvmeSwapStore(tmp_path, aio=_aio(queue_depth=2, intra_op_parallelism=2), buffer_count=8, tag="close")
    assert os.path.basename(store.swap_dir) == f"partita-close-rank0-pid{os.getpid()}"
    assert os.path.dirname(store.swap_dir) == str(tmp_path)
    store.allocate({f"k{i}": (40_000, torch.float32) for i in range(8)})
    futures = [store.write(f"k{i}", torch.full((40_000,), float(i))) for i in range(8)]
    store.close()
    assert all(f.done() and f.exception() is None for f in futures)
    assert store.bytes_written == 8 * 160_000
    assert not os.path.exists(store.swap_dir)
    assert os.listdir(tmp_path) == []
    store.close()  # twice is fine
    with pytest.raises(NvmeSwapError, match="is closed"):
        store.write("k0", torch.zeros(40_000))


def test_interpreter_exit_removes_the_swap_directory(tmp_path):
    script = (
        "import sys, torch\n"
        "from partita.offload.config import AioConfig\n"
        "from partita.offload.nvme import NvmeSwapStore\n"
        "store = NvmeSwapStore(sys.argv[1], aio=AioConfig(), buffer_count=2, tag='exit')\n"
        "store.allocate({'a': (1000, torch.float32)})\n"
        "store.write('a', torch.ones(1000))\n"  # not waited for, not closed
        "print(store.swap_dir)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(tmp_path / "partita-exit-rank0-pid"))
    assert os.listdir(tmp_path) == []


def test_overlap_events_false_serialises_operations(tmp_path):
    with NvmeSwapStore(tmp_path, aio=_aio(overlap_events=False, queue_depth=1), buffer_count=4, tag="ser") as store:
        store.allocate({f"k{i}": (30_000, torch.float32) for i in range(4)})
        futures = []
        for i in range(4):
            futures.append(store.write(f"k{i}", torch.full((30_000,), float(i))))
            # The store waited for every earlier write before submitting this one.
            assert all(f.done() for f in futures[:-1])
        for i, f in enumerate(futures):
            f.result()
            out = torch.empty(30_000)
            store.read_sync(f"k{i}", out)
            assert torch.equal(out, torch.full((30_000,), float(i)))


# ---- PinnedBufferPool ----------------------------------------------------------------------


def test_pool_basics_and_exhaustion():
    pool = PinnedBufferPool(count=2, numel=1000, dtype=torch.bfloat16, pin=True, name="grads")
    assert pool.pinned == torch.cuda.is_available()
    assert (pool.capacity, pool.buffer_bytes, pool.total_bytes) == (2, 2000, 4000)
    a = pool.acquire()
    b = pool.acquire()
    assert a.dtype == torch.bfloat16 and a.shape == (1000,) and a.device.type == "cpu"
    assert a.data_ptr() != b.data_ptr()
    assert a.data_ptr() % BUFFER_ALIGNMENT == 0 and b.data_ptr() % BUFFER_ALIGNMENT == 0
    assert (pool.in_use, pool.peak_in_use) == (2, 2)
    start = time.monotonic()
    with pytest.raises(PoolExhaustedError) as info:
        pool.acquire(timeout_s=0.05)
    assert time.monotonic() - start >= 0.05
    assert isinstance(info.value, TimeoutError)
    assert "buffer pool 'grads': all 2 buffers (2000 bytes each) are still in use after waiting 0.05 s" in str(info.value)
    pool.release(a[:10])  # a view releases its buffer
    assert pool.in_use == 1
    c = pool.acquire(timeout_s=0)
    assert c.data_ptr() == a.data_ptr()  # the same memory comes back, nothing new was allocated
    assert (pool.in_use, pool.peak_in_use) == (2, 2)
    pool.release(b)
    pool.release(c)
    assert (pool.in_use, pool.peak_in_use) == (0, 2)


def test_pool_refuses_foreign_and_double_release():
    pool = PinnedBufferPool(count=1, numel=16, dtype=torch.float32, pin=False)
    assert pool.pinned is False
    buf = pool.acquire()
    with pytest.raises(BufferPoolError, match="not one of this pool's 1 buffers"):
        pool.release(torch.zeros(16))
    other = PinnedBufferPool(count=1, numel=16, dtype=torch.float32, pin=False, name="other")
    with pytest.raises(BufferPoolError, match="'other'.*not one of this pool's"):
        other.release(buf)
    pool.release(buf)
    with pytest.raises(BufferPoolError, match="buffer 0 released twice"):
        pool.release(buf)
    assert pool.in_use == 0
    with pytest.raises(ValueError, match="count=0 must be an integer >= 1"):
        PinnedBufferPool(count=0, numel=16, dtype=torch.float32, pin=False)


def test_pool_never_exceeds_capacity_under_contention():
    pool = PinnedBufferPool(count=2, numel=64, dtype=torch.float32, pin=True)
    observed = []
    owners: dict[int, int] = {}
    guard = threading.Lock()
    errors = []

    def worker(tid: int) -> None:
        try:
            for _ in range(40):
                with pool.borrowed(timeout_s=10) as buf:
                    with guard:
                        observed.append(pool.in_use)
                        ptr = buf.data_ptr()
                        assert ptr not in owners, "one buffer handed to two threads"
                        owners[ptr] = tid
                    buf.fill_(tid)
                    time.sleep(0.0005)
                    assert bool((buf == tid).all()), "buffer written by another thread while held"
                    with guard:
                        del owners[ptr]
        except BaseException as exc:  # collected so a failure in a thread fails the test
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(observed) == 8 * 40
    assert max(observed) <= 2
    assert pool.peak_in_use == 2
    assert pool.in_use == 0


def test_pool_close_wakes_waiters():
    pool = PinnedBufferPool(count=1, numel=8, dtype=torch.int8, pin=False)
    held = pool.acquire()
    result = []

    def waiter() -> None:
        try:
            pool.acquire()
        except BufferPoolError as exc:
            result.append(str(exc))

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    pool.close()
    t.join(timeout=5)
    assert result == ["buffer pool 'staging' is closed; no buffer can be acquired"]
    pool.release(held)  # returning a buffer after close is accepted
    pool.close()
