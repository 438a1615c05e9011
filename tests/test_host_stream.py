"""Host-streamed weights (partita.inference.host_stream.HostStreamedWeights) on tiny models, CPU.

Oracle: the same model with every weight resident. Streaming only moves bytes, so the logits and
the greedy tokens must be *equal* (not close), in fp32 and with torchao int8/int4 weights; the
counters must show the schedule (each unit copied once per forward, the next one prefetched,
wrapping to the first block for the next token).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from partita.inference.host_stream import HostStreamedWeights  # noqa: E402

VOCAB = 96
LAYERS = 3


def _hf(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=LAYERS, n_head=4,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _ids(batch: int = 2, seq: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(5))


def _blocks(model: nn.Module) -> nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


@torch.no_grad()
def _logits(model: nn.Module) -> torch.Tensor:
    return model(_ids()).logits


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_streamed_fp32_logits_equal_resident(kind, prefetch) -> None:
    model = _hf(kind)
    want = _logits(model)
    streamed = HostStreamedWeights(model, "cpu", prefetch=prefetch)
    assert torch.equal(_logits(model), want)
    assert torch.equal(_logits(model), want)  # and again: the second pass runs from the wrapped prefetch
    block_bytes = sum(p.numel() * p.element_size() for p in _blocks(model).parameters())
    assert streamed.nbytes_on_host() == block_bytes


@pytest.mark.parametrize("bits", [8, 4])
def test_streamed_quantized_logits_equal_quantized_resident(bits) -> None:
    pytest.importorskip("torchao")
    from partita.inference.quantize import quantize_weights

    model = quantize_weights(_hf("llama"), bits=bits)
    want = _logits(model)
    streamed = HostStreamedWeights(model, "cpu", prefetch=1)
    assert torch.equal(_logits(model), want)
    # The quantized data streams as stored: the host holds int8 / packed int4 bytes, not floats.
    kinds = {type(slot.host).__name__ for unit in streamed._slots for slot in unit if slot.host.dim() == 2}
    assert kinds == {"Int8Tensor" if bits == 8 else "Int4OpaqueTensor"}
    floats = sum(p.numel() * 4 for p in _blocks(_hf("llama")).parameters())
    assert streamed.nbytes_on_host() < floats * (0.3 if bits == 8 else 0.2)
    # One forward: 4 unit copies (block 0 twice: its own turn, then prefetched after the last block).
    assert streamed.counters.bytes_copied == streamed.nbytes_on_host() * 4 // LAYERS


def test_greedy_generation_with_a_kv_cache_streams_every_block_once_per_token() -> None:
    model = _hf("llama")
    prompt = _ids(1, 5)
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=6, do_sample=False)
        streamed = HostStreamedWeights(model, "cpu", prefetch=1)
        got = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    # 6 forwards (the prompt, then 5 one-token steps): every block copied once each; block 0 once
    # more, prefetched after the last block of the last step for a next token.
    assert streamed.counters.fetches == [7, 6, 6]
    assert streamed.counters.prefetch_hits == 6 * LAYERS - 1
    assert streamed.counters.prefetches_issued == 6 * LAYERS
    assert streamed.counters.prefetches_dropped == 0


def test_the_reference_gpt_generates_the_same_tokens_streamed_fp32_and_int8() -> None:
    pytest.importorskip("torchao")
    from partita.inference.quantize import quantize_weights
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=LAYERS, n_embd=64, vocab_size=VOCAB, block_size=32)).eval()
    prompt = _ids(1, 5)
    with torch.no_grad():
        for bits in (None, 8):
            if bits:
                quantize_weights(model, bits=bits)
            want = model.generate(prompt, 6)
            streamed = HostStreamedWeights(model, "cpu", prefetch=1)
            assert torch.equal(model.generate(prompt, 6), want), bits
            assert streamed.counters.fetches == [7, 6, 6]  # its own static KV cache: one call per block and token
            streamed.remove()


# ----------------------------------------------------------------------------- the schedule


@pytest.mark.parametrize("prefetch,fetches,hits,issued", [(0, [3, 3, 3], 0, 0), (1, [4, 3, 3], 8, 9),
                                                           (2, [4, 4, 3], 8, 10)])
def test_counters_show_one_copy_per_unit_per_forward_and_the_prefetch(prefetch, fetches, hits, issued) -> None:
    model = _hf("gpt2")
    streamed = HostStreamedWeights(model, "cpu", prefetch=prefetch)
    for _ in range(3):
        _logits(model)
    assert streamed.counters.fetches == fetches
    assert streamed.counters.prefetch_hits == hits
    assert streamed.counters.prefetches_issued == issued
    assert streamed.counters.copies_issued == sum(fetches)
    assert streamed.counters.host_waits == 0  # CPU work is done when its call returns


class _SlowEvent:
    """A device that is always behind the host: an event completes only when waited for."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_a_host_running_ahead_of_the_device_waits_so_at_most_prefetch_plus_two_units_are_alive() -> None:
    model = _hf("gpt2")
    want = _logits(model)
    streamed = HostStreamedWeights(model, "cpu", prefetch=1)
    streamed._new_event = lambda stream=None: _SlowEvent()
    alive = []
    fetch = streamed._fetch

    def counting_fetch(index):
        fetch(index)
        alive.append(len(streamed._inflight) + len(streamed._released))

    streamed._fetch = counting_fetch
    assert torch.equal(_logits(model), want) and torch.equal(_logits(model), want)
    # Forward 1 waits once (block 2 prefetching block 0 while blocks 0 and 1 are "still computing");
    # forward 2 once per block.
    assert streamed.counters.host_waits == 4
    assert max(alive) == 3


def test_units_run_out_of_order_drop_their_unused_prefetch() -> None:
    model = _hf("gpt2")
    streamed = HostStreamedWeights(model, "cpu", prefetch=1)
    h = torch.randn(1, 3, 32)
    with torch.no_grad():
        _blocks(model)[0](h)  # prefetches block 1
        _blocks(model)[2](h)  # block 1 never ran: its copy is dropped; block 2 then prefetches block 0
    assert streamed.counters.fetches == [2, 1, 1] and streamed.counters.prefetches_dropped == 1
    assert streamed._inflight.keys() == {0}  # block 2 prefetched block 0 (wrapping)


def test_the_weights_are_copies_while_the_unit_runs_and_host_tensors_otherwise() -> None:
    model = _hf("llama")
    block = _blocks(model)[1]
    streamed = HostStreamedWeights(model, "cpu", prefetch=1)
    host = {n: p for n, p in block.named_parameters()}
    seen = {}

    def look(module, _args):  # registered after the streaming hook, so it sees what forward sees
        seen.update({n: p for n, p in module.named_parameters()})

    block.register_forward_pre_hook(look)
    _logits(model)
    assert seen.keys() == host.keys()
    for name, p in seen.items():
        assert p is not host[name] and p.data_ptr() != host[name].data_ptr()  # a real copy
        assert torch.equal(p, host[name])
    assert all(p is host[n] for n, p in block.named_parameters())  # dropped after the unit ran
    assert streamed._running == set()


def test_a_unit_that_raises_still_gets_its_host_tensors_back() -> None:
    model = _hf("llama")
    streamed = HostStreamedWeights(model, "cpu", prefetch=0)
    block = _blocks(model)[0]
    host = dict(block.named_parameters())
    with pytest.raises(AttributeError), torch.no_grad():
        block("not a tensor")  # fails inside the block, after the weights were installed
    assert all(p is host[n] for n, p in block.named_parameters()) and streamed._running == set()


def test_embeddings_norm_and_head_stay_resident_and_tied() -> None:
    model = _hf("gpt2")
    streamed = HostStreamedWeights(model, "cpu")
    streamed_ids = {id(slot.host) for unit in streamed._slots for slot in unit}
    assert id(model.lm_head.weight) not in streamed_ids and id(model.transformer.ln_f.weight) not in streamed_ids
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(streamed._slots) == LAYERS and all(len(unit) == 12 for unit in streamed._slots)


def test_a_parameter_shared_between_units_stays_resident() -> None:
    torch.manual_seed(0)

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)])
            self.layers[2].weight = self.layers[0].weight

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    model = Shared()
    x = torch.randn(4, 8)
    with torch.no_grad():
        want = model(x)
        streamed = HostStreamedWeights(model, "cpu")
        assert torch.equal(model(x), want)
    names = [[slot.name for slot in unit] for unit in streamed._slots]
    assert names == [["bias"], ["weight", "bias"], ["bias"]]
    assert model.layers[2].weight is model.layers[0].weight


def test_remove_restores_the_model_resident_and_unhooked() -> None:
    model = _hf("llama")
    want = _logits(model)
    streamed = HostStreamedWeights(model, "cpu", prefetch=1)
    _logits(model)
    before = streamed.counters.copies_issued
    assert streamed.remove() is model
    assert torch.equal(_logits(model), want)
    assert streamed.counters.copies_issued == before  # no hook ran
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in _blocks(model))
    assert streamed.nbytes_on_host() == 0


def test_units_by_name_and_as_a_context_manager() -> None:
    model = _hf("llama")
    want = _logits(model)
    with HostStreamedWeights(model, "cpu", units=["model.layers.0", "model.layers.2"]) as streamed:
        assert torch.equal(_logits(model), want)
        assert streamed.counters.fetches == [2, 1]  # layer 0 again: prefetched after layer 2
    assert not _blocks(model)[0]._forward_pre_hooks
    with HostStreamedWeights(model, "cpu", units=["model.layers"]) as streamed:  # a ModuleList: its children
        assert torch.equal(_logits(model), want) and streamed.counters.fetches == [2, 1, 1]


# Tensor parallelism: each tensor rank streaming its own int8 shards is checked in the same 2-rank run as
# the quantized split (tests/test_inference_quantize.py::test_tensor_parallel_int8_equals_the_unsharded_int8_model),
# so the suite pays for one set of processes.


# ----------------------------------------------------------------------------- refusals


def _refusal(model, device="cpu", **kwargs) -> str:
    with pytest.raises(ValueError) as e:
        HostStreamedWeights(model, device, **kwargs)
    return str(e.value)


@pytest.mark.parametrize("prefetch", [-1, 1.5, True])
def test_a_bad_prefetch_is_refused(prefetch) -> None:
    assert _refusal(_hf("gpt2"), prefetch=prefetch) == (
        f"HostStreamedWeights: prefetch must be an int >= 0 (units copied ahead), got {prefetch!r}")


def test_bad_units_are_refused() -> None:
    model = _hf("llama")
    assert _refusal(nn.Sequential(nn.Linear(2, 2))) == (
        "HostStreamedWeights: Sequential has no nn.ModuleList whose children (the blocks) could stream; "
        "pass units=[...] (the modules to stream, in the order they run)")
    assert _refusal(model, units=[]) == (
        "HostStreamedWeights: units is empty; pass the modules to stream, or units=None for the children of "
        "the model's nn.ModuleLists")
    assert _refusal(model, units=["model.blocks.0"]) == (
        "HostStreamedWeights: units names 'model.blocks.0', which is not a submodule of LlamaForCausalLM")
    assert _refusal(model, units=[nn.Linear(2, 2)]) == (
        "HostStreamedWeights: every unit must be a submodule of the model (or its name); got Linear")
    assert _refusal(model, units=[model]) == "HostStreamedWeights: the model itself cannot be a unit; pass its blocks"
    assert _refusal(model, units=["model.layers.0", "model.layers.0.mlp"]) == (
        "HostStreamedWeights: unit 'model.layers.0.mlp' lies inside unit 'model.layers.0'; units must not overlap")
    assert _refusal(model, units=["model.layers.1", "model.layers.1"]) == (
        "HostStreamedWeights: a unit is listed twice; list each once, in the order they run")
    assert _refusal(model, device="mps") == "HostStreamedWeights: device 'mps' is not supported; use 'cuda' or 'cpu'"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a machine without CUDA")
def test_cuda_without_cuda_is_refused() -> None:
    assert _refusal(_hf("gpt2"), device="cuda") == (
        "HostStreamedWeights: device 'cuda' is not available (torch.cuda.is_available() is False); "
        "stream to device='cpu' instead")


def test_int4_packed_for_cpu_is_refused_for_cuda_before_anything_moves(monkeypatch) -> None:
    pytest.importorskip("torchao")
    from partita.inference.quantize import quantize_weights

    model = quantize_weights(_hf("llama"), bits=4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _refusal(model, device="cuda") == (
        "HostStreamedWeights: model.layers.0.self_attn.q_proj.weight is a Int4OpaqueTensor, packed for cpu kernels, "
        "and cannot run on cuda; quantize for the device it runs on: quantize_weights(model, bits=4, device='cuda') "
        "before streaming")
    assert all(type(p) is nn.Parameter for p in model.model.layers[0].parameters() if p.dim() == 1)  # untouched
    assert not model.model.layers[0]._forward_pre_hooks


# ----------------------------------------------------------------------------- CUDA (skipped without a GPU)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_cuda_streams_from_pinned_host_memory_with_the_logits_of_resident_weights(bits) -> None:
    from partita.inference.quantize import quantize_weights

    model = _hf("llama").to(torch.bfloat16)
    ids = _ids().cuda()
    resident = _hf("llama").to(torch.bfloat16).cuda()
    if bits:
        quantize_weights(resident, bits=bits)
        quantize_weights(model, bits=bits, device="cuda")  # packed for the GPU, kept on the host
    with torch.no_grad():
        want = resident(ids).logits
        del resident
        torch.cuda.empty_cache()
        streamed = HostStreamedWeights(model, "cuda", prefetch=1)
        assert all(slot.host.device.type == "cpu" for unit in streamed._slots for slot in unit)
        pinned = [leaf.is_pinned() for unit in streamed._slots for slot in unit for leaf in _leaves(slot.host)]
        assert pinned and all(pinned)
        got = model(ids).logits
    assert torch.equal(got, want)
    assert streamed.counters.fetches == [2, 1, 1]
    streamed.remove()
    assert all(p.device.type == "cuda" for p in model.parameters())


def _leaves(t):
    from partita.inference.tensor_parts import leaves

    return list(leaves(t))
