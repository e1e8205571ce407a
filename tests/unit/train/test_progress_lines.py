"""Progress where no terminal is (issue 51): while training runs with its output going to a file
(a Prefect worker, a SLURM job, `nohup`), the launching process says where the epoch is in a
step line every `runtime.progress_every_s`, not only once per epoch.

The loop runs in this process at world size 1 with its real heartbeat and events (what a
worker writes); `follow_training` reads them as the stage's launching process does, into a
log file."""

from __future__ import annotations

import logging
import re
import sys
import time

import pytest
import torch

from enn_core.data.dataset import StagedDataset
from enn_core.events import EventLog
from enn_core.fault import FaultInjector
from enn_core.losses import make_loss
from enn_core.model.enn import build_model
from enn_core.progress import Ticker, follow_training
from enn_core.runtime.dist import local_env
from enn_core.runtime.heartbeat import Heartbeat
from enn_core.train.loop import Runtime, TrainData, train
from tests.fixtures.train import staged_dir, tiny_cfg

STEP_LINE = re.compile(
    r"distributed-train: (\d+)/(\d+) steps \(epoch 1/1\)  [\d,]+ rows/s  ~\d+:\d\d left$"
)


@pytest.mark.parametrize("capped", [False, True], ids=["epochs", "max-steps"])
def test_a_run_whose_output_is_a_file_says_its_steps_within_the_epoch(tmp_path, capped) -> None:
    """`capped`: train.epochs=3 and train.max_steps one epoch's steps: the lines count the
    epochs the run trains (before: `epoch 1/3`, and 2 more epochs in the ETA)."""
    sets = ["data.synthetic.n_replicates=20", "train.batch_size=1", "runtime.progress_every_s=0.2"]
    cfg = tiny_cfg(*sets, "train.epochs=1")
    staged = staged_dir(tmp_path, cfg)
    ds = StagedDataset(staged)
    n_train = len(ds.split("train"))
    if capped:
        cfg = tiny_cfg(*sets, "train.epochs=3", f"train.max_steps={n_train}")
    run_dir = tmp_path / "run"
    log_file = tmp_path / "enn.log"
    handler = logging.FileHandler(log_file)
    log = logging.getLogger("enn.test-progress-lines")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    assert not sys.stderr.isatty()  # as under Prefect or SLURM: no bar to show
    torch.set_num_threads(1)
    model = build_model(cfg.model, ds.manifest.model_data(), data_dir=staged).train()
    beat = Heartbeat(run_dir, 0, interval=0.05).start()
    rt = Runtime(
        env=local_env(),
        model=model,
        core=model,
        loss=make_loss(cfg.train),
        run_dir=run_dir,
        events=EventLog(run_dir),
        faults=FaultInjector(cfg.fault),
        heartbeat=beat,
    )
    data = TrainData(ds.features, ds.labels, ds.split("train"), ds.split("val"))
    try:
        with follow_training(
            run_dir,
            n_train,
            "distributed-train",
            log,
            bar_enabled=cfg.runtime.progress,
            interval=0.05,
            every_s=cfg.runtime.progress_every_s,
            epochs=cfg.train.epochs,
        ):
            train(cfg.train, data, rt, seed=0)
    finally:
        beat.stop()
        log.removeHandler(handler)
        handler.close()
    lines = log_file.read_text().splitlines()
    epoch = next(i for i, line in enumerate(lines) if line.startswith("distributed-train: epoch"))
    assert lines[epoch].startswith("distributed-train: epoch 1/1 "), lines[epoch]
    steps = [m for line in lines[:epoch] if (m := STEP_LINE.match(line))]
    assert steps, lines  # before the fix: the epoch line alone
    assert all(int(m[2]) == n_train for m in steps)
    done = [int(m[1]) for m in steps]
    assert done == sorted(done) and 0 < done[-1] < n_train


def test_a_ticker_says_nothing_where_a_bar_shows_or_before_its_interval(caplog) -> None:
    caplog.set_level(logging.INFO, logger="enn.test-ticker")
    log = logging.getLogger("enn.test-ticker")
    quick = Ticker("predict", 1000, unit="rows", every_s=60.0, logger=log)
    quick.update(500)
    shown = Ticker("predict", 1000, unit="rows", every_s=0.0001, logger=log, quiet=True)
    shown.update(500)
    off = Ticker("predict", 1000, unit="rows", every_s=0, logger=log)
    off.update(500)
    assert caplog.records == []
    due = Ticker("stage-data", None, unit="rows", every_s=0.001, logger=log)
    time.sleep(0.01)
    due.update(3_000)
    (record,) = caplog.records
    assert re.fullmatch(r"stage-data: 3,000 rows  [\d,]+ rows/s", record.getMessage())


def test_a_slow_rate_is_not_shown_as_zero() -> None:
    """A large model's first step: 16 rows in 76 s read `0 rows/s`."""
    slow = Ticker("distributed-train", 2, unit="steps", every_s=60.0, rows_per_unit=16)
    slow.done = 1
    line = slow.line(slow.t0 + 76.0)
    assert "  0.21 rows/s  " in line, line
