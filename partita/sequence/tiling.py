"""Sequence tiling: the LM-head loss and token-wise MLPs computed a tile of tokens at a time.

At long context the largest activations of a GPT are not in attention (flash kernels keep it
O(T)) but in two token-wise places:

- the loss: ``T x vocab`` logits, kept in fp32 for the softmax. GPT-1.3B at 256k tokens and a
  50304 vocabulary: 49 GiB of fp32 logits, plus their bf16 copy and the softmax gradient;
- the MLP: a ``T x 4d`` intermediate, twice (before and after GELU), saved for backward or
  rebuilt at once when the block is recomputed under activation checkpointing.

Both are computed per token, so nothing forces all tokens through them at once.
:func:`tiled_cross_entropy` runs the head and the cross-entropy over ``tile_tokens`` tokens at a
time and keeps only each token's log-sum-exp (4 bytes); backward recomputes each tile's logits
and turns them into that tile's gradients for the hidden states and the head weight.
:func:`tiled_mlp` (and the :class:`TiledMLP` module, :func:`apply_tiled_mlp`) runs a token-wise
module tile by tile without keeping anything but its input, and recomputes one tile at a time in
backward. Only one tile's logits / intermediate exist at any moment. The price is compute:

- tiled loss: one more LM-head matmul (``2 T d V`` FLOPs, a third of the head's training cost;
  about 2 % of a GPT-1.3B step at 2k tokens, less at longer ones where attention dominates);
- tiled MLP: one more MLP forward (``16 T d^2`` FLOPs per block); with the block checkpointed too,
  the MLP's forward runs three times instead of two.

Why partita's own: torch has no tiled or fused linear-cross-entropy and no tiled MLP (torch.nn
and torch.utils offer neither; ``torch.utils.checkpoint`` per tile would accumulate each
parameter's gradient once per tile, firing ZeRO's per-parameter gradient hooks once per tile).
DeepSpeed's ALST (``TiledMLP``, ``TiledFusedLogitsLoss``) and Liger's fused linear
cross-entropy are the prior art; the autograd Functions below are written here so that each
input, parameters included, receives exactly one gradient per call, summed in fp32 over the
tiles, which is what ZeRO's reduction hooks expect.

Exactness: each tile computes what the untiled code computes for those tokens, in the same
dtypes (under autocast, the matmuls in the autocast dtype and the softmax in fp32, as
``F.linear`` then ``logits.float()`` do); only the summation order of the weight gradients over
tiles differs (fp32 accumulation). Dropout inside a tiled MLP draws the same masks in backward
as in forward (the RNG state is replayed, as ``torch.utils.checkpoint`` does).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

__all__ = [
    "IGNORE_INDEX",
    "TiledMLP",
    "apply_tiled_mlp",
    "check_tile_tokens",
    "remove_tiled_mlp",
    "tiled_cross_entropy",
    "tiled_mlp",
]

IGNORE_INDEX = -100  # F.cross_entropy's default: targets equal to it are not tokens of the loss


def check_tile_tokens(value: Any, name: str = "tile_tokens") -> int:
    """``value`` as a tile size, or ValueError naming ``name``, the value and what is allowed."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int (tokens per tile), got {value!r}")
    return value


def _tiles(n: int, tile: int) -> range:
    return range(0, n, tile)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    # What F.linear would compute in here: the autocast dtype when autocast is on for the device.
    device_type = t.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return t.dtype


# ---------------------------------------------------------------------------------------- loss
class _TiledLinearCrossEntropy(torch.autograd.Function):
    """Sum over tokens of ``cross_entropy(hidden @ weight.T, targets)``, one tile at a time.

    Saves hidden, weight, targets and each token's log-sum-exp: never a logits tensor."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, tile: int,
                ignore_index: int) -> torch.Tensor:  # fmt: skip
        n = hidden.size(0)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in _tiles(n, tile):
            h, t = hidden[start : start + tile], targets[start : start + tile]
            logits = torch.mm(h, weight.t()).float()  # the untiled GPT's F.linear, then .float()
            tile_lse = torch.logsumexp(logits, dim=-1)
            valid = t != ignore_index
            target_logit = logits.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
            del logits
            loss_sum += torch.where(valid, tile_lse - target_logit, 0.0).sum()
            lse[start : start + tile] = tile_lse
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.tile, ctx.ignore_index = tile, ignore_index
        return loss_sum

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # fp32 accumulator whatever the weight's dtype: tiles add up without bf16 rounding between them.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        scale = grad_loss.float()
        for start in _tiles(hidden.size(0), ctx.tile):
            h, t = hidden[start : start + ctx.tile], targets[start : start + ctx.tile]
            # d loss / d logits = softmax - onehot(target), zero for ignored tokens, times grad_loss.
            probs = torch.mm(h, weight.t()).float()
            probs.sub_(lse[start : start + ctx.tile].unsqueeze(1)).exp_()
            valid = t != ctx.ignore_index
            probs.scatter_add_(1, torch.where(valid, t, 0).unsqueeze(1), -valid.to(probs.dtype).unsqueeze(1))
            probs.mul_((valid.to(probs.dtype) * scale).unsqueeze(1))
            grad_logits = probs.to(hidden.dtype)  # the untiled backward casts here too (logits.float()'s grad)
            del probs
            if need_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[start : start + ctx.tile])
            if need_weight:
                if grad_logits.dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:
                    grad_weight += torch.mm(grad_logits.t(), h).float()
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


@torch.compiler.disable  # a Python loop over tiles: compiled models call it eagerly (a graph break)
def tiled_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tile_tokens: int,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy((hidden @ weight.T).float(), targets)`` without the logits tensor.

    Args:
        hidden: ``(..., d)`` final hidden states (after the last norm).
        weight: ``(vocab, d)`` the LM head's weight (no bias), e.g. ``model.lm_head.weight``.
        targets: the token ids, ``hidden``'s leading shape; ``ignore_index`` marks tokens left out.
        tile_tokens: tokens per tile; one tile's ``tile_tokens x vocab`` fp32 logits exist at a time.
        reduction: ``"mean"`` (over the tokens not ignored; NaN when there are none, as torch's)
            or ``"sum"`` (for a mean taken elsewhere, e.g. over a sequence-parallel group).

    Returns the fp32 loss. Gradients reach ``hidden`` and ``weight``. Under autocast the matmul
    runs in the autocast dtype, as ``F.linear`` would. Under ZeRO-3 call it where ``weight`` is
    gathered (inside the forward of the module that owns it, or of the model).
    """
    check_tile_tokens(tile_tokens, "tile_tokens")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be \"mean\" or \"sum\", got {reduction!r}")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.size(-1) != weight.size(1):
        raise ValueError(
            f"tiled_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not fit: "
            "expected hidden (..., d) and weight (vocab, d)"
        )
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"tiled_cross_entropy: targets have shape {tuple(targets.shape)}, expected hidden's leading shape "
            f"{tuple(hidden.shape[:-1])}"
        )
    dtype = _compute_dtype(hidden)
    flat_hidden = hidden.reshape(-1, hidden.size(-1)).to(dtype)
    flat_targets = targets.reshape(-1)
    with torch.autocast(hidden.device.type, enabled=False):
        loss_sum = _TiledLinearCrossEntropy.apply(flat_hidden, weight.to(dtype), flat_targets, tile_tokens, ignore_index)
    if reduction == "sum":
        return loss_sum
    return loss_sum / (flat_targets != ignore_index).sum()


# ----------------------------------------------------------------------------------------- MLP
class _AutocastState:
    """The autocast setting of the forward, replayed around the backward's recomputation."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.enabled = torch.is_autocast_enabled(device_type)
        self.dtype = torch.get_autocast_dtype(device_type)

    def __call__(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


class _RngState:
    """CPU and (for a CUDA input) device RNG states, to replay dropout masks in the recomputation."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device

    def fork(self):
        devices = [self.device] if self.cuda is not None else []
        return torch.random.fork_rng(devices=devices)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class _TiledTokenwise(torch.autograd.Function):
    """``function`` applied to the tokens of ``x`` a tile at a time; recomputed per tile in backward.

    ``params`` are the tensors ``function`` reads that need gradients: they are inputs of this
    Function so that autograd gives each exactly one (summed) gradient."""

    @staticmethod
    def forward(ctx: Any, function: Callable[[torch.Tensor], torch.Tensor], tile: int, preserve_rng: bool,
                x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # fmt: skip
        ctx.function, ctx.tile, ctx.params = function, tile, params
        ctx.autocast = _AutocastState(x.device.type)
        ctx.rng = _RngState(x.device) if preserve_rng else None
        flat = x.reshape(-1, x.size(-1))
        out = None
        for start in _tiles(flat.size(0), tile):
            y = function(flat[start : start + tile])
            if y.dim() != 2 or y.size(0) != min(tile, flat.size(0) - start):
                raise ValueError(
                    f"tiled_mlp: the function must map (tokens, d_in) to (tokens, d_out) token by token; a tile of "
                    f"shape {tuple(flat[start : start + tile].shape)} gave {tuple(y.shape)}"
                )
            if out is None:  # one output buffer: no list of tiles to concatenate (2x the output)
                out = y.new_empty(flat.size(0), y.size(1))
            out[start : start + tile] = y
        ctx.save_for_backward(x)
        return out.view(*x.shape[:-1], out.size(-1))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[3]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[4:]) if need]
        params = [ctx.params[i] for i in wanted]
        flat_x = x.reshape(-1, x.size(-1))
        flat_grad = grad_out.reshape(-1, grad_out.size(-1))
        grad_x = torch.empty_like(flat_x) if need_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        rng = ctx.rng.fork() if ctx.rng is not None else contextlib.nullcontext()
        with rng, torch.enable_grad(), ctx.autocast():
            if ctx.rng is not None:
                ctx.rng.restore()
            for index, start in enumerate(_tiles(flat_x.size(0), ctx.tile)):
                tile_x = flat_x[start : start + ctx.tile].detach().requires_grad_(need_x)
                y = ctx.function(tile_x)
                if index == 0:
                    _check_leaves(y, [tile_x, *ctx.params])
                inputs = ([tile_x] if need_x else []) + params
                if not inputs:
                    break
                grads = torch.autograd.grad(y, inputs, flat_grad[start : start + ctx.tile], allow_unused=True)
                if need_x:
                    grad_x[start : start + ctx.tile] = grads[0]
                    grads = grads[1:]
                for i, g in enumerate(grads):
                    if g is None:
                        continue
                    # Summed in fp32 over tiles; one gradient per parameter leaves this Function.
                    sums[i] = g.float() if sums[i] is None else sums[i].add_(g)
        param_grads: list[torch.Tensor | None] = [None] * len(ctx.params)
        for i, total in zip(wanted, sums):
            param_grads[i] = None if total is None else total.to(ctx.params[i].dtype)
        return (None, None, None, grad_x.view_as(x) if need_x else None, *param_grads)


def _check_leaves(output: torch.Tensor, allowed: Sequence[torch.Tensor]) -> None:
    """Refuse a function that reads a trainable tensor not passed in ``params``: its gradient would
    be silently lost (the recomputed graph is not connected to the model's)."""
    known = {id(t) for t in allowed}
    seen, stack, missing = set(), [output.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf that wants a gradient
        if variable is not None and id(variable) not in known:
            missing.append(tuple(variable.shape))
        stack.extend(next_node for next_node, _ in node.next_functions)
    if missing:
        raise ValueError(
            f"tiled_mlp: the function reads trainable tensors of shapes {missing} that are not in params; their "
            "gradients would be lost. Pass every parameter it uses (params=tuple(module.parameters()))"
        )


@torch.compiler.disable  # a Python loop over tiles: compiled models call it eagerly (a graph break)
def tiled_mlp(
    function: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    *,
    tile_tokens: int,
    params: Iterable[torch.Tensor] = (),
    preserve_rng_state: bool = True,
) -> torch.Tensor:
    """``function(x)`` for a token-wise ``function`` (each token's output depends on that token only,
    as an MLP's does), computed ``tile_tokens`` tokens at a time.

    Nothing of ``function``'s internals is kept for backward: only ``x``; backward recomputes one
    tile at a time. ``x`` is ``(..., d_in)``, all leading dims are tokens; the result is
    ``(..., d_out)``. ``params``: every trainable tensor ``function`` reads (an ``nn.Module``'s
    ``parameters()``); a missing one is an error at backward. ``preserve_rng_state``: replay the
    forward's RNG in the recomputation, so dropout masks match (as torch's checkpoint).
    """
    check_tile_tokens(tile_tokens, "tile_tokens")
    if x.dim() < 1:
        raise ValueError("tiled_mlp: x must have a feature dim (..., d_in), got a 0-dim tensor")
    return _TiledTokenwise.apply(function, tile_tokens, preserve_rng_state, x, *tuple(params))


class TiledMLP(nn.Module):
    """Wraps a token-wise module (an MLP) so it runs ``tile_tokens`` tokens at a time.

    DeepSpeed ALST's name. The wrapped module is ``self.mlp``, so its ``state_dict`` keys gain an
    ``mlp.`` prefix; to tile the modules of an existing model in place with unchanged keys use
    :func:`apply_tiled_mlp`."""

    def __init__(self, mlp: nn.Module, tile_tokens: int, *, preserve_rng_state: bool = True) -> None:
        super().__init__()
        self.mlp = mlp
        self.tile_tokens = check_tile_tokens(tile_tokens, "TiledMLP tile_tokens")
        self.preserve_rng_state = preserve_rng_state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_mlp(self.mlp, x, tile_tokens=self.tile_tokens, params=tuple(self.mlp.parameters()),
                         preserve_rng_state=self.preserve_rng_state)  # fmt: skip

    def extra_repr(self) -> str:
        return f"tile_tokens={self.tile_tokens}"


class TiledForward:
    """The instance-level ``forward`` :func:`apply_tiled_mlp` gives a module (its class's
    ``forward``, tiled); the module's identity, class and ``state_dict`` keys are unchanged."""

    def __init__(self, module: nn.Module, tile_tokens: int) -> None:
        self.module = module
        self.inner = module.forward  # the class's forward, bound
        self.tile_tokens = tile_tokens

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_mlp(self.inner, x, tile_tokens=self.tile_tokens, params=tuple(self.module.parameters()))


def apply_tiled_mlp(model: nn.Module, *, tile_tokens: int, module_types: Sequence[type | str]) -> list[str]:
    """Tile every module of ``module_types`` (classes or class names) of ``model`` in place;
    return their names. Each must be token-wise with one tensor input (an MLP); do this before
    activation checkpointing wraps the blocks around them."""
    check_tile_tokens(tile_tokens, "mlp_tile_tokens")
    wanted = tuple(module_types)
    if not wanted:
        raise ValueError("apply_tiled_mlp: module_types is empty; give the MLP's class or class name, e.g. [\"MLP\"]")

    def matches(module: nn.Module) -> bool:
        return any(type(module).__name__ == t if isinstance(t, str) else isinstance(module, t) for t in wanted)

    names = []
    for name, module in model.named_modules():
        if not matches(module):
            continue
        if "forward" in module.__dict__:
            raise ValueError(
                f"apply_tiled_mlp: {name or type(module).__name__} already has an instance-level forward (tiled, "
                "checkpointed or patched); tile the MLPs before activation checkpointing, and only once"
            )
        module.forward = TiledForward(module, tile_tokens)
        names.append(name)
    if not names:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"apply_tiled_mlp: no module of types {[getattr(t, '__name__', t) for t in wanted]} in "
            f"{type(model).__name__}; its module classes are {present}"
        )
    return names


def remove_tiled_mlp(model: nn.Module) -> list[str]:
    """Undo :func:`apply_tiled_mlp`; return the names of the modules restored."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module.__dict__.get("forward"), TiledForward):
            del module.forward
            names.append(name)
    return names
