"""Chunked parts, resume, refusal of foreign parts and assembly by row id."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from enn_core.config import FaultConfig
from enn_core.errors import DataError, StaleOutputError
from enn_core.fault import InjectedFault
from enn_core.predict.assemble import assemble, check_coverage
from enn_core.predict.chunks import PartsPlan, parts_of_worker
from enn_core.predict.workers import WorkerJob, predict_parts
from tests.fixtures.predict import OUT_SHAPE, job_secret, load_tiny, make_features, parts_store


def _plan(n=50, rows=16, model="m1", inp="i1") -> PartsPlan:
    return PartsPlan(
        n_rows=n,
        rows_per_part=rows,
        out_shape=OUT_SHAPE,
        dtype="float32",
        model_fingerprint=model,
        input_fingerprint=inp,
    )


def _job(tmp_path, plan, index=None, fault=None, batch=5) -> WorkerJob:
    feats = tmp_path / "features.npy"
    if not feats.exists():
        np.save(feats, make_features(80))
    idx_path = None
    if index is not None:
        idx_path = str(tmp_path / "index.npy")
        np.save(idx_path, index)
    return WorkerJob(
        rank=0,
        world_size=1,
        parts_dir=str(tmp_path / "parts"),
        plan=plan,
        features_path=str(feats),
        index_path=idx_path,
        batch_size=batch,
        loader=functools.partial(load_tiny, 3, 0),
        fault=fault or FaultConfig(),
        fault_marker_dir=str(tmp_path / "faults"),
        secret_file=job_secret(tmp_path),
    )


def _reference(index: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return load_tiny()(torch.from_numpy(make_features(80)[index])).numpy()


def test_plan_ranges_and_worker_blocks_cover_every_part_once():
    plan = _plan(n=50, rows=16)
    assert plan.n_parts == 4
    assert [plan.part_range(k) for k in range(4)] == [(0, 16), (16, 32), (32, 48), (48, 50)]
    for world in (1, 2, 3, 5):
        blocks = [list(parts_of_worker(7, r, world)) for r in range(world)]
        assert sum(blocks, []) == list(range(7))


def test_parts_assemble_to_the_model_output(tmp_path):
    index = np.arange(5, 55, dtype=np.int64)[::-1].copy()
    plan = _plan()
    store = parts_store(tmp_path / "parts", plan, tmp_path)
    assert store.prepare() is None
    stats = predict_parts(_job(tmp_path, plan, index))
    assert stats["computed_parts"] == [0, 1, 2, 3] and stats["rows_computed"] == 50
    out = assemble(store, tmp_path / "pred.npy")
    np.testing.assert_allclose(out, _reference(index), rtol=1e-6, atol=1e-5)


def test_resume_after_injected_failure_skips_done_parts_and_is_bit_identical(tmp_path):
    plan = _plan()
    clean_dir = tmp_path / "clean"
    clean_dir.mkdir()
    parts_store(clean_dir / "parts", plan, clean_dir).prepare()
    predict_parts(_job(clean_dir, plan))
    clean = np.array(
        assemble(parts_store(clean_dir / "parts", plan, clean_dir), clean_dir / "p.npy")
    )

    store = parts_store(tmp_path / "parts", plan, tmp_path)
    store.prepare()
    fault = FaultConfig(kind="raise", phase="predict_chunk", step=1)
    with pytest.raises(InjectedFault):
        predict_parts(_job(tmp_path, plan, fault=fault))
    done = {k: store.pred_path(k).stat().st_mtime_ns for k in (0, 1)}
    assert not store.marker_path(2).exists()

    store.prepare()
    stats = predict_parts(_job(tmp_path, plan))
    assert stats["reused_parts"] == [0, 1] and stats["computed_parts"] == [2, 3]
    assert {k: store.pred_path(k).stat().st_mtime_ns for k in (0, 1)} == done
    resumed = np.array(assemble(store, tmp_path / "p.npy"))
    assert resumed.tobytes() == clean.tobytes()


def test_parts_from_another_model_or_input_are_discarded(tmp_path):
    plan = _plan()
    parts_store(tmp_path / "parts", plan, tmp_path).prepare()
    predict_parts(_job(tmp_path, plan))
    for other in (_plan(model="m2"), _plan(inp="i2"), _plan(rows=8)):
        store = parts_store(tmp_path / "parts", other, tmp_path)
        reason = store.prepare()
        assert reason is not None and "recomputing every part" in reason
        assert not any(store.is_done(k) for k in range(other.n_parts))
        stats = predict_parts(_job(tmp_path, other))
        assert stats["reused_parts"] == []


def test_corrupted_part_fails_its_checksum_and_is_recomputed(tmp_path):
    plan = _plan()
    store = parts_store(tmp_path / "parts", plan, tmp_path)
    store.prepare()
    predict_parts(_job(tmp_path, plan))
    good = np.array(assemble(store, tmp_path / "a.npy"))
    arr = np.load(store.pred_path(2), mmap_mode="r+")
    arr[0, 0, 0] += 1.0
    arr.flush()
    del arr
    assert not store.is_done(2)
    stats = predict_parts(_job(tmp_path, plan))
    assert stats["computed_parts"] == [2]
    assert np.array(assemble(store, tmp_path / "b.npy")).tobytes() == good.tobytes()


def test_assembly_names_missing_and_duplicated_rows(tmp_path):
    with pytest.raises(DataError, match=r"2 rows \(3, 4\) missing"):
        check_coverage([np.array([0, 1, 2]), np.array([5])], 6, tmp_path)
    with pytest.raises(DataError, match=r"1 rows \(2\) appear in more than one part"):
        check_coverage([np.array([0, 1, 2]), np.array([2, 3])], 4, tmp_path)
    plan = _plan()
    store = parts_store(tmp_path / "parts", plan, tmp_path)
    store.prepare()
    predict_parts(_job(tmp_path, plan))
    store.marker_path(1).unlink()
    with pytest.raises(StaleOutputError, match="part 1 is not complete"):
        assemble(store, tmp_path / "x.npy")
