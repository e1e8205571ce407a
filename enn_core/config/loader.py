"""Loading a run config: defaults -> params.yaml -> `--set key=value` overrides.

Every component is a frozen, keyword-only dataclass (see the sibling modules). This module
knows nothing about any particular component: it walks dataclass fields, so a new field is
picked up by loading, validation, the resolved-config dump and the generated reference
(`docs/config.md`) without further code.

Rules:
- YAML with the safe loader only, bounded (size, depth, aliases) and without duplicate keys
  (`enn_core/config/yaml_file.py`).
- An unknown key is an error that names the closest valid key (`train.epoch` -> `train.epochs`).
- Values are checked against the field's annotation; `__post_init__` of each dataclass
  validates meaning and names the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from enn_core.config.fields import FrozenMap
from enn_core.config.yaml_file import load_text, read_params
from enn_core.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T", bound="DataclassInstance")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key that a dataclass tree accepts (sections and leaves)."""
    keys: list[str] = []
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        sub = _dataclass_of(hints[f.name])
        if sub is not None:
            keys.extend(all_keys(sub, key + "."))
    return keys


def _dataclass_of(tp: Any) -> type[DataclassInstance] | None:
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _unknown_key_error(key: str, root: type, where: str) -> ConfigError:
    valid = all_keys(root)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'?" if close else "see docs/config.md for the valid keys"
    return ConfigError(f"{where}: unknown config key '{key}'; {hint}")


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check (and gently coerce) a YAML value against a type annotation."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, tp, key, where)
    if origin is typing.Literal:
        args = typing.get_args(tp)
        if value not in args:
            raise ConfigError(
                f"{where}: {key}={value!r} is not one of {list(args)}; pick one of those"
            )
        return value
    if origin in (tuple, list, Sequence):
        return _coerce_sequence(value, tp, key, where)
    if origin in (dict, Mapping):
        return _coerce_mapping(value, tp, key, where)
    return _coerce_scalar(value, tp, key, where)


def _coerce_union(value: Any, tp: Any, key: str, where: str) -> Any:
    """The first member the value fits (None only where the union has None)."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    for a in args:
        if a is type(None):
            continue
        try:
            return _coerce(value, a, key, where)
        except ConfigError:
            continue
    raise ConfigError(f"{where}: {key}={value!r} does not fit {tp}")


def _coerce_sequence(value: Any, tp: Any, key: str, where: str) -> tuple[Any, ...]:
    """A YAML list -> a tuple (fixed-length tuples check their length and each item's type)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: {key} must be a list, got {value!r}; write it as [a, b, ...]")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(args) != len(value):
            raise ConfigError(f"{where}: {key} needs {len(args)} items, got {len(value)}")
        return tuple(
            _coerce(v, a, f"{key}[{i}]", where)
            for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    inner = args[0] if args else Any
    return tuple(_coerce(v, inner, f"{key}[{i}]", where) for i, v in enumerate(value))


def _coerce_mapping(value: Any, tp: Any, key: str, where: str) -> FrozenMap:
    """A YAML mapping -> a read-only, hashable mapping, keys and values checked."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: {key} must be a mapping, got {value!r}")
    args = typing.get_args(tp)
    kt, vt = args if args else (Any, Any)
    return FrozenMap(
        {_coerce(k, kt, key, where): _coerce(v, vt, f"{key}.{k}", where) for k, v in value.items()}
    )


def _coerce_scalar(value: Any, tp: Any, key: str, where: str) -> Any:
    """bool, int, float (an int is widened) and str (a number is stringified); else as is."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: {key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: {key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: {key} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{where}: {key} must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
            raise ConfigError(f"{where}: {key} must be a string, got {value!r}")
        return value
    return value


def build(
    cls: type[_T], data: Mapping[str, Any] | None, *, root: type, prefix: str = "", where: str
) -> _T:
    """Instantiate dataclass `cls` from a (possibly partial) mapping, recursing into sections."""
    data = dict(data or {})
    hints = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise _unknown_key_error(f"{prefix}{k}", root, where)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        key = f"{prefix}{f.name}"
        sub = _dataclass_of(hints[f.name])
        if sub is not None:
            if not isinstance(data[f.name], Mapping):
                raise ConfigError(f"{where}: section '{key}' must be a mapping")
            kwargs[f.name] = build(sub, data[f.name], root=root, prefix=key + ".", where=where)
        else:
            kwargs[f.name] = _coerce(data[f.name], hints[f.name], key, where)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: section '{prefix.rstrip('.') or cls.__name__}': {e}") from e


def parse_override(text: str) -> tuple[str, Any]:
    """`train.epochs=3` -> ("train.epochs", 3); the value is parsed as YAML (safe)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value, e.g. --set train.epochs=3")
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = load_text(raw, f"--set {key}") if raw.strip() else ""
    except yaml.YAMLError:
        value = (
            raw  # not YAML (e.g. a cron string '*/5 * * * *'): a plain string, type-checked later
        )
    return key, value


def _mapping_keys(cls: type, prefix: str = "") -> list[str]:
    """The dotted keys of free mappings (`model.options`), whose own keys are the user's."""
    keys: list[str] = []
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        tp, sub = hints[f.name], _dataclass_of(hints[f.name])
        if sub is not None:
            keys.extend(_mapping_keys(sub, f"{prefix}{f.name}."))
        elif typing.get_origin(tp) in (dict, Mapping):
            keys.append(f"{prefix}{f.name}")
    return keys


def deep_merge(base: dict[str, Any], key: str, value: Any, root: type) -> None:
    valid = set(all_keys(root))
    free = any(key.startswith(m + ".") for m in _mapping_keys(root))
    if key not in valid and not free:
        raise _unknown_key_error(key, root, "--set")
    parts = key.split(".")
    node = base
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: '{p}' is not a section")
    node[parts[-1]] = value


def read_yaml(path: Path) -> dict[str, Any]:
    """The params file's sections, read with bounds (`enn_core/config/yaml_file.py`)."""
    return read_params(path)


def to_plain(obj: Any) -> Any:
    """Dataclass tree -> JSON/YAML-friendly plain data."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def canonical_json(obj: Any) -> str:
    return json.dumps(to_plain(obj), sort_keys=True, separators=(",", ":"))
