"""Apply `--set key=value` overrides of a pipeline run to params.yaml, as `dvc exp run -S`
does: DVC owns staleness and reads params.yaml, so the values a run used must be the ones in
the file. Comments and order are kept (ruamel round-trip).

`enn run --set` and `enn <stage> --set` treat the file the same way (`record_overrides`): a key
of a section DVC tracks (a stage's `sections`: data, model, train, checkpoint, predict,
collapse, export) is written; a key of the others (runtime, tracking, deploy, fault: how to
run, not what to compute) applies to that run only and leaves the file as it was. A run that
fails before any stage is recorded puts the file back as it was (`recorded_overrides`): bad
input loses nothing, and params.yaml, the outputs and dvc.lock keep agreeing."""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from ruamel.yaml import YAML

from enn_core.atomic import atomic_file
from enn_core.config import RunConfig, load_config, redact_override
from enn_core.config.loader import parse_override


def apply_overrides(path: Path, overrides: list[str]) -> list[str]:
    """Validate the overrides, write them into `path`, and return 'key: old -> new' lines."""
    if not overrides:
        return []
    load_config(path, overrides)  # validates keys and values before touching the file
    return write_overrides(path, overrides)


def tracked_sections() -> frozenset[str]:
    """The config sections some stage reads, which dvc.yaml's `params:` track."""
    from enn_core.stages import ALL

    return frozenset(section for spec in ALL for section in spec.sections)


def record_overrides(path: Path, overrides: list[str]) -> list[str]:
    """What `--set` does to the config file: tracked keys written (validated already: the
    run's config holds them), the others named as this run's only."""
    tracked = tracked_sections()
    keep = [o for o in overrides if parse_override(o)[0].split(".")[0] in tracked]
    lines = write_overrides(path, keep)
    once = [o for o in overrides if o not in keep]
    if once:
        shown = ", ".join(redact_override(o) for o in once)
        lines.append(f"{shown} for this run only (not written: not a pipeline parameter)")
    return lines


class Recorded:
    """The overrides a run wrote; `keep()` once a stage's outputs were made with them."""

    def __init__(self, path: Path, before: bytes) -> None:
        self.path, self.before, self.kept = path, before, False

    def keep(self) -> None:
        self.kept = True


@contextlib.contextmanager
def recorded_overrides(path: Path, overrides: list[str], log: logging.Logger) -> Iterator[Recorded]:
    """`record_overrides` for the body's run; the file restored if the body fails before
    `keep()`."""
    recorded = Recorded(path, path.read_bytes())
    for change in record_overrides(path, overrides):
        log.info("params: %s", change)
    try:
        yield recorded
    except BaseException:
        if not recorded.kept and path.read_bytes() != recorded.before:
            put_back(path, recorded.before)
            log.info("params: %s restored (the run failed before any stage finished)", path.name)
        raise


def put_back(path: Path, data: bytes) -> None:
    """Write `data` back into `path`: atomically, or on a full disk in place (the file's
    blocks are already there: a run that failed for want of space must not keep its --set)."""
    try:
        with atomic_file(path, "wb") as f:
            f.write(data)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        with open(path, "r+b") as f:
            f.write(data)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())


def write_overrides(path: Path, overrides: list[str]) -> list[str]:
    """Write overrides that were already validated (a loaded config holds them) into `path`."""
    if not overrides:
        return []
    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.representer.add_representer(float, _float_yaml11)
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
        if old != value:
            changes.append(f"{key}: {old} -> {value}")
    buf = io.StringIO()
    yaml.dump(doc, buf)
    with atomic_file(path) as f:
        f.write(buf.getvalue())
    return changes


def _float_yaml11(representer, value: float):  # noqa: ANN001, ANN202 - ruamel's hook
    """A float as YAML 1.1 reads it back as a float: `1.0e-06`, not ruamel's `1e-06`, which
    PyYAML (the config loader) reads as the string '1e-06'."""
    text = repr(value)
    mantissa, e, exponent = text.partition("e")
    if e and "." not in mantissa:
        text = f"{mantissa}.0e{exponent}"
    return representer.represent_scalar("tag:yaml.org,2002:float", text)


__all__ = ["RunConfig", "apply_overrides", "record_overrides"]
