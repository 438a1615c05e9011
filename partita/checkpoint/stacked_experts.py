"""Checkpoints from before the MoE layer took DeepSpeed's module layout, read as today's.

Until then an MoE layer ``P`` kept each expert parameter stacked, and checkpoints recorded it
as the global tensor of every expert: ``P.experts.stacked.<name>`` of shape
``(num_experts, ...)``, rows by global expert index (at ``ep_size > 1`` as a dim-0 split over
the expert ranks), with the gate as ``P.gate.wg.weight``, the residual MLP as
``P.mlp.stacked.<name>`` of shape ``(1, ...)`` and shared experts as
``P.shared_experts.stacked.<name>``. Today's names (those of ``ep_size`` 1) are::

    P.gate.wg.weight              -> P.deepspeed_moe.gate.wg.weight
    P.experts.stacked.<name>[g]   -> P.deepspeed_moe.experts.deepspeed_experts.<g>.<name>
    P.mlp.stacked.<name>[0]       -> P.mlp.<name>
    P.shared_experts.stacked.<name>[j] -> P.shared_experts.deepspeed_experts.<j>.<name>

The old layout is told from the names alone (``.experts.stacked.`` next to ``gate.wg.weight``),
so :func:`upgrade` works from meta.json without the model (``partita checkpoint consolidate``).
It rewrites meta.json in memory: row ``g`` of a stacked tensor is elements
``[g * n, (g + 1) * n)`` of its flattened whole (``n`` = one row's elements), so each new
parameter's record is the stacked record's ranges shifted by ``-g * n`` — a reading rank then
reads exactly the bytes of its own experts, at any world size, ZeRO stage and ``ep_size`` —
and :class:`UpgradedReader` answers the new tensor names from the files' stacked tensors. Nothing
on disk changes; the next ``save_checkpoint`` writes today's layout.
"""

from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from partita.checkpoint import format as fmt
from partita.checkpoint.errors import CheckpointMismatchError
from partita.checkpoint.reshard import ShardReader

__all__ = ["StackedLayout", "UpgradedReader", "open_upgraded", "upgrade"]

_STACKED = re.compile(r"^(?P<prefix>(?:.*\.)?)(?P<kind>experts|mlp|shared_experts)\.stacked\.(?P<leaf>.+)$")


@dataclass(frozen=True)
class _Row:
    """A new parameter name's source: row ``index`` of old key ``old`` (``index`` None: the
    whole old tensor under a new name, the gate)."""

    old: str
    index: int | None
    shape: tuple[int, ...]  # the new tensor's shape

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _new_names(prefix: str, kind: str, leaf: str, rows: int) -> list[str]:
    if kind == "experts":
        return [f"{prefix}deepspeed_moe.experts.deepspeed_experts.{g}.{leaf}" for g in range(rows)]
    if kind == "mlp":
        return [f"{prefix}mlp.{leaf}"]
    return [f"{prefix}shared_experts.deepspeed_experts.{j}.{leaf}" for j in range(rows)]


def _shape_of(meta: dict[str, Any], key: str) -> list[int] | None:
    record = meta["optimizer"]["params"].get(key) or meta["model"]["tensors"].get(key) \
        or meta["model"].get("frozen_shards", {}).get(key)
    return None if record is None else list(record["shape"])


def _renames(meta: dict[str, Any]) -> dict[str, list[tuple[str, _Row]]]:
    """``{old key: [(new name, source row), ...]}`` for every old-layout key (empty when none)."""
    keys = meta["model"]["keys"]
    # An old MoE layer is stacked experts next to its gate (a user module that happens to be
    # called experts.stacked is not one).
    present = set(keys)
    prefixes = {m["prefix"] for k in keys if (m := _STACKED.match(k)) and m["kind"] == "experts"
                and f"{m['prefix']}gate.wg.weight" in present}
    out: dict[str, list[tuple[str, _Row]]] = {}
    for key in keys:
        match = _STACKED.match(key)
        if match is not None and match["prefix"] in prefixes:
            shape = _shape_of(meta, key)
            if shape is None or len(shape) < 1 or (match["kind"] == "mlp" and shape[0] != 1):
                raise CheckpointMismatchError(
                    f"the checkpoint's stacked MoE entry {key!r} has shape {shape}: not (rows, ...) of the stacked expert "
                    "layout (meta.json is inconsistent)")
            row = tuple(shape[1:])
            out[key] = [(new, _Row(key, i, row)) for i, new in
                        enumerate(_new_names(match["prefix"], match["kind"], match["leaf"], shape[0]))]
        elif key.endswith("gate.wg.weight") and key[: -len("gate.wg.weight")] in prefixes:
            prefix = key[: -len("gate.wg.weight")]
            out[key] = [(f"{prefix}deepspeed_moe.gate.wg.weight", _Row(key, None, tuple(_shape_of(meta, key))))]
    return out


def _whole_flat_shards(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A saved record's ranges in flat coordinates of the whole stacked tensor (an ``ep_size > 1``
    save records one piece of consecutive rows per expert rank)."""
    if "pieces" not in record:
        return list(record["shards"])
    split = record["tensor"]
    if split["dim"] != 0 or split["chunks"] != 1:
        raise CheckpointMismatchError(f"a stacked MoE entry split along dimension {split['dim']} ({split['chunks']} "
                                      "chunks): the stacked expert layout only ever split by rows (meta.json is inconsistent)")
    out = []
    for piece in record["pieces"]:
        shift = piece["rank"] * piece["numel"]
        out += [{**s, "start": s["start"] + shift, "end": s["end"] + shift} for s in piece["shards"]]
    return out


def _row_record(record: dict[str, Any], row: _Row) -> dict[str, Any]:
    """The record of one row: the stacked ranges overlapping it, shifted so that the row's first
    element is element 0 (a range may start below 0: the reader offsets into the file's tensor
    by ``element - start``, which the shift leaves pointing at the same bytes)."""
    base = 0 if row.index is None else row.index * row.numel
    shards = [{**s, "start": s["start"] - base, "end": s["end"] - base}
              for s in _whole_flat_shards(record) if s["end"] > base and s["start"] < base + row.numel]
    kept = {k: v for k, v in record.items() if k not in ("tensor", "pieces", "shards", "shape", "numel")}
    return {**kept, "shape": list(row.shape), "numel": row.numel, "shards": shards}


@dataclass
class StackedLayout:
    """An old-layout checkpoint: meta.json rewritten to today's names, and where each comes from."""

    meta: dict[str, Any]
    rows: dict[str, _Row]  # new name -> source
    expansions: dict[str, list[str]]  # old key -> its new names

    def reader(self, tag_dir: str | os.PathLike[str]) -> UpgradedReader:
        return UpgradedReader(tag_dir, self)

    def check_model(self, module: nn.Module) -> None:
        """Refuse (CheckpointMismatchError) stacked entries whose rows disagree with the model's
        experts: another expert count or another expert parameter shape."""
        from partita.moe.registry import moe_layers

        for prefix, layer in ((f"{n}." if n else "", m) for n, m in moe_layers(module)):
            first = layer.deepspeed_moe.experts.deepspeed_experts[0]
            for leaf, param in first.named_parameters():
                old = f"{prefix}experts.stacked.{leaf}"
                if old not in self.expansions:
                    continue
                saved = [len(self.expansions[old]), *self.rows[self.expansions[old][0]].shape]
                want = [layer.num_experts, *param.shape]
                if saved != want:
                    raise CheckpointMismatchError(
                        f"the checkpoint stores {old!r} (the stacked expert layout of earlier partita) with shape "
                        f"{saved}, but this model's MoE layer {prefix[:-1] or '(the model)'!r} has {layer.num_experts} "
                        f"experts whose '{leaf}' has shape {list(param.shape)} (stacked: {want}); build the model with "
                        "the num_experts and expert module the checkpoint was trained with")


def _expert_major(keys: list[str], expansions: dict[str, list[str]]) -> list[str]:
    """``keys`` with old ones expanded; a layer's stacked parameters come out expert by expert
    (each expert's parameters together, in their order), where its first one was: the order
    of ``state_dict()`` today."""
    groups: dict[tuple[str, str], list[str]] = {}
    for key in keys:
        match = _STACKED.match(key)
        if match is not None and key in expansions:
            groups.setdefault((match["prefix"], match["kind"]), []).append(key)
    out = []
    for key in keys:
        match = _STACKED.match(key) if key in expansions else None
        if match is None:
            out += expansions.get(key, [key])
        elif groups.get((match["prefix"], match["kind"]), [None])[0] == key:
            members = groups[(match["prefix"], match["kind"])]
            out += [expansions[old][i] for i in range(len(expansions[members[0]])) for old in members]
    return out


def upgrade(meta: dict[str, Any]) -> StackedLayout | None:
    """The old-layout checkpoint ``meta`` (meta.json) under today's names, None for any other."""
    renames = _renames(meta)
    if not renames:
        return None
    block_wise = [g for g in meta["optimizer"]["groups"] if g.get("block_state") and set(g["params"]) & renames.keys()]
    if block_wise:
        raise NotImplementedError(
            "this checkpoint stores MoE experts stacked (earlier partita) with 8-bit block-wise optimizer state, whose "
            "quantisation blocks span several experts; load it with load_optimizer_states=False (weights and fp32 "
            "master weights still load exactly; the 8-bit moments restart)")
    rows = {new: row for pairs in renames.values() for new, row in pairs}
    expansions = {old: [new for new, _ in pairs] for old, pairs in renames.items()}
    expand = lambda key: expansions.get(key, [key])  # noqa: E731
    meta = copy.deepcopy(meta)
    model = meta["model"]
    model["keys"] = _expert_major(model["keys"], expansions)
    model["sharded_keys"] = [new for key in model.get("sharded_keys", []) for new in expand(key)]
    model["tensors"] = {new: ({**record, "shape": list(rows[new].shape)} if new in rows else record)
                        for key, record in model["tensors"].items() for new in expand(key)}
    model["files"] = {new: file for key, file in model.get("files", {}).items() for new in expand(key)}
    model["aliases"] = {a: s for alias, source in model["aliases"].items()
                        for a, s in zip(expand(alias), expand(source))}
    model["frozen_shards"] = {new: (_row_record(record, rows[new]) if new in rows else record)
                              for key, record in model.get("frozen_shards", {}).items() for new in expand(key)}
    optimizer = meta["optimizer"]
    optimizer["params"] = {new: (_row_record(record, rows[new]) if new in rows else record)
                           for key, record in optimizer["params"].items() for new in expand(key)}
    for group in optimizer["groups"]:
        group["params"] = [new for key in group["params"] for new in expand(key)]
    return StackedLayout(meta, rows, expansions)


class _RenamedHandle:
    """A safetensors file of an old-layout checkpoint that also answers today's names."""

    def __init__(self, handle: Any, rows: dict[str, tuple[str, int | None]], flat: dict[str, str]) -> None:
        self._handle = handle
        present = set(handle.keys())
        self._rows = {k: v for k, v in rows.items() if v[0] in present}  # model-file tensors: one row each
        self._flat = {k: v for k, v in flat.items() if v in present}  # master/state/frozen ranges: read by range

    def keys(self) -> list[str]:
        return [*self._handle.keys(), *self._rows, *self._flat]

    def get_slice(self, key: str) -> Any:
        return self._handle.get_slice(self._flat.get(key, key))

    def get_tensor(self, key: str) -> torch.Tensor:
        if key in self._rows:
            old, index = self._rows[key]
            value = self._handle.get_tensor(old)
            return value if index is None else value[index].clone()
        return self._handle.get_tensor(self._flat.get(key, key))

    def metadata(self) -> dict[str, str] | None:
        return self._handle.metadata()


class UpgradedReader(ShardReader):
    """:class:`ShardReader` of an old-layout checkpoint, reading today's names from its files:
    a model-file tensor is its stacked tensor's row; ``master/``, ``state/<kind>/`` and
    ``frozen/`` entries are the stacked ranges (the rewritten records' shifted ranges say which)."""

    def __init__(self, tag_dir: str | os.PathLike[str], layout: StackedLayout) -> None:
        super().__init__(tag_dir)
        kinds = {k for g in layout.meta["optimizer"]["groups"] for k in g["partition_state"]}
        self._row_keys = {new: (row.old, row.index) for new, row in layout.rows.items()}
        self._flat_keys: dict[str, str] = {}
        for new, row in layout.rows.items():
            for key_of in (fmt.master_key, fmt.frozen_key, *(lambda n, k=k: fmt.state_key(k, n) for k in kinds)):
                self._flat_keys[key_of(new)] = key_of(row.old)
        self._renamed: dict[str, _RenamedHandle] = {}

    def handle(self, name: str) -> Any:
        if name not in self._renamed:
            self._renamed[name] = _RenamedHandle(super().handle(name), self._row_keys, self._flat_keys)
        return self._renamed[name]

    def close(self) -> None:
        self._renamed.clear()
        super().close()


def open_upgraded(tag_dir: str | os.PathLike[str], meta: dict[str, Any],
                  module: nn.Module | None = None) -> tuple[dict[str, Any], ShardReader]:
    """``(meta, reader)`` for reading the checkpoint in ``tag_dir`` under today's names: an
    old-layout checkpoint's upgraded meta and reader (checked against ``module``'s experts when
    given), any other checkpoint's own meta and a plain :class:`ShardReader`."""
    layout = upgrade(meta)
    if layout is None:
        return meta, ShardReader(tag_dir)
    if module is not None:
        layout.check_model(module)
    return layout.meta, layout.reader(tag_dir)
