"""Issue 17 item 1, one rank: what partita holds at the memory peak, and that holding less
changes no value.

- each gradient is folded into the fp32 partition as it arrives (reducer [Note: folding on one
  rank]): when the last gradient of a backward arrives, no earlier ``param.grad`` is still alive;
- the partition's first pass copies instead of zero-fill + add (shard_group [Note: first write on
  the device]): unused parameters' ranges are still zero;
- ZeRO-3 keeps no unit whole across the forward's end (param_gatherer [Note: reuse]), but still
  keeps a unit reused inside the forward;
- all of it bitwise equal to the previous rule (fold in ``finish_backward`` from a zeroed partition,
  keep units for the backward), run in the same process.
"""

from __future__ import annotations

import torch

from tests.harness import run_distributed


def _model(twice: bool = False):
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=16))
    if twice:  # block 0 runs twice in every forward: a unit reused inside the forward
        model.blocks[0] = _Twice(model.blocks[0])
    return model


class _Twice(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.inner = torch.nn.ModuleList([block])  # a ModuleList child: its own ZeRO-3 unit
        object.__setattr__(self, "mlp", block.mlp)  # GPT.forward reads block.mlp (not registered twice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner[0](self.inner[0](x))


def _train(stage: int, *, legacy: bool, twice: bool = False, gas: int = 1) -> dict:
    import partita
    from partita.zero import reducer as reducer_module
    from partita.zero import shard_group

    model = _model(twice)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "bf16": {"enabled": True},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 20},
           "steps_per_print": 10**6}
    engine, _, _, _ = partita.initialize(model=model, config=cfg)
    reducer, groups = engine.zero.reducer, engine.optimizer.groups
    restore = []
    if legacy:
        # The previous rule: leave gradients in param.grad and fold them at the end of backward
        # into a zero-filled partition; keep units across the forward's end (set after step 1).
        reducer.remove_hooks()
        original_hook = reducer._on_grad_ready
        legacy_hook = lambda p: original_hook(p) if not reducer._armed else None  # noqa: E731
        reducer._hooks = [p.register_post_accumulate_grad_hook(legacy_hook) for p in reducer._bucket_of]
        for group in groups:
            group._write_on_device = lambda start, reduced, g=group: g.ensure_grad_partition()[
                start : start + reduced.numel()].add_(reduced)
    alive_at_last: list[int] = []
    params = [p for p in model.parameters() if p.requires_grad]
    last = params[0]  # tok_emb: tied, its gradient is the last of a backward

    def at_last_hook(p):
        alive_at_last.append(sum(q.grad is not None for q in params if q is not last))

    hook = last.register_post_accumulate_grad_hook(at_last_hook)
    g = torch.Generator().manual_seed(1)
    losses = []
    for micro in range(3 * gas):
        x = torch.randint(0, 37, (2, 8), generator=g)
        loss = engine(x, x)[1]
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if legacy and micro == 0 and engine.zero.gatherer is not None:
            trace = engine.zero.gatherer.trace  # ready now: no reuse crosses into the backward
            trace.reused_in_backward = [False] * len(trace.reused_in_backward)
    hook.remove()
    kept = engine.zero.gatherer.kept_count if engine.zero.gatherer is not None else None
    return {
        "masters": [grp.master.clone() for grp in groups],
        "states": [{k: v.clone() for k, v in st.items() if torch.is_tensor(v)} for st in engine.optimizer.inner.state.values()],
        "losses": losses, "alive_at_last": alive_at_last, "kept": kept,
    }


def run_cases() -> dict:
    out = {}
    for stage in (1, 2, 3):
        for gas in (1, 2):
            out[(stage, gas)] = (_train(stage, legacy=False, gas=gas), _train(stage, legacy=True, gas=gas))
    out["twice"] = (_train(3, legacy=False, twice=True), _train(3, legacy=True, twice=True))
    return out


def test_one_rank_folds_early_keeps_no_unit_and_changes_no_value() -> None:
    results = run_distributed(run_cases, 1, timeout=300)[0]
    for case, (new, old) in results.items():
        assert new["losses"] == old["losses"], case
        for a, b in zip(new["masters"], old["masters"]):
            assert torch.equal(a, b), case
        for a, b in zip(new["states"], old["states"]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), case
        # The last (reducing) backward: every other gradient was folded and freed before the last.
        assert new["alive_at_last"][-1] == 0, case
        assert old["alive_at_last"][-1] > 0, case
    # ZeRO-3 at world 1: nothing kept for the backward (old rule: every block), but block 0's
    # reuse inside the forward still is (once per forward after the first step).
    assert results[(3, 1)][0]["kept"] == 0 and results[(3, 1)][1]["kept"] > 0
    assert results["twice"][0]["kept"] == 2
