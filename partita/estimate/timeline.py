"""The reference GPT's backward, block by block: activations freed, gradients reduced.

Summing every line alive "during backward" would count all activations together with the
fp32 gradient partition and three reduce buckets, which never coexist: backward frees a
block's activations as it produces that block's gradients, and partita only allocates the
fp32 partition when its first bucket is retired (``reducer.py``: a bucket is retired once
``_IN_FLIGHT`` newer ones are launched; at world size 1 at the first gradient). So for the GPT
we walk backward the way autograd runs it and take the worst point:

- event 0: the loss, LM head and final LayerNorm: frees the log-probabilities and the final
  norm's activations; the final norm's parameters are ready; the tied token embedding gets
  its first gradient contribution (its ``param.grad`` now exists, but its hook fires only
  after the embedding's own contribution, at the last event);
- event ``i`` (1..L): block ``L - i``: its saved activations are freed (a checkpointed block
  is first recomputed in full), its parameters are ready;
- event L+1: the embeddings: token and position embedding gradients are ready.

After each event: buckets whose parameters are all ready are launched in order, all but the
newest ``_IN_FLIGHT`` are retired into the partition, the next bucket holds what is already
packed. Parameters whose gradient is not ready yet keep gradients held from earlier
micro-batches (stages 0/1 with accumulation). On one process at stages 0-2 the blocks' 16-bit
weights come back from the master one block at a time, just before each block's backward
(``partita/zero/one_rank_weights.py``; with ``one_rank_gradient_fold "end"`` they are freed again
after it). Everything not changing in backward (model states,
ZeRO-3 gathered parameters, ...) is added as it is.
"""

from __future__ import annotations

from partita.estimate.activations import gpt_activations
from partita.estimate.buffers import IN_FLIGHT, bucket_bytes, packs_buckets, reduce_buckets
from partita.estimate.inputs import Setup
from partita.estimate.model_info import ModelInfo
from partita.estimate.model_states import fp32_sums_active, frees_weights_again, holds_grads_across_micro_batches
from partita.estimate.result import BACKWARD, Line

__all__ = ["DYNAMIC_KINDS", "gpt_backward_walk"]

DYNAMIC_KINDS = frozenset({
    "block_activations", "embeddings", "head", "logits", "loss_grads", "recompute",
    "grad_partition", "full_grads", "fp32_sums", "reduce_buckets", "block_params",
})
"""Line kinds whose amount the walk computes itself."""

_TIED_EMBEDDING = "tok_emb.weight"


def gpt_backward_walk(info: ModelInfo, setup: Setup, lines: list[Line]) -> int:
    """Accelerator bytes at the worst point of the GPT's backward (before ``finish_backward``)."""
    shape = info.gpt
    if shape is None:
        raise ValueError("gpt_backward_walk needs a model read from a GPTShape")  # internal misuse
    acts = gpt_activations(shape, setup)
    layers = shape.n_layers
    d = setup.dtype_bytes
    static = sum(
        line.nbytes for line in lines
        if line.device == "accelerator" and BACKWARD in line.phases and line.kind not in DYNAMIC_KINDS
    )
    partition = sum(line.nbytes for line in lines if line.device == "accelerator" and line.kind == "grad_partition")
    refills = any(line.kind == "block_params" for line in lines)  # partita/zero/one_rank_weights.py
    params = list(info.params())
    in_blocks = [p.order for p in params if p.unit >= 1]
    last_block_order = max((p.order for p in params if p.unit >= 1), default=-1)

    def event(unit: int, order: int) -> int:
        if unit >= 1:
            return layers - unit + 1  # unit 1 is block 0, processed last
        return 0 if order > last_block_order else layers + 1  # final norm first, embeddings last

    ready_at = {p.order: event(p.unit, p.order) for p in params}
    numel = {p.order: p.numel for p in params}
    tied = next((p for p in params if p.name == _TIED_EMBEDDING), None)
    trainable = info.trainable_numel
    buckets = reduce_buckets(info, setup) if setup.world_size > 1 else []
    packed = packs_buckets(setup)
    sizes = [bucket_bytes(setup, b) if packed else 0 for b in buckets]
    complete = [max(ready_at[o] for o in b.orders) for b in buckets]
    started = [min(ready_at[o] for o in b.orders) for b in buckets]
    held = holds_grads_across_micro_batches(setup)
    sums = fp32_sums_active(setup)
    one_rank = setup.world_size == 1
    again = frees_weights_again(setup)

    worst = 0
    for e in range(layers + 2):
        remaining = layers if e == 0 else max(0, layers - e)  # blocks whose backward has not run
        saved = sum(acts.blocks[:remaining]) - sum(acts.offloaded[:remaining]) + acts.logits
        saved += acts.embeddings if e <= layers else 0
        recompute = acts.recompute[remaining - 1] if remaining >= 1 else 0
        ready = sum(n for o, n in numel.items() if ready_at[o] <= e)
        waiting = trainable - ready
        grads = (d * waiting if held else 0) + (4 * trainable if sums and one_rank else 4 * waiting if sums else 0)
        at_end = one_rank and setup.fold_gradients_at_end and not held  # every param.grad held, no partition yet
        if at_end:
            grads += d * ready
        if tied is not None and ready_at[tied.order] > e and not held:
            grads += d * tied.numel  # the LM head's contribution, waiting for the embedding's
        launched = 0
        while launched < len(buckets) and complete[launched] <= e:
            launched += 1
        retired = max(0, launched - IN_FLIGHT) if packed else launched
        alive = sum(sizes[retired:launched])
        if launched < len(buckets) and started[launched] <= e:
            alive += sizes[launched]  # the bucket being filled
        has_partition = retired > 0 if packed else launched > 0
        if one_rank:
            has_partition = ready > 0 and not at_end  # allocated by the first gradient folded in
        # Freed block weights: each block's are cast back just before its backward (that of block
        # L - 1 - e, whose recomputation the snapshot holds) and stay; folding at the end, they
        # are freed again once the block's gradients are in (one_rank_weights.py).
        came_back = (lambda o: ready_at[o] == e + 1) if again else (lambda o: ready_at[o] <= e + 1)
        weights = d * sum(numel[o] for o in in_blocks if came_back(o)) if refills else 0
        total = saved + recompute + grads + alive + weights + (partition if has_partition else 0)
        worst = max(worst, total)
    return static + worst
