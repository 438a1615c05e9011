"""Where NVMe swap files live and how their space is reserved (the swap store's disk side).

:class:`~partita.offload.nvme.NvmeSwapStore` calls these for its directory checks, its private
directory, the O_DIRECT probe and the pre-allocation of its files; the reads and writes
themselves are in :mod:`partita.offload.nvme_io`. Every error names the config key the
directory came from, so the user knows which setting to change.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import shutil
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from partita.offload.errors import NvmeConfigError, NvmeSpaceError
from partita.progress import progress

DIRECT_ALIGNMENT = 4096  # address/length/offset alignment partita requires for O_DIRECT requests
# Allocations at least this large show progress (rank 0): reserving tens of GiB can take minutes
# (the zero-writing fallback, a slow or network disk); smaller ones finish before a bar is useful.
PROGRESS_MIN_BYTES = 2**30

# Private directories of the stores open in this process: two stores with the same tag would share one.
_ACTIVE_DIRS: set[str] = set()
_ACTIVE_LOCK = threading.Lock()


@dataclass(frozen=True)
class SwapFile:
    key: str
    path: str
    numel: int
    dtype: torch.dtype
    nbytes: int  # the tensor's bytes
    file_bytes: int  # nbytes rounded up to block_size: whole-block files keep O_DIRECT offsets legal


def human(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def check_directory(directory: str | os.PathLike, config_key: str) -> str:
    """The absolute path of ``directory`` once it exists, is a directory and is writable."""
    given = os.fspath(directory)
    path = os.path.abspath(given)
    if not os.path.exists(path):
        raise NvmeConfigError(
            f"{config_key}={given!r}: the directory does not exist. Create it on a fast local disk "
            f"(mkdir -p {path}) or set {config_key} to an existing directory."
        )
    if not os.path.isdir(path):
        raise NvmeConfigError(
            f"{config_key}={given!r}: not a directory. Set {config_key} to a directory on a fast local "
            "disk; partita creates its swap files inside it."
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise NvmeConfigError(
            f"{config_key}={given!r}: the directory is not writable by this process (uid {os.getuid()}). "
            f"Make it writable (chmod/chown) or set {config_key} to a directory you can write."
        )
    return path


def make_private_dir(swap_dir: str, *, tag: str, root: str, config_key: str) -> None:
    """Create ``swap_dir`` (mode 0700) and register it as open in this process."""
    with _ACTIVE_LOCK:
        if swap_dir in _ACTIVE_DIRS:
            raise ValueError(
                f"an NvmeSwapStore with tag {tag!r} is already open in this process at "
                f"{swap_dir}; give each store a distinct tag"
            )
        if os.path.isdir(swap_dir):
            # Same tag, rank and pid but no open store: left by an earlier process that died
            # without cleanup and had our pid (common in containers). Its files are garbage.
            warnings.warn(f"removing stale swap directory {swap_dir} left by an earlier process", stacklevel=3)
            shutil.rmtree(swap_dir, ignore_errors=True)
        try:
            os.mkdir(swap_dir, 0o700)
        except OSError as exc:
            raise NvmeConfigError(
                f"{config_key}={root!r}: cannot create the swap directory {swap_dir}: "
                f"{exc}. Set {config_key} to a writable directory on a fast local disk."
            ) from exc
        _ACTIVE_DIRS.add(swap_dir)


def remove_private_dir(swap_dir: str) -> None:
    shutil.rmtree(swap_dir, ignore_errors=True)
    with _ACTIVE_LOCK:
        _ACTIVE_DIRS.discard(swap_dir)


def probe_direct_io(swap_dir: str) -> bool:
    """Write and read one aligned page with O_DIRECT; False where the filesystem refuses it."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(swap_dir, ".odirect-probe")
    page = mmap.mmap(-1, DIRECT_ALIGNMENT)  # anonymous mappings are page-aligned
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        try:
            if os.pwrite(fd, page, 0) != DIRECT_ALIGNMENT:
                return False
        finally:
            os.close(fd)
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        try:
            return os.preadv(fd, [page], 0) == DIRECT_ALIGNMENT
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        page.close()
        try:
            os.unlink(probe)
        except OSError:
            pass


def plan_files(
    sizes: Mapping[str, tuple[int, torch.dtype]], *, block_size: int, existing: Mapping[str, SwapFile], swap_dir: str
) -> list[tuple[str, int, torch.dtype, int, int]]:
    """Check ``{key: (numel, dtype)}`` and return ``(key, numel, dtype, nbytes, file_bytes)`` rows."""
    plan: list[tuple[str, int, torch.dtype, int, int]] = []
    for key, spec in sizes.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"swap key {key!r} must be a non-empty string")
        if key in existing:
            raise ValueError(f"swap key {key!r} is already allocated in {swap_dir}; keys must be unique")
        try:
            numel, dtype = spec
        except (TypeError, ValueError):
            raise ValueError(f"swap key {key!r}: expected (numel, dtype), got {spec!r}") from None
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"swap key {key!r}: numel={numel!r} must be an integer >= 0")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"swap key {key!r}: dtype={dtype!r} must be a torch.dtype")
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        file_bytes = -(-nbytes // block_size) * block_size
        plan.append((key, numel, dtype, nbytes, file_bytes))
    return plan


def create_files(
    plan: list[tuple[str, int, torch.dtype, int, int]],
    *,
    swap_dir: str,
    root: str,
    config_key: str,
    block_size: int,
    first_index: int,
    progress_min_bytes: int,
) -> dict[str, SwapFile]:
    """Check the free space for all of ``plan``, then create and reserve one file per row.

    All or nothing: on failure the files created so far are removed. Rows are numbered from
    ``first_index`` in the file names (keys may collide once made filesystem-safe).
    """
    needed = sum(p[4] for p in plan)
    free = shutil.disk_usage(swap_dir).free
    if needed > free:
        raise NvmeSpaceError(space_message(root, swap_dir, config_key, needed, free))
    created: list[str] = []
    files: dict[str, SwapFile] = {}
    # Counted in MiB, rounded up, so the bar ends exactly at its total.
    mib = 2**20
    bar = progress(-(-needed // mib), desc=f"pre-allocating swap files in {swap_dir} (MiB)",
                   enabled=None if needed >= progress_min_bytes else False)
    done = 0
    try:
        for index, (key, numel, dtype, nbytes, file_bytes) in enumerate(plan, start=first_index):
            safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:80]
            path = os.path.join(swap_dir, f"{index:06d}-{safe}.swp")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            created.append(path)
            try:
                preallocate(fd, file_bytes, block_size)
            finally:
                os.close(fd)
            files[key] = SwapFile(key, path, numel, dtype, nbytes, file_bytes)
            done += file_bytes
            bar.update(-(-done // mib) - bar.n)
    except OSError as exc:
        for path in created:
            try:
                os.unlink(path)
            except OSError:
                pass
        if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            raise NvmeSpaceError(
                space_message(root, swap_dir, config_key, needed, shutil.disk_usage(swap_dir).free, cause=str(exc))
            ) from exc
        raise NvmeConfigError(f"{config_key}={root!r}: could not create swap files in {swap_dir}: {exc}") from exc
    finally:
        bar.close()
    return files


def preallocate(fd: int, nbytes: int, block_size: int) -> None:
    if nbytes == 0:
        return
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    # No fallocate: set the size, then write zeros so the blocks are really reserved
    # (ftruncate alone makes a sparse file that can still run out of space later).
    os.ftruncate(fd, nbytes)
    zeros = bytes(block_size)
    for offset in range(0, nbytes, block_size):
        length = min(block_size, nbytes - offset)
        if os.pwrite(fd, zeros[:length], offset) != length:
            raise OSError(errno.ENOSPC, "short write while pre-allocating", fd)


def space_message(root: str, swap_dir: str, config_key: str, needed: int, free: int, cause: str = "") -> str:
    stale = sorted(
        name for name in os.listdir(root) if name.startswith("partita-") and os.path.join(root, name) != swap_dir
    )
    stale_note = (
        f" Other partita swap directories there (from earlier or concurrent runs; delete them only if "
        f"no job uses them): {', '.join(stale[:5])}{' ...' if len(stale) > 5 else ''}."
        if stale
        else ""
    )
    return (
        f"{config_key}={root!r}: not enough free disk space for the swap files: need "
        f"{needed} bytes ({human(needed)}), free {free} bytes ({human(free)})"
        f"{' (' + cause + ')' if cause else ''}. Free space there, set {config_key} to a larger "
        f"disk, or offload less.{stale_note}"
    )
