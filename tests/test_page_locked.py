"""Exact-size page-locked host memory (partita/offload/page_locked.py).

On this CPU-only machine the CUDA driver is replaced by a recorder, so the tests check what
partita asks the driver for: exactly each tensor's bytes registered, each range unregistered once
(on close, or when the owner is collected unclosed), and nothing registered after close. The last
test runs the real driver where CUDA exists.
"""

from __future__ import annotations

import gc
import types

import pytest
import torch

from partita.offload.buffer_pool import BUFFER_ALIGNMENT, PinnedBufferPool
from partita.offload.page_locked import PageLockedHost
from partita.offload.transfer import HostTransfer


class FakeDriver:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # base -> bytes
        self.unregistered: list[int] = []
        self.refuse = False

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 (the driver's name)
        if self.refuse:
            return 1  # cudaErrorInvalidValue
        assert ptr not in self.registered, "registered twice"
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        assert ptr in self.registered, "unregistering a range never registered"
        del self.registered[ptr]
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return fake


def test_without_cuda_tensors_are_plain_and_exact():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only fallback")
    host = PageLockedHost(True)
    t = host.empty(1000, torch.bfloat16)
    assert not host.enabled and t.numel() == 1000 and t.dtype == torch.bfloat16
    assert not host.holds(t) and host.nbytes == 0 and not t.is_pinned()
    host.close()
    host.close()


def test_registers_exactly_the_tensor_bytes_and_unregisters_once(driver):
    host = PageLockedHost(True)
    a = host.empty(3_000_001, torch.float32)  # torch's pinned allocator would take 16 MiB for these 12 MB
    b = host.empty(5, torch.bfloat16)
    assert driver.registered == {a.data_ptr(): 12_000_004, b.data_ptr(): 10}
    assert host.nbytes == 12_000_014
    assert host.holds(a) and host.holds(a[100:200]) and host.holds(b)
    assert not host.holds(torch.empty(4))
    host.close()
    assert sorted(driver.unregistered) == sorted([a.data_ptr(), b.data_ptr()]) and driver.registered == {}
    host.close()  # safe twice: nothing unregistered again
    assert len(driver.unregistered) == 2
    assert not host.register(torch.empty(8)) and driver.registered == {}  # closed: refused, not leaked


def test_collected_without_close_unregisters(driver):
    host = PageLockedHost(True)
    t = host.empty(64)
    base = t.data_ptr()
    del host
    gc.collect()
    assert driver.unregistered == [base] and driver.registered == {}


def test_refused_or_disabled_registration_leaves_plain_memory(driver):
    driver.refuse = True
    host = PageLockedHost(True)
    t = host.empty(64)
    assert t.numel() == 64 and not host.holds(t) and host.nbytes == 0
    off = PageLockedHost(False)
    assert not off.enabled and not off.register(torch.empty(8)) and driver.registered == {}
    assert not PageLockedHost(True).register(torch.empty(0))
    assert not PageLockedHost(True).register(torch.empty(4, 4).t())  # not contiguous


def test_staging_pool_locks_each_buffer_exactly_and_aligned(driver):
    pool = PinnedBufferPool(count=3, numel=2**20, dtype=torch.float32, pin=True, name="t")
    assert pool.pinned
    assert sorted(driver.registered.values()) == [4 * 2**20] * 3  # not 8 MiB each for buffer + alignment page
    buffers = [pool.acquire() for _ in range(3)]
    assert all(b.data_ptr() % BUFFER_ALIGNMENT == 0 and b.data_ptr() in driver.registered for b in buffers)
    for b in buffers:
        pool.release(b)
    pool.close()
    assert driver.registered == {} and len(driver.unregistered) == 3


def test_host_transfer_on_a_cpu_device_locks_nothing(driver):
    # The model on the CPU: no copy engine to serve, so pin_memory is moot and nothing is registered.
    transfer = HostTransfer(torch.device("cpu"), buffer_count=2, pin_memory=True, staging_bytes=4096)
    grad = transfer.empty_host(7_000_003)
    assert grad.numel() == 7_000_003 and not transfer.pin_in_place(torch.empty(11))
    assert driver.registered == {}
    transfer.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs the CUDA driver")
def test_real_driver_copies_through_registered_memory():
    host = PageLockedHost(True)
    src = host.empty(1 << 20)
    src.copy_(torch.arange(1 << 20, dtype=torch.float32))
    assert host.holds(src) and src.is_pinned()
    dst = src.to("cuda", non_blocking=True)
    back = host.empty(1 << 20)
    back.copy_(dst * 2, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src * 2)
    host.close()
    assert not src.is_pinned()
