"""The staged manifest as a record: parsed once at the file boundary, written back unchanged."""

from __future__ import annotations

import json

from enn_core.config import DataConfig, SyntheticConfig
from enn_core.data.manifest import MANIFEST, FileEntry, StagedManifest, read_manifest
from enn_core.data.staging import stage_features
from enn_core.paths import Layout
from tests.fixtures.data import run_stage

SMALL = SyntheticConfig(n_months=3, n_daytypes=2, n_sections=2, n_hours=3, n_replicates=2)


def test_the_record_writes_the_json_it_was_read_from(tmp_path):
    """Training and features-only manifests: the record's file form is the file's JSON, key for
    key (so outputs written before the record load, and re-staging changes no DVC hash)."""
    _, out = run_stage(tmp_path, synthetic=SMALL)
    data = DataConfig(synthetic=SMALL)
    stage_features(data, Layout.for_root(tmp_path), tmp_path / "new", out / MANIFEST)
    for folder in (out, tmp_path / "new"):
        on_disk = json.loads((folder / MANIFEST).read_text())
        m = read_manifest(folder)
        assert m.to_json() == on_disk
        assert StagedManifest.from_json(on_disk) == m
    train, new = read_manifest(out), read_manifest(tmp_path / "new")
    assert train.mode == "training" and train.labels is not None
    assert new.mode == "features_only" and new.labels is None
    assert new.label == train.label and new.training_content_hash == train.content_hash
    assert train.label_shape == (2, 3) and set(train.splits) == {"train", "val", "test"}


def test_model_data_is_what_a_checkpoint_records(tmp_path):
    _, out = run_stage(tmp_path, synthetic=SMALL)
    m = read_manifest(out)
    data = m.model_data()
    assert data["label_shape"] == [2, 3] and data["content_hash"] == m.content_hash
    assert data["feature_specs"] == [dict(s) for s in m.feature_specs]


def test_a_legacy_file_entry_keeps_its_key():
    old = {"dtype": "int64", "shape": [3], "sha256": "ab" * 32}
    entry = FileEntry.from_json(old)
    assert entry.hash == "ab" * 32 and entry.to_json() == old
