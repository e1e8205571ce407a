"""How a config component is declared, and where its help text lives.

Every component is a `@frozen` dataclass (frozen, keyword-only). A field is a plain dataclass
field with an immutable default (a sub-section: `field(default_factory=SomeConfig)`), and its
help is the attribute docstring on the line(s) under it:

    epochs: int = 20
    \"\"\"Maximum epochs.\"\"\"

`field_help(cls)` reads those docstrings from the source with `ast`, lazily (only the generated
reference, docs/config.md, asks), so importing the config parses nothing.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import textwrap
from typing import Any, TypeVar, dataclass_transform

_T = TypeVar("_T")


class FrozenMap(dict[str, Any]):
    """A read-only dict that hashes (by its JSON text), so that a frozen config holding one
    (`model.options`) stays hashable; what a YAML mapping becomes in a config. A dict, so that
    `json.dumps` writes it as one."""

    def __hash__(self) -> int:  # type: ignore[override]  # dict is unhashable; this is not
        return hash(json.dumps(self, sort_keys=True, default=str))

    def __reduce__(self) -> tuple[Any, ...]:  # pickled by value, not item by item
        return (FrozenMap, (dict(self),))

    def _read_only(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a config mapping is read-only; build a new config instead")

    __setitem__ = __delitem__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only  # type: ignore[assignment]


def _immutable(value: object) -> bool:
    """Hashable means immutable enough for a shared default: a list, or a tuple of lists, is not;
    a @frozen sub-section is when its own fields are."""
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _check_defaults(cls: type) -> None:
    """Refuse mutable defaults: a default object is shared by every instance."""
    for name in cls.__dict__.get("__annotations__", {}):
        value = cls.__dict__.get(name, dataclasses.MISSING)
        if isinstance(value, dataclasses.Field):
            factory = value.default_factory
            if factory is not dataclasses.MISSING and not _immutable(factory()):
                raise TypeError(
                    f"{cls.__qualname__}.{name}: default_factory={factory!r} makes a mutable "
                    "value; a factory only makes a @frozen sub-section"
                )
            value = value.default
        if value is not dataclasses.MISSING and not _immutable(value):
            raise TypeError(
                f"{cls.__qualname__}.{name}={value!r}: use a tuple (immutable) for sequence "
                "defaults in frozen configs"
            )


@dataclass_transform(
    frozen_default=True,
    kw_only_default=True,
    field_specifiers=(dataclasses.field,),
)
def frozen(cls: type[_T]) -> type[_T]:
    """The decorator every config component uses: frozen and keyword-only, defaults immutable."""
    _check_defaults(cls)
    return dataclasses.dataclass(frozen=True, kw_only=True)(cls)


@functools.cache
def _help_of(cls: type) -> tuple[tuple[str, str], ...]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    found = []
    for stmt, after in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            text = " ".join(inspect.cleandoc(after.value.value).split())
            found.append((stmt.target.id, text))
    return tuple(found)


def field_help(cls: type) -> dict[str, str]:
    """{field name: help} of a config class: the attribute docstring under each field, its lines
    joined into one paragraph (whitespace collapsed). A field without a docstring is absent (a
    test requires one on every field). Parsed from the source once per class, on first use."""
    return dict(_help_of(cls))
