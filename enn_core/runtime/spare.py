"""A spare worker: the one worker of a one-node job without restarts, started before its job.

The launcher (enn_core.runtime.launch, `spare_worker`) starts it when the caller knows such a
job will come (the training flow: tasks/session.py); it runs the worker entry with `--warm
<module>` (enn_core.runtime.entry), imports the module, and waits for its job on a pipe. The
next such job takes it (`take_spare`, `hand_over`) when it still runs, in the process group
the job needs, with the job's environment but for `LATE_VARIABLES`; otherwise it is let go
and a fresh worker starts. Only the parent holds the pipe: nothing else chooses its job. It is
a child of the process table (enn_core.runtime.children): started and stopped there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from enn_core.runtime import children
from enn_core.runtime.entry import WARM

log = logging.getLogger("enn.launch")


@dataclass
class Spare:
    """A worker started before its job (`spare_worker`)."""

    child: children.Child
    env: dict[str, str]
    own_group: bool

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.child.proc


_spare: list[Spare] = []  # at most one
_spare_lock = threading.Lock()
# Variables a spare may see change between its start and its job: the tools' settings of the
# parent (MLflow's client sets MLFLOW_TRACKING_URI when the run's tracker starts), which the
# worker's imports never read; the job's values are applied when it is handed over.
LATE_VARIABLES = ("MLFLOW_", "PREFECT_")


def let_go(spare: Spare) -> None:
    """An unused spare ends now (it holds nothing to clean up; it may still be importing)."""
    children.stop(spare.child)
    with contextlib.suppress(OSError):
        assert spare.proc.stdin is not None
        spare.proc.stdin.close()


def take_spare(env: dict[str, str], own_group: bool) -> Spare | None:
    """The spare, when it runs with `env` (but for `LATE_VARIABLES`) in the process group
    the job needs; else None (a spare that does not match is let go)."""
    with _spare_lock:
        spare = _spare.pop() if _spare else None
    if spare is None:
        return None
    changed = sorted(
        k
        for k in {*env, *spare.env}
        if env.get(k) != spare.env.get(k) and not k.startswith(LATE_VARIABLES)
    )
    if spare.proc.poll() is None and not changed and spare.own_group == own_group:
        return spare
    log.debug(
        "the spare worker does not fit the job (exit %s, variables %s, own group %s -> %s); "
        "a fresh worker starts",
        spare.proc.poll(),
        changed,
        spare.own_group,
        own_group,
    )
    let_go(spare)
    return None


def start(module: str, env: dict[str, str], own_group: bool) -> Spare:
    """A spare importing `module`, the one to take from now (an older one is let go)."""
    command = [sys.executable, "-m", "enn_core.runtime.entry", WARM, module]
    child = children.start("spare-worker", command, env=env, stdin_pipe=True, session=own_group)
    spare = Spare(child, env, own_group)
    with _spare_lock:
        before, _spare[:] = list(_spare), [spare]
    for old in before:  # a session inside another: the newer spare is the one to take
        let_go(old)
    return spare


def release(spare: Spare) -> None:
    """`spare` let go unless a job took it."""
    with _spare_lock:
        unused = spare in _spare
        if unused:
            _spare.remove(spare)
    if unused:
        let_go(spare)


def hand_over(
    spare: Spare, env: dict[str, str], rank_env: dict[str, str], job: Path, log_file: Path
) -> bool:
    """The job to the spare (False if it died meanwhile: a fresh worker is started). Its
    environment becomes the job's: `env`'s late variables (those unset since its start
    removed) and the rank's variables."""
    late = {k: v for k, v in env.items() if k.startswith(LATE_VARIABLES)}
    unset = [k for k in spare.env if k.startswith(LATE_VARIABLES) and k not in env]
    handed = {"job": str(job), "log": str(log_file), "env": {**late, **rank_env}, "unset": unset}
    assert spare.proc.stdin is not None
    try:
        spare.proc.stdin.write(json.dumps(handed).encode() + b"\n")
        spare.proc.stdin.close()
    except OSError:
        let_go(spare)
        return False
    except BaseException:  # interrupted mid-hand-over: the spare is nobody's now
        let_go(spare)
        raise
    spare.child.kind = "worker"  # the job's one worker now
    return True
