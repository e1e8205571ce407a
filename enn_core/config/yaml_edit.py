"""Set keys of a params file in its text, every other byte kept.

`--set` on the pipeline's params.yaml and `enn tune --apply` write values that DVC (and the
next run) must read from the file. A YAML round-trip (ruamel) rewrote what it did not change:
comments realigned, lines re-indented, quoting dropped; a tracked file then showed lines a
person never touched, and git called the checkout dirty for them. Here each value is replaced
where it stands in the text (its span, from the parser's marks), or a missing key is added as
one line at the end of its section, and nothing else moves:

- a scalar keeps its quoting style when the new value is a string (`'...'` stays `'...'`;
  an empty `''` was quoted only because it is empty);
- a list or mapping is written in flow style (`[a, b]`, `{k: 1}`), on the key's line;
- a float is written in its shortest form that reads back as the same float (`1.0e-05`,
  which YAML 1.1 reads as a float where `1e-05` is a string);
- a missing key goes under its section, indented as that section's keys are; a missing
  section at the end of the file.

The result is read back and compared with what was meant (the old values with these keys set);
a file this editor cannot change alone (a value that other keys share through an anchor) is a
ConfigError naming the key, and nothing is written.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

import yaml

from enn_core.config.yaml_file import _LOADER, load_text
from enn_core.errors import ConfigError

_NULLS = frozenset({"", "~", "null", "Null", "NULL"})


class _Node:
    """A node of the text: its kind (scalar, alias, map, seq), its span and column, and for a
    collection its children (a map's keys and values, a sequence's items as `values`). Not a
    dataclass: the dataclasses of enn_core.config are its config sections."""

    def __init__(
        self,
        kind: str,
        start: int,
        end: int,
        column: int,
        flow: bool = False,
        style: str | None = None,
    ) -> None:
        self.kind, self.start, self.end, self.column = kind, start, end, column
        self.flow, self.style = flow, style
        self.anchor: str | None = None
        self.value = ""
        self.keys: list[_Node] = []
        self.values: list[_Node] = []

    def content_end(self) -> int:
        """Where the node's text ends: a block collection ends with its last child (not at
        the next key, after the comments between), a block scalar before its trailing breaks."""
        if self.kind in ("map", "seq") and not self.flow and self.values:
            return self.values[-1].content_end()
        return self.end

    def is_null(self) -> bool:
        return self.kind == "scalar" and self.style is None and self.value in _NULLS

    def find(self, key: str) -> int | None:
        for i, k in enumerate(self.keys):
            if k.kind == "scalar" and k.value == key:
                return i
        return None


def _tree(text: str) -> tuple[_Node | None, set[str]]:
    """The document's root node (None for an empty document) and the anchors aliases name."""
    stack: list[_Node] = []
    root: _Node | None = None
    aliased: set[str] = set()
    for ev in yaml.parse(text, Loader=_LOADER):  # libyaml's marks, too, count characters
        node: _Node | None = None
        if ev.start_mark is None or ev.end_mark is None:  # both parsers mark every event
            continue
        start, end, column = ev.start_mark.index, ev.end_mark.index, ev.start_mark.column
        if isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            kind = "map" if isinstance(ev, yaml.MappingStartEvent) else "seq"
            node = _Node(kind, start, end, column, bool(ev.flow_style))
            node.anchor = ev.anchor
            _add(stack, node)
            stack.append(node)
            continue
        if isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            done = stack.pop()
            done.end = end
            root = done if not stack else root
            continue
        if isinstance(ev, yaml.ScalarEvent):
            node = _Node("scalar", start, end, column, style=ev.style or None)  # libyaml: plain ""
            node.anchor, node.value = ev.anchor, ev.value
        elif isinstance(ev, yaml.AliasEvent):
            node = _Node("alias", start, end, column)
            aliased.add(ev.anchor or "")
        if node is not None:
            _add(stack, node)
            root = node if not stack else root
    return root, aliased


def _add(stack: list[_Node], node: _Node) -> None:
    if not stack:
        return
    parent = stack[-1]
    if parent.kind == "seq" or len(parent.keys) > len(parent.values):
        parent.values.append(node)
    else:
        parent.keys.append(node)


def render(value: Any, style: str | None = None) -> str:
    """`value` as one line of YAML that the config loader reads back as `value`; a string
    in the quoting `style` of the value it replaces, where that style can hold it."""
    if isinstance(value, str) and "\n" not in value and value.isprintable():
        if style == "'":
            return "'" + value.replace("'", "''") + "'"
        if style == '"':
            return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, str) and ("\n" in value or not value.isprintable()):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a YAML double-quoted one
    text = yaml.safe_dump(
        value, default_flow_style=True, width=1 << 30, allow_unicode=True, sort_keys=False
    )
    return text.removesuffix("\n").removesuffix("\n...").strip()


class _Editor:
    def __init__(self, text: str, where: str) -> None:
        self.text, self.where = text, where
        self.nl = "\r\n" if "\r\n" in text else "\n"

    def set(self, key: str, value: Any) -> None:
        root, aliased = _tree(self.text)
        parts = key.split(".")
        if root is None or root.is_null():
            self._append_top(parts, value, root)
            return
        node = root
        for depth, part in enumerate(parts):
            if node.kind != "map":
                raise self._refuse(key, f"{'.'.join(parts[:depth]) or 'the file'} is not a mapping")
            if node.anchor in aliased:
                raise self._refuse(key, f"its section is shared through the anchor &{node.anchor}")
            i = node.find(part)
            if i is None:
                self._insert(node, parts[depth:], value)
                return
            child = node.values[i]
            if depth == len(parts) - 1:
                if child.anchor in aliased:
                    raise self._refuse(
                        key, f"its value is shared through the anchor &{child.anchor}"
                    )
                self._replace(node.keys[i], child, value)
                return
            if child.kind == "alias":
                raise self._refuse(key, f"'{part}' is an alias of another section")
            if child.is_null():  # `train:` with nothing under it yet
                self._fill_null(node.keys[i], child, parts[depth + 1 :], value)
                return
            node = child

    def _refuse(self, key: str, why: str) -> ConfigError:
        return ConfigError(
            f"{self.where}: cannot set {key} without changing other keys ({why}); "
            "write the value into the file by hand"
        )

    def _splice(self, start: int, end: int, new: str) -> None:
        self.text = self.text[:start] + new + self.text[end:]

    def _after_colon(self, key: _Node) -> int:
        colon = self.text.find(":", key.end)
        return colon + 1

    def _replace(self, key: _Node, old: _Node, value: Any) -> None:
        block = (old.kind in ("map", "seq") and not old.flow) or old.style in ("|", ">")
        if not block:
            space = " " if old.start == old.end else ""  # `key:` with nothing after the colon
            style = old.style if old.value else None  # '' is quoted only because it is empty
            self._splice(old.start, old.end, space + render(value, style))
            return
        end = old.content_end()
        while end > old.start and self.text[end - 1] in "\r\n":
            end -= 1  # a block scalar's trailing breaks stay
        self._splice(self._after_colon(key), end, " " + render(value))

    def _lines(self, parts: Sequence[str], value: Any, indent: int, step: int) -> str:
        """`a:\\n  b: value\\n` for parts [a, b], starting at column `indent`."""
        out = []
        for i, part in enumerate(parts):
            pad = " " * (indent + i * step)
            tail = f" {render(value)}" if i == len(parts) - 1 else ""
            out.append(f"{pad}{render(part)}:{tail}{self.nl}")
        return "".join(out)

    def _step(self) -> int:
        """The file's indentation step: how far a section's keys sit right of its name."""
        root, _ = _tree(self.text)
        if root is not None and root.kind == "map":
            for k, v in zip(root.keys, root.values, strict=False):
                if v.kind == "map" and not v.flow and v.column > k.column:
                    return v.column - k.column
        return 2

    def _line_end(self, pos: int) -> int:
        """The start of the line after the one `pos` is on (the end of the text if none)."""
        if pos > 0 and self.text[pos - 1] == "\n":
            return pos
        nl = self.text.find("\n", pos)
        return len(self.text) if nl < 0 else nl + 1

    def _insert(self, node: _Node, parts: Sequence[str], value: Any) -> None:
        if node.flow:  # {a: 1} -> {a: 1, b: 2}
            close = node.end - 1
            pair = f"{render(parts[0])}: {render(_nest(parts[1:], value))}"
            self._splice(close, close, (", " if node.keys else "") + pair)
            return
        pos = self._line_end(node.content_end())
        lines = self._lines(parts, value, node.keys[0].column, self._step())
        if pos == len(self.text) and self.text and not self.text.endswith("\n"):
            lines = self.nl + lines
        self._splice(pos, pos, lines)

    def _fill_null(self, key: _Node, null: _Node, parts: Sequence[str], value: Any) -> None:
        lines = self._lines(parts, value, key.column + self._step(), self._step())
        self._splice(self._after_colon(key), null.end, self.nl + lines.removesuffix(self.nl))

    def _append_top(self, parts: Sequence[str], value: Any, root: _Node | None) -> None:
        if root is not None:  # a document of only `null` / `~`
            self._splice(root.start, root.end, "")
        sep = self.nl if self.text and not self.text.endswith("\n") else ""
        self.text += sep + self._lines(parts, value, 0, 2)


def _nest(parts: Sequence[str], value: Any) -> Any:
    for part in reversed(parts):
        value = {part: value}
    return value


def _strict(value: Any) -> Any:
    """A value compared by type as well (1 is not 1.0 nor True in a params file)."""
    if isinstance(value, dict):
        return ("map", sorted((repr(k), _strict(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("seq", [_strict(v) for v in value])
    return (type(value).__name__, repr(value))


def set_values(text: str, changes: Sequence[tuple[str, Any]], where: str) -> str:
    """`text` with each dotted key of `changes` set to its value, every other byte as it was.
    Read back and checked: the file means what it meant, with these keys set."""
    before = load_text(text, where) or {}
    editor = _Editor(text, where)
    meant = copy.deepcopy(before)
    for key, value in changes:
        editor.set(key, value)
        node = meant
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    try:
        after = load_text(editor.text, where) or {}
    except yaml.YAMLError as e:
        raise ConfigError(
            f"{where}: setting {', '.join(k for k, _ in changes)} would not leave valid YAML "
            f"({str(e).splitlines()[0]}); write the values into the file by hand"
        ) from e
    if _strict(after) != _strict(meant):
        raise ConfigError(
            f"{where}: setting {', '.join(k for k, _ in changes)} in the text would change other "
            "keys too; write the values into the file by hand"
        )
    return editor.text
