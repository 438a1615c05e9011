"""An NVMe-offload engine dropped without destroy() and collected on one of its swap store's own
I/O threads while a read is in flight closes without deadlocking (partita/offload/finalizers.py).

Before the fix the swapper's ``weakref.finalize`` ran the store's close on the collecting
thread; the close waits for the store's I/O threads, so a collection on a block-request thread,
with the read-ahead a step leaves for the next step still in the kernel, waited for itself
forever. Tests that build engines in a loop and never destroy them (tests/test_zero_parity.py's
``train_partita``) leave exactly that behind; a one-off 180 s hang of
tests/test_offload_nvme_optimizer.py::test_other_optimizers_and_errors is one way it shows.
Here the collection is forced onto a request thread, deterministically.
"""

from __future__ import annotations

import os

from tests.harness import run_distributed
from tests.test_offload_nvme_optimizer import _config, _engine, _nvme, _train, _with_aio


def collected_on_a_request_thread(nvme_path: str) -> dict:
    import gc
    import threading
    import time

    import partita.offload.nvme_io as nvme_io

    engine = _engine(_with_aio(_config(2, 1, **_nvme(nvme_path, read=True))))
    store = engine.optimizer.swapper.store  # the atexit hook holds it too; the swapper is what gets collected
    swap_dir = store.swap_dir
    holder, go, collected, armed = [engine], threading.Event(), threading.Event(), threading.Event()
    del engine
    original = nvme_io.BlockIO._request
    lock = threading.Lock()

    def request(self, op, offset, length):
        if armed.is_set() and op.kind == "read":
            go.wait(30)  # the read-ahead's requests wait here: a read is in flight
            with lock:
                if holder:
                    dropped = holder.pop()
                    del dropped  # the last reference: the engine (and its swapper) are garbage now
                    gc.collect()  # on this request thread, as a collection triggered here would
                    collected.set()
        return original(self, op, offset, length)

    nvme_io.BlockIO._request = request
    gc.disable()  # no collection on the training thread first
    try:
        armed.set()
        _train(holder[0], 0, 1)  # its end starts reading the next step's first ranges (pipeline_read)
        go.set()
        finished = collected.wait(30)
        deadline = time.monotonic() + 30
        while os.path.exists(swap_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        gc.enable()
        nvme_io.BlockIO._request = original
    return {"collected": finished, "removed": not os.path.exists(swap_dir), "closed": store._io.closed}


def test_an_engine_collected_on_its_own_io_thread_closes(tmp_path) -> None:
    out = run_distributed(collected_on_a_request_thread, 1, str(tmp_path), timeout=120)[0]
    assert out == {"collected": True, "removed": True, "closed": True}, out
