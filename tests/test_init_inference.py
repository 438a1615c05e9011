"""``partita.init_inference`` in one process: the config (DeepSpeed's keys, merge rules, every
refusal's exact message), the engine's surface, parity with the plain model, the token limit,
checkpoint errors, int8 weights, streamed weights and the compiled decoding path.

Oracle for parity: the same model object's own forward / generate in eval mode (the engine runs
the model's modules unchanged at tp 1, so outputs are bit-identical).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.test_init_inference_tp import build, greedy, prompt

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import partita  # noqa: E402
from partita.checkpoint.errors import CheckpointError, CheckpointMismatchError  # noqa: E402
from partita.config import ConfigError  # noqa: E402
from partita.inference.config import merge_config_and_kwargs, parse_inference_config  # noqa: E402

FP32 = {"dtype": torch.float32}


def _problems(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_inference_config(raw)
    assert str(info.value).startswith("Invalid partita config in init_inference (")
    return [p.render() for p in info.value.problems]


# ------------------------------------------------------------------------------ config


def test_config_and_kwargs_merge_and_a_conflict_is_deepspeeds_value_error(tmp_path) -> None:
    assert merge_config_and_kwargs({"dtype": "fp32"}, {"dtype": "fp32", "max_tokens": 8}) == {"dtype": "fp32", "max_tokens": 8}
    with pytest.raises(ValueError, match=r"^Conflicting argument 'dtype' in 'config':fp16 and kwargs:fp32$"):
        merge_config_and_kwargs({"dtype": "fp16"}, {"dtype": "fp32"})
    with pytest.raises(ValueError, match=r"^'config' argument expected string or dictionary, got <class 'int'>$"):
        merge_config_and_kwargs(3, {})
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"tp": {"tp_size": 1}, "max_tokens": 64, "kernel_inject": True}))
    cfg = parse_inference_config(merge_config_and_kwargs(str(path), {"dtype": "bf16"}))
    assert (cfg.tp_size, cfg.max_out_tokens, cfg.replace_with_kernel_inject, cfg.torch_dtype) == (1, 64, True, torch.bfloat16)


def test_defaults_are_deepspeeds() -> None:
    defaults = partita.default_inference_config()
    assert defaults["dtype"] is torch.float16 and defaults["max_out_tokens"] == 1024
    assert defaults["tensor_parallel"]["tp_size"] == 1 and defaults["replace_with_kernel_inject"] is False
    cfg = parse_inference_config({})
    assert (cfg.torch_dtype, cfg.max_out_tokens, cfg.min_out_tokens, cfg.tp_size, cfg.enable_cuda_graph) == (
        torch.float16, 1024, 1, 1, False)
    assert cfg.quant_bits is None and not cfg.streams_weights


@pytest.mark.parametrize("value, dtype", [
    (torch.float16, torch.float16), ("half", torch.float16), ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
    (torch.float32, torch.float32), ("float", torch.float32), ("torch.int8", torch.int8), (torch.int8, torch.int8)])
def test_dtype_takes_torch_dtypes_and_deepspeeds_strings(value, dtype) -> None:
    assert parse_inference_config({"dtype": value}).torch_dtype is dtype


def test_deprecated_mp_size_sets_tp_size_and_refuses_both() -> None:
    with pytest.warns(UserWarning, match=r"^init_inference: mp_size is deprecated \(DeepSpeed\); use tensor_parallel="):
        assert parse_inference_config({"mp_size": 2}).tp_size == 2
    assert _problems({"mp_size": 2, "tensor_parallel": {"tp_size": 2}}) == [
        "mp_size = 2: Cannot provide deprecated parameter 'mp_size' and replacing parameter 'tensor_parallel.tp_size' "
        "together; keep tensor_parallel.tp_size"]
    assert parse_inference_config({"tensor_parallel": {"tp_size": 4, "enabled": False}}).tp_size == 1


def test_unknown_keys_name_the_key_a_close_match_and_the_valid_keys() -> None:
    [top] = _problems({"tensor_paralel": {"tp_size": 2}})
    assert top.startswith("tensor_paralel = {\"tp_size\": 2}: unknown key at the top level; did you mean "
                          "'tensor_parallel'? Valid keys: replace_with_kernel_inject, dtype, tensor_parallel, ")
    assert _problems({"tensor_parallel": {"tp_sise": 2}}) == [
        "tensor_parallel.tp_sise = 2: unknown key in 'tensor_parallel'; did you mean 'tp_size' or 'tp_grain_size'? "
        "Valid keys: enabled, tp_size, tp_grain_size, mpu, tp_group"]
    assert _problems({"tp": {"tp_size": 1}, "tensor_parallel": {"tp_size": 1}}) == [
        "tensor_parallel = {\"tp_size\": 1}: 'tp' is DeepSpeed's other name for 'tensor_parallel', and both are given; "
        "keep one"]


def test_wrong_types_and_ranges_say_what_is_allowed() -> None:
    assert _problems({"max_out_tokens": 0, "dtype": "fp8", "moe": "yes"}) == [
        "dtype = \"fp8\": not a dtype partita runs inference in; use torch.float16 / torch.bfloat16 / torch.float32 / "
        "torch.int8 or one of the strings torch.float16, fp16, float16, half, torch.float32, fp32, float32, float, "
        "torch.bfloat16, bf16, bfloat16, bfloat, torch.int8, int8"]
    assert _problems({"max_out_tokens": 0}) == [
        "max_out_tokens = 0: input should be greater than 0; allowed: an integer > 0 (default 1024)"]
    assert _problems({"moe": "yes"}) == [
        "moe = \"yes\": input should be a valid boolean; allowed: true or false or an object with keys 'enabled', "
        "'ep_size', 'moe_experts', 'type', 'ep_mp_group', 'ep_group'"]
    assert _problems({"dtype": torch.float64}) == [
        "dtype: torch.float64 is not supported; use torch.float16, torch.bfloat16, torch.float32 or torch.int8"]


REFUSALS = {
    "use_triton": ({"use_triton": True}, "use_triton = true: partita injects no Triton kernels; set enable_cuda_graph=True "
                   "to decode under torch.compile (Inductor generates Triton kernels for the model's own modules)"),
    "tm": ({"tm": False}, "triangular_masking = false: partita runs the model's own attention masking; remove the key"),
    "set_empty_params": ({"set_empty_params": True}, "set_empty_params = true: partita needs real parameters: build the "
                         "model (on the meta device is fine only with checkpoint=) and remove the key"),
    "save_mp": ({"save_mp_checkpoint_path": "/x"}, "save_mp_checkpoint_path = \"/x\": partita loads a checkpoint at any "
                "tp_size directly (resharding on load), so no pre-sharded copy is needed; remove the key"),
    "checkpoint_dict": ({"checkpoint": {"type": "Megatron"}}, "checkpoint = {\"type\": \"Megatron\"}: DeepSpeed's JSON "
                        "load policies (Megatron / ds_model checkpoint lists) are not read: give checkpoint=<partita "
                        "checkpoint dir> or a directory of safetensors weights"),
    "injection_policy": ({"injection_dict": {"LlamaDecoderLayer": 3}}, "injection_policy = \"<value>\": "
                         "injection_policy must map a layer class (or its name) to the name or tuple of names of its "
                         "row-parallel linear layers, e.g. {LlamaDecoderLayer: ('self_attn.o_proj', 'mlp.down_proj')}"),
    "injection_policy_tuple": ({"injection_policy_tuple": ("a",)}, "injection_policy_tuple = \"<tuple>\": DeepSpeed "
                               "fills this in itself; give injection_policy instead"),
    "transposed": ({"transposed_mode": True}, "transposed_mode = true: only DeepSpeed's injected kernels have a "
                   "transposed mode; remove the key"),
    "ep_size": ({"moe": {"ep_size": 2}}, "moe.ep_size = 2: expert parallelism at inference is not implemented: every "
                "rank runs all experts of its model; set ep_size to 1"),
    "bits": ({"quant": {"weight": {"num_bits": 3}}}, "quant.weight.num_bits = 3: weight-only quantization is int8 or "
             "int4: 8 or 4"),
    "asymmetric": ({"quant": {"weight": {"q_type": "asymmetric"}}}, "quant.weight.q_type = \"asymmetric\": torchao's "
                   "weight-only int8/int4 is symmetric; use \"symmetric\""),
    "q_groups": ({"quant": {"weight": {"q_groups": 4}}}, "quant.weight.q_groups = 4: give quant.weight.group_size "
                 "(input features per scale) instead of a group count"),
    "activation": ({"quant": {"activation": {"enabled": True}}}, "quant.activation.enabled = true: partita quantizes "
                   "weights only (activations stay in floating point); set it to false"),
    "nvme": ({"zero": {"stage": 3, "offload_param": {"device": "nvme"}}}, "zero.offload_param.device = \"nvme\": "
             "inference streams weights from host memory only; use \"cpu\""),
    "stage2": ({"zero": {"stage": 2}}, "zero.stage = 2: inference has no optimizer state or gradients to partition: "
               "use 0 (weights resident) or 3 with offload_param {\"device\": \"cpu\"} (ZeRO-Inference)"),
    "mpu": ({"tensor_parallel": {"mpu": object()}}, "tensor_parallel.mpu = \"<object>\": an mpu object is not used by "
            "partita: give tensor_parallel.tp_size and launch tp_size (x replicas) processes; partita builds the "
            "tensor group"),
    "tp_group": ({"tensor_parallel": {"tp_group": object()}}, "tensor_parallel.tp_group = \"<object>\": a process group "
                 "is not taken: partita builds the tensor group from its topology (consecutive ranks); give "
                 "tensor_parallel.tp_size"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_deepspeed_settings_partita_does_not_do_are_refused_with_the_way_out(case) -> None:
    raw, message = REFUSALS[case]
    assert _problems(raw) == [message]


def test_injection_policy_names_row_parallel_layers_and_every_other_linear_is_column_parallel() -> None:
    from partita.inference.parallel import policy_plan

    model = build("llama")
    plan = policy_plan(model, {type(model.model.layers[0]): ("self_attn.o_proj", "mlp.down_proj")})
    assert {name: style.kind for name, style in plan.styles.items() if name.startswith("model.layers.0.")} == {
        "model.layers.0.self_attn.q_proj": "column", "model.layers.0.self_attn.k_proj": "column",
        "model.layers.0.self_attn.v_proj": "column", "model.layers.0.self_attn.o_proj": "row",
        "model.layers.0.mlp.gate_proj": "column", "model.layers.0.mlp.up_proj": "column",
        "model.layers.0.mlp.down_proj": "row"}
    assert plan.head_counts == {"num_attention_heads": 8, "num_key_value_heads": 4}
    gpt2 = policy_plan(build("gpt2"), {"GPT2Block": ("attn.c_proj", "mlp.c_proj")})
    assert gpt2.styles["transformer.h.1.attn.c_attn"].chunks == 3
    with pytest.raises(ConfigError, match=r"^injection_policy: LlamaForCausalLM has no module of class GPT2Block; "):
        policy_plan(model, {"GPT2Block": "attn.c_proj"})
    with pytest.raises(ConfigError, match=r"^injection_policy: no layer named 'o_projection' inside LlamaDecoderLayer; "):
        policy_plan(model, {"LlamaDecoderLayer": ("o_projection",)})


def test_harmless_deepspeed_keys_are_accepted() -> None:
    cfg = parse_inference_config({"replace_with_kernel_inject": True, "return_tuple": False, "min_tokens": 8,
                                  "args": {"hidden": 1}, "moe": True, "tp": {"tp_grain_size": 32},
                                  "keep_module_on_host": True, "base_dir": "/x", "training_mp_size": 2})
    assert cfg.min_out_tokens == 8 and cfg.keep_module_on_host and cfg.training_mp_size == 2


def test_cuda_graph_with_tensor_parallelism_or_streaming_is_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match=r"^enable_cuda_graph with tensor_parallel\.tp_size = 2 is not supported yet "
                                          r"\(DeepSpeed refuses it too\)"):
        partita.init_inference(build("llama"), tensor_parallel={"tp_size": 2}, enable_cuda_graph=True)
    with pytest.raises(ConfigError, match=r"^enable_cuda_graph with zero\.offload_param \(weights streamed from host "
                                          r"memory\) is not possible"):
        partita.init_inference(build("llama"), enable_cuda_graph=True,
                               zero={"stage": 3, "offload_param": {"device": "cpu"}})


def test_a_model_holding_zero3_shards_or_meta_parameters_is_refused() -> None:
    from partita.zero.freed import free_param

    model = build("gpt")
    free_param(model.lm_head.weight, "a ZeRO-3 shard for this test")
    with pytest.raises(ConfigError, match=r"^init_inference: the model's parameters are ZeRO-3 shards \(a training "
                                          r"engine's module, or a model built under partita\.zero\.Init\); generate from"):
        partita.init_inference(model, **FP32)
    with torch.device("meta"):
        meta = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"^init_inference: the model has parameters on the meta device"):
        partita.init_inference(meta, **FP32)


def test_tp_size_above_one_in_a_single_process_says_how_to_launch() -> None:
    with pytest.raises(ConfigError, match=r"^tensor_parallel\.tp_size = 2 does not divide the 1 launched process\(es\); "
                                          r"launch a multiple of 2 processes \(partita run --nproc 2"):
        partita.init_inference(build("llama"), tensor_parallel={"tp_size": 2}, **FP32)
    import torch.distributed as dist

    assert not dist.is_initialized()  # refused before any process group started


# ------------------------------------------------------------------------------ the engine


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gpt"])
def test_forward_and_generate_equal_the_plain_model(kind) -> None:
    want_tokens = greedy(build(kind).eval())
    plain = build(kind).eval()
    x = prompt()
    want_logits = plain(x)
    engine = partita.init_inference(build(kind), **FP32)
    got_logits = engine(x)
    if kind != "gpt":
        want_logits, got_logits = want_logits.logits, got_logits.logits
    else:
        want_logits, got_logits = want_logits[0], got_logits[0]
    assert torch.equal(got_logits, want_logits) and not got_logits.requires_grad
    assert greedy(engine) == want_tokens
    assert engine.mp_world_size == 1 and engine.mp_group is None and engine.tp_rank == 0
    assert engine.dtype is torch.float32 and not engine.module.training


def test_the_engine_falls_through_to_the_module_and_casts_to_dtype() -> None:
    model = build("llama")
    engine = partita.init_inference(model, dtype="bf16")
    assert engine.module is model and engine.config is model.config
    assert engine.get_input_embeddings() is model.get_input_embeddings()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and engine.dtype is torch.bfloat16
    default = partita.init_inference(build("llama"))
    assert {p.dtype for p in default.module.parameters()} == {torch.float16}  # DeepSpeed's default dtype
    assert partita.InferenceEngine is type(engine) and partita.DeepSpeedInferenceConfig is type(engine._config)


def test_engine_compile_is_deepspeeds_whole_module_compile() -> None:
    engine = partita.init_inference(build("gpt"), **FP32)
    x = prompt()
    want = engine(x)[0]
    torch._dynamo.reset()
    engine.compile(backend="eager")
    assert engine.is_compiled and torch.equal(engine(x)[0], want)
    torch._dynamo.reset()


def test_generate_refuses_more_tokens_than_max_out_tokens() -> None:
    engine = partita.init_inference(build("llama"), max_tokens=10, **FP32)
    x = prompt()
    assert len(engine.generate(x, max_new_tokens=5, attention_mask=torch.ones_like(x))[0]) == 10
    with pytest.raises(ValueError, match=r"^generate asks for 11 tokens \(5 prompt \+ 6 new\) but max_out_tokens is 10; "
                                         r"pass max_out_tokens=11 \(DeepSpeed's max_tokens\) to init_inference, or ask "
                                         r"for fewer tokens$"):
        engine.generate(x, max_new_tokens=6)
    with pytest.raises(ValueError, match=r"^generate asks for 12 tokens \(max_length 12, prompt 5\)"):
        engine.generate(input_ids=x, max_length=12)
    gpt = partita.init_inference(build("gpt"), max_out_tokens=8, **FP32)
    with pytest.raises(ValueError, match=r"^generate asks for 9 tokens \(5 prompt \+ 4 new\)"):
        gpt.generate(x, 4)
    with pytest.raises(AttributeError, match=r"^Sequential has no generate\(\); call the engine"):
        partita.init_inference(torch.nn.Sequential(torch.nn.Linear(2, 2)), **FP32).generate(x)


def test_enable_cuda_graph_on_cpu_warns_and_decodes_eagerly() -> None:
    want = greedy(build("llama").eval())
    with pytest.warns(UserWarning, match=r"^init_inference: enable_cuda_graph=True has no effect on cpu \(CUDA graphs "
                                         r"need a CUDA device\); decoding runs eagerly, as DeepSpeed does off CUDA$"):
        engine = partita.init_inference(build("llama"), enable_cuda_graph=True, **FP32)
    assert greedy(engine) == want
    assert engine.module.generation_config.cache_implementation is None


def test_compiled_decoding_captures_the_decode_step_whole_and_decodes_the_same_tokens() -> None:
    # The CUDA path's code on CPU: dynamo traces the decode step into one graph (fullgraph=True;
    # a graph break would raise) and the eager backend runs it as traced (no code generation).
    # A generation config of the caller's keeps the static cache and the compiled decoding
    # (transformers fills its unset fields from the module's).
    from torch._dynamo.utils import counters

    want = greedy(build("llama").eval())
    engine = partita.init_inference(build("llama"), **FP32)
    torch._dynamo.reset()
    counters.clear()
    engine._enable_compiled_decoding(backend="eager")
    x = prompt()
    config = transformers.GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = engine.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
    assert got.tolist() == want
    assert counters["stats"]["unique_graphs"] == 1  # prefill runs eagerly; every decode step is the one graph
    # A call the static loop does not implement runs the model's own generate, with the same tokens.
    beams = engine.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False, num_beams=1,
                            output_scores=True, return_dict_in_generate=True)
    assert beams.sequences.tolist() == want
    torch._dynamo.reset()


def test_compiled_reference_gpt_reuses_one_kv_cache_per_batch_size() -> None:
    from torch._dynamo.utils import counters

    want = greedy(build("gpt").eval())
    engine = partita.init_inference(build("gpt"), max_out_tokens=16, **FP32)
    torch._dynamo.reset()
    counters.clear()
    engine._enable_compiled_decoding(mode=None, backend="eager")
    assert greedy(engine) == want and greedy(engine) == want
    [cache] = engine._decode_caches.values()
    assert cache.max_len == 16 and counters["stats"]["unique_graphs"] == 1  # the second call reused the graph
    torch._dynamo.reset()


# ------------------------------------------------------------------------------ checkpoints


def test_checkpoint_paths_that_hold_no_weights_are_named(tmp_path) -> None:
    with pytest.raises(CheckpointError, match=r"^checkpoint '.*nowhere' does not exist: give a partita checkpoint"):
        partita.init_inference(build("llama"), checkpoint=tmp_path / "nowhere", **FP32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"^checkpoint '.*empty' is neither a partita checkpoint \(no meta\.json or "
                                              r"'latest'\) nor weights \(no \*\.safetensors"):
        partita.init_inference(build("llama"), checkpoint="empty", base_dir=str(tmp_path), **FP32)
    (tmp_path / "ckpt.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"^checkpoint '.*ckpt\.json' is a JSON file: DeepSpeed's checkpoint "
                                              r"descriptions \(a list of Megatron / ds_model files\) are not read"):
        partita.init_inference(build("llama"), checkpoint=tmp_path / "ckpt.json", **FP32)


def test_weights_of_another_model_are_a_mismatch_listing_the_tensors(tmp_path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in build("llama_kv2").state_dict().items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointMismatchError, match=r"^checkpoint .* does not fit LlamaForCausalLM: \d+ model "
                                                      r"tensor\(s\) not in the checkpoint: model\.layers\.1\..*; \d+ of "
                                                      r"other shapes: model\.embed_tokens\.weight: model \[96, 64\], "
                                                      r"checkpoint \[96, 32\]"):
        partita.init_inference(build("llama"), checkpoint=tmp_path, **FP32)


def test_safetensors_weights_load_into_a_fresh_model(tmp_path) -> None:
    from safetensors.torch import save_file

    trained = build("gpt2", seed=3).eval()
    state = trained.state_dict()
    state.pop("lm_head.weight")  # tied to the embedding: Hugging Face stores it once
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    engine = partita.init_inference(build("gpt2", seed=0), checkpoint=str(tmp_path), **FP32)
    assert greedy(engine) == greedy(trained)


def test_torch_saved_weights_load_too(tmp_path) -> None:
    trained = build("gpt2", seed=3).eval()
    torch.save(trained.state_dict(), tmp_path / "pytorch_model.bin")  # tied weights under both names
    engine = partita.init_inference(build("gpt2", seed=0), checkpoint=tmp_path / "pytorch_model.bin", **FP32)
    assert greedy(engine) == greedy(trained)


# ------------------------------------------------------------------------------ int8 and streamed weights


def test_int8_dtype_quantizes_the_linear_weights_and_generates() -> None:
    pytest.importorskip("torchao")
    from partita.inference.quantize import quantized_nbytes

    full = quantized_nbytes(build("llama"))
    engine = partita.init_inference(build("llama"), dtype=torch.int8)
    weight = engine.module.model.layers[0].self_attn.q_proj.weight
    assert type(weight).__module__.startswith("torchao") and quantized_nbytes(engine.module) < full
    assert engine.module.lm_head.weight.dtype is torch.float32  # float parts keep the model's dtype
    assert len(greedy(engine)[0]) == 5 + 6


def test_zero3_offload_param_streams_the_blocks_from_host_memory() -> None:
    want = greedy(build("llama").eval())
    engine = partita.init_inference(build("llama"), zero={"stage": 3, "offload_param": {"device": "cpu"}}, **FP32)
    assert engine.host_stream is not None and engine.host_stream.nbytes_on_host() > 0
    assert greedy(engine) == want
    assert sum(engine.host_stream.counters.fetches) > 0
