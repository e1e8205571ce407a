"""Batches that fit the table (`train.batch_size: auto`, `train.eval_batch: auto`,
`predict.batch_size: auto`) and the cap on optimizer steps (`train.max_steps`)."""

from __future__ import annotations

import json

import pytest

from enn_core.config import load_config
from enn_core.events import read_events
from enn_core.train.batch import choose_batch, choose_eval_batch
from tests.fixtures.train import run_local, tiny_cfg


def test_the_default_batch_grows_with_the_table() -> None:
    cfg = load_config(None, [])
    assert cfg.train.batch_size == "auto" and cfg.train.eval_batch == "auto"
    # the demo table (504 rows, 70% training): the 16 it was always trained with
    assert choose_batch(cfg.train.batch_size, 353, 1).value == 16
    # issue 51's 3-million-row table: 1,465 steps an epoch, not 135,469
    big = choose_batch(cfg.train.batch_size, 3_000_000, 1)
    assert big.value == 2048
    assert big.reason == "train.batch_size=auto for 3,000,000 training rows: 1,465 steps an epoch"
    assert choose_batch("auto", 10**9, 1).value == 4096  # the ceiling
    assert choose_batch("auto", 5, 1).value == 5  # never more than the training rows
    # a multiple of the world size, said so; powers of two already are
    odd = choose_batch("auto", 300_000, 3)
    assert odd.value == 513 and "multiple of 3 workers" in odd.reason
    assert choose_batch("auto", 300_000, 4).value == 512
    assert choose_batch(32, 3_000_000, 2).value == 32  # a number set is kept


def test_eval_and_predict_batches_follow_the_training_batch() -> None:
    assert choose_eval_batch("auto", 16).value == 256
    assert choose_eval_batch("auto", 2048).value == 4096
    assert choose_eval_batch(64, 2048).value == 64
    predict = load_config(None, []).predict
    assert predict.batch_size == "auto" and predict.forward_rows == 4096
    assert load_config(None, ["predict.chunk_rows=500"]).predict.forward_rows == 500
    assert load_config(None, ["predict.batch_size=64"]).predict.forward_rows == 64


def test_max_steps_ends_the_run_and_its_schedule(staged, tmp_path) -> None:
    cfg = tiny_cfg("train.epochs=5", "train.max_steps=6", "train.min_lr_ratio=0.5")
    result, _ = run_local(cfg, staged, tmp_path)
    spe = -(-json.loads((staged / "manifest.json").read_text())["splits"]["train"] // 8)
    assert spe < 6 < 2 * spe  # the cap falls inside the second epoch
    assert result.applied_steps == 6 and len(result.history) == 2
    # the cosine schedule was laid over the 6 steps: it ended at its floor
    assert result.history[-1]["lr"] == pytest.approx(cfg.train.lr * 0.5, rel=1e-6)
    events = list(read_events(tmp_path))
    capped = [e for e in events if e.get("name") == "max_steps"]
    assert [e["fields"]["step"] for e in capped] == [6]
    params = {e["name"]: e["value"] for e in events if e["type"] == "param"}
    assert params["resolved.train.total_steps"] == 6
    assert params["resolved.train.eval_batch"] == 256


def test_an_auto_batch_is_resolved_and_recorded_by_the_loop(staged, tmp_path) -> None:
    result, _ = run_local(tiny_cfg("train.batch_size=auto"), staged, tmp_path)
    params = {e["name"]: e["value"] for e in read_events(tmp_path) if e["type"] == "param"}
    assert params["resolved.train.batch_size"] == 16 == result.micro_batch
    assert params["resolved.train.batch_size_reason"].startswith("train.batch_size=auto for ")
