"""The collective timing's own pieces (enn_core.runtime.comm_clock) and the collective-delay
fault that feeds it. What it measures in a real FSDP2 run on 2 workers:
tests/distributed/test_comm_telemetry.py."""

from __future__ import annotations

import time

import pytest
import torch

from enn_core.config import FaultConfig
from enn_core.errors import ConfigError
from enn_core.fault import FaultInjector
from enn_core.runtime.comm_clock import CommClock, time_fsdp_collectives
from tests.fixtures.train import tiny_cfg


def test_the_clock_adds_what_it_times():
    clock = CommClock()
    with clock:
        time.sleep(0.02)
    with clock:
        pass
    assert clock.calls == 2 and 0.02 <= clock.seconds < 0.5


def test_a_model_without_fsdp2_has_nothing_to_time():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    assert time_fsdp_collectives(model, CommClock()) == 0
    with pytest.raises(ValueError, match="unknown collectives"):
        time_fsdp_collectives(model, CommClock(), {"all_reduce": 1.0})


def test_comm_delay_is_handed_to_the_collectives_of_its_rank_only():
    cfg = FaultConfig(kind="comm_delay", phase="reduce_scatter", rank=1, seconds=0.25)
    assert FaultInjector(cfg, rank=1).collective_delays() == {"reduce_scatter": 0.25}
    assert FaultInjector(cfg, rank=0).collective_delays() == {}
    everywhere = FaultConfig(kind="comm_delay", phase="all_gather", seconds=0.1)
    assert FaultInjector(everywhere, rank=3).collective_delays() == {"all_gather": 0.1}
    assert FaultInjector(FaultConfig(kind="delay", phase="step")).collective_delays() == {}
    FaultInjector(cfg, rank=1).at("reduce_scatter")  # never fired at a call site


def test_comm_delay_names_the_phases_it_can_slow():
    with pytest.raises(ConfigError, match=r"comm_delay .*one of all_gather, reduce_scatter"):
        tiny_cfg("fault.kind=comm_delay", "fault.phase=step")
