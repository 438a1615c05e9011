"""DeepSpeed's ``elasticity`` section: one global batch that is valid on every GPU count of a range.

An elastic job may run on 8 GPUs today and on 6 after a node is lost. The math of training
(the gradient of one optimizer step) stays the same only if the global batch stays the same,
so it must divide into ``micro-batch x gradient-accumulation x GPUs`` for every GPU count
the job may get. The section names the acceptable micro-batches and the largest acceptable
global batch; :func:`compute_elastic_batch` picks the global batch that works for the most GPU
counts in ``[min_gpus, max_gpus]``, and for the GPU count of this run the largest micro-batch
that divides it. Gradient accumulation follows, so a job resumed on another valid GPU count
keeps its global batch (:mod:`partita.config.batch` resolves it on every launch).

The algorithm is DeepSpeed's ``compute_elastic_config`` (``deepspeed/elasticity``), whose last
release is DeepSpeed 0.18.9: DeepSpeed 0.19 removed the section (0.19.8 refuses it with
"Elastic training has been removed"). partita keeps the keys and their semantics:

- Candidates: each micro-batch, and their least common multiple, scaled by the largest highly
  composite number that keeps it within ``max_train_batch_size`` (highly composite numbers
  have more divisors than any smaller number, so they fit the most GPU counts).
- A candidate's valid GPU counts: every divisor of ``candidate / micro`` (for each micro-batch
  that divides the candidate) inside ``[min_gpus, max_gpus]``. The candidate with the most
  wins; a tie goes to the larger batch (``prefer_larger_batch``) or the smaller.
- Version 0.2 counts nodes instead of GPUs (``num_gpus_per_node``, ``model_parallel_size``) and,
  on a GPU count outside the valid list, falls back to a batch specific to that count (which
  changes the global batch when the job later resumes elsewhere; a warning says so).

One deliberate difference from DeepSpeed 0.18.9: a candidate above ``max_train_batch_size``
(the least common multiple of the micro-batches can exceed it) is dropped, as DeepSpeed's own
later fix does, instead of being offered; the cap is what the user asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce
from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from partita.config.base import ConfigError, JsonInt, StrictSection

# The highly composite numbers up to 720720 (OEIS A002182), the list DeepSpeed scales by.
HIGHLY_COMPOSITE = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080,
    15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640,
    498960, 554400, 665280, 720720,
)
VERSIONS = (0.1, 0.2)
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class ElasticityConfig(StrictSection):
    """DeepSpeed's ``elasticity`` keys (0.18.9, the last release that had them); off by default."""

    enabled: bool = Field(False, description="Pick the batch sizes from this section. DeepSpeed default false.")
    max_train_batch_size: JsonInt = Field(
        2000, ge=1,
        description="Largest acceptable global batch (samples per optimizer step). Required when enabled.",
    )
    micro_batch_sizes: list[JsonInt] = Field(
        default_factory=lambda: [2, 4, 6],
        description="Acceptable micro-batches per GPU (what fits in memory). Required when enabled.",
    )
    min_gpus: JsonInt = Field(1, ge=1, description="Fewest GPUs the job may run on. DeepSpeed default 1.")
    max_gpus: JsonInt = Field(10000, ge=1, description="Most GPUs the job may run on. DeepSpeed default 10000.")
    min_time: float = Field(
        0, ge=0,
        description=(
            "Minutes a resource scheduler should let the job run before resizing it (0: unknown). Read by "
            "schedulers, not by training; partita records it. DeepSpeed default 0."
        ),
    )
    version: float = Field(0.2, description="The algorithm: 0.1 (GPU counts) or 0.2 (node counts). Default 0.2.")
    prefer_larger_batch: bool = Field(
        True, description="On a tie in valid GPU counts take the larger batch (else the smaller). Default true."
    )
    ignore_non_elastic_batch_info: bool = Field(
        False,
        description=(
            "With elasticity on, batch keys elsewhere in the config are an error (they would be overridden); "
            "true ignores them instead, with a warning. Default false."
        ),
    )
    num_gpus_per_node: JsonInt = Field(1, ge=1, description="Version 0.2: GPUs per node. Default 1.")
    model_parallel_size: JsonInt = Field(
        1, ge=1, description="Version 0.2: GPUs per model replica (tensor x pipeline). Default 1."
    )

    @field_validator("version")
    @classmethod
    def _known_version(cls, value: float) -> float:
        if value not in VERSIONS:
            raise PydanticCustomError(
                "elasticity_version", "elasticity.version {value} is not one of 0.1 or 0.2 (DeepSpeed's versions)",
                {"value": value},
            )
        return value

    @field_validator("micro_batch_sizes")
    @classmethod
    def _positive_micro_batches(cls, value: list[int]) -> list[int]:
        if not value or any(m < 1 for m in value):
            raise PydanticCustomError(
                "elasticity_micro_batches",
                "elasticity.micro_batch_sizes must be a non-empty list of integers >= 1, got {value}",
                {"value": value},
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ElasticityConfig:
        if not self.enabled:
            return self
        missing = [k for k in ("max_train_batch_size", "micro_batch_sizes") if k not in self.model_fields_set]
        if missing:
            raise PydanticCustomError(
                "elasticity_missing",
                "elasticity is enabled but {missing} is not set; DeepSpeed requires both max_train_batch_size and "
                "micro_batch_sizes, e.g. \"max_train_batch_size\": 2000, \"micro_batch_sizes\": [2, 4, 6]",
                {"missing": " and ".join(missing)},
            )
        if self.min_gpus > self.max_gpus:
            raise PydanticCustomError(
                "elasticity_gpu_range",
                "elasticity.min_gpus ({lo}) is greater than max_gpus ({hi}); swap them or widen the range",
                {"lo": self.min_gpus, "hi": self.max_gpus},
            )
        too_big = [m for m in self.micro_batch_sizes if m > self.max_train_batch_size]
        if too_big:
            raise PydanticCustomError(
                "elasticity_micro_too_big",
                "elasticity.micro_batch_sizes {big} exceed max_train_batch_size {cap}; every micro-batch must fit in "
                "the global batch",
                {"big": too_big, "cap": self.max_train_batch_size},
            )
        if self.model_parallel_size > 1 and self.version != 0.2:
            raise PydanticCustomError(
                "elasticity_mp_version",
                "elasticity.model_parallel_size {mp} needs version 0.2 (version 0.1 counts GPUs, not replicas); "
                "set \"version\": 0.2",
                {"mp": self.model_parallel_size},
            )
        if self.num_gpus_per_node % self.model_parallel_size:
            raise PydanticCustomError(
                "elasticity_mp_per_node",
                "elasticity.num_gpus_per_node {n} is not a multiple of model_parallel_size {mp}; a model replica "
                "must not straddle nodes",
                {"n": self.num_gpus_per_node, "mp": self.model_parallel_size},
            )
        return self


@dataclass(frozen=True)
class ElasticBatch:
    """What the section picks: the global batch, the GPU counts it fits, this run's micro-batch."""

    train_batch_size: int
    valid_gpus: tuple[int, ...]
    micro_batch_size: int
    # False when version 0.2 fell back to a batch for this GPU count only (not in valid_gpus).
    world_independent: bool = True


# ---------------------------------------------------------------------------- the algorithm (pure)


def _largest_highly_composite_at_most(value: int) -> int:
    return max(h for h in HIGHLY_COMPOSITE if h <= value)


def candidate_batch_sizes(micro_batches: list[int], max_batch: int) -> list[int]:
    """Each micro-batch and their LCM, scaled by a highly composite number to at most ``max_batch``."""
    lcm = reduce(math.lcm, micro_batches)
    candidates = set()
    for base in [*micro_batches, lcm]:
        if base > max_batch:
            continue  # only the LCM can be (micro-batches are checked against the cap)
        candidates.add(base * _largest_highly_composite_at_most(max_batch // base))
    return sorted(candidates)


def valid_gpu_counts(batch: int, micro_batches: list[int], min_gpus: int, max_gpus: int) -> list[int]:
    """GPU counts in ``[min_gpus, max_gpus]`` that split ``batch`` as micro x accumulation x GPUs."""
    counts = set()
    for micro in micro_batches:
        if batch % micro:
            continue
        per_micro = batch // micro  # GPUs x accumulation steps
        counts.update(g for g in range(min_gpus, min(max_gpus, per_micro) + 1) if per_micro % g == 0)
    return sorted(counts)


def best_batch(micro_batches: list[int], max_batch: int, min_gpus: int, max_gpus: int,
               prefer_larger: bool) -> tuple[int, list[int]]:
    """Version 0.1: the candidate valid for the most GPU counts; ties by size (``prefer_larger``)."""
    best, best_gpus = None, []
    for batch in candidate_batch_sizes(micro_batches, max_batch):
        gpus = valid_gpu_counts(batch, micro_batches, min_gpus, max_gpus)
        better_tie = best is not None and (batch > best if prefer_larger else batch < best)
        if best is None or len(gpus) > len(best_gpus) or (len(gpus) == len(best_gpus) and better_tie):
            best, best_gpus = batch, gpus
    return best, best_gpus


def _largest_dividing_micro(micro_batches: list[int], per_gpu: int) -> int | None:
    fitting = [m for m in set(micro_batches) if per_gpu % m == 0]
    return max(fitting) if fitting else None


def compute_elastic_batch(section: ElasticityConfig, *, world_size: int) -> ElasticBatch:
    """The global batch, its valid GPU counts and this run's micro-batch for ``world_size`` GPUs.

    Raises:
        ConfigError: ``world_size`` is not a valid GPU count (version 0.1), or no batch fits.
    """
    micro = list(section.micro_batch_sizes)
    if section.version == 0.1:
        batch, gpus = best_batch(micro, section.max_train_batch_size, section.min_gpus, section.max_gpus,
                                 section.prefer_larger_batch)
        independent = True
    else:
        batch, gpus, independent = _version_02(section, micro, world_size)
    if not gpus:
        raise ConfigError(
            f"elasticity finds no GPU count in [{section.min_gpus}, {section.max_gpus}] for any global batch up to "
            f"max_train_batch_size {section.max_train_batch_size} with micro_batch_sizes {micro}; raise "
            "max_train_batch_size or widen the GPU range"
        )
    if world_size not in gpus:
        raise ConfigError(
            f"elasticity: this run has {world_size} data-parallel GPUs, but global batch {batch} (from "
            f"max_train_batch_size {section.max_train_batch_size}, micro_batch_sizes {micro}) only splits over "
            f"{gpus}; run on one of those counts, or change the elasticity section"
        )
    chosen = _largest_dividing_micro(micro, batch // world_size)
    if chosen is None or batch < world_size:
        raise ConfigError(
            f"elasticity: global batch {batch} does not split into any micro-batch of {micro} on {world_size} GPUs; "
            "raise max_train_batch_size or add smaller micro_batch_sizes"
        )
    return ElasticBatch(batch, tuple(gpus), chosen, independent)


def _version_02(section: ElasticityConfig, micro: list[int], world_size: int) -> tuple[int, list[int], bool]:
    """Version 0.2: version 0.1 over node counts, scaled by the data-parallel ranks per node."""
    per_node = section.num_gpus_per_node // section.model_parallel_size  # data-parallel ranks per node
    node_cap = section.max_train_batch_size // per_node
    if any(m > node_cap for m in micro):
        raise ConfigError(
            f"elasticity (version 0.2): micro_batch_sizes {micro} must be <= max_train_batch_size / data-parallel "
            f"ranks per node = {section.max_train_batch_size} / {per_node} = {node_cap}; raise max_train_batch_size"
        )
    min_nodes = section.min_gpus // section.num_gpus_per_node or 1
    max_nodes = section.max_gpus // section.num_gpus_per_node or node_cap // min(micro)
    node_batch, nodes = best_batch(micro, node_cap, min_nodes, max_nodes, section.prefer_larger_batch)
    batch = node_batch * per_node
    valid = [n * per_node for n in nodes]
    if world_size in valid:
        return batch, valid, True
    # Not a valid count: the largest (or smallest) multiple of micro x ranks within the cap, for this count only.
    sizes = [math.floor(section.max_train_batch_size / (m * world_size)) * m * world_size for m in micro]
    fallback = max(sizes) if section.prefer_larger_batch else min(sizes)
    return fallback, [world_size], False


def check_batch_keys(section: ElasticityConfig, given: dict[str, Any]) -> list[str]:
    """Batch keys set beside an enabled section: an error unless ``ignore_non_elastic_batch_info``.

    Returns the keys that will be ignored (for the caller's warning).
    """
    present = [k for k in BATCH_KEYS if given.get(k) is not None]
    if present and not section.ignore_non_elastic_batch_info:
        raise ConfigError(
            f"elasticity is enabled and the config also sets {', '.join(present)}; elasticity picks the batch sizes "
            "itself, so these would not be used. Remove them, or set elasticity.ignore_non_elastic_batch_info to "
            "true to ignore them"
        )
    return present
