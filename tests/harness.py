"""Run a test body on N spawned CPU processes (gloo) and fail on a hang.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh processes with the
torchrun environment variables set (so ``partita.initialize`` starts gloo by itself),
calls ``fn(*args)`` in each, and returns the per-rank results in rank order. An
exception in any rank fails the test with that rank's traceback; a rank that does not
finish within ``timeout`` seconds fails it as a hang, and every process is killed.
``fn`` must be a module-level function (each rank imports it by name).

The parent hosts the job's TCPStore on a port the OS picks while binding it, and the ranks join
it as clients, as torchrun's workers join the agent's store (``TORCHELASTIC_USE_AGENT_STORE``).
Picking a free port first and letting rank 0 bind it later raced with every other process on a
busy machine (another test job could take the port in between: "address already in use"), and a
rank 0 that finished first took the store away from ranks still reading it.

The ranks are forked from a ``forkserver`` that imported torch and partita once for the whole
test session: spawning each rank from scratch paid ~5 s of CPU per rank for those imports (about
a third of the suite's time on 2 cores). The server only imports, never runs an op, so no thread
pool or process group exists in it to be forked; every rank is still a fresh process. A forked
rank starts with the server's environment, so each rank is handed the test's ``os.environ`` and
applies it before it imports the test module (``fn`` travels by name, its arguments as bytes).
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import multiprocessing as mp
import os
import pickle
import queue as queue_lib
import signal
import tempfile
import time
import traceback
from typing import Any, Callable


# How long the ranks may take to start (spawn, import torch) before the test body's own
# ``timeout`` begins: on a 2-core machine busy with other jobs, start-up alone took over 60 s,
# which used to count against the body's hang timeout.
STARTUP_TIMEOUT_S = 300.0
_READY = "ready"


# What the fork server imports before it forks any rank (the imports every rank repeated).
# torch._dynamo: every rank's first torch optimizer imports it (Optimizer.__init__ ->
# torch._compile._disable_dynamo), ~1.8 CPU-s per rank; it starts no threads, so forking after
# it stays safe.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "partita.bootstrap"]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (first use)
    return ctx


def _worker(rank: int, world_size: int, port: int, environ: dict, fn_name: tuple[str, str], payload: bytes,
            results: mp.Queue) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the test's environment, not the fork server's
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        CUDA_VISIBLE_DEVICES="",
        TORCHELASTIC_USE_AGENT_STORE="True",  # the parent hosts the store (see the module doc)
    )
    import torch

    torch.set_num_threads(1)
    # On a hang the parent sends _STACK_SIGNAL: every thread's stack goes to this file (see _stacks).
    stacks = open(_stack_file(port, rank), "w")  # noqa: SIM115 - open for the rank's life
    faulthandler.register(_STACK_SIGNAL, file=stacks, all_threads=True)
    results.put((rank, _READY, None))
    try:
        module, qualname = fn_name
        fn = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        args = pickle.loads(payload)
        value = fn(*args)
        # Plain pickle copies tensors by value; torch's shared-memory reducer would hand
        # the parent file descriptors that vanish when this process exits.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            # partita's exit path: destroys the groups and joins gloo's worker threads now.
            from partita.distributed.shutdown import teardown_process_groups

            teardown_process_groups()
        # A forked rank ends in os._exit, which skips atexit; a spawned or torchrun-started rank
        # runs it. Run it here so the ranks exit as real jobs do (NVMe swap directories are
        # removed by atexit hooks, and tests check that they are).
        import atexit

        atexit._run_exitfuncs()


# A real-time signal nothing else uses (partita saves on SIGTERM/SIGUSR1, tests send SIGUSR1/2).
_STACK_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2


def _stack_file(port: int, rank: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"partita-test-stacks-{port}-{rank}.txt")


def _stacks(procs: list, ranks: list[int], port: int) -> str:
    """Every thread's stack of the hung ``ranks`` (faulthandler in each, on _STACK_SIGNAL)."""
    for r in ranks:
        if procs[r].is_alive():
            os.kill(procs[r].pid, _STACK_SIGNAL)
    time.sleep(1.0)
    out = []
    for r in ranks:
        try:
            with open(_stack_file(port, r)) as f:
                out.append(f"--- rank {r} stacks ---\n{f.read()}")
        except OSError:
            pass
    return "\n".join(out)


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = 180.0, expect_dead: frozenset[int] = frozenset()
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return results in rank order.

    Ranks in ``expect_dead`` are allowed to exit without reporting (tests of a rank that
    dies); their result is None.
    """
    from datetime import timedelta

    import torch.distributed as dist

    ctx = _context()
    results = ctx.Queue()
    fn_name, payload = (fn.__module__, fn.__qualname__), pickle.dumps(args)
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    port = store.port
    environ = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, environ, fn_name, payload, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    ready: set[int] = set()
    # Until every rank has started, only the start-up limit applies; then the body's timeout.
    deadline = time.monotonic() + STARTUP_TIMEOUT_S + timeout
    try:
        must_report = set(range(world_size)) - set(expect_dead)
        while not must_report <= set(outcome):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(must_report - set(outcome))
                if len(ready) < world_size:
                    late = sorted(set(range(world_size)) - ready)
                    raise TimeoutError(f"ranks {late} of {world_size} did not start within {STARTUP_TIMEOUT_S:.0f} s")
                raise TimeoutError(f"hang: ranks {missing} of {world_size} did not finish within {timeout:.0f} s\n"
                                   + _stacks(procs, missing, port))
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue_lib.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in outcome and r not in expect_dead
                ]
                if dead:
                    raise RuntimeError(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
                continue
            if ok == _READY:
                ready.add(rank)
                if len(ready) == world_size:
                    deadline = time.monotonic() + timeout
                continue
            outcome[rank] = (ok, pickle.loads(value) if ok else value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        del store  # only now: a rank may read the store until it exits
        for r in range(world_size):
            with contextlib.suppress(OSError):
                os.remove(_stack_file(port, r))
    failures = [(r, v) for r, (ok, v) in sorted(outcome.items()) if not ok]
    if failures:
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures)
        raise AssertionError(f"{len(failures)} rank(s) failed:\n{detail}")
    return [outcome[r][1] if r in outcome else None for r in range(world_size)]
