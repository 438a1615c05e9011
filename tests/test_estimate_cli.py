"""partita.estimate's inputs (byte sizes, Setup errors) and the ``partita estimate`` command's
tables, JSON and errors."""

from __future__ import annotations

import json

import pytest

from partita.estimate import EstimateError, GPTShape, Setup, estimate_memory, parse_bytes


# ----------------------------------------------------------------------------- (4) inputs and CLI


def test_parse_bytes():
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1000") == 1000
    with pytest.raises(EstimateError, match="141XB"):
        parse_bytes("141XB")


def test_setup_errors():
    with pytest.raises(EstimateError, match="every_x"):
        Setup(checkpointing="every_x")
    with pytest.raises(EstimateError, match="every_k:2"):
        Setup(checkpointing="every_k")
    with pytest.raises(EstimateError, match="world_size must be an integer >= 1, got -2"):
        Setup(world_size=-2)
    with pytest.raises(EstimateError, match="stage 1, 2 or 3"):
        Setup(stage=0, offload_optimizer="cpu")
    with pytest.raises(EstimateError, match="divisible"):
        GPTShape(d_model=10, n_layers=1, n_heads=3, vocab=5, seq_len=4)
    with pytest.raises(EstimateError, match="longer than"):
        estimate_memory(GPTShape(d_model=8, n_layers=1, n_heads=2, vocab=5, seq_len=4), seq_len=8)


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    from partita.launcher.cli import main

    code = main(["estimate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_table_and_json(capsys, tmp_path):
    code, out, _ = _cli(capsys, "--model", "gpt", "--d-model", "64", "--n-layers", "2", "--n-heads", "4",
                        "--vocab", "100", "--seq-len", "32", "--stage", "2", "--world-size", "2")
    assert code == 0
    assert "ZeRO stage 2, world size 2" in out and "fp32 master weights" in out and "peak" in out
    code, out, _ = _cli(capsys, "--model", "tiny", "--json")
    data = json.loads(out)
    # No --config: one rank, AdamW, nothing offloaded, which "auto" runs with the streamed step.
    streamed = Setup(fold_gradients_at_end=True, streamed_step=True)
    assert code == 0 and data["peak_accelerator_bytes"] == estimate_memory(GPTShape.preset("tiny"), streamed).peak_accelerator
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                                  "zero_optimization": {"stage": 3}}))
    code, out, _ = _cli(capsys, "--model", "tiny", "--config", str(config), "--world-size", "2")
    assert code == 0 and "bf16, ZeRO stage 3, world size 2, micro-batch 4" in out
    code, out, _ = _cli(capsys, "--model", "tiny", "--config", str(config), "--stage", "1")
    assert code == 0 and "ZeRO stage 1" in out  # a flag overrides the config
    code, out, _ = _cli(capsys, "--params", "7e9", "--stage", "3", "--world-size", "8", "--gpu-memory", "141GB",
                        "--activation-bytes", "20GB")
    assert code == 0 and "Recommended: ZeRO stage" in out
    code, out, _ = _cli(capsys, "--params", "1e6")
    assert code == 0 and "unknown" in out
    # --logits-held: the loop keeps its logits to the next step; reserved gains the bf16 logits' hole.
    flags = ["--model", "gpt2-124m", "--dtype", "bf16", "--micro-batch", "4", "--allocator", "expandable", "--json"]
    plain, held = (json.loads(_cli(capsys, *flags, *extra)[1]) for extra in ((), ("--logits-held",)))
    assert held["setup"]["logits_held_to_next_step"] and not plain["setup"]["logits_held_to_next_step"]
    assert held["reserved_accelerator"]["held_logits_bytes"] == 4 * 1024 * 50304 * 2
    assert held["reserved_accelerator_bytes"] == plain["reserved_accelerator_bytes"] + 4 * 1024 * 50304 * 2


@pytest.mark.parametrize("argv,message", [
    (["--model", "tiny", "--checkpointing", "every_x"], "checkpointing 'every_x' is not one of"),
    (["--model", "tiny", "--world-size", "-2"], "world_size must be an integer >= 1, got -2"),
    (["--model", "tiny", "--micro-batch", "0"], "micro_batch must be an integer >= 1"),
    (["--model", "tiny", "--gpu-memory", "141XB"], "gpu memory '141XB' is not a size"),
    (["--model", "gpt", "--d-model", "64"], "--model gpt needs --n-layers, --n-heads, --vocab, --seq-len"),
    (["--params", "7e9", "--d-model", "64"], "--d-model describe a GPT"),
    (["--params", "lots"], "--params 'lots' is not a number"),
    (["--model", "tiny", "--stage", "0", "--offload-optimizer", "cpu"], "needs ZeRO stage 1, 2 or 3"),
    (["--model", "tiny", "--config", "/nonexistent/ds.json"], "nonexistent"),
])
def test_cli_errors(capsys, argv, message):
    code, _, err = _cli(capsys, *argv)
    assert code == 2
    assert err.startswith("partita estimate: error: ") and message in err, err
