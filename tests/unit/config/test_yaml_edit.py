"""Setting keys in a params file's text (enn_core/config/yaml_edit.py): each value changes
where it stands, a missing key is one line under its section, and every other byte stays."""

from __future__ import annotations

import difflib
import math
import random

import pytest
import yaml

from enn_core.config.yaml_edit import render, set_values
from enn_core.errors import ConfigError
from tests.fixtures.project import ROOT

FAST = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
SHIPPED = [
    ROOT / "params.yaml",
    ROOT / "prediction" / "params.yaml",
    *sorted((ROOT / "configs").glob("*.yaml")),
]


def leaves(node: yaml.Node, prefix: str = "") -> list[tuple[str, yaml.Node, yaml.Node]]:
    """(dotted key, key node, value node) of every value that is not a mapping (and that a
    dotted key names: not tune.space's keys, which hold dots)."""
    out = []
    for k, v in node.value:
        if "." in k.value:
            continue
        key = f"{prefix}{k.value}"
        if isinstance(v, yaml.MappingNode) and v.value:
            out += leaves(v, key + ".")
        else:
            out.append((key, k, v))
    return out


def another(value):
    """A different value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 7
    if isinstance(value, float):
        return value * 3.5 + 0.125
    if isinstance(value, str):
        return value + "-x"
    if isinstance(value, list):
        return [*value, value[0]] if value else ["a"]
    if isinstance(value, dict):
        return {**value, "extra": 1}
    return "set"


def get(data, key: str):
    for part in key.split("."):
        data = data[part]
    return data


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_setting_any_key_of_a_shipped_file_changes_only_its_own_lines(path):
    text = path.read_text()
    data = yaml.load(text, Loader=FAST)
    lines = text.splitlines(keepends=True)
    for key, knode, vnode in leaves(yaml.compose(text, Loader=FAST)):
        new = another(get(data, key))
        edited = set_values(text, [(key, new)], str(path))  # checks it reads back as meant
        assert get(yaml.load(edited, Loader=FAST), key) == new, key
        own = range(knode.start_mark.line, vnode.end_mark.line + 1)
        matcher = difflib.SequenceMatcher(None, lines, edited.splitlines(keepends=True))
        for op, i1, i2, _, _ in matcher.get_opcodes():
            if op != "equal":
                assert i1 in own and (i2 - 1 in own or i2 == i1), (key, op, lines[i1:i2])


def test_a_missing_key_goes_under_its_section_as_its_keys_are_indented():
    text = (
        "# head\ndata:\n    source: csv   # aligned\n    path: a.csv\n"
        "# model next\nmodel:\n    d_model: 8\n"
    )
    out = set_values(text, [("data.test_fold", 2), ("model.options.hidden", 4)], "p")
    assert out == (
        "# head\ndata:\n    source: csv   # aligned\n    path: a.csv\n    test_fold: 2\n"
        "# model next\nmodel:\n    d_model: 8\n    options:\n        hidden: 4\n"
    )
    assert set_values("", [("train.lr", 0.02)], "p") == "train:\n  lr: 0.02\n"
    assert set_values("train:\n  lr: 0.1", [("train.epochs", 3)], "p") == (
        "train:\n  lr: 0.1\n  epochs: 3\n"
    )
    assert set_values("train:  # soon\nx: 1\n", [("train.lr", 0.5)], "p") == (
        "train:\n  lr: 0.5  # soon\nx: 1\n"
    )
    assert set_values("train: {lr: 0.1}\n", [("train.epochs", 3)], "p") == (
        "train: {lr: 0.1, epochs: 3}\n"
    )


def test_quoting_line_endings_and_block_values():
    text = "a: 'x'\r\nb: \"y\"\r\nc: |\r\n  two\r\n  lines\r\nd:\r\n  - p\r\n  - q\r\ne: ''\r\n"
    out = set_values(
        text, [("a", "it's"), ("b", 'say "hi"'), ("c", "one"), ("d", [1]), ("e", "f")], "p"
    )
    assert out == "a: 'it''s'\r\nb: \"say \\\"hi\\\"\"\r\nc: one\r\nd: [1]\r\ne: f\r\n"
    assert set_values("p: x\n", [("p", "multi\nline")], "p") == 'p: "multi\\nline"\n'
    assert set_values("p: x\n", [("p", "yes")], "p") == "p: 'yes'\n"  # not the boolean


def test_a_value_shared_through_an_anchor_is_refused_whole():
    shared = "base: &b 0.1\nother: *b\n"
    with pytest.raises(ConfigError, match=r"p: cannot set base .*anchor &b.*by hand"):
        set_values(shared, [("base", 0.2)], "p")
    assert set_values(shared, [("other", 0.2)], "p") == "base: &b 0.1\nother: 0.2\n"
    section = "base: &s\n  lr: 0.1\ntrain: *s\n"
    with pytest.raises(ConfigError, match="shared through the anchor &s"):
        set_values(section, [("base.lr", 0.2)], "p")
    merged = "base: &s {lr: 1}\ntrain:\n  <<: *s\n  epochs: 2\n"  # a merge key: set over it
    out = set_values(merged, [("train.lr", 0.5)], "p")
    assert yaml.safe_load(out)["train"] == {"lr": 0.5, "epochs": 2}


def test_a_float_is_written_in_its_shortest_form_that_reads_back_the_same():
    rng = random.Random(0)
    values = [1e-05, 1e20, 0.1 + 0.2, 3.0, 2.5e-300, math.pi]
    values += [10 ** rng.uniform(-8, 8) for _ in range(500)]
    for x in values:
        text = render(x)
        assert yaml.safe_load(f"v: {text}")["v"] == x, text  # YAML 1.1 reads it as that float
        assert len(text.replace(".0e", "e")) <= len(repr(x)), (text, repr(x))
    assert render(1e-05) == "1.0e-05" and render(0.002) == "0.002"
