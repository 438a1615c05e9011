"""partita.inference.static_decode: the static-cache decode loop behind ``enable_cuda_graph``.

On CPU the loop runs uncompiled (``compile=False``): the same prefill, static cache, per-step mask
and positions that the CUDA-graph path captures, checked token for token against Hugging Face's
``generate`` (dynamic cache, eager), the reference this loop replaces.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from partita.inference.static_decode import CACHE_BUCKET, StaticDecoder, unsupported_reason  # noqa: E402


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=89, n_embd=32, n_layer=2, n_head=4, n_positions=256)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _prompt(batch=3, length=9, vocab=80, seed=1):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama-gqa", "gpt2"])
def test_greedy_equals_hf_generate(build):
    model = build()
    ids = _prompt()
    mask = torch.ones_like(ids)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    got = StaticDecoder(model, compile=False).generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(got, expected)


def test_left_padding_equals_hf_generate():
    model = _llama()
    ids = _prompt()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    got = StaticDecoder(model, compile=False).generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, expected)


def test_eos_and_min_new_tokens_match_hf_generate():
    model = _llama()
    ids = _prompt()
    mask = torch.ones_like(ids)
    free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    eos = int(free[1, ids.shape[1] + 4])  # row 1 emits it as its 5th new token
    decoder = StaticDecoder(model, compile=False)
    for extra in ({}, {"min_new_tokens": 10}):
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=0, **extra)
        expected = model.generate(**kwargs)
        got = decoder.generate(**kwargs)
        assert torch.equal(got, expected), extra


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    model = _llama()
    ids = _prompt()
    decoder = StaticDecoder(model, compile=False)
    torch.manual_seed(5)
    first = decoder.generate(input_ids=ids, max_new_tokens=8, do_sample=True, temperature=0.8, top_p=0.9)
    torch.manual_seed(5)
    second = decoder.generate(input_ids=ids, max_new_tokens=8, do_sample=True, temperature=0.8, top_p=0.9)
    assert torch.equal(first, second)
    greedy = decoder.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(decoder.generate(input_ids=ids, max_new_tokens=8, do_sample=True, top_k=1), greedy)


def test_cache_length_is_bucketed():
    model = _llama()
    decoder = StaticDecoder(model, compile=False)
    seen = []
    original = transformers.StaticCache.__init__

    def record(self, *args, **kwargs):
        seen.append(kwargs["max_cache_len"])
        original(self, *args, **kwargs)

    transformers.StaticCache.__init__ = record
    try:
        decoder.generate(input_ids=_prompt(length=9), max_new_tokens=5)
        decoder.generate(input_ids=_prompt(length=CACHE_BUCKET), max_new_tokens=1)
    finally:
        transformers.StaticCache.__init__ = original
    assert seen == [CACHE_BUCKET, 2 * CACHE_BUCKET]


def test_refusals():
    model = _llama()
    with pytest.raises(ValueError, match=r"generate asks for 29 tokens \(prompt 9 \+ max_new_tokens 20\) but the inference "
                                         r"engine's max_out_tokens is 16; raise max_out_tokens"):
        StaticDecoder(model, compile=False, max_out_tokens=16).generate(input_ids=_prompt(), max_new_tokens=20)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        StaticDecoder(model, compile=False).generate(input_ids=_prompt(), max_new_tokens=0)
    config = model.generation_config
    assert unsupported_reason({"input_ids": _prompt(), "num_beams": 4}, config) == (
        "generation settings the static-cache loop does not implement: num_beams=4")
    assert unsupported_reason({"input_ids": _prompt(), "logits_processor": [object()]}, config) == (
        "generate arguments the static-cache loop does not implement: logits_processor")
    assert unsupported_reason({"inputs_embeds": torch.zeros(1, 2, 64)}, config) == (
        "generate arguments the static-cache loop does not implement: inputs_embeds")
    assert unsupported_reason({"input_ids": _prompt(), "max_new_tokens": 3}, config) is None
