"""The ``checkpoint`` config section: DeepSpeed's keys plus partita's save/resume switches.

DeepSpeed's section holds ``tag_validation``, ``load_universal`` and
``use_node_local_storage``. partita keeps their meanings where it can:

- ``tag_validation`` (Ignore / Warn / Fail): what to do when ranks pass different tags.
- ``load_universal``: DeepSpeed needs an offline conversion ("universal checkpoint") to load
  on another world size; partita checkpoints reshard on load, so ``true`` is refused as
  unnecessary rather than silently ignored.
- ``use_node_local_storage``: not implemented (partita needs one directory every rank can
  read, because a resharded load reads other ranks' shards); ``true`` is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from partita.config.base import PARTITA_KEY, JsonInt, StrictSection

# Signals a scheduler sends before it kills a job (SIGKILL and SIGSTOP cannot be caught).
SIGNAL_NAMES = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGQUIT")

_TAG_VALIDATION = {"ignore": "Ignore", "warn": "Warn", "fail": "Fail"}


def _canonical_tag_validation(value: Any) -> Any:
    # DeepSpeed upper-cases the value before comparing, so "WARN", "warn" and "Warn" all work.
    if isinstance(value, str) and value.lower() in _TAG_VALIDATION:
        return _TAG_VALIDATION[value.lower()]
    return value


class CheckpointConfig(StrictSection):
    """How checkpoints are validated, written and resumed from."""

    tag_validation: Annotated[Literal["Ignore", "Warn", "Fail"], BeforeValidator(_canonical_tag_validation)] = Field(
        "Warn",
        description=(
            "When ranks pass different tags to save_checkpoint: Warn (use rank 0's tag and log), "
            "Ignore (use rank 0's tag silently) or Fail (raise on every rank). Case-insensitive. "
            "DeepSpeed default \"Warn\"."
        ),
    )
    load_universal: bool = Field(
        False,
        description=(
            "DeepSpeed: load a checkpoint converted to the universal format. partita loads any "
            "checkpoint on any world size and ZeRO stage without conversion, so only false is accepted."
        ),
    )
    use_node_local_storage: bool = Field(
        False,
        description=(
            "DeepSpeed: each node saves to its own local disk. Not implemented: partita needs a "
            "directory every rank can read (resharding reads other ranks' shards). Default false."
        ),
    )
    save_dir: str | None = Field(
        None,
        description=(
            "partita only: directory for checkpoints; the default for engine.save_checkpoint() "
            "without a directory and the directory `resume` reads. Default null."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    resume: Literal["latest"] | None = Field(
        None,
        description=(
            "partita only: \"latest\" makes initialize() load the newest complete checkpoint in "
            "save_dir when there is one (what a restarted job needs); null starts fresh. Default null."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    async_save: bool = Field(
        False,
        description=(
            "partita only: save_checkpoint copies the state to CPU memory and returns; a background "
            "thread writes the files. The next save/load (or process exit) waits for it. Default false."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    handshake_timeout_seconds: float = Field(
        120.0,
        gt=0,
        description=(
            "partita only: seconds every rank waits for the others to enter save_checkpoint / "
            "load_checkpoint before failing with a message naming the missing ranks (a call "
            "from rank 0 alone would otherwise hang). Default 120."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    verify_checksums: bool = Field(
        True,
        description=(
            "partita only: check each file's sha256 against the manifest when loading (the work is "
            "split over the ranks). Sizes are always checked. Default true."
        ),
        json_schema_extra=PARTITA_KEY,
    )

    save_on_signal: list[str] = Field(
        default_factory=lambda: ["SIGTERM", "SIGUSR1"],
        description=(
            "partita only: signals that make a job with save_dir set finish its optimizer step, save a checkpoint "
            "every rank agrees on and exit with code 200 (SLURM --signal, Kubernetes' termination grace period). "
            "[] turns it off. Default [\"SIGTERM\", \"SIGUSR1\"]."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    signal_save_deadline_seconds: float = Field(
        60.0,
        gt=0,
        description=(
            "partita only: seconds from the signal to the end of its save; a save still running then is abandoned "
            "(the previous complete checkpoint stays latest) and the process exits with code 201. Keep it below "
            "the scheduler's grace (SLURM --signal lead time, terminationGracePeriodSeconds). Default 60."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    signal_check_interval_steps: JsonInt = Field(
        1,
        ge=1,
        description=(
            "partita only: optimizer steps between the ranks' checks for a signal (one 4-byte all-reduce each); "
            "a signal is acted on at most this many steps late. Default 1."
        ),
        json_schema_extra=PARTITA_KEY,
    )

    @field_validator("save_on_signal")
    @classmethod
    def _known_signals(cls, value: list[str]) -> list[str]:
        import signal as signals

        unknown = [name for name in value if name not in SIGNAL_NAMES or not hasattr(signals, name)]
        if unknown:
            raise PydanticCustomError(
                "checkpoint_unknown_signal",
                "checkpoint.save_on_signal has {unknown}; use signal names from {allowed} ([] turns saving on a "
                "signal off)",
                {"unknown": unknown, "allowed": list(SIGNAL_NAMES)},
            )
        return list(dict.fromkeys(value))

    @field_validator("load_universal")
    @classmethod
    def _no_universal(cls, value: bool) -> bool:
        if value:
            raise PydanticCustomError(
                "checkpoint_universal_unnecessary",
                "load_universal is unnecessary in partita: every checkpoint already loads on any "
                "world size and ZeRO stage without conversion; remove the key or set it to false",
            )
        return value

    @field_validator("use_node_local_storage")
    @classmethod
    def _no_node_local(cls, value: bool) -> bool:
        if value:
            raise PydanticCustomError(
                "checkpoint_node_local_not_implemented",
                "use_node_local_storage is not implemented in partita: checkpoints must go to a "
                "directory every rank can read (a shared file system); set it to false",
            )
        return value

    @model_validator(mode="after")
    def _resume_needs_dir(self) -> CheckpointConfig:
        if self.resume is not None and self.save_dir is None:
            raise PydanticCustomError(
                "checkpoint_resume_without_dir",
                "checkpoint.resume is \"latest\" but checkpoint.save_dir is not set; add "
                "\"save_dir\": \"<directory the job saves checkpoints to>\"",
            )
        return self
