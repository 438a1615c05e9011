"""ZeRO++ qwZ / qgZ: block quantization bounds, bytes on the wire from the comms logger, training
next to plain ZeRO-3, checkpoint resume, and the config keys' checks. One 4-rank launch runs every
distributed case (partita/zero/quantized_comm.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from partita.config.base import ConfigError
from partita.zero.quantized_comm import BLOCK, RowFormat, decode_rows, dequantize_blocks, encode_rows, quantize_blocks
from tests.harness import run_distributed

WORLD, WIDTH, HIDDEN, CLASSES, STEPS, GLOBAL_BATCH = 4, 64, 128, 10, 6, 16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(h)))


class _Net(nn.Module):
    """Three blocks (ZeRO-3 units, 16.6k elements each: the weights sharded, biases persistent)."""

    def __init__(self, frozen_first: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, CLASSES)
        if frozen_first:
            self.blocks[0].requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).float(), y)


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, GLOBAL_BATCH, WIDTH, generator=g).expand(STEPS, -1, -1)  # one batch, seen every step:
    return x, torch.randint(0, CLASSES, (1, GLOBAL_BATCH), generator=g).expand(STEPS, -1)  # the loss falls


def _config(**zeropp) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}},
        "gradient_clipping": 0.5,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000,
                              "reduce_bucket_size": 100_000, **zeropp},
        "comms_logger": {"enabled": True, "debug": True},
        "steps_per_print": 10_000,
    }


def _train(cfg: dict, *, frozen_first: bool = False, steps: range = range(STEPS), save: str | None = None,
           load: str | None = None) -> dict:
    import torch.distributed as dist

    import partita
    from partita.monitor.comms_logger import COMMS_LOGGER

    torch.manual_seed(0)
    if frozen_first:  # frozen parameters stay sharded only when built under zero.Init
        with partita.zero.Init(config_dict_or_path=cfg):
            model = _Net(frozen_first=True)
    else:
        model = _Net()
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=cfg)
    if load is not None:
        engine.load_checkpoint(load, tag="t")
    COMMS_LOGGER.reset()
    xs, ys = _batches()
    rank, micro = dist.get_rank(), engine.train_micro_batch_size_per_gpu()
    losses = []
    for step in steps:
        total = 0.0
        for m in range(2):
            lo = (m * dist.get_world_size() + rank) * micro
            loss = engine(xs[step][lo: lo + micro], ys[step][lo: lo + micro])
            engine.backward(loss)
            engine.step()
            total += float(loss.detach()) / 2
        losses.append(total)
        if save is not None and step == 2:
            engine.save_checkpoint(save, tag="t")
    by_purpose: dict[str, int] = {}
    for record in COMMS_LOGGER.records():
        key = f"{record.op}: {record.purpose.split(' (')[0]}"
        by_purpose[key] = by_purpose.get(key, 0) + record.message_bytes
    # A gather asked for outside a unit (what GatheredParameters and the exports do) is exact: the
    # bf16 cast of the fp32 master, not its int8 rounding.
    from partita.zero.gathered import iter_fp32_master

    gatherer = engine.zero.gatherer
    masters = {p: full.clone() for p, full in iter_fp32_master(engine.zero) if gatherer.is_sharded_param(p)}
    gatherer.gather(list(masters))
    exact = all(torch.equal(p.detach(), full.to(p.dtype)) for p, full in masters.items())
    gatherer.release(list(masters))
    return {"losses": losses, "bytes": by_purpose, "prefetches": gatherer.prefetch_count, "exact": exact,
            "checked": len(masters), "skipped": engine.skipped_steps}


def _fp16(cfg: dict) -> dict:
    # A loss scale of 2^30 overflows every rank's own fp16 gradients (not just their sum).
    cfg = {k: v for k, v in cfg.items() if k != "bf16"}
    return {**cfg, "fp16": {"enabled": True, "initial_scale_power": 30}}


def _all_cases(save_dir: str) -> dict:
    out = {
        "plain": _train(_config()),
        "qwz": _train(_config(zero_quantized_weights=True)),
        "qgz4": _train(_config(zero_quantized_gradients=True)),
        "qgz8": _train(_config(zero_quantized_gradients=True, zero_quantized_gradients_bits=8)),
        "frozen_plain": _train(_config(), frozen_first=True),
        "frozen_q": _train(_config(zero_quantized_nontrainable_weights=True), frozen_first=True),
    }
    both = _config(zero_quantized_weights=True, zero_quantized_gradients=True)
    out["both"] = _train(both, save=f"{save_dir}/ckpt")
    out["resumed"] = _train(both, steps=range(3, STEPS), load=f"{save_dir}/ckpt")
    out["fp16_plain"], out["fp16_both"] = _train(_fp16(_config()), steps=range(2)), _train(_fp16(both), steps=range(2))
    return out


def _eight_ranks() -> dict:
    both = _config(zero_quantized_weights=True, zero_quantized_gradients=True)
    return {"plain": _train(_config(), steps=range(2)), "both": _train(both, steps=range(2))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    save_dir = str(tmp_path_factory.mktemp("zeropp"))
    return run_distributed(_all_cases, WORLD, save_dir)


# ---------------------------------------------------------------- quantization, one process
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, BLOCK - 1, BLOCK, 3 * BLOCK + 7])
def test_blockwise_error_is_at_most_half_a_scale(bits: int, numel: int) -> None:
    g = torch.Generator().manual_seed(numel)
    # Rows of very different magnitudes (1e-8 .. 1e2): a gradient's range; an outlier in row 1.
    x = torch.randn(3, numel, generator=g) * torch.tensor([[1e-8], [1.0], [1e2]])
    x[1, numel // 2] = 50.0
    q, scales = quantize_blocks(x, bits)
    qmax = 127 if bits == 8 else 7
    assert q.dtype == torch.int8 and int(q.abs().max()) <= qmax
    assert scales.dtype == torch.float32 and scales.shape == (3, RowFormat(numel, bits).blocks)
    back = dequantize_blocks(q, scales, numel, torch.float32)
    error = F.pad((back - x).abs(), (0, q.shape[1] - numel)).view(3, -1, BLOCK).amax(dim=2)
    assert (error <= scales / 2 * (1 + 1e-6)).all()
    assert (scales > 0).all()  # no block is all zeros here: the bound is not vacuous
    # The wire rows decode to the same values, and cost what RowFormat says.
    wire = encode_rows(x, bits)
    assert wire.dtype == torch.uint8 and wire.shape == (3, RowFormat(numel, bits).row_bytes)
    assert torch.equal(decode_rows(wire, numel, bits, torch.float32), back)


@pytest.mark.parametrize("bits", [8, 4])
def test_chunked_wire_equals_one_pass(monkeypatch, bits: int) -> None:
    import partita.zero.quantized_comm as quantized_comm

    x = torch.randn(2, 5 * BLOCK + 3, generator=torch.Generator().manual_seed(bits))
    one_pass = dequantize_blocks(*quantize_blocks(x, bits), x.shape[1], torch.float32)
    monkeypatch.setattr(quantized_comm, "_CHUNK", 2 * BLOCK)  # three chunks, the last one ragged and odd
    wire = encode_rows(x, bits)
    assert wire.shape == (2, RowFormat(x.shape[1], bits).row_bytes)
    assert torch.equal(decode_rows(wire, x.shape[1], bits, torch.float32), one_pass)


def test_non_finite_blocks_arrive_non_finite_and_zero_blocks_as_zeros() -> None:
    x = torch.randn(1, 3 * BLOCK)
    x[0, 5] = float("inf")
    x[0, BLOCK + 9] = float("nan")
    x[0, 2 * BLOCK:] = 0.0
    for bits in (8, 4):
        back = decode_rows(encode_rows(x, bits), x.shape[1], bits, torch.bfloat16).float()
        assert not back[0, :2 * BLOCK].isfinite().any()  # fp16's overflow check still sees the step
        assert torch.equal(back[0, 2 * BLOCK:], torch.zeros(BLOCK))


def test_wire_row_bytes() -> None:
    assert RowFormat(4096, 8).row_bytes == 4096 + 16 * 4
    assert RowFormat(4096, 4).row_bytes == 2048 + 16 * 4
    assert RowFormat(5, 4).row_bytes == 8  # 3 payload bytes + one scale, padded to 4
    with pytest.raises(ValueError, match="supports 8 or 4 bits, got 2"):
        RowFormat(10, 2)


# ---------------------------------------------------------------- bytes from the comms logger
GATHER = "all_gather_into_tensor: ZeRO-3 parameter all-gather"
QGATHER = "all_gather_into_tensor: int8 ZeRO-3 parameter all-gather"
REDUCE = "reduce_scatter_tensor: gradient reduction"


def test_quantized_weight_all_gather_moves_at_most_051x_of_bf16(runs) -> None:
    for rank in runs:
        plain, qwz = rank["plain"]["bytes"], rank["qwz"]["bytes"]
        assert plain[GATHER] > 0 and GATHER not in qwz
        assert qwz[QGATHER] <= 0.51 * plain[GATHER], (qwz[QGATHER], plain[GATHER])
        assert qwz[REDUCE] == plain[REDUCE]  # gradients untouched by qwZ
        assert rank["qwz"]["prefetches"] == rank["plain"]["prefetches"] > 0  # prefetch still runs ahead


def test_eight_ranks_bytes_and_losses() -> None:
    # 8 ranks: one sample per rank per micro-batch, each rank's shard half as wide as at 4.
    for rank in run_distributed(_eight_ranks, 8):
        plain, both = rank["plain"]["bytes"], rank["both"]["bytes"]
        assert both[QGATHER] <= 0.51 * plain[GATHER]
        assert both["all_to_all_single: int4 gradient reduction"] <= 0.27 * plain[REDUCE]
        gaps = [abs(a - b) for a, b in zip(rank["both"]["losses"], rank["plain"]["losses"])]
        assert max(gaps) <= 0.02 * rank["plain"]["losses"][0]


@pytest.mark.parametrize(("case", "bound"), [("qgz4", 0.27), ("qgz8", 0.51)])
def test_quantized_gradients_move_a_fraction_of_bf16(runs, case: str, bound: float) -> None:
    bits = case[-1]
    for rank in runs:
        plain, quant = rank["plain"]["bytes"], rank[case]["bytes"]
        sent = quant[f"all_to_all_single: int{bits} gradient reduction"]
        assert REDUCE not in quant
        assert sent <= bound * plain[REDUCE], (sent, plain[REDUCE])
        assert quant[GATHER] == plain[GATHER]  # weights untouched by qgZ


def test_nontrainable_flag_quantizes_only_frozen_weights(runs) -> None:
    for rank in runs:
        plain, quant = rank["frozen_plain"]["bytes"], rank["frozen_q"]["bytes"]
        exact, int8 = quant[GATHER], quant[QGATHER]
        assert 0 < exact < plain[GATHER]  # the trainable blocks still gather in bf16
        assert int8 <= 0.51 * (plain[GATHER] - exact)  # the frozen block's share, quantized


# ---------------------------------------------------------------- training and resume
def test_training_tracks_plain_zero3(runs) -> None:
    # Tolerances, as fractions of the first loss (2.06; the loss falls to ~0.25 in 6 steps, bf16, 2
    # micro-batches, clipping). int8 blocks (weights, or 8-bit gradients) round each element by at most
    # 1/254 of its block's largest: measured loss gaps <= 0.003, allowed 0.5% (0.010). int4 gradients
    # round by up to 1/14 of the block's largest gradient; Adam's normalisation turns that into a
    # slightly different step per element, and the gap grows with the steps: measured <= 0.018,
    # allowed 2% (0.041). A misread scale or a swapped chunk gives gaps of order the loss itself.
    for rank in runs:
        plain = rank["plain"]["losses"]
        assert plain[-1] < 0.2 * plain[0]  # it learns: the comparison is not between two flat lines
        for case, tolerance in (("qwz", 0.005), ("qgz8", 0.005), ("qgz4", 0.02), ("both", 0.02)):
            gaps = [abs(a - b) for a, b in zip(rank[case]["losses"], plain)]
            assert max(gaps) <= tolerance * plain[0], (case, rank[case]["losses"], plain)
        frozen_plain = rank["frozen_plain"]["losses"]
        gaps = [abs(a - b) for a, b in zip(rank["frozen_q"]["losses"], frozen_plain)]
        assert max(gaps) <= 0.005 * frozen_plain[0]
    for case in ("qwz", "qgz4", "qgz8", "frozen_q"):  # the wire really was rounded
        base = "frozen_plain" if case == "frozen_q" else "plain"
        assert runs[0][case]["losses"] != runs[0][base]["losses"], case


def test_fp16_overflow_is_seen_through_quantized_gradients(runs) -> None:
    # An inf in a gradient block arrives as a non-finite block, so the overflow check skips the step
    # (and nothing moves: the loss stays the first one). Without a skip the quantized run would step.
    for rank in runs:
        plain, both = rank["fp16_plain"], rank["fp16_both"]
        assert plain["skipped"] == both["skipped"] == 2
        assert both["losses"][0] == both["losses"][1] and plain["losses"][0] == plain["losses"][1]


def test_gathers_outside_units_stay_exact(runs) -> None:
    for rank in runs:
        for case in ("plain", "qwz", "both"):
            assert rank[case]["checked"] == 6 and rank[case]["exact"], case  # the blocks' six weights


def test_resume_from_checkpoint_continues_the_uninterrupted_run(runs) -> None:
    for rank in runs:  # bit for bit: masters, optimizer state and step resume, and the rounding is deterministic
        assert rank["resumed"]["losses"] == rank["both"]["losses"][3:]


# ---------------------------------------------------------------- config keys
def _load(zero: dict):
    from partita.config import load_config

    return load_config({"train_batch_size": 8, "zero_optimization": zero})


def test_config_keys_and_defaults() -> None:
    zero = _load({"stage": 3}).zero_optimization
    assert (zero.zero_quantized_weights, zero.zero_quantized_nontrainable_weights,
            zero.zero_quantized_gradients, zero.zero_quantized_gradients_bits) == (False, False, False, 4)
    zero = _load({"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
                  "zero_quantized_gradients_bits": 8}).zero_optimization
    assert zero.zero_quantized_weights and zero.zero_quantized_gradients and zero.zero_quantized_gradients_bits == 8


@pytest.mark.parametrize(("zero", "message"), [
    ({"stage": 2, "zero_quantized_weights": True},
     "zero_quantized_weights (ZeRO++) work at ZeRO stage 3 only"),
    ({"stage": 1, "zero_quantized_gradients": True, "zero_quantized_nontrainable_weights": True},
     "zero_quantized_nontrainable_weights, zero_quantized_gradients (ZeRO++) work at ZeRO stage 3 only"),
    ({"stage": 3, "zero_quantized_gradients": True, "reduce_scatter": False},
     "zero_quantized_gradients replaces the gradient reduce-scatter with a quantized all-to-all"),
    ({"stage": 3, "zero_quantized_gradients_bits": 2}, "zero_quantized_gradients_bits"),
])
def test_config_refusals(zero: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        _load(zero)
    assert message in str(info.value)


def test_hpz_of_one_is_inert() -> None:
    assert _load({"stage": 3, "zero_hpz_partition_size": 1}).zero_optimization.stage == 3
