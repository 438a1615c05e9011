"""Tensor parallelism of the reference GPT on gloo ranks equals single-process torch.

Oracle: the same GPT (same seed) trained by plain torch AdamW + clip_grad_norm_ on the global
batch. Each launch trains one engine per (ZeRO stage, sequence parallelism) in one process
group; whole parameters are rebuilt from the fp32 masters (every rank) and the tensor shards.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed

# SGD, not Adam: the gradient of the key bias is zero in exact arithmetic (softmax ignores a
# shift shared by all keys), so Adam would turn its rounding noise into lr-sized steps that no
# two summation orders share. SGD keeps the comparison about the gradients.
LR = 0.5
CLIP = 0.05  # small enough that clipping is active in every step
STEPS = 3
GLOBAL_BATCH = 4
SEQ = 8


def _gpt(seed: int = 0, dropout: float = 0.0):
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, dropout=dropout))


def _batches():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (STEPS, GLOBAL_BATCH, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=-1)


def _config(stage: int, tensor: int, sequence_parallel: bool, gas: int = 1) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "allgather_bucket_size": 500},
        "tensor_parallel": {"autotp_size": tensor, "sequence_parallel": sequence_parallel},
        "steps_per_print": 1000,
    }


def train_tp(configs: list[dict]) -> list[dict]:
    import partita

    out = []
    for cfg in configs:
        model = _gpt()
        engine, optimizer, _, _ = partita.initialize(model=model, model_parameters=model.optimizer_param_groups(0.1), config=cfg)
        topo = engine.topology
        gas, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
        xs, ys = _batches()
        losses, norms = [], []
        for step in range(STEPS):
            for m in range(gas):
                start = (m * topo.data_size + topo.data_rank) * micro
                _, loss = engine(xs[step][start:start + micro], ys[step][start:start + micro])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            norms.append(engine.get_global_grad_norm())
        whole = whole_params(engine, model)
        out.append({
            "params": whole, "norms": norms, "losses": losses,
            "local_numel": {n: p.numel() for n, p in model.named_parameters()},
            "layout": topo.describe(),
        })
    return out


def whole_params(engine, model) -> dict:
    """Whole fp32 parameters on every rank: the masters, gathered over the tensor axis where the
    export returned a shard."""
    from partita.tensor_parallel.layers import gather_whole, tensor_shard_of

    local = engine.get_fp32_state_dict(rank0_only=False)
    out = {}
    for name, param in model.named_parameters():
        shard = tensor_shard_of(param)
        split = shard is not None and tuple(local[name].shape) != shard.full_shape
        out[name] = gather_whole(local[name], shard) if split else local[name]
    return out


def _reference(gas: int = 1):
    model = _gpt()
    opt = torch.optim.SGD(model.optimizer_param_groups(0.1), lr=LR, momentum=0.9)
    xs, ys = _batches()
    norms, losses = [], []
    for step in range(STEPS):
        opt.zero_grad()
        micro = GLOBAL_BATCH // gas
        for m in range(gas):
            _, loss = model(xs[step][m * micro:(m + 1) * micro], ys[step][m * micro:(m + 1) * micro])
            (loss / gas).backward()
            losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _check(result: dict, ref_params: dict, ref_norms: list, what: str) -> None:
    for name, ref in ref_params.items():
        got = result["params"][name]
        assert got.shape == ref.shape, (what, name, got.shape, ref.shape)
        err = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err < 1e-5, f"{what}: {name} relative error {err:.2e}"
    for got, ref in zip(result["norms"], ref_norms):
        assert abs(got - ref) / ref < 1e-5, (what, got, ref)


CASES = [(stage, sp) for stage in (0, 1, 2, 3) for sp in (False, True)]


@pytest.mark.parametrize("world,tensor", [(2, 2), (4, 2), (4, 4)])
def test_gpt_parity_every_stage_with_and_without_sequence_parallel(world: int, tensor: int) -> None:
    configs = [_config(stage, tensor, sp) for stage, sp in CASES]
    per_rank = run_distributed(train_tp, world, configs, timeout=420)
    ref_params, ref_norms = _reference()
    for (stage, sp), result in zip(CASES, per_rank[0]):
        _check(result, ref_params, ref_norms, f"world {world} tensor {tensor} stage {stage} sp {sp}")
        assert result["layout"] == f"pipe=1 data={world // tensor} sequence=1 tensor={tensor}"
    # The split layers hold 1/tensor of their parameters on each rank (counted).
    full = {n: p.numel() for n, p in _gpt().named_parameters()}
    local = per_rank[0][0]["local_numel"]
    for name in ("tok_emb.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias", "blocks.0.attn.proj.weight",
                 "blocks.1.mlp.fc.weight", "blocks.1.mlp.proj.weight"):
        assert local[name] * tensor == full[name], name
    for name in ("pos_emb.weight", "blocks.0.ln_1.weight", "blocks.0.attn.proj.bias", "ln_f.bias"):
        assert local[name] == full[name], name
    # Every rank ends with the same whole model.
    for other in per_rank[1:]:
        for a, b in zip(per_rank[0], other):
            for name in a["params"]:
                assert torch.equal(a["params"][name], b["params"][name]), name
