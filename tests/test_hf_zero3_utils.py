"""Hugging Face's ZeRO-3 utilities on a partita ZeRO-3 model (partita.integrations.hf_zero3).

With ``enable_zero3(config)`` on, transformers' own ZeRO-3 code runs on partita at 1 and 2 gloo
ranks, for GPT-2 (tied head) and Llama (untied head) saved with ``save_pretrained``:

- ``from_pretrained`` builds under partita's ``zero.Init`` (every parameter leaves it sharded)
  and loads through ``GatheredParameters(modifier_rank=0)``: gathered, the weights equal the
  saved ones exactly, and the generation config comes along;
- ``resize_token_embeddings`` (mean-resizing, then ``pad_to_multiple_of`` with
  ``mean_resizing=False``) gives exactly what the same calls with the same seeds give on the
  unsharded model; ``initialize`` then trains the resized model as single-process torch does;
  a resize after ``initialize`` is refused and leaves the model as it was;
- ``generate`` with transformers' default ``synced_gpus`` (on under ZeRO-3) where the ranks stop
  at different lengths returns, per rank, the unsharded model's greedy output;
- ``save_pretrained`` of the model before ``initialize`` and of the engine (16-bit and fp32
  masters) writes folders that plain ``from_pretrained`` loads to the same values;
- closing the hook takes the ``deepspeed`` alias out of ``sys.modules`` and turns the flag off.

A second 2-rank run loads a larger model and reads each rank's peak resident memory during
``from_pretrained``: the rank that reads no checkpoint stays far below one whole copy.
"""

from __future__ import annotations

import os
import shutil
import sys
import types

import pytest

pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

from tests.harness import run_distributed  # noqa: E402
from tests.test_hf_models import _build  # noqa: E402,F401 - the same tiny GPT-2 / Llama (VOCAB 96, SEQ 16)

FAMILIES = ("gpt2", "llama")
VOCAB, SEQ, LR, EPS = 96, 16, 5e-3, 1e-6
RESIZED = VOCAB + 5  # mean-resizing adds 5 rows; pad_to_multiple_of=8 then pads to 104
PADDED = 104
MAX_NEW = (2, 5)
MISSING = ("transformer.h.0.mlp.c_fc.weight", "transformer.h.1.attn.c_attn.bias")  # left out of one saved file  # tokens generated on rank 0 and rank 1: the ranks finish at different steps
CONFIG = {
    "train_batch_size": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": EPS, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "steps_per_print": 1000,
}


def _config(world: int) -> dict:
    return {**CONFIG, "train_micro_batch_size_per_gpu": 2 // world}


def _batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    start = torch.randint(0, VOCAB, (2, 1), generator=gen)
    return (start + torch.arange(SEQ)) % RESIZED  # touches the added rows too


def _prompts() -> torch.Tensor:
    return torch.tensor([[5, 17, 33], [60, 2, 91]])


def _whole(model: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor] | None:
    """Every state_dict entry gathered (every rank must call), cloned to CPU where ``keep``."""
    import deepspeed  # the alias enable_zero3 installed: transformers' own spelling

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone().cpu() for k, v in model.state_dict().items()} if keep else None


def _client(saved: dict[str, str], out_dir: str) -> dict:
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    import partita
    from partita.integrations.hf_gathered import GatheredParameters
    from partita.integrations.hf_zero3 import enable_zero3, save_pretrained

    partita.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _config(world)
    keep = rank == 0
    results: dict = {}
    with enable_zero3(cfg) as hook:
        results["flag_on"] = is_deepspeed_zero3_enabled()
        results["alias"] = sys.modules["deepspeed"].zero.GatheredParameters is GatheredParameters
        for family in FAMILIES:
            r: dict = {}
            model = AutoModelForCausalLM.from_pretrained(saved[family])
            r["all_sharded"] = all(p.numel() > 0 and p.untyped_storage().nbytes() == 0 for p in model.parameters())
            r["loaded"] = _whole(model, keep)
            r["generation_config"] = model.generation_config.to_diff_dict()
            save_pretrained(model, os.path.join(out_dir, f"pre-{family}"))
            torch.manual_seed(11)
            model.resize_token_embeddings(RESIZED)
            r["resized"] = _whole(model, keep)
            torch.manual_seed(12)
            model.resize_token_embeddings(None, pad_to_multiple_of=8, mean_resizing=False)
            r["padded"] = _whole(model, keep)
            r["vocab_size"] = model.config.vocab_size
            r["tied"] = model.lm_head.weight is model.get_input_embeddings().weight
            engine, _, _, _ = partita.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            ids = _batch()
            lo, hi = rank * (2 // world), (rank + 1) * (2 // world)
            losses = []
            for _ in range(2):
                out = engine(input_ids=ids[lo:hi], labels=ids[lo:hi])
                engine.backward(out.loss)
                engine.step()
                losses.append(float(out.loss.detach()))
            r["losses"] = losses
            r["trained"] = _whole(model, keep)
            try:
                model.resize_token_embeddings(PADDED + 8)
                r["late_resize"] = None
            except NotImplementedError as e:
                r["late_resize"] = str(e)
            r["after_late_resize"] = (model.config.vocab_size, tuple(_whole(model)["lm_head.weight"].shape))
            engine.eval()
            with torch.no_grad():
                r["generated"] = model.generate(_prompts()[rank:rank + 1], max_new_tokens=MAX_NEW[rank],
                                                do_sample=False).tolist()
                r["generated_default"] = model.generate(_prompts()[rank:rank + 1]).tolist()  # generation_config's
            save_pretrained(engine, os.path.join(out_dir, f"engine16-{family}"))
            save_pretrained(engine, os.path.join(out_dir, f"engine32-{family}"), fp32=True)
            results[family] = r
            del engine, model
        torch.manual_seed(4)
        results["missing"] = _whole(AutoModelForCausalLM.from_pretrained(saved["gpt2-missing"]), keep)
        torch.manual_seed(3)
        results["from_config"] = _whole(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(saved["gpt2"])))
        results["hook_closed_early"] = hook.closed
    results["flag_off"] = not is_deepspeed_zero3_enabled()
    results["alias_gone"] = "deepspeed" not in sys.modules
    return results


def _reference(family: str, saved: str, world: int) -> dict:
    """The same calls on the unsharded model, one process, the global batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved)
    loaded = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(11)
    model.resize_token_embeddings(RESIZED)
    resized = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(12)
    model.resize_token_embeddings(None, pad_to_multiple_of=8, mean_resizing=False)
    padded = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.01)
    losses = []
    for _ in range(2):
        loss = model(input_ids=_batch(), labels=_batch()).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    model.eval()
    with torch.no_grad():
        generated = [model.generate(_prompts()[r:r + 1], max_new_tokens=MAX_NEW[r], do_sample=False).tolist()
                     for r in range(world)]
        generated_default = [model.generate(_prompts()[r:r + 1]).tolist() for r in range(world)]
    return {"loaded": loaded, "resized": resized, "padded": padded, "losses": losses,
            "trained": {k: v.detach().clone() for k, v in model.state_dict().items()}, "generated": generated,
            "generated_default": generated_default}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf_zero3_saved")
    out = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        model = _build(family)
        model.generation_config.max_new_tokens = 3  # generate() without arguments must use it
        model.generation_config.do_sample = False
        model.save_pretrained(root / family)
        out[family] = str(root / family)
    # GPT-2 with two entries missing from the file: from_pretrained initialises them.
    from safetensors.torch import load_file, save_file

    state = load_file(root / "gpt2" / "model.safetensors")
    del state[MISSING[0]], state[MISSING[1]]
    shutil.copytree(root / "gpt2", root / "gpt2-missing")
    save_file(state, root / "gpt2-missing" / "model.safetensors", metadata={"format": "pt"})
    out["gpt2-missing"] = str(root / "gpt2-missing")
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def run(request, saved, tmp_path_factory) -> tuple[int, list[dict], str]:
    world = request.param
    out = tmp_path_factory.mktemp(f"hf_zero3_out{world}")
    return world, run_distributed(_client, world, saved, str(out), timeout=500), str(out)


@pytest.fixture(scope="module")
def references(saved) -> dict:
    return {(family, world): _reference(family, saved[family], world) for family in FAMILIES for world in (1, 2)}


def _equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape and torch.equal(got[name], tensor), name


def _close(got: dict, want: dict, rel: float) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        diff = float((got[name].float() - tensor.float()).norm())
        assert diff <= rel * float(tensor.float().norm()) + 1e-7, (name, diff)


def test_the_hook_switches_transformers_zero3_on_and_off(run) -> None:
    _, ranks, _ = run
    for r in ranks:
        assert r["flag_on"] and r["alias"] and not r["hook_closed_early"]
        assert r["flag_off"] and r["alias_gone"]


@pytest.mark.parametrize("family", FAMILIES)
def test_from_pretrained_lands_the_saved_weights_in_zero_init_shards(run, saved, family) -> None:
    from safetensors.torch import load_file

    _, ranks, _ = run
    file = load_file(os.path.join(saved[family], "model.safetensors"))
    loaded = ranks[0][family]["loaded"]
    for r in ranks:
        assert r[family]["all_sharded"]  # built under partita's zero.Init: no rank holds a whole parameter
        assert r[family]["generation_config"]["max_new_tokens"] == 3
    for name, tensor in file.items():
        assert torch.equal(loaded[name], tensor), name
    if family == "gpt2":  # the tied head: not in the file, the embedding's values
        assert torch.equal(loaded["lm_head.weight"], file["transformer.wte.weight"])


def test_from_pretrained_initialises_missing_keys_as_the_unsharded_load(run, saved) -> None:
    from transformers import AutoModelForCausalLM

    _, ranks, _ = run
    torch.manual_seed(4)
    want = AutoModelForCausalLM.from_pretrained(saved["gpt2-missing"]).state_dict()
    _equal(ranks[0]["missing"], dict(want))
    assert float(want[MISSING[0]].std()) > 0.01 and not want[MISSING[1]].any()  # initialised: normal(0.02), zeros


def test_from_config_initialises_on_rank_0_and_every_rank_holds_its_values(run) -> None:
    """transformers' ZeRO-3 from_config builds without initialising, then initialises module by
    module on rank 0 (its own order, so not an unsharded build's random stream): every rank must
    get rank 0's values, and they are an initialisation (the config's std, zero biases, unit norms)."""
    _, ranks, _ = run
    first = ranks[0]["from_config"]
    for r in ranks[1:]:
        _equal(r["from_config"], first)
    assert abs(float(first["transformer.h.0.mlp.c_fc.weight"].std()) - 0.02) < 0.002
    assert not first["transformer.h.0.mlp.c_fc.bias"].any() and bool((first["transformer.ln_f.weight"] == 1).all())


@pytest.mark.parametrize("family", FAMILIES)
def test_resize_token_embeddings_equals_the_unsharded_resize(run, references, family) -> None:
    world, ranks, _ = run
    ref = references[family, world]
    r = ranks[0][family]
    _equal(r["loaded"], ref["loaded"])
    _equal(r["resized"], ref["resized"])
    _equal(r["padded"], ref["padded"])
    assert r["resized"]["lm_head.weight"].shape[0] == RESIZED and r["padded"]["lm_head.weight"].shape[0] == PADDED
    # the added rows are new values (mean-resized, then initialised), not zeros or the old rows
    assert not torch.equal(r["padded"]["lm_head.weight"][RESIZED:], torch.zeros(PADDED - RESIZED, 32))
    for rank in ranks:
        assert rank[family]["vocab_size"] == PADDED
        assert rank[family]["tied"] == (family == "gpt2")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_resized_model_trains_as_single_process_torch(run, references, family) -> None:
    world, ranks, _ = run
    ref = references[family, world]
    global_losses = [sum(vals) / world for vals in zip(*(r[family]["losses"] for r in ranks))]
    for got, want in zip(global_losses, ref["losses"]):
        assert abs(got - want) <= 1e-5 * abs(want), (global_losses, ref["losses"])
    _close(ranks[0][family]["trained"], ref["trained"], 1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_resize_after_initialize_is_refused_and_changes_nothing(run, family) -> None:
    _, ranks, _ = run
    for r in ranks:
        assert "resize_token_embeddings or another module swap after partita.initialize" in r[family]["late_resize"]
        assert "Resize (or swap modules) before initialize" in r[family]["late_resize"]
        assert r[family]["after_late_resize"] == (PADDED, (PADDED, 32))


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_synced_gpus_matches_the_unsharded_model_per_rank(run, references, family) -> None:
    world, ranks, _ = run
    ref = references[family, world]
    for rank, r in enumerate(ranks):
        assert r[family]["generated"] == ref["generated"][rank]
        assert len(r[family]["generated"][0]) == 3 + MAX_NEW[rank]  # greedy, no early stop: the lengths differ
        assert r[family]["generated_default"] == ref["generated_default"][rank]
        assert len(r[family]["generated_default"][0]) == 3 + 3  # the saved generation_config's max_new_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_writes_what_from_pretrained_loads(run, references, family) -> None:
    from transformers import AutoModelForCausalLM

    world, ranks, out = run
    r = ranks[0][family]
    before = AutoModelForCausalLM.from_pretrained(os.path.join(out, f"pre-{family}"))
    _equal(dict(before.state_dict()), r["loaded"])
    assert before.generation_config.max_new_tokens == 3
    for kind in ("engine16", "engine32"):
        after = AutoModelForCausalLM.from_pretrained(os.path.join(out, f"{kind}-{family}"))
        assert after.config.vocab_size == PADDED and after.generation_config.max_new_tokens == 3
        _equal(dict(after.state_dict()), r["trained"])  # fp32 model: the masters are the weights


# ---------------------------------------------------------------------------- one process, no ranks
def test_enable_zero3_refuses_other_stages_a_second_hook_and_a_real_deepspeed() -> None:
    from partita.integrations.hf_zero3 import enable_zero3

    with pytest.raises(ValueError, match="needs a ZeRO-3 config, got zero_optimization.stage=2"):
        enable_zero3({"zero_optimization": {"stage": 2}})
    with enable_zero3({"zero_optimization": {"stage": 3}}):
        with pytest.raises(ValueError, match="already enabled"):
            enable_zero3({"zero_optimization": {"stage": 3}})
    assert "deepspeed" not in sys.modules
    sys.modules["deepspeed"] = types.ModuleType("deepspeed")  # what `import deepspeed` leaves behind
    try:
        with pytest.raises(ValueError, match="the real deepspeed package is imported"):
            enable_zero3({"zero_optimization": {"stage": 3}})
    finally:
        del sys.modules["deepspeed"]


def test_the_alias_answers_what_transformers_imports() -> None:
    import importlib.util

    import partita.accelerator
    import partita.comm
    import partita.zero
    from partita.integrations.hf_zero3 import enable_zero3
    from transformers.integrations import deepspeed_config, is_deepspeed_available

    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    with enable_zero3(config) as hook:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.zero import partition_parameters as pp

        assert deepspeed.zero.Init is partita.zero.Init and deepspeed.comm is partita.comm
        assert get_accelerator is partita.accelerator.get_accelerator
        assert pp.zero_wrapper_for_fp_tensor_constructor(torch.ones) is torch.ones  # constructors stay as they are
        assert deepspeed.initialize is partita.initialize  # any other name: partita's
        assert deepspeed_config() == config and hook._hf_config.is_offload()
        assert importlib.util.find_spec("deepspeed") is not None and not is_deepspeed_available()
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("deepspeed.ops.not_a_module")
    assert deepspeed_config() is None


def test_save_pretrained_refuses_what_it_sets_itself(tmp_path) -> None:
    from partita.integrations.hf_zero3 import save_pretrained

    with pytest.raises(ValueError, match="sets state_dict= itself"):
        save_pretrained(_build("gpt2"), tmp_path, state_dict={})


# ---------------------------------------------------------------------------- host memory of from_pretrained
def _peak_rss_during(fn) -> tuple[object, int]:
    """``fn()``'s result and this process's peak resident memory above its start (bytes): the
    kernel's high-water mark, reset first (Linux /proc/self/clear_refs)."""
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = status("VmRSS:")
    out = fn()
    return out, status("VmHWM:") - start


def _load_and_measure(saved: str, warmup: str) -> dict:
    """Peak resident memory of one ``from_pretrained`` of ``saved`` under the hook on this rank,
    after a warm-up load of the tiny ``warmup`` model (imports and first-use caches not counted);
    then, as the instrument's control, the peak while the whole model is gathered."""
    import ctypes

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import partita
    from partita.integrations.hf_zero3 import enable_zero3

    # Large blocks from mmap, returned to the kernel when freed: the resident size then follows the
    # live bytes (glibc's adaptive threshold would keep freed blocks in its heap and count them).
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    partita.init_distributed()
    with enable_zero3(_config(dist.get_world_size())):
        AutoModelForCausalLM.from_pretrained(warmup)
        model, peak = _peak_rss_during(lambda: AutoModelForCausalLM.from_pretrained(saved))
        freed = all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        _, whole_peak = _peak_rss_during(lambda: _whole(model, keep=False))
        return {"peak": peak, "whole_peak": whole_peak, "freed": freed,
                "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_from_pretrained_under_zero3_holds_no_whole_copy_on_the_ranks_that_read_no_checkpoint(saved, tmp_path) -> None:
    """GPT-2 of 19.4 M parameters (74 MiB in fp32, the largest 4 MiB), 2 ranks. Rank 1 reads no
    checkpoint (transformers gives it meta tensors) and holds its half of the shards plus one
    module's parameters at a time; rank 0 also holds transformers' whole checkpoint dict while
    loading (transformers' ZeRO-3 loader reads the file on rank 0, as under DeepSpeed). The
    control: gathering the whole model afterwards raises the peak by at least its size."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_head=8, n_embd=512, vocab_size=1024, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))
    model.save_pretrained(tmp_path / "big")
    del model
    ranks = run_distributed(_load_and_measure, 2, str(tmp_path / "big"), saved["gpt2"], timeout=500)
    size = ranks[0]["model_bytes"]
    for rank, r in enumerate(ranks):  # MiB, for the record (pytest -s)
        print(f"rank {rank}: model {size / 2**20:.1f} MiB; peak resident growth during from_pretrained "
              f"{r['peak'] / 2**20:.1f} MiB, while gathered whole {r['whole_peak'] / 2**20:.1f} MiB")
    assert all(r["freed"] for r in ranks)
    assert ranks[1]["peak"] < 0.75 * size  # half the shards plus one module: never the whole model
    assert all(r["whole_peak"] > 0.9 * size for r in ranks)  # the instrument sees a whole copy where there is one


# ---------------------------------------------------------------------------- bf16: model dtype and fp32 masters
def _client_bf16(saved: str, out_dir: str) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import partita
    from partita.integrations.hf_zero3 import enable_zero3, save_pretrained

    partita.init_distributed()
    cfg = {**_config(dist.get_world_size()), "bf16": {"enabled": True}}
    keep = dist.get_rank() == 0
    with enable_zero3(cfg):
        model = AutoModelForCausalLM.from_pretrained(saved)
        loaded = _whole(model, keep)
        engine, _, _, _ = partita.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        ids = _batch() % VOCAB
        rank = dist.get_rank()
        out = engine(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1])
        engine.backward(out.loss)
        engine.step()
        weights = _whole(model, keep)
        masters = engine.get_fp32_state_dict()
        save_pretrained(engine, os.path.join(out_dir, "bf16"))
        save_pretrained(engine, os.path.join(out_dir, "fp32"), fp32=True)
    return {"loaded": loaded, "weights": weights, "masters": masters if keep else None}


def test_save_pretrained_of_a_bf16_engine_writes_its_weights_or_its_fp32_masters(saved, tmp_path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    r = run_distributed(_client_bf16, 2, saved["gpt2"], str(tmp_path), timeout=500)[0]
    file = load_file(os.path.join(saved["gpt2"], "model.safetensors"))
    for name, tensor in file.items():  # zero.Init built the model in the config's dtype
        assert r["loaded"][name].dtype == torch.bfloat16 and torch.equal(r["loaded"][name], tensor.bfloat16()), name
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert bf16.dtype == torch.bfloat16
    _equal(dict(bf16.state_dict()), r["weights"])
    fp32 = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32)
    _equal(dict(fp32.state_dict()), r["masters"])
    assert any(not torch.equal(r["masters"][n].bfloat16().float(), r["masters"][n]) for n in r["masters"])  # not bf16 values


# ---------------------------------------------------------------------------- with PartitaTrainer
class _RecordingCollator:
    """Stacks samples and remembers each micro-batch: the Trainer's data order, for the oracle."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def __call__(self, samples: list[dict]) -> dict:
        batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
        self.batches.append(batch["input_ids"].clone())
        return batch


def _trainer_config(world: int) -> dict:
    optimizer = {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": EPS, "weight_decay": 0.0}}
    return {**_config(world), "train_micro_batch_size_per_gpu": 1, "train_batch_size": world, "optimizer": optimizer}


def _trainer_client(saved: str, out_dir: str) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, TrainingArguments

    import partita
    from partita.integrations.hf import PartitaTrainer, enable_zero3

    partita.init_distributed()
    cfg = _trainer_config(dist.get_world_size())
    gen = torch.Generator().manual_seed(3)
    data = [{"input_ids": row, "labels": row.clone()} for row in torch.randint(0, RESIZED, (4, SEQ), generator=gen)]
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=1, num_train_epochs=1, learning_rate=LR,
                             weight_decay=0.0, max_grad_norm=1.0, adam_epsilon=EPS, logging_steps=1, save_strategy="no",
                             report_to=[], seed=0, use_cpu=True, disable_tqdm=True, lr_scheduler_type="constant")
    collator = _RecordingCollator()
    with enable_zero3(cfg):
        model = AutoModelForCausalLM.from_pretrained(saved)
        torch.manual_seed(11)
        model.resize_token_embeddings(RESIZED)
        trainer = PartitaTrainer(model=model, args=args, train_dataset=data, data_collator=collator,
                                 partita_config=cfg)
        trainer.train()
        trainer.save_model(os.path.join(out_dir, "final"))
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"losses": losses, "batches": collator.batches}


def test_partita_trainer_trains_a_model_loaded_and_resized_under_the_hook(saved, tmp_path) -> None:
    """from_pretrained into shards, resize, then PartitaTrainer at ZeRO-3 on 2 ranks: the Trainer's
    losses and the weights save_model writes are a plain torch loop's on the same global batches."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    r0, r1 = run_distributed(_trainer_client, 2, saved["gpt2"], str(tmp_path), timeout=500)
    assert r0["losses"] == r1["losses"] and len(r0["losses"]) == 2
    model = AutoModelForCausalLM.from_pretrained(saved["gpt2"])
    torch.manual_seed(11)
    model.resize_token_embeddings(RESIZED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    losses = []
    for a, b in zip(r0["batches"], r1["batches"]):  # each step: rank 0's micro-batch, then rank 1's
        ids = torch.cat([a, b])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    for got, want in zip(r0["losses"], losses):
        assert abs(got - want) <= 1e-5 * abs(want), (r0["losses"], losses)
    saved_model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    _close(dict(saved_model.state_dict()), {k: v.detach() for k, v in model.state_dict().items()}, 1e-5)
