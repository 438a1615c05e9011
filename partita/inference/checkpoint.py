"""``init_inference(checkpoint=...)``: weights from a partita training checkpoint or a safetensors
directory, read straight into the (possibly tensor-split) model, at any saved layout.

The model is split first (partita/inference/parallel.py); then each of its tensors is filled with
exactly the elements this rank holds. A partita checkpoint (``save_checkpoint``'s directory with
``latest``, or one tag directory) stores every trainable parameter as fp32 master shards, per
ZeRO rank and per saved tensor rank (format: :mod:`partita.checkpoint.format`);
:func:`partita.checkpoint.tensor_layout.assemble` reads this rank's local shard (or the whole
tensor) from the saved pieces that overlap it, so a ZeRO-3 x data 2, tensor 2, pipeline or expert
checkpoint loads at tp 1, 2 or 4 without a conversion step. Old stacked-expert checkpoints come
under today's names (:mod:`partita.checkpoint.stacked_experts`), and a pipeline checkpoint's keys
match either the PipelineModule itself or the ``nn.Sequential`` of its layers
(:mod:`partita.checkpoint.pipeline_layout`, as ``consolidate`` writes them).

Weights exported as safetensors (``save_16bit_model``, ``partita checkpoint consolidate``,
Hugging Face ``save_pretrained``) are read the same way: per tensor, only this rank's rows or
columns (``safe_open(...).get_slice``). ``torch.save`` state dicts (``pytorch_model.bin``) are
opened memory-mapped and tensors-only, then sliced.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partita.checkpoint import format as fmt
from partita.checkpoint.errors import CheckpointError, CheckpointMismatchError
from partita.tensor_parallel.layers import TensorShard, tensor_shard_of

logger = logging.getLogger("partita")

__all__ = ["load_weights", "resolve_checkpoint"]

_TORCH_SUFFIXES = (".bin", ".pt", ".pth")


def resolve_checkpoint(path: str | os.PathLike, base_dir: str = "") -> tuple[str, Path]:
    """``(kind, where)``: kind is "partita" (a tag directory), "safetensors" or "torch" (a file or directory)."""
    given = Path(os.fspath(path))
    where = Path(base_dir) / given if base_dir and not given.is_absolute() else given
    if not where.exists():
        raise CheckpointError(f"checkpoint {str(where)!r} does not exist: give a partita checkpoint directory (the "
                              "save_checkpoint dir with 'latest', or a tag directory) or a directory of safetensors weights")
    if where.is_dir() and (where / fmt.LATEST_FILE).is_file():
        from partita.checkpoint.manifest import read_latest_checked

        tag, problem = read_latest_checked(where)
        if tag is None:
            raise CheckpointError(f"checkpoint {where}: its 'latest' file cannot be used ({problem}); pass the tag "
                                  f"directory itself (one of {sorted(p.name for p in where.iterdir() if p.is_dir())})")
        where = where / tag
    if where.is_dir() and (where / fmt.META_FILE).is_file():
        return "partita", where
    if where.is_file() and where.suffix == ".safetensors":
        return "safetensors", where
    if where.is_file() and where.suffix == ".json":
        raise CheckpointError(
            f"checkpoint {str(where)!r} is a JSON file: DeepSpeed's checkpoint descriptions (a list of Megatron / "
            "ds_model files) are not read; pass the save_checkpoint directory, a tag directory, or safetensors weights")
    if where.is_dir() and any(where.glob("*.safetensors")):
        return "safetensors", where
    if where.suffix in _TORCH_SUFFIXES or (where.is_dir() and any(p.suffix in _TORCH_SUFFIXES for p in where.iterdir())):
        return "torch", where
    raise CheckpointError(
        f"checkpoint {str(where)!r} is neither a partita checkpoint (no {fmt.META_FILE} or '{fmt.LATEST_FILE}') nor "
        "weights (no *.safetensors, *.bin, *.pt or *.pth file); pass the save_checkpoint directory, a tag directory in "
        "it, or the directory save_16bit_model / `partita checkpoint consolidate` wrote"
    )


def load_weights(module: nn.Module, path: str | os.PathLike, *, base_dir: str = "", training_mp_size: int = 1) -> str:
    """Fill every parameter and persistent buffer of ``module`` from the checkpoint; returns a
    one-line description for the log. Raises CheckpointMismatchError when the names or shapes do
    not fit the model (listing them), CheckpointError for a path that holds no checkpoint."""
    kind, where = resolve_checkpoint(path, base_dir)
    if kind == "partita":
        source = _PartitaSource(where, module)
    elif kind == "safetensors":
        source = _SafetensorsSource(where)
    else:
        source = _TorchFileSource(where)
    with source:
        if kind == "partita" and training_mp_size > 1 and source.tensor_size != training_mp_size:
            raise CheckpointMismatchError(
                f"training_mp_size = {training_mp_size} but the checkpoint in {where} was saved at tensor-parallel size "
                f"{source.tensor_size}; remove training_mp_size (partita reads the layout from the checkpoint)")
        _fill(module, source, where)
    return f"{kind} weights from {where}"


def _fill(module: nn.Module, source, where: Path) -> None:
    targets = module.state_dict(keep_vars=True)
    names_of: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in targets.items():
        names_of.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    missing, wrong = [], []
    used: set[str] = set()
    for key, names in names_of.items():
        tensor = tensors[key]
        found = next((source.key_for(n) for n in names if source.key_for(n) is not None), None)
        if found is None:
            missing.append(names[0])
            continue
        used.add(found)
        shard = tensor_shard_of(tensor)
        full = tuple(shard.full_shape) if shard is not None else tuple(tensor.shape)
        saved_shape = source.shape(found)
        if saved_shape != full:
            wrong.append(f"{names[0]}: model {list(full)}, checkpoint {list(saved_shape)}")
            continue
        with torch.no_grad():
            tensor.data.copy_(source.read(found, shard, tensor.dtype).reshape(tensor.shape))
    unused = source.unused(used)
    if missing or wrong or unused:
        parts = []
        if missing:
            parts.append(f"{len(missing)} model tensor(s) not in the checkpoint: {_few(missing)}")
        if wrong:
            parts.append(f"{len(wrong)} of other shapes: {_few(wrong)}")
        if unused:
            parts.append(f"{len(unused)} checkpoint tensor(s) the model has no place for: {_few(unused)}")
        raise CheckpointMismatchError(
            f"checkpoint {where} does not fit {type(module).__name__}: " + "; ".join(parts)
            + ". Build the model with the architecture and config it was trained with")


def _few(items: list[str], limit: int = 5) -> str:
    return ", ".join(items[:limit]) + (f", … ({len(items)} in all)" if len(items) > limit else "")


# ------------------------------------------------------------------------------ partita checkpoints


class _PartitaSource:
    """One tag directory: names -> (kind, record); reads this rank's part of any saved layout."""

    def __init__(self, tag_dir: Path, module: nn.Module) -> None:
        from partita.checkpoint.stacked_experts import open_upgraded

        try:
            meta = json.loads((tag_dir / fmt.META_FILE).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise CheckpointError(f"cannot read {tag_dir / fmt.META_FILE}: {error}") from None
        if meta.get("format") not in (None, fmt.FORMAT_NAME):
            raise CheckpointError(f"{tag_dir} holds a {meta.get('format')!r} checkpoint, not a partita one")
        _check_sizes(tag_dir)
        self.meta, self.reader = open_upgraded(tag_dir, meta, module)
        self.tensor_size = int(self.meta.get("tensor_parallel_size", 1) or 1)
        model_meta = self.meta["model"]
        self.params = self.meta["optimizer"]["params"]
        self.frozen = model_meta.get("frozen_shards", {})
        self.tensors = model_meta.get("tensors", {})
        self.aliases = model_meta.get("aliases", {})
        extra = model_meta.get("extra_state", {})
        self.keys = [k for k in model_meta["keys"] if k not in self.aliases and k not in extra]
        # A pipeline checkpoint's names are the PipelineModule's; a model built as the plain
        # nn.Sequential of its layers uses consolidate's names for them.
        self.renamed: dict[str, str] = {}
        if self.meta.get("pipeline") is not None:
            from partita.checkpoint.pipeline_layout import sequential_names

            forward, tied = sequential_names(self.keys, self.meta["pipeline"])
            self.renamed = {new: old for old, new in forward.items()}
            self.renamed.update({alias: self.renamed.get(stored, stored) for alias, stored in tied.items()})

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.reader.close()

    def key_for(self, name: str) -> str | None:
        for candidate in (name, self.renamed.get(name)):
            if candidate is None:
                continue
            candidate = self.aliases.get(candidate, candidate)
            if candidate in self.params or candidate in self.frozen or candidate in self.tensors:
                return candidate
        return None

    def _record(self, key: str) -> dict[str, Any]:
        return self.params.get(key) or self.frozen.get(key) or self.tensors[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._record(key)["shape"])

    def read(self, key: str, shard: TensorShard | None, dtype: torch.dtype) -> torch.Tensor:
        from partita.checkpoint.tensor_layout import assemble

        if key in self.params:  # fp32 master weights: exact whatever the training precision
            return assemble(self.reader, fmt.master_key(key), self.params[key], shard, dtype=torch.float32)
        if key in self.frozen:
            record = self.frozen[key]
            return assemble(self.reader, fmt.frozen_key(key), record, shard, dtype=getattr(torch, record["dtype"]))
        whole = self.reader.tensor(fmt.model_file_of(self.meta["model"], key), key)
        return _local(whole, shard)

    def unused(self, used: set[str]) -> list[str]:
        return [k for k in self.keys if k not in used]


def _check_sizes(tag_dir: Path) -> None:
    """Every file the manifest lists has its recorded size (a truncated copy fails here, named,
    rather than as a garbled tensor); checksums are ``partita checkpoint verify``'s job."""
    from partita.checkpoint.errors import CheckpointCorruptError
    from partita.checkpoint.manifest import check_files, read_manifest

    problems = check_files(tag_dir, read_manifest(tag_dir), hash_names=set())
    if problems:
        raise CheckpointCorruptError(f"checkpoint {tag_dir} is damaged: " + "; ".join(problems))


def _local(whole: torch.Tensor, shard: TensorShard | None) -> torch.Tensor:
    if shard is None:
        return whole
    from partita.tensor_parallel.shard_ranges import local_slice

    return local_slice(whole, dim=shard.dim, size=shard.size, rank=shard.rank, chunks=shard.chunks)


# ------------------------------------------------------------------------------ safetensors weights


class _SafetensorsSource:
    """``model.safetensors`` (save_16bit_model: tied names in the header's ``partita_tied``), or
    sharded files with ``model.safetensors.index.json`` (consolidate: ``metadata.tied_weights``;
    Hugging Face: tied weights simply absent, found through the model's other name for them)."""

    def __init__(self, where: Path) -> None:
        from safetensors import safe_open

        files = [where] if where.is_file() else sorted(where.glob("*.safetensors"))
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self.where = where
        self.file_of: dict[str, Any] = {}
        self.aliases: dict[str, str] = {}
        for handle in self._handles:
            for key in handle.keys():
                self.file_of[key] = handle
            tied = (handle.metadata() or {}).get("partita_tied")
            if tied:
                self.aliases.update(json.loads(tied))
        index = (where if where.is_dir() else where.parent) / "model.safetensors.index.json"
        if index.is_file():
            self.aliases.update(json.loads(index.read_text(encoding="utf-8")).get("metadata", {}).get("tied_weights", {}))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()

    def key_for(self, name: str) -> str | None:
        name = self.aliases.get(name, name)
        return name if name in self.file_of else None

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.file_of[key].get_slice(key).get_shape())

    def read(self, key: str, shard: TensorShard | None, dtype: torch.dtype) -> torch.Tensor:
        part = self.file_of[key].get_slice(key)
        if shard is None:
            return part[:]
        lead = (slice(None),) * shard.dim
        # Only this rank's rows/columns are read from the memory map (one range per fused chunk).
        pieces = [part[lead + (slice(a, b),)] for a, b in shard.full_ranges()]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=shard.dim)

    def unused(self, used: set[str]) -> list[str]:
        return [k for k in self.file_of if k not in used]




class _TorchFileSource:
    """``torch.save`` state dicts (``pytorch_model*.bin``, ``save_16bit_model(dir, "model.bin")``),
    opened memory-mapped and tensors-only (``weights_only``: no pickled code runs)."""

    def __init__(self, where: Path) -> None:
        files = [where] if where.is_file() else sorted(p for p in where.iterdir() if p.suffix in _TORCH_SUFFIXES)
        self.state: dict[str, torch.Tensor] = {}
        for path in files:
            try:
                loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as error:  # torch raises several types for a file that is not a state dict
                raise CheckpointError(f"{path} cannot be read as a torch state dict (tensors only): {error}") from None
            if isinstance(loaded, dict) and isinstance(loaded.get("module"), dict):
                loaded = loaded["module"]  # DeepSpeed's mp_rank_00_model_states.pt layout
            self.state.update({k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)})

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.state.clear()

    def key_for(self, name: str) -> str | None:
        return name if name in self.state else None

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.state[key].shape)

    def read(self, key: str, shard: TensorShard | None, dtype: torch.dtype) -> torch.Tensor:
        return _local(self.state[key], shard)

    def unused(self, used: set[str]) -> list[str]:
        # Several names of one tied tensor are all in a torch.save dict; one of them filled it.
        storages = {self.state[k].untyped_storage().data_ptr() for k in used}
        return [k for k, v in self.state.items() if k not in used and v.untyped_storage().data_ptr() not in storages]
