"""Sequence parallelism on gloo ranks equals single-process torch.

- ``DistributedAttention`` (Ulysses) at sequence size 2 and 4, both DeepSpeed layouts, causal and
  not: output and q/k/v gradients equal plain SDPA on the whole sequence (fp32, 1e-5).
- The reference GPT through ``partita.initialize`` with ``sequence_parallel_size`` 2 (world 2) and
  2 x data 2 (world 4), ZeRO stages 0-3, Ulysses and ring: parameters after K steps equal torch's
  AdamW on the same global batch, where a quarter of the targets are ignored (-100) at the end of
  every sequence, so sequence ranks hold unequal numbers of valid tokens and a mean of per-rank
  means would be wrong.
- Every bad input: its error type and message.

One spawned run per world size does all of it, to keep CI time low.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed

LR = 1e-2
CLIP = 0.5
STEPS = 2
GLOBAL_BATCH = 4
SEQ = 16


def _gpt_config():
    from partita.models.gpt import GPTConfig

    # No biases: the key bias's gradient is zero in exact arithmetic (softmax ignores a shift of every
    # score of a row), so Adam would turn its rounding noise into full-size, order-dependent updates.
    return GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32, bias=False)


def _build_gpt(config=None):
    from partita.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(config or _gpt_config())


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 64, (STEPS, GLOBAL_BATCH, SEQ), generator=gen)
    y = torch.randint(0, 64, (STEPS, GLOBAL_BATCH, SEQ), generator=gen)
    y[..., -SEQ // 4 :] = -100  # the last quarter of every sequence is not trained on
    return x, y


def _optimizer_config() -> dict:
    return {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}}


def _reference() -> dict[str, torch.Tensor]:
    model = _build_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    xs, ys = _batches()
    for step in range(STEPS):
        _, loss = model(xs[step], ys[step])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _attention_checks(group, size: int, rank: int) -> list[tuple]:
    from partita.sequence.layer import DistributedAttention
    from partita.sequence.sharding import shard_sequence

    results = []
    for batch_dim_idx in (0, 1):
        for causal in (True, False):
            gen = torch.Generator().manual_seed(10 * batch_dim_idx + causal)
            shape = (2, 8 * size, 4, 8)  # [batch, seq, heads, head_dim]
            q, k, v, grad_out = (torch.randn(shape, generator=gen) for _ in range(4))
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in full), is_causal=causal).transpose(1, 2)
            ref.backward(grad_out)

            def to_layout(t: torch.Tensor) -> torch.Tensor:  # [b, s, ...] -> the layout under test
                return t if batch_dim_idx == 0 else t.transpose(0, 1).contiguous()

            def local(t: torch.Tensor) -> torch.Tensor:
                return shard_sequence(to_layout(t), dim=1 - batch_dim_idx, rank=rank, size=size, layout="contiguous")

            def sdpa(q_, k_, v_):  # DeepSpeed-style local attention on [.., seq, heads, dim] tensors
                perm = (0, 2, 1, 3) if batch_dim_idx == 0 else (1, 2, 0, 3)
                inv = (0, 2, 1, 3) if batch_dim_idx == 0 else (2, 0, 1, 3)
                out = F.scaled_dot_product_attention(*(t.permute(perm) for t in (q_, k_, v_)), is_causal=causal)
                return out.permute(inv)

            inputs = [local(t).clone().requires_grad_() for t in (q, k, v)]
            out = DistributedAttention(sdpa, group)(*inputs, batch_dim_idx)
            out.backward(local(grad_out))
            diffs = [(out - local(ref.detach())).abs().max().item()]
            diffs += [(mine.grad - local(whole.grad)).abs().max().item() for mine, whole in zip(inputs, full)]
            results.append((batch_dim_idx, causal, diffs))
    return results


def _train(cfg: dict, data_rank: int, data_size: int) -> dict[str, torch.Tensor]:
    import partita

    model = _build_gpt()
    engine, _, _, _ = partita.initialize(model=model, config=cfg)
    assert engine.topology.data_rank == data_rank and engine.topology.data_size == data_size
    micro = GLOBAL_BATCH // data_size
    xs, ys = _batches()
    for step in range(STEPS):
        rows = slice(data_rank * micro, (data_rank + 1) * micro)
        _, loss = engine(xs[step][rows], ys[step][rows])  # whole sequences: the model cuts them
        engine.backward(loss)
        engine.step()
    engine.finish_pending_step()
    from partita.zero.gathered import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _error(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the test checks the type
        return type(error).__name__, str(error)
    return None


def _errors(sp: int) -> dict[str, tuple[str, str] | None]:
    import partita
    from partita.models.gpt import GPT, GPTConfig

    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": _optimizer_config(), "sequence_parallel_size": sp}

    def heads():
        partita.initialize(model=GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=3, n_embd=24)), config=base)

    def length():
        engine, *_ = partita.initialize(model=_build_gpt(), config=base)
        engine(torch.zeros(1, SEQ + 1, dtype=torch.long), torch.zeros(1, SEQ + 1, dtype=torch.long))

    def ring_length():
        engine, *_ = partita.initialize(model=_build_gpt(), config={**base, "sequence_parallel": {"mode": "ring"}})
        engine(torch.zeros(1, 2 * sp + sp, dtype=torch.long))

    def other_model():
        partita.initialize(model=torch.nn.Linear(2, 2), config=base)

    def sparse():
        partita.initialize(model=_build_gpt(), config={**base, "sparse_attention": {"mode": "dense"}})

    return {"heads": _error(heads), "length": _error(length), "ring_length": _error(ring_length),
            "other": _error(other_model), "sparse": _error(sparse)}


def _run(world: int, sp: int) -> dict:
    import torch.distributed as dist

    import partita  # noqa: F401

    cases = [(stage, "ulysses") for stage in (0, 1, 2, 3)] + [(3, "ring"), (1, "ring")]
    results: dict = {"train": {}}
    data_size = world // sp
    for stage, mode in cases:
        cfg = {
            "train_batch_size": GLOBAL_BATCH,
            "optimizer": _optimizer_config(),
            "gradient_clipping": CLIP,
            "sequence_parallel_size": sp,
            "sequence_parallel": {"mode": mode},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "allgather_bucket_size": 500},
            "steps_per_print": 1000,
        }
        results["train"][(stage, mode)] = _train(cfg, data_rank=int(os.environ["RANK"]) // sp, data_size=data_size)
    group = dist.new_group(list(range(world)))
    results["attention"] = _attention_checks(group, world, dist.get_rank())
    results["errors"] = _errors(sp)
    return results


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return _reference()


@pytest.fixture(scope="module", params=[(2, 2), (4, 2)], ids=["sp2", "sp2xdp2"])
def run(request) -> tuple[int, int, list[dict]]:
    world, sp = request.param
    return world, sp, run_distributed(_run, world, world, sp, timeout=300)


def test_distributed_attention_equals_full_attention(run) -> None:
    world, _, per_rank = run
    for rank_results in per_rank:
        for batch_dim_idx, causal, diffs in rank_results["attention"]:
            assert max(diffs) < 1e-5, (world, batch_dim_idx, causal, diffs)


def test_gpt_parameters_equal_single_process_torch(run, reference) -> None:
    world, sp, per_rank = run
    for (stage, mode), params in per_rank[0]["train"].items():
        for name, ref in reference.items():
            err = float((params[name] - ref).norm() / ref.norm())
            assert err < 1e-5, f"world {world}, sp {sp}, stage {stage}, {mode}: {name} relative error {err:.2e}"
    for other in per_rank[1:]:  # every rank ends with the same weights
        for key, params in other["train"].items():
            for name in params:
                assert torch.equal(params[name], per_rank[0]["train"][key][name]), (key, name)


def test_bad_inputs(run) -> None:
    _, sp, per_rank = run
    errors = per_rank[0]["errors"]
    kind, message = errors["heads"]
    assert kind == "ValueError"
    assert "3 attention heads over sequence_parallel_size=2" in message and '"ring"' in message
    kind, message = errors["length"]
    assert kind == "ValueError"
    assert f"sequence length {SEQ + 1} is not divisible by {sp}" in message and "pad or cut" in message
    kind, message = errors["ring_length"]
    assert kind == "ValueError" and f"not divisible by {2 * sp}" in message and "load-balanced chunks" in message
    kind, message = errors["other"]
    assert kind == "NotImplementedError" and "Linear has no partita.sequence.layer.DistributedAttention" in message
    kind, message = errors["sparse"]
    assert kind == "NotImplementedError" and f"sparse_attention with sequence_parallel_size={sp}" in message
