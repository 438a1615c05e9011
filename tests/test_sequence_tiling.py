"""Sequence tiling (partita.sequence.tiling): the tiled loss and the tiled MLP equal untiled torch.

- ``tiled_cross_entropy`` equals ``F.cross_entropy`` on the full logits, forward and gradients of
  the hidden states and the head weight (fp32, 1e-6 relative), with a tile size that does not
  divide the token count, ignored targets, both reductions; NaN like torch when every target is
  ignored; close under bf16 autocast.
- ``tiled_mlp`` / ``TiledMLP`` equal the dense MLP; with dropout the backward replays the
  forward's masks (the gradients equal an autograd run over the same tiles).
- The reference GPT with ``loss_tile_tokens`` and ``mlp_tile_tokens`` equals the untiled GPT (loss
  and every gradient), alone, under activation checkpointing (every block, selective, with CPU
  offload), and through
  ``partita.initialize`` on 2 gloo ranks with Ulysses and ring sequence parallelism at ZeRO-3 with
  every block checkpointed
  (parameters after two steps equal single-process torch).
- Memory: during a tiled GPT's forward and backward no op produces, and autograd saves, a tensor
  larger than one tile's logits or one tile's MLP intermediate; the untiled GPT does both.
- Bad inputs: their error types and messages.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from partita.models.gpt import GPT, MLP, GPTConfig
from partita.sequence.tiling import TiledMLP, apply_tiled_mlp, remove_tiled_mlp, tiled_cross_entropy, tiled_mlp
from tests.harness import run_distributed

RTOL = 1e-6


def _close(got: torch.Tensor, ref: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    # Relative to the tensor's scale: elementwise relative error is meaningless near zero.
    got, ref = got.detach().double(), ref.detach().double()
    err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.0e}"


# ------------------------------------------------------------------------------------ the loss
def _loss_inputs(ignore: bool = True):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 37, 16, generator=gen, requires_grad=True)  # 111 tokens
    weight = (0.3 * torch.randn(50, 16, generator=gen)).requires_grad_()
    targets = torch.randint(0, 50, (3, 37), generator=gen)
    if ignore:
        targets[0, :9] = -100
        targets[2, -4:] = -100
    return hidden, weight, targets


@pytest.mark.parametrize("tile", [1, 8, 37, 111, 500])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tiled_cross_entropy_equals_full_logits(tile: int, reduction: str) -> None:
    hidden, weight, targets = _loss_inputs()
    ref = F.cross_entropy((hidden @ weight.t()).float().view(-1, 50), targets.view(-1), reduction=reduction)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    got = tiled_cross_entropy(hidden, weight, targets, tile_tokens=tile, reduction=reduction)
    grads = torch.autograd.grad(got, (hidden, weight))
    _close(got, ref, "loss")
    _close(grads[0], ref_grads[0], "hidden grad")
    _close(grads[1], ref_grads[1], "weight grad")
    assert got.dtype == torch.float32


def test_tiled_cross_entropy_all_ignored_is_nan_like_torch() -> None:
    hidden, weight, targets = _loss_inputs()
    targets[:] = -100
    ref = F.cross_entropy((hidden @ weight.t()).view(-1, 50), targets.view(-1))
    got = tiled_cross_entropy(hidden, weight, targets, tile_tokens=10)
    assert torch.isnan(ref) and torch.isnan(got)
    assert float(tiled_cross_entropy(hidden, weight, targets, tile_tokens=10, reduction="sum").detach()) == 0.0


def test_tiled_cross_entropy_bf16_autocast_matches_linear_then_float() -> None:
    hidden, weight, targets = _loss_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(hidden, weight).float().view(-1, 50), targets.view(-1))
        got = tiled_cross_entropy(hidden, weight, targets, tile_tokens=16)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    grads = torch.autograd.grad(got, (hidden, weight))
    _close(got, ref, "bf16 loss", rtol=1e-2)
    for g, r, what in zip(grads, ref_grads, ("hidden", "weight")):
        assert g.dtype == r.dtype
        _close(g, r, f"bf16 {what} grad", rtol=2e-2)


# ------------------------------------------------------------------------------------- the MLP
def _mlp(dropout: float = 0.0) -> MLP:
    torch.manual_seed(1)
    return MLP(GPTConfig(n_embd=16, n_head=2, dropout=dropout))


def _grads(module: torch.nn.Module, x: torch.Tensor, out: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, [x, *module.parameters()], grad))


@pytest.mark.parametrize("tile", [7, 74, 100])
def test_tiled_mlp_equals_dense(tile: int) -> None:
    mlp = _mlp()
    x = torch.randn(2, 37, 16, requires_grad=True)
    grad = torch.randn(2, 37, 16)
    ref = mlp.dense(x)
    ref_grads = _grads(mlp, x, ref, grad)
    for got in (TiledMLP(mlp, tile)(x), tiled_mlp(mlp.dense, x, tile_tokens=tile, params=tuple(mlp.parameters()))):
        _close(got, ref, "output")
        for g, r in zip(_grads(mlp, x, got, grad), ref_grads):
            _close(g, r, "gradient")


def test_tiled_mlp_replays_dropout_masks_in_backward() -> None:
    mlp = _mlp(dropout=0.3)
    x = torch.randn(2, 37, 16, requires_grad=True)
    grad = torch.randn(2, 37, 16)
    torch.manual_seed(7)  # reference: the same tiles, in order, kept by autograd
    flat = x.reshape(-1, 16)
    ref = torch.cat([mlp.dense(flat[s : s + 10]) for s in range(0, 74, 10)]).view(2, 37, 16)
    ref_grads = _grads(mlp, x, ref, grad)
    torch.manual_seed(7)
    got = TiledMLP(mlp, 10)(x)
    after = torch.rand(())  # the backward's replay leaves the generator where the forward left it
    grads = _grads(mlp, x, got, grad)
    _close(got, ref, "output")
    for g, r in zip(grads, ref_grads):
        _close(g, r, "gradient")
    torch.manual_seed(7)
    TiledMLP(mlp, 10)(x)
    assert torch.equal(torch.rand(()), after)
    assert (got == 0).float().mean() > 0.2  # dropout was on


def test_apply_tiled_mlp_in_place_keeps_keys_and_parity() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), _Tokenwise(16), torch.nn.Linear(16, 4))
    keys = list(model.state_dict())
    x = torch.randn(3, 11, 8, requires_grad=True)
    ref_grads = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    assert apply_tiled_mlp(model, tile_tokens=4, module_types=["_Tokenwise"]) == ["1"]
    assert list(model.state_dict()) == keys
    grads = torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()])
    for g, r in zip(grads, ref_grads):
        _close(g, r, "gradient")
    assert remove_tiled_mlp(model) == ["1"] and "forward" not in model[1].__dict__


class _Tokenwise(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, 3 * d)
        self.down = torch.nn.Linear(3 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


# ------------------------------------------------------------------------------ the reference GPT
def _gpt(**tiling) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=200, block_size=40, n_layer=2, n_head=4, n_embd=32, **tiling)
    return GPT(config)


def _gpt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 200, (2, 40), generator=gen)
    targets = torch.randint(0, 200, (2, 40), generator=gen)
    targets[1, -7:] = -100
    return idx, targets


def _gpt_grads(model: GPT) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    idx, targets = _gpt_batch()
    model.zero_grad(set_to_none=True)
    logits, loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [None, "every", "selective", "every+cpu_offload"])
def test_tiled_gpt_equals_untiled(checkpointing: str | None) -> None:
    from partita.activation_checkpointing import apply_activation_checkpointing

    ref_loss, ref = _gpt_grads(_gpt())
    model = _gpt(loss_tile_tokens=11, mlp_tile_tokens=13)  # 80 tokens: neither divides
    if checkpointing:
        policy = checkpointing.split("+")[0]
        apply_activation_checkpointing(model, policy=policy, cpu_offload=checkpointing.endswith("offload"))
    idx, targets = _gpt_batch()
    logits, _ = model(idx, targets)
    assert logits is None  # never built
    loss, grads = _gpt_grads(model)
    _close(loss, ref_loss, "loss")
    for name, r in ref.items():
        _close(grads[name], r, name)
    # Without targets (generation) the logits are returned as usual.
    logits, loss = model(idx)
    assert logits.shape == (2, 40, 200) and loss is None


def test_set_sequence_tiling_turns_tiling_on_and_off() -> None:
    model = _gpt()
    model.set_sequence_tiling(loss_tile_tokens=8, mlp_tile_tokens=8)
    assert model.config.loss_tile_tokens == 8 and all(b.mlp.tile_tokens == 8 for b in model.blocks)
    assert model(*_gpt_batch())[0] is None
    model.set_sequence_tiling(loss_tile_tokens=None, mlp_tile_tokens=None)
    assert model(*_gpt_batch())[0] is not None


# ------------------------------------------------------------------------------------- memory
class _LargestOutputs(TorchDispatchMode):
    """Every op's outputs (forward and backward), by last dim: the most elements seen."""

    def __init__(self, skip_shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.skip = skip_shapes
        self.largest: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and tuple(t.shape) not in self.skip:
                self.largest[t.size(-1)] = max(self.largest.get(t.size(-1), 0), t.numel())
        return out


def _memory_profile(model: GPT) -> tuple[dict[int, int], dict[int, int]]:
    # Parameters, their gradients and transposes are not activations.
    params = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 1 and tuple(t.shape) not in params:
            saved[t.size(-1)] = max(saved.get(t.size(-1), 0), t.numel())
        return t

    idx, targets = _gpt_batch()
    mode = _LargestOutputs(params)
    with mode:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = model(idx, targets)
        loss.backward()
    return mode.largest, saved


def test_tiled_gpt_never_holds_full_logits_or_mlp_intermediate() -> None:
    vocab, hidden4, tokens, loss_tile, mlp_tile = 200, 4 * 32, 80, 11, 13
    largest, saved = _memory_profile(_gpt())
    assert largest[vocab] == tokens * vocab and saved[vocab] == tokens * vocab  # the untiled GPT's logits
    assert largest[hidden4] == tokens * hidden4 and saved[hidden4] == tokens * hidden4
    largest, saved = _memory_profile(_gpt(loss_tile_tokens=loss_tile, mlp_tile_tokens=mlp_tile))
    assert largest[vocab] == loss_tile * vocab, largest  # one tile's logits, in forward and in backward
    assert largest[hidden4] == mlp_tile * hidden4, largest  # one tile's MLP intermediate
    assert vocab not in saved and hidden4 not in saved, saved  # autograd keeps neither


# ----------------------------------------------------------------------------------- bad inputs
def test_bad_tile_sizes() -> None:
    hidden, weight, targets = _loss_inputs()
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"tile_tokens must be a positive int \\(tokens per tile\\), got {bad!r}"):
            tiled_cross_entropy(hidden, weight, targets, tile_tokens=bad)
        with pytest.raises(ValueError, match="tile_tokens must be a positive int"):
            tiled_mlp(lambda t: t, hidden, tile_tokens=bad)
    with pytest.raises(ValueError, match="TiledMLP tile_tokens must be a positive int \\(tokens per tile\\), got 0"):
        TiledMLP(_mlp(), 0)
    with pytest.raises(ValueError, match="GPTConfig.loss_tile_tokens must be a positive int \\(tokens per tile\\) or None, got 0"):
        GPTConfig(loss_tile_tokens=0)
    with pytest.raises(ValueError, match="GPTConfig.mlp_tile_tokens must be a positive int \\(tokens per tile\\) or None, got -1"):
        GPTConfig(mlp_tile_tokens=-1)


def test_bad_shapes_and_arguments() -> None:
    hidden, weight, targets = _loss_inputs()
    with pytest.raises(ValueError, match=r"hidden \(3, 37, 16\) and weight \(50, 8\) do not fit"):
        tiled_cross_entropy(hidden, weight[:, :8], targets, tile_tokens=4)
    with pytest.raises(ValueError, match=r"targets have shape \(3, 36\), expected hidden's leading shape \(3, 37\)"):
        tiled_cross_entropy(hidden, weight, targets[:, 1:], tile_tokens=4)
    with pytest.raises(ValueError, match='reduction must be "mean" or "sum", got \'none\''):
        tiled_cross_entropy(hidden, weight, targets, tile_tokens=4, reduction="none")
    with pytest.raises(ValueError, match=r"token by token; a tile of shape \(4, 16\) gave \(16,\)"):
        tiled_mlp(lambda t: t.sum(0), hidden, tile_tokens=4)
    mlp = _mlp()
    out = tiled_mlp(mlp.dense, torch.randn(5, 16, requires_grad=True), tile_tokens=2, params=(mlp.fc.weight,))
    with pytest.raises(ValueError, match=r"reads trainable tensors of shapes .* that are not in params"):
        out.sum().backward()
    with pytest.raises(ValueError, match=r"no module of types \['Nope'\] in Sequential"):
        apply_tiled_mlp(torch.nn.Sequential(torch.nn.Linear(2, 2)), tile_tokens=2, module_types=["Nope"])
    model = torch.nn.Sequential(_Tokenwise(4))
    apply_tiled_mlp(model, tile_tokens=2, module_types=[_Tokenwise])
    with pytest.raises(ValueError, match="already has an instance-level forward"):
        apply_tiled_mlp(model, tile_tokens=2, module_types=[_Tokenwise])


def test_replaced_loss_without_tiled_form_is_refused() -> None:
    model = _gpt(loss_tile_tokens=8)
    model.lm_loss = torch.nn.CrossEntropyLoss()
    with pytest.raises(NotImplementedError, match="loss_tile_tokens=8 with the loss replaced by CrossEntropyLoss"):
        model(*_gpt_batch())


def test_config_section_validation_and_application() -> None:
    from partita.config import ConfigError, load_config
    from partita.sequence.apply_tiling import apply_sequence_tiling

    base = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(ConfigError, match="sequence_tiling.loss_tile_tokens"):
        load_config({**base, "sequence_tiling": {"loss_tile_tokens": 0}})
    with pytest.raises(ConfigError, match="mlp_module_types only applies with mlp_tile_tokens"):
        load_config({**base, "sequence_tiling": {"mlp_module_types": ["MLP"]}})

    def section(**keys):
        return load_config({**base, "sequence_tiling": keys}).sequence_tiling

    model = _gpt()
    names = apply_sequence_tiling(model, section(loss_tile_tokens=16, mlp_tile_tokens=8))
    assert names == ["blocks.0.mlp", "blocks.1.mlp"] and model.config.loss_tile_tokens == 16
    with pytest.raises(ValueError, match=r"sequence_tiling.mlp_tile_tokens=4 but the model was built with GPTConfig.mlp_tile_tokens=8"):
        apply_sequence_tiling(model, section(mlp_tile_tokens=4))
    with pytest.raises(ValueError, match="the reference GPT's dense MLPs are tiled without it"):
        apply_sequence_tiling(_gpt(), section(mlp_tile_tokens=4, mlp_module_types=["MLP"]))
    other = torch.nn.Sequential(_Tokenwise(4))
    with pytest.raises(ValueError, match="Sequential computes its own, so call partita.sequence.tiling.tiled_cross_entropy"):
        apply_sequence_tiling(other, section(loss_tile_tokens=4))
    with pytest.raises(ValueError, match="name the token-wise modules to tile with sequence_tiling.mlp_module_types"):
        apply_sequence_tiling(other, section(mlp_tile_tokens=4))
    assert apply_sequence_tiling(other, section(mlp_tile_tokens=4, mlp_module_types=["_Tokenwise"])) == ["0"]
    assert apply_sequence_tiling(other, section()) == []
    with pytest.raises(NotImplementedError, match="sequence_tiling with tensor_parallel.autotp_size=2 is not implemented"):
        apply_sequence_tiling(_gpt(), section(mlp_tile_tokens=4), tensor_parallel_size=2)


# ------------------------------------------------------ through initialize, with sequence parallelism
STEPS, SEQ, LR = 2, 16, 1e-2


def _sp_model(**tiling) -> GPT:
    torch.manual_seed(0)  # no biases: see tests/test_sequence_parallel.py
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32, bias=False, **tiling))


def _sp_batches() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 64, (STEPS, 2, SEQ), generator=gen)
    y = torch.randint(0, 64, (STEPS, 2, SEQ), generator=gen)
    y[..., -SEQ // 4 :] = -100  # sequence ranks hold unequal numbers of valid tokens
    return x, y


def _sp_reference() -> dict[str, torch.Tensor]:
    model = _sp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    xs, ys = _sp_batches()
    for step in range(STEPS):
        model(xs[step], ys[step])[1].backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _sp_run() -> dict:
    import partita
    from partita.zero.gathered import GatheredParameters

    out = {}
    for stage, mode in ((3, "ulysses"), (3, "ring")):
        model = _sp_model()
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
            "gradient_clipping": 0.0,
            "sequence_parallel_size": 2,
            "sequence_parallel": {"mode": mode},
            "sequence_tiling": {"loss_tile_tokens": 3, "mlp_tile_tokens": 5},
            "activation_checkpointing": {"policy": "every"},
            "zero_optimization": {"stage": stage},
            "steps_per_print": 1000,
        }
        engine, *_ = partita.initialize(model=model, config=cfg)
        xs, ys = _sp_batches()
        for step in range(STEPS):
            logits, loss = engine(xs[step], ys[step])
            assert logits is None
            engine.backward(loss)
            engine.step()
        engine.finish_pending_step()
        with GatheredParameters(list(model.parameters())):
            out[(stage, mode)] = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return out


def test_tiled_gpt_with_sequence_parallel_equals_single_process_torch() -> None:
    reference = _sp_reference()
    per_rank = run_distributed(_sp_run, 2, timeout=300)
    for key, params in per_rank[0].items():
        for name, ref in reference.items():
            err = float((params[name] - ref).norm() / ref.norm())
            assert err < 1e-5, f"{key}: {name} relative error {err:.2e}"
        for name in params:
            assert torch.equal(params[name], per_rank[1][key][name]), (key, name)
