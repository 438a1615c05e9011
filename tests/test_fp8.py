"""The ``fp8`` section (torchao float8 training): which linears convert, the config's and the
strategy's errors, the numerics against bf16 (torchao's emulation on the CPU, the FP8 kernels on a
GPU that has them), activation checkpointing's recompute, ZeRO 0-3 against single-process torch on
2 gloo ranks, and checkpoints across FP8 on and off."""

from __future__ import annotations

import logging
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from partita.config import ConfigError, load_config
from partita.precision.fp8 import apply_fp8, fp8_linears, select_fp8_linears
from tests.harness import run_distributed

pytest.importorskip("torchao.float8")

VOCAB, WIDTH, HIDDEN, SEQ = 32, 32, 64, 8
LR, STEPS = 1e-2, 3
ONE_RANK = SimpleNamespace(tensor_size=1)
CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class Net(nn.Module):
    """Every linear's dimensions are multiples of 16 (FP8 matmuls need them)."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.proj_in = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(layers)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.proj_in(self.embed(idx))
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(self.norm(h)).float().reshape(-1, VOCAB), targets.reshape(-1))


def build(seed: int = 0, layers: int = 3) -> Net:
    torch.manual_seed(seed)
    return Net(layers)


def fp8_config(**section) -> object:
    return load_config({"train_batch_size": 1, "fp8": {"enabled": True, "emulate": True, **section}})


def convert(model: nn.Module, **section) -> list[str]:
    with pytest.warns(UserWarning, match="fp8 is on without compile"):
        return apply_fp8(model, fp8_config(**section), ONE_RANK, device=CPU)


def batches(world: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = (STEPS, world * micro, SEQ)
    return torch.randint(0, VOCAB, shape, generator=g), torch.randint(0, VOCAB, shape, generator=g)


# ----------------------------------------------------------------------------- which linears convert


def test_auto_filter_uses_torchaos_size_rules_per_recipe() -> None:
    with torch.device("meta"):  # real sizes, no memory
        model = nn.ModuleDict({
            "small": nn.Linear(4096, 1024),  # tensorwise: K <= 4096 and N <= 1024 -> skipped
            "wide": nn.Linear(4096, 2048),  # tensorwise yes; rowwise: N <= 2048 -> skipped
            "square": nn.Linear(4096, 4096),  # both
            "mid": nn.Linear(2048, 4096),  # rowwise: N <= 4096 with K <= 2048 -> skipped
            "odd": nn.Linear(4104, 4100),  # not multiples of 16 -> skipped by both
        })
    assert fp8_config(filter="auto").fp8 == fp8_config().fp8  # "auto" written out is the default
    tensorwise, skipped = select_fp8_linears(model, fp8_config().fp8)
    assert [n for n, _ in tensorwise] == ["wide", "square", "mid"]
    assert sorted(skipped) == ["odd", "small"]
    for recipe in ("rowwise", "rowwise_with_gw_hp"):
        chosen, _ = select_fp8_linears(model, fp8_config(recipe=recipe).fp8)
        assert [n for n, _ in chosen] == ["square"], recipe
    names = convert(model, recipe="rowwise")
    assert names == ["square"] and fp8_linears(model) == ["square"]
    assert type(model["wide"]) is nn.Linear


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_patterns_and_keep_first_last() -> None:
    model = build(layers=4)
    weight = model.blocks[1].up.weight
    logger, handler = logging.getLogger("partita"), _Lines()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)  # on the logger itself: initialize may have turned its propagation off
    try:
        names = convert(model, filter=["*"], keep_first_last_bf16=True)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    # First and last blocks, the embedding-adjacent proj_in and the head stay in high precision.
    assert names == ["blocks.1.up", "blocks.1.down", "blocks.2.up", "blocks.2.down"]
    assert fp8_linears(model) == names
    assert model.blocks[1].up.weight is weight  # the same Parameter: optimizer and ZeRO see no change
    line = [text for text in handler.lines if text.startswith("fp8:")]
    assert line == ["fp8: tensorwise (emulated), 4 of 10 linears in FP8: blocks.1.up, blocks.1.down, blocks.2.up, "
                    "blocks.2.down; kept in high precision: keep_first_last_bf16: proj_in, blocks.0.up, blocks.0.down, "
                    "blocks.3.up, blocks.3.down, head"]
    assert convert(build(), filter=["blocks.*.up"]) == ["blocks.0.up", "blocks.1.up", "blocks.2.up"]
    # No repeated blocks: the first and last linear stay.
    plain = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    assert convert(plain, filter=["*"], keep_first_last_bf16=True) == ["1"]


def test_filter_and_setting_errors() -> None:
    with pytest.raises(ConfigError, match=r"fp8.filter patterns \['block.\*'\] match no nn.Linear of the model; "
                                          r"its linears are named like \['proj_in', 'blocks.0.up'"):
        apply_fp8(build(), fp8_config(filter=["blocks.*", "block.*"]), ONE_RANK, device=CPU)
    odd = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 10))
    with pytest.raises(ConfigError, match="fp8.filter matches '1' \\(in_features 32, out_features 10\\): FP8 matmuls "
                                          "need both dimensions to be multiples of 16"):
        apply_fp8(odd, fp8_config(filter=["*"]), ONE_RANK, device=CPU)
    with pytest.raises(ConfigError, match="fp8 with tensor parallelism \\(tensor_parallel.autotp_size=2\\) is not supported"):
        apply_fp8(build(), fp8_config(), SimpleNamespace(tensor_size=2), device=CPU)
    cfg = load_config({"train_batch_size": 1, "fp16": {"enabled": True}, "fp8": {"enabled": True}})
    with pytest.raises(ConfigError, match="fp8 with fp16.enabled: .* set \"bf16\": {\"enabled\": true} instead"):
        apply_fp8(build(), cfg, ONE_RANK, device=CPU)
    with pytest.raises(ConfigError, match="fp8 got a bare nn.Linear as the model"):
        apply_fp8(nn.Linear(32, 32), fp8_config(), ONE_RANK, device=CPU)
    converted = build()
    convert(converted, filter=["blocks.0.*"])
    with pytest.raises(ConfigError, match="the model already has torchao Float8Linear layers \\(blocks.0.up, "
                                          "blocks.0.down\\): it was converted before"):
        apply_fp8(converted, fp8_config(), ONE_RANK, device=CPU)
    # Off: nothing converts and nothing is imported or checked.
    assert apply_fp8(build(), load_config({"train_batch_size": 1}), SimpleNamespace(tensor_size=4), device=CPU) == []


def test_missing_torchao_and_missing_fp8_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fp8(*args, **kwargs):
        raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9")

    monkeypatch.setattr(torch, "_scaled_mm", no_fp8)
    cfg = load_config({"train_batch_size": 1, "fp8": {"enabled": True}})
    with pytest.raises(ConfigError, match="fp8 \\(recipe 'tensorwise'\\) needs FP8 matmuls, which this device \\(cpu\\) "
                                          "cannot run: torch._scaled_mm is only supported .* or fp8.emulate to true"):
        apply_fp8(build(), cfg, ONE_RANK, device=CPU)
    with pytest.warns(UserWarning):
        assert apply_fp8(build(), fp8_config(filter=["*"]), ONE_RANK, device=CPU)  # emulate needs no kernel
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(ConfigError, match="fp8.enabled needs torchao's float8 training, which cannot be imported .*"
                                          "pip install 'torchao>=0.17,<0.19'"):
        apply_fp8(build(), fp8_config(), ONE_RANK, device=CPU)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"recipe": "rowwise"}, "recipe only applies when fp8.enabled is true"),
        ({"enabled": True, "filter": "all"}, "filter is \"all\"; give \"auto\" \\(torchao's size rules\\) or a list"),
        ({"enabled": True, "filter": []}, "filter is \\[\\]: no linear would run in FP8"),
        ({"enabled": True, "filter": ["a.*", " "]}, "filter has an empty pattern"),
        ({"enabled": True, "recipe": "delayed"}, "fp8.recipe = \"delayed\": not one of the choices"),
        ({"enabled": True, "flter": "auto"}, "fp8.flter = \"auto\": unknown key in 'fp8'; did you mean 'filter'"),
    ],
)
def test_config_errors(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config({"train_batch_size": 1, "fp8": section})


# ----------------------------------------------------------------------------- numerics


def _sqnr(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.detach().float(), ref.detach().float()
    return float(20 * torch.log10(ref.norm() / (ours - ref).norm()))


def _check_sqnr(recipe: str, emulate: bool, device: torch.device, compiled: bool = False) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(device, torch.bfloat16)
    ours = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(device, torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    cfg = load_config({"train_batch_size": 1, "bf16": {"enabled": True}, "compile": {"enabled": True},
                       "fp8": {"enabled": True, "recipe": recipe, "filter": ["*"], "emulate": emulate}})
    assert apply_fp8(ours, cfg, ONE_RANK, device=device) == ["0", "2"]
    if compiled:  # the forward only: the hooks below stay eager (inductor fuses torchao's casts)
        for index in (0, 2):
            ours[index].forward = torch.compile(ours[index].forward)
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
    outputs = {}
    for name, model in (("ref", ref), ("ours", ours)):
        for index in (0, 2):  # per layer: each linear's output
            model[index].register_forward_hook(lambda m, i, o, key=(name, index): outputs.__setitem__(key, o))
        inp = x.clone().requires_grad_()
        model(inp).square().mean().backward()
        outputs[name, "x"] = inp.grad
    for index in (0, 2):
        assert _sqnr(outputs["ours", index], outputs["ref", index]) >= 18, (recipe, index)
        assert _sqnr(ours[index].weight.grad, ref[index].weight.grad) >= 17, (recipe, index)
    assert _sqnr(outputs["ours", "x"], outputs["ref", "x"]) >= 17, recipe
    # The matmuls really are quantised: FP8 differs from bf16.
    assert not torch.equal(outputs["ours", 0], outputs["ref", 0])


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_sqnr_against_bf16_emulated(recipe: str) -> None:
    _check_sqnr(recipe, emulate=True, device=CPU)


def _has_fp8_kernels() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _has_fp8_kernels(), reason="needs a GPU with FP8 tensor cores (compute capability 8.9+)")
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_sqnr_against_bf16_on_fp8_hardware(recipe: str, compiled: bool) -> None:
    _check_sqnr(recipe, emulate=False, device=torch.device("cuda"), compiled=compiled)


def test_checkpoint_recompute_equals_the_forward_exactly() -> None:
    from partita.activation_checkpointing.apply import apply_activation_checkpointing

    x, y = batches(1, 4)
    results = []
    for checkpointed in (False, True):
        model = build()
        convert(model, filter=["blocks.*"])
        if checkpointed:
            assert apply_activation_checkpointing(model) == ["blocks.0", "blocks.1", "blocks.2"]
        seen: list[torch.Tensor] = []  # every output of blocks.1.up: forward, then the recompute
        model.blocks[1].up.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
        loss = model(x[0], y[0])
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, seen))
    (plain_loss, plain_grads, plain_seen), (ckpt_loss, ckpt_grads, ckpt_seen) = results
    assert len(plain_seen) == 1 and len(ckpt_seen) == 2  # the recompute ran the Float8Linear again
    assert torch.equal(ckpt_seen[1], ckpt_seen[0])  # recomputed output == forward output, bit for bit
    assert torch.equal(ckpt_seen[0], plain_seen[0])
    assert torch.equal(ckpt_loss, plain_loss)
    for name, grad in plain_grads.items():
        assert torch.equal(ckpt_grads[name], grad), name


# ----------------------------------------------------------------------------- engine, 2 ranks

MICRO = 2
FILTER = ["blocks.*"]


def _config(stage: int, *, fp8: bool = True, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "compile": {"enabled": False},
        "steps_per_print": 1000,
        **extra,
    }
    if fp8:
        cfg["fp8"] = {"enabled": True, "emulate": True, "filter": FILTER}
    return cfg


def _engine(cfg: dict):
    import partita

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager-FP8 warning
        engine, *_ = partita.initialize(model=build(), config=cfg)
    return engine


def _train(engine, steps: range) -> list[float]:
    import torch.distributed as dist

    rank = dist.get_rank()
    x, y = batches(dist.get_world_size(), MICRO)
    losses = []
    for step in steps:
        loss = engine(x[step, rank * MICRO : (rank + 1) * MICRO], y[step, rank * MICRO : (rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _params(engine) -> dict[str, torch.Tensor]:
    from partita.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _on_ranks(save_dir: str) -> dict:
    import partita.step_log

    # The CPU has no peak in partita's table: give it the H200's, so that leaving MFU out is seen.
    partita.step_log.device_peak_tflops = lambda device, precision: 989.0
    out: dict = {"stages": {}}
    for stage in (0, 1, 2, 3):
        engine = _engine(_config(stage))
        out["stages"][stage] = {"losses": _train(engine, range(STEPS)), "fp8": fp8_linears(engine.module),
                                "mfu_peak": engine._step_log.peak_tflops}
    out["ckpt"] = _train(_engine(_config(3, activation_checkpointing={"policy": "every"})), range(STEPS))
    import partita

    with partita.zero.Init(config_dict_or_path=_config(3)):  # built sharded: converted before any gather
        sharded = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = partita.initialize(model=sharded, config=_config(3))
    out["zero_init"] = _train(engine, range(STEPS))
    plain = _engine(_config(0, fp8=False))
    out["plain"], out["plain_peak"] = _train(plain, range(STEPS)), plain._step_log.peak_tflops
    # bf16 (the usual compute precision) at ZeRO-3, eager and compiled: the compiled blocks trace the
    # Float8Linear casts (aot_eager: the traced graph run unfused, so equal to eager bit for bit).
    bf16 = {"bf16": {"enabled": True}}
    out["bf16_eager"] = _train(_engine(_config(3, **bf16)), range(STEPS))
    compiled = _engine(_config(3, **bf16, compile={"enabled": True, "backend": "aot_eager"}))
    out["bf16_compiled"], out["compiled_fp8"] = _train(compiled, range(STEPS)), fp8_linears(compiled.module)
    # Saved with FP8 on, resumed with it off; saved with it off, resumed with it on.
    first = _engine(_config(2))
    _train(first, range(2))
    first.save_checkpoint(save_dir, tag="on")
    saved_on = _params(first)
    continued_on = _train(first, range(2, 3))
    off = _engine(_config(2, fp8=False))
    off.load_checkpoint(save_dir, tag="on")
    out["off_loads_on"] = all(torch.equal(p, saved_on[n]) for n, p in _params(off).items())
    out["off_fp8"] = fp8_linears(off.module)
    off.save_checkpoint(save_dir, tag="off")
    on = _engine(_config(2))
    on.load_checkpoint(save_dir, tag="off")
    out["on_loads_off"] = all(torch.equal(p, saved_on[n]) for n, p in _params(on).items())
    out["resumed_on"], out["continued_on"] = _train(on, range(2, 3)), continued_on
    return out


def _reference() -> list[list[float]]:
    """Single-process torch: the same FP8 (emulated) model, each rank's micro-batch its own forward
    (activation scales are per micro-batch, as on the ranks), gradients averaged, AdamW."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    import dataclasses

    model = build()
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn.startswith("blocks."))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    x, y = batches(2, MICRO)
    per_rank: list[list[float]] = [[], []]
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(2):
            loss = model(x[step, rank * MICRO : (rank + 1) * MICRO], y[step, rank * MICRO : (rank + 1) * MICRO])
            (loss / 2).backward()
            per_rank[rank].append(loss.item())
        opt.step()
    return per_rank


def test_zero_stages_checkpointing_and_checkpoints_on_two_ranks(tmp_path) -> None:
    per_rank = run_distributed(_on_ranks, 2, str(tmp_path), timeout=170)
    reference = _reference()
    fp8_names = [f"blocks.{i}.{n}" for i in range(3) for n in ("up", "down")]
    for rank, out in enumerate(per_rank):
        for stage, result in out["stages"].items():
            assert result["fp8"] == fp8_names, stage
            assert result["losses"] == pytest.approx(reference[rank], rel=1e-5, abs=1e-6), (rank, stage)
            assert result["mfu_peak"] is None  # MFU is not reported with FP8 on
        assert out["plain_peak"] == 989.0
        # Without FP8 the losses differ by more than the tolerance: the comparison above sees FP8.
        assert out["plain"][1:] != pytest.approx(reference[rank][1:], rel=1e-4)
        assert out["ckpt"] == out["stages"][3]["losses"]  # activation checkpointing on == off, exactly
        assert out["zero_init"] == out["stages"][3]["losses"]
        assert out["off_loads_on"] and out["on_loads_off"] and out["off_fp8"] == []
        assert out["resumed_on"] == out["continued_on"]
        assert out["bf16_compiled"] == out["bf16_eager"] and out["compiled_fp8"] == fp8_names
        assert out["bf16_eager"] != pytest.approx(out["stages"][3]["losses"], rel=1e-4)  # bf16 really ran
