"""Atomic output: a kill leaves the previous output untouched and its temp sibling is removed
next time; read-only and full output directories fail cleanly; readers refuse stale data."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from enn_core.config import SyntheticConfig
from enn_core.data.dataset import StagedDataset
from enn_core.errors import DataError, StaleOutputError
from tests.fixtures.data import run_stage, tree, write_npy_pair

ROOT = Path(__file__).resolve().parents[3]
SMALL = SyntheticConfig(n_months=3, n_daytypes=2, n_sections=2, n_hours=3, n_replicates=2)

KILL = """
import sys
from enn_core.config import load_config
from enn_core.data.staging import run
from enn_core.paths import Layout
from enn_core.stage import make_context
from enn_core.stages import STAGE_DATA
root, x, y = sys.argv[1:4]
overrides = ["data.source=npy", f"data.path={x}", f"data.labels_path={y}", "data.chunk_rows=10",
             "fault.kind=kill", "fault.phase=stage-data", "fault.step=2"]
cfg = load_config(None, overrides, allow_faults=True)
run(cfg, make_context(cfg, Layout.for_root(root), STAGE_DATA, "killed"))
"""


@pytest.mark.timeout(60)
def test_kill_leaves_previous_output_and_next_run_cleans_temp(tmp_path):
    _, out = run_stage(tmp_path, synthetic=SMALL)
    before = tree(out)
    x, y = write_npy_pair(tmp_path, n=100, f=3, label_shape=(2,))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", KILL, str(tmp_path), str(x), str(y)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -9, proc.stderr
    assert tree(out) == before
    stale = [p for p in out.parent.iterdir() if p.name.startswith(".tmp-stage-data-")]
    assert (
        len(stale) == 1 and (stale[0] / "features.npy").exists()
    )  # the killed run's partial output
    run_stage(tmp_path, source="npy", path=str(x), labels_path=str(y))
    assert sorted(p.name for p in out.parent.iterdir()) == ["stage-data"]
    np.testing.assert_array_equal(StagedDataset(out).features, np.load(x))


@pytest.fixture
def tmpfs(tmp_path):
    """A 64 KiB tmpfs mounted at <root>/outputs (tests run as root; chmod would stop nothing)."""
    mnt = tmp_path / "outputs"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_read_only_output_directory(tmp_path, tmpfs):
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    with pytest.raises(
        DataError, match=r"output directory is not writable .*make .*outputs writable"
    ) as info:
        run_stage(tmp_path, synthetic=SMALL)
    assert "\n" not in str(info.value) and info.value.exit_code != 0
    assert list(tmpfs.iterdir()) == []


def test_full_output_directory(tmp_path, tmpfs):
    src = tmp_path / "in"
    src.mkdir()
    x, y = write_npy_pair(
        src, n=6000, f=4, label_shape=(2,)
    )  # ~100 KB staged: more than the 64 KiB device
    with pytest.raises(
        DataError, match=r"no space left on the output device; free space under .*outputs"
    ) as info:
        run_stage(tmp_path, source="npy", path=str(x), labels_path=str(y), chunk_rows=500)
    assert "\n" not in str(info.value)
    assert list(tmpfs.iterdir()) == []  # the partial temp directory was removed


def test_reader_refuses_stale_or_mismatched_data(tmp_path):
    _, out = run_stage(tmp_path, synthetic=SMALL)
    ds = StagedDataset(out)
    assert ds.features.shape[0] == ds.n_rows and ds.split("all").shape == (ds.n_rows,)
    manifest = json.loads((out / "manifest.json").read_text())

    def refused(match: str) -> None:
        with pytest.raises(StaleOutputError, match=match):
            StagedDataset(out)

    (out / "manifest.json").write_text(json.dumps({**manifest, "format_version": 0}))
    refused(r"format_version 0 but this code reads 1; re-run stage-data")
    (out / "manifest.json").write_text(json.dumps({**manifest, "format_version": 2}))
    refused(r"newer than this code reads .*upgrade enn")
    (out / "manifest.json").write_text(
        json.dumps({**manifest, "n_rows": 3, "features": {**manifest["features"], "shape": [3, 3]}})
    )
    refused(
        r"features.npy is float32\[\d+, 3\] but the manifest says float32\[3, 3\]; "
        "re-run stage-data"
    )
    (out / "manifest.json").write_text(json.dumps(manifest))
    np.save(out / "splits" / "val.npy", np.arange(2))
    refused(r"splits/val.npy is int64\[2\] but the manifest says int64\[\d+\]; re-run stage-data")
    (out / "manifest.json").unlink()
    refused(r"no staged data \(manifest.json missing\); run `enn stage-data` first")


def test_verify_detects_changed_content(tmp_path):
    _, out = run_stage(tmp_path, synthetic=SMALL)
    labels = np.load(out / "labels.npy")
    labels[0, 0, 0] += 1
    np.save(out / "labels.npy", labels)
    with pytest.raises(StaleOutputError, match="do not match their content hash"):
        StagedDataset(out).verify()


def _b2tree(data: bytes, leaf: int = 1 << 20) -> str:
    """The tree BLAKE2b that manifests before BLAKE3 carried, computed without enn_core."""
    params = {"digest_size": 32, "fanout": 0, "depth": 2, "leaf_size": leaf, "inner_size": 32}
    leaves = [
        hashlib.blake2b(data[s : s + leaf], node_offset=i, node_depth=0, **params).digest()
        for i, s in enumerate(range(0, len(data), leaf))
    ]
    root = hashlib.blake2b(b"".join(leaves), node_offset=0, node_depth=1, last_node=True, **params)
    return "blake2b-256-tree1m:" + root.hexdigest()


@pytest.mark.parametrize(
    "key, spell",
    [
        ("hash", _b2tree),  # BLAKE2b tree, the staging hash before BLAKE3
        ("hash", lambda data: "blake2b-256:" + hashlib.blake2b(data, digest_size=32).hexdigest()),
        ("sha256", lambda data: hashlib.sha256(data).hexdigest()),  # before hashes were named
    ],
    ids=["blake2b-tree", "blake2b-plain", "bare-sha256"],
)
def test_manifests_with_earlier_hashes_still_verify(tmp_path, key, spell):
    """Version-1 manifests written by earlier versions (tree BLAKE2b; plain BLAKE2b; bare sha256
    hex under "sha256") are read and verified as before; an unknown hash spelling is refused
    clearly."""
    from enn_core.data.manifest import FileEntry, content_hash

    # labels of 3 MiB: several 1 MiB leaves, so the tree hash is checked across their boundaries
    x, y = write_npy_pair(tmp_path, n=200_000, f=3, label_shape=(4,))
    _, out = run_stage(tmp_path, source="npy", path=str(x), labels_path=str(y), chunk_rows=30_000)
    manifest = json.loads((out / "manifest.json").read_text())
    assert all(f["hash"].startswith("blake3:") for f in manifest["files"].values())
    legacy = {}
    for name, spec in manifest["files"].items():
        data = np.ascontiguousarray(np.load(out / name)).tobytes()
        legacy[name] = {"dtype": spec["dtype"], "shape": spec["shape"], key: spell(data)}
    assert os.path.getsize(out / "labels.npy") > 3 << 20
    entries = {name: FileEntry.from_json(spec) for name, spec in legacy.items()}
    old = {**manifest, "files": legacy, "content_hash": content_hash(entries)}
    (out / "manifest.json").write_text(json.dumps(old))
    ds = StagedDataset(out)
    ds.verify()
    assert ds.fingerprint == old["content_hash"] != manifest["content_hash"]
    labels = np.load(out / "labels.npy")
    labels.flat[-1] += 1
    np.save(out / "labels.npy", labels)
    with pytest.raises(StaleOutputError, match="do not match their content hash"):
        StagedDataset(out).verify()
    legacy["labels.npy"][key] = "md5:0123"
    (out / "manifest.json").write_text(json.dumps({**old, "files": legacy}))
    with pytest.raises(
        StaleOutputError, match=r"labels.npy: unknown hash 'md5:0123'.*re-run stage-data"
    ):
        StagedDataset(out).verify()


def test_restaging_is_byte_identical(tmp_path):
    """Same input and params -> the same bytes in every file (a dvc repro re-run changes
    nothing)."""
    _, out = run_stage(tmp_path, synthetic=SMALL)
    first = tree(out)
    run_stage(tmp_path, synthetic=SMALL)
    assert tree(out) == first and "row_keys.parquet" in first and "splits/train.npy" in first
