"""torch.compile per block: same training as eager at ZeRO 0/2/3, no recompiles, clear errors.

The oracle is single-process torch on the global batch (as for every ZeRO parity test). Tolerance:
relative error < 1e-5 (norm of the difference over the norm) for fp32 parameters after 3 AdamW
steps and for each step's loss: inductor fuses and reorders float operations, so results differ
from eager in the last bits, not more.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from partita.compile import compile_blocks, compile_stats, compiled_blocks
from partita.compile.apply import apply_config
from partita.config import ConfigError, load_config
from tests.harness import run_distributed
from tests.tiny_models import build_block_model, build_model, make_batches, param_groups

LR, CLIP, STEPS, GLOBAL_BATCH, EVAL = 1e-2, 0.5, 3, 8, 4
BUILDERS = {"blocks": build_block_model, "tied": build_model}
BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]


def _config(stage: int, compile_section: dict | None = None, **extra) -> dict:
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 60, "allgather_bucket_size": 50},
        "steps_per_print": 1000,
        **extra,
    }
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if compile_section is not None:
        cfg["compile"] = compile_section
    return cfg


def reference(model_name: str) -> tuple[dict[str, torch.Tensor], list[float], float]:
    """Single-process eager torch AdamW with global-norm clipping: final parameters, losses, and an
    eval loss of the trained model."""
    model = BUILDERS[model_name]()
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in param_groups(model)]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(xs[step], ys[step])
        loss.backward()
        losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    with torch.no_grad():
        eval_loss = float(model.eval()(xs[0][:EVAL], ys[0][:EVAL]))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses, eval_loss


class CountingBackend:
    """A torch.compile backend that counts the graphs TorchDynamo hands it (then traces with aot_eager)."""

    __name__ = "counting_aot_eager"

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def train_runs(runs: list[tuple[str, dict, dict | None]]) -> list[dict]:
    """Each run: (model name, config, engine.compile kwargs or None). Returns per-run observations."""
    import torch._dynamo
    import torch._inductor.config
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import partita

    torch._inductor.config.compile_threads = 1  # no compile-worker pool per rank on a 2-core machine
    out = []
    for model_name, cfg, engine_compile in runs:
        torch._dynamo.reset()  # every run compiles from scratch: counts below are this run's own
        counters.clear()
        model = BUILDERS[model_name]()
        engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        counting = None
        if engine_compile is not None:
            kwargs = dict(engine_compile)
            if kwargs.pop("backend") == "counting":
                counting = CountingBackend()
            engine.compile(backend=counting or "aot_eager", **kwargs)
            engine.compile(backend=counting or "aot_eager", **kwargs)  # same settings again: no-op
            try:
                engine.compile(backend="eager")
                changed_settings_refused = False
            except ValueError:
                changed_settings_refused = True
        rank, world = dist.get_rank(), dist.get_world_size()
        micro = engine.train_micro_batch_size_per_gpu()
        xs, ys = make_batches(STEPS, GLOBAL_BATCH)
        losses, graphs_per_step, backend_graphs_per_step = [], [], []
        for step in range(STEPS):
            graphs_before = counters["stats"]["unique_graphs"]
            backend_before = counting.graphs if counting else 0
            loss = engine(xs[step][rank * micro : (rank + 1) * micro], ys[step][rank * micro : (rank + 1) * micro])
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()  # the global batch's loss: the mean over ranks
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
            graphs_per_step.append(counters["stats"]["unique_graphs"] - graphs_before)
            backend_graphs_per_step.append((counting.graphs if counting else 0) - backend_before)
        graphs_before = counting.graphs if counting else 0
        with torch.no_grad():  # eval: hooks gather and free around the compiled forward again
            eval_loss = float(engine.eval()(xs[0][:EVAL], ys[0][:EVAL]))
            engine.train()
        gatherer = engine.zero.gatherer
        freed = gatherer is not None and gatherer.num_gathered() == 0 and all(
            p.untyped_storage().nbytes() == 0 for p in model.parameters() if gatherer.is_sharded_param(p)
        )
        out.append({
            "params": engine.get_fp32_state_dict(rank0_only=False),
            "losses": losses,
            "compiled": compiled_blocks(model),
            "is_compiled": engine.is_compiled,
            "graphs_per_step": graphs_per_step,
            "backend_graphs_per_step": backend_graphs_per_step,
            "graph_breaks": sum(counters["graph_break"].values()),
            "recompiles": sum(s.recompiles for s in compile_stats(model).values()),
            "freed": freed,
            "changed_settings_refused": changed_settings_refused if engine_compile is not None else None,
            "eval_loss": eval_loss,
            "eval_backend_graphs": (counting.graphs if counting else 0) - graphs_before,
        })
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _assert_matches_reference(result: dict, model_name: str, where: str) -> None:
    ref_params, ref_losses, ref_eval = reference(model_name)
    for name, want in ref_params.items():
        assert _rel(result["params"][name], want) < 1e-5, (where, name, _rel(result["params"][name], want))
    for got, want in zip(result["losses"], ref_losses):
        assert abs(got - want) / want < 1e-5, (where, got, want)
    assert abs(result["eval_loss"] - ref_eval) / ref_eval < 1e-5, (where, result["eval_loss"], ref_eval)


INDUCTOR = {"enabled": True, "backend": "inductor"}
RUNS = [
    ("blocks", _config(0, INDUCTOR), None),
    ("blocks", _config(2, INDUCTOR), None),
    ("blocks", _config(3, {**INDUCTOR, "fullgraph": True}), None),  # fullgraph: a graph break would raise
    # ZeRO-3 + activation checkpointing: the checkpoint stays eager, the block compiles inside it.
    ("blocks", _config(3, {"enabled": True, "backend": "aot_eager"}, activation_checkpointing={"policy": "every"}),
     None),
    # engine.compile() after initialize (DeepSpeed's call), with a backend that counts graphs.
    ("blocks", _config(3), {"backend": "counting", "compile_kwargs": {"fullgraph": True}}),
    # No repeated blocks: the whole model is one region.
    ("tied", _config(2, {"enabled": True, "backend": "aot_eager"}), None),
]


def test_compiled_training_matches_eager_torch_and_never_recompiles() -> None:
    per_rank = run_distributed(train_runs, 2, RUNS, timeout=300)
    for (model_name, cfg, engine_compile), result in zip(RUNS, per_rank[0]):
        stage = cfg["zero_optimization"]["stage"]
        where = f"{model_name} stage={stage} compile={cfg.get('compile')} engine.compile={engine_compile}"
        _assert_matches_reference(result, model_name, where)
        assert result["is_compiled"], where
        assert result["compiled"] == (BLOCKS if model_name == "blocks" else [""]), where
        # Step 1 builds the graphs (at most one per block: identical blocks share one); later steps none.
        first, *later = result["graphs_per_step"]
        assert 1 <= first <= len(result["compiled"]) and later == [0] * (STEPS - 1), (where, result["graphs_per_step"])
        assert result["graph_breaks"] == 0 and result["recompiles"] == 0, where
        assert result["freed"] == (stage == 3), where  # ZeRO-3 still frees every sharded parameter
        if engine_compile is not None:
            # The backend itself saw each graph once: 2 (block 1's frozen layer changes its guards).
            assert result["backend_graphs_per_step"] == [2, 0, 0], (where, result["backend_graphs_per_step"])
            assert result["eval_backend_graphs"] == 2, where  # no_grad is a new context: compiled once more
            assert result["changed_settings_refused"], where
    for other in per_rank[1:]:  # every rank ends with the same weights
        for a, b in zip(per_rank[0], other):
            assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


# ----------------------------------------------------------------------------- recompiles are visible


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Layer(), Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_recompile_is_logged_with_its_reason() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    model = TwoBlocks()
    assert compile_blocks(model, backend="eager", dynamic=False) == ["blocks.0", "blocks.1"]
    records = _Records()
    logging.getLogger("partita").addHandler(records)
    try:
        model(torch.randn(3, 4)).sum().backward()
        model(torch.randn(3, 4)).sum().backward()
        assert not records.messages and all(s.recompiles == 0 for s in compile_stats(model).values())
        model(torch.randn(5, 4))  # a new batch size with dynamic=False: both blocks recompile
    finally:
        logging.getLogger("partita").removeHandler(records)
    stats = compile_stats(model)
    assert [s.recompiles for s in stats.values()] == [1, 1]
    assert len(records.messages) == 2 and "recompiled block blocks.0 (recompile 1" in records.messages[0]
    # torch's reason, and the limit after which torch gives up compiling
    assert "size mismatch at index 0. expected 3, actual 5" in records.messages[0]
    assert "recompile_limit (8) graphs torch stops compiling it" in records.messages[0]
    # eval / no_grad is a new context: compiling there once is expected, not a recompile
    with torch.no_grad():
        model(torch.randn(5, 4))
    assert [s.recompiles for s in compile_stats(model).values()] == [1, 1]


def test_reaching_the_recompile_limit_is_said() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    model = nn.ModuleList([Layer(), Layer()])  # a ModuleList is its own list of blocks
    compile_blocks(model, backend="eager", dynamic=False)
    records = _Records()
    logging.getLogger("partita").addHandler(records)
    try:
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=2):
            for rows in (1, 2, 3):  # block 0: one graph per shape; the third shape is past the limit
                model[0](torch.randn(rows, 4))
    finally:
        logging.getLogger("partita").removeHandler(records)
    assert compile_stats(model)["0"].graphs == 2 and len(records.messages) == 1
    assert "That is torch._dynamo.config.recompile_limit (2)" in records.messages[0]


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"deepcompile": True}, "partita does not implement. partita compiles each repeated block"),
        ({"enabled": True, "mode": "fast"}, "not one of the choices"),
        ({"backend": "eager"}, "backend only applies when compile.enabled is true"),
        ({"enabled": True, "backend": ""}, "give a torch.compile backend name"),
        ({"enabled": True, "block_types": []}, "give class names"),
        ({"enabled": True, "fulgraph": True}, "did you mean 'fullgraph'"),
        ({"enabled": True, "offload_activation": True}, "It tunes DeepSpeed's DeepCompile"),
        ({"enabled": "yes"}, "wrong type"),
    ],
)
def test_bad_compile_config_is_refused(section: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"compile": section})
    assert expected in str(info.value)


def test_deepspeed_compile_sections_at_their_defaults_are_accepted() -> None:
    cfg = load_config({"compile": {"deepcompile": False, "free_activation": False, "double_buffer": True}})
    assert cfg.compile.enabled is False
    cfg = load_config({"compile": {"enabled": True, "mode": "max-autotune-no-cudagraphs", "dynamic": False}})
    section = cfg.compile
    assert (section.backend, section.mode, section.dynamic) == ("inductor", "max-autotune-no-cudagraphs", False)


class Mixed(nn.Module):
    """No repeated blocks (a ModuleList of two types), so the whole model would be one region."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.layers[1](self.layers[0](x)))


def test_what_does_not_mix_with_zero3_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="not registered with torch.compile"):
        compile_blocks(TwoBlocks(), backend="inductr")
    with pytest.raises(ValueError, match=r"\['fullgrahp'\] are not torch.compile arguments"):
        compile_blocks(TwoBlocks(), fullgrahp=True)
    # CUDA graphs replay fixed parameter addresses; ZeRO-3 reallocates storage at each gather.
    with pytest.raises(NotImplementedError, match="max-autotune-no-cudagraphs"):
        compile_blocks(TwoBlocks(), zero_stage=3, mode="reduce-overhead")
    # Compiling the whole Mixed model would put the ZeRO-3 units layers.0 / layers.1 inside it.
    with pytest.raises(NotImplementedError, match=r"set compile.block_types to \['LayerNorm', 'Linear'\]"):
        compile_blocks(Mixed(), zero_stage=3, backend="eager")
    assert compile_blocks(Mixed(), zero_stage=2, backend="eager") == [""]  # fine without ZeRO-3 hooks
    # The user's own nn.Module.compile() would trace ZeRO-3's hooks: refused even with compile off.
    model = TwoBlocks()
    model.blocks[0].compile(backend="eager")
    with pytest.raises(NotImplementedError, match=r"nn.Module.compile\(\): \['blocks.0'\]"):
        apply_config(model, load_config({}).compile, zero_stage=3)
    assert apply_config(model, load_config({}).compile, zero_stage=2) == []


def test_compiled_blocks_keep_keys_and_identity() -> None:
    model = build_block_model()
    before = list(model.state_dict())
    blocks = list(model.blocks)
    assert compile_blocks(model, backend="eager") == BLOCKS
    assert list(model.state_dict()) == before and list(model.blocks) == blocks
    x, y = make_batches(1, 2)
    assert torch.equal(model(x[0], y[0]), build_block_model()(x[0], y[0]))  # eager backend: bitwise equal
