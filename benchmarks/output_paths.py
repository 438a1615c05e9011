"""argparse types for the paths a benchmark writes to: they create what is missing, at parse time.

A benchmark that runs for an hour on a leased GPU must not fail at its first write because
``--nvme-path`` or the directory of ``--out`` does not exist yet (``largest_tiered.py
--nvme-path`` once did). These types create the directory (or the file's parent directory)
when the arguments are parsed, before any work starts; a path that cannot be created is an
argparse error naming the option, the path and the reason.

    parser.add_argument("--out", type=output_file)
    parser.add_argument("--nvme-path", type=output_dir)
"""

from __future__ import annotations

import argparse
import os

__all__ = ["output_dir", "output_file"]


def _make_dirs(path: str, what: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise argparse.ArgumentTypeError(
            f"cannot create {what} {path!r}: {error.strerror or error}; give a writable path"
        ) from error
    if not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{what} {path!r} is not writable; give a writable path")


def output_dir(value: str) -> str:
    """A directory the benchmark writes into (swap files, results): created if missing."""
    _make_dirs(value, "directory")
    return value


def output_file(value: str) -> str:
    """A file the benchmark writes (JSON, a log, a plot prefix): its parent directory is created if missing."""
    parent = os.path.dirname(os.path.abspath(value))
    _make_dirs(parent, "the directory of")
    return value
