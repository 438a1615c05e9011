"""Errors raised by the offload layer (NVMe swap files and pinned staging buffers).

They are separate classes so the engine and users can catch exactly the failure they care
about, and each carries a message that names the path / key / pool and the fix.
"""

from __future__ import annotations

from partita.config.base import ConfigError


class NvmeConfigError(ConfigError):
    """``nvme_path`` cannot be used: missing, not a directory, not writable, or unsafe tag.

    A :class:`~partita.config.base.ConfigError` (hence a ``ValueError``) because the fix is a
    config change: point ``offload_optimizer.nvme_path`` / ``offload_param.nvme_path`` elsewhere.
    """


class NvmeSpaceError(NvmeConfigError):
    """The swap directory's filesystem has less free space than the swap files need.

    Raised by :meth:`NvmeSwapStore.allocate` before any file is written (or, when the free space
    report was optimistic, when pre-allocation itself hits ENOSPC; the partial files are removed).
    """


class NvmeSwapError(RuntimeError):
    """A swap file read or write failed while training.

    Typical cause: the swap directory was cleaned, truncated or filled by something else while
    the job ran. Not a ``ValueError``: the config was fine, the environment changed under the job.
    """


class PoolExhaustedError(TimeoutError):
    """:meth:`PinnedBufferPool.acquire` timed out: every buffer of the pool is still in use."""


class BufferPoolError(ValueError):
    """A buffer was released to a pool that does not own it, released twice, or the pool is closed."""
