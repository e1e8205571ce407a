"""Dying with the parent, in real processes: a child whose parent dies while it is still
starting (Python's imports take seconds; a study or an `enn` killed in that window) must not
live on under init. This is what the tuning study's SIGKILL test met on CI: a trial's
torchrun, started a moment before the trial was killed, trained on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from enn_core.runtime.parent import PARENT_ENV

ROOT = Path(__file__).resolve().parents[3]

# the child: a slow start (its imports), then die_with_parent, then a mark that it lived on
CHILD = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    time.sleep(float(sys.argv[2]))
    from enn_core.runtime.parent import PARENT_ENV, die_with_parent
    die_with_parent()
    Path(sys.argv[1]).write_text(os.environ.get(PARENT_ENV, "popped"))
    time.sleep(30)
    """
)

# the parent: starts the child with spawned_env, writes its pid, and dies at once
PARENT = textwrap.dedent(
    """
    import os, subprocess, sys
    from pathlib import Path
    from enn_core.runtime.parent import spawned_env
    child = subprocess.Popen(
        [sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]],
        env=spawned_env(dict(os.environ)),
    )
    Path(sys.argv[4]).write_text(str(child.pid))
    os._exit(0)
    """
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != PARENT_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_child_whose_parent_died_while_it_started_ends_at_once(tmp_path):
    mark, pid_file = tmp_path / "lived-on", tmp_path / "child.pid"
    subprocess.run(
        [sys.executable, "-c", PARENT, CHILD, str(mark), "1.5", str(pid_file)],
        env=_env(),
        check=True,
        timeout=60,
    )
    child = int(pid_file.read_text())
    try:
        assert _gone(child, 20), "the orphaned child lived on under init"
        assert not mark.exists(), "the orphaned child ran past die_with_parent"
    finally:
        if not _gone(child, 0):
            os.kill(child, 9)


def test_a_child_whose_parent_lives_runs_and_its_own_children_are_not_told(tmp_path):
    mark = tmp_path / "ran"
    env = {**_env(), PARENT_ENV: str(os.getpid())}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(mark), "0"], env=env)
    try:
        deadline = time.monotonic() + 30
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        # the message is one hop: the child's own children never inherit it
        assert mark.read_text() == "popped"
        assert child.poll() is None
    finally:
        child.kill()
        child.wait(10)


def test_a_named_parent_that_is_not_the_parent_ends_the_child_and_junk_is_ignored(tmp_path):
    mark = tmp_path / "ran"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(mark), "0"],
            env={**_env(), PARENT_ENV: str(other.pid)},
            timeout=60,
            check=False,
        )
        assert out.returncode == 1 and not mark.exists()
    finally:
        other.kill()
        other.wait(10)
    junk = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(mark), "0"],
        env={**_env(), PARENT_ENV: "$(rm -rf /)"},
    )
    try:
        deadline = time.monotonic() + 30
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists() and junk.poll() is None, "junk in the variable: parent = getppid"
    finally:
        junk.kill()
        junk.wait(10)
