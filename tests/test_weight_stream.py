"""engine.iter_16bit_weight_buckets on 2 gloo ranks: every rank streams the names and values of
save_16bit_model (``_zero3_consolidated_16bit_state_dict`` and the .safetensors file) exactly, at
ZeRO-1, ZeRO-3 (bf16, after a step), tensor parallel 2 (whole tensors) and expert parallel 2 (every
expert by its global name); each bucket holds at most bucket_bytes (a larger tensor alone); the
memory a rank holds beyond its shards, counted by the stream and independently by the ZeRO-3
gatherer's live-element peak, stays within one bucket plus the largest tensor, while a bucket the
size of the model makes the same measures report the whole model."""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_distributed

# Bytes per bucket: a few of BlockNet's tensors per bucket, and tensors larger than one (fp32: 364 bytes, bf16: 182).
BUCKET = {"stage1": 300, "stage3-bf16": 150}


def _stream(engine, bucket_bytes: int) -> dict:
    """Consume the stream as a generator would (copy each bucket, then ask for the next)."""
    stream = engine.iter_16bit_weight_buckets(bucket_bytes=bucket_bytes)
    got, sizes = {}, []
    for bucket in stream:
        unique = {id(t): t for _, t in bucket}
        sizes.append((sum(t.numel() * t.element_size() for t in unique.values()), len(unique)))
        for name, tensor in bucket:
            assert name not in got, name
            got[name] = tensor.to("cpu", copy=True)
    return {"got": got, "sizes": sizes, "peak": stream.peak_extra_bytes, "largest": stream.largest_bytes}


def _gatherer_peak_bytes(engine, bucket_bytes: int) -> tuple[int, dict]:
    """The ZeRO-3 gatherer's own count of elements held whole, across one stream."""
    gatherer = engine.zero.gatherer
    gatherer.reset_peak_live_numel()
    base = gatherer.live_numel
    out = _stream(engine, bucket_bytes)
    element = next(engine.module.parameters()).element_size()
    return (gatherer.peak_live_numel - base) * element, out


def _block_engine(stage: int, bf16: bool):
    import partita
    from tests.test_offload_states import _config, _train
    from tests.tiny_models import build_block_model, param_groups

    model = build_block_model()
    engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model),
                                         config=_config(stage, bf16, False))
    _train(engine, range(1))
    return engine


def zero_body(save_dir: str) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load_file

    out = {}
    for label, stage, bf16 in (("stage1", 1, False), ("stage3-bf16", 3, True)):
        engine = _block_engine(stage, bf16)
        want = engine._zero3_consolidated_16bit_state_dict()
        path = engine.save_16bit_model(os.path.join(save_dir, label), "model.safetensors")
        if stage == 3:
            gathered_peak, result = _gatherer_peak_bytes(engine, BUCKET[label])
            result["gatherer_peak"] = gathered_peak
            whole_peak, whole = _gatherer_peak_bytes(engine, 1 << 30)  # one bucket: the whole model at once
            result["whole_gatherer_peak"], result["whole_peak"] = whole_peak, whole["peak"]
            result["sharded_bytes"] = sum(p.numel() * p.element_size() for p in engine.module.parameters()
                                          if engine.zero.gatherer.is_sharded_param(p))
        else:
            result = _stream(engine, BUCKET[label])
        result["want"] = want
        result["file"] = load_file(str(path)) if dist.get_rank() == 0 else None
        try:
            engine.iter_16bit_weight_buckets(bucket_bytes=0)
        except ValueError as err:
            result["refusal"] = str(err)
        out[label] = result
        engine.destroy()
    return out


def tp_body() -> dict:
    import partita
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=32))
    cfg = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10},
           "tensor_parallel": {"autotp_size": 2}, "steps_per_print": 1000}
    engine, _, _, _ = partita.initialize(model=model, model_parameters=model.optimizer_param_groups(0.1), config=cfg)
    result = _stream(engine, 4096)
    result["want"] = engine._zero3_consolidated_16bit_state_dict()
    result["local_shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return result


def ep_body() -> dict:
    import partita
    from tests.test_moe_checkpoint import E, _config
    from tests.test_moe_reference import MoENet

    rank = int(os.environ["RANK"])
    model = MoENet(num_experts=E, ep_size=2, k=2, drop_tokens=False, expert_rank=rank)
    engine, _, _, _ = partita.initialize(model=model, config={**_config(2, 3), "bf16": {"enabled": True}})
    result = _stream(engine, 256)
    result["want"] = engine._zero3_consolidated_16bit_state_dict()
    return result


def _check_stream(per_rank: list[dict], what: str) -> None:
    want = per_rank[0]["want"]
    for rank, r in enumerate(per_rank):
        assert sorted(r["got"]) == sorted(want), f"{what} rank {rank}: names differ"
        for name, value in want.items():
            got = r["got"][name]
            assert got.dtype == value.dtype and torch.equal(got, value), f"{what} rank {rank}: {name}"


def _check_buckets(r: dict, limit: int, what: str) -> None:
    assert len(r["sizes"]) > 1, what
    for size, count in r["sizes"]:
        assert size <= limit or count == 1, f"{what}: a bucket of {size} bytes in {count} tensors"
    assert any(size > limit for size, _ in r["sizes"]), what  # the case of a tensor larger than a bucket is run


@pytest.fixture(scope="module")
def zero_results(tmp_path_factory) -> list[dict]:
    return run_distributed(zero_body, 2, str(tmp_path_factory.mktemp("stream")), timeout=600)


def test_stream_equals_save_16bit_model_at_zero_1_and_3(zero_results) -> None:
    for label in ("stage1", "stage3-bf16"):
        per_rank = [r[label] for r in zero_results]
        _check_stream(per_rank, label)
        _check_buckets(per_rank[0], BUCKET[label], label)
        saved = per_rank[0]["file"]  # the safetensors file: each tied weight once, under its first name
        assert saved and set(saved) < set(per_rank[0]["want"]) and "head.weight" not in saved
        for name, value in saved.items():
            assert torch.equal(per_rank[0]["got"][name], value), (label, name)
        assert per_rank[0]["got"]["head.weight"] is not None and torch.equal(
            per_rank[0]["got"]["head.weight"], per_rank[0]["got"]["embed.weight"])  # tied: under both names
    assert zero_results[0]["stage3-bf16"]["got"]["embed.weight"].dtype == torch.bfloat16
    assert zero_results[0]["stage1"]["refusal"] == (
        "iter_16bit_weight_buckets(bucket_bytes=0): bucket_bytes must be a positive int, the most bytes of tensors one "
        "bucket holds (e.g. 512 << 20 for 512 MiB)")


def test_stream_holds_at_most_one_bucket_plus_the_largest_tensor(zero_results) -> None:
    for rank, results in enumerate(zero_results):
        stage1, stage3 = results["stage1"], results["stage3-bf16"]
        assert stage1["peak"] == 0  # stages 0-2: the tensors handed out are the model's own, nothing is allocated
        bound = BUCKET["stage3-bf16"] + stage3["largest"]
        assert 0 < stage3["peak"] <= bound, (rank, stage3["peak"], bound)
        assert 0 < stage3["gatherer_peak"] <= bound, (rank, stage3["gatherer_peak"], bound)  # the gatherer's count
        # The same measures see the whole model when one bucket holds it: they can fail.
        assert stage3["whole_gatherer_peak"] == stage3["whole_peak"] == stage3["sharded_bytes"] > bound, rank


def test_stream_under_tensor_parallelism_yields_whole_tensors() -> None:
    per_rank = run_distributed(tp_body, 2, timeout=600)
    _check_stream(per_rank, "tp 2")
    r = per_rank[0]
    split = [n for n, shape in r["local_shapes"].items() if tuple(r["want"][n].shape) != shape]
    assert split, "no parameter is tensor-split: the test would not exercise the tensor gathers"
    assert all(r["got"][n].shape == r["want"][n].shape for n in split)
    _check_buckets(r, 4096, "tp 2")


def test_stream_under_expert_parallelism_yields_every_expert() -> None:
    per_rank = run_distributed(ep_body, 2, timeout=600)
    _check_stream(per_rank, "ep 2")
    names = per_rank[0]["got"]
    assert any(".deepspeed_experts.3." in n for n in names) and any(".deepspeed_experts.0." in n for n in names)
