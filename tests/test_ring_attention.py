"""Ring attention on 2 and 4 gloo ranks equals single-process full attention, forward and backward.

Every rank builds the same full q, k, v (one seed), runs the ring on its shard (balanced or
contiguous layout) and compares its output rows and its shard of dq, dk, dv with plain SDPA on
the whole sequence, in fp32 within 1e-5, for causal and non-causal attention and for both the
fused (aten) and the plain-torch block kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from partita.sequence.block_kernels import math_backward, math_forward
from partita.sequence.sharding import shard_sequence
from tests.harness import run_distributed

CASES = [
    # (causal, layout, prefer_math)
    (True, "balanced", False),
    (True, "balanced", True),
    (True, "contiguous", False),
    (False, "contiguous", False),
    (False, "balanced", True),
]


def _full(seed: int, shape: tuple[int, ...]):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    grad_out = torch.randn(shape, generator=gen)
    return q, k, v, grad_out


def _ring_vs_full() -> list[tuple]:
    import torch.distributed as dist

    from partita.sequence.ring import ring_attention

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size)))
    errors = []
    for index, (causal, layout, prefer_math) in enumerate(CASES):
        shape = (2, 3, 8 * size, 8)  # batch 2, 3 heads (fewer than 4 ranks: no head limit), head dim 8
        q, k, v, grad_out = _full(index, shape)
        ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*ref_inputs, is_causal=causal)
        ref.backward(grad_out)

        def shard(t: torch.Tensor) -> torch.Tensor:
            return shard_sequence(t, dim=2, rank=rank, size=size, layout=layout)

        local = [shard(t).clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, group=group, causal=causal, layout=layout, prefer_math=prefer_math)
        out.backward(shard(grad_out))
        diffs = [(out - shard(ref)).abs().max().item()]
        diffs += [(mine.grad - shard(full.grad)).abs().max().item() for mine, full in zip(local, ref_inputs)]
        errors.append((causal, layout, prefer_math, diffs))
    return errors


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_equals_full_attention(world_size: int) -> None:
    for rank_errors in run_distributed(_ring_vs_full, world_size):
        for causal, layout, prefer_math, diffs in rank_errors:
            assert max(diffs) < 1e-5, (world_size, causal, layout, prefer_math, diffs)


def test_math_block_kernel_matches_sdpa_and_autograd() -> None:
    """The plain-torch kernel (CUDA fp32 and other devices) in query tiles: output, lse and grads."""
    import partita.sequence.block_kernels as kernels

    q, k, v, grad_out = _full(7, (1, 2, 12, 4))
    old_tile = kernels.MATH_QUERY_TILE
    kernels.MATH_QUERY_TILE = 5  # several uneven tiles
    try:
        for causal in (True, False):
            out, lse = math_forward(q, k, v, causal=causal, scale=0.5)
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*inputs, is_causal=causal, scale=0.5)
            ref.backward(grad_out)
            scores = (q @ k.transpose(-1, -2)) * 0.5
            if causal:
                scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
            assert torch.allclose(out, ref, atol=1e-6)
            assert torch.allclose(lse, scores.logsumexp(-1), atol=1e-6)
            grads = math_backward(grad_out, q, k, v, out, lse, causal=causal, scale=0.5)
            for mine, full in zip(grads, inputs):
                assert torch.allclose(mine, full.grad, atol=1e-5)
    finally:
        kernels.MATH_QUERY_TILE = old_tile


def test_ring_attention_bad_inputs() -> None:
    """Shapes are checked before any communication, so no process group is needed."""
    from partita.sequence.ring import ring_attention

    q = torch.zeros(1, 2, 4, 4)
    with pytest.raises(ValueError, match=r"local length 3 is odd.*2 x sequence_parallel_size"):
        odd = torch.zeros(1, 2, 3, 4)
        ring_attention(odd, odd, odd, group=None, causal=True, layout="balanced")
    with pytest.raises(ValueError, match=r"shape \(2, 3, 4\); expected \(batch, heads, local_len, head_dim\)"):
        flat = torch.zeros(2, 3, 4)
        ring_attention(flat, flat, flat, group=None)
    with pytest.raises(ValueError, match=r"layout='zigzag'\): choose one of \['contiguous', 'balanced'\]"):
        ring_attention(q, q, q, group=None, layout="zigzag")
    with pytest.raises(ValueError, match=r"must agree in batch, heads and local length.*repeat grouped"):
        ring_attention(q, torch.zeros(1, 1, 4, 4), q, group=None)
