"""A params file (params.yaml, a `--config` file) and a `--set` value read as bounded YAML.

Params files are code-equivalent (docs/security.md), but a clumsy edit or a file from
elsewhere must still end in one line, fast: before anything is built, the YAML's event stream
(libyaml's, when PyYAML has it) is checked against

- `MAX_BYTES`: a larger file is refused before it is parsed (a 50 MB file took minutes);
- `MAX_DEPTH` nested collections: Python's composer recurses per level (5000 levels ended
  in a RecursionError);
- `MAX_NODES` nodes once aliases are expanded: nine anchors of nine aliases each are 9^9
  values that the config builder would walk (a "billion laughs" hung for minutes);
- an alias inside the node it names (a value containing itself: walking it never ends);
- duplicate keys in one mapping: YAML keeps the last silently, so a second `train:` section
  dropped the first; refused naming the key and both lines.

Then the text is loaded with the safe loader only (`yaml.safe_load`'s constructors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from enn_core.errors import ConfigError

MAX_BYTES = 256 << 10  # params.yaml is ~4 KB; 256 KiB loads in about a second on a busy core
MAX_DEPTH = 32  # params nest 4 deep (tune.space.<key>.choices); options a few more
MAX_NODES = 100_000  # scalars and collections after alias expansion (256 KiB hold ~40000)

_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_MERGE = "<<"


class _Open:
    """A collection being read: its nodes so far (aliases expanded) and, for a mapping, its keys
    (key -> line), whether its next child is a key, and the key being read."""

    def __init__(self, mapping: bool, anchor: str | None, where: str) -> None:
        self.mapping, self.anchor, self.where = mapping, anchor, where
        self.nodes = 1
        self.keys: dict[str, int] = {}
        self.at_key = True
        self.key = ""


def read_params(path: Path) -> dict[str, Any]:
    """The mapping of sections in the params file `path`; any problem is one ConfigError."""
    if not path.exists():
        raise ConfigError(
            f"{path}: config file not found; pass --config PATH or create params.yaml"
        )
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e}); pass a params file") from e
    if len(raw) > MAX_BYTES:
        raise ConfigError(
            f"{path}: larger than {MAX_BYTES >> 10} KiB, which no params file is; is it the "
            "right file?"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); save it as UTF-8 YAML") from e
    try:
        data = load_text(text, str(path))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    data = {} if data is None else data  # an empty file: the defaults
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections (data:, model:, ...)")
    return data


def load_text(text: str, where: str) -> Any:
    """`text` as YAML (safe constructors only), once `check_events` passed; syntax errors
    are yaml.YAMLError, bounds and duplicate keys ConfigError naming `where`."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_BYTES >> 10} KiB of YAML")
    check_events(text, where)
    return yaml.load(text, Loader=_LOADER)  # noqa: S506 - a safe loader (C or Python)


def check_events(text: str, where: str) -> None:
    """Depth, expanded size and duplicate keys, from the event stream (no tree is built)."""
    stack: list[_Open] = []
    sizes: dict[str, int] = {}  # anchor -> its node's size, aliases inside expanded
    total, aliases = 0, 0
    for event in yaml.parse(text, Loader=_LOADER):
        line = event.start_mark.line + 1 if event.start_mark else 0
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            _child(stack, None, line, where)
            total += 1
            here = _path(stack)
            stack.append(_Open(isinstance(event, yaml.MappingStartEvent), event.anchor, here))
            if len(stack) > MAX_DEPTH:
                raise ConfigError(
                    f"{where}:{line}: nested more than {MAX_DEPTH} levels deep; a params file "
                    "needs a few (flatten it)"
                )
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            done = stack.pop()
            if done.anchor:
                sizes[done.anchor] = done.nodes
            _done(stack, done.nodes)
        elif isinstance(event, yaml.ScalarEvent):
            _child(stack, event.value, line, where)
            total += 1
            if event.anchor:
                sizes[event.anchor] = 1
            _done(stack, 1)
        elif isinstance(event, yaml.AliasEvent):
            if any(f.anchor == event.anchor for f in stack):
                raise ConfigError(
                    f"{where}:{line}: alias *{event.anchor} refers to the node it is in, which "
                    "would contain itself; write the values out"
                )
            _child(stack, None, line, where)
            size = sizes.get(event.anchor or "", 1)
            total, aliases = total + size, aliases + 1
            _done(stack, size)
        if total > MAX_NODES:
            how = " once its aliases are expanded" if aliases else ""
            raise ConfigError(
                f"{where}:{line}: holds more than {MAX_NODES} values{how}, which no params "
                "file needs; write out what it means"
            )


def _path(stack: list[_Open]) -> str:
    """The dotted keys down to the node about to start (`train`, `tune.space`)."""
    if not stack:
        return ""
    parent = stack[-1]
    return ".".join(p for p in (parent.where, parent.key if parent.mapping else "") if p)


def _child(stack: list[_Open], key: str | None, line: int, where: str) -> None:
    """A node starts inside the innermost open collection: a mapping's key is checked for a
    duplicate (scalar keys; a merge key `<<` may repeat what it merges)."""
    if not stack or not stack[-1].mapping or not stack[-1].at_key:
        return
    parent = stack[-1]
    parent.key = key if key is not None else ""
    if key is None or key == _MERGE:
        return
    if key in parent.keys:
        inside = f" in {parent.where}" if parent.where else ""
        raise ConfigError(
            f"{where}:{line}: duplicate key '{key}'{inside} (first on line {parent.keys[key]}); "
            "YAML would keep only the last: keep one"
        )
    parent.keys[key] = line


def _done(stack: list[_Open], nodes: int) -> None:
    """A node of `nodes` (expanded) ended: count it in its collection; a mapping alternates
    key and value."""
    if not stack:
        return
    parent = stack[-1]
    parent.nodes += nodes
    if parent.mapping:
        parent.at_key = not parent.at_key
