"""Tensor-sharded parameters in a checkpoint: how they are recorded, and how any layout reads them.

[Note: tensor-parallel parameter records]
Under tensor parallelism a parameter is a *local shard* of a whole tensor (``TensorShard``:
split dimension ``dim``, ``size`` tensor ranks, ``chunks`` fused blocks), and ZeRO partitions
each tensor rank's local shard over the ZeRO group (``data x sequence``) exactly as it would a
plain parameter. So meta.json's record of such a parameter keeps the two levels apart:

    {"group": g, "shape": <whole shape>, "numel": <whole numel>, "dtype": ...,
     "tensor": {"dim": d, "size": a, "chunks": k},
     "pieces": [{"rank": t, "shape": <local shape>, "numel": n,
                 "shards": [{"file", "start", "end"}, ...]}, ...]}   # one per tensor rank

A piece's ``shards`` are element ranges of *that tensor rank's flattened local shard*, in the
rank files of the ranks that owned them (keys ``master/<name>``, ``state/<kind>/<name>`` as for
any parameter: a rank file holds one tensor rank's piece, so keys never collide). Parameters
the tensor ranks replicate (norms, row-parallel biases, position embeddings) are recorded as
plain parameters and written by tensor rank 0 only.

A loading rank needs elements ``[start, end)`` of its own flattened local shard, whatever its
tensor size ``c`` (1 included). Three ways, cheapest first:

1. same split (``size``, ``dim``, ``chunks`` equal): its piece is exactly the saved piece of the
   same tensor rank; the ZeRO ranges are read as for a plain parameter;
2. both split along dim 0 with one chunk (or not split): every local shard is a contiguous run
   of the whole tensor's flattened elements (piece ``t`` is ``[t*n, (t+1)*n)``), so the saved
   ranges are shifted into whole-tensor coordinates and read directly (only the bytes needed);
3. otherwise (dim 1, fused q/k/v at another size): the rank's local shard is assembled from
   the saved pieces that overlap it along ``dim`` (each read whole, one parameter at a time),
   then sliced. Peak extra memory: one local shard plus one saved piece.

8-bit (block-wise) state moves only where blocks of ``B`` = 256 elements of the loading rank's
local shard are blocks of a saved piece, holding the same elements: cases 1, and 2 when every
local shard involved has a multiple of ``B`` elements. Anything else cannot be re-cut without
dequantising (a different result from an uninterrupted run), so it is refused with the sizes
and the way out (:func:`check_block_wise`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from partita.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError
from partita.checkpoint.reshard import ShardReader
from partita.checkpoint.state_layout import block_shards
from partita.tensor_parallel.layers import TensorShard
from partita.tensor_parallel.shard_ranges import dim_ranges, local_shape

ShardsOf = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def _identity(shards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return shards


# ---------------------------------------------------------------------------- recording


def tensor_param_record(shard: TensorShard, local_numel: int, local_ranges: Callable[[int], list[dict[str, Any]]]) -> dict[str, Any]:
    """The meta.json fields of a tensor-sharded parameter (see the note above).

    ``local_ranges(t)``: the ``{file, start, end}`` ZeRO shards of tensor rank ``t``'s local
    shard. Every tensor rank's local shard has the same shape, hence the same ZeRO layout; only
    the files differ.
    """
    local = list(local_shape(shard.full_shape, dim=shard.dim, size=shard.size))
    return {
        "shape": list(shard.full_shape),
        "numel": math.prod(shard.full_shape),
        "tensor": {"dim": shard.dim, "size": shard.size, "chunks": shard.chunks},
        "pieces": [{"rank": t, "shape": local, "numel": local_numel, "shards": local_ranges(t)} for t in range(shard.size)],
    }


def full_shape_of(param: torch.Tensor, shard: TensorShard | None) -> tuple[int, ...]:
    return tuple(shard.full_shape) if shard is not None else tuple(param.shape)


# ---------------------------------------------------------------------------- reading


def _split(record: dict[str, Any]) -> dict[str, int] | None:
    return record.get("tensor")


def _same_split(saved: dict[str, int] | None, current: TensorShard | None) -> bool:
    if saved is None or current is None:
        return saved is None and current is None
    return (saved["dim"], saved["size"], saved["chunks"]) == (current.dim, current.size, current.chunks)


def _row_contiguous(dim: int | None, chunks: int | None) -> bool:
    """Whether every local shard is one contiguous run of the whole tensor's flattened elements."""
    return dim is None or (dim == 0 and chunks == 1)


def _contiguous(saved: dict[str, int] | None, current: TensorShard | None) -> bool:
    return _row_contiguous(*((saved["dim"], saved["chunks"]) if saved else (None, None))) and _row_contiguous(
        *((current.dim, current.chunks) if current else (None, None))
    )


def _local_numel(current: TensorShard) -> int:
    return math.prod(local_shape(current.full_shape, dim=current.dim, size=current.size))


def _whole_flat_shards(record: dict[str, Any], shards_of: ShardsOf) -> list[dict[str, Any]]:
    """A contiguous layout's saved ranges in whole-tensor flat coordinates."""
    if _split(record) is None:
        return shards_of(record["shards"])
    out = []
    for piece in record["pieces"]:
        shift = piece["rank"] * piece["numel"]
        out += [{**s, "start": s["start"] + shift, "end": s["end"] + shift} for s in shards_of(piece["shards"])]
    return out


def read_elements(reader: ShardReader, key: str, record: dict[str, Any], current: TensorShard | None, start: int,
                  end: int, out: torch.Tensor, *, shards_of: ShardsOf = _identity) -> None:
    """Fill ``out`` with elements ``[start, end)`` of this rank's flattened local tensor of the
    parameter saved as ``record`` (``current``: its tensor shard now, None when whole).

    ``shards_of`` maps a list of saved ZeRO ranges to the ranges the key was saved over
    (block-rounded for 8-bit per-element state).
    """
    saved = _split(record)
    if saved is not None and _same_split(saved, current):
        reader.read_range(key, shards_of(record["pieces"][current.rank]["shards"]), start, end, out)
    elif _contiguous(saved, current):
        # A checkpoint without tensor parallelism loaded without it takes this branch with
        # shift 0: exactly the plain read.
        shift = 0 if current is None else current.rank * _local_numel(current)
        reader.read_range(key, _whole_flat_shards(record, shards_of), shift + start, shift + end, out)
    else:
        local = assemble(reader, key, record, current, dtype=out.dtype, shards_of=shards_of)
        out.copy_(local.reshape(-1)[start:end])


def assemble(reader: ShardReader, key: str, record: dict[str, Any], current: TensorShard | None, *,
             dtype: torch.dtype = torch.float32, shards_of: ShardsOf = _identity) -> torch.Tensor:
    """This rank's whole local shard (``current``), or the whole tensor (``current`` None), of
    ``key`` from the saved pieces that overlap it along the split dimension."""
    full_shape = tuple(record["shape"])
    saved = _split(record)
    if saved is None and current is None:
        return reader.read_full(key, {**record, "shards": shards_of(record["shards"])}, dtype)
    if saved is not None and current is not None and saved["dim"] != current.dim:
        raise CheckpointMismatchError(
            f"{key!r} was split along dimension {saved['dim']} by tensor parallelism when saved and is split along "
            f"dimension {current.dim} now; the model's tensor-parallel plan changed. Load with the saved plan"
        )
    dim = saved["dim"] if saved is not None else current.dim
    length = full_shape[dim]
    want = dim_ranges(length, size=current.size, rank=current.rank, chunks=current.chunks) if current else [(0, length)]
    out_shape = list(full_shape)
    out_shape[dim] = sum(b - a for a, b in want)
    out = torch.empty(out_shape, dtype=dtype)
    if saved is None:
        pieces = [([(0, length)], {"shape": list(full_shape), "numel": record["numel"], "shards": record["shards"]})]
    else:
        pieces = [(dim_ranges(length, size=saved["size"], rank=p["rank"], chunks=saved["chunks"]), p) for p in record["pieces"]]
    cache: dict[int, torch.Tensor] = {}

    def piece_tensor(index: int) -> torch.Tensor:
        if index not in cache:
            piece = pieces[index][1]
            flat = torch.empty(piece["numel"], dtype=dtype)
            reader.read_range(key, shards_of(piece["shards"]), 0, piece["numel"], flat)
            cache[index] = flat.view(piece["shape"])
        return cache[index]

    filled, at = 0, 0
    for a, b in want:
        for index, (ranges, _) in enumerate(pieces):
            pos = 0
            for pa, pb in ranges:
                lo, hi = max(a, pa), min(b, pb)
                if lo < hi:
                    out.narrow(dim, at + lo - a, hi - lo).copy_(piece_tensor(index).narrow(dim, pos + lo - pa, hi - lo))
                    filled += hi - lo
                pos += pb - pa
        at += b - a
    if filled != out_shape[dim]:
        raise CheckpointCorruptError(
            f"the saved tensor-parallel pieces of {key!r} cover {filled} of the {out_shape[dim]} rows needed along "
            f"dimension {dim} (meta.json in {reader.tag_dir} is inconsistent)"
        )
    return out


def check_block_wise(name: str, record: dict[str, Any], current: TensorShard | None, block_size: int) -> None:
    """Refuse 8-bit state that a change of tensor layout would cut across its blocks."""
    saved = _split(record)
    if _same_split(saved, current):
        return
    aligned = _contiguous(saved, current)
    if saved is not None:
        aligned = aligned and record["pieces"][0]["numel"] % block_size == 0
    if current is not None:
        aligned = aligned and _local_numel(current) % block_size == 0
    if aligned:
        return
    was = "not split" if saved is None else f"split {saved['size']} ways along dimension {saved['dim']}" + (
        f" ({saved['chunks']} fused chunks)" if saved["chunks"] > 1 else "")
    now = "not split" if current is None else f"split {current.size} ways along dimension {current.dim}" + (
        f" ({current.chunks} fused chunks)" if current.chunks > 1 else "")
    raise CheckpointMismatchError(
        f"the 8-bit optimizer state of '{name}' was saved at tensor-parallel size {1 if saved is None else saved['size']} "
        f"({was}) and this run uses tensor-parallel size {1 if current is None else current.size} ({now}); its "
        f"quantisation blocks of {block_size} elements would hold other elements in this layout, so it cannot "
        "resume exactly. Resume at the saved tensor-parallel size, or pass load_optimizer_states=False (weights and "
        "fp32 master weights still load exactly; the 8-bit moments restart)"
    )


def read_blocks(reader: ShardReader, key: str, record: dict[str, Any], current: TensorShard | None, first: int,
                last: int, out: torch.Tensor, block_size: int) -> None:
    """Fill ``out`` with blocks ``[first, last)`` of this rank's local shard's per-block state
    (after :func:`check_block_wise` accepted the layouts)."""
    saved = _split(record)
    if saved is not None and _same_split(saved, current):
        reader.read_range(key, block_shards(record["pieces"][current.rank]["shards"], block_size), first, last, out)
        return
    shift = 0 if current is None else current.rank * _local_numel(current) // block_size
    reader.read_range(key, block_shards(_whole_flat_shards(record, _identity), block_size), shift + first, shift + last, out)


def last_shard_file(record: dict[str, Any], current: TensorShard | None) -> str:
    """The file holding the padding of this rank's local shard's last block (same-layout loads)."""
    saved = _split(record)
    if saved is not None and _same_split(saved, current):
        return record["pieces"][current.rank]["shards"][-1]["file"]
    if saved is not None:
        return record["pieces"][-1]["shards"][-1]["file"]
    return record["shards"][-1]["file"]
