"""End a torch.distributed process without the abort torch 2.13's gloo backend can cause at exit.

The abort (``terminate called without an active exception``, SIGABRT, after all work is done)
has one cause, seen in a core dump of a plain torch script (init gloo, a few all-reduces, return
from the script): a gloo worker thread (``ProcessGroupGloo::runLoop``) still holds the last
reference to a finished collective when the interpreter starts finalizing. Dropping that reference
frees the collective's tensors, whose Python objects need the GIL; a thread that asks for the GIL
while the interpreter is finalizing is ended with ``pthread_exit``, and the unwind through the
``noexcept`` destructor of the work object calls ``std::terminate``. A worker signals a collective
complete *before* it drops its own reference, so on a busy machine (the worker descheduled in
between) the main thread can reach finalization first: about 1 launch in 10 on a loaded 2-core
machine, with or without partita. ``dist.destroy_process_group()`` alone does not help: it only
forgets the groups, and their worker threads live as long as any Python object still refers to
them, which partita's engine parts (reducer, gatherer, optimizer, sample counter, the
DeviceMesh's registry) and the user's ``engine`` variable do until finalization.

The fix, :func:`install_exit_handler`, registered by :func:`partita.distributed.init_distributed`:
an ``atexit`` handler that runs while the interpreter is still whole, after Python has joined the
non-daemon threads (an asynchronous checkpoint writer, the delayed-update step thread) and after
the handlers registered later (the monitors' flush and close), and

1. destroys every process group torch knows (``dist.destroy_process_group()``);
2. drops the references that partita's own objects and torch's DeviceMesh keep to those groups,
   so that the last reference goes and each ``ProcessGroupGloo`` is destroyed *now*, in the main
   thread: its destructor releases the GIL and joins the worker threads, which then finish
   dropping their work with the GIL available. After that no gloo thread is left to abort;
3. for a group something else still holds (a user's own ``dist.new_group()``, say), gives its
   worker threads a bounded moment with the GIL released, which is best effort only.

It never turns a failure into success and never hangs: a process ending with an uncaught
exception skips the teardown (it exits at once, as before, so the other ranks notice), and a
watchdog ends the process with status 1 if the teardown does not finish within
:data:`TEARDOWN_TIMEOUT_S` (a collective still in flight at exit whose peer is gone).
``PARTITA_EXIT_TEARDOWN=0`` turns the handler off.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import sys
import threading
import time
import types
import warnings
import weakref
from typing import Any

import torch.distributed as dist

__all__ = ["TEARDOWN_TIMEOUT_S", "install_exit_handler", "teardown_process_groups"]

# A clean teardown takes milliseconds (joining idle threads); only a collective still running at
# exit can hold it up, and then only until its peer answers or the group's timeout.
TEARDOWN_TIMEOUT_S = 60.0
# How long the GIL is released for worker threads of groups that outlive the teardown.
_SURVIVOR_GRACE_S = 0.25

_installed = False
_uncaught_exception = False
# Where partita and torch's DeviceMesh keep process groups: objects of these modules.
_OWNER_MODULES = ("partita.", "torch.distributed.")


def install_exit_handler() -> None:
    """Register the clean exit path once per process (idempotent; see the module docstring)."""
    global _installed
    if _installed or os.environ.get("PARTITA_EXIT_TEARDOWN", "1") == "0":
        return
    _installed = True
    previous_hook = sys.excepthook

    def note_uncaught(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        # An uncaught exception ends the process with status 1: remember it so the exit path
        # skips the teardown, which could wait on a collective the failure left in flight.
        global _uncaught_exception
        _uncaught_exception = True
        previous_hook(exc_type, exc, tb)

    sys.excepthook = note_uncaught
    atexit.register(_at_exit)


def _at_exit() -> None:
    if _uncaught_exception or not dist.is_available() or not dist.is_initialized():
        return
    watchdog: threading.Timer | None = threading.Timer(TEARDOWN_TIMEOUT_S, _give_up)
    watchdog.daemon = True
    try:
        watchdog.start()
    except RuntimeError:  # newer Pythons refuse new threads at shutdown: faulthandler's C thread
        watchdog = None
        faulthandler.dump_traceback_later(TEARDOWN_TIMEOUT_S, exit=True)
    try:
        teardown_process_groups()
    except Exception as error:  # noqa: BLE001 - the exit path must not mask the script's outcome
        print(f"partita: process-group teardown at exit failed: {error!r}", file=sys.stderr, flush=True)
    finally:
        if watchdog is not None:
            watchdog.cancel()
        else:
            faulthandler.cancel_dump_traceback_later()


def _give_up() -> None:
    sys.stderr.write(
        f"partita: tearing down the process groups at exit took more than {TEARDOWN_TIMEOUT_S:g} s (a collective "
        "was still in flight, its peer gone?); exiting with status 1\n"
    )
    sys.stderr.flush()
    os._exit(1)


def teardown_process_groups() -> int:
    """Destroy every process group and join their worker threads where possible.

    Returns how many groups are still alive afterwards because something outside partita and
    torch.distributed holds them (their worker threads get a short grace period instead).
    """
    from torch.distributed import distributed_c10d

    groups = [weakref.ref(pg) for pg in list(distributed_c10d._world.pg_map)]
    dist.destroy_process_group()
    alive = [pg for pg in (ref() for ref in groups) if pg is not None]
    with warnings.catch_warnings():  # reading attributes of deprecated torch objects warns
        warnings.simplefilter("ignore")
        _drop_library_references(alive)
    del alive
    gc.collect()  # reference cycles (engine <-> hooks) can hold the last reference
    survivors = sum(ref() is not None for ref in groups)
    if survivors:
        time.sleep(_SURVIVOR_GRACE_S)  # releases the GIL for any worker still dropping a work
    return survivors


def _is_library_object(obj: object) -> bool:
    module = getattr(type(obj), "__module__", None)
    return isinstance(module, str) and module.startswith(_OWNER_MODULES)


def _attribute_names(obj: object) -> list[str]:
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    return names


def _drop_from_defaults(fn: types.FunctionType, targets: set[int]) -> int:
    """``torch.distributed.nn.functional`` binds ``group=group.WORLD`` as a default argument when
    it is imported, so once imported after the default group started, its functions hold that
    group for the life of the process."""
    module = fn.__module__
    if not (isinstance(module, str) and module.startswith(_OWNER_MODULES)):
        return 0
    dropped = 0
    if fn.__defaults__ and any(id(v) in targets for v in fn.__defaults__):
        dropped += sum(id(v) in targets for v in fn.__defaults__)
        fn.__defaults__ = tuple(None if id(v) in targets else v for v in fn.__defaults__)
    if fn.__kwdefaults__:
        for key in [k for k, v in fn.__kwdefaults__.items() if id(v) in targets]:
            fn.__kwdefaults__[key] = None
            dropped += 1
    return dropped


def _drop_library_references(groups: list[dist.ProcessGroup]) -> int:
    """Replace the references partita's and torch.distributed's objects hold to ``groups`` with
    None (attributes, and the items of dicts and lists kept in attributes, such as the
    reducer's ``_groups`` or DeviceMesh's ``_pg_registry``); returns how many were dropped.

    Only at exit, after the groups were destroyed: nothing may use them any more, and these
    references are what keeps their worker threads alive into finalization. The objects are
    found by walking the heap, not ``gc.get_referrers``: a process-group object is not tracked
    by the garbage collector, so a dict holding only groups and strings is not tracked either.
    """
    targets = {id(pg) for pg in groups}
    dropped = 0
    for obj in gc.get_objects():
        if type(obj) in weakref.ProxyTypes:
            continue  # torch.compile keeps weakref proxies: any look at a dead one raises ReferenceError
        if isinstance(obj, types.FunctionType):
            dropped += _drop_from_defaults(obj, targets)
            continue
        if not _is_library_object(obj):
            continue
        for name in _attribute_names(obj):
            try:
                value = object.__getattribute__(obj, name)
            except AttributeError:
                continue
            if id(value) in targets:
                object.__setattr__(obj, name, None)  # frozen dataclasses too
                dropped += 1
            elif isinstance(value, dict):
                for key in [k for k, v in value.items() if id(v) in targets]:
                    value[key] = None
                    dropped += 1
            elif isinstance(value, list):
                for index, item in enumerate(value):
                    if id(item) in targets:
                        value[index] = None
                        dropped += 1
    return dropped
