"""Activation memory of partita's reference GPT (partita/models/gpt.py) for one micro-batch.

What is counted: the tensors autograd keeps from the forward for the backward (each storage
once), plus the logits the model returns (the training loop holds them until backward),
plus two transients of the backward. The model runs in the compute dtype (partita casts the
model; no autocast), so activations are ``d`` bytes per element (4 fp32, 2 bf16/fp16).
Symbols: ``b`` micro-batch, ``s`` sequence length, ``h`` d_model, ``a`` heads, ``V``
vocabulary, ``L`` layers.

Per block, without checkpointing (Korthikanti et al. 2022 count ``34sbh + 5as^2b`` bytes in
16-bit with dropout masks; for this model it is ``32sbh`` plus small fp32 terms):

==========================================  ==============
saved for backward                          elements (d B)
==========================================  ==============
block input ``x`` (ln_1 input)              ``bsh``
ln_1 output (qkv input)                     ``bsh``
qkv output; q, k, v are views of it (SDPA)  ``3bsh``
SDPA output (also proj's input, see below)  ``bsh``
residual after attention (ln_2 input)       ``bsh``
ln_2 output (fc input)                      ``bsh``
fc output (GELU input)                      ``4bsh``
GELU output (mlp proj input)                ``4bsh``
==========================================  ==============

= ``16bsh`` elements (``32bsh`` bytes in bf16), plus fp32 LayerNorm mean and rstd (``2 x 2 x
bs x 4`` bytes on CUDA) and the fp32 log-sum-exp of attention (``bas x 4``). The attention
kernels write their output in ``(b, s, heads, head_dim)`` memory order, so the model's
``transpose(1, 2).contiguous()`` is a no-op and the projection saves the SDPA output's own
storage (measured: one ``bsh`` tensor, not two). There is no
``5as^2b`` term: ``F.scaled_dot_product_attention`` runs a flash / memory-efficient kernel
that recomputes the attention matrix in backward. With dropout > 0 each block adds two
1-byte masks (after attention and after the MLP, ``2bsh`` bytes) and attention dropout is
replayed from the RNG state (flash kernels; CPU falls back to a math kernel that stores
``s^2``, which this formula does not describe). The residual adds save nothing.

Checkpointing (partita.activation_checkpointing): a checkpointed block keeps its input
(``bsh``); ``selective`` also keeps the outputs of the matmuls and of attention (qkv
``3bsh``, SDPA output ``bsh`` + log-sum-exp, both projections ``2bsh``, fc ``4bsh``; SDPA is
recomputed when its dropout is on) = ``11bsh``; ``every_k:K`` checkpoints ``L // K``
blocks. In backward one checkpointed block at a time is recomputed in full.

Around the blocks: token ids and targets (int64, ``2bs x 8``) and positions (``s x 8``);
final LayerNorm input and output (``2bsh``) + stats; the fp32 log-probabilities of the loss
(``bsV x 4``; ``logits.float()`` saves nothing). The logits returned to the caller add
``bsV x d`` while the caller holds them (``logits, loss = engine(x, y)`` keeps them through
backward; a caller that keeps only the loss frees them, and the peak is that much lower). At the start of backward the gradients of the log-probabilities and of the
fp32 logits (``2 x bsV x 4``) exist together with everything above.

Sequence tiling (``sequence_tiling``, partita/sequence/tiling.py): with ``mlp_tile_tokens`` each
MLP saves only its input, so a block keeps ``8bsh`` elements instead of ``16bsh`` (and one dropout
mask instead of two); backward rebuilds one tile's fc and GELU outputs at a time (``3 x tile x 4h``
elements with their gradients) and sums the MLP's weight gradients in fp32 (``4 x 8h^2`` bytes).
With ``loss_tile_tokens`` the head keeps each token's fp32 log-sum-exp (``4bs`` bytes) instead of
the ``bsV`` fp32 log-probabilities, returns no logits, and its backward holds one tile's fp32
probabilities and their cast (``tile x V x (4 + d)``), the fp32 head-weight accumulator (``4Vh``)
and the hidden states' gradient (``bsh x d``). Selective checkpointing with a tiled MLP is not
modelled (refused).

Validated against saved-tensor bytes measured on CPU in tests/test_estimate_activations.py and
tests/test_estimate_frozen_tiling.py (tiled).
"""

from __future__ import annotations

from dataclasses import dataclass

from partita.estimate.inputs import EstimateError, GPTShape, Setup
from partita.estimate.result import BACKWARD, END_BACKWARD, START_BACKWARD, Line

__all__ = ["GPTActivations", "gpt_activations", "gpt_activation_lines", "SAVED_KINDS"]

_SAVED = frozenset({START_BACKWARD, BACKWARD})
SAVED_KINDS = ("block_activations", "embeddings", "head")
"""Line kinds that are tensors saved for backward (what saved-tensor hooks measure)."""


@dataclass(frozen=True)
class GPTActivations:
    """Bytes per piece for one micro-batch (the module docstring says what each counts).

    ``blocks[j]``: what block ``j`` keeps through the forward under the checkpointing
    policy; ``recompute[j]``: what its recomputation adds in backward (0 when not
    checkpointed); ``offloaded[j]``: the part of ``blocks[j]`` kept in CPU memory.
    """

    blocks: tuple[int, ...]
    recompute: tuple[int, ...]
    offloaded: tuple[int, ...]
    block_full: int
    embeddings: int
    final_norm: int
    log_probs: int
    logits: int
    loss_grads: int
    mlp_tile: int = 0  # sequence tiling: one MLP tile rebuilt in backward (0 untiled)

    @property
    def head(self) -> int:
        """Freed by the backward of the loss, the LM head and the final LayerNorm."""
        return self.final_norm + self.log_probs


def gpt_activations(shape: GPTShape, setup: Setup) -> GPTActivations:
    """The activation pieces of partita's GPT for ``setup`` (micro-batch, seq_len, dtype, policy)."""
    if setup.seq_len is not None and setup.seq_len > shape.seq_len:
        raise EstimateError(
            f"seq_len {setup.seq_len} is longer than the GPT's seq_len (block size) {shape.seq_len}; "
            f"the model cannot run it: raise the shape's seq_len or lower the training seq_len"
        )
    b, s = setup.micro_batch, setup.seq_len or shape.seq_len
    h, a, v, d = shape.d_model, shape.n_heads, shape.vocab, setup.dtype_bytes
    dropout = shape.dropout > 0.0
    bsh = b * s * h
    ln_stats = 2 * b * s * 4  # mean + rstd, fp32
    lse = b * a * s * 4
    mlp_tiled = setup.mlp_tile_tokens is not None
    # A tiled MLP saves only its input (the ln_2 output, counted anyway): not the fc and GELU
    # outputs (8bsh) nor its dropout mask (bsh), which the tiles rebuild in backward.
    elements = 8 if mlp_tiled else 16
    masks = (1 if mlp_tiled else 2) * bsh if dropout else 0
    full = elements * bsh * d + 2 * ln_stats + lse + masks
    block_input = bsh * d
    # Selective: input + qkv (3) + both projections (2) + fc (4) [+ SDPA output (1) and its
    # log-sum-exp, unless attention dropout makes SDPA random and hence recomputed].
    selective = 10 * bsh * d + (0 if dropout else bsh * d + lse)
    policy, k = setup.checkpointing.policy, setup.checkpointing.k
    blocks, recompute, offloaded = [], [], []
    for j in range(shape.n_layers):
        checkpointed = policy in ("every", "selective") or (policy == "every_k" and (j + 1) % k == 0)
        kept = selective if policy == "selective" else block_input
        blocks.append(kept if checkpointed else full)
        # Recompute rebuilds the block in full; with CPU checkpointing its input comes back too.
        recompute.append(full - kept + (block_input if setup.cpu_checkpointing else 0) if checkpointed else 0)
        offloaded.append(block_input if checkpointed and setup.cpu_checkpointing else 0)
    tokens = b * s
    loss_tile = setup.loss_tile_tokens
    if loss_tile is None:
        log_probs, logits, loss_grads = tokens * v * 4, tokens * v * d, 2 * tokens * v * 4
    else:
        # tiled_cross_entropy: each token's fp32 log-sum-exp is kept, never the logits; its backward
        # holds one tile's fp32 probabilities and their cast, the fp32 head-weight gradient
        # accumulator and the hidden states' gradient.
        tile = min(loss_tile, tokens)
        log_probs, logits, loss_grads = tokens * 4, 0, tile * v * (4 + d) + 4 * v * h + bsh * d
    mlp_tile = 0
    if mlp_tiled:
        # One tile's fc and GELU outputs and their gradients rebuilt in backward, plus the fp32 sums of
        # the MLP's weight gradients over the tiles (partita/sequence/tiling.py, _TiledTokenwise).
        tile = min(setup.mlp_tile_tokens, tokens)
        mlp_tile = 3 * tile * 4 * h * d + 4 * (8 * h * h + 5 * h)
    return GPTActivations(
        blocks=tuple(blocks), recompute=tuple(recompute), offloaded=tuple(offloaded), block_full=full,
        embeddings=2 * b * s * 8 + s * 8 + (bsh if dropout else 0),
        final_norm=2 * bsh * d + ln_stats,
        log_probs=log_probs,
        logits=logits,
        loss_grads=loss_grads,
        mlp_tile=mlp_tile,
    )


def gpt_activation_lines(shape: GPTShape, setup: Setup) -> list[Line]:
    """Activation lines (accelerator, or CPU for offloaded checkpoint inputs) of one micro-batch."""
    c = gpt_activations(shape, setup)
    layers = shape.n_layers
    checkpointed = sum(1 for r in c.recompute if r)
    policy = "" if not checkpointed else f", {checkpointed} checkpointed ({setup.checkpointing})"
    on_device = sum(c.blocks) - sum(c.offloaded)
    lines = [Line("activations", f"{layers} blocks{policy}", "accelerator", on_device, _SAVED, exact=False,
                  kind="block_activations")]
    if sum(c.offloaded):
        lines.append(Line("activations", "checkpointed block inputs (cpu_checkpointing)", "cpu", sum(c.offloaded),
                          _SAVED, exact=False, kind="block_activations"))
    if checkpointed:
        lines.append(Line("activations", "one block recomputed in backward", "accelerator", max(c.recompute),
                          frozenset({BACKWARD}), exact=False, kind="recompute"))
    if c.mlp_tile:
        lines.append(Line("activations", f"one MLP tile of {setup.mlp_tile_tokens} tokens rebuilt in backward",
                          "accelerator", c.mlp_tile, frozenset({BACKWARD}), exact=False, kind="mlp_tile"))
    head = "final LayerNorm + fp32 log-probabilities (loss)" if setup.loss_tile_tokens is None else \
        f"final LayerNorm + fp32 log-sum-exp per token (loss tiled by {setup.loss_tile_tokens})"
    grads = "cross-entropy gradients, fp32" if setup.loss_tile_tokens is None else \
        "tiled loss backward: one tile's probabilities, fp32 head-weight sum, hidden gradient"
    out = lines + [
        Line("activations", "token ids, targets, positions, embedding", "accelerator", c.embeddings, _SAVED,
             exact=False, kind="embeddings"),
        Line("activations", head, "accelerator", c.head, _SAVED, exact=False, kind="head"),
        Line("activations", f"{setup.dtype} logits returned to the caller", "accelerator", c.logits,
             frozenset({START_BACKWARD, BACKWARD, END_BACKWARD}), exact=False, kind="logits",
             note="while the caller holds them"),
        Line("activations", grads, "accelerator", c.loss_grads, frozenset({START_BACKWARD}), exact=False,
             kind="loss_grads"),
    ]
    return [line for line in out if line.nbytes or line.kind != "logits"]  # tiled loss: no logits
