"""Which host and study process ran a trial: its record, read as data.

When a study starts a trial it records `TrialOwner` (user attribute `enn.owner`, JSON): the
host, the trial process's pid, start time and command line, and the `enn tune` process that
started it. Nothing is ever signalled from a record: a trial's process group dies with its
study (tasks/tuning/trial.py), so a resumed study only marks failed the trials `left_here`
(this host, this checkout's study folder, a study process that is gone). A RUNNING trial with
no record was asked by a client that died before running it (tasks/tuning/shared.py).
"""

from __future__ import annotations

import json
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

OWNER_ATTR = "enn.owner"
TRIAL_MODULE = "tasks.tuning.trial"
START_TOLERANCE_S = 0.01  # psutil's create_time of one process, read twice, agrees to this


@dataclass(frozen=True)
class TrialOwner:
    host: str
    pid: int
    started: float  # the trial process's start time (seconds since the epoch)
    cmdline: tuple[str, ...]
    study_pid: int = 0  # the `enn tune` process that started it
    study_started: float = 0.0

    @classmethod
    def of(cls, pid: int, command: list[str]) -> TrialOwner:
        try:
            p = psutil.Process(pid)
            started, cmdline = p.create_time(), tuple(p.cmdline())
        except psutil.NoSuchProcess:  # it exited already
            started, cmdline = 0.0, tuple(command)
        me = psutil.Process()
        return cls(socket.gethostname(), pid, started, cmdline, me.pid, me.create_time())

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, raw: Any) -> TrialOwner | None:
        """The record as stored, or None when it is not one (missing, malformed, foreign)."""
        try:
            d = json.loads(raw) if isinstance(raw, str) else {}
            owner = cls(
                str(d["host"]),
                int(d["pid"]),
                float(d["started"]),
                tuple(d["cmdline"]),
                int(d.get("study_pid", 0)),
                float(d.get("study_started", 0.0)),
            )
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError):
            return None
        return owner if all(isinstance(a, str) for a in owner.cmdline) else None


def trial_command(job_file: Path) -> list[str]:
    """How the study starts the trial whose job file is `job_file`."""
    return [sys.executable, "-m", TRIAL_MODULE, str(job_file)]


def left_here(owner: TrialOwner | None, job_file: Path) -> bool:
    """Whether `owner` is a trial this host started for this checkout's study (`job_file`: the
    study's own job file for its number) whose `enn tune` is gone."""
    if owner is None or owner.host != socket.gethostname():
        return False
    if tuple(owner.cmdline[-3:]) != tuple(trial_command(job_file)[-3:]):
        return False
    return not process_is(owner.study_pid, owner.study_started)


def process_is(pid: int, started: float) -> bool:
    """Whether process `pid` of this host runs and started at `started`."""
    if pid <= 0:
        return False
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - started) <= START_TOLERANCE_S and (
            p.status() != psutil.STATUS_ZOMBIE
        )
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
