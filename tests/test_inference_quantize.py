"""Weight-only int8 / int4 quantization (partita.inference.quantize) on tiny models.

Tolerance: torchao's own tests accept a quantized linear whose output has an SQNR above 20 dB
against the float layer (``compute_error(original, quantized) > 20``): pytorch/ao
test/quantization/quantize_/workflows/int8/test_int8_tensor.py (``test_int8_linear_variants``, the
Int8WeightOnlyConfig cases), int8/test_int8_tensor_cpu.py, and int4/test_int4_opaque_tensor.py
(``test_linear``, the CPU int4 tensor used here). Every layer type partita quantizes is held to
that bound, layer by layer; whole models to it for int8, and for int4 to 15 dB (the 20 dB per layer
compounds through two blocks of seven quantized layers each).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch import nn

from tests.harness import run_distributed

torchao = pytest.importorskip("torchao")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from torchao.quantization.utils import compute_error  # noqa: E402

from partita.inference.quantize import LinearFromConv1D, quantize_weights, quantized_nbytes  # noqa: E402

VOCAB = 96
TORCHAO_SQNR = 20.0  # dB, torchao's bound for one quantized linear (module docstring)


def _hf(kind: str, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=64, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg).to(dtype).eval()
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def _ids(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(3))


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    return compute_error(ref.float(), got.float()).item()


# ----------------------------------------------------------------------------- layers


@pytest.mark.parametrize("bits,group_size,dtype", [(8, None, torch.bfloat16), (8, 64, torch.float32),
                                                   (4, None, torch.bfloat16), (4, 32, torch.float32)])
def test_one_linear_is_within_torchaos_tolerance(bits, group_size, dtype) -> None:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(256, 128, dtype=dtype))
    x = torch.randn(4, 256, dtype=dtype)
    ref = layer(x)
    quantize_weights(layer, bits=bits, group_size=group_size)
    with torch.no_grad():
        got = layer(x)
    assert _sqnr(ref, got) > TORCHAO_SQNR
    assert type(layer[0].weight).__name__ == ("Int8Tensor" if bits == 8 else "Int4OpaqueTensor")


def test_hf_conv1d_becomes_a_linear_of_the_same_function() -> None:
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(96, 64))  # y = x @ W + b, W of shape (in=64, out=96)
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        ref = model(x)
        exact = LinearFromConv1D(model[0].weight, model[0].bias)(x)
    torch.testing.assert_close(exact, ref, rtol=1e-6, atol=1e-6)  # the conversion alone changes nothing
    quantize_weights(model, bits=8)
    assert isinstance(model[0], LinearFromConv1D) and type(model[0].weight).__name__ == "Int8Tensor"
    with torch.no_grad():
        assert _sqnr(ref, model(x)) > TORCHAO_SQNR


# ----------------------------------------------------------------------------- whole models


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("bits", [8, 4])
def test_model_logits_against_the_unquantized_model(kind, bits) -> None:
    model = _hf(kind)
    with torch.no_grad():
        ref = model(_ids()).logits
        quantize_weights(model, bits=bits)
        got = model(_ids()).logits
    assert _sqnr(ref, got) > (TORCHAO_SQNR if bits == 8 else 15.0)
    blocks = model.transformer.h if kind == "gpt2" else model.model.layers
    names = {type(p).__name__ for p in blocks.parameters() if p.dim() == 2}
    assert names == {"Int8Tensor" if bits == 8 else "Int4OpaqueTensor"}
    # The head stays float by default (and GPT-2's stays tied to its input embedding).
    assert type(model.lm_head.weight) is nn.Parameter
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == (kind == "gpt2")


def test_include_lm_head_quantizes_the_head_too() -> None:
    model = _hf("llama")
    quantize_weights(model, bits=8, include_lm_head=True)
    assert type(model.lm_head.weight).__name__ == "Int8Tensor"
    assert type(model.model.embed_tokens.weight) is nn.Parameter  # lookups stay float


def test_stored_bytes_are_a_half_and_a_quarter_of_bf16() -> None:
    def stack():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 256, bias=False), nn.Linear(256, 256, bias=False)).to(torch.bfloat16)

    bf16 = quantized_nbytes(stack())
    assert bf16 == 2 * 256 * 256 * 2
    int8 = quantized_nbytes(quantize_weights(stack(), bits=8)) / bf16
    int4 = quantized_nbytes(quantize_weights(stack(), bits=4, group_size=128)) / bf16
    # int8: 1 byte a weight + a bf16 scale and zero point per row; int4: half a byte + scale and zero per group.
    assert 0.5 < int8 < 0.52, int8
    assert 0.25 < int4 < 0.27, int4


def test_tied_weights_are_counted_once() -> None:
    model = _hf("gpt2")
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    assert quantized_nbytes(model) == sum(unique.values())


def test_a_weight_shared_by_two_layers_is_quantized_once_and_stays_shared() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 11), nn.Linear(11, 11), nn.Linear(11, 11))
    model[2].weight = model[1].weight
    x = torch.randn(3, 7)
    ref = model(x)
    quantize_weights(model, bits=4)  # 7 and 11 features: no group of 32 fits, so one group per row (Intx)
    assert model[1].weight is model[2].weight
    assert type(model[0].weight).__name__ == "IntxUnpackedToInt8Tensor"
    with torch.no_grad():
        assert _sqnr(ref, model(x)) > TORCHAO_SQNR


def test_greedy_generation_of_an_int8_llama_runs_and_matches_float() -> None:
    model = _hf("llama")
    prompt = _ids(1, 6)
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=8, do_sample=False)
        quantize_weights(model, bits=8)
        got = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert got.shape == (1, 14)
    # int8 at ~40 dB moves no argmax of this model: the tokens are the float model's.
    assert torch.equal(got, ref), (got, ref)


# ----------------------------------------------------------------------------- tensor parallel


def quantize_after_split(kinds: list[str]) -> dict:
    return {kind: _quantize_after_split(kind) for kind in kinds}


def _quantize_after_split(kind: str) -> dict:
    import torch.distributed as dist

    from partita.tensor_parallel.apply import apply_tensor_parallel
    from partita.tensor_parallel.autotp import autotp_plan, fix_attention_widths

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model = _hf(kind)
    apply_tensor_parallel(model, group=dist.group.WORLD, plan=autotp_plan(model))
    fix_attention_widths(model, dist.get_world_size())
    # Groups of 16 never straddle a shard boundary: each rank's groups are the unsharded model's.
    quantize_weights(model, bits=8, group_size=16)
    with torch.no_grad():
        logits = model(_ids()).logits
        # Each tensor rank streams its own quantized shards from host memory: the same logits.
        from partita.inference.host_stream import HostStreamedWeights

        streamed = HostStreamedWeights(model, "cpu", prefetch=1)
        streamed_equal = torch.equal(model(_ids()).logits, logits)
        streamed.remove()
    types = sorted({f"{type(m).__name__}:{type(m.weight).__name__}" for m in model.modules()
                    if "Parallel" in type(m).__name__ or isinstance(m, LinearFromConv1D)})
    try:
        quantize_weights(_split_again(kind), bits=8, group_size=64)
        error = None
    except ValueError as e:
        error = str(e)
    return {"logits": logits, "types": types, "error": error, "streamed_equal": streamed_equal,
            "fetches": streamed.counters.fetches}


def _split_again(kind: str) -> nn.Module:
    import torch.distributed as dist

    from partita.tensor_parallel.apply import apply_tensor_parallel
    from partita.tensor_parallel.autotp import autotp_plan

    model = _hf(kind)
    apply_tensor_parallel(model, group=dist.group.WORLD, plan=autotp_plan(model))
    return model


def test_tensor_parallel_int8_equals_the_unsharded_int8_model() -> None:
    """tp 2: quantizing after the split gives the unsharded int8 model's logits, and streaming each
    rank's shards from host memory (HostStreamedWeights) gives exactly the resident logits."""
    outs = run_distributed(quantize_after_split, 2, ["gpt2", "llama"], timeout=120)
    per_rank = {kind: [out[kind] for out in outs] for kind in ("gpt2", "llama")}
    for kind, ranks in per_rank.items():
        model = _hf(kind)
        quantize_weights(model, bits=8, group_size=16)
        with torch.no_grad():
            want = model(_ids()).logits
        for out in ranks:
            torch.testing.assert_close(out["logits"], want, rtol=1e-5, atol=1e-5)
            assert out["streamed_equal"] and out["fetches"] == [2, 1], (kind, out["fetches"])
    assert per_rank["gpt2"][0]["types"] == ["LinearFromConv1D:Int8Tensor"]
    assert per_rank["llama"][0]["types"] == ["ColumnParallelLinear:Int8Tensor", "RowParallelLinear:Int8Tensor"]
    # A row-parallel shard's input features are what the group size must divide (64 / 2 = 32).
    assert per_rank["llama"][0]["error"] == (
        "quantize_weights: group_size 64 does not divide the 32 input features of layer "
        "'model.layers.0.self_attn.o_proj' (this tensor rank's shard of the input features); choose a "
        "group_size that divides 32 (powers of two that do: 16, 32), or group_size=None")


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("bits", [3, 16, "8"])
def test_bits_other_than_8_or_4_are_refused(bits) -> None:
    with pytest.raises(ValueError) as e:
        quantize_weights(nn.Linear(8, 8), bits=bits)
    assert str(e.value) == (f"quantize_weights: bits={bits!r} is not supported; choose 8 (int8) or 4 (int4) "
                            "weight-only quantization")


def test_a_group_size_that_does_not_divide_a_layer_is_refused_before_anything_changes() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 96), nn.Linear(96, 8))
    with pytest.raises(ValueError) as e:
        quantize_weights(model, bits=4, group_size=64)
    assert str(e.value) == (
        "quantize_weights: group_size 64 does not divide the 96 input features of layer '2'; choose a "
        "group_size that divides 96 (powers of two that do: 16, 32), or group_size=None")
    assert all(type(p) is nn.Parameter for p in model.parameters())  # checked first, nothing quantized


@pytest.mark.parametrize("group_size", [0, -32, True, 32.0])
def test_a_group_size_that_is_not_a_positive_int_is_refused(group_size) -> None:
    with pytest.raises(ValueError) as e:
        quantize_weights(nn.Linear(64, 8), bits=8, group_size=group_size)
    assert str(e.value) == f"quantize_weights: group_size must be a positive int or None, got {group_size!r}"


def test_without_torchao_the_error_names_the_install(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ImportError) as e:
        quantize_weights(nn.Linear(8, 8), bits=8)
    assert str(e.value) == (
        "weight-only quantization (dtype=torch.int8 / quant) needs torchao, which is not installed: "
        "pip install torchao (or pip install partita[inference])")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bits", [8, 4])
def test_cuda_formats_are_within_torchaos_tolerance(bits) -> None:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(1024, 512, dtype=torch.bfloat16, device="cuda"))
    x = torch.randn(4, 1024, dtype=torch.bfloat16, device="cuda")
    ref = layer(x)
    quantize_weights(layer, bits=bits)
    with torch.no_grad():
        assert _sqnr(ref, layer(x)) > TORCHAO_SQNR
    fast_int4 = "Int4Tensor" if importlib.util.find_spec("mslk") else "Int4TilePackedTo4dTensor"
    assert type(layer[0].weight).__name__ == ("Int8Tensor" if bits == 8 else fast_int4)
