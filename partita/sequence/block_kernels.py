"""Attention of one query block against one key/value block, returning the log-sum-exp.

Ring attention merges partial results of blocks through their softmax normalisers, so each block
must return ``lse = log(sum_j exp(s_ij))`` beside its output, and its backward must accept the
*merged* output and lse of the whole row (then the block's gradients are exactly its share of the
full attention's gradients: ``P = exp(S - lse)``, ``dS = P * (dP - rowsum(dO * O))``).
``F.scaled_dot_product_attention`` returns neither, so the fused kernels are reached through the
aten ops SDPA itself dispatches to. They exist with these schemas on torch 2.11 and 2.13 (checked
on 2.13's schema and torch's own context-parallel code, which calls the CUDA ones the same way):

- CPU, every float dtype: ``_scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``),
  lse ``(batch, heads, q_len)`` in fp32 for fp32 inputs;
- CUDA, fp16/bf16: ``_scaled_dot_product_flash_attention`` (+ ``_backward``);
- anything else (CUDA fp32, other devices): :func:`math_forward` / :func:`math_backward`, plain
  torch that materialises one block's scores at a time, in query tiles of ``MATH_QUERY_TILE``
  rows so a long block does not hold its whole score matrix.

The causal flag always means the diagonal block (equal query and key lengths, query i sees keys
0..i): ring attention only asks for a causal block when query and keys are the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

aten = torch.ops.aten

MATH_QUERY_TILE = 4096


@dataclass
class BlockKernel:
    """One of the implementations above, picked once per ring call (:func:`pick_kernel`)."""

    name: str  # "cpu_flash", "cuda_flash" or "math"
    # The flash CUDA op returns RNG state and sequence bookkeeping its backward wants back; the
    # first forward call's values serve every block (no dropout, dense inputs).
    extras: tuple[Any, ...] = field(default_factory=tuple)

    def forward(self, q, k, v, *, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in q's dtype, lse in fp32) of q against k, v; tensors are (batch, heads, len, dim)."""
        if self.name == "cpu_flash":
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
            return out, lse.float()
        if self.name == "cuda_flash":
            out, lse, cum_q, cum_k, _max_q, _max_k, seed, offset, _debug = aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=scale
            )
            if not self.extras:
                self.extras = (cum_q, cum_k, seed, offset)
            return out, lse.float()
        return math_forward(q, k, v, causal=causal, scale=scale)

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float):
        """(dq, dk, dv) of this block, given the merged ``out`` and ``lse`` of the rows of ``q``."""
        if self.name == "cpu_flash":
            return aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse.to(torch.float32), 0.0, causal, scale=scale
            )
        if self.name == "cuda_flash":
            cum_q, cum_k, seed, offset = self.extras
            return aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, cum_q, cum_k, q.size(2), k.size(2), 0.0, causal, seed, offset, scale=scale
            )
        return math_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)


def pick_kernel(q: torch.Tensor, *, prefer_math: bool = False) -> BlockKernel:
    """The fused kernel for ``q``'s device and dtype, or the math one (always for ``prefer_math``)."""
    if not prefer_math:
        if q.device.type == "cpu":
            return BlockKernel("cpu_flash")
        if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
            return BlockKernel("cuda_flash")
    return BlockKernel("math")


def _tile_scores(q_tile, k, *, causal: bool, scale: float, row0: int) -> torch.Tensor:
    scores = torch.matmul(q_tile.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(row0, row0 + q_tile.size(-2), device=q_tile.device)[:, None]
        cols = torch.arange(k.size(-2), device=q_tile.device)[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
    return scores


def math_forward(q, k, v, *, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    outs, lses = [], []
    for row0 in range(0, q.size(-2), MATH_QUERY_TILE):
        scores = _tile_scores(q[..., row0 : row0 + MATH_QUERY_TILE, :], k, causal=causal, scale=scale, row0=row0)
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.matmul(torch.exp(scores - lse[..., None]), v.float()).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def math_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    dq = torch.empty_like(q, dtype=torch.float32)
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)
    kf, vf = k.float(), v.float()
    for row0 in range(0, q.size(-2), MATH_QUERY_TILE):
        rows = slice(row0, row0 + MATH_QUERY_TILE)
        q_t, do_t = q[..., rows, :].float(), dout[..., rows, :].float()
        probs = torch.exp(_tile_scores(q_t, k, causal=causal, scale=scale, row0=row0) - lse[..., rows, None].float())
        dv += torch.matmul(probs.transpose(-1, -2), do_t)
        delta = (do_t * out[..., rows, :].float()).sum(-1, keepdim=True)
        dscores = probs * (torch.matmul(do_t, vf.transpose(-1, -2)) - delta)
        dq[..., rows, :] = torch.matmul(dscores, kf) * scale
        dk += torch.matmul(dscores.transpose(-1, -2), q_t) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
