"""The prediction parts folder, shared by hosts, chooses nothing (issue 38.2): no link is
followed, only what enn wrote is deleted (a manifest never decides more), a user's file is
left and named, and a part forged without the job secret is recomputed, never published."""

from __future__ import annotations

import hashlib
import json
import logging

import numpy as np
import pytest

from enn_core.errors import ConfigError, StaleOutputError
from enn_core.predict.assemble import assemble
from enn_core.predict.chunks import MANIFEST, PartsPlan, PartStore

PLAN = PartsPlan(
    n_rows=10,
    rows_per_part=4,
    out_shape=(2,),
    dtype="float32",
    model_fingerprint="m" * 16,
    input_fingerprint="i" * 16,
)
KEY = b"s" * 32


def _write_all(store: PartStore) -> None:
    for k in range(PLAN.n_parts):
        start, stop = PLAN.part_range(k)
        with store.writing(k) as buf:
            buf[:] = np.arange(start * 2, stop * 2, dtype=np.float32).reshape(-1, 2)


def test_a_link_where_the_parts_folder_should_be_is_one_line_and_nothing_written(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / ".tmp-keep").write_text("theirs")
    (tmp_path / "predict").symlink_to(target)
    store = PartStore(tmp_path / "predict", PLAN, key=KEY)
    with pytest.raises(ConfigError, match=r"predict is a link .*choose another predict.parts_dir"):
        store.prepare()
    with pytest.raises(ConfigError, match="is a link"):
        with store.writing(0):
            pass
    assert [p.name for p in target.iterdir()] == [".tmp-keep"]


def test_a_users_file_survives_the_clear_and_a_foreign_manifest_deletes_nothing_of_theirs(
    tmp_path, caplog
):
    root = tmp_path / "predict"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    (root / MANIFEST).write_text(json.dumps({**PLAN.to_manifest(), "model_fingerprint": "x"}))
    (root / "part-00000.npy").write_text("a user's file with our name, no authentic marker")
    store = PartStore(root, PLAN, key=KEY)
    assert "model_fingerprint" in (store.prepare() or "")
    assert (root / "notes.txt").read_text() == "mine"
    assert (root / "part-00000.npy").exists()  # no marker vouches for it: not deleted
    _write_all(store)  # part 0 is rewritten by the job (a regular file replaced)
    with caplog.at_level(logging.WARNING, logger="enn.predict"):
        left = store.clear()
    assert left == ["notes.txt"] and "notes.txt" in caplog.text
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]


def test_the_folder_enn_made_goes_when_empty_and_a_link_inside_is_removed_as_a_link(tmp_path):
    victim = tmp_path / "victim.npy"
    victim.write_text("keep")
    store = PartStore(tmp_path / "parts" / "predict", PLAN, key=KEY)
    store.prepare("job-1")
    (store.root / ".tmp-part-00001.npy").symlink_to(victim)  # planted before a worker writes
    _write_all(store)
    assert victim.read_text() == "keep"
    store.clear()
    assert not store.root.exists() and victim.read_text() == "keep"


def test_a_forged_part_is_recomputed_and_never_assembled(tmp_path):
    store = PartStore(tmp_path / "predict", PLAN, key=KEY)
    store.prepare()
    _write_all(store)
    assert all(store.is_done(k) for k in range(PLAN.n_parts))
    # the attacker rewrites part 1 with other values and recomputes its marker's sha256
    forged = np.full((4, 2), 7.0, dtype=np.float32)
    np.save(store.pred_path(1), forged)
    marker = json.loads(store.marker_path(1).read_text())
    marker["sha256"] = hashlib.sha256(store.pred_path(1).read_bytes()).hexdigest()
    store.marker_path(1).write_text(json.dumps(marker))
    assert not store.is_done(1)  # recomputed on resume
    with pytest.raises(StaleOutputError, match="part 1 .*not complete"):
        assemble(store, tmp_path / "out.npy")
    # ... and after a check passed, a part changed under the reader is refused, not published
    _write_all(store)
    np.save(store.pred_path(2), np.zeros((2, 2), dtype=np.float32))
    with pytest.raises(StaleOutputError, match="part 2 changed after it was written"):
        store.read_part(2)
    # without the job secret's MAC, a marker is not this job's (another secret, no secret)
    assert not PartStore(store.root, PLAN, key=b"o" * 32).is_done(0)
    assert PartStore(store.root, PLAN, key=KEY).is_done(0)
