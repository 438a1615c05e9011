"""Full model weights from a checkpoint, as Hugging Face-style sharded safetensors.

Trainable parameters come from the fp32 master shards (exact, whatever the training
precision), tensor-parallel ones put back together from their tensor ranks' pieces; frozen
parameters and buffers from the model file, or frozen parameters ZeRO-3 held as shards from
their ``frozen/`` ranges in the rank files (partita/checkpoint/frozen.py). The output is
``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_bytes`` each and
``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``), which
``transformers`` loads. Tied parameters are written once; the index lists the aliases under
``metadata.tied_weights``. A pipeline checkpoint is written with the keys of a plain
``nn.Sequential`` of its layers (:mod:`partita.checkpoint.pipeline_layout`);
:func:`load_consolidated` reads an output back as one state dict, aliases included.

Memory: the plan (names, shapes, output files) comes from meta.json alone; each tensor is
then assembled from its shards, cast, written and dropped before the next one, so the peak
is about one parameter (in fp32 plus its cast), not the model or an output shard.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from partita.checkpoint import format as fmt
from partita.checkpoint.errors import CheckpointError
from partita.checkpoint.pipeline_layout import sequential_names
from partita.checkpoint.stacked_experts import open_upgraded
from partita.checkpoint.safetensors_io import TensorEntry, write_json, write_safetensors
from partita.checkpoint.tensor_layout import assemble
from partita.progress import progress

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes in "5GB" (10**9 units, as Hugging Face), "500MiB" (2**20 units) or "1000"."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in _UNITS:
        raise ValueError(f"size {text!r} is not a number with an optional unit (KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size < 1:
        raise ValueError(f"size {text!r} must be at least 1 byte")
    return size


@dataclass(frozen=True)
class _Item:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    from_master: bool
    from_frozen: bool = False  # a ZeRO-3 sharded frozen parameter (model.frozen_shards)


def _plan(meta: dict[str, Any], dtype: torch.dtype) -> tuple[list[_Item], dict[str, str]]:
    model = meta["model"]
    params = meta["optimizer"]["params"]
    aliases = model["aliases"]
    extra = model.get("extra_state", {})
    items = []
    for key in model["keys"]:
        if key in aliases or key in extra:
            continue
        if key in params:
            items.append(_Item(key, dtype, tuple(params[key]["shape"]), True))
            continue
        frozen = model.get("frozen_shards", {}).get(key)
        record = model["tensors"].get(key) if frozen is None else frozen
        if record is None:
            raise CheckpointError(f"the checkpoint has no weights for {key!r} (meta.json is inconsistent)")
        saved = getattr(torch, record["dtype"])
        # Floating tensors take the requested dtype; integer buffers (counters, ids) keep theirs.
        items.append(_Item(key, dtype if saved.is_floating_point else saved, tuple(record["shape"]), False,
                           from_frozen=frozen is not None))
    return items, dict(aliases)


def _split(items: list[_Item], max_bytes: int) -> list[list[_Item]]:
    shards: list[list[_Item]] = [[]]
    size = 0
    for item in items:
        nbytes = math.prod(item.shape) * torch.empty((), dtype=item.dtype).element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


def consolidate(tag_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, dtype: str = "fp32",
                max_shard_size: str = "5GB") -> Path:
    """Write the full weights of the checkpoint in ``tag_dir`` to ``out_dir``; returns the index path."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    tag_dir, out_dir = Path(tag_dir), Path(out_dir)
    meta = json.loads((tag_dir / fmt.META_FILE).read_text(encoding="utf-8"))
    # MoE experts saved stacked by earlier partita come out under today's per-expert names.
    meta, reader = open_upgraded(tag_dir, meta)
    items, aliases = _plan(meta, DTYPES[dtype])
    # A pipeline checkpoint's keys become those of nn.Sequential(*layers) (pipeline_layout's note).
    renamed = {item.name: item.name for item in items}
    if meta.get("pipeline") is not None:
        renamed, tied = sequential_names([item.name for item in items], meta["pipeline"])
        aliases = {**{renamed.get(a, a): renamed.get(s, s) for a, s in aliases.items()}, **tied}
    shards = _split(items, parse_size(max_shard_size))
    out_dir.mkdir(parents=True, exist_ok=True)
    params = meta["optimizer"]["params"]
    weight_map: dict[str, str] = {}
    with reader, progress(len(items), desc="consolidate", enabled=True, interval_s=5.0) as bar:

        def produce(item: _Item):
            def build() -> torch.Tensor:
                if item.from_master:
                    # A tensor-parallel parameter's pieces are put back together (tensor_layout).
                    full = assemble(reader, fmt.master_key(item.name), params[item.name], None)
                elif item.from_frozen:
                    record = meta["model"]["frozen_shards"][item.name]
                    full = reader.read_full(fmt.frozen_key(item.name), record, getattr(torch, record["dtype"]))
                else:
                    full = reader.tensor(fmt.model_file_of(meta["model"], item.name), item.name)
                return full.to(item.dtype).reshape(item.shape)

            return build

        for index, shard in enumerate(shards, start=1):
            name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            entries = [TensorEntry(renamed[item.name], item.dtype, item.shape, produce(item)) for item in shard]
            write_safetensors(out_dir / name, entries, metadata={"format": "pt"}, on_tensor=lambda e: bar.update(1))
            weight_map.update({renamed[item.name]: name for item in shard})
    tensor_bytes = sum(math.prod(i.shape) * torch.empty((), dtype=i.dtype).element_size() for i in items)
    index_path = out_dir / "model.safetensors.index.json"
    write_json(index_path, {"metadata": {"total_size": tensor_bytes, "tied_weights": aliases,
                                         "source": str(tag_dir), "global_steps": meta["counters"]["global_steps"]},
                            "weight_map": weight_map})
    return index_path


def load_consolidated(out_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The state dict :func:`consolidate` wrote to ``out_dir``; each alias of ``metadata.tied_weights``
    is the same tensor object as the key it names, as in the module it came from."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    index = json.loads((out_dir / "model.safetensors.index.json").read_text(encoding="utf-8"))
    state: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        state.update(load_file(str(out_dir / name)))
    for alias, stored in index["metadata"].get("tied_weights", {}).items():
        state[alias] = state[stored]
    return state
