"""The ``sparse_attention`` config section: DeepSpeed's keys, modes and defaults.

DeepSpeed parses this section but nothing in its engine reads it (its users build the layer
themselves). In partita, when the section is given, ``initialize`` makes the reference GPT's
attention run the pattern (:func:`partita.ops.sparse_attention.apply_sparse_attention`); other
models build :class:`SparseSelfAttention` from ``to_sparsity_config(num_heads)``.

Each mode reads its own keys, with DeepSpeed's defaults per mode (``num_random_blocks`` is 0 in
"variable" and 1 in "bigbird"); a key the chosen mode does not read is an error, because
DeepSpeed silently ignores it and the user meant something by it. ``seed`` is partita's: the
random blocks of "variable" and "bigbird" are drawn from it, identically on every rank.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from partita.config.base import PARTITA_KEY, JsonInt, StrictSection
from partita.ops.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

Mode = Literal["dense", "fixed", "variable", "bigbird", "bslongformer"]

# The keys each mode reads, with DeepSpeed's defaults (deepspeed/runtime/config.py get_sparse_*_config).
MODE_KEYS: dict[str, dict[str, Any]] = {
    "dense": {},
    "fixed": {
        "num_local_blocks": 4,
        "num_global_blocks": 1,
        "attention": "bidirectional",
        "horizontal_global_attention": False,
        "num_different_global_patterns": 1,
    },
    "variable": {
        "num_random_blocks": 0,
        "local_window_blocks": [4],
        "global_block_indices": [0],
        "global_block_end_indices": None,
        "attention": "bidirectional",
        "horizontal_global_attention": False,
    },
    "bigbird": {"num_random_blocks": 1, "num_sliding_window_blocks": 3, "num_global_blocks": 1, "attention": "bidirectional"},
    "bslongformer": {
        "num_sliding_window_blocks": 3,
        "global_block_indices": [0],
        "global_block_end_indices": None,
        "attention": "bidirectional",
    },
}
_RANDOM_MODES = ("variable", "bigbird")


class SparseAttentionConfig(StrictSection):
    """DeepSpeed's block-sparse attention patterns (see the module docstring)."""

    mode: Mode = Field("fixed", description="The pattern. DeepSpeed default \"fixed\".")
    block: JsonInt = Field(16, ge=1, description="Tokens per side of a block. DeepSpeed default 16.")
    different_layout_per_head: bool = Field(False, description="A layout per head. DeepSpeed default false.")
    num_local_blocks: JsonInt | None = Field(None, ge=1, description="fixed: blocks per local window (4).")
    num_global_blocks: JsonInt | None = Field(
        None, ge=1, description="fixed: representative blocks per window (1); bigbird: leading global blocks (1)."
    )
    attention: Literal["unidirectional", "bidirectional"] | None = Field(
        None, description="Causal (\"unidirectional\") or not (\"bidirectional\", the default); not for dense."
    )
    horizontal_global_attention: bool | None = Field(
        None, description="fixed/variable: global blocks also attend to every block (bidirectional only; false)."
    )
    num_different_global_patterns: JsonInt | None = Field(
        None, ge=1, description="fixed: distinct representative choices over heads (1)."
    )
    num_random_blocks: JsonInt | None = Field(
        None, ge=0, description="variable (0) / bigbird (1): random blocks per block row."
    )
    local_window_blocks: list[JsonInt] | None = Field(
        None, description="variable: sizes of the local windows, the last repeating ([4])."
    )
    global_block_indices: list[JsonInt] | None = Field(
        None, description="variable/bslongformer: global blocks, or range starts ([0])."
    )
    global_block_end_indices: list[JsonInt] | None = Field(
        None, description="variable/bslongformer: exclusive ends of the global ranges (null: single blocks)."
    )
    num_sliding_window_blocks: JsonInt | None = Field(
        None, ge=1, description="bigbird/bslongformer: blocks of the sliding window (3)."
    )
    seed: JsonInt = Field(
        0, ge=0, description="partita only: seed of the random blocks (variable, bigbird), the same on every rank.",
        json_schema_extra=PARTITA_KEY,
    )

    @model_validator(mode="after")
    def _keys_of_mode(self) -> SparseAttentionConfig:
        readable = set(MODE_KEYS[self.mode])
        stray = [
            name
            for name in ("num_local_blocks", "num_global_blocks", "attention", "horizontal_global_attention",
                         "num_different_global_patterns", "num_random_blocks", "local_window_blocks",
                         "global_block_indices", "global_block_end_indices", "num_sliding_window_blocks")
            if getattr(self, name) is not None and name not in readable
        ]
        if stray:
            modes = {n: [m for m, keys in MODE_KEYS.items() if n in keys] for n in stray}
            detail = "; ".join(f"{n} is read by {' / '.join(m)}" for n, m in modes.items())
            raise ValueError(
                f"sparse_attention mode {self.mode!r} does not read {stray} ({detail}); remove them or change the mode"
            )
        if "seed" in self.model_fields_set and self.mode not in _RANDOM_MODES:
            raise ValueError(f"sparse_attention.seed only affects modes {list(_RANDOM_MODES)}, not {self.mode!r}; remove it")
        # The pattern constructors check how the keys combine (local % global blocks, ...): fail at load.
        self.to_sparsity_config(num_heads=max(self.num_different_global_patterns or 1, 1))
        return self

    def resolved(self) -> dict[str, Any]:
        """The chosen mode's keys, with DeepSpeed's default for each one not given."""
        return {k: (default if getattr(self, k) is None else getattr(self, k)) for k, default in MODE_KEYS[self.mode].items()}

    @property
    def attention_direction(self) -> str:
        return self.resolved().get("attention", "bidirectional")

    def to_sparsity_config(self, num_heads: int) -> SparsityConfig:
        """The pattern object for a layer with ``num_heads`` heads (constructor errors name the key)."""
        common = {"num_heads": num_heads, "block": self.block, "different_layout_per_head": self.different_layout_per_head}
        keys = self.resolved()
        if self.mode == "dense":
            return DenseSparsityConfig(**common)
        if self.mode == "fixed":
            return FixedSparsityConfig(**common, **keys)
        if self.mode == "variable":
            return VariableSparsityConfig(**common, **keys, seed=self.seed)
        if self.mode == "bigbird":
            return BigBirdSparsityConfig(**common, **keys, seed=self.seed)
        return BSLongformerSparsityConfig(**common, **keys)
