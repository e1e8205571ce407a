"""DVC in enn's own process draws nothing on a terminal: its repository lock's "Waiting to
acquire lock. If DVC froze ..." bar flashed once per stage even when nobody else held the
lock (a newcomer read it as a hang)."""

from __future__ import annotations

import io
import subprocess
import sys

from tasks.dvc_state import _repo_class


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_taking_dvcs_lock_in_a_terminal_draws_nothing(tmp_path, monkeypatch):
    subprocess.run(
        [sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True
    )
    Repo = _repo_class()  # noqa: N806 - DVC's class
    screen = _Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    with Repo(str(tmp_path)) as repo:
        with repo.lock:  # nobody else holds it
            pass
        # another DVC process holds it for a second: DVC waits and retries
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(tmp_path / ".dvc" / "tmp" / "lock")],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with repo.lock:
            pass
        holder.wait(30)
    assert "Waiting to acquire lock" not in screen.getvalue()
    assert screen.getvalue() == ""


HOLD = """
import sys, time
import zc.lockfile
lock = zc.lockfile.LockFile(sys.argv[1])
print("held", flush=True)
time.sleep(1.0)
lock.close()
"""


def test_committing_and_checking_a_stage_in_a_terminal_draws_nothing(tmp_path, monkeypatch):
    """After each stage enn commits it and asks its status: dvc-data drew "Checking cache in
    '.dvc/cache/files/md5'" once per stage on a terminal (seen in a 120-column pty)."""
    subprocess.run(
        [sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True
    )
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n  make:\n    cmd: echo\n    outs:\n      - out/\n", encoding="utf-8"
    )
    (tmp_path / "out").mkdir()
    for i in range(3):
        (tmp_path / "out" / f"{i}.txt").write_text(str(i), encoding="utf-8")
    Repo = _repo_class()  # noqa: N806 - DVC's class
    screen = _Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    target = f"{tmp_path / 'dvc.yaml'}:make"
    with Repo(str(tmp_path)) as repo:
        repo.commit(target, force=True)
        assert repo.status(targets=[target]) == {}
    assert (tmp_path / "dvc.lock").exists()
    assert screen.getvalue() == ""
