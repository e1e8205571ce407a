"""`opt(default, help)`: a dataclass field with its help text, which the generated config
reference (docs/config.md) and `enn --help` show."""

from __future__ import annotations

import dataclasses
from typing import Any


def opt(default: Any, help: str) -> Any:  # noqa: A002 - mirrors argparse
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple (immutable) for sequence defaults in frozen configs")
    return dataclasses.field(default=default, metadata={"help": help})


def section(factory: Any, help: str) -> Any:  # noqa: A002
    return dataclasses.field(default_factory=factory, metadata={"help": help})


def frozen(cls):
    """The decorator every config component uses: frozen and keyword-only."""
    return dataclasses.dataclass(frozen=True, kw_only=True)(cls)
