"""What `--set key=value` does to the config file of a run (`plan`), and writing values into
a params file with every other byte kept (`write_overrides`, enn_core/config/yaml_edit.py).

- The pipeline's own params.yaml (the file its dvc.yaml reads: `params.yaml`,
  `prediction/params.yaml`) gets the keys of the sections DVC tracks (a stage's `sections`:
  data, model, train, checkpoint, predict, collapse, export), as `dvc exp run -S` does: DVC
  decides staleness from the file, so it must hold the values a run used. Only keys whose value
  changes are written, each where it stands. `runtime`, `tracking`, `deploy`, `fault` (how to
  run, not what to compute) apply to that run only.
- Any other config file (`--config configs/expressway.yaml`) is never written: its `--set`
  values are that run's only (its config.yaml and MLflow hold them). DVC does not decide or
  record such runs anyway (`tasks.dvc_state.owns`).
- A path (`enn_core.config.PATH_KEYS`) inside the project is recorded relative to the
  pipeline's folder, as the config resolves it; a path outside is never written into a
  tracked file (it would differ on every machine): that run's `--set` values are then its own,
  params.yaml stays as it was, and DVC neither skips nor records its stages.

A run that fails before any stage is recorded puts the file back as it was
(`recorded_overrides`): bad input loses nothing, and params.yaml, the outputs and dvc.lock keep
agreeing.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from enn_core.atomic import atomic_file
from enn_core.config import PATH_KEYS, RunConfig, load_config, redact_override, to_plain
from enn_core.config.loader import parse_override
from enn_core.config.yaml_edit import render, set_values
from enn_core.paths import checkout_root, project_root

_MISSING = object()
TAG_CHANGES_KEY = "enn.changes"  # = tasks.tracking.runs.TAG_CHANGES (a test holds them equal)


def tracked_sections() -> frozenset[str]:
    """The config sections some stage reads, which dvc.yaml's `params:` track."""
    from enn_core.stages import ALL

    return frozenset(section for spec in ALL for section in spec.sections)


def is_pipeline_params(config: Path) -> bool:
    """Whether `config` is a pipeline's own params.yaml (the file its dvc.yaml reads)."""
    root = project_root(config)
    return (root / "dvc.yaml").is_file() and (root / "params.yaml").resolve() == config.resolve()


def _is_reference(value: str) -> bool:
    """A registry reference or keyword, not a file: `models:/...`, `runs:/...`, `champion`."""
    return ":/" in value or value == "champion"


def project_path(root: Path, value: str) -> str | None:
    """`value` (a path key's value, relative to the pipeline folder `root`) as recorded: as
    given when relative and inside the project, relative to `root` when absolute and inside;
    None when it lies outside the project (the checkout `root` belongs to)."""
    if not value or _is_reference(value):
        return value
    full = os.path.normpath(os.path.join(os.path.abspath(root), value))
    for top, base in (
        (checkout_root(root), os.path.abspath(root)),
        (checkout_root(root).resolve(), str(Path(root).resolve())),
    ):
        if full == str(top) or full.startswith(str(top).rstrip(os.sep) + os.sep):
            if not os.path.isabs(value):
                return value
            return Path(os.path.relpath(full, base)).as_posix()
    return None


@dataclass(frozen=True)
class Plan:
    """What `--set` does with a run's config file."""

    config: Path
    run: tuple[str, ...]  # the overrides the run uses (paths inside the project made relative)
    write: tuple[str, ...] = ()  # written into the config file
    once: tuple[str, ...] = ()  # this run's only
    why: str = ""  # why `once` are not written
    kept_out: tuple[str, ...] = ()  # paths outside the project (DVC neither skips nor records)
    deployed: bool = False  # a run a deployment started: its --set values are its own

    def name(self) -> str:
        root = checkout_root(project_root(self.config))
        try:
            return self.config.resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            return str(self.config)

    def one_off(self) -> str:
        """Why DVC must neither skip nor record this run's stages ("" when it may): a value the
        run uses that params.yaml does not hold."""
        if self.deployed:
            return (
                "a deployment's run never writes a tracked file, so "
                f"{self.name()} does not hold this run's values"
            )
        if not self.kept_out:
            return ""
        return (
            f"{self.outside()} lies outside the project, so {self.name()} does not hold this "
            "run's values"
        )

    def outside(self) -> str:
        """The keys of the paths outside the project (`checkpoint.dir`): their values, often
        long absolute paths, are in the run's config.yaml and MLflow, not on the console."""
        return ", ".join(o.split("=", 1)[0] for o in self.kept_out)


def run_overrides(config: Path, overrides: Sequence[str]) -> list[str]:
    """The overrides a run uses: each path inside the project relative to the pipeline folder
    (what the config resolves it from), every other one as given."""
    root = project_root(config)
    out = []
    for text in overrides:
        key, value = parse_override(text)
        if key in PATH_KEYS and isinstance(value, str):
            recorded = project_path(root, value)
            if recorded is not None and recorded != value:
                text = f"{key}={render(recorded)}"
        out.append(text)
    return out


def plan(config: Path, overrides: Sequence[str], deployed: bool = False) -> Plan:
    """What `--set` does with `config` for a run with `overrides`. `deployed`: a run a
    deployment started (a worker's checkout, `enn deploy`): its overrides are that run's only,
    as with --config, so that a pooled checkout never drifts from its commit."""
    run = tuple(run_overrides(config, overrides))
    if not run:
        return Plan(config, run)
    if deployed:
        why = "a deployment's run: its overrides are its own, never written into a tracked file"
        return Plan(config, run, once=run, why=why, deployed=True)
    if not is_pipeline_params(config):
        why = (
            f"--set never writes {config.name}, a --config file; the run's config.yaml and "
            "MLflow hold them"
        )
        return Plan(config, run, once=run, why=why)
    tracked = tracked_sections()
    root = project_root(config)
    keep, once, outside = [], [], []
    for text in run:
        key, value = parse_override(text)
        if key.split(".")[0] not in tracked:
            once.append(text)
        elif key in PATH_KEYS and isinstance(value, str) and project_path(root, value) is None:
            outside.append(text)
        else:
            keep.append(text)
    if outside:
        return Plan(config, run, once=run, kept_out=tuple(outside))
    why = "not pipeline parameters: how to run, not what to compute" if once else ""
    return Plan(config, run, write=tuple(keep), once=tuple(once), why=why)


def _shown(overrides: Sequence[str], sep: str) -> str:
    """Overrides as the console and MLflow show them: a URL's user is ***."""
    return sep.join(redact_override(o) for o in overrides)


def once_lines(p: Plan) -> list[str]:
    """The lines that say what `--set` did not write, and why."""
    if p.deployed:
        return [
            f"{p.name()} unchanged: {_shown(p.once, ', ')} for this run only (a deployment's run "
            "never writes a tracked file); DVC neither skips nor records its stages"
        ]
    if p.kept_out:  # the closing `params:` line says it, once and short (issue 54: 450
        return []  # characters with absolute paths, said at the start and again at the end)
    if p.once:
        return [f"{_shown(p.once, ', ')} for this run only ({p.why})"]
    return []


def summary_line(p: Plan, changes: Sequence[str]) -> str | None:
    """The closing summary's word on the config file: which file changed, or that none did."""
    if changes:
        once = f"; {_shown(p.once, ', ')} for this run only" if p.once else ""
        return f"params: {p.name()} changed ({'; '.join(changes)}{once})"
    if p.kept_out:  # the paths' keys only: their values are in config.yaml and MLflow
        return (
            f"params: {p.name()} unchanged ({p.outside()} lies outside the project: every --set "
            "is this run's own, and DVC neither skips nor records its stages)"
        )
    if p.once:
        return f"params: {p.name()} unchanged ({_shown(p.once, ', ')} for this run only)"
    if p.write:
        return f"params: {p.name()} unchanged (it held these values)"
    return None


def mlflow_tags(p: Plan) -> dict[str, str]:
    """The run's `--set` values as the MLflow tag `enn.overrides`, with where they went; and
    what the run's name says differs from the pipeline's params file (`TAG_CHANGES`: a --config
    file's name, then each --set, as JSON; tasks/tracking/runs.py names the run from it)."""
    import json

    changes = [] if is_pipeline_params(p.config) else [p.config.name]
    # what to compute, as `dvc exp run -S` runs are named: not how to run (runtime.*, which a
    # launcher sets) nor a path outside the project (a shared checkpoint.dir), which named a
    # SLURM job's parent `... synthetic checkpoint.dir=/abs/path runtime.launcher=external
    # (+4)` (issue 54); enn.overrides below keeps every --set
    tracked, outside = tracked_sections(), set(p.kept_out)
    changes += [
        redact_override(o) for o in p.run if o.split(".")[0] in tracked and o not in outside
    ]
    if not p.run and not changes:  # `dvc repro`, `dvc exp run -S`: the file against its commit
        changes = committed_changes(p.config)
    tags = {TAG_CHANGES_KEY: json.dumps(changes)} if changes else {}
    if not p.run:
        return tags
    parts = [_shown(p.run, " ")]
    if p.write:
        parts.append(f"in {p.name()}: {' '.join(p.write)}")
    if p.once:
        unchanged = "" if p.write else f" ({p.name()} unchanged)"
        parts.append(f"this run only{unchanged}: {_shown(p.once, ' ')}")
    return {**tags, "enn.overrides": "; ".join(parts)[:5000]}


def committed_changes(config: Path) -> list[str]:
    """`key=value` for each pipeline parameter whose value in `config` differs from the file's
    last commit (what `dvc exp run -S` changed), or [] (no git, not committed, unreadable)."""
    import subprocess
    import tempfile

    root = checkout_root(config.parent)
    try:
        rel = config.resolve().relative_to(root.resolve()).as_posix()
        old = subprocess.run(
            ["git", "-C", str(root), "show", f"HEAD:{rel}"],
            capture_output=True,
            timeout=30,
            check=True,
        ).stdout
        with tempfile.TemporaryDirectory() as tmp:
            then = Path(tmp) / "params.yaml"
            then.write_bytes(old)
            before = _flat(to_plain(load_config(then)))
        now = _flat(to_plain(load_config(config)))
    except Exception:  # noqa: BLE001 - a run's name is best-effort: no git, no commit, no name part
        return []
    tracked = tracked_sections()
    return [
        f"{k}={render(v)}"
        for k, v in now.items()
        if k.split(".")[0] in tracked and not _same(before.get(k, _MISSING), v)
    ]


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): tree}


def record_overrides(
    config: Path, overrides: Sequence[str], deployed: bool = False
) -> tuple[Plan, list[str]]:
    """`--set` applied to the config file (the values were validated: the run's config holds
    them): its plan and the 'key: old -> new' lines of what changed."""
    p = plan(config, overrides, deployed)
    return p, write_overrides(config, p.write)


def apply_overrides(path: Path, overrides: list[str]) -> list[str]:
    """Validate the overrides, write them into `path` (any params file: `enn tune --apply`,
    tests), and return 'key: old -> new' lines."""
    if not overrides:
        return []
    load_config(path, overrides)  # validates keys and values before touching the file
    return write_overrides(path, overrides)


class Recorded:
    """The overrides a run wrote; `keep()` once a stage's outputs were made with them."""

    def __init__(self, path: Path, before: bytes, p: Plan, changes: list[str]) -> None:
        self.path, self.before, self.kept, self.restored = path, before, False, False
        self.plan, self.changes = p, changes

    def keep(self) -> None:
        self.kept = True

    def summary(self) -> str | None:
        if self.restored:
            return (
                f"params: {self.plan.name()} unchanged (restored, no stage finished: "
                f"{'; '.join(self.changes)} undone)"
            )
        return summary_line(self.plan, self.changes)


@contextlib.contextmanager
def recorded_overrides(
    path: Path, overrides: list[str], log: logging.Logger, deployed: bool = False
) -> Iterator[Recorded]:
    """`record_overrides` for the body's run; the file restored if the body fails before
    `keep()`."""
    before = path.read_bytes()
    p, changes = record_overrides(path, overrides, deployed)
    recorded = Recorded(path, before, p, changes)
    for line in [f"{p.name()}: {c}" for c in changes] + once_lines(p):
        log.info("params: %s", line)
    try:
        yield recorded
    except BaseException:
        if not recorded.kept and path.read_bytes() != recorded.before:
            put_back(path, recorded.before)
            recorded.restored = True
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


def _lookup(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def _same(a: Any, b: Any) -> bool:
    """Equal as config values (1 and 1.0 are; True and 1 are not)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


def write_overrides(path: Path, overrides: Sequence[str]) -> list[str]:
    """Write overrides that were already validated (a loaded config holds them) into `path`:
    only the keys whose value changes, each in place (every other byte kept). Returns
    'key: old -> new' lines."""
    if not overrides:
        return []
    from enn_core.config.yaml_file import read_params

    raw = read_params(path)
    defaults = to_plain(RunConfig())
    changes: dict[str, tuple[Any, Any]] = {}  # key -> (the file's value, the new one)
    for text in overrides:
        key, value = parse_override(text)
        old = _lookup(raw, key)
        old = _lookup(defaults, key) if old is _MISSING else old
        changes.pop(key, None)  # the last --set of a key counts, as in the run's config
        if old is _MISSING or not _same(old, value):
            changes[key] = (old, value)
    if not changes:
        return []
    data = path.read_bytes()
    text = set_values(data.decode("utf-8"), [(k, v) for k, (_, v) in changes.items()], str(path))
    with atomic_file(path, "wb") as f:
        f.write(text.encode("utf-8"))
    return [
        f"{key}: {'<default>' if old is _MISSING else old} -> {new}"
        for key, (old, new) in changes.items()
    ]


__all__ = [
    "Plan",
    "RunConfig",
    "apply_overrides",
    "plan",
    "record_overrides",
    "run_overrides",
]
