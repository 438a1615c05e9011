"""Manifests, the ``latest`` pointer, and what makes a tag *complete*.

A tag directory is complete when it has been renamed from ``<tag>.partial`` (which happens
only after every rank reported its files written and fsynced) and its ``manifest.json``
lists every file with its size and sha256. A crash mid-save leaves only a ``.partial``
directory, which loading never considers. ``latest`` is replaced with ``os.replace`` after
the rename, so it names a complete tag or, after a crash between the two, an older one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partita.checkpoint.errors import CheckpointCorruptError
from partita.checkpoint.format import FORMAT_NAME, FORMAT_VERSION, LATEST_FILE, MANIFEST_FILE, PARTIAL_SUFFIX
from partita.checkpoint.safetensors_io import WrittenFile, file_sha256, write_json


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or a new file in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_latest(save_dir: str | os.PathLike[str]) -> str | None:
    path = Path(save_dir) / LATEST_FILE
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None


def read_latest_checked(save_dir: str | os.PathLike[str]) -> tuple[str | None, str | None]:
    """``(tag, problem)``: the tag ``latest`` names, or None with why the file cannot be trusted.

    A damaged ``latest`` (binary bytes, several lines, a name that cannot be a tag such as
    ``../x``) is treated like one naming a damaged tag: callers fall back to the newest
    complete tag. ``(None, None)`` means there is no ``latest`` at all.
    """
    from partita.checkpoint.format import check_tag

    try:
        latest = read_latest(save_dir)
    except UnicodeDecodeError:
        return None, "it is not UTF-8 text"
    except OSError as error:
        return None, f"it cannot be read ({error})"
    if latest is None:
        return None, None
    problem = check_tag(latest) if "\n" not in latest else "it holds more than one line"
    return (None, problem) if problem is not None else (latest, None)


def write_latest(save_dir: str | os.PathLike[str], tag: str) -> None:
    """Point ``latest`` at ``tag`` atomically (write a temporary file, then ``os.replace``)."""
    tmp = Path(save_dir) / f".{LATEST_FILE}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(tag + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(save_dir) / LATEST_FILE)
    fsync_dir(save_dir)


def commit_tag(
    save_dir: str | os.PathLike[str], tag: str, files: dict[str, WrittenFile], summary: dict[str, Any]
) -> Path:
    """Write the manifest into ``<tag>.partial`` and rename it to ``<tag>`` (replacing an older one)."""
    root = Path(save_dir)
    partial = root / (tag + PARTIAL_SUFFIX)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "tag": tag,
        "saved_at": time.time(),
        **summary,
        "files": {name: {"size": f.size, "sha256": f.sha256} for name, f in sorted(files.items())},
    }
    write_json(partial / MANIFEST_FILE, manifest)
    fsync_dir(partial)
    final = root / tag
    stale = None
    if final.exists():
        # Saving a tag twice replaces it; move the old one aside first so the new one
        # appears with a single rename.
        stale = root / f".{tag}.replaced-{uuid.uuid4().hex[:8]}"
        os.rename(final, stale)
    os.rename(partial, final)
    fsync_dir(root)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def read_manifest(tag_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a tag directory; CheckpointCorruptError when it is missing or unreadable."""
    path = Path(tag_dir) / MANIFEST_FILE
    if not Path(tag_dir).is_dir():
        raise CheckpointCorruptError(f"checkpoint directory {tag_dir} does not exist")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"{path} is missing: {tag_dir} is not a complete partita checkpoint (a save that did not finish, "
            "or not a partita checkpoint)"
        ) from None
    except (OSError, ValueError) as error:
        raise CheckpointCorruptError(f"{path} cannot be read: {error}") from None
    if manifest.get("format") != FORMAT_NAME or not isinstance(manifest.get("files"), dict):
        raise CheckpointCorruptError(f"{path} is not a partita checkpoint manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{path} has format version {manifest.get('format_version')}, newer than this partita reads "
            f"({FORMAT_VERSION}); upgrade partita"
        )
    return manifest


def check_files(
    tag_dir: str | os.PathLike[str],
    manifest: dict[str, Any],
    *,
    hash_names: set[str],
    on_file: Callable[[str], None] | None = None,
) -> list[str]:
    """Problems with the files of a tag: every file's size is checked, the sha256 of ``hash_names`` too.

    ``on_file(name)`` is called after each file is checked (progress bars: hashing a large
    checkpoint reads every byte of it). Returns human-readable problems, each naming the
    file; empty when all is well.
    """
    problems = []
    root = Path(tag_dir)
    for name, record in manifest["files"].items():
        problem = _check_file(root / name, record, hashed=name in hash_names)
        if problem is not None:
            problems.append(problem)
        if on_file is not None:
            on_file(name)
    return problems


def _check_file(path: Path, record: dict[str, Any], *, hashed: bool) -> str | None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path}: missing"
    if size != record["size"]:
        return f"{path}: {size} bytes, the manifest records {record['size']} (truncated or overwritten)"
    if hashed and file_sha256(path) != record["sha256"]:
        return f"{path}: sha256 differs from the manifest (the file is corrupted)"
    return None


@dataclass(frozen=True)
class TagInfo:
    """A directory under save_dir that looks like a checkpoint."""

    tag: str
    path: Path
    manifest: dict[str, Any] | None  # None: incomplete (partial or no manifest)
    problem: str | None = None

    @property
    def complete(self) -> bool:
        return self.manifest is not None


def scan_tags(save_dir: str | os.PathLike[str]) -> list[TagInfo]:
    """Every checkpoint-like directory in ``save_dir``: complete ones newest first, then incomplete ones."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    complete, incomplete = [], []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        if entry.name.endswith(PARTIAL_SUFFIX):
            incomplete.append(TagInfo(entry.name[: -len(PARTIAL_SUFFIX)], entry, None, "save did not finish"))
            continue
        try:
            complete.append(TagInfo(entry.name, entry, read_manifest(entry)))
        except CheckpointCorruptError as error:
            if (entry / "meta.json").exists() or any(entry.glob("rank*.safetensors")):
                incomplete.append(TagInfo(entry.name, entry, None, str(error)))
    complete.sort(key=lambda t: (t.manifest.get("saved_at", 0), t.manifest.get("global_steps", 0)), reverse=True)
    return complete + incomplete
