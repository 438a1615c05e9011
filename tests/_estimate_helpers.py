"""The small GPT whose saved activations tests/test_estimate_activations.py measures, and
tests/test_estimate_model_states.py counts in its one-rank total (model states + activations)."""

from __future__ import annotations

import torch

from partita.estimate import GPTShape

_ACT_SHAPE = GPTShape(d_model=64, n_layers=3, n_heads=4, vocab=256, seq_len=64)
_ACT_BATCH = 4


def _act_model(dtype: torch.dtype, policy: str | None, k: int = 1):
    from partita.activation_checkpointing.apply import apply_activation_checkpointing
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    s = _ACT_SHAPE
    model = GPT(GPTConfig(vocab_size=s.vocab, block_size=s.seq_len, n_layer=s.n_layers, n_head=s.n_heads,
                          n_embd=s.d_model)).to(dtype)
    if policy is not None:
        apply_activation_checkpointing(model, policy=policy, k=k)
    return model


def _batch():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, _ACT_SHAPE.vocab, (_ACT_BATCH, _ACT_SHAPE.seq_len), generator=g),
            torch.randint(0, _ACT_SHAPE.vocab, (_ACT_BATCH, _ACT_SHAPE.seq_len), generator=g))


def saved_tensor_bytes(model, idx, targets) -> int:
    """Distinct storages autograd saves for backward during the forward (parameters excluded).

    Storages are told apart by their StorageImpl (``_cdata``), not their address: at one process
    the blocks' weights are freed during the forward (one_rank_weights.py), so an activation can be
    allocated where a weight was (an address match would skip it), and a weight refilled later
    has a new address (an address match would count it)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in params:
            seen[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, targets)
    return sum(seen.values())
