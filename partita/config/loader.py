"""Turn a dict or a .json file into a :class:`PartitaConfig`, reporting every mistake at once.

Validation runs in two passes over the raw JSON so that one :class:`ConfigError` can list
all problems, each with its full key path, the value, what is allowed and a fix:

1. A walk over the raw dict, guided by the section models, that handles what pydantic
   cannot phrase well: unknown keys (with "did you mean"), DeepSpeed keys partita lacks
   (``partita.config.unsupported``), the ``"auto"`` placeholder and key aliases.
2. pydantic validation of what is left (types, ranges, per-section rules); its errors are
   translated into the same one-line form.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from partita.config.base import (
    MISSING,
    ConfigError,
    Problem,
    StrictSection,
    accepts_literal,
    describe_field,
    describe_type,
    element_annotation,
    single_model,
)
from partita.config.root import CROSS_CHECKED, PartitaConfig, cross_section_problems
from partita.config.suggest import did_you_mean
from partita.config.unsupported import lookup as lookup_unsupported
from partita.config.unsupported import unsupported_keys

AUTO_HELP = (
    "'auto' is a placeholder that the Hugging Face Trainer replaces with its own arguments; "
    "partita has no Trainer to fill it in and no default it can safely assume for this key"
)


def load_config(config: Mapping[str, Any] | str | os.PathLike[str] | PartitaConfig) -> PartitaConfig:
    """Validate a config given as a dict or as the path of a .json file.

    Args:
        config: a DeepSpeed-style dict, the path of a ``.json`` file holding one, or an
            already loaded :class:`PartitaConfig` (returned unchanged).

    Raises:
        ConfigError: listing every problem (key path, value, what is allowed, fix), or
            saying why the file cannot be read.
    """
    if isinstance(config, PartitaConfig):
        return config
    if isinstance(config, Mapping):
        return validate_config(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(os.fsdecode(config))
        return validate_config(read_json_config(path), source=str(path))
    raise ConfigError(
        f"config must be a dict or the path of a .json file (str or os.PathLike), got "
        f"{type(config).__name__}: {config!r:.80}"
    )


def validate_config(raw: Mapping[str, Any], *, source: str | None = None) -> PartitaConfig:
    """Validate a raw config dict; ``source`` (a file name) is named in the error."""
    cleaned, problems = _prepare(raw, PartitaConfig, ())
    problems.extend(cross_section_problems(cleaned))
    config: PartitaConfig | None = None
    try:
        config = PartitaConfig.model_validate(cleaned, context={CROSS_CHECKED: True})
    except ValidationError as error:
        problems.extend(_from_pydantic(item, cleaned) for item in error.errors())
    if problems or config is None:
        raise ConfigError.from_problems(_in_file_order(_dedupe(problems), raw), source=source)
    config._raw = copy.deepcopy(dict(raw))
    return config


# ----------------------------------------------------------------------------- JSON files


def read_json_config(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ConfigError for a missing, unreadable or invalid file."""
    if path.suffix.lower() != ".json":
        raise ConfigError(
            f"config path {str(path)!r} is not a .json file; pass the path of a JSON file, "
            "or the config itself as a dict"
        )
    if not path.exists():
        raise ConfigError(f"config file not found: {path} (absolute: {path.absolute()})")
    if not path.is_file():
        raise ConfigError(f"config path {path} is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file {path}: {error}") from error
    duplicates: list[str] = []
    try:
        data = json.loads(
            text,
            object_pairs_hook=lambda pairs: _no_duplicates(pairs, duplicates),
            parse_constant=_reject_constant,
        )
    except json.JSONDecodeError as error:
        raise ConfigError(_json_error_message(path, text, error)) from error
    except ValueError as error:  # from _reject_constant
        raise ConfigError(f"invalid JSON in {path}: {error}") from error
    if duplicates:
        listed = "; ".join(duplicates)
        raise ConfigError(
            f"duplicate keys in {path}: {listed}. JSON keeps only the last value, which hides "
            "mistakes; keep one of each (DeepSpeed refuses duplicates too)"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a JSON object {{...}}, got {_json_kind(data)}")
    return data


def _no_duplicates(pairs: list[tuple[str, Any]], duplicates: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            duplicates.append(f"{key!r} appears more than once")
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (Python's json accepts it; write a number or null)")


def _json_error_message(path: Path, text: str, error: json.JSONDecodeError) -> str:
    lines = text.splitlines()
    shown = lines[error.lineno - 1] if 0 < error.lineno <= len(lines) else ""
    caret = " " * (error.colno - 1) + "^"
    return (
        f"invalid JSON in {path} at line {error.lineno} column {error.colno}: {error.msg}\n"
        f"    {shown}\n    {caret}"
    )


# ----------------------------------------------------------------------------- pass 1: walk


def _prepare(
    raw: Mapping[str, Any], model: type[BaseModel], section: tuple[str, ...]
) -> tuple[dict[str, Any], list[Problem]]:
    """Drop what pass 1 reports or resolves (unknown, unsupported, "auto"); recurse into sections."""
    fields = model.model_fields
    aliases: Mapping[str, str] = getattr(model, "key_aliases", {})
    auto_fields: frozenset[str] = getattr(model, "auto_fields", frozenset())
    cleaned: dict[str, Any] = {}
    problems: list[Problem] = []
    for key, value in raw.items():
        path = _join((*section, str(key)))
        name = aliases.get(key, key) if isinstance(key, str) else key
        if isinstance(name, str) and name in fields:
            if name in cleaned or (name != key and name in raw):
                message = f"'{key}' is DeepSpeed's other name for '{name}', which is also given; keep one"
                problems.append(Problem(path, message, value))
                continue
            field = fields[name]
            if _is_auto(value) and not accepts_literal(field.annotation, "auto"):
                if name not in auto_fields:
                    problems.append(Problem(path, f"{AUTO_HELP}. Set a value: {describe_field(field)}", value))
                continue  # "auto" means the field default, as in DeepSpeed
            nested = _nested_model(model, name, raw)
            if nested is not None and isinstance(value, Mapping):
                value, inner = _prepare(value, nested, (*section, name))
                problems.extend(inner)
            cleaned[name] = value
            continue
        entry = lookup_unsupported(section, key) if isinstance(key, str) else None
        if entry is not None:
            if not entry.is_inert(value):
                problems.append(Problem(path, entry.message(path), value))
            continue
        problems.append(_unknown_key(path, str(key), value, model, section))
    return cleaned, problems


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def _nested_model(model: type[BaseModel], key: str, raw: Mapping[str, Any]) -> type[BaseModel] | None:
    """The model to walk the object under ``key`` with, or None to leave it to pydantic.

    A section that overrides ``nested_section`` knows best. Otherwise the field annotation
    decides, unless a before/wrap validator may swap the model (it then cannot be known here).
    """
    hook = getattr(model, "nested_section", None)
    if hook is None:
        return None
    if getattr(hook, "__func__", None) is not StrictSection.nested_section.__func__:
        return hook(key, raw)
    for decorator in model.__pydantic_decorators__.field_validators.values():
        if decorator.info.mode in ("before", "wrap", "plain") and (
            key in decorator.info.fields or "*" in decorator.info.fields
        ):
            return None
    return hook(key, raw)


def _unknown_key(path: str, key: str, value: Any, model: type[BaseModel] | None, section: tuple[str, ...]) -> Problem:
    where = f"in '{_join(section)}'" if section else "at the top level"
    misplaced = getattr(model, "misplaced_keys", {}).get(key)
    if misplaced is not None:
        return Problem(path, misplaced, value)
    if model is None or not model.model_fields:
        # A section whose model depends on another key (optimizer params) and that does
        # not override nested_section: its valid keys are not known here.
        return Problem(path, f"unknown key {where}", value)
    hint = did_you_mean(key, [*model.model_fields, *getattr(model, "key_aliases", {})])
    if not hint:
        pending = did_you_mean(key, unsupported_keys(section))
        hint = f"{pending[:-1]} (a DeepSpeed setting partita does not implement yet)?" if pending else ""
    sentence = f"unknown key {where}" + (f"; {hint}" if hint else ".")
    return Problem(path, f"{sentence} Valid keys: {', '.join(model.model_fields)}", value)


# ----------------------------------------------------------------------------- pass 2: pydantic

_TYPE_ERRORS = {
    "int_type", "int_parsing", "int_from_float", "float_type", "float_parsing", "bool_type",
    "bool_parsing", "string_type", "list_type", "tuple_type", "dict_type", "model_type",
    "model_attributes_type", "none_required",
}  # fmt: skip
_RANGE_ERRORS = {
    "greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number",
    "too_short", "too_long", "multiple_of",
}  # fmt: skip


def _from_pydantic(error: Mapping[str, Any], cleaned: Mapping[str, Any]) -> Problem:
    kind = error["type"]
    parts, field, parent = _resolve(tuple(error["loc"]), cleaned)
    path = _join(parts) or "(top level)"
    value = MISSING if kind == "missing" else error.get("input", MISSING)
    allowed = describe_field(field) if field is not None else _lower_first(error["msg"])
    if field is not None and parts and isinstance(parts[-1], int):
        item = element_annotation(field.annotation, parts[-1])
        allowed = describe_type(item) if item is not None else _lower_first(error["msg"])
    if kind == "extra_forbidden":
        section = tuple(str(p) for p in parts[:-1])
        entry = lookup_unsupported(section, str(parts[-1]))
        if entry is not None:
            return Problem(path, entry.message(path), value)
        return _unknown_key(path, str(parts[-1]), value, parent, section)
    if _is_auto(value) and (field is None or not accepts_literal(field.annotation, "auto")):
        # Pass 1 could not see this field (a section it does not walk): same explanation.
        return Problem(path, f"{AUTO_HELP}. Set a value: {allowed}", value)
    if kind == "missing" and len(parts) > 1 and isinstance(parts[-1], int) and field is not None:
        # A fixed-length list given too few items: pydantic names each missing index, but the
        # user wrote the list, so report it (once) at the list's own path.
        items = _value_at(cleaned, parts[:-1])
        if isinstance(items, (list, tuple)):
            count = f"{len(items)} item{'s' if len(items) != 1 else ''}"
            return Problem(_join(parts[:-1]), f"too few items ({count}); allowed: {describe_field(field)}", items)
    if kind == "missing":
        return Problem(path, f"required key is missing; allowed: {allowed}")
    if kind in _TYPE_ERRORS:
        return Problem(path, f"wrong type: got {_json_kind(value)}; allowed: {allowed}", value)
    if kind in _RANGE_ERRORS:
        return Problem(path, f"out of range; allowed: {allowed}", value)
    if kind in ("literal_error", "enum"):
        return Problem(path, f"not one of the choices; allowed: {allowed}", value)
    # Errors raised by a section's own rules carry their full explanation.
    message = error["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    return Problem(path, message, value)


def _resolve(
    loc: tuple[Any, ...], cleaned: Mapping[str, Any]
) -> tuple[list[Any], FieldInfo | None, type[BaseModel] | None]:
    """Follow a pydantic ``loc`` through the models: the user's key path, the field, its model.

    pydantic puts union tags and validator names into ``loc``; they are not keys the user
    wrote, so they are skipped.
    """
    parts: list[Any] = []
    models: list[type[BaseModel]] = [PartitaConfig]
    field: FieldInfo | None = None
    parent: type[BaseModel] | None = None
    raw: Any = cleaned
    for index, item in enumerate(loc):
        last = index == len(loc) - 1
        if isinstance(item, int):
            parts.append(item)
            models = []
            raw = raw[item] if isinstance(raw, list) and 0 <= item < len(raw) else None
            continue
        owner = next((m for m in models if item in m.model_fields), None)
        if owner is not None:
            parts.append(item)
            parent, field = owner, owner.model_fields[item]
            nested = _nested_model(owner, item, raw) if isinstance(raw, Mapping) else None
            models = [nested] if nested is not None else _models_in(field.annotation)
            raw = raw.get(item) if isinstance(raw, Mapping) else None
            continue
        if not last and ("[" in str(item) or any(m.__name__ == item for m in _all_models(models))):
            continue  # a union tag or validator name
        parent = models[0] if len(models) == 1 else None
        parts.append(item)
        field, models = None, []
        raw = raw.get(item) if isinstance(raw, Mapping) else None
    return parts, field, parent


def _value_at(cleaned: Mapping[str, Any], parts: list[Any]) -> Any:
    """The raw value at a key path (``MISSING`` when the path does not exist)."""
    value: Any = cleaned
    for part in parts:
        if isinstance(part, int) and isinstance(value, (list, tuple)) and 0 <= part < len(value):
            value = value[part]
        elif isinstance(part, str) and isinstance(value, Mapping) and part in value:
            value = value[part]
        else:
            return MISSING
    return value


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    model = single_model(annotation)
    if model is not None:
        return [model]
    found: list[type[BaseModel]] = []
    for arg in get_args(annotation):
        found.extend(_models_in(arg))
    return found


def _all_models(models: Iterable[type[BaseModel]]) -> list[type[BaseModel]]:
    out: list[type[BaseModel]] = []
    for model in models:
        out.extend([model, *model.__subclasses__()])
    return out


# ----------------------------------------------------------------------------- helpers


def _join(parts: Iterable[Any]) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number" if value.is_integer() else "a number with a fraction"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    return type(value).__name__


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _in_file_order(problems: list[Problem], raw: Mapping[str, Any]) -> list[Problem]:
    """Problems ordered as their top-level sections appear in the config, then by path."""
    aliases = PartitaConfig.key_aliases
    position = {aliases.get(k, k): i for i, k in reversed(list(enumerate(raw)))}
    position.update({k: i for i, k in enumerate(raw)})

    def key(problem: Problem) -> tuple[int, str]:
        head = problem.path.split(",")[0].split(".")[0].split("[")[0]
        return position.get(head, len(position)), problem.path

    return sorted(problems, key=key)


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen: set[tuple[str, str]] = set()
    unique = []
    for problem in problems:
        marker = (problem.path, problem.message)
        if marker not in seen:
            seen.add(marker)
            unique.append(problem)
    return unique
