"""Config fields: each has an attribute docstring (its help), and every default is immutable."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import subprocess
import sys

import pytest

import enn_core.config
from enn_core.config import RunConfig
from enn_core.config.fields import FrozenMap, field_help, frozen


def _sections(cls: type) -> set[type]:
    """`cls` and every config class reachable from it through sub-section fields."""
    found = {cls}
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            found |= _sections(f.default_factory)
    return found


def _defined() -> list[type]:
    """Every dataclass defined in a module of enn_core.config."""
    found = []
    for info in pkgutil.iter_modules(enn_core.config.__path__):
        module = importlib.import_module(f"enn_core.config.{info.name}")
        found += [
            v
            for v in vars(module).values()
            if isinstance(v, type)
            and dataclasses.is_dataclass(v)
            and v.__module__ == module.__name__
        ]
    return sorted(found + [RunConfig], key=lambda c: c.__name__)


CONFIG_CLASSES = _defined()


def test_every_config_class_is_a_section_of_run_config():
    assert set(CONFIG_CLASSES) == _sections(RunConfig)


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_every_config_field_has_a_docstring(cls: type):
    helps = field_help(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not helps.get(f.name, "").strip()]
    assert not missing, (
        f"{cls.__qualname__} fields without help: {missing}; write the help as a docstring on "
        'the line under the field: `name: int = 1` then `"""What it means."""`'
    )


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_every_config_default_is_immutable(cls: type):
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            assert f.default_factory in CONFIG_CLASSES, f"{cls.__name__}.{f.name}"  # a section
        else:
            hash(f.default)  # a list, dict or set (also inside a tuple) is unhashable
            mutable = isinstance(f.default, (list, dict, set))
            assert not mutable or isinstance(f.default, FrozenMap), f"{cls.__name__}.{f.name}"
    hash(cls())  # the whole default tree, sub-sections included


def test_a_config_mapping_is_read_only_and_hashable():
    m = FrozenMap({"channels": 8})
    for mutate in (lambda: m.__setitem__("x", 1), m.clear, lambda: m.update(x=1)):
        with pytest.raises(TypeError, match="read-only"):
            mutate()
    assert hash(m) == hash(FrozenMap({"channels": 8})) and m == {"channels": 8}


def test_frozen_refuses_mutable_defaults():
    with pytest.raises(TypeError, match="use a tuple"):

        @frozen
        class _List:
            keys: list[str] = ["a"]  # the point of the test

    with pytest.raises(TypeError, match="use a tuple"):

        @frozen
        class _Nested:
            keys: tuple[list[str], ...] = (["a"],)

    with pytest.raises(TypeError, match="makes a mutable value"):

        @frozen
        class _Factory:
            keys: list[str] = dataclasses.field(default_factory=list)


def test_field_help_joins_a_multiline_docstring_into_one_paragraph():
    @frozen
    class Example:
        short: int = 1
        """One line."""

        long: str = "x"
        """First line of a help text
        that goes on,   with odd spacing,
            and indentation."""

        bare: int = 2

    assert field_help(Example) == {
        "short": "One line.",
        "long": "First line of a help text that goes on, with odd spacing, and indentation.",
    }
    assert Example().long == "x" and Example(short=3).short == 3  # still a plain dataclass


def test_importing_the_config_parses_no_source():
    """Help is read lazily: `enn --help` and every stage import the config without `ast`."""
    code = (
        "import enn_core.config, enn_core.config.fields as f; "
        "assert f._help_of.cache_info().misses == 0"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
