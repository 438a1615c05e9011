"""The training engine: what ``partita.initialize`` returns.

It reads like the training loop it serves:

    loss = engine(batch)        # forward (inputs cast to the compute dtype)
    engine.backward(loss)       # scale, backward, reduce gradients into fp32 partitions
    engine.step()               # at the accumulation boundary: unscale, clip, step, LR

Everything sharded lives in the ZeRO pieces (:mod:`partita.zero`); the engine only
sequences them and keeps the counters.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

from partita.config import BatchSizes
from partita.distributed.init import local_rank
from partita.distributed.topology import Topology
from partita.sample_count import SampleCounter
from partita.step_log import StepLogger
from partita.tensor_containers import map_tensors
from partita.zero.api import ZeroState

logger = logging.getLogger("partita")


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    # Input containers keep their types (namedtuples, dataclasses, dict subclasses).
    return map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)


class Engine:
    """Runs forward, backward and step for one model under ZeRO data parallelism.

    Attribute access that the engine does not define falls through to the wrapped
    module, as in DeepSpeed (``engine.generate(...)`` calls ``engine.module.generate``).
    """

    # engine.offload_states: what is in host memory now (partita/zero/offload_states.py); None: nothing.
    _offloaded_states = None

    def __init__(
        self,
        *,
        module: nn.Module,
        zero: ZeroState,
        batch: BatchSizes,
        topology: Topology,
        device: torch.device,
        compute_dtype: torch.dtype,
        loss_scaler=None,
        lr_scheduler=None,
        config=None,
        training_dataloader=None,
        autocast=None,
    ) -> None:
        self.module = module
        # torch_autocast (partita/precision/autocast.py): fp32 parameters, forward under torch.autocast.
        self.autocast = autocast
        self.zero = zero
        self.optimizer = zero.optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = loss_scaler
        self.topology = topology
        self.device = device
        self.compute_dtype = compute_dtype
        self.config = config
        self.training_dataloader = training_dataloader
        # (path, client_state) of the last load_checkpoint, also when initialize() resumed (partita/checkpoint).
        self.loaded_checkpoint: tuple[str, dict] | None = None
        self._batch = batch
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._global_grad_norm: float | None = None
        self._step_applied = False
        self._backward_pending = False
        # Accumulation driven by the client (DeepSpeed's set_gradient_accumulation_boundary / no_sync):
        # the boundary it set (None: follow gradient_accumulation_steps), whether no_sync is open, whether
        # backward may run again before step(), and whether the window's last backward reduced.
        self._boundary_override: bool | None = None
        self._inside_no_sync = False
        self._manual_window = False
        self._last_backward_reduced = True
        self._step_log = StepLogger(engine=self)  # needs device, topology, module, config set above
        from partita.checkpoint.preemption import PreemptionGuard

        # checkpoint.save_on_signal: a scheduler's SIGTERM/SIGUSR1 saves at the next step boundary, then exits.
        self._preemption = PreemptionGuard(self, config.checkpoint if config is not None else None)
        self._samples = SampleCounter(micro_batch_size=batch.micro_batch_size, data_size=topology.data_size,
                                      data_group=topology.data_group, device=device)
        # DeepSpeed's rank attributes, so they do not fall through to the module.
        self.local_rank = local_rank()
        self.global_rank = topology.rank
        self.world_size = topology.world_size
        self.dp_world_size = topology.data_size
        if zero.gatherer is not None:
            from partita.zero.external import check_external_parameters

            check_external_parameters(module, zero.gatherer)  # zero.register_external_parameter uses ZeRO-3 cannot honour
        from partita.zero.generation import GenerationSessions, install_generate

        # engine.generate and engine.module.generate run in generation sessions (partita/zero/generation.py):
        # at ZeRO-3 the model is gathered once per call (or streamed with prefetch), not once per token.
        static_decoding = None
        if config is not None and config.generation.cuda_graph:
            from partita.inference.rollouts import RolloutDecoding

            static_decoding = RolloutDecoding(module, rank=topology.rank)
        self._generation = GenerationSessions(
            module=module, zero=zero, topology=topology,
            mode=config.zero_optimization.stage3_generation if config is not None else "auto",
            static_decoding=static_decoding)
        self._generate_wrapper = install_generate(module, self._generation)
        from partita.schedules.forward_kwargs import build_forward_schedules

        # progressive_layer_drop / legacy curriculum_learning: extra forward kwargs (partita/schedules), DeepSpeed's names.
        self._forward_schedules = build_forward_schedules(config, module)
        self.progressive_layer_drop = getattr(self._forward_schedules, "pld", None)
        self.curriculum_scheduler_legacy = getattr(self._forward_schedules, "curriculum", None)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails; forward to the module like DeepSpeed.
        if name in {"module", "__setstate__"}:
            raise AttributeError(name)
        try:
            return getattr(self.module, name)
        except AttributeError:
            from partita.deepspeed_compat import missing_engine_attribute

            missing_engine_attribute(name)  # a DeepSpeedEngine call partita lacks: say so and what to use
            raise

    # ------------------------------------------------------------------ batch sizes
    def train_batch_size(self) -> int:
        return self._batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self._batch.gradient_accumulation_steps

    def fp16_enabled(self) -> bool:
        """True when training in fp16 (config ``fp16.enabled``), as DeepSpeed's."""
        return self.compute_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        """True when training in bf16 (config ``bf16.enabled``), as DeepSpeed's."""
        return self.compute_dtype == torch.bfloat16

    def torch_autocast_enabled(self) -> bool:
        """True when the config's ``torch_autocast`` section is enabled, as DeepSpeed's."""
        return self.autocast is not None

    def torch_autocast_dtype(self) -> torch.dtype | None:
        """The dtype the forward autocasts to (None without ``torch_autocast``), as DeepSpeed's."""
        return self.autocast.dtype if self.autocast is not None else None

    def zero_optimization_stage(self) -> int:
        return self.zero.policy.stage

    def is_gradient_accumulation_boundary(self) -> bool:
        """True while computing the last micro-batch of an accumulation window (the value given to
        :meth:`set_gradient_accumulation_boundary`, once called)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self._batch.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's manual boundary (Accelerate calls it before every backward): backward reduces and
        ``step()`` updates only while it is True; backward may run several times before one ``step()``.
        Each backward still scales its loss by 1 / gradient_accumulation_steps, as DeepSpeed's."""
        if not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary(is_boundary) takes True or False, got {is_boundary!r}")
        self._boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self):
        """DeepSpeed's ``no_sync()``: backwards inside accumulate gradients on this rank without reducing
        them; the next backward outside reduces everything accumulated. ZeRO 0/1 only; ``step()`` inside
        is refused, as in DeepSpeed."""
        if self.zero.policy.stage >= 2 or self.zero.reducer.wants_reduction_every_micro_batch():
            raise ValueError(
                f"engine.no_sync() cannot be used at ZeRO stage {self.zero.policy.stage}: ZeRO-2/3 reduce and "
                "partition the gradients of every micro-batch (DeepSpeed refuses it too); set "
                "gradient_accumulation_steps in the config and call backward/step each micro-batch instead")
        if self._inside_no_sync:
            raise RuntimeError("engine.no_sync() was entered again inside engine.no_sync(); it does not nest")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    # ------------------------------------------------------------------ modes
    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        self.finish_pending_step()  # evaluate the newest weights, not those of one update ago
        return self.train(False)

    def finish_pending_step(self) -> None:
        """Put a delayed update (``offload_optimizer.delayed_param_update``) into the model now.

        Every rank must call it (it all-gathers the new weights). Checkpoints, exports and
        ``eval()`` call it themselves; call it after the last ``step()`` before reading the
        model's weights directly. A no-op without a delayed update.
        """
        if self.zero.one_rank_weights is not None:
            self.zero.one_rank_weights.restore()  # a forward without backward left blocks freed
        self.optimizer.finish_pending_step()

    def destroy(self) -> None:
        """End of training, as DeepSpeed's ``engine.destroy()``: land a delayed update, wait for an
        asynchronous checkpoint save, log the run's summary (:meth:`log_summary`: throughput since
        warm-up and, with ``comms_logger``, the communication table), flush and close the monitors
        (TensorBoard, CSV, W&B) and release offload threads, pinned buffers and swap files. Every
        rank calls it; the engine cannot train afterwards. The process group stays up
        (``dist.destroy_process_group()`` is the caller's, as in DeepSpeed)."""
        from partita.checkpoint.save import wait_for_pending_save

        from partita.zero.generation import uninstall_generate

        uninstall_generate(self.module, self._generate_wrapper)  # module.generate is the class's again
        self.optimizer.close()
        wait_for_pending_save()
        if self.zero.gatherer is not None:
            self.zero.gatherer.close()
        self.log_summary()  # the end of training: no collective, so ranks need not be in step
        self._step_log.close()

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``generate`` (Hugging Face's GenerationMixin, the reference GPT's) in a generation
        session: at ZeRO-3 the model is gathered once for the call and held, or streamed unit by unit with
        prefetch when it does not fit (config ``zero_optimization.stage3_generation``); under no_grad.
        Every rank must call it. See docs/guides/zero3-generation.md."""
        generate = getattr(type(self.module), "generate", None)
        if not callable(generate) and not callable(self.module.__dict__.get("generate")):
            raise AttributeError(
                f"engine.generate: the model ({type(self.module).__name__}) has no generate() method; call "
                "engine(...) for forwards, or give the model a generate (Hugging Face models and the reference "
                "GPT have one)"
            )
        if self._offloaded_states is not None:
            self._offloaded_states.refuse_weights("engine.generate()")
        plain = self.module.__dict__.get("generate")
        if plain is self._generate_wrapper and plain is not None:
            return plain(*args, **kwargs)  # the wrapper opens the session
        target = plain if callable(plain) else generate.__get__(self.module)
        return self._generation.run(target, args, kwargs)

    @property
    def generation_mode(self) -> str | None:
        """How the last ZeRO-3 generate call got its weights: "gather_once", "stream" (None: none yet, or
        stages 0-2)."""
        return self._generation.last_mode

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    # ------------------------------------------------------------------ the loop
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module; floating-point tensor inputs are cast to the compute dtype."""
        if self.compute_dtype != torch.float32:
            args, kwargs = _cast_floating(args, self.compute_dtype), _cast_floating(kwargs, self.compute_dtype)
        if self._forward_schedules is not None:
            kwargs = {**kwargs, **self._forward_schedules.forward_kwargs(training=self.module.training,
                                                                         global_steps=self.global_steps)}
        if self.module.training and torch.is_grad_enabled():
            self._samples.observe_forward(args, kwargs)
        with self._step_log.forward_scope(args, kwargs):
            if self.autocast is not None:
                with self.autocast.forward_context():  # torch_autocast: only the forward, as DeepSpeed
                    return self.module(*args, **kwargs)
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of one micro-batch's loss; gradients of the window's last micro-batch
        (every micro-batch under ZeRO-2) are reduced across ranks before this returns."""
        if self._offloaded_states is not None:
            self._offloaded_states.refuse("engine.backward()")
        if self._backward_pending and not self._manual_window:
            raise RuntimeError(
                "engine.backward() was called twice without engine.step() in between; "
                "call engine.step() after every engine.backward() (it only updates at the "
                "gradient-accumulation boundary)"
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"engine.backward() needs a scalar loss tensor, got {shape}; reduce it with .mean()")
        if not loss.requires_grad:
            raise ValueError(
                "engine.backward() got a loss that does not require grad: was the forward run under "
                "torch.no_grad() or with engine.eval()-only code?"
            )
        self._step_log.observe_loss(loss)
        self.optimizer.finish_overlapped_update()  # offload_optimizer.overlap_step_with_forward
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        scaled = loss.float() * (scale / self._batch.gradient_accumulation_steps)
        reducer = self.zero.reducer
        reduce_now = ((self.is_gradient_accumulation_boundary() and not self._inside_no_sync)
                      or reducer.wants_reduction_every_micro_batch())
        self._manual_window = self._boundary_override is not None or self._inside_no_sync
        self._last_backward_reduced = reduce_now
        with self._step_log.backward_scope():
            reducer.begin_backward(reduce=reduce_now)
            with self._step_log.timer("backward_inner"):
                scaled.backward(retain_graph=retain_graph)
            # The reduction left after autograd (the rest overlapped it): DeepSpeed's bwd_allreduce.
            with self._step_log.timer("backward_allreduce"):
                reducer.finish_backward()
            if self.zero.gatherer is not None:
                self.zero.gatherer.release_all()  # parameters that got no gradient are still whole
            if self.zero.one_rank_weights is not None:
                self.zero.one_rank_weights.restore()  # units whose outputs got no gradient are still freed
        self._samples.end_micro_batch()
        self._backward_pending = True
        return loss

    def step(self) -> None:
        """End one micro-batch; at the accumulation boundary update the weights."""
        if self._offloaded_states is not None:
            self._offloaded_states.refuse("engine.step()")
        if not self._backward_pending:
            raise RuntimeError("engine.step() was called without engine.backward(loss) for this micro-batch")
        if self._inside_no_sync:
            raise RuntimeError("engine.step() was called inside engine.no_sync(); leave the no_sync block first "
                               "(its gradients were not reduced), as DeepSpeed requires")
        boundary = self.is_gradient_accumulation_boundary()
        if boundary and not self._last_backward_reduced:
            raise RuntimeError(
                "engine.step() at the accumulation boundary, but the last backward did not reduce the gradients "
                "across ranks (it ran inside engine.no_sync() or before set_gradient_accumulation_boundary(True)); "
                "run the window's last backward outside no_sync with the boundary set, then step()")
        self._manual_window = False
        self._backward_pending = False
        self.micro_steps += 1
        self._step_applied = False
        if not boundary:
            return
        samples = self._samples.end_step(global_steps=self.global_steps + 1)  # may refuse unequal micro-batches
        self._apply_update(samples)

    def _apply_update(self, samples: int) -> None:
        """The update at an accumulation boundary, shared by :meth:`step` and the pipeline engine's
        ``train_batch`` (partita/pipe): the optimizer step (unscale, clip, skip on inf/nan), the
        loss scale, the counters, the step log and the preemption check. ``samples``: the global
        samples of the batch just reduced."""
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        # The LR scheduler steps once the update is in the weights: at once, or, with a
        # delayed update, when it lands (so the update never reads the next step's rate).
        after = self.lr_scheduler.step if self.lr_scheduler is not None else None
        with self._step_log.timer("step"):
            result = self.optimizer.step(loss_scale=scale, received=self.zero.reducer.take_received(), after=after)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=not result.applied)
        self._global_grad_norm = result.grad_norm
        self._step_applied = result.applied
        if not result.applied:
            self.skipped_steps += 1
            if self.loss_scaler is None:
                logger.warning(
                    "step %d skipped: the gradient norm is %s (inf/nan in the gradients)",
                    self.global_steps + 1,
                    result.grad_norm,
                )
            elif self.topology.rank == 0:  # every rank skips alike
                logger.warning(
                    "step %d skipped: fp16 gradients overflowed (inf/nan) at loss scale %g; the loss scale is now %g",
                    self.global_steps + 1,
                    scale,
                    self.loss_scaler.scale,
                )
        if self._forward_schedules is not None:
            self._forward_schedules.at_boundary(self.global_steps)  # PLD's theta, from the step count before it advances
        self.global_steps += 1
        self.global_samples += samples
        self._step_log.end_step(self)
        self._preemption.at_step_boundary(self)  # a preemption signal on any rank: save this step and exit

    def zero_grad(self) -> None:
        """Drop every accumulated gradient (model ``.grad`` and the fp32 partitions)."""
        for group in self.optimizer.groups:
            for param in group.params:
                param.grad = None
        self.optimizer.zero_grad()
        self.zero.reducer.take_received()
        self._samples.drop_window()
        self._backward_pending = False
        self._manual_window = False

    # ------------------------------------------------------------------ checkpoints (partita/checkpoint)
    def save_checkpoint(
        self,
        save_dir: str | None = None,
        tag: str | None = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        *,
        async_save: bool | None = None,
    ) -> bool:
        """Save the complete training state to ``save_dir/tag`` (default ``global_step{N}``); every
        rank must call it. ``client_state``: JSON values and tensors, returned by load_checkpoint.
        ``async_save`` (default: config ``checkpoint.async_save``) writes from a CPU copy in the
        background. ``save_dir`` defaults to config ``checkpoint.save_dir``."""
        from partita.checkpoint.save import save_checkpoint

        self.finish_pending_step()
        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest, async_save=async_save)

    def load_checkpoint(
        self,
        load_dir: str | None = None,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict | None]:
        """Load a checkpoint saved at any world size and ZeRO stage; every rank must call it.
        ``tag=None``: the tag in ``latest`` (the newest complete one if that is damaged).
        Returns ``(path, client_state)``, or ``(None, None)`` when the directory has none."""
        from partita.checkpoint.load import load_checkpoint

        self.finish_pending_step()
        path, client_state = load_checkpoint(
            self, load_dir, tag=tag, load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
        )
        if path is not None:
            self.loaded_checkpoint = (path, client_state)
            if not load_module_only:
                from partita.config.batch import check_resumed_batch

                check_resumed_batch(self, path)  # another world size: realign accumulation, warn if the batch changed
        return path, client_state

    # ------------------------------------------------------------------ queries
    def get_global_grad_norm(self) -> float | None:
        """Global L2 norm of the unscaled gradients at the last optimizer step, before clipping."""
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_pld_theta(self) -> float | None:
        """Progressive layer drop's current theta (None when it is off), as DeepSpeed's."""
        return None if self.progressive_layer_drop is None else self.progressive_layer_drop.get_theta()

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False):
        """Write the whole model in its compute dtype (all ranks must call; rank 0 writes), in the
        format the name says: ``.safetensors``, or ``torch.save`` of tensors for ``.bin``/``.pt``
        (see :func:`partita.zero.export.save_16bit_model` for tied weights). Works at every ZeRO
        stage, streaming one parameter at a time."""
        from partita.zero.export import save_16bit_model

        self.finish_pending_step()
        return save_16bit_model(self.module, self.zero, save_dir, save_filename,
                                exclude_frozen_parameters=exclude_frozen_parameters)

    def save_fp16_model(self, save_dir: str, save_filename: str = "model.safetensors"):
        """DeepSpeed's older name of :meth:`save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """DeepSpeed's name (accelerate's ``get_state_dict`` calls it): the whole state dict in the
        model's dtype as CPU tensors on rank 0, None on other ranks; all ranks must call. Unlike
        DeepSpeed's it works at every ZeRO stage (see :func:`partita.zero.export.consolidated_16bit_state_dict`).
        At ZeRO-3 ``engine.module.state_dict()`` has placeholders instead (partita/zero/state_dict_guard.py)."""
        import torch.distributed as dist

        from partita.zero.export import consolidated_16bit_state_dict

        self.finish_pending_step()
        state = consolidated_16bit_state_dict(self.module, self.zero, exclude_frozen_parameters=exclude_frozen_parameters)
        return state if not dist.is_initialized() or dist.get_rank() == 0 else None

    def get_fp32_state_dict(self, rank0_only: bool = True) -> dict:
        """Full fp32 weights from the optimizer's master shards, keyed like the model's
        state_dict (all ranks must call; only rank 0 gets them when ``rank0_only``)."""
        from partita.zero.export import fp32_state_dict

        self.finish_pending_step()
        return fp32_state_dict(self.module, self.zero, rank0_only=rank0_only)

    def get_loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    # ------------------------------------------------------------------ offload states (partita/zero/offload_states.py)
    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False) -> dict:
        """DeepSpeed's ``engine.offload_states``: move device tensors to host memory until :meth:`reload_states`
        (colocated rollouts: the generator gets the accelerator). ``include``: kinds of DeepSpeed's
        ``OffloadStateTypeEnum`` ("optim_states", "hp_params", "lp_params", "lp_grads",
        "contiguous_grad_buffer"; None: all). What offload_optimizer / offload_param keep in host memory
        stays there. Each rank moves its own tensors (no collective). Returns the bytes moved per kind.
        backward/step (and forward, once lp_params moved) raise until reload_states."""
        from partita.zero.offload_states import OffloadedStates, parse_device, parse_include

        kinds = parse_include(include)
        parse_device(device)
        self.finish_pending_step()  # a delayed update lands first; one-rank freed blocks are whole again
        if self._offloaded_states is None:
            self._offloaded_states = OffloadedStates()
        return self._offloaded_states.offload(self.module, self.zero, kinds, compute_device=self.device,
                                              pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's ``engine.reload_states``: everything :meth:`offload_states` moved goes back to its
        device, bit for bit, into the same tensor objects; training continues exactly. A no-op when
        nothing is offloaded."""
        if self._offloaded_states is not None:
            self._offloaded_states.reload(non_blocking=non_blocking)
            self._offloaded_states = None

    # ------------------------------------------------------------------ weight streaming (partita/zero/weight_stream.py)
    def iter_16bit_weight_buckets(self, bucket_bytes: int = 512 << 20, exclude_frozen_parameters: bool = False):
        """Yield the whole model in its 16-bit dtype as lists of ``(name, whole tensor)`` of at most
        ``bucket_bytes`` each (a larger tensor comes alone): the weight sync to a generator (vLLM's
        ``load_weights``). Names and values are ``save_16bit_model``'s (``.bin``: tied weights under each
        name). Every rank must iterate to the end (gathers); no rank holds more than one bucket plus one
        tensor beyond its own shards. Read the tensors before asking for the next bucket: they may be
        the model's own storage (stages 0-2) and are freed again after (ZeRO-3)."""
        from partita.zero.weight_stream import iter_16bit_weight_buckets

        self.finish_pending_step()
        if self._offloaded_states is not None:
            self._offloaded_states.refuse_weights("engine.iter_16bit_weight_buckets()")
        return iter_16bit_weight_buckets(self.module, self.zero, bucket_bytes=bucket_bytes,
                                         exclude_frozen_parameters=exclude_frozen_parameters)

    # ------------------------------------------------------------------ torch.compile (partita/compile)
    def compile(self, backend: Any = "inductor", compile_kwargs: dict | None = None, schedule: Any = None,
                *, block_types: Any = None) -> None:
        """DeepSpeed's ``engine.compile``: torch.compile each repeated block (the whole model if it
        has none) with ``backend`` and ``compile_kwargs`` (mode, fullgraph, dynamic, options, ...),
        ZeRO hooks outside the compiled regions. ``schedule`` (DeepCompile passes) is refused;
        ``block_types`` (partita only) picks the blocks. A second call with the same settings does nothing."""
        from partita.compile.apply import compile_engine

        compile_engine(self, backend, compile_kwargs, schedule, block_types=block_types)

    @property
    def is_compiled(self) -> bool:
        """True once the config's compile section or :meth:`compile` compiled the model."""
        from partita.compile.apply import compiled_blocks

        return bool(compiled_blocks(self.module))

    # ------------------------------------------------------------------ monitoring (partita/monitor)
    def set_flops_per_token(self, flops: float, *, tokens_per_sample: int | None = None) -> None:
        """Training FLOPs per token (forward + backward) for the logged TFLOP/s and MFU."""
        self._step_log.set_flops_per_token(flops, tokens_per_sample=tokens_per_sample)

    def flops_profile(self):
        """The flops profiler's :class:`partita.monitor.FlopsProfile` (None before profile_step)."""
        return self._step_log.flops_profile

    def comms_summary(self):
        """This rank's :class:`partita.monitor.CommsSummary` (needs ``comms_logger.enabled``)."""
        from partita.monitor.comms_logger import COMMS_LOGGER

        return COMMS_LOGGER.summary()

    def log_summary(self) -> str:
        """Log (rank 0) and return throughput since warm-up and the communication summary."""
        text = self._step_log.summary()
        if text:
            logger.info("%s", text)
        return text
