"""`enn gc` deletes only inside the roots it owns: the MLflow store is data, so an artifact
location it names outside the local artifact root (absolute, relative, or escaping with `..`)
is left alone and named; links are removed as links, never followed (a trial folder, a run
directory or an artifact folder that is a link to elsewhere; a study folder that is one); a
configured `checkpoint.dir` is swept by the same rules, only distributed-train's fingerprint
folders there; `--dry-run` prints exactly what the real run removes."""

from __future__ import annotations

import contextlib
import io
import os
import sqlite3
import time
from pathlib import Path

import pytest

from enn_core.config import load_config
from enn_core.paths import Layout
from flows.gc import gc_command
from tasks import gc
from tests.fixtures.cli import enn

OLD = time.time() - 30 * 86400


def precious(path: Path) -> Path:
    """A folder outside the project holding a file gc must never delete."""
    path.mkdir(parents=True)
    (path / "keep.txt").write_text("precious")
    return path


def aged(path: Path, when: float = OLD) -> Path:
    os.utime(path, (when, when), follow_symlinks=False)
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A real MLflow store with five old failed runs whose artifact locations the store names
    (edited in the database, as a copied or crafted store would hold them), and one the UI
    marked deleted."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("gc")
    layout = Layout(root=root / "proj", work=root / "proj" / "work")
    layout.mlflow_dir.mkdir(parents=True)
    outside = root / "outside"
    client = MlflowClient(layout.mlflow_uri)
    exp = client.create_experiment("enn", artifact_location=layout.mlflow_artifacts.as_uri())
    runs = {}
    for name in ("absolute", "relative", "dotdot", "link", "inside", "deleted"):
        run = client.create_run(exp, run_name=name)
        client.log_text(run.info.run_id, "x" * 100, "a.txt")
        client.set_terminated(run.info.run_id, "FAILED", end_time=int(OLD * 1000))
        runs[name] = run.info.run_id
    client.delete_run(runs["deleted"])
    art = layout.mlflow_artifacts
    uris = {
        "absolute": precious(outside / "absolute").as_uri(),
        "relative": "../outside/relative",
        "dotdot": f"{art.as_uri()}/../../../../outside/dotdot",
    }
    precious(outside / "relative")
    precious(outside / "dotdot")
    link = Path(client.get_run(runs["link"]).info.artifact_uri.removeprefix("file://"))
    for p in link.iterdir():
        p.unlink()
    link.rmdir()
    link.symlink_to(precious(outside / "link"), target_is_directory=True)
    with sqlite3.connect(layout.mlflow_dir / "mlflow.db") as con:
        for name, uri in uris.items():
            con.execute("update runs set artifact_uri = ? where run_uuid = ?", (uri, runs[name]))
    return layout, runs, outside


def test_artifact_locations_outside_the_artifact_root_are_left_and_named(store):
    """`enn gc` over a store naming artifact locations outside the artifact root: they are
    listed as left alone (dry run and real run alike) and survive; a link is removed as one."""
    layout, runs, outside = store
    (layout.root / "params.yaml").write_text("gc: {keep_days: 1}\n")
    (layout.root / "dvc.yaml").write_text("stages: {}\n")
    dry, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(dry):
        assert enn(layout.root, "gc", "--dry-run")[0] == 0
    with contextlib.redirect_stdout(out):
        code, _ = enn(layout.root, "gc")
    lines = out.getvalue().splitlines()
    assert code == 0, lines
    assert dry.getvalue().replace("would remove", "removed").splitlines()[:-1] == lines[:-1]
    for name in ("absolute", "relative", "dotdot", "link"):
        assert (outside / name / "keep.txt").read_text() == "precious", (name, lines)
    left = [line for line in lines if line.startswith("left alone: ")]
    assert len(left) == 3 and any("a relative artifact location" in line for line in left)
    assert any(f"it lies outside {layout.mlflow_artifacts}" in line for line in left)
    removed = [line for line in lines if line.startswith("removed: ")]
    assert len(removed) == 3, lines  # inside, deleted, and the link (as a link)
    link = layout.mlflow_artifacts / runs["link"] / "artifacts"
    assert not link.exists() and not link.is_symlink()


def project(tmp_path: Path) -> tuple[Layout, Path]:
    layout = Layout(root=tmp_path / "proj", work=tmp_path / "proj" / "work")
    return layout, tmp_path / "outside"


def test_links_are_removed_as_links_and_never_followed(tmp_path):
    layout, outside = project(tmp_path)
    tune = layout.work / "tune"
    (tune / "s").mkdir(parents=True)
    target = precious(outside / "trial")
    (target / "end.json").write_text("{}")
    (tune / "s" / "trial-0").symlink_to(target)  # a finished trial's folder is a link
    elsewhere = precious(outside / "study")
    (elsewhere / "trial-0").mkdir()
    (elsewhere / "trial-0" / "end.json").write_text("{}")
    (tune / "evil").symlink_to(elsewhere)  # a study folder that is a link
    runs = layout.work / "runs"
    runs.mkdir(parents=True)
    (runs / "old").symlink_to(aged(precious(outside / "run")))
    aged(runs / "old")  # the link's own time: older than gc.keep_days
    cfg = load_config(None, ["tracking.enabled=false"])
    planned = gc.plan(cfg, layout)
    assert sorted(r.path.name for r in planned.removals) == ["old", "trial-0"]
    assert [s.path for s in planned.skipped] == [tune / "evil" / "trial-0"]
    assert gc.remove(cfg, layout, planned.removals) == {}
    assert not (tune / "s" / "trial-0").is_symlink() and not (runs / "old").is_symlink()
    for name in ("trial", "study", "run"):
        assert (outside / name / "keep.txt").read_text() == "precious"
    assert (elsewhere / "trial-0" / "end.json").is_file()


def fingerprint(root: Path, name: str, *, finished: bool, age_days: float, ours: bool = True):
    d = root / name
    (d / "step-1").mkdir(parents=True)
    (d / "step-1" / "shard").write_bytes(b"x" * 10)
    if ours:
        (d / "fingerprint.json").write_text("{}")
    if finished:
        (d / "COMPLETE").touch()
    aged(d, time.time() - age_days * 86400)
    return d


def test_a_configured_checkpoint_dir_is_swept_by_the_same_rules(tmp_path):
    layout, outside = project(tmp_path)
    shared = outside / "shared-ckpt"
    fingerprint(shared, "a1", finished=True, age_days=0)  # the newest two stay
    fingerprint(shared, "a2", finished=True, age_days=0.1)
    old = fingerprint(shared, "a3", finished=True, age_days=0.2)
    fingerprint(shared, "b1", finished=True, age_days=9, ours=False)  # not distributed-train's
    precious(shared / "notes")
    local = fingerprint(layout.checkpoints, "c1", finished=False, age_days=9)
    sets = [f"checkpoint.dir={shared}", "gc.keep_fingerprints=2", "tracking.enabled=false"]
    cfg = load_config(None, sets)
    planned = gc.plan(cfg, layout)
    assert [r.path for r in planned.removals] == [old]  # local: c1 is its newest
    assert local.exists()
    assert gc.remove(cfg, layout, planned.removals) == {}
    assert (
        not old.exists() and (shared / "b1").exists() and (shared / "notes" / "keep.txt").exists()
    )


def run_gc(layout: Path, *flags: str) -> list[str]:
    cfg = load_config(None, ["tracking.enabled=false", "gc.keep_days=1"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert gc_command(cfg, Path("params.yaml"), layout, dry_run=bool(flags)) == 0
    return out.getvalue().splitlines()


def test_dry_run_lists_exactly_what_the_real_run_removes(tmp_path):
    layout, outside = project(tmp_path)
    for n in range(3):
        t = layout.work / "tune" / "s" / f"trial-{n}"
        t.mkdir(parents=True)
        (t / "end.json").write_text("{}")
    (layout.work / "tune" / "evil").symlink_to(precious(outside / "study"))
    (outside / "study" / "trial-9").mkdir()
    (outside / "study" / "trial-9" / "end.json").write_text("{}")
    aged(precious(layout.work / "runs" / "r1"))
    fingerprint(layout.checkpoints, "f1", finished=True, age_days=1)
    for n in range(3):
        fingerprint(layout.checkpoints, f"f{n + 2}", finished=True, age_days=0)
    dry = run_gc(layout, "--dry-run")
    real = run_gc(layout)
    assert [line.replace("would remove", "removed") for line in dry[:-1]] == real[:-1]
    assert dry[-1].replace("would free", "freed") == real[-1]
    assert sum(line.startswith("removed: ") for line in real) == 6  # 3 trials, r1, 2 fps
    assert any(line.startswith("left alone: ") and "trial-9" in line for line in real)
    assert (outside / "study" / "trial-9" / "end.json").is_file()
    assert run_gc(layout)[-1].startswith("gc: freed 0.0 MB in 0 path(s)")
