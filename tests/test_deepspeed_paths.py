"""DeepSpeed's public paths under ``import partita`` (``import partita as deepspeed``).

A bare ``import partita`` in a fresh interpreter must expose every subpackage as an attribute
without importing torch; each DeepSpeed call gives DeepSpeed's values; names partita lacks on
purpose raise NotImplementedError naming the DeepSpeed call.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

from tests.harness import run_distributed

DEEPSPEED_PATHS = ["zero", "checkpointing", "comm", "accelerator", "utils", "runtime", "ops"]


def _fresh_python(code: str, **env: str) -> dict:
    """Run ``code`` in a new interpreter (nothing imported before it); it prints one JSON line."""
    import os

    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_bare_import_reaches_every_subpackage_and_deepspeeds_dotted_paths(tmp_path) -> None:
    # One fresh interpreter (nothing imported before `import partita`) for all three checks:
    # attributes after a bare import, DeepSpeed's dotted paths, init_distributed with a file store.
    out = _fresh_python(
        f"""
        import json, pkgutil, sys
        import partita
        torch_after_import = "torch" in sys.modules
        subpackages = sorted(i.name for i in pkgutil.iter_modules(partita.__path__) if not i.name.startswith("_"))
        reached = {{name: getattr(partita, name).__name__ for name in subpackages}}
        listed = dir(partita)

        import partita as deepspeed
        from partita.engine import Engine
        import partita.activation_checkpointing as ac
        checks = {{
            "zero.Init": deepspeed.zero.Init is partita.zero.Init,
            "zero.GatheredParameters": deepspeed.zero.GatheredParameters is partita.zero.GatheredParameters,
            "checkpointing.checkpoint": deepspeed.checkpointing.checkpoint is ac.checkpoint,
            "partition_parameters.Init": deepspeed.runtime.zero.partition_parameters.Init is partita.zero.Init,
            "partition_parameters.GatheredParameters":
                deepspeed.runtime.zero.partition_parameters.GatheredParameters is partita.zero.GatheredParameters,
            "partition_parameters.register_external_parameter":
                deepspeed.runtime.zero.partition_parameters.register_external_parameter
                is deepspeed.zero.register_external_parameter,
            "runtime.engine.DeepSpeedEngine": deepspeed.runtime.engine.DeepSpeedEngine is Engine,
            "DeepSpeedEngine": deepspeed.DeepSpeedEngine is Engine,
            "runtime.activation_checkpointing": deepspeed.runtime.activation_checkpointing.checkpointing.checkpoint
                is ac.checkpoint,
            "init_distributed": deepspeed.init_distributed is deepspeed.comm.init_distributed,
            "utils.logger": deepspeed.utils.logger.name == "partita" and deepspeed.logger is deepspeed.utils.logger,
            "utils.set_z3_leaf_modules": deepspeed.utils.set_z3_leaf_modules is partita.zero.set_z3_leaf_modules,
            "ops.adam": deepspeed.ops.adam.FusedAdam.__name__ == "FusedAdam",
            "accelerator": deepspeed.accelerator.get_accelerator().device_name(0) == "cpu",
        }}
        comm = deepspeed.comm
        deepspeed.init_distributed(dist_backend="gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        started = [comm.is_initialized(), comm.get_rank(), comm.get_world_size(), comm.get_backend()]
        print(json.dumps({{"torch_after_import": torch_after_import, "subpackages": subpackages, "reached": reached,
                          "dir": listed, "checks": checks, "started": started}}))
        """,
        CUDA_VISIBLE_DEVICES="",
    )
    assert out["torch_after_import"] is False  # the console command stays fast
    for name in out["subpackages"]:  # generic: moe, sequence, tensor_parallel, pipe once they exist
        assert out["reached"][name] == f"partita.{name}"
        assert name in out["dir"]
    for name in DEEPSPEED_PATHS:
        assert name in out["subpackages"] and name in out["dir"]
    for name in ("initialize", "add_config_arguments", "init_distributed", "DeepSpeedEngine", "logger"):
        assert name in out["dir"]
    assert out["checks"] == {key: True for key in out["checks"]} and len(out["checks"]) == 14, out["checks"]
    assert out["started"] == [True, 0, 1, "gloo"]


def test_a_subpackage_added_later_becomes_an_attribute(tmp_path) -> None:
    # A package placed on partita's path (as moe, sequence, pipe were added) is found by the same
    # mechanism, with no list of names to update.
    (tmp_path / "future_axis").mkdir()
    (tmp_path / "future_axis" / "__init__.py").write_text("VALUE = 42\n")
    out = _fresh_python(
        f"""
        import json
        import partita
        try:
            partita.future_axis
            before = "no error"
        except AttributeError as error:
            before = str(error)
        partita.__path__.append({str(tmp_path)!r})
        print(json.dumps({{"before": before, "name": partita.future_axis.__name__, "value": partita.future_axis.VALUE,
                           "in_dir": "future_axis" in dir(partita)}}))
        """
    )
    assert out == {"before": "module 'partita' has no attribute 'future_axis'", "name": "partita.future_axis",
                   "value": 42, "in_dir": True}


def test_top_level_pipeline_names_follow_partita_pipe() -> None:
    import importlib.util

    import partita

    if importlib.util.find_spec("partita.pipe") is not None:
        assert partita.PipelineModule is partita.pipe.PipelineModule
        assert partita.PipelineEngine is partita.pipe.PipelineEngine
    else:
        with pytest.raises(NotImplementedError, match=r"^deepspeed\.PipelineModule: pipeline parallelism"):
            partita.PipelineModule


# ---------------------------------------------------------------------------- deliberately missing


def test_missing_deepspeed_names_raise_not_implemented_naming_them() -> None:
    import partita
    from partita.deepspeed_compat import MissingDeepSpeedFeature

    with pytest.raises(NotImplementedError, match=r"^deepspeed\.module_inject \(kernel injection\): DeepSpeed's injected inference kernels .* partita\.init_inference\(model, \.\.\.\)"):
        partita.module_inject
    with pytest.raises(NotImplementedError, match=r"deepspeed\.add_tuning_arguments .* `partita estimate` predicts memory"):
        partita.add_tuning_arguments
    with pytest.raises(NotImplementedError, match=r"deepspeed\.ops\.op_builder is not part of partita"):
        partita.ops.op_builder
    with pytest.raises(NotImplementedError, match=r"deepspeed\.utils\.safe_get_full_fp32_param .* engine\.get_fp32_state_dict\(\)"):
        partita.utils.safe_get_full_fp32_param
    with pytest.raises(NotImplementedError, match=r"get_accelerator\(\)\.create_op_builder\(\) builds DeepSpeed's compiled"):
        partita.accelerator.get_accelerator().create_op_builder
    with pytest.raises(NotImplementedError, match=r"deepspeed\.checkpointing\.get_cuda_rng_tracker \(Megatron's"):
        partita.runtime.activation_checkpointing.checkpointing.get_cuda_rng_tracker
    assert partita.checkpointing.non_reentrant_checkpoint is partita.checkpointing.checkpoint
    # Still an AttributeError for attribute probing: hasattr and getattr's default keep working.
    assert not hasattr(partita, "module_inject") and getattr(partita, "OnDevice", 7) == 7
    assert issubclass(MissingDeepSpeedFeature, AttributeError)
    with pytest.raises(AttributeError, match=r"^module 'partita' has no attribute 'no_such_thing'$"):
        partita.no_such_thing


def test_fused_adam_and_cpu_adam_are_torch_adam_with_deepspeeds_arguments() -> None:
    from partita.ops.adam import DeepSpeedCPUAdam, FusedAdam

    def run(make) -> torch.Tensor:
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(5))
        opt = make([p])
        for _ in range(3):
            p.grad = torch.ones(5) * 0.5
            opt.step()
        return p.detach().clone()

    expected = run(lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.2))
    assert torch.equal(run(lambda ps: FusedAdam(ps, lr=0.1, weight_decay=0.2)), expected)
    assert torch.equal(run(lambda ps: DeepSpeedCPUAdam(ps, lr=0.1, weight_decay=0.2)), expected)
    plain = run(lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.2))
    assert torch.equal(run(lambda ps: FusedAdam(ps, lr=0.1, weight_decay=0.2, adam_w_mode=False)), plain)
    with pytest.raises(NotImplementedError, match=r"FusedAdam\(bias_correction=False\) is not supported"):
        FusedAdam([nn.Parameter(torch.ones(1))], bias_correction=False)


# ---------------------------------------------------------------------------- accelerator


def test_cpu_accelerator_values(monkeypatch) -> None:
    from partita.accelerator import CpuAccelerator, CudaAccelerator, get_accelerator, real_accelerator

    monkeypatch.setattr(real_accelerator, "_current", None)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    accel = get_accelerator()
    assert isinstance(accel, CpuAccelerator) and get_accelerator() is accel
    assert accel.device_name(0) == "cpu" and accel.device_name() == "cpu" and accel.device_name(5) == "cpu"
    assert accel.current_device_name() == "cpu" and accel.current_device() == 3 and accel.device_count() == 4
    assert accel.device(1) == torch.device("cpu")
    assert accel.is_available() and accel.is_bf16_supported() and accel.communication_backend_name() == "gloo"
    assert accel.synchronize() is None and accel.set_device(0) is None and accel.empty_cache() is None
    assert accel.Stream is None and accel.Event is None and accel.current_stream() is None
    with accel.stream(None):
        pass
    accel.manual_seed(123)
    first = torch.rand(3)
    accel.manual_seed(123)
    assert torch.equal(torch.rand(3), first)
    used = accel.memory_allocated()
    assert isinstance(used, int) and used > 10 * 2**20  # a Python process with torch holds > 10 MiB
    assert accel.max_memory_allocated() >= used
    assert torch.float32 in accel.supported_dtypes() and torch.bfloat16 in accel.supported_dtypes()
    # The CUDA accelerator's names need no GPU.
    cuda = CudaAccelerator()
    assert cuda.device_name(1) == "cuda:1" and cuda.device_name() == "cuda" and cuda.communication_backend_name() == "nccl"

    monkeypatch.setattr(real_accelerator, "_current", None)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match=r"DS_ACCELERATOR='xpu': partita runs on cuda or cpu"):
        get_accelerator()


# ---------------------------------------------------------------------------- arguments and init


def test_add_config_arguments_has_deepspeeds_flags_and_defaults() -> None:
    import partita

    parser = partita.add_config_arguments(argparse.ArgumentParser())
    assert vars(parser.parse_args([])) == {
        "deepspeed": False, "deepspeed_config": None, "deepscale": False, "deepscale_config": None,
    }
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = parser.parse_args(["--deepscale_config", "old.json"])
    assert old.deepspeed_config == "old.json" and old.deepscale_config == "old.json"
    assert any("--deepscale_config is deprecated" in str(w.message) for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        both = parser.parse_args(["--deepscale_config", "old.json", "--deepspeed_config", "new.json"])
    assert both.deepspeed_config == "new.json"


def test_init_distributed_refuses_what_partita_cannot_start(monkeypatch) -> None:
    import torch.distributed as dist

    import partita

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"dist_backend='ccl'\): partita runs on 'nccl' \(GPUs\) or 'gloo'"):
        partita.init_distributed(dist_backend="ccl")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(NotImplementedError, match=r"started by an MPI launcher \(OMPI_COMM_WORLD_SIZE=2\).*auto_mpi_discovery"):
        partita.init_distributed()
    with pytest.raises(ValueError, match=r"init_method='tcp://127.0.0.1:1'\) needs rank= and world_size="):
        partita.init_distributed(init_method="tcp://127.0.0.1:1")
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------- 2 ranks: comm and the engine


class _Blocks(nn.Module):
    """Two blocks in a ModuleList (two ZeRO-3 units) and a root-level head."""

    def __init__(self, read_block0_from_block1: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.head = nn.Linear(6, 2)
        self.read_block0_from_block1 = read_block0_from_block1

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks[0](x))
        h = torch.tanh(self.blocks[1](h))
        if self.read_block0_from_block1:
            h = h @ self.blocks[0].weight  # block 0's weight read outside block 0
        logits = nn.functional.linear(h, self.head.weight) + self.head.bias
        return nn.functional.cross_entropy(logits, y)


def _comm_and_engine_on_each_rank() -> dict:
    import torch.distributed as dist

    import partita as deepspeed
    from partita.deepspeed_compat import MissingDeepSpeedFeature

    comm = deepspeed.comm
    deepspeed.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    out: dict = {"rank": rank, "world": world, "local": comm.get_local_rank(), "init": comm.is_initialized()}
    t = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    comm.all_reduce(t)
    out["sum"] = t.tolist()
    m = torch.tensor([float(rank)])
    comm.all_reduce(m, op=comm.ReduceOp.MAX)
    out["max"] = m.item()
    gathered = [torch.zeros(1) for _ in range(world)]
    comm.all_gather(gathered, torch.tensor([rank * 3.0]))
    out["all_gather"] = [g.item() for g in gathered]
    into = torch.zeros(world)
    comm.all_gather_into_tensor(into, torch.tensor([rank + 0.5]))
    out["all_gather_into_tensor"] = into.tolist()
    b = torch.tensor([float(rank) + 7.0])
    comm.broadcast(b, src=1)
    out["broadcast"] = b.item()
    rs = torch.zeros(1)
    comm.reduce_scatter_tensor(rs, torch.tensor([1.0 + rank, 100.0 + rank]))
    out["reduce_scatter_tensor"] = rs.item()
    rs_list = torch.zeros(1)
    comm.reduce_scatter(rs_list, [torch.tensor([2.0 * rank]), torch.tensor([5.0])])
    out["reduce_scatter"] = rs_list.item()
    a2a = torch.zeros(world)
    comm.all_to_all_single(a2a, torch.tensor([10.0 * rank, 10.0 * rank + 1]))
    out["all_to_all_single"] = a2a.tolist()
    group = comm.new_group([0, 1])
    g = torch.tensor([1.0])
    comm.all_reduce(g, group=group)
    out["group_sum"] = g.item()
    comm.barrier()

    base = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "steps_per_print": 1000}
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=_Blocks(), config={**base, "fp16": {"enabled": True}})
    out["engine"] = [engine.local_rank, engine.global_rank, engine.world_size, engine.dp_world_size,
                     engine.fp16_enabled(), engine.bfloat16_enabled(), engine.zero_optimization_stage()]
    try:
        engine.get_mom()
    except MissingDeepSpeedFeature as error:
        out["get_mom"] = str(error)
    try:
        engine.no_such_attribute
    except AttributeError as error:
        out["unknown"] = str(error)
    engine, *_ = deepspeed.initialize(model=_Blocks(), config={**base, "bf16": {"enabled": True}})
    out["bf16"] = [engine.fp16_enabled(), engine.bfloat16_enabled()]

    # zero.register_external_parameter under ZeRO-3 (tiny threshold: every weight is sharded).
    z3 = {**base, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1}}
    model = _Blocks()
    deepspeed.zero.register_external_parameter(model, model.head.weight)  # root-owned: always whole
    engine, *_ = deepspeed.initialize(model=model, config=z3)
    x, y = torch.randn(2, 6), torch.tensor([0, 1])
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    out["z3_root_loss_finite"] = bool(torch.isfinite(loss).item())
    model = _Blocks(read_block0_from_block1=True)
    deepspeed.zero.register_external_parameter(model.blocks[1], model.blocks[0].weight)
    try:
        deepspeed.initialize(model=model, config=z3)
    except NotImplementedError as error:
        out["z3_refused"] = str(error)
    dist.barrier()
    return out


def test_comm_and_engine_attributes_on_two_gloo_ranks() -> None:
    results = run_distributed(_comm_and_engine_on_each_rank, 2)
    for rank, out in enumerate(results):
        assert (out["rank"], out["world"], out["local"], out["init"]) == (rank, 2, rank, True)
        assert out["sum"] == [3.0, 30.0] and out["max"] == 1.0
        assert out["all_gather"] == [0.0, 3.0] and out["all_gather_into_tensor"] == [0.5, 1.5]
        assert out["broadcast"] == 8.0
        assert out["reduce_scatter_tensor"] == [3.0, 201.0][rank]
        assert out["reduce_scatter"] == [2.0, 10.0][rank]
        assert out["all_to_all_single"] == [[0.0, 10.0], [1.0, 11.0]][rank]
        assert out["group_sum"] == 2.0
        assert out["engine"] == [rank, rank, 2, 2, True, False, 0]
        assert out["bf16"] == [False, True]
        assert out["get_mom"].startswith("engine.get_mom() is not in partita")
        assert out["unknown"] == "'_Blocks' object has no attribute 'no_such_attribute'"
        assert out["z3_root_loss_finite"] is True
        assert out["z3_refused"].startswith(
            "zero.register_external_parameter('blocks.1', 'blocks.0.weight'): partita's ZeRO-3 gathers this "
            "parameter with the block 'blocks.0' (Linear) only while that block runs"
        )


def test_register_external_parameter_registry() -> None:
    from partita.zero import register_external_parameter, unregister_external_parameter
    from partita.zero.external import external_parameters

    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    register_external_parameter(a, b.weight)
    register_external_parameter(a, b.weight)  # twice: still one entry
    assert external_parameters(a) == [b.weight] and external_parameters(b) == []
    unregister_external_parameter(a, b.weight)
    assert external_parameters(a) == []
    with pytest.raises(ValueError, match=r"is not registered as an external parameter of Linear"):
        unregister_external_parameter(a, b.weight)
    with pytest.raises(ValueError, match=r"parameter must be a torch.nn.Parameter, got Tensor"):
        register_external_parameter(a, torch.ones(2))


# ---------------------------------------------------------------------------- a DeepSpeedExamples-style script


def _cifar_runs(runs: list[list[str]], backend: str = "partita") -> list:
    """Runs on every rank: the CIFAR client script's main() once per argv (``CIFAR_BACKEND`` picks the library)."""
    import os

    os.environ["CIFAR_BACKEND"] = backend
    from partita.config import ConfigError
    from tests.client_scripts.cifar_ds_style import main

    out = []
    for argv in runs:
        try:
            out.append(main(argv))
        except ConfigError as error:
            out.append({"config_error": str(error)})
    return out


CIFAR_ARGV = ["--deepspeed", "--epochs", "1", "--warmup-steps", "5", "--lr", "0.004"]


def test_deepspeed_examples_cifar_script_on_two_gloo_ranks(tmp_path) -> None:
    refused = tmp_path / "ds_config.json"
    refused.write_text(json.dumps({
        "train_batch_size": 16,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
        "zero_optimization": {"stage": 2, "cpu_offload": True},  # DeepSpeed's deprecated spelling
    }))
    runs = [CIFAR_ARGV, CIFAR_ARGV, CIFAR_ARGV + ["--dtype", "bf16", "--stage", "2"], ["--deepspeed_config", str(refused)]]
    results = run_distributed(_cifar_runs, 2, runs, timeout=400)
    for rank, (fp32, again, bf16, bad) in enumerate(results):
        for run in (fp32, bf16):
            losses = run["losses"]
            assert len(losses) == 512 // 16 and all(torch.isfinite(torch.tensor(losses)))
            first, last = sum(losses[:6]) / 6, sum(losses[-6:]) / 6
            assert last < 0.8 * first, (first, last)  # learning, not noise
            assert run["device_name"] == "cpu" and run["local_rank"] == rank
            assert run["global_samples"] == 512
        assert again["losses"] == fp32["losses"]  # two identical runs: identical losses
        assert (fp32["fp16"], fp32["bf16"], bf16["fp16"], bf16["bf16"]) == (False, False, False, True)
        assert results[0][0]["losses"] == results[1][0]["losses"]  # every rank logs the global mean
        assert fp32["accuracy"] > 0.5  # 10 classes: chance is 0.1
        assert bad["config_error"].endswith(
            "zero_optimization.cpu_offload = true: 'zero_optimization.cpu_offload' is DeepSpeed's deprecated spelling "
            'of "offload_optimizer": {"device": "cpu"}, which partita reads under its current name only; write '
            '"offload_optimizer": {"device": "cpu"} instead (the value false has no effect and is accepted)'
        )


def test_cifar_script_losses_match_deepspeeds() -> None:
    """Where DeepSpeed is installed (never a dependency): the same script, seed and data on both,
    live, at ZeRO 0-3 (tests/test_cifar_deepspeed_parity.py checks the same against DeepSpeed's
    recorded numbers, in CI)."""
    pytest.importorskip("deepspeed")
    from tests.fixtures.make_cifar_deepspeed_losses import CIFAR_PARITY_ARGV, STEPS, stage_losses

    stages = [0, 1, 2, 3]
    ours = run_distributed(stage_losses, 2, "partita", stages, CIFAR_PARITY_ARGV, timeout=400)[0]
    theirs = run_distributed(stage_losses, 2, "deepspeed", stages, CIFAR_PARITY_ARGV, timeout=1200)[0]
    for stage in map(str, stages):
        assert len(ours[stage]) == len(theirs[stage]) == STEPS
        # Same lr at every step (DeepSpeed's WarmupLR counter) and the same data order: the two
        # libraries' Adam kernels differ by fp32 rounding only.
        worst = max(abs(a - b) / abs(b) for a, b in zip(ours[stage], theirs[stage]))
        assert worst <= 1e-6, (stage, worst)
