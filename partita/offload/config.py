"""The ``offload_optimizer``, ``offload_param`` (inside ``zero_optimization``) and ``aio`` sections.

Keys, meanings and defaults follow DeepSpeed 0.19 (``zero/offload_config.py`` and
``aio_config.py``); partita's additions are marked as such in their descriptions.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from partita.config.base import PARTITA_KEY, JsonInt, StrictSection
from partita.offload.tier_config import OffloadTiersConfig

OffloadDevice = Literal["none", "cpu", "nvme"]
OptimizerOffloadDevice = Literal["none", "cpu", "nvme", "auto"]

_NVME_PATH_HELP = (
    "Directory for swap files when device is \"nvme\" (a fast local disk). It must exist and have "
    "room for the swapped tensors: partita checks both and pre-allocates the files at start. "
    "DeepSpeed default \"/local_nvme\"."
)


class OffloadOptimizerConfig(StrictSection):
    """``zero_optimization.offload_optimizer``: fp32 master weights and optimizer states off the GPU."""

    device: OptimizerOffloadDevice = Field(
        "none",
        description=(
            "Where fp32 master weights and optimizer states live: \"none\" (the accelerator), "
            "\"cpu\" (CPU memory; the optimizer step runs on CPU) or \"nvme\" (files under nvme_path, "
            "streamed through CPU memory sub-group by sub-group). Stages 1-3. DeepSpeed default \"none\". "
            "partita extension: \"auto\" splits the state over all three tiers, accelerator first, then host "
            "memory, then NVMe (see \"tiers\")."
        ),
    )
    nvme_path: str = Field("/local_nvme", description=_NVME_PATH_HELP)
    buffer_count: JsonInt = Field(
        4,
        ge=1,
        description=(
            "Pinned CPU staging buffers for gradient downloads and parameter uploads (and NVMe "
            "reads/writes); bounds the pinned memory partita adds. DeepSpeed default 4."
        ),
    )
    pin_memory: bool = Field(
        True,
        description=(
            "Page-lock CPU buffers so copies to and from the GPU run asynchronously at full PCIe "
            "speed. Ignored without a GPU. DeepSpeed default true."
        ),
    )
    pipeline_read: bool = Field(
        False,
        description="NVMe: read the next sub-group while the current one steps. DeepSpeed default false.",
    )
    pipeline_write: bool = Field(
        False,
        description="NVMe: write a stepped sub-group back while the next one steps. DeepSpeed default false.",
    )
    fast_init: bool = Field(
        False,
        description="NVMe: accepted for compatibility; partita always initialises swap files in large writes. DeepSpeed default false.",
    )
    ratio: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description=(
            "Fraction of the optimizer partition offloaded (by elements, whole parameters at a "
            "time, the earliest-registered first); the rest stays on the accelerator and steps there. "
            "With device \"auto\" it fixes the accelerator's share to 1 - ratio and partita splits the "
            "offloaded part between host memory and NVMe. DeepSpeed default 1.0."
        ),
    )
    tiers: OffloadTiersConfig = Field(
        default_factory=OffloadTiersConfig,
        description=(
            "partita extension, device \"auto\" only: an explicit split per tier, or the capacities and "
            "headroom partita's automatic split uses."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    delayed_param_update: bool = Field(
        False,
        description=(
            "partita extension: the one-step-delayed parameter update of the ZeRO-Offload paper. The "
            "CPU step of step t runs while the accelerator computes step t+1, whose gradients are "
            "therefore taken on weights one update old. This changes the math (it is not the same "
            "training as without it); off by default."
        ),
        json_schema_extra=PARTITA_KEY,
    )

    overlap_step_with_forward: bool = Field(
        False,
        description=(
            "partita extension: the exact (not delayed) offloaded step returns once the gradient norm "
            "is known; a worker thread steps the offloaded partition bucket by bucket in the forward's order "
            "while the next forward runs, each module's forward waiting only for the buckets of its own "
            "parameters. With device \"nvme\" or \"auto\" (tiers) the NVMe groups' sub-groups are stepped there "
            "too, their reads ahead and writes behind on the disk while host buckets step. The same update bit "
            "for bit; between step() and the next forward, parameters read directly may be one update old "
            "(engine.finish_pending_step() lands it). Needs device \"cpu\", \"nvme\" or \"auto\", ZeRO stage 1 "
            "or 2, torch's Adam/AdamW, and a model whose modules use only their own parameters before their "
            "own forward; used where the offloaded partition is not sharded (one data-parallel rank), "
            "elsewhere the plain step runs. With delayed_param_update (device \"cpu\"), the delayed update lands "
            "beside the next forward the same way instead of before it. Off by default."
        ),
        json_schema_extra=PARTITA_KEY,
    )

    host_step_16bit_grads: bool = Field(
        False,
        description=(
            "partita extension: keep the offloaded gradient partition in host memory in the model's "
            "16-bit dtype (bf16/fp16) and step it with a torch.compile'd host AdamW that reads it "
            "directly (partita/optim/host_adamw_compiled.py): 2 bytes per gradient element down and "
            "read instead of 4, and no fp32 write-back of the unscaled gradient; bit-identical to the "
            "fp32 path. Needs device \"cpu\"; used with torch's fused Adam/AdamW on one data-parallel "
            "rank, elsewhere (and for a step that accumulates micro-batches into the partition) the "
            "fp32 partition is used. Off by default: on a 2-core host its exact FMA emulation is "
            "compute-bound and slower than torch's fused kernel (docs/guides/offload.md)."
        ),
        json_schema_extra=PARTITA_KEY,
    )

    check_host_memory: bool = Field(
        True,
        description=(
            "partita extension: at initialize, refuse an offload whose host buffers (estimated by partita "
            "estimate, without the process's own few GiB) exceed the host memory available to this rank, "
            "instead of running into the kernel's OOM killer (partita/offload/host_check.py). Applies to "
            "device \"cpu\"/\"nvme\" and to offload_param; \"auto\" plans its own fit."
        ),
        json_schema_extra=PARTITA_KEY,
    )

    @property
    def enabled(self) -> bool:
        return self.device != "none"

    def tier_fractions(self) -> tuple[float, float, float]:
        """(accelerator, cpu, nvme) shares of every optimizer group, whatever the device.

        ``"auto"`` must have been decided already (``tiers.fractions`` set, see
        ``partita.offload.auto_placement.resolve_tiered_placement``)."""
        if self.device == "none":
            return (1.0, 0.0, 0.0)
        if self.device == "cpu":
            return (1.0 - self.ratio, self.ratio, 0.0)
        if self.device == "nvme":
            return (1.0 - self.ratio, 0.0, self.ratio)
        if self.tiers.fractions is None:
            raise RuntimeError(
                "offload_optimizer.device \"auto\" was not decided before ZeRO was applied; partita.initialize "
                "decides it (partita.offload.auto_placement.resolve_tiered_placement)"
            )
        return self.tiers.fractions.as_tuple()

    @model_validator(mode="after")
    def _tiers_need_auto(self) -> OffloadOptimizerConfig:
        if "tiers" in self.model_fields_set and self.device != "auto":
            raise PydanticCustomError(
                "offload_tiers_device",
                "offload_optimizer.tiers applies to device \"auto\" only (device is \"{device}\"); set device to "
                "\"auto\", or remove tiers (device \"cpu\"/\"nvme\" with ratio r is the split 1-r / r)",
                {"device": self.device},
            )
        if self.device == "auto" and self.tiers.fractions is not None and self.ratio != 1.0:
            raise PydanticCustomError(
                "offload_tiers_ratio",
                "offload_optimizer.ratio={ratio} and tiers.fractions both fix the accelerator's share; give one "
                "of them (tiers.fractions.accelerator = 1 - ratio)",
                {"ratio": self.ratio},
            )
        return self

    @model_validator(mode="after")
    def _delay_needs_offload(self) -> OffloadOptimizerConfig:
        if self.delayed_param_update and not self.enabled:
            raise PydanticCustomError(
                "offload_delay",
                "delayed_param_update overlaps the host optimizer step with the next step and needs "
                "offload_optimizer.device \"cpu\" or \"nvme\"; set the device or remove delayed_param_update",
            )
        return self

    @model_validator(mode="after")
    def _overlap_needs_offload(self) -> OffloadOptimizerConfig:
        if not self.overlap_step_with_forward:
            return self
        if self.device == "none":
            raise PydanticCustomError(
                "offload_overlap",
                "overlap_step_with_forward runs the offloaded optimizer step beside the next forward and needs "
                "offload_optimizer.device \"cpu\", \"nvme\" or \"auto\" (got \"none\"); set one of them or remove "
                "overlap_step_with_forward",
            )
        return self

    @model_validator(mode="after")
    def _16bit_grads_need_cpu(self) -> OffloadOptimizerConfig:
        if self.host_step_16bit_grads and self.device != "cpu":
            raise PydanticCustomError(
                "offload_16bit_grads",
                "host_step_16bit_grads keeps the gradient partition in host memory for the host AdamW and "
                "needs offload_optimizer.device \"cpu\" (got \"{device}\"); set device \"cpu\" or remove "
                "host_step_16bit_grads",
                {"device": self.device},
            )
        return self


class OffloadParamConfig(StrictSection):
    """``zero_optimization.offload_param``: ZeRO-3 parameter shards off the GPU."""

    device: OffloadDevice = Field(
        "none",
        description=(
            "Where each rank's 16-bit parameter shards live between uses at ZeRO stage 3: \"none\", "
            "\"cpu\" or \"nvme\". They are brought to the accelerator by the stage-3 prefetch. "
            "DeepSpeed default \"none\"."
        ),
    )
    nvme_path: str = Field("/local_nvme", description=_NVME_PATH_HELP)
    buffer_count: JsonInt = Field(5, ge=1, description="Pinned buffers for parameter swapping. DeepSpeed default 5.")
    buffer_size: JsonInt = Field(
        100_000_000, gt=0, description="Elements per parameter swap buffer. DeepSpeed default 1e8."
    )
    max_in_cpu: JsonInt = Field(
        1_000_000_000,
        ge=0,
        description="NVMe: parameter elements kept in CPU memory before swapping to disk. DeepSpeed default 1e9.",
    )
    pin_memory: bool = Field(True, description="Page-lock CPU parameter shards. DeepSpeed default true.")
    gather_from_master: bool = Field(
        False,
        description=(
            "partita extension, device \"cpu\" with the optimizer offloaded to host memory: keep no 16-bit copy "
            "of the parameters in host memory. A gather copies the fp32 master's pieces to the accelerator "
            "and casts them there (as FSDP2's CPUOffloadPolicy does). Saves 2 bytes per parameter of host "
            "memory and the host cast after each step, for twice the PCIe bytes per gather. The same values "
            "bit for bit. Not with delayed_param_update (its host step rewrites the master while the next "
            "forward gathers). In fp32 training it saves the 4-byte host copy at the same PCIe bytes per gather."
        ),
        json_schema_extra=PARTITA_KEY,
    )

    @property
    def enabled(self) -> bool:
        return self.device != "none"


class AioConfig(StrictSection):
    """``aio``: how NVMe swap files are read and written."""

    key_aliases: ClassVar[dict[str, str]] = {"thread_count": "intra_op_parallelism"}

    block_size: JsonInt = Field(
        1_048_576,
        gt=0,
        description="Bytes per read/write request; a multiple of 4096 for O_DIRECT. DeepSpeed default 1048576.",
    )
    queue_depth: JsonInt = Field(
        8, ge=1, description="Requests in flight per I/O thread. DeepSpeed default 8."
    )
    intra_op_parallelism: JsonInt = Field(
        1,
        ge=1,
        description=(
            "Threads that split one tensor's reads and writes (also spelled thread_count). "
            "DeepSpeed default 1."
        ),
    )
    single_submit: bool = Field(
        False, description="Submit requests one at a time instead of in batches. DeepSpeed default false."
    )
    overlap_events: bool = Field(
        True, description="Overlap submitting new requests with completing earlier ones. DeepSpeed default true."
    )
    use_gds: bool = Field(
        False,
        description="GPUDirect Storage. Not available in partita: only false is accepted. DeepSpeed default false.",
    )

    @field_validator("block_size")
    @classmethod
    def _page_multiple(cls, value: int) -> int:
        if value % 4096:
            raise PydanticCustomError(
                "aio_block_size",
                "aio.block_size must be a multiple of 4096 bytes (the page size O_DIRECT needs), e.g. 1048576",
            )
        return value

    @field_validator("use_gds")
    @classmethod
    def _no_gds(cls, value: bool) -> bool:
        if value:
            raise PydanticCustomError(
                "aio_use_gds",
                "GPUDirect Storage is not available in partita; set aio.use_gds to false (NVMe swaps go "
                "through pinned CPU buffers)",
            )
        return value
