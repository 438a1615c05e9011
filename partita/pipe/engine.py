"""``PipelineEngine``: what ``partita.initialize`` returns for a :class:`partita.pipe.PipelineModule`.

DeepSpeed's pipeline API: ``loss = engine.train_batch(data_iter)`` runs one whole batch
(``gradient_accumulation_steps`` micro-batches) through the pipeline schedule and updates the
weights; ``forward`` / ``backward`` / ``step`` are errors, as in DeepSpeed.

One batch, on every rank:

1. the first stage reads the inputs and the last stage the labels of every micro-batch from the
   data iterator (the others read nothing), joined into one batch the schedule splits again;
2. the torch schedule (:mod:`partita.pipe.schedule`) runs forwards and backwards; gradients
   accumulate in ``param.grad`` (the ZeRO reducer's hooks are not armed), already divided by
   the number of micro-batches; under ZeRO-3 every layer is gathered per micro-batch forward and
   backward and freed after ([Note: pipeline stages] in partita/zero/param_gatherer.py);
3. tied parameters' gradients are summed over their owner stages, then the ZeRO reducer averages
   every gradient over this stage's ZeRO group (data x sequence) once, into the fp32 partitions
   (ZeRO-1: reduce-scatter), exactly what gradient accumulation does for the plain Engine;
4. the ZeRO optimizer steps (:meth:`partita.engine.Engine._apply_update`, the plain engine's own
   epilogue); its global gradient norm is summed over the pipe axis too (each tied parameter
   counted once), so clipping and fp16 overflow skipping agree on every stage.

Monitoring: the step log's loss is the batch loss broadcast from the last stage (the same on
every stage), its samples/s the whole pipeline's batch (``train_batch_size``) per step, its
tokens counted on the first stage only; ``engine.last_bubble`` and the log's ``pipe_idle_s<k>``
give each stage's idle time (:mod:`partita.pipe.bubble`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

# The module, not the partita.pipe package: the package's lazy PipelineEngine is this module.
import partita.pipe.checkpoint as checkpoint
from partita.data.sampler import infinite_batches
from partita.distributed import collectives
from partita.engine import Engine
from partita.pipe.bubble import BubbleTimer
from partita.pipe.failure import FailureReporter
from partita.pipe.module import PipelineModule
from partita.pipe.sequence import SequenceSlices
from partita.pipe.setup import norm_group
from partita.pipe.schedule import ScaledLoss, build_schedule, build_stages, check_micro_batches
from partita.tensor_containers import map_tensors

logger = logging.getLogger("partita")

__all__ = ["PipelineEngine", "PipelineError"]


class PipelineError(RuntimeError):
    """A DeepSpeedEngine call that a pipeline engine does not offer (DeepSpeed's ``PipelineError``)."""


class PipelineEngine(Engine):
    """Trains a PipelineModule with ``train_batch``; the plain Engine's counters and queries stay."""

    def __init__(self, *, module: PipelineModule, **kwargs: Any) -> None:
        super().__init__(module=module, **kwargs)
        topology, config = self.topology, self.config
        pipeline = config.pipeline
        if topology.pipe_rank != module.stage_id or topology.pipe_size != module.num_stages:
            raise RuntimeError(  # the module and the mesh derive stages from the same rank order
                f"rank {topology.rank}: the PipelineModule built stage {module.stage_id} of {module.num_stages} but the "
                f"topology puts this rank at pipe {topology.pipe_rank} of {topology.pipe_size}"
            )
        self.micro_batches = self._batch.gradient_accumulation_steps
        self.schedule_name = pipeline.schedule
        check_micro_batches(self.schedule_name, self.micro_batches, module.num_stages, module.virtual_stages)
        if pipeline.activation_checkpoint_interval > 0:
            module.activation_checkpoint_interval = pipeline.activation_checkpoint_interval  # DeepSpeed's override
        module.checkpoint_use_reentrant = bool(pipeline.use_reentrant)
        if module.loss_fn is None:
            raise ValueError("the PipelineModule has no loss_fn: build it with PipelineModule(..., loss_fn=...)")
        self.num_stages = module.num_stages
        self.stage_id = module.stage_id
        # A stage that fails ends every stage at once, naming itself (partita/pipe/failure.py).
        self._failures = FailureReporter(stage=module.stage_id, rank=topology.rank, device=self.device)
        # zero bubble: nn.Linear weight gradients kept for the W action (partita/pipe/weight_grads.py)
        defer = self.schedule_name == "zero_bubble" and pipeline.zero_bubble_weight_split == "linear"
        self._stages = build_stages(module, device=self.device, group=topology.pipe_group, defer_linear_weights=defer)
        # Sequence parallelism: this rank's slice of each sequence, and the loss over the sequence group.
        self._slices = SequenceSlices(rank=topology.sequence_rank, size=topology.sequence_size,
                                      group=topology.sequence_group, mode=config.sequence_parallel.mode
                                      ) if topology.sequence_size > 1 else None
        self._loss = ScaledLoss(module.loss_fn, self.micro_batches, self._slices)
        measure = pipeline.measure_bubble if pipeline.measure_bubble is not None else self.device.type != "cuda"
        # Idle time per stage (partita/pipe/bubble.py); None when pipeline.measure_bubble is off.
        self._bubble = BubbleTimer(stage_id=module.stage_id, num_stages=module.num_stages,
                                   micro_batches=self.micro_batches, schedule=self.schedule_name,
                                   device=self.device, virtual_stages=module.virtual_stages) if measure else None
        # The last batch's idle time per stage (BubbleTimer.gather's dict), None before the first batch.
        self.last_bubble: dict[str, Any] | None = None
        loss_fn: Any = self._loss
        if self._bubble is not None:
            self._bubble.wrap_stages(self._stages)
            loss_fn = self._bubble.timed(self._loss)
            self._step_log.extra_metrics = self._bubble.window_metrics
        self._train_schedule = build_schedule(self.schedule_name, self._stages, self.micro_batches, loss_fn)
        self._eval: Any = None  # built at the first eval_batch
        self._last_stage_rank = dist.get_global_rank(topology.pipe_group, topology.pipe_size - 1)
        group = norm_group(topology)  # pipe (x tensor): every stage's gradients in the clipping norm
        if group is not None:
            self.optimizer.count_norm_across(group, uncounted_params=module.uncounted_in_norm(),
                                             covers_tensor_group=topology.tensor_size > 1)
        # Tensor and sequence ranks must read the same samples: checked once, at the first batch.
        self._batch_checked = topology.tensor_size == 1 and topology.sequence_size == 1
        self._data_iterator: Iterator | None = (
            infinite_batches(self.training_dataloader) if self.training_dataloader is not None else None
        )
        if topology.rank == 0:
            for row in module.partition_summary():
                logger.info("pipeline stage %d: layers %d-%d (%s), %d parameters", row["stage"], row["layers"][0],
                            row["layers"][1] - 1, ", ".join(str(n) for n in row["names"]), row["parameters"])

    # ------------------------------------------------------------------ DeepSpeed's queries
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterator) -> None:
        """The iterator ``train_batch()`` reads when called without one (first and last stages)."""
        self._data_iterator = iterator

    def is_pipe_parallel(self) -> bool:
        return self.num_stages > 1

    # ------------------------------------------------------------------ the batch
    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One batch: ``gradient_accumulation_steps`` micro-batches through the schedule, then the
        optimizer step. Returns the batch's mean loss (over micro-batches and data ranks), the same
        value on every stage."""
        if self._offloaded_states is not None:  # engine.offload_states(): the step's tensors are in host memory
            self._offloaded_states.refuse("engine.train_batch()")
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() needs gradients enabled (it was called under torch.no_grad()); "
                               "use eval_batch() to evaluate")
        self.module.train()
        args, target = self._read_agreed(data_iter, "train_batch")
        self._step_log.observe_batch(args)  # tokens on the first stage; starts the throughput clock
        self._loss.losses.clear()
        self._loss.loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        with self._failures.guard("train_batch"):
            if not self._batch_checked:
                self._check_same_batch(args, target)
            args, target = self._sequence_slices(args, target)
            with self._step_log.timer("pipeline_schedule"):
                if self._bubble is not None:
                    self._bubble.run(lambda: self._run(self._train_schedule, args, target))
                else:
                    self._run(self._train_schedule, args, target)
            with self._step_log.timer("backward_allreduce"):
                self._reduce_gradients()
            # The last micro_batches calls are the batch's: torch 2.13 also calls the loss once while it
            # infers the backward metadata at a schedule's first step (its gradients go nowhere).
            loss = self._mean_loss(self._loss.losses[-self.micro_batches:], reduce_output="avg")
            if self._bubble is not None:
                self.last_bubble = self._bubble.gather()
        self._step_log.observe_loss(loss)
        self.micro_steps += self.micro_batches
        self._apply_update(self._batch.train_batch_size)
        return loss

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg") -> Any:
        """Forward only over ``gradient_accumulation_steps`` micro-batches.

        Returns the loss (``reduce_output="avg"``: the mean over micro-batches and data ranks; None:
        a tensor of each micro-batch's loss, averaged over data ranks), the same on every stage;
        with ``return_logits`` a pair ``(loss, outputs)``, the outputs on the last stage only
        (None elsewhere). ``compute_loss=False``: the last stage's outputs instead of the loss.
        """
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None")
        was_training = self.module.training
        self.module.eval()
        try:
            args, target = self._read_agreed(data_iter, "eval_batch")
            with torch.no_grad(), self._failures.guard("eval_batch"):
                args, target = self._sequence_slices(args, target)
                outputs = self._eval_schedule().step(*args)
                losses = []
                if compute_loss and self.is_last_stage():
                    for out, tgt in zip(_split(outputs, self.micro_batches), torch.tensor_split(target, self.micro_batches)):
                        losses.append(self._loss.unscaled(out, tgt).detach().float().reshape(()))
                loss = self._mean_loss(losses, reduce_output=reduce_output) if compute_loss else outputs
        finally:
            self.module.train(was_training)
        if return_logits:
            return loss, outputs if self.is_last_stage() else None
        return loss

    # ------------------------------------------------------------------ pieces of a batch
    def _read_agreed(self, data_iter: Iterator | None, caller: str) -> tuple[tuple, torch.Tensor | None]:
        """:meth:`_read_batch` on every rank, then one all-reduce so that a stage that could not
        read (only the first and last stages read) stops every stage before the schedule starts."""
        error: Exception | None = None
        try:
            args, target = self._read_batch(data_iter, caller)
        except Exception as failed:  # noqa: BLE001 - re-raised by agree_on_read on this rank
            error = failed
        self._failures.agree_on_read(error, caller)
        return args, target

    def _read_batch(self, data_iter: Iterator | None, caller: str) -> tuple[tuple, torch.Tensor | None]:
        """The first stage's inputs and the last stage's labels of every micro-batch, each joined
        along dim 0 (the schedule cuts them back into the same micro-batches)."""
        first, last = self.is_first_stage(), self.is_last_stage()
        if not (first or last):
            return (), None
        iterator = data_iter if data_iter is not None else self._data_iterator
        if iterator is None:
            raise ValueError(f"{caller}() got no data iterator: pass one, call engine.set_dataiterator(it), or give "
                             "initialize(training_data=...)")
        inputs, labels = [], []
        for k in range(self.micro_batches):
            try:
                item = next(iterator)
            except StopIteration:
                raise RuntimeError(
                    f"{caller}(): the data iterator ran out after {k} of {self.micro_batches} micro-batches "
                    "(gradient_accumulation_steps); give a longer or repeating iterator"
                ) from None
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError(f"{caller}(): each item of the data iterator must be (inputs, labels), got "
                                 f"{type(item).__name__}")
            inputs.append(item[0] if isinstance(item[0], tuple) else (item[0],))
            labels.append(item[1])
        sizes = {int(x[0].shape[0]) for x in inputs}
        if len(sizes) != 1:
            raise ValueError(f"{caller}(): micro-batches of different sizes {sorted(sizes)}; every micro-batch must "
                             "hold train_micro_batch_size_per_gpu samples")
        args: tuple = ()
        if first:
            args = tuple(torch.cat([x[i] for x in inputs]).to(self.device) for i in range(len(inputs[0])))
            if self.compute_dtype != torch.float32:
                args = map_tensors(args, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t)
        target = None
        if last:
            if not all(isinstance(y, torch.Tensor) for y in labels):
                raise NotImplementedError(f"{caller}(): labels must be one tensor per micro-batch (tuples of labels "
                                          "are not implemented for pipelines yet)")
            target = torch.cat(labels).to(self.device)
        return args, target

    def _check_same_batch(self, args: tuple, target: torch.Tensor | None) -> None:
        """Tensor and sequence parallelism: every tensor rank and every sequence rank of a stage must
        compute on the same micro-batches (they hold parts of the same layers, or slices of the same
        sequences). Checked once, at the first batch, from a digest of the inputs and labels this
        rank read (sums and sizes), over the tensor group, then the sequence group."""
        self._batch_checked = True
        tensors = [t for t in (*args, target) if isinstance(t, torch.Tensor)]
        digest = torch.tensor([float(t.detach().double().sum()) for t in tensors] + [float(sum(t.numel() for t in tensors))],
                              dtype=torch.float64, device=self.device)
        topology = self.topology
        for axis, size, group in (("tensor", topology.tensor_size, topology.tensor_group),
                                  ("sequence", topology.sequence_size, topology.sequence_group)):
            if size == 1:
                continue
            gathered = torch.empty(size * digest.numel(), dtype=torch.float64, device=self.device)
            collectives.all_gather_into_tensor(gathered, digest, group=group,
                                               purpose=f"pipeline: the {axis} ranks' first batch digest")
            rows = gathered.view(size, -1)
            if not all(torch.equal(row, rows[0]) for row in rows):
                raise ValueError(
                    f"{axis} parallelism: the {axis} ranks of stage {self.stage_id} read different micro-batches at the "
                    f"first train_batch; every {axis} rank must get the same samples: shard the data by "
                    "engine.topology.data_rank / data_size, not by the global rank"
                )

    def _sequence_slices(self, args: tuple, target: torch.Tensor | None) -> tuple[tuple, torch.Tensor | None]:
        """With sequence parallelism, this rank's tokens of the inputs and labels it read
        (:mod:`partita.pipe.sequence`); unchanged otherwise."""
        if self._slices is None:
            return args, target
        return self._slices.cut_inputs(args), self._slices.cut_labels(target)

    def _run(self, schedule: Any, args: tuple, target: torch.Tensor | None) -> Any:
        kwargs: dict[str, Any] = {}
        if self.is_last_stage() and target is not None:
            kwargs = {"target": target, "losses": []}
        return schedule.step(*args, **kwargs)

    def _eval_schedule(self) -> Any:
        """A forward-only schedule over stage objects of its own: torch 2.11 does not re-infer a
        stage's receive buffers when one schedule switches between eval and train (2.13 does), so
        sharing the training stages broke the next train_batch there."""
        if self._eval is None:
            stages = build_stages(self.module, device=self.device, group=self.topology.pipe_group)
            self._eval = build_schedule(self.schedule_name, stages, self.micro_batches, None)
        return self._eval

    def _reduce_gradients(self) -> None:
        """Tied gradients summed over their owner stages, then one ZeRO reduction for the batch."""
        reducer = self.zero.reducer
        reducer.begin_backward(reduce=True)
        for tied in self.module.tied_groups():
            if tied.group is None:
                continue
            for param in tied.params:
                if param.grad is None:  # not zeros_like: under ZeRO-3 the parameter is freed (its shape stays)
                    param.grad = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
                collectives.all_reduce(param.grad, group=tied.group, purpose=f"tied-layer {tied.key!r} gradient sum")
        reducer.finish_backward()
        if self.zero.gatherer is not None:
            self.zero.gatherer.release_all()  # ZeRO-3: finish stray gathers, free what is still whole

    def _mean_loss(self, losses: list[torch.Tensor], *, reduce_output: str | None) -> torch.Tensor:
        """On the last stage: the mean (or each) micro-batch loss averaged over data ranks;
        broadcast from there to every stage."""
        shape = () if reduce_output == "avg" else (self.micro_batches,)
        if self.is_last_stage():
            stacked = torch.stack(losses)
            value = stacked.mean() if reduce_output == "avg" else stacked
            value = value.to(self.device)
            if self.topology.data_size > 1:
                collectives.all_reduce(value, group=self.topology.data_group, purpose="pipeline loss mean over data ranks")
                value /= self.topology.data_size
        else:
            value = torch.zeros(shape, dtype=torch.float32, device=self.device)
        if self.num_stages > 1:
            collectives.broadcast(value, src=self._last_stage_rank, group=self.topology.pipe_group,
                                  purpose="pipeline loss broadcast from the last stage")
        return value

    # ------------------------------------------------------------------ what a pipeline engine refuses
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("a pipeline engine runs whole batches: call engine.train_batch(data_iter) (or eval_batch), "
                            "not engine(batch) / engine.forward")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("a pipeline engine runs backward inside engine.train_batch(data_iter); "
                            "engine.backward() is not available in pipeline mode")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError("a pipeline engine steps inside engine.train_batch(data_iter); "
                            "engine.step() is not available in pipeline mode")

    # ------------------------------------------------------------------ checkpoints (partita/pipe/checkpoint.py)
    def save_checkpoint(self, save_dir: str | None = None, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, *, async_save: bool | None = None) -> bool:
        """DeepSpeed's signature; keyed by layer, so it loads at any stage count, data size and ZeRO stage."""
        return checkpoint.save_checkpoint(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                          async_save=async_save)

    def load_checkpoint(self, load_dir: str | None = None, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict | None]:
        """DeepSpeed's signature; a checkpoint saved with any number of stages (``tag=None``: ``latest``)."""
        return checkpoint.load_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                                          load_optimizer_states=load_optimizer_states,
                                          load_lr_scheduler_states=load_lr_scheduler_states,
                                          load_module_only=load_module_only)

    def save_16bit_model(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("save_16bit_model of a pipeline engine is not implemented yet (each stage holds "
                                  "only its layers)")

    def get_fp32_state_dict(self, *args: Any, **kwargs: Any) -> dict:
        raise NotImplementedError("get_fp32_state_dict of a pipeline engine is not implemented yet (each stage holds "
                                  "only its layers)")

    def _zero3_consolidated_16bit_state_dict(self, *args: Any, **kwargs: Any) -> dict:
        raise NotImplementedError("_zero3_consolidated_16bit_state_dict of a pipeline engine is not implemented yet "
                                  "(each stage holds only its layers): save_checkpoint(dir) saves every stage's "
                                  "weights, at any ZeRO stage")


def _split(outputs: Any, parts: int) -> list[Any]:
    """The last stage's merged outputs cut back into micro-batches (torch merges them along dim 0)."""
    if isinstance(outputs, torch.Tensor):
        return list(torch.tensor_split(outputs, parts))
    columns = [torch.tensor_split(t, parts) for t in outputs]
    return [tuple(c[k] for c in columns) for k in range(parts)]
