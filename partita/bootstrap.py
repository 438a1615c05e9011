"""``partita.initialize`` (defined here, exported by the package): DeepSpeed's entry point, same arguments, same return value.

Order matters and is deliberate:
1. parse and validate the config (cheap, identical on every rank, so a mistake fails
   everywhere before any process group or memory is touched);
2. start torch.distributed, then resolve the batch triple with the real data-parallel
   size (DeepSpeed resolves it before and gets ``ws=1``, its issue #3228);
3. move and cast the model, broadcast rank 0's weights so every rank starts equal;
4. build ZeRO, the inner optimizer, the LR scheduler, the loss scaler, the data loader.
"""

from __future__ import annotations

import logging
import os
import random
import warnings
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from partita.activation_checkpointing.apply import apply_config as apply_activation_checkpointing_config
from partita.autotune.trial_env import apply_config_override
from partita.compile.apply import apply_config as apply_compile_config
from partita.config import ConfigError, PartitaConfig, load_config, resolve_batch_sizes
from partita.data.sampler import ResumableDistributedSampler
from partita.distributed import collectives
from partita.distributed.init import current_device, init_distributed
from partita.distributed.topology import Axis, Topology, build_topology, resolve_mesh_shape
from partita.engine import Engine
from partita.moe.registry import bind_experts
from partita.monitor.setup import prepare_monitoring
from partita.offload.auto_placement import resolve_tiered_placement
from partita.offload.host_check import check_host_capacity
from partita.zero.fold_choice import resolve_gradient_fold
from partita.optim.factory import build_optimizer, required_alignment
from partita.optim.schedulers import build_scheduler
from partita.param_groups import normalize_param_groups
from partita.precision.fp8 import apply_fp8
from partita.precision.loss_scaler import build_loss_scaler
from partita.tensor_parallel.setup import apply_config as apply_tensor_parallel_config
from partita.ops.sparse_attention.apply import apply_config as apply_sparse_attention_config
from partita.sequence.apply import apply_sequence_parallel
from partita.utils.host_memory import release_free_host_memory
from partita.sequence.apply_tiling import apply_sequence_tiling
from partita.zero.api import apply_zero
from partita.pipe import PipelineModule
from partita.pipe.setup import pipe_size_for, prepare_pipeline

logger = logging.getLogger("partita")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[[list[dict]], torch.optim.Optimizer] | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    collate_fn: Callable | None = None,
    config: dict | str | os.PathLike | None = None,
    config_params: dict | str | None = None,
) -> tuple[Engine, Any, torch.utils.data.DataLoader | None, Any]:
    """Wrap a model for ZeRO data-parallel training.

    Args:
        args: optional argparse namespace; its ``deepspeed_config`` is used when ``config`` is None.
        model: the ``nn.Module`` to train.
        optimizer: a torch optimizer over the model's parameters (its param groups and
            hyperparameters are kept; its parameters are replaced by fp32 master
            partitions), or a callable ``f(param_groups) -> Optimizer``, or None to build
            the one in the config's ``optimizer`` section.
        model_parameters: parameters or param-group dicts to train (default: all of the model's).
        training_data: a map-style dataset; a distributed, resumable data loader is returned.
        lr_scheduler: a scheduler instance, a callable ``f(optimizer) -> scheduler``, or
            None for the config's ``scheduler`` section.
        mpu: model-parallel unit; not supported yet.
        collate_fn: collate function for the data loader.
        config: a dict or the path of a DeepSpeed-style JSON file.
        config_params: DeepSpeed's older name for ``config``.

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler)``, as DeepSpeed's ``initialize``.
    """
    # apply_config_override: a `partita tune` trial's settings (PARTITA_CONFIG_OVERRIDE), else unchanged.
    cfg = load_config(apply_config_override(_pick_config(args, config, config_params)))
    if model is None or not isinstance(model, nn.Module):
        raise ValueError(f"initialize() needs model=<torch.nn.Module>, got {type(model).__name__}")
    if mpu is not None:
        raise NotImplementedError("model parallelism (mpu=...) is not implemented yet in partita")
    if optimizer is not None and cfg.optimizer is not None:
        raise ValueError(
            "an optimizer was passed to initialize() and the config has an 'optimizer' section; "
            "keep one: remove the section or drop the optimizer argument"
        )
    # ZeRO-Inference (DeepSpeed's configuration of it): stage 3, no optimizer anywhere (partita/zero/inference.py).
    inference_only = optimizer is None and cfg.optimizer is None and cfg.zero_optimization.stage == 3
    if optimizer is None and cfg.optimizer is None and not inference_only:
        raise ValueError(
            "no optimizer: pass optimizer=<torch optimizer or callable> to initialize() or add an "
            "'optimizer' section to the config, e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-4}}; "
            f"for inference only (ZeRO-Inference) set zero_optimization.stage to 3 (it is {cfg.zero_optimization.stage}), "
            "optionally with offload_param {\"device\": \"cpu\", \"pin_memory\": true}, and give no optimizer"
        )
    if inference_only:
        _check_inference_only(cfg, model, lr_scheduler)
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ValueError(
            "an lr_scheduler was passed to initialize() and the config has a 'scheduler' section; keep one"
        )

    init_distributed(backend=cfg.distributed.backend, timeout_seconds=cfg.distributed.timeout_seconds)
    device = current_device()
    from partita.integrations.peft_support import check_quantized_base

    check_quantized_base(model, device)  # QLoRA: a 4-bit base bitsandbytes cannot run here, refused before sharding
    topology = _build_topology(cfg, device_type=device.type, model=model)
    if inference_only and cfg.train_batch_size is None and cfg.train_micro_batch_size_per_gpu is None:
        cfg = cfg.model_copy(update={"train_micro_batch_size_per_gpu": 1})  # no optimizer step to size a batch for
    batch = resolve_batch_sizes(cfg, dp_world_size=topology.data_size)
    if cfg.seed is not None:
        _seed_everything(cfg.seed)
    _configure_logging(topology)
    prepare_monitoring(cfg)  # missing monitor package fails here; comms logger sees the weight broadcast

    if isinstance(optimizer, torch.optim.Optimizer):
        source_groups = optimizer.param_groups
    elif model_parameters is not None:
        source_groups = model_parameters
    else:
        source_groups = model.parameters()
    # Inference only: every parameter is sharded, trainable or not (a frozen model is the usual case).
    param_groups = [{"params": list(model.parameters())}] if inference_only else normalize_param_groups(source_groups, model)

    compute_dtype = _DTYPES[cfg.precision]
    # The strategies, in this order (torchtitan's): tensor parallelism splits the whole model first,
    # then experts, activation checkpointing, compile, and ZeRO over what each rank holds.
    # fp8 first, as torchtitan's converters: its Float8Linear keeps each Parameter (param_groups stay valid)
    # and every later strategy wraps the converted model (partita/precision/fp8.py says why this order).
    apply_fp8(model, cfg, topology, device=device)
    param_groups = apply_tensor_parallel_config(model, cfg.tensor_parallel, topology, param_groups)
    # MoE layers get their expert groups (collective: same order everywhere); expert parameters
    # are then broadcast, reduced and ZeRO-sharded within their expert-data group only.
    expert_comms = bind_experts(model, topology)
    _place_model(model, device=device, dtype=compute_dtype, topology=topology, stage=cfg.zero_optimization.stage,
                 expert_comms=expert_comms)
    prepare_pipeline(model, cfg, topology)  # a PipelineModule: refusals, config checks, tied-weight broadcast
    # sequence_parallel_size > 1: split each sequence (a pipeline stage may hold no attention: prepare_pipeline
    # checked the stages together)
    apply_sequence_parallel(model, topology, cfg.sequence_parallel, require_attention=not isinstance(model, PipelineModule))
    apply_sparse_attention_config(model, cfg.sparse_attention, sequence_parallel_size=topology.sequence_size)
    apply_sequence_tiling(model, cfg.sequence_tiling, tensor_parallel_size=topology.tensor_size)  # before checkpointing
    # Before ZeRO (whose stage 3 will hook modules): blocks keep identity and state_dict keys.
    apply_activation_checkpointing_config(
        model, cfg.activation_checkpointing, given="activation_checkpointing" in cfg.model_fields_set
    )
    # After checkpointing (a checkpointed block compiles inside its checkpoint); before ZeRO only to
    # fail fast: compiled regions are block forwards, so ZeRO-3's hooks stay eager either way.
    apply_compile_config(model, cfg.compile, zero_stage=cfg.zero_optimization.stage)
    if inference_only:
        return _initialize_inference(model, cfg, topology, batch, device, compute_dtype, expert_comms,
                                     training_data, collate_fn)
    # offload_optimizer.device "auto": the estimator splits the optimizer state over accelerator,
    # host memory and NVMe for the tiers' capacities (partita/offload/auto_placement.py).
    cfg = resolve_tiered_placement(cfg, model, param_groups, world_size=topology.zero_size,
                                   batch_world_size=topology.data_size, device=device, client_optimizer=optimizer)
    # A fixed offload whose host buffers cannot fit: a clear refusal now, not the OOM killer later.
    check_host_capacity(cfg, model, param_groups, world_size=topology.zero_size,
                        batch_world_size=topology.data_size, device=device, client_optimizer=optimizer)
    # One process: fold each gradient as it arrives or after backward, whichever peaks lower.
    cfg = resolve_gradient_fold(cfg, model, param_groups, world_size=topology.zero_size, client_optimizer=optimizer,
                                gradient_accumulation_steps=batch.gradient_accumulation_steps, device_type=device.type)

    zero = apply_zero(
        model,
        param_groups,
        config=cfg.zero_optimization,
        topology=topology,
        gradient_clipping=cfg.gradient_clipping,
        # Offloaded masters step on the host, with its fused kernel where torch has one.
        build_inner_optimizer=_inner_optimizer_factory(
            optimizer, cfg, "cpu" if cfg.zero_optimization.offload_optimizer.enabled else device.type
        ),
        # 8-bit optimizers quantise blocks of the partition: shards must be whole blocks.
        alignment=required_alignment(cfg.optimizer if optimizer is None else None),
        comm_dtype=_DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None,
        # prescale_gradients: divide by the averaging world before the sum (nothing left to divide after).
        predivide_factor=float(topology.zero_size) if cfg.prescale_gradients else cfg.gradient_predivide_factor,
        accumulate_in_fp32=cfg.data_types.grad_accum_dtype == "fp32" and compute_dtype != torch.float32,
        aio=cfg.aio,
        param_comms=expert_comms,
    )
    inner = zero.optimizer.inner
    scheduler = _build_scheduler(lr_scheduler, cfg, inner)
    loss_scaler = build_loss_scaler(cfg.fp16) if cfg.precision == "fp16" else None
    dataloader = _build_dataloader(training_data, collate_fn, batch.micro_batch_size, topology, cfg)
    if isinstance(model, PipelineModule):  # train_batch (partita/pipe)
        # lazily: torch.distributed.pipelining imports torch._dynamo (~2 s of CPU per process)
        from partita.pipe.engine import PipelineEngine as engine_class
    else:
        engine_class = Engine
    engine = engine_class(
        module=model,
        zero=zero,
        batch=batch,
        topology=topology,
        device=device,
        compute_dtype=compute_dtype,
        loss_scaler=loss_scaler,
        lr_scheduler=scheduler,
        config=cfg,
        training_dataloader=dataloader,
    )
    if cfg.checkpoint.resume is not None:
        from partita.checkpoint.resume import resume_from_config

        resume_from_config(engine)  # checkpoint.resume: continue from the newest complete checkpoint
    release_free_host_memory()  # whole copies and init shards freed while building (partita/utils/host_memory.py)
    return engine, zero.optimizer, dataloader, scheduler


def _check_inference_only(cfg: PartitaConfig, model: nn.Module, lr_scheduler: Any) -> None:
    """What an inference-only engine (no optimizer) cannot honour, refused before anything is built."""
    if lr_scheduler is not None or cfg.scheduler is not None:
        raise ConfigError(
            "an lr scheduler was given but no optimizer: with zero_optimization.stage 3 and no optimizer partita builds "
            "an inference-only engine (ZeRO-Inference), which has no learning rate; add an \"optimizer\" section to "
            "train, or drop the scheduler"
        )
    if isinstance(model, PipelineModule):
        raise ConfigError(
            "a PipelineModule with no optimizer: inference-only engines (ZeRO-Inference) run whole models; add an "
            "\"optimizer\" section to train the pipeline, or pass the model itself (not a PipelineModule)"
        )


def _initialize_inference(model: nn.Module, cfg: PartitaConfig, topology: Topology, batch, device: torch.device,
                          compute_dtype: torch.dtype, expert_comms, training_data, collate_fn):
    """ZeRO-Inference: every parameter sharded (streamed from host memory or NVMe with offload_param), no
    fp32 masters, no optimizer state; ``(engine, None, dataloader, None)`` (partita/zero/inference.py)."""
    from partita.zero.inference import apply_zero_inference
    from partita.zero.inference_engine import ZeroInferenceEngine

    zero = apply_zero_inference(model, config=cfg.zero_optimization, topology=topology, aio=cfg.aio,
                                param_comms=expert_comms)
    engine = ZeroInferenceEngine(module=model, zero=zero, batch=batch, topology=topology, device=device,
                                 compute_dtype=compute_dtype, config=cfg,
                                 training_dataloader=_build_dataloader(training_data, collate_fn,
                                                                       batch.micro_batch_size, topology, cfg))
    location = zero.gatherer.shard_location
    logger.info("ZeRO-Inference: no optimizer, %d parameters sharded over %d rank(s), shards in %s (%s), no fp32 masters",
                sum(1 for p in model.parameters() if zero.gatherer.is_sharded_param(p)), topology.zero_size,
                {"accelerator": "device memory", "cpu": "host memory", "nvme": "NVMe swap files"}[location],
                compute_dtype)
    release_free_host_memory()
    return engine, None, engine.training_dataloader, None


def _build_topology(cfg: PartitaConfig, *, device_type: str, model: nn.Module | None = None) -> Topology:
    """The mesh from the config's model-parallel sizes; a layout that cannot cover the world is a
    ConfigError naming every factor (raised identically on every rank)."""
    sizes = {Axis.TENSOR: cfg.tensor_parallel.size, Axis.SEQUENCE: cfg.sequence_parallel_size,
             Axis.PIPE: pipe_size_for(cfg, model)}
    try:
        resolve_mesh_shape(world_size=dist.get_world_size(), sizes={Axis.DATA: None, **sizes})
    except ValueError as error:
        raise ConfigError(f"the parallel layout does not fit the job: {error}") from None
    return build_topology(device_type=device_type, sizes=sizes)


def _pick_config(args: Any, config: Any, config_params: Any) -> Any:
    chosen = [c for c in (config, config_params) if c is not None]
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None:
        chosen.append(from_args)
    if len(chosen) > 1:
        raise ValueError("the config was given more than once (config=, config_params=, args.deepspeed_config); give it once")
    if not chosen:
        raise ValueError("initialize() needs config=<dict or path to a DeepSpeed-style .json file>")
    return chosen[0]


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _configure_logging(topology: Topology) -> None:
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[partita rank {topology.rank}] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if topology.rank == 0 else logging.WARNING)
    logger.propagate = False


@torch.no_grad()
def _place_model(
    model: nn.Module, *, device: torch.device, dtype: torch.dtype, topology: Topology, stage: int,
    expert_comms: dict | None = None,
) -> None:
    """Move to the device, cast to the compute dtype, and make every rank hold rank 0's weights.

    ``module.to`` swaps ``param.data`` in place, so the Parameter objects (and any
    optimizer built over them) survive the move. Parameters built under ``zero.Init`` stay
    sharded at ZeRO-3 (they are already on the device, in the dtype, and equal on every
    rank by construction) and are gathered whole once for stages 0-2.
    """
    from partita.zero.init_context import init_shard_of, materialize_init_params

    params = list(model.parameters())
    presharded = [p for p in params if init_shard_of(p) is not None]
    if presharded and stage < 3:
        materialize_init_params(presharded)
        presharded = []
    for p in presharded:
        if p.device != device or p.dtype != dtype:
            raise ValueError(
                f"a parameter built under partita.zero.Init is {p.dtype} on {p.device}, but training runs in "
                f"{dtype} on {device}: pass the same config to zero.Init(config_dict_or_path=...) as to initialize()"
            )
    model.to(device=device)
    if dtype != torch.float32:
        model.to(dtype=dtype)
    if topology.zero_size > 1:
        # Like DDP: ranks may have initialised differently (different seeds); rank 0 of each
        # group holding the same weights (data x sequence) wins.
        # Expert parameters differ across expert ranks: only their expert-data group (the ranks
        # holding the same experts) takes its first rank's copy.
        src = dist.get_global_rank(topology.zero_group, 0)
        expert_comms = expert_comms or {}
        skip = {id(p) for p in presharded}
        for tensor in [p for p in params if id(p) not in skip] + list(model.buffers()):
            comm = expert_comms.get(tensor)
            if comm is None:
                collectives.broadcast(tensor.data, src=src, group=topology.zero_group, purpose="initial weight broadcast")
            elif comm.size > 1:
                collectives.broadcast(tensor.data, src=dist.get_global_rank(comm.process_group, 0),
                                      group=comm.process_group, purpose="initial expert weight broadcast")


def _inner_optimizer_factory(optimizer: Any, cfg: PartitaConfig, device_type: str):
    def build(master_groups: list[dict]) -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer):
            if optimizer.state:
                warnings.warn(
                    "the optimizer passed to initialize() already has state (it has stepped); partita "
                    "restarts it on the fp32 master weights"
                )
            # Keep the user's instance (and any scheduler bound to it): its groups become the
            # master groups, which carry every option of the original groups.
            optimizer.param_groups[:] = master_groups
            optimizer.state.clear()
            return optimizer
        if callable(optimizer):
            built = optimizer(master_groups)
            if not isinstance(built, torch.optim.Optimizer):
                raise ValueError(f"the optimizer callable returned {type(built).__name__}, not a torch.optim.Optimizer")
            return built
        return build_optimizer(cfg.optimizer, master_groups, device_type=device_type)

    return build


def _build_scheduler(lr_scheduler: Any, cfg: PartitaConfig, inner: torch.optim.Optimizer) -> Any:
    if lr_scheduler is None:
        return build_scheduler(cfg.scheduler, inner) if cfg.scheduler is not None else None
    if hasattr(lr_scheduler, "step") and not isinstance(lr_scheduler, type):
        base_lrs = getattr(lr_scheduler, "base_lrs", None)
        if base_lrs is not None and len(base_lrs) != len(inner.param_groups):
            # offload_optimizer.ratio < 1 cuts each group in two; a scheduler built before
            # initialize() would silently schedule only some of them.
            raise ValueError(
                f"the lr_scheduler passed to initialize() schedules {len(base_lrs)} param groups, but the optimizer "
                f"has {len(inner.param_groups)} after ZeRO (offload_optimizer.ratio < 1 splits each group into an "
                "offloaded and an on-device part); pass the scheduler as a callable, lr_scheduler=lambda opt: "
                "YourScheduler(opt, ...), or use the config's \"scheduler\" section"
            )
        return lr_scheduler
    if callable(lr_scheduler):
        return lr_scheduler(inner)
    raise ValueError(f"lr_scheduler must be a scheduler or a callable, got {type(lr_scheduler).__name__}")


def _build_dataloader(training_data, collate_fn, micro_batch: int, topology: Topology, cfg: PartitaConfig):
    if training_data is None:
        return None
    sampler = ResumableDistributedSampler(
        training_data,
        num_replicas=topology.data_size,
        rank=topology.data_rank,
        shuffle=True,
        seed=cfg.seed or 0,
        drop_last=True,
        # DeepSpeed's loader: the order changes only when the client calls sampler.set_epoch
        # (its DeepSpeedExamples never do, so every epoch repeats the first one's order).
        advance_epochs=False,
    )
    loader = torch.utils.data.DataLoader(
        training_data, batch_size=micro_batch, sampler=sampler, collate_fn=collate_fn, drop_last=True
    )
    loader.data_sampler = sampler  # DeepSpeedDataLoader's name: clients call trainloader.data_sampler.set_epoch(e)
    return loader
