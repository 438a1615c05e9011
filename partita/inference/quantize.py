"""Weight-only int8 / int4 quantization of a model's matmul layers, through torchao.

:func:`quantize_weights` replaces the weight of every linear layer by a torchao quantized tensor
(``torchao.quantization.quantize_``, one layer at a time), so the layer's own ``forward`` runs
unchanged: ``F.linear`` dispatches to torchao's weight-only kernel. Activations stay in the model's
dtype; only the weights are stored in 8 or 4 bits (plus one scale, and for int4 a zero point, per
group). Layers covered:

- ``nn.Linear``;
- partita's tensor-parallel :class:`ColumnParallelLinear` / :class:`RowParallelLinear`: they hold
  this rank's shard as a plain ``weight`` and call ``F.linear``, so quantizing *after* the split
  quantizes each rank's shard (groups run along this rank's input features);
- Hugging Face's ``Conv1D`` (GPT-2) and AutoTP's :class:`Conv1DColumnParallel` /
  :class:`Conv1DRowParallel`: their weight is stored transposed, ``(in, out)``, and multiplied by
  ``addmm``, which torchao's tensors do not implement; each is converted to an equivalent layer
  holding ``(out, in)`` and calling ``F.linear`` (:class:`LinearFromConv1D`) before quantizing.

Kept in full precision by default: embeddings (a lookup reads one row per token, so its bytes are
not what a decoding step streams, and torchao's linear formats do not serve lookups) and the LM head
(the output embedding: quantizing it perturbs every logit directly, where argmax flips show first;
it is often tied to the input embedding, which a quantized copy would untie; and partita's reference
GPT reads ``lm_head.weight`` as a matrix in its tiled loss). ``include_lm_head=True`` quantizes it too.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from partita.inference.tensor_parts import map_leaves, stored_nbytes
from partita.tensor_parallel.autotp import Conv1DColumnParallel, Conv1DRowParallel, is_hf_conv1d
from partita.tensor_parallel.comm import copy_to_tensor, reduce_from_tensor
from partita.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

logger = logging.getLogger("partita")

__all__ = ["LinearFromConv1D", "quantize_weights", "quantized_nbytes"]

BITS = (8, 4)
# The CPU int4 kernel (aten's _weight_int4pack_mm_for_cpu, behind torchao's Int4OpaqueTensor) and the
# CUDA tinygemm kernel take these group sizes only; other sizes fall back to IntxUnpackedToInt8Tensor.
_PACKED_INT4_GROUPS = {"cpu": (32, 64, 128), "cuda": (32, 64, 128, 256)}
_INT4_DEFAULT_GROUPS = (128, 64, 32)  # torchao's default (128) first, then the largest that fits


class LinearFromConv1D(nn.Module):
    """A ``Conv1D`` (or its AutoTP column / row split) as a Linear: ``weight`` is ``(out, in)``.

    ``parallel``: None (a whole layer), ``"column"`` (output features split: the input is the whole
    activation, the output stays sharded) or ``"row"`` (input features split: the partial products
    are summed over the tensor group, then the replicated bias is added once) — the same
    collectives as the layer it replaces, so the model's outputs do not change.
    """

    def __init__(self, weight_in_out: torch.Tensor, bias: torch.Tensor | None, *, parallel: str | None = None,
                 group=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight_in_out.detach().t().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.parallel = parallel
        self.group = group

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel == "column":
            return F.linear(copy_to_tensor(x, self.group), self.weight, self.bias)
        if self.parallel == "row":
            out = reduce_from_tensor(F.linear(x, self.weight), self.group)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, parallel={self.parallel}"


def _linear_from_conv1d(module: nn.Module) -> LinearFromConv1D:
    if isinstance(module, Conv1DColumnParallel):
        return LinearFromConv1D(module.weight, module.bias, parallel="column", group=module.group)
    if isinstance(module, Conv1DRowParallel):
        return LinearFromConv1D(module.weight, module.bias, parallel="row", group=module.group)
    return LinearFromConv1D(module.weight, module.bias)


_LINEAR_TYPES = (nn.Linear, ColumnParallelLinear, RowParallelLinear, LinearFromConv1D)


def _is_conv1d(module: nn.Module) -> bool:
    return is_hf_conv1d(module) or isinstance(module, (Conv1DColumnParallel, Conv1DRowParallel))


def _head_weights(model: nn.Module) -> set[int]:
    """ids of the weights that are the model's LM head: HF's output embeddings, any module called
    ``lm_head``, and any matmul weight shared with an embedding (a tied head)."""
    heads: set[int] = set()
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        try:
            out = get_out()
        except (AttributeError, NotImplementedError):
            out = None
        if isinstance(getattr(out, "weight", None), torch.Tensor):
            heads.add(id(out.weight))
    embedded = {id(m.weight) for m in model.modules() if _is_embedding(m)}
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor) or _is_embedding(m):
            continue
        if name.rsplit(".", 1)[-1] == "lm_head" or id(w) in embedded:
            heads.add(id(w))
    return heads


def _is_embedding(module: nn.Module) -> bool:
    return isinstance(module, (nn.Embedding, VocabParallelEmbedding))


def _require_torchao():
    if importlib.util.find_spec("torchao") is None:
        raise ImportError(
            "weight-only quantization (dtype=torch.int8 / quant) needs torchao, which is not installed: "
            "pip install torchao (or pip install partita[inference])"
        )
    import torchao.quantization as tq

    return tq


def _valid_groups(in_features: int) -> str:
    sizes = [g for g in (16, 32, 64, 128, 256, 512, 1024) if g <= in_features and in_features % g == 0]
    return ", ".join(map(str, sizes)) or "none of 16..1024"


def _check_group(name: str, in_features: int, group_size: int | None, shard_note: str) -> None:
    if group_size is None:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"quantize_weights: group_size must be a positive int or None, got {group_size!r}")
    if in_features % group_size != 0:
        raise ValueError(
            f"quantize_weights: group_size {group_size} does not divide the {in_features} input features of "
            f"layer {name!r}{shard_note}; choose a group_size that divides {in_features} "
            f"(powers of two that do: {_valid_groups(in_features)}), or group_size=None"
        )


def _int4_group(in_features: int, group_size: int | None) -> int:
    if group_size is not None:
        return group_size
    return next((g for g in _INT4_DEFAULT_GROUPS if in_features % g == 0), in_features)


def _config_for(tq, weight: torch.Tensor, bits: int, group_size: int | None, device: torch.device):
    """The torchao config for one layer: the fastest format the device has a kernel for.

    int8: ``Int8WeightOnlyConfig`` on every device (plain int8 ``qdata`` + per-row or per-group
    scales: it moves between devices as is, so it is also the format to stream from host memory).
    int4, by device:

    - CUDA, bf16 weights: ``Int4WeightOnlyConfig`` — the ``plain`` format's kernels (the ``mslk``
      package) when importable, the fastest int4 GEMV/GEMM torchao has on Hopper; otherwise the
      ``tile_packed_to_4d`` format, whose tinygemm kernel ships inside torch itself;
    - CPU: torchao's ``Int4OpaqueTensor`` (``PrototypeInt4WeightOnlyConfig``), packed two values a byte
      for aten's CPU int4 kernel — a quarter of bf16's bytes; ``Int4WeightOnlyConfig``'s default
      format needs ``mslk``, which has no CPU build;
    - anything else (fp32/fp16 on CUDA, a group size those kernels lack):
      ``IntxWeightOnlyConfig(weight_dtype=torch.int4)``, exact int4 arithmetic but each value stored
      in an int8 (half of bf16's bytes, not a quarter), on any device.
    """
    in_features = weight.shape[-1]
    if bits == 8:
        gran = tq.PerRow() if group_size is None else tq.PerGroup(group_size)
        # set_inductor_config=False: torchao's recommended settings flip process-wide compiler flags
        # (coordinate descent tuning...), which a library call must not do behind the user's back.
        return tq.Int8WeightOnlyConfig(granularity=gran, set_inductor_config=False)
    group = _int4_group(in_features, group_size)
    if device.type == "cuda" and weight.dtype == torch.bfloat16 and group in _PACKED_INT4_GROUPS["cuda"]:
        if importlib.util.find_spec("mslk") is not None:
            return tq.Int4WeightOnlyConfig(group_size=group, set_inductor_config=False)
        if torch.cuda.get_device_capability(device)[0] >= 8:
            return tq.Int4WeightOnlyConfig(group_size=group, int4_packing_format="tile_packed_to_4d",
                                           set_inductor_config=False)
    if device.type == "cpu" and weight.dim() == 2 and group in _PACKED_INT4_GROUPS["cpu"]:
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=group, set_inductor_config=False)
    gran = tq.PerGroup(group) if group < in_features else tq.PerAxis(0)
    return tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=gran)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else map_leaves(t, lambda leaf: leaf.to(device))


def quantize_weights(model: nn.Module, *, bits: int = 8, group_size: int | None = None,
                     include_lm_head: bool = False, device: torch.device | str | None = None) -> nn.Module:
    """Quantize the weights of ``model``'s linear layers in place (weight-only int8 or int4); returns ``model``.

    - ``bits``: 8 or 4.
    - ``group_size``: input features sharing one scale. None: int8 one scale per output row; int4
      groups of 128 (torchao's default), else the largest of 64 / 32 that divides the layer, else one
      group per row. Must divide every quantized layer's input features (this rank's shard of them,
      for a row-parallel layer).
    - ``include_lm_head``: also quantize the LM head (kept in full precision by default: module doc).
    - ``device``: pack each weight for this device's kernels (quantized there, then put back where
      it was). Default: the device each weight is on. The int4 formats are packed per device: to
      stream int4 weights from host memory to a GPU, quantize them with ``device="cuda"``.

    Run it after loading a checkpoint and after tensor-parallel splitting: the quantized model is
    for inference (the weights no longer train, and a partita training checkpoint cannot be saved
    from it). Bias, norms and embeddings keep their dtype. Raises ImportError without torchao, and
    ValueError for a ``bits`` other than 8 / 4 or a ``group_size`` that does not divide a layer.
    """
    if bits not in BITS:
        raise ValueError(f"quantize_weights: bits={bits!r} is not supported; choose 8 (int8) or 4 (int4) "
                         "weight-only quantization")
    tq = _require_torchao()
    skip = set() if include_lm_head else _head_weights(model)
    target = None if device is None else torch.device(device)
    if target is not None and target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())

    chosen: list[tuple[str, nn.Module]] = []
    for name, module in list(model.named_modules()):
        if not (isinstance(module, _LINEAR_TYPES) or _is_conv1d(module)):
            continue
        weight = module.weight
        if id(weight) in skip or weight.dim() != 2 or is_traceable_wrapper_subclass(weight):
            continue  # the LM head, or already quantized (torchao tensors report the float dtype they replace)
        in_features = weight.shape[0] if _is_conv1d(module) else weight.shape[1]
        sharded = isinstance(module, (RowParallelLinear, Conv1DRowParallel))
        note = " (this tensor rank's shard of the input features)" if sharded else ""
        _check_group(name or type(module).__name__, in_features, group_size, note)
        chosen.append((name, module))

    done: dict[int, nn.Parameter] = {}  # id(float weight) -> its quantized Parameter: shared weights stay shared
    formats: dict[str, int] = {}
    for name, module in chosen:
        original = id(module.weight)
        if original in done:
            module.weight = done[original]
            continue
        if _is_conv1d(module):
            replacement = _linear_from_conv1d(module)
            if name:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, replacement)
            else:
                model = replacement
            module = replacement
        home = module.weight.device
        where = target or home
        if where != home:  # only the weight visits the packing device; the bias stays where it is
            module.weight = nn.Parameter(module.weight.detach().to(where), requires_grad=False)
        config = _config_for(tq, module.weight, bits, group_size, where)
        layer = module
        # One layer at a time: filter_fn matches this module only (the root of the traversal).
        tq.quantize_(layer, config, filter_fn=lambda m, _fqn, layer=layer: m is layer)
        if where != home:
            layer.weight = nn.Parameter(_to(layer.weight, home), requires_grad=False)
        done[original] = layer.weight
        formats[type(layer.weight).__name__] = formats.get(type(layer.weight).__name__, 0) + 1
    kept = [n for n, m in model.named_modules() if id(getattr(m, "weight", None)) in skip and not _is_embedding(m)]
    logger.info("quantize_weights: int%d weights in %s; kept in full precision: %s", bits,
                ", ".join(f"{k} layers of {v}" for v, k in sorted(formats.items())) or "no layer",
                ", ".join(kept) or "nothing")
    return model


def quantized_nbytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters as stored (quantized data, scales and zero points; tied
    parameters counted once), for logs and benchmarks."""
    return stored_nbytes(model.parameters())
