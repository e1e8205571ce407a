"""Which process a trial's record names, and whether the study may signal it.

A study database is data (README, "Security notes"): copied, restored from a backup or
written by someone else, it must never choose what is killed. When the study starts a trial
it records the trial process as `TrialOwner` (user attribute `enn.owner`, JSON): the host,
the pid, the process's start time and its command line. A resumed study signals a trial
process only when (`claim`)

- the record was made on this host,
- a process with that pid runs and started at the recorded time (pids are reused),
- its command line is the recorded one, and that is this study's trial command for the
  trial's own folder (`python -m tasks.tuning.trial work/tune/<study>/trial-<N>/trial.json`,
  the folder computed by the study, not read from the record);

anything else is left alone and named. The record also names the `enn tune` process that
started the trial (`study_pid`, `study_started`). On a storage shared by several hosts
(`tune.storage`), a starting study ends at once only the trials it finds `left_here`: made on
this host, for this checkout's study folder, by a study process that is gone; every other
running trial belongs to a live study somewhere, and Optuna's heartbeat decides when it is
stale (tasks/tuning/shared.py). Another host's record is never signalled: each host kills only
its own trials' processes, and only by `claim`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

OWNER_ATTR = "enn.owner"  # a trial's user attribute: TrialOwner as JSON
TRIAL_MODULE = "tasks.tuning.trial"
START_TOLERANCE_S = 0.01  # psutil's create_time of one process, read twice, agrees to this


@dataclass(frozen=True)
class TrialOwner:
    """The process a study started for a trial: where, which, since when, running what."""

    host: str
    pid: int
    started: float  # the process's start time (psutil create_time, seconds since the epoch)
    cmdline: tuple[str, ...]
    study_pid: int = 0  # the `enn tune` process that started it (0: an older record)
    study_started: float = 0.0

    @classmethod
    def of(cls, pid: int, command: list[str]) -> TrialOwner:
        """The record of the process the study just started with `command`."""
        try:
            p = psutil.Process(pid)
            started, cmdline = p.create_time(), tuple(p.cmdline())
        except psutil.NoSuchProcess:  # it exited already: a record no process will match
            started, cmdline = 0.0, tuple(command)
        me = psutil.Process()
        return cls(socket.gethostname(), pid, started, cmdline, me.pid, me.create_time())

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, raw: Any) -> TrialOwner | None:
        """The record as stored, or None when it is not one (missing, malformed, foreign)."""
        try:
            d = json.loads(raw) if isinstance(raw, str) else None
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
        if not all(isinstance(a, str) for a in owner.cmdline):
            return None
        return owner


def trial_command(job_file: Path) -> list[str]:
    """How the study starts the trial whose job file is `job_file`."""
    return [sys.executable, "-m", TRIAL_MODULE, str(job_file)]


def claim(owner: TrialOwner | None, job_file: Path) -> tuple[psutil.Process | None, str]:
    """The process `owner` names, when it is the trial this study started for `job_file` on
    this host and still that process; else None. The second item says which (for the log)."""
    if owner is None:
        return None, "its record names no process this study started"
    who = f"pid {owner.pid} on {owner.host}"
    if owner.host != socket.gethostname():
        return None, f"{who}: another host's process"
    if owner.pid <= 1 or owner.pid == os.getpid():
        return None, f"{who}: not a trial process"
    if tuple(owner.cmdline[-3:]) != tuple(trial_command(job_file)[-3:]):
        return None, f"{who}: its record names another command than this trial's"
    try:
        p = psutil.Process(owner.pid)
        same = (
            abs(p.create_time() - owner.started) <= START_TOLERANCE_S
            and tuple(p.cmdline()) == owner.cmdline
            and p.status() != psutil.STATUS_ZOMBIE
        )
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None, f"{who}: gone"
    if not same:
        return None, f"{who}: now another process (pid reused)"
    return p, f"{who}: still running"


def left_here(owner: TrialOwner | None, job_file: Path) -> bool:
    """Whether `owner` is a trial this host started for this checkout's study (`job_file` is
    the study's own job file for the trial's number) whose `enn tune` is gone: a trial a killed
    study left here, which the next `enn tune` of this checkout ends without waiting for its
    heartbeat to go stale."""
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
