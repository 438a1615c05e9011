"""partita's MoE has DeepSpeed 0.19.8's module layout: the same module tree, parameter and
state_dict names and shapes (recorded from DeepSpeed by tests/fixtures/make_moe_layout_deepspeed.py),
DeepSpeed's state dicts load and give DeepSpeed's outputs; each ``deepspeed_experts[j]`` is a real
instance of the user's class whose parameters are rows of one stacked storage."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from partita.moe import ExpertList, ExpertMLP, MoE
from partita.moe.stacked import rows_view
from tests.fixtures.moe_layout_experts import CONFIGS, HIDDEN, GatedExpert, make_expert

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "moe_layout_deepspeed.pt")
ANSWERS = torch.load(FIXTURE, weights_only=True)
CONTAINER = "deepspeed_moe.experts.deepspeed_experts"


def _build(name: str) -> MoE:
    kind, kwargs, _ = CONFIGS[name]
    torch.manual_seed(0)
    return MoE(HIDDEN, make_expert(kind), **kwargs)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_module_tree_parameters_and_state_dict_equal_deepspeeds(name: str) -> None:
    theirs = ANSWERS["configs"][name]
    moe = _build(name)
    ours = [(n, type(m).__name__) for n, m in moe.named_modules()]
    # The one documented difference: the experts' container is an ExpertList, not an nn.ModuleList.
    expected = [(n, "ExpertList" if n == CONTAINER else t) for n, t in theirs["modules"]]
    assert (CONTAINER, "ModuleList") in [tuple(e) for e in theirs["modules"]]
    assert ours == [tuple(e) for e in expected]
    assert [(n, list(p.shape)) for n, p in moe.named_parameters()] == [(n, s) for n, s in theirs["parameters"]]
    assert [(n, list(t.shape)) for n, t in moe.state_dict().items()] == [(n, s) for n, s in theirs["state_dict"]]


@pytest.mark.parametrize("name", sorted(n for n, (_, _, run) in CONFIGS.items() if run))
def test_deepspeed_state_dict_loads_and_gives_deepspeeds_output(name: str) -> None:
    theirs = ANSWERS["configs"][name]
    moe = _build(name)
    moe.load_state_dict(theirs["weights"], strict=True)
    assert moe.experts.is_stacked()  # load_state_dict copies into the rows in place
    moe.eval()
    with torch.no_grad():
        out, l_aux, counts = moe(theirs["input"])
    assert torch.allclose(out, theirs["output"], atol=1e-6, rtol=1e-5), float((out - theirs["output"]).abs().max())
    assert torch.allclose(l_aux, theirs["l_aux"], atol=1e-7)
    assert counts.tolist() == theirs["exp_counts"].tolist()
    state = moe.state_dict()
    assert all(torch.equal(state[k], v) for k, v in theirs["weights"].items())  # saved back under DeepSpeed's keys


def test_experts_are_instances_of_the_users_class_with_rows_of_one_storage() -> None:
    moe = MoE(HIDDEN, GatedExpert(HIDDEN, 12), num_experts=6, ep_size=2, k=1)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    assert isinstance(experts, ExpertList) and len(experts) == 3 and experts[-1] is experts[2]
    assert all(type(e) is GatedExpert for e in experts) and [e for e in experts] == list(experts[0:3])
    with pytest.raises(IndexError, match="this rank holds 3 experts"):
        experts[3]
    for name, param in experts[0].named_parameters():
        rows = [e.get_parameter(name) for e in experts]
        assert all(p.is_leaf and p.requires_grad for p in rows)
        step = rows[0].numel() * rows[0].element_size()
        assert [p.data_ptr() - rows[0].data_ptr() for p in rows] == [j * step for j in range(3)], name
        assert rows_view(rows) is not None and torch.equal(moe.experts.stacked(name), torch.stack(rows))
    # .to() converts each parameter on its own; the experts are stacked again.
    moe.to(torch.float64)
    assert moe.experts.is_stacked() and experts[1].out.weight.dtype == torch.float64


def test_seeding_through_named_modules_reaches_the_stacked_weights() -> None:
    """DeepSpeed client code seeds experts by walking the module tree; the grouped GEMM sees it."""
    moe = MoE(16, ExpertMLP(16, 32), num_experts=4, k=1, drop_tokens=False)
    for name, module in moe.named_modules():
        if name.startswith(CONTAINER + ".") and isinstance(module, nn.Linear):
            j = int(name.split(".")[3])
            nn.init.constant_(module.weight, 0.01 * (j + 1))
            nn.init.zeros_(module.bias)
    stacked = moe.experts.stacked("fc1.weight")
    assert [float(stacked[j, 0, 0]) for j in range(4)] == pytest.approx([0.01, 0.02, 0.03, 0.04])
    assert moe.experts.uses_grouped_mm


def _loop_reference(moe: MoE, x: torch.Tensor):
    """The same layer run expert by expert through each expert's own forward (no stacking)."""
    twin = MoE(16, ExpertMLP(16, 32), num_experts=4, k=2, drop_tokens=moe.drop_tokens, capacity_factor=2.0)
    twin.load_state_dict(moe.state_dict())
    twin.experts._mlp = None
    twin.eval()
    out, _, _ = twin(x)
    out.square().sum().backward()
    return out, dict(twin.named_parameters())


def _interleave(moe: MoE) -> None:
    """Lay the experts' parameters out as ZeRO does when it aliases them to its flat fp32 master
    (stage 0-1, one rank): expert by expert in model order, padded, in one flat tensor."""
    params = list(moe.experts.parameters())
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel() + 3  # odd padding: rows 4-byte but not 16-byte aligned
    flat = torch.zeros(total)
    for p, offset in zip(params, offsets):
        flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
        p.data = flat[offset : offset + p.numel()].view(p.shape)


@pytest.mark.parametrize("drop_tokens", [False, True])
@pytest.mark.parametrize("layout", ["stacked", "separate", "interleaved"])
def test_gradients_reach_each_expert_as_with_its_own_forward(drop_tokens: bool, layout: str) -> None:
    """Grouped (dropless) and batched (capacity) GEMMs over the stacked rows give each expert's
    parameter the gradient its own forward would; also when the rows are separate storages
    (what ZeRO-3 makes of them: the stacked weight is a copy made for the GEMM) or equally spaced
    rows of a larger flat tensor (ZeRO's master aliasing: a strided view, copied for grouped_mm
    where not 16-byte aligned)."""
    torch.manual_seed(3)
    moe = MoE(16, ExpertMLP(16, 32), num_experts=4, k=2, drop_tokens=drop_tokens, capacity_factor=2.0)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_()
    if layout == "separate":
        for p in moe.experts.parameters():
            p.data = p.data.clone()
    elif layout == "interleaved":
        _interleave(moe)
    assert moe.experts.is_stacked() is (layout != "separate")
    moe.eval()
    x = torch.randn(12, 16)
    out, _, _ = moe(x)
    out.square().sum().backward()
    ref_out, ref = _loop_reference(moe, x)
    assert torch.allclose(out, ref_out, atol=1e-5)
    for name, param in moe.named_parameters():
        assert param.grad is not None and param.grad.shape == param.shape, name
        assert torch.allclose(param.grad, ref[name].grad, atol=1e-4, rtol=1e-5), name


def test_experts_forward_is_deepspeeds_chunked_call() -> None:
    """``Experts.forward`` as DeepSpeed's: chunks along dim 1, chunk j through local expert j."""
    moe = MoE(HIDDEN, GatedExpert(HIDDEN, 12), num_experts=3, k=1)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_()
    x = torch.randn(2, 3, 4, HIDDEN)  # (ep, local experts, capacity, hidden)
    out = moe.experts(x)
    expected = torch.cat([e(x[:, j : j + 1])[0] for j, e in enumerate(moe.experts.deepspeed_experts)], dim=1)
    assert torch.equal(out, expected)


def test_a_dropped_layer_is_freed() -> None:
    """The expert registry holds layers weakly (it kept every MoE layer ever built alive)."""
    import gc
    import weakref

    moe = MoE(HIDDEN, make_expert("sequential"), num_experts=4)
    layer, param = weakref.ref(moe), weakref.ref(next(moe.experts.parameters()))
    del moe
    gc.collect()
    assert layer() is None and param() is None
