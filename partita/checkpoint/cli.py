"""``partita checkpoint inspect|verify|consolidate|import-deepspeed``: look at, check, export and import
checkpoints offline.

Runs in one process without torch.distributed. DIR is a save directory (holding tags and
``latest``) or one tag directory. Imports stay inside the functions so that building the
``partita`` argument parser does not import torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["add_checkpoint_parser", "main", "run_checkpoint_command"]


def add_checkpoint_parser(commands: Any) -> None:
    """Add the ``checkpoint`` subcommand to the ``partita`` parser's subparsers."""
    parser = commands.add_parser(
        "checkpoint", help="inspect, verify, consolidate or import (DeepSpeed) checkpoints",
        description="Inspect, verify or consolidate partita checkpoints (DIR: a save directory or one tag directory), "
                    "or import a DeepSpeed checkpoint.",
    )
    sub = parser.add_subparsers(dest="checkpoint_command", required=True,
                                metavar="{inspect,verify,consolidate,import-deepspeed}")
    inspect = sub.add_parser("inspect", help="list tags with step, world size, ZeRO stage, precision, size")
    inspect.add_argument("dir")
    verify = sub.add_parser("verify", help="check every file's size and sha256 against the manifest")
    verify.add_argument("dir")
    verify.add_argument("--tag", default=None, help="only this tag (default: every tag)")
    consolidate = sub.add_parser(
        "consolidate", help="write full weights (from the fp32 master shards) as sharded safetensors + index",
    )
    consolidate.add_argument("dir")
    consolidate.add_argument("out", help="output directory")
    consolidate.add_argument("--tag", default=None, help="default: latest (or the newest complete tag)")
    consolidate.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                             help="dtype of floating tensors (default fp32)")
    consolidate.add_argument("--max-shard-size", default="5GB", help="largest output file, e.g. 5GB, 500MB (default 5GB)")
    imports = sub.add_parser(
        "import-deepspeed", help="turn a DeepSpeed (ZeRO 0-3) checkpoint into a partita checkpoint that resumes at any world size",
    )
    imports.add_argument("dir", help="DeepSpeed's save_dir (holding 'latest') or one of its tag directories")
    imports.add_argument("out", help="partita save directory to write into (the tag directory and 'latest')")
    imports.add_argument("--tag", default=None, help="DeepSpeed tag to import (default: the one 'latest' names)")
    imports.add_argument("--out-tag", default=None, help="partita tag to write (default: the DeepSpeed tag)")
    imports.add_argument("--optimizer-class", default=None,
                         help="torch optimizer class of the resumed run, e.g. torch.optim.adamw.AdamW (default: inferred)")
    imports.add_argument("--param-names", default=None, metavar="FILE",
                         help="ZeRO 0 only: JSON list of lists, each param group's parameter names in optimizer order")
    imports.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                         help="replace the name prefix OLD by NEW in every key (e.g. 'module.=' drops a wrapper's "
                              "prefix); repeatable")


def _human(size: float) -> str:
    unit = "B"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000:
            break
        size /= 1000
    return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"


def _split_dir(path: Path) -> tuple[Path, str | None]:
    """(save_dir, tag) for a tag directory, (path, None) for a save directory."""
    from partita.checkpoint.format import MANIFEST_FILE, PARTIAL_SUFFIX

    if (path / MANIFEST_FILE).exists() or path.name.endswith(PARTIAL_SUFFIX):
        return path.parent, path.name
    return path, None


def _inspect(path: Path) -> int:
    from partita.checkpoint.manifest import read_latest_checked, scan_tags

    save_dir, only = _split_dir(path)
    latest, damaged = read_latest_checked(save_dir)
    if damaged is not None:
        print(f"{save_dir / 'latest'} is damaged ({damaged}); loading would use the newest complete tag")
    tags = [t for t in scan_tags(save_dir) if only is None or t.path.name == only]
    if not tags:
        print(f"{path}: no checkpoints")
        return 1
    print(f"{save_dir}  (latest: {latest or 'none'})")
    for info in tags:
        if not info.complete:
            print(f"  {info.tag:<24} incomplete: {info.problem}")
            continue
        m = info.manifest
        size = sum(f["size"] for f in m["files"].values())
        saved = datetime.fromtimestamp(m.get("saved_at", 0)).strftime("%Y-%m-%d %H:%M:%S")
        mark = "  <- latest" if info.tag == latest else ""
        pipe = m.get("pipeline_parallel_size", 1)
        world = f"{m.get('world_size')} (pipe {pipe})" if pipe > 1 else f"{m.get('world_size')}"
        print(
            f"  {info.tag:<24} step {m.get('global_steps')}  samples {m.get('global_samples')}  world {world}  "
            f"stage {m.get('zero_stage')}  {m.get('precision')}  {_human(size)} in {len(m['files'])} files  {saved}{mark}"
        )
    return 0


def _verify(path: Path, tag: str | None) -> int:
    from partita.checkpoint.errors import CheckpointCorruptError
    from partita.checkpoint.manifest import check_files, read_manifest, scan_tags
    from partita.progress import progress

    save_dir, only = _split_dir(path)
    only = tag or only
    if only is not None:
        targets = [(only, save_dir / only)]
    else:
        targets = [(t.tag, t.path) for t in scan_tags(save_dir) if t.complete]
        incomplete = [t for t in scan_tags(save_dir) if not t.complete]
        for t in incomplete:
            print(f"{t.tag}: incomplete ({t.problem}); loading ignores it")
    if not targets:
        print(f"{path}: no complete checkpoint to verify")
        return 1
    manifests: list[tuple[str, Path, dict | None, list[str]]] = []
    for name, tag_dir in targets:
        try:
            manifests.append((name, tag_dir, read_manifest(tag_dir), []))
        except CheckpointCorruptError as error:
            manifests.append((name, tag_dir, None, [str(error)]))
    # Hashing reads every byte of every file: show progress, counted in files.
    total = sum(len(manifest["files"]) for _, _, manifest, _ in manifests if manifest is not None)
    bad = 0
    with progress(total, desc="verify", enabled=True, interval_s=5.0) as bar:
        for name, tag_dir, manifest, problems in manifests:
            if manifest is not None:
                problems = check_files(tag_dir, manifest, hash_names=set(manifest["files"]), on_file=lambda _: bar.update(1))
            if problems:
                bad += 1
                bar.write(f"{name}: DAMAGED")
                for problem in problems:
                    bar.write(f"  {problem}")
            else:
                bar.write(f"{name}: ok ({len(manifest['files'])} files, sizes and sha256 match)")
    return 1 if bad else 0


def _resolve_tag(save_dir: Path, tag: str | None) -> Path:
    from partita.checkpoint.errors import CheckpointCorruptError
    from partita.checkpoint.manifest import check_files, read_latest_checked, read_manifest, scan_tags

    if tag is not None:
        read_manifest(save_dir / tag)
        return save_dir / tag
    latest, damaged = read_latest_checked(save_dir)
    if damaged is not None:
        print(f"{save_dir / 'latest'} is damaged ({damaged}); using the newest complete tag")
    candidates = ([latest] if latest else []) + [t.tag for t in scan_tags(save_dir) if t.complete and t.tag != latest]
    for candidate in candidates:
        try:
            if not check_files(save_dir / candidate, read_manifest(save_dir / candidate), hash_names=set()):
                if latest is not None and candidate != latest:
                    print(f"using {candidate} (latest {latest!r} is missing or incomplete)")
                return save_dir / candidate
        except CheckpointCorruptError:
            continue
    raise CheckpointCorruptError(f"{save_dir} holds no complete checkpoint")


def _consolidate(args: argparse.Namespace) -> int:
    from partita.checkpoint.consolidate import consolidate

    save_dir, tag = _split_dir(Path(args.dir))
    tag_dir = _resolve_tag(save_dir, args.tag or tag)
    index = consolidate(tag_dir, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size)
    print(f"wrote {index.parent} (from {tag_dir}, {args.dtype})")
    return 0


def _import_deepspeed(args: argparse.Namespace) -> int:
    import json

    from partita.checkpoint.import_deepspeed import import_deepspeed

    names = None
    if args.param_names is not None:
        try:
            names = json.loads(Path(args.param_names).read_text(encoding="utf-8"))
        except ValueError as error:
            raise ValueError(f"--param-names {args.param_names}: not JSON ({error}); give a list of lists of names") from None
    rename = {}
    for item in args.rename:
        if "=" not in item:
            raise ValueError(f"--rename {item!r}: expected OLD=NEW (a name prefix and its replacement)")
        old, new = item.split("=", 1)
        rename[old] = new
    out = import_deepspeed(args.dir, args.out, tag=args.tag, out_tag=args.out_tag, optimizer_class=args.optimizer_class,
                           stage0_param_names=names, rename=rename or None)
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    source = meta["imported_from"]
    print(f"wrote {out} from DeepSpeed {source['deepspeed_version']} ZeRO-{source['zero_stage']} "
          f"({source['data_parallel_size']} ranks), step {meta['counters']['global_steps']}, "
          f"{len(meta['optimizer']['params'])} parameters")
    return 0


def run_checkpoint_command(args: argparse.Namespace) -> int:
    """Run a parsed ``partita checkpoint ...`` command; returns the exit status."""
    from partita.checkpoint.errors import CheckpointError

    try:
        if args.checkpoint_command == "inspect":
            return _inspect(Path(args.dir))
        if args.checkpoint_command == "verify":
            return _verify(Path(args.dir), args.tag)
        if args.checkpoint_command == "import-deepspeed":
            return _import_deepspeed(args)
        return _consolidate(args)
    except (CheckpointError, ValueError, OSError, NotImplementedError) as error:
        print(f"partita checkpoint: error: {error}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """``partita checkpoint`` on its own (``python -m partita.checkpoint.cli inspect DIR``)."""
    parser = argparse.ArgumentParser(prog="partita")
    add_checkpoint_parser(parser.add_subparsers(dest="command", required=True))
    return run_checkpoint_command(parser.parse_args(["checkpoint", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
