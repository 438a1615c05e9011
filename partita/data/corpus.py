"""A byte-level text corpus that every machine already has: the Python standard library.

Examples and tests need real text to show a loss falling, but must not download anything (CI
machines and GPU nodes are often offline). The ``.py`` sources of the standard library that runs
partita are ~12 MB of code and docstrings on CPython 3.11, enough for a small byte-level GPT.

What goes in, and why:
- every ``*.py`` file under the directory of ``os.__file__``, walked recursively, in sorted
  relative-path order (POSIX separators), so the same Python install always gives the same bytes;
- left out: ``site-packages`` / ``dist-packages`` (third-party code that differs per environment
  and is 10x larger), test directories (``test``, ``tests``, ``idle_test``: another ~19 MB of
  mostly fixtures) and ``__pycache__``;
- each file is preceded by a ``# ---- <relative path>`` line so the model sees file boundaries.

Different Python versions give different corpora; the cache file name carries a content hash,
so they never mix.

The token file is written once into a cache directory and then memory-mapped by every process.
Several ranks may start at once: each writes to its own temporary file in the cache directory
and renames it onto the final name (``os.replace`` is atomic on POSIX and Windows). All writers
produce identical bytes, so whichever rename lands last, readers only ever see a complete file.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile

import numpy as np

_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def default_cache_dir() -> pathlib.Path:
    """``$PARTITA_CACHE`` if set, else ``~/.cache/partita``."""
    env = os.environ.get("PARTITA_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "partita"


def stdlib_root() -> pathlib.Path:
    """The directory holding the standard library's pure-Python modules."""
    return pathlib.Path(os.__file__).resolve().parent


def stdlib_source_files(root: pathlib.Path | None = None) -> list[str]:
    """Sorted POSIX relative paths of the ``.py`` files that make up the corpus."""
    root = stdlib_root() if root is None else root
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place keeps os.walk out of site-packages (13k files) altogether.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        rel_dir = pathlib.Path(dirpath).relative_to(root)
        found.extend((rel_dir / name).as_posix() for name in filenames if name.endswith(".py"))
    return sorted(found)


def _corpus_bytes(root: pathlib.Path, max_bytes: int | None) -> bytes:
    parts = []
    size = 0
    for rel in stdlib_source_files(root):
        chunk = f"# ---- {rel}\n".encode() + (root / rel).read_bytes() + b"\n"
        parts.append(chunk)
        size += len(chunk)
        if max_bytes is not None and size >= max_bytes:
            break
    data = b"".join(parts)
    return data if max_bytes is None else data[:max_bytes]


def build_stdlib_corpus(
    *, cache_dir: str | os.PathLike | None = None, max_bytes: int | None = None
) -> pathlib.Path:
    """Build (or find) the standard-library byte corpus and return the path of its token file.

    The file holds raw bytes, one uint8 token per byte (vocabulary 256). Its name is
    ``stdlib-<sha256 of the bytes, 16 hex>.u8``: the content decides the name, so a cached file
    is reused only when the sources and ``max_bytes`` give exactly the same bytes.

    Args:
        cache_dir: where to keep the file (default: ``$PARTITA_CACHE`` or ``~/.cache/partita``).
        max_bytes: keep only the first ``max_bytes`` bytes (for quick tests); None keeps all.

    Safe to call from several processes at once (see the module docstring).
    """
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
        raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
    data = _corpus_bytes(stdlib_root(), max_bytes)
    if not data:
        raise RuntimeError(f"no .py files found under {stdlib_root()}; this Python has no stdlib sources")
    digest = hashlib.sha256(data).hexdigest()[:16]
    cache = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"stdlib-{digest}.u8"
    if path.is_file() and path.stat().st_size == len(data):
        return path
    # A unique temporary name per writer: concurrent builders never write into the same file.
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; other users of a shared cache must read it.
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_corpus(
    *, cache_dir: str | os.PathLike | None = None, max_bytes: int | None = None
) -> np.memmap:
    """The standard-library corpus as a read-only uint8 memmap (built on first use).

    A memmap rather than an array: every process on a node shares the page cache instead of
    holding its own copy.
    """
    path = build_stdlib_corpus(cache_dir=cache_dir, max_bytes=max_bytes)
    return np.memmap(path, dtype=np.uint8, mode="r")


def split_train_val(tokens: np.ndarray, *, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Split a token array into (train, validation) views: the last ``val_fraction`` is validation.

    A contiguous tail rather than random windows, so no validation window overlaps a training
    window. The views share memory with ``tokens`` (no copy of a memmap).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    n_val = int(len(tokens) * val_fraction)
    if n_val < 1 or n_val >= len(tokens):
        raise ValueError(
            f"cannot split {len(tokens)} tokens with val_fraction={val_fraction}: one side would be "
            f"empty; use a larger corpus or another val_fraction"
        )
    split = len(tokens) - n_val
    return tokens[:split], tokens[split:]
