"""Base class every config section derives from, and the error users see.

Each section of the DeepSpeed-style JSON config is a pydantic model that lives next to
the code that owns it (``partita/zero/config.py``, ``partita/optim/config.py``, ...).
They all derive from :class:`StrictSection`, which forbids unknown keys and refuses
silent type coercion, so a typo or a wrong type fails at ``initialize`` instead of being
ignored as DeepSpeed ignores unknown top-level keys.

A section can declare two class-level tables that the loader (``partita.config.root``)
reads while it walks the raw JSON, so no field needs a special case of its own:

- ``auto_fields``: keys whose value may be the placeholder ``"auto"`` (written by the
  Hugging Face Trainer). ``"auto"`` there means "use partita's default", exactly what
  DeepSpeed does when it drops ``"auto"``. For every other key ``"auto"`` is an error
  that says why it cannot be resolved.
- ``key_aliases``: other spellings DeepSpeed accepts for a key (``"bfloat16"`` for
  ``"bf16"``), mapped to the field name.
- ``misplaced_keys``: keys that are not settings of this section but are commonly put
  there (``max_grad_norm`` in optimizer params), each with the explanation of where the
  setting belongs; the loader reports that instead of a bare "unknown key".

Sections whose nested model depends on a sibling value (an optimizer's ``params``
depends on its ``type``) can override :meth:`StrictSection.nested_section` so the loader
can still name the valid keys and suggest a fix for a typo inside them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
import types
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic.fields import FieldInfo

# The loader uses this to mark "the key was not given" in a Problem (None is a valid value).
MISSING: Any = type("Missing", (), {"__repr__": lambda self: "<missing>"})()


class ConfigError(ValueError):
    """A user mistake in the training config.

    The message names the key path, the value given, what is allowed, and a fix.
    Subclasses ``ValueError`` so callers catching ``ValueError`` keep working.
    ``problems`` holds every mistake found (empty when raised with a plain message).
    """

    def __init__(self, message: str, *, problems: Sequence[Problem] = ()) -> None:
        super().__init__(message)
        self.problems: tuple[Problem, ...] = tuple(problems)

    @classmethod
    def from_problems(cls, problems: Sequence[Problem], *, source: str | None = None) -> ConfigError:
        """One error listing every problem, so users fix a config in one round trip."""
        where = f" in {source}" if source else ""
        count = len(problems)
        header = f"Invalid partita config{where} ({count} problem{'s' if count != 1 else ''}):"
        lines = [header, *(f"  - {p.render()}" for p in problems)]
        return cls("\n".join(lines), problems=problems)


@dataclass(frozen=True)
class Problem:
    """One mistake: where it is (dotted key path), what was given, and what to do."""

    path: str
    message: str
    value: Any = MISSING

    def render(self) -> str:
        if self.value is MISSING:
            return f"{self.path}: {self.message}"
        return f"{self.path} = {format_value(self.value)}: {self.message}"


def format_value(value: Any, *, limit: int = 80) -> str:
    """The value as the user wrote it in JSON (true, null, "x"), shortened if long."""
    try:
        text = json.dumps(value, sort_keys=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _integral(value: Any) -> Any:
    # JSON has one number type, and DeepSpeed configs write sizes as 5e8; accept a float
    # that is a whole number for an int field. 5.5, "5" and true still fail the strict
    # int check that runs after this.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[int, BeforeValidator(_integral)]
"""An int field that accepts integral floats (5e8) as JSON writes them, and nothing looser."""

PARTITA_KEY: dict[str, str] = {"origin": "partita"}
"""``json_schema_extra`` of a field (or a section) that is partita's own, not DeepSpeed's: the
generated config reference (docs/generate_references.py) reads it from the JSON schema. Keys
without it are DeepSpeed's, with DeepSpeed's name, meaning and default; a key inside a marked
section is partita's too."""


class StrictSection(BaseModel):
    """A config section: unknown keys are errors, values are not silently coerced."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        validate_default=True,
        allow_inf_nan=False,
    )

    auto_fields: ClassVar[frozenset[str]] = frozenset()
    """Keys where ``"auto"`` resolves to the field default (see module docstring)."""

    key_aliases: ClassVar[Mapping[str, str]] = {}
    """Other spellings DeepSpeed accepts, mapped to the field name."""

    misplaced_keys: ClassVar[Mapping[str, str]] = {}
    """Keys that belong elsewhere, mapped to the message saying where (see module docstring)."""

    @classmethod
    def nested_section(cls, key: str, raw: Mapping[str, Any]) -> type[BaseModel] | None:
        """The model that validates the object under ``key``, given this section's raw dict.

        The default reads the field annotation (``Model`` or ``Model | None``); it returns
        None when the field is not a single model, and the loader then leaves that object
        to pydantic alone.
        """
        field = cls.model_fields.get(key)
        return None if field is None else single_model(field.annotation)


def single_model(annotation: Any) -> type[BaseModel] | None:
    """``Model`` for an annotation ``Model``, ``Model | None`` or ``Annotated[Model, ...]``."""
    inner = unwrap_optional(annotation)
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        return inner
    return None


def unwrap_optional(annotation: Any) -> Any:
    """Strip ``Annotated`` and a ``| None``; return the single remaining type or the union."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if _is_union(annotation):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return unwrap_optional(members[0])
    return annotation


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def accepts_literal(annotation: Any, value: Any) -> bool:
    """Whether ``value`` is one of the Literal choices anywhere in ``annotation``."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) is Literal:
        return value in get_args(annotation)
    if _is_union(annotation):
        return any(accepts_literal(a, value) for a in get_args(annotation))
    return False


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_BOUND_WORDS = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "<="),
)


def describe_type(annotation: Any, metadata: Sequence[Any] = ()) -> str:
    """Plain words for what a field accepts: 'an integer >= 1', 'null or a number > 0'."""
    metadata = list(metadata)
    while get_origin(annotation) is Annotated:
        annotation, *extra = get_args(annotation)
        metadata.extend(extra)
    # Field(ge=...) inside Annotated arrives as a FieldInfo holding the bounds.
    metadata = [m for item in metadata for m in (item.metadata if isinstance(item, FieldInfo) else [item])]
    bounds = [
        f"{symbol} {format_value(getattr(item, attr))}"
        for item in metadata
        for kind, attr, symbol in _BOUND_WORDS
        if isinstance(item, kind)
    ]
    suffix = (" " + " and ".join(bounds)) if bounds else ""
    if get_origin(annotation) is Literal:
        choices = [format_value(c) for c in get_args(annotation)]
        return "one of " + ", ".join(choices) + suffix
    if _is_union(annotation):
        members = get_args(annotation)
        words = [describe_type(m) for m in members if m is not type(None)]
        null = ["null"] if type(None) in members else []
        return " or ".join(null + words) + suffix
    if get_origin(annotation) in (list, tuple, Sequence):
        args = [a for a in get_args(annotation) if a is not Ellipsis]
        inner = describe_type(args[0]) if args else "any value"
        count = f" of {len(args)} items" if get_origin(annotation) is tuple and len(args) > 1 else ""
        return f"a list{count}, each {inner}" + suffix
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if not annotation.model_fields:  # a base whose keys depend on a sibling ("type")
            return "an object"
        return "an object with keys " + ", ".join(repr(k) for k in annotation.model_fields)
    return _TYPE_WORDS.get(annotation, getattr(annotation, "__name__", str(annotation))) + suffix


def describe_field(field: FieldInfo) -> str:
    """What the field accepts and its default, for error messages."""
    allowed = describe_type(field.annotation, field.metadata)
    if field.is_required():
        return f"{allowed} (required)"
    default = field.get_default(call_default_factory=True)
    if isinstance(default, BaseModel):
        return allowed
    return f"{allowed} (default {format_value(default)})"


def element_annotation(annotation: Any, index: int) -> Any:
    """The annotation of item ``index`` of a list or tuple field (None when unknown)."""
    inner = unwrap_optional(annotation)
    args = [a for a in get_args(inner) if a is not Ellipsis]
    if get_origin(inner) is tuple and len(args) > 1:
        return args[index] if index < len(args) else None
    if get_origin(inner) in (list, tuple, Sequence) and args:
        return args[0]
    return None
