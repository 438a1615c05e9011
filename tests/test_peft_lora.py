"""LoRA (peft) on a partita engine at ZeRO 0-3, 2 ranks: training, saves, merges, refusals.

The oracle is single-process peft + torch AdamW on the same seeded tiny Llama and the same global
batches. Under ZeRO-3 the base is built both whole and under ``partita.zero.Init`` (then it stays
sharded). ``modules_to_save`` (the LM head) trains beside the adapters. Saves are read back with
``PeftModel.from_pretrained`` in this process; merges are compared with peft's
``merge_and_unload`` of the unsharded model holding the same adapters.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import run_distributed

VOCAB, SEQ, GLOBAL_BATCH, STEPS, LR, DECAY, CLIP = 64, 8, 4, 3, 1e-2, 0.1, 1.0
# (name, ZeRO stage, built under zero.Init)
RUNS = (("z0", 0, False), ("z1", 1, False), ("z2", 2, False), ("z3", 3, False), ("z3init", 3, True))


def _llama(hidden: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def _lora(**kw):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                      modules_to_save=["lm_head"], **kw)


def _batches() -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _config(stage: int) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": DECAY}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }


def _initialize(model, config: dict):
    import partita

    engine, _, _, _ = partita.initialize(model=model, config=config,
                                         model_parameters=[p for p in model.parameters() if p.requires_grad])
    return engine


def _train(engine) -> None:
    """STEPS steps, each rank on its half of the global batch."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for batch in _batches():
        micro = batch[rank * 2 : rank * 2 + 2]
        loss = engine(input_ids=micro, labels=micro).loss
        engine.backward(loss)
        engine.step()


def _run(name: str, stage: int, use_init: bool, save_dir: str) -> dict:
    import torch.distributed as dist

    import partita
    from partita.integrations import peft_support

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if use_init:
        with partita.zero.Init(config_dict_or_path=_config(stage)):
            base = _llama()
    else:
        base = _llama()
    model = peft_support.get_peft_model(base, _lora())
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    engine = _initialize(model, _config(stage))
    names = {id(p): n for n, p in model.named_parameters()}
    groups = engine.zero.optimizer.groups
    out = {
        "in_groups": sorted(names[id(p)] for g in groups for p in g.params),
        "trainable": sorted(trainable),
        "master_numel": sum(g.master.numel() for g in groups),
        # What this rank's share of the adapters is: a ceil(numel / world) shard each (stage 0: all).
        "adapter_share": sum(p.numel() if stage == 0 else math.ceil(p.numel() / world) for p in trainable.values()),
    }
    if stage == 3:
        frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        out["base_sharded"] = [engine.zero.gatherer.is_sharded_param(p) for _, p in frozen]
        out["base_with_storage"] = [n for n, p in frozen if p.untyped_storage().nbytes() > 0]
    _train(engine)
    out["state_numel"] = sum(s["exp_avg"].numel() for s in engine.zero.optimizer.inner.state.values())
    out["adapters"] = peft_support.adapter_state_dict(engine)
    peft_support.save_adapters(model, f"{save_dir}/{name}", engine=engine)
    out["merged"] = peft_support.merged_state_dict(engine)
    out["merged_again"] = peft_support.merged_state_dict(engine)  # the engine's model was left as it was
    if stage == 3:
        engine.save_16bit_model(f"{save_dir}/{name}", "model.safetensors")
        # peft's own save_pretrained: refused outside the gathered block (no empty files), whole inside it.
        try:
            model.save_pretrained(f"{save_dir}/{name}-bare-{rank}")
            out["bare_save"] = "saved"
        except RuntimeError as err:
            out["bare_save"] = type(err).__name__
        with peft_support.gathered_adapters(engine) as gathered:
            gathered.save_pretrained(f"{save_dir}/{name}-peft", is_main_process=rank == 0)
        dist.barrier()
    # Training goes on after the saves and merges (nothing was left gathered or changed).
    micro = _batches()[0][rank * 2 : rank * 2 + 2]
    loss = engine(input_ids=micro, labels=micro).loss
    engine.backward(loss)
    engine.step()
    out["loss_after"] = float(loss.detach())
    if stage == 3:
        out["gathered_after"] = engine.zero.gatherer.num_gathered()
    return out


def _run_whole_adapters(save_dir: str) -> dict:
    """ZeRO-3 with the persistence threshold at whole_adapters_threshold: the adapters are never
    sharded, and peft's bare save_pretrained on rank 0 alone writes them whole."""
    import torch.distributed as dist
    from peft import LoraConfig

    from partita.integrations import peft_support

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = peft_support.get_peft_model(_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    config = _config(3)
    threshold = peft_support.whole_adapters_threshold(model)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = threshold
    engine = _initialize(model, config)
    _train(engine)
    if rank == 0:
        model.save_pretrained(f"{save_dir}/whole-bare")  # one rank, no gather
    dist.barrier()
    adapters = [p for p in model.parameters() if p.requires_grad]
    whole = [not engine.zero.gatherer.is_sharded_param(p) and p.untyped_storage().nbytes() > 0 for p in adapters]
    return {"threshold": threshold, "adapters": peft_support.adapter_state_dict(engine), "whole": whole}


def _run_bf16_merge() -> dict:
    """bf16 at ZeRO-3: the fp32 merge from the masters, and the masters to check it against."""
    from partita.integrations import peft_support

    torch.manual_seed(0)
    model = peft_support.get_peft_model(_llama(), _lora())
    config = {**_config(3), "bf16": {"enabled": True}}
    engine = _initialize(model, config)
    _train(engine)
    return {"fp32": engine.get_fp32_state_dict(), "merged_fp32": peft_support.merged_state_dict(engine, fp32=True),
            "merged": peft_support.merged_state_dict(engine)}


def _load_4bit(base_dir: str):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=quantization, device_map="cpu")


def _run_qlora(base_dir: str, save_dir: str) -> dict:
    """QLoRA at ZeRO-3: a bitsandbytes 4-bit base (bitsandbytes runs 4-bit on the CPU)."""
    from partita.integrations import peft_support

    base = _load_4bit(base_dir)
    torch.manual_seed(0)
    model = peft_support.get_peft_model(base, _lora())  # checks the device for 4-bit kernels
    engine = _initialize(model, _config(3))
    packed = [p for p in model.parameters() if type(p).__name__ == "Params4bit"]
    _train(engine)
    peft_support.save_adapters(engine, f"{save_dir}/qlora")
    return {"adapters": peft_support.adapter_state_dict(engine), "packed": len(packed),
            "packed_whole": all(p.untyped_storage().nbytes() > 0 for p in packed)}


def _body(save_dir: str, base_dir: str) -> dict:
    from partita.distributed.init import init_distributed

    init_distributed()
    out = {name: _run(name, stage, use_init, save_dir) for name, stage, use_init in RUNS}
    out["whole"] = _run_whole_adapters(save_dir)
    out["bf16"] = _run_bf16_merge()
    out["qlora"] = _run_qlora(base_dir, save_dir)
    out["refusals"] = _refusals()
    return out


def _reference():
    """Single-process peft + torch AdamW (clipped) on the global batches; returns (model, initial adapter state)."""
    import peft

    torch.manual_seed(0)
    model = peft.get_peft_model(_llama(), _lora())
    initial = {k: v.clone() for k, v in peft.get_peft_model_state_dict(model).items()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=DECAY)
    for batch in _batches():
        model(input_ids=batch, labels=batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return model, initial


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    # The QLoRA run loads it in 4 bits (hidden 64: bitsandbytes' CPU 4-bit path fails on a 16-wide k_proj).
    _llama(hidden=64).save_pretrained(save_dir / "base")
    return save_dir, run_distributed(_body, 2, str(save_dir), str(save_dir / "base"), timeout=300)


@pytest.fixture(scope="module")
def reference() -> dict:
    import peft

    model, initial = _reference()
    trained = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # each rank's micro-batch of step 0, after the 3 steps (the runs' loss_after)
        halves = [_batches()[0][r * 2 : r * 2 + 2] for r in range(2)]
        losses = [float(model(input_ids=h, labels=h).loss) for h in halves]
    return {"initial": initial, "adapters": trained, "full": full, "losses": losses,
            "merged": model.merge_and_unload().state_dict()}


def test_lora_trains_like_single_process_peft_at_every_stage(world2, reference) -> None:
    _, per_rank = world2
    initial, want = reference["initial"], reference["adapters"]
    assert any("modules_to_save" in k or k.endswith("lm_head.weight") for k in want)
    for name, stage, _ in RUNS:
        for rank, out in enumerate(per_rank):
            run = out[name]
            # Only the adapters and the LM head copy are under ZeRO: masters and optimizer state of their share.
            assert run["in_groups"] == run["trainable"], (name, rank)
            assert not any("base_layer" in n or "original_module" in n for n in run["in_groups"])
            assert run["master_numel"] == run["adapter_share"] == run["state_numel"], (name, rank, run["master_numel"])
        adapters = per_rank[0][name]["adapters"]
        assert per_rank[1][name]["adapters"] == {}  # rank 0's
        assert sorted(adapters) == sorted(want), name
        for key, value in want.items():
            assert adapters[key].shape == value.shape and adapters[key].numel() > 0, (name, key)
            assert not torch.equal(value, initial[key]), (name, key)  # it trained
            assert _rel(adapters[key], value) < 1e-5, (name, key, _rel(adapters[key], value))
    z3, z3init = per_rank[0]["z3"], per_rank[0]["z3init"]
    assert not any(z3["base_sharded"]) and len(z3["base_with_storage"]) == len(z3["base_sharded"])  # whole, as documented
    assert all(z3init["base_sharded"]) and z3init["base_with_storage"] == []  # under zero.Init: sharded, no storage
    for rank, out in enumerate(per_rank):
        assert out["z3"]["gathered_after"] == 0 and out["z3init"]["gathered_after"] == 0
        # The step after the saves and merges starts from the trained weights (nothing was left merged or gathered).
        for name, _, _ in RUNS:
            assert abs(out[name]["loss_after"] - reference["losses"][rank]) < 1e-5, (name, rank)


def test_saved_adapters_load_whole_and_equal(world2) -> None:
    from peft import PeftModel, get_peft_model_state_dict

    save_dir, per_rank = world2
    for name, stage, _ in RUNS:
        saved = load_file(str(save_dir / name / "adapter_model.safetensors"))
        adapters = per_rank[0][name]["adapters"]
        assert sorted(saved) == sorted(adapters), name
        assert any("lm_head" in k for k in saved)  # modules_to_save saved
        for key, value in saved.items():
            assert value.numel() > 0 and torch.equal(value, adapters[key]), (name, key)
        torch.manual_seed(5)  # other base weights: only the base loads from here, the adapters from the file
        loaded = PeftModel.from_pretrained(_llama(), str(save_dir / name))
        for key, value in get_peft_model_state_dict(loaded).items():
            assert torch.equal(value, adapters[key]), (name, key)
    for name in ("z3", "z3init"):  # peft's own save_pretrained inside gathered_adapters: the same files
        assert per_rank[0][name]["bare_save"] == "ParameterNotGatheredError"
        peft_saved = load_file(str(save_dir / f"{name}-peft" / "adapter_model.safetensors"))
        ours = load_file(str(save_dir / name / "adapter_model.safetensors"))
        assert sorted(peft_saved) == sorted(ours) and all(torch.equal(peft_saved[k], ours[k]) for k in ours)


def test_merge_equals_unsharded_merge(world2, reference) -> None:
    from peft import PeftModel

    save_dir, per_rank = world2
    torch.manual_seed(0)
    base_state = _llama().state_dict()
    ref_merged = reference["merged"]
    for name, _, _ in RUNS:
        merged = per_rank[0][name]["merged"]
        assert per_rank[1][name]["merged"] == {}
        # The unsharded merge of the same adapters: peft's merge_and_unload in one process.
        torch.manual_seed(0)
        unsharded = PeftModel.from_pretrained(_llama(), str(save_dir / name)).merge_and_unload().state_dict()
        assert sorted(merged) == sorted(unsharded) == sorted(base_state), name
        for key, value in unsharded.items():
            assert torch.equal(merged[key], value), (name, key)
            assert torch.equal(per_rank[0][name]["merged_again"][key], value), (name, key)
            assert _rel(merged[key], ref_merged[key]) < 1e-5, (name, key)
        assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                               base_state["model.layers.0.self_attn.q_proj.weight"])


def test_save_16bit_model_of_a_peft_model_at_zero3_is_whole(world2, reference) -> None:
    save_dir, per_rank = world2
    want = reference["full"]
    for name in ("z3", "z3init"):
        saved = load_file(str(save_dir / name / "model.safetensors"))
        assert sorted(saved) == sorted(want), name
        for key, value in want.items():
            assert saved[key].shape == value.shape and saved[key].numel() > 0, (name, key)
            assert _rel(saved[key], value) < 1e-5, (name, key)


# ------------------------------------------------------------------------------ refusals (one process)
def test_refusals_name_the_problem_and_the_fix(tmp_path, monkeypatch) -> None:
    from partita.config.base import ConfigError
    from partita.integrations import peft_support

    with pytest.raises(TypeError, match=r"^save_adapters needs a peft.PeftModel \(or the partita engine training one\), "
                       r"got LlamaForCausalLM; build it with partita.integrations.peft_support.get_peft_model"):
        peft_support.save_adapters(_llama(), tmp_path)
    model = peft_support.get_peft_model(_llama(), _lora())
    with pytest.raises(ValueError, match=r"^save_adapters sets state_dict= itself \(the gathered adapters, rank 0 "
                       r"writes\); drop state_dict=$"):
        peft_support.save_adapters(model, tmp_path, state_dict={})
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear4bit(32, 16, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(16, 32), requires_grad=False, quant_type="nf4").to("cpu")
    peft_support.check_quantized_base(layer, "cpu")  # bitsandbytes runs 4-bit on the CPU: allowed

    def no_kernels(*args, **kwargs):
        raise NotImplementedError("no 4-bit kernels for this backend")

    monkeypatch.setattr(bnb.functional, "quantize_4bit", no_kernels)  # a device bitsandbytes has no kernels for
    with pytest.raises(ConfigError) as err:
        peft_support.check_quantized_base(layer, "cpu")
    assert str(err.value) == (
        "QLoRA: the base has 1 bitsandbytes-quantized parameters (e.g. 'weight'), and bitsandbytes cannot run 4-bit "
        "weights on cpu (NotImplementedError: no 4-bit kernels for this backend); train on a device bitsandbytes "
        "supports (CUDA or the CPU), or load the base unquantized (torch_dtype=torch.bfloat16, no "
        "quantization_config) and shard it with ZeRO-3 under partita.zero.Init instead"
    )


def _refusals() -> dict:
    """Refusals that need a model built under zero.Init, or an engine (run inside ``_body``)."""
    import partita
    from partita.config.base import ConfigError
    from partita.integrations import peft_support

    out = {}
    with partita.zero.Init(config_dict_or_path=_config(3)):
        base = _llama()
    try:
        peft_support.get_peft_model(base, _lora(init_lora_weights="pissa"))
    except ConfigError as err:
        out["pissa"] = str(err)
    model = peft_support.get_peft_model(base, _lora())
    partita.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                       config=_config(3))
    try:
        peft_support.get_peft_model(model.get_base_model(), _lora())
    except ConfigError as err:
        out["after_initialize"] = str(err)
    return out


def test_refusals_under_zero3(world2) -> None:
    out = world2[1][0]["refusals"]
    assert out["pissa"] == (
        "get_peft_model: init_lora_weights='pissa' rewrites the base weights while it builds the adapters, and this "
        "base was built under partita.zero.Init (each rank holds a shard); build the base without zero.Init for this "
        "initialisation, or use init_lora_weights=True (the default) or 'gaussian'"
    )
    assert out["after_initialize"] == (
        "get_peft_model: a partita engine already trains this model, and its optimizer state and ZeRO-3 units were "
        "built without the adapters; apply PEFT first, then call partita.initialize on the PeftModel"
    )


def test_qlora_at_zero3_trains_like_single_process_peft(world2) -> None:
    import peft

    save_dir, per_rank = world2
    base = _load_4bit(str(save_dir / "base"))
    torch.manual_seed(0)
    model = peft.get_peft_model(base, _lora())
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=DECAY)
    for batch in _batches():
        model(input_ids=batch, labels=batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        optimizer.step()
        optimizer.zero_grad()
    want = peft.get_peft_model_state_dict(model)
    run = per_rank[0]["qlora"]
    assert run["packed"] == 14 and all(out["qlora"]["packed_whole"] for out in per_rank)  # 4-bit base: whole per rank
    saved = load_file(str(save_dir / "qlora" / "adapter_model.safetensors"))
    assert sorted(run["adapters"]) == sorted(want) == sorted(saved)
    for key, value in want.items():
        assert saved[key].numel() > 0 and torch.equal(saved[key], run["adapters"][key]), key
        assert _rel(run["adapters"][key], value) < 1e-5, (key, _rel(run["adapters"][key], value))


def _dora_body(save_dir: str) -> dict:
    """DoRA on a base built under zero.Init: peft reads each base weight's norm while it builds the
    adapters (its own ZeRO-3 gather, served by partita). Its own launch: a transformers model built
    in a second zero.Init context of a process lacks its kernels' state (reported to the lead), and
    ``_body`` builds one already."""
    import partita
    from partita.distributed.init import init_distributed
    from partita.integrations import peft_support

    init_distributed()
    torch.manual_seed(0)
    with partita.zero.Init(config_dict_or_path=_config(3)):
        base = _llama()
    model = peft_support.get_peft_model(base, _lora(use_dora=True))
    engine = _initialize(model, _config(3))
    _train(engine)
    peft_support.save_adapters(engine, f"{save_dir}/dora")
    return {"adapters": peft_support.adapter_state_dict(engine), "merged": peft_support.merged_state_dict(engine)}


def test_dora_on_a_zero_init_base_trains_saves_and_merges(tmp_path) -> None:
    import peft

    out = run_distributed(_dora_body, 2, str(tmp_path), timeout=300)[0]
    torch.manual_seed(0)
    model = peft.get_peft_model(_llama(), _lora(use_dora=True))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=DECAY)
    for batch in _batches():
        model(input_ids=batch, labels=batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        optimizer.step()
        optimizer.zero_grad()
    want = peft.get_peft_model_state_dict(model)
    assert any("lora_magnitude_vector" in k for k in want)
    assert sorted(out["adapters"]) == sorted(want)
    for key, value in want.items():
        assert _rel(out["adapters"][key], value) < 1e-5, (key, _rel(out["adapters"][key], value))
    torch.manual_seed(0)
    unsharded = peft.PeftModel.from_pretrained(_llama(), str(tmp_path / "dora")).merge_and_unload().state_dict()
    assert sorted(out["merged"]) == sorted(unsharded)
    for key, value in unsharded.items():
        assert torch.equal(out["merged"][key], value), key


def test_whole_adapters_threshold_makes_peft_save_pretrained_whole(world2) -> None:
    from peft import PeftModel, get_peft_model_state_dict

    save_dir, per_rank = world2
    run = per_rank[0]["whole"]
    assert run["threshold"] == 4 * 32  # r x hidden: every lora_A and lora_B of q_proj and v_proj
    assert len(run["whole"]) == 8 and all(run["whole"])  # at threshold 0 (run z3) they are sharded and refuse
    saved = load_file(str(save_dir / "whole-bare" / "adapter_model.safetensors"))
    assert sorted(saved) == sorted(run["adapters"]) and len(saved) == 8
    for key, value in run["adapters"].items():
        assert saved[key].numel() > 0 and torch.equal(saved[key], value), key
    torch.manual_seed(0)
    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(_llama(), str(save_dir / "whole-bare")))
    assert all(torch.equal(loaded[k], v) for k, v in run["adapters"].items())


def test_fp32_merge_of_a_bf16_engine_equals_the_fp32_unsharded_merge(world2) -> None:
    import peft

    run = world2[1][0]["bf16"]
    assert world2[1][1]["bf16"]["merged_fp32"] == {}
    torch.manual_seed(0)
    unsharded = peft.get_peft_model(_llama(), _lora())  # fp32, loaded with the engine's fp32 weights (masters)
    unsharded.load_state_dict({k: run["fp32"][k] for k in unsharded.state_dict()})  # (it also lists non-persistent buffers)
    want = unsharded.merge_and_unload().state_dict()
    assert sorted(run["merged_fp32"]) == sorted(want) == sorted(run["merged"])
    for key, value in want.items():
        assert run["merged_fp32"][key].dtype == torch.float32 and torch.equal(run["merged_fp32"][key], value), key
        assert run["merged"][key].dtype == torch.bfloat16, key
        assert _rel(run["merged"][key], value) < 1e-2, key  # the bf16 merge: within bf16's rounding
