"""`train.micro_batch: auto`: the probe picks a divisor of the per-rank batch that fits the
memory budget, says why, backs away from out-of-memory sizes, and leaves the model, its
gradients and the random stream exactly as they were."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from torch import nn

from enn_core.config import load_config
from enn_core.data.dataset import StagedDataset
from enn_core.errors import ConfigError, OutOfMemory
from enn_core.events import EventLog
from enn_core.fault import FaultInjector
from enn_core.losses import make_loss
from enn_core.model.enn import build_model
from enn_core.runtime.batch_probe import (
    MicroBatchChoice,
    agree_choice,
    choose_micro_batch,
    divisors,
    sample_from_staged,
)
from enn_core.runtime.dist import local_env
from enn_core.runtime.memory import MemoryGovernor, host_peak, sampled_anon_peak
from enn_core.runtime.sampler import make_plan
from enn_core.train.loop import Runtime, TrainData, train
from enn_core.train.worker import full_state
from tests.fixtures.train import run_local, tiny_cfg

pytestmark = pytest.mark.timeout(120)


def _setup(staged, device="cpu", *extra):
    torch.set_num_threads(1)
    cfg = tiny_cfg("model.dropout=0.1", *extra)
    ds = StagedDataset(staged)
    model = build_model(cfg.model, ds.manifest.model_data(), data_dir=staged).to(device).train()
    loss = make_loss(cfg.train).to(device)
    sample = sample_from_staged(ds.features, ds.labels, ds.split("train"), device, model.normalize)
    return model, loss, sample


class OOMAbove(nn.Module):
    """The real loss, but a micro-batch of more than `k` rows fails as the CUDA allocator does."""

    def __init__(self, loss: nn.Module, k: int) -> None:
        super().__init__()
        self.loss, self.k = loss, k

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if pred.shape[0] > self.k:
            raise torch.OutOfMemoryError(f"injected out-of-memory at {pred.shape[0]} rows")
        return self.loss(pred, target)


def test_auto_picks_a_divisor_with_its_reason(staged):
    model, loss, sample = _setup(staged)
    got = choose_micro_batch(model, loss, sample, 24, "cpu", headroom=0.2)
    assert isinstance(got, MicroBatchChoice)
    assert got.micro_batch == 24  # a tiny model fits whole in any real machine's memory
    assert got.reason.startswith("auto (fit): 24 of per-rank 24 fits")
    assert "MemAvailable" in got.reason and "MiB/row" in got.reason
    m = got.measured
    assert (
        m["method"] == "fit"
        and m["bytes_per_row"] > 0
        and m["predicted_bytes"] <= m["budget_bytes"]
    )
    assert set(got.as_record()) == {"micro_batch", "micro_batch_reason", "micro_batch_measured"}


def test_a_small_budget_forces_a_smaller_micro_batch(staged):
    model, loss, sample = _setup(staged)
    first = choose_micro_batch(model, loss, sample, 48, "cpu", probe_rows=16)
    f = first.measured
    budget = int(f["unseen_bytes"] + f["fixed_bytes"] + 6 * f["bytes_per_row"])
    got = choose_micro_batch(model, loss, sample, 48, "cpu", budget_bytes=budget, probe_rows=16)
    m = got.measured
    assert got.micro_batch < 48 and 48 % got.micro_batch == 0
    assert m["predicted_bytes"] <= budget and "given budget" in got.reason
    bigger = [d for d in divisors(48) if d > got.micro_batch]  # the next one would not fit
    assert m["fixed_bytes"] + bigger[0] * m["bytes_per_row"] + m["unseen_bytes"] > budget


def test_probe_leaves_parameters_grads_buffers_and_rng_untouched(staged):
    model, loss, sample = _setup(staged, "cpu", "train.loss=student_t")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss_before = [p.detach().clone() for p in loss.parameters()]
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    for method in ("fit", "trial"):
        choose_micro_batch(model, loss, sample, 12, "cpu", method=method, probe_rows=8)
    assert torch.equal(torch.get_rng_state(), rng)  # dropout in the probe drew nothing we see
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(a, b) for a, b in zip(loss_before, loss.parameters(), strict=True))
    assert all(p.grad is None for p in [*model.parameters(), *loss.parameters()])
    assert model.training


def test_training_after_the_probe_is_bit_identical_to_training_without_it(staged, tmp_path):
    """What the lead's wiring relies on: probing, then training with the chosen micro-batch,
    gives the same loss curve as training with that micro-batch set by hand."""
    by_hand = tiny_cfg("model.dropout=0.1", "train.epochs=1", "train.micro_batch=1")
    reference, _ = run_local(by_hand, staged, tmp_path / "ref")
    cfg = tiny_cfg("model.dropout=0.1", "train.epochs=1", "train.micro_batch=auto")
    ds = StagedDataset(staged)
    torch.manual_seed(cfg.runtime.seed)  # as run_local does; the probe runs after seeding
    model = build_model(cfg.model, ds.manifest.model_data(), data_dir=staged).train()
    loss = make_loss(cfg.train)
    sample = sample_from_staged(ds.features, ds.labels, ds.split("train"), "cpu", model.normalize)
    got = choose_micro_batch(model, loss, sample, 8, "cpu", budget_bytes=0, probe_rows=8)
    assert got.micro_batch == 1 and "predicted over the budget" in got.reason  # nothing fits 0
    train_cfg = dataclasses.replace(cfg.train, micro_batch=got.micro_batch)
    env = local_env()
    rt = Runtime(
        env=env,
        model=model,
        core=model,
        loss=loss,
        run_dir=tmp_path / "probed",
        events=EventLog(tmp_path / "probed"),
        faults=FaultInjector(cfg.fault),
        full_state=lambda: full_state(model, env),
    )
    data = TrainData(ds.features, ds.labels, ds.split("train"), ds.split("val"))
    probed = train(train_cfg, data, rt, seed=cfg.runtime.seed)
    assert probed.step_losses == reference.step_losses


def test_injected_oom_makes_the_trial_search_step_down(staged):
    model, loss, sample = _setup(staged)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = choose_micro_batch(model, OOMAbove(loss, 5), sample, 24, "cpu", method="trial")
    assert got.micro_batch == 4  # the largest divisor of 24 that is <= 5
    tried = [(t["micro_batch"], t.get("result")) for t in got.measured["trials"]]
    assert tried == [
        (24, "out of memory"),
        (12, "out of memory"),
        (8, "out of memory"),
        (6, "out of memory"),
        (4, None),
    ]
    assert got.reason.startswith("auto (trial): 4 of per-rank 24 fits")
    assert "24 (out of memory)" in got.reason
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())


def test_trial_search_with_no_size_that_fits_is_a_clear_error(staged):
    model, loss, sample = _setup(staged)
    with pytest.raises(OutOfMemory, match=r"even a micro-batch of 1 row runs out of memory") as e:
        choose_micro_batch(model, OOMAbove(loss, 0), sample, 6, "cpu", method="trial")
    assert "\n" not in str(e.value)


def test_config_accepts_auto_and_rejects_bad_values_in_one_line():
    cfg = load_config(None, ["train.micro_batch=auto", "train.memory_headroom=0.3"])
    assert cfg.train.micro_batch == "auto" and cfg.train.memory_headroom == 0.3
    assert load_config(None, ["train.micro_batch=8"]).train.micro_batch == 8
    for bad, text in [
        ("train.micro_batch=big", "train.micro_batch='big' is not valid"),
        ("train.micro_batch=-2", "train.micro_batch >= 0"),
        ("train.memory_headroom=1.5", "train.memory_headroom=1.5 must be in [0, 1)"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(None, [bad])
        assert text in str(e.value) and "\n" not in str(e.value)


def test_plan_takes_the_auto_choice_and_refuses_an_unresolved_auto():
    plan = make_plan(32, "auto", 2, auto_micro_batch=4)
    assert (plan.per_rank, plan.micro_batch, plan.accumulation) == (16, 4, 4)
    assert make_plan(32, 0, 2).micro_batch == 16  # unchanged meaning of 0
    with pytest.raises(ConfigError, match="train.micro_batch=auto was not resolved"):
        make_plan(32, "auto", 2)
    choice = MicroBatchChoice(4, "auto (fit): ...")
    assert agree_choice(choice, local_env()) is choice  # world size 1: nothing to agree


@pytest.mark.gpu
def test_cuda_trial_backs_off_a_real_out_of_memory(staged):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda", 0)
    model, loss, sample = _setup(staged, dev)
    whole = choose_micro_batch(model, loss, sample, 4096, dev)
    assert whole.measured["method"] == "trial" and 4096 % whole.micro_batch == 0
    assert "max_memory_allocated" in whole.reason
    # cap this process's allocator just above what it holds: large sizes really run out
    torch.cuda.synchronize(dev)
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.empty_cache()
    cap = torch.cuda.memory_allocated(dev) + 64 * 2**20
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.cuda.set_per_process_memory_fraction(cap / total, dev)
    try:
        got = choose_micro_batch(model, loss, sample, 4096, dev)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
    assert got.micro_batch < 4096 and 4096 % got.micro_batch == 0
    assert got.measured["trials"][0]["result"] == "out of memory", got.reason
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_host_peak_counts_anonymous_memory_not_memmap_pages(tmp_path):
    mib = 2**20
    big = np.lib.format.open_memmap(
        tmp_path / "m.npy", mode="w+", dtype=np.float32, shape=(16 * mib,)
    )
    big[:] = 1.0
    big.flush()
    del big
    pages = np.load(tmp_path / "m.npy", mmap_mode="r")
    read = host_peak(lambda: float(pages.sum(dtype=np.float64)))  # 64 MiB of file pages touched
    assert read.bytes < 16 * mib
    alloc = host_peak(lambda: torch.ones(16 * mib))  # 64 MiB of anonymous memory
    # the fallback without clear_refs samples every 1 ms: hold the allocation for a few samples
    # (freed at once, its last pages could fall between two samples: 58.7 MiB read once in CI)
    sampled = sampled_anon_peak(lambda: (torch.ones(16 * mib), time.sleep(0.02)))
    for r in (alloc, sampled):
        assert 60 * mib < r.bytes < 80 * mib, r


def test_back_off_from_an_odd_auto_choice_steps_to_a_smaller_divisor():
    g = MemoryGovernor(make_plan(48, "auto", 2, auto_micro_batch=3), max_backoffs=4)
    p = g.back_off(epoch=0, step=0, reason="oom")
    assert (p.micro_batch, p.accumulation, p.global_batch) == (1, 24, 48)
    with pytest.raises(OutOfMemory, match=r"smaller divisor of the per-rank batch 24"):
        g.back_off(epoch=0, step=1, reason="oom")
    g6 = MemoryGovernor(make_plan(24, 6, 1), max_backoffs=4)
    assert [g6.back_off(epoch=0, step=s, reason="oom").micro_batch for s in (0, 1)] == [3, 1]
