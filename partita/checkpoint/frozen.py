"""Checkpoints of ZeRO-3's sharded frozen parameters (see partita/zero/frozen_params.py).

Such a parameter (built under ``zero.Init``, not trained) has no fp32 master, and between uses
no storage, so neither the master shards nor the model file can hold it. As for a master, each
rank writes the range ``[start, end)`` of the flattened parameter it holds, in the model's dtype,
into its rank file under ``frozen/<name>``; rank 0's meta.json lists the parameter in the model
section's ``frozen_shards`` (``{name: {shape, numel, dtype, shards: [{file, start, end}]}}``) and
among its ``sharded_keys``. Nothing here is a collective (as in the rest of partita/checkpoint).

Loading reads, on any world size, the ranges each rank holds now. A run holding the parameter
whole (a model built without zero.Init, ZeRO 0-2) reads it whole; a run holding it as shards
also loads it from a checkpoint that has it whole in its model file, or as fp32 master shards
(saved while it was trained).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

import partita.checkpoint.format as fmt
from partita.checkpoint.errors import CheckpointMismatchError
from partita.checkpoint.locations import param_names, shard_file_of
from partita.checkpoint.reshard import ShardReader
from partita.checkpoint.safetensors_io import TensorEntry
from partita.checkpoint.tensor_layout import read_elements

if TYPE_CHECKING:
    from partita.engine import Engine
    from partita.zero.frozen_params import FrozenShards


def _frozen_of(engine: Engine) -> FrozenShards | None:
    gatherer = getattr(engine.zero, "gatherer", None)
    return None if gatherer is None else gatherer.frozen


def frozen_entries(engine: Engine, names: dict[torch.nn.Parameter, str], *, copy: bool) -> list[TensorEntry]:
    """This rank's rank-file entries: its range of every sharded frozen parameter."""
    frozen = _frozen_of(engine)
    if frozen is None:
        return []
    out = []
    for param, _, start, end, elements in frozen.owned():
        if end > start:
            value = elements.detach()
            out.append(TensorEntry.of(fmt.frozen_key(names[param]), value.to("cpu", copy=True) if copy else value))
    return out


def frozen_meta(engine: Engine, names: dict[torch.nn.Parameter, str]) -> dict[str, Any]:
    """meta.json's ``model.frozen_shards``: where each rank's range of each parameter is."""
    frozen = _frozen_of(engine)
    if frozen is None:
        return {}
    out = {}
    for param in frozen.params:
        spec = frozen.spec(param)
        shards = []
        for shard_rank in range(frozen.comm.size):
            start, end = spec.owned_range(shard_rank)
            if end > start:
                shards.append({"file": shard_file_of(engine, shard_rank), "start": start, "end": end})
        out[names[param]] = {"shape": list(spec.shape), "numel": spec.numel,
                             "dtype": str(param.dtype).replace("torch.", ""), "shards": shards}
    return out


def read_whole(reader: ShardReader, model_meta: dict[str, Any], source: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The whole value of ``source`` if the checkpoint holds it as frozen shards, else None."""
    record = model_meta.get("frozen_shards", {}).get(source)
    return None if record is None else reader.read_full(fmt.frozen_key(source), record, dtype)


def read_range(reader: ShardReader, model_meta: dict[str, Any], source: str, start: int, end: int,
               out: torch.Tensor) -> bool:
    """Fill ``out`` with elements ``[start, end)`` of ``source`` if the checkpoint holds it as
    frozen shards; False if it does not."""
    record = model_meta.get("frozen_shards", {}).get(source)
    if record is None:
        return False
    reader.read_range(fmt.frozen_key(source), record["shards"], start, end, out)
    return True


@torch.no_grad()
def load_frozen(engine: Engine, reader: ShardReader, meta: dict[str, Any], *, strict: bool) -> None:
    """Each sharded frozen parameter of this run: this rank's range, from wherever the checkpoint has it."""
    frozen = _frozen_of(engine)
    if frozen is None:
        return
    model_meta, masters = meta["model"], meta["optimizer"]["params"]
    names = param_names(engine.module)
    for param, spec, start, end, out in frozen.owned():
        name = names[param]
        source = model_meta["aliases"].get(name, name)
        saved_shape = (model_meta.get("frozen_shards", {}).get(source) or model_meta["tensors"].get(source)
                       or masters.get(source) or {}).get("shape")
        if saved_shape is not None and tuple(saved_shape) != tuple(spec.shape):
            raise CheckpointMismatchError(f"'{name}' has shape {saved_shape} in the checkpoint and {list(spec.shape)} "
                                          "in this model")
        if end <= start or read_range(reader, model_meta, source, start, end, out):
            continue
        if source in model_meta["tensors"]:  # saved whole (without zero.Init, or at ZeRO 0-2)
            value = reader.tensor(fmt.model_file_of(model_meta, source), source)
            out.copy_(value.reshape(-1)[start:end])
        elif source in masters:  # saved while trained: its fp32 master shards
            read_elements(reader, fmt.master_key(source), masters[source], None, start, end, out)
        elif strict or name in model_meta["keys"]:
            raise CheckpointMismatchError(f"the checkpoint has no weights for the frozen parameter '{name}'")
