"""Data layer: staged data checks pass on good data and name the cause on bad data, places
on tmpfs or unwritable are reported, and a platform without /dev/shm gets a warning."""

from __future__ import annotations

import json
import tempfile

import numpy as np

from enn_core.doctor import data, run_doctor
from enn_core.doctor.report import Recorder
from tests.fixtures.data import zero_inflated
from tests.fixtures.doctor import context, staged


def _by_name(checks) -> dict:
    return {c.name: c for c in checks}


def test_good_staged_data_passes(layout):
    staged(layout.root)
    checks = _by_name(data.run(context(layout)))
    for name in (
        "manifest",
        "content hash",
        "non-finite",
        "labels",
        "memmaps",
        "fs data",
        "fs temp",
        "fs work",
    ):
        assert checks[name].status == "ok", checks[name]
    assert "features 0, labels 0" in checks["non-finite"].detail
    assert "no value holds more than 50% of a label column" in checks["labels"].detail
    assert checks["fs data"].data["fstype"] not in ("", "unknown")


def test_a_label_mostly_zeros_is_a_warning_saying_what_it_means(layout, monkeypatch):
    """Issue 54: `enn doctor --quick` passed a label 68% zeros with "0 warn"; the problem showed
    after a 16-minute run, when collapse-check failed the model on spread."""
    zero_inflated(layout.root, zeros=0.68)
    report = run_doctor(context(layout).cfg, layout, quick=True, only=["data"])
    check = report.find("data", "labels")[0]
    assert check.status == "warn" and report.exit_code == 0, check
    assert check.detail.startswith("count: 68% of 217 training rows are 0: "), check.detail
    assert "under MAE the best constant is about 0" in check.detail
    assert "collapse-check fails it on spread (collapse.median_ratio_min=0.5)" in check.detail
    assert 'docs/your-data.md, "A label that is mostly one value"' in check.fix
    assert check.data["top_share"] > 0.5 and check.data["mostly_one_value"] == 1
    # --quick reads a sample of the training rows of a large label
    monkeypatch.setattr("enn_core.doctor.labels.QUICK_LABEL_BYTES", 4 * 100)
    check = _by_name(data.run(context(layout)))["labels"]
    assert check.status == "warn" and "training rows (--quick: a sample of 100) are 0" in (
        check.detail
    )


def test_no_staged_data_is_a_warning_naming_the_command(layout):
    checks = _by_name(data.run(context(layout)))
    assert checks["manifest"].status == "warn"
    assert "enn stage-data" in checks["manifest"].fix


def test_corrupt_content_hash_fails_and_names_the_fix(layout):
    path = staged(layout.root)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["content_hash"] = "0" * 64
    (path / "manifest.json").write_text(json.dumps(manifest))
    report = run_doctor(context(layout).cfg, layout, quick=True, only=["data"])
    check = report.find("data", "content hash")[0]
    assert check.status == "fail" and "do not match their content hash" in check.detail
    assert "re-run `enn stage-data`" in check.fix
    assert report.exit_code == 1


def test_modified_staged_values_fail_hash_and_nonfinite_with_the_row(layout):
    path = staged(layout.root)
    feats = np.load(path / "features.npy", mmap_mode="r+")
    feats[5, 1] = np.nan
    feats.flush()
    del feats
    checks = _by_name(data.run(context(layout)))
    assert checks["content hash"].status == "fail"
    assert checks["non-finite"].status == "fail"
    assert (
        "features 1" in checks["non-finite"].detail
        and "first at row 5" in checks["non-finite"].detail
    )


def test_truncated_array_fails_the_manifest_check(layout):
    path = staged(layout.root)
    raw = (path / "labels.npy").read_bytes()
    (path / "labels.npy").write_bytes(raw[: len(raw) // 2])
    check = _by_name(data.run(context(layout)))["manifest"]
    assert check.status == "fail" and "labels.npy" in check.detail


def test_data_on_tmpfs_warns(layout, tmpfs):
    tmpfs(layout.root / "outputs", size="16m")
    staged(layout.root)
    check = _by_name(data.run(context(layout)))["fs data"]
    assert check.status == "warn", check
    assert "tmpfs" in check.detail and check.data["fstype"] == "tmpfs"
    assert "disk" in check.fix


def test_read_only_temp_dir_fails(layout, tmpfs, tmp_path, monkeypatch):
    ro = tmpfs(tmp_path / "ro-tmp", size="1m", ro=True)
    monkeypatch.setattr(tempfile, "tempdir", str(ro))
    check = _by_name(data.run(context(layout)))["fs temp"]
    assert check.status == "fail", check
    assert "Read-only file system" in check.detail and "TMPDIR" in check.fix
    assert "mounted read-only" in check.fix


def test_unusable_tmpdir_is_named_although_python_falls_back(layout, tmpfs, tmp_path, monkeypatch):
    ro = tmpfs(tmp_path / "ro-env-tmp", size="1m", ro=True)
    monkeypatch.setenv("TMPDIR", str(ro))
    checks = _by_name(data.run(context(layout)))
    assert (
        checks["fs TMPDIR"].status == "fail"
        and "Read-only file system" in checks["fs TMPDIR"].detail
    )
    assert "TMPDIR" in checks["fs TMPDIR"].fix


def test_full_temp_dir_fails(layout, tmpfs, tmp_path, monkeypatch):
    full = tmpfs(tmp_path / "full-tmp", size="64k")
    try:
        (full / "filler").write_bytes(b"x" * (1 << 20))
    except OSError:
        pass  # ENOSPC: the filesystem is now full, which is the point
    monkeypatch.setattr(tempfile, "tempdir", str(full))
    check = _by_name(data.run(context(layout)))["fs temp"]
    assert check.status == "fail", check
    assert "No space left on device" in check.detail


def test_missing_dev_shm_is_a_warning_not_a_failure(tmp_path):
    rec = Recorder("data")
    data.shm(rec, tmp_path / "no-shm-here")
    assert [c.status for c in rec.checks] == ["warn"]
    assert "does not exist" in rec.checks[0].detail


def test_small_dev_shm_warns(tmpfs, tmp_path):
    small = tmpfs(tmp_path / "shm", size="8m")
    rec = Recorder("data")
    data.shm(rec, small)
    assert rec.checks[0].status == "warn" and "Bus error" in rec.checks[0].detail
