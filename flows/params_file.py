"""Apply `--set key=value` overrides of a pipeline run to params.yaml, as `dvc exp run -S`
does: DVC owns staleness and reads params.yaml, so the values a run used must be the ones in
the file. Comments and order are kept (ruamel round-trip)."""

from __future__ import annotations

import io
from pathlib import Path

from ruamel.yaml import YAML

from enn_core.atomic import atomic_file
from enn_core.config import RunConfig, load_config
from enn_core.config.loader import parse_override


def apply_overrides(path: Path, overrides: list[str]) -> list[str]:
    """Validate the overrides, write them into `path`, and return 'key: old -> new' lines."""
    if not overrides:
        return []
    load_config(path, overrides)  # validates keys and values before touching the file
    return write_overrides(path, overrides)


def write_overrides(path: Path, overrides: list[str]) -> list[str]:
    """Write overrides that were already validated (a loaded config holds them) into `path`."""
    if not overrides:
        return []
    yaml = YAML()
    yaml.preserve_quotes = True
    doc = yaml.load(path.read_text()) or {}
    changes = []
    for text in overrides:
        key, value = parse_override(text)
        node = doc
        parts = key.split(".")
        for p in parts[:-1]:
            if p not in node or node[p] is None:
                node[p] = {}
            node = node[p]
        old = node.get(parts[-1], "<default>")
        node[parts[-1]] = value
        changes.append(f"{key}: {old} -> {value}")
    buf = io.StringIO()
    yaml.dump(doc, buf)
    with atomic_file(path) as f:
        f.write(buf.getvalue())
    return changes


__all__ = ["RunConfig", "apply_overrides"]
