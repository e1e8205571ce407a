"""The process table (enn_core.runtime.children), in real processes: a child is started with
the handshake and its log, listed while it runs, stopped with its whole tree (a grandchild in
a session of its own too), given its grace when asked, dies with its parent (enn's programs
by the handshake, a foreign one by the kernel), and a record whose pid is another process's
now is never signalled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from enn_core.runtime import children
from enn_core.runtime.children import Proc
from enn_core.runtime.parent import PARENT_ENV

ROOT = Path(__file__).resolve().parents[3]
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]

# a child that starts a grandchild in its group and one in a session of its own, writes
# their pids, then waits
TREE = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    a = subprocess.Popen(cmd)
    b = subprocess.Popen(cmd, start_new_session=True)
    Path(sys.argv[1]).write_text(f"{a.pid} {b.pid}")
    time.sleep(60)
    """
)

# a child that saves and leaves on SIGTERM
GRACEFUL = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    def leave(*_):
        Path(sys.argv[1]).write_text("saved")
        sys.exit(0)
    signal.signal(signal.SIGTERM, leave)
    Path(sys.argv[1] + ".ready").write_text("")
    time.sleep(60)
    """
)

# a parent that starts one child through the table, writes its pid, and dies at once
PARENT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from enn_core.runtime import children
    foreign = sys.argv[2] == "foreign"
    cmd = ["sleep", "60"] if foreign else [sys.executable, "-c", sys.argv[3]]
    child = children.start("test", cmd, foreign=foreign, session=True)
    Path(sys.argv[1]).write_text(str(child.pid))
    os._exit(0)
    """
)
CHILD = textwrap.dedent(
    """
    import time
    time.sleep(1.0)  # its imports: the parent is gone before it asks
    from enn_core.runtime.parent import die_with_parent
    die_with_parent()
    time.sleep(60)
    """
)


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _wait_for(path: Path, within_s: float = 30) -> str:
    deadline = time.monotonic() + within_s
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return path.read_text()


def environ(pid: int) -> list[bytes]:
    """`pid`'s environment as exec gave it: empty for a moment after Popen returns (the kernel
    releases a vfork parent before it sets the new program's environment up)."""
    deadline = time.monotonic() + 10
    while not (raw := Path(f"/proc/{pid}/environ").read_bytes()):
        assert time.monotonic() < deadline, f"pid {pid} has no environment"
        time.sleep(0.02)
    return raw.split(b"\0")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != PARENT_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_a_child_is_started_with_the_handshake_and_its_log_and_listed_while_it_runs(tmp_path):
    log = tmp_path / "child.log"
    say = [sys.executable, "-c", "import time; print('hello', flush=True); time.sleep(60)"]
    child = children.start("test", say, log=log, session=True)
    try:
        assert f"{PARENT_ENV}={os.getpid()}".encode() in environ(child.pid)
        assert os.getpgid(child.pid) == child.pid  # a session of its own
        assert child.record == Proc(child.pid, psutil.Process(child.pid).create_time())
        assert child in children.running()
        assert _wait_for(log).strip() == "hello"
    finally:
        children.stop(child)
    assert child not in children.running()
    assert child.proc.returncode is not None


def test_stop_ends_the_whole_tree_and_the_group(tmp_path):
    pids = tmp_path / "pids"
    child = children.start("test", [sys.executable, "-c", TREE, str(pids)], session=True)
    in_group, own_session = map(int, _wait_for(pids).split())
    killed = children.stop(child)
    assert set(killed) == {child.pid, in_group, own_session}
    for pid in (child.pid, in_group, own_session):
        assert _gone(pid, 10), f"pid {pid} of the tree outlived the stop"


def test_stop_with_a_grace_lets_the_child_save_and_leave(tmp_path):
    mark = tmp_path / "mark"
    child = children.start("test", [sys.executable, "-c", GRACEFUL, str(mark)], session=True)
    deadline = time.monotonic() + 30
    while not Path(f"{mark}.ready").exists():
        assert time.monotonic() < deadline, "the child never got ready"
        time.sleep(0.05)
    children.stop(child, grace_s=20)
    assert mark.read_text() == "saved"
    assert child.proc.returncode == 0


def test_a_record_whose_pid_is_another_process_now_is_not_signalled():
    other = subprocess.Popen(SLEEP)
    try:
        now = Proc.of(other.pid)
        assert now is not None and now.same()
        reused = Proc(other.pid, now.started - 5.0)  # the same pid, an earlier process's
        assert not reused.same()
        assert children.kill([reused]) == set()
        child = children.start("test", SLEEP)
        assert other.pid not in children.stop(child, also=[reused])
        time.sleep(0.2)
        assert other.poll() is None, "a process that only reused a recorded pid was killed"
        assert children.kill([now]) == {other.pid}
        assert other.wait(10) == -signal.SIGKILL
    finally:
        other.kill()
        other.wait(10)


def test_a_child_dies_with_its_parent_by_the_handshake_or_the_kernel(tmp_path):
    for how in ("handshake", "foreign"):
        pid_file = tmp_path / f"{how}.pid"
        subprocess.run(
            [sys.executable, "-c", PARENT, str(pid_file), how, CHILD],
            env=_env(),
            check=True,
            timeout=60,
        )
        pid = int(pid_file.read_text())
        try:
            assert _gone(pid, 20), f"{how}: the child lived on after its parent died"
        finally:
            if not _gone(pid, 0):
                os.kill(pid, signal.SIGKILL)


def _daemon_threads() -> dict[str, str]:
    """Each `threading.Thread(..., daemon=True)` of the product: its name (an f-string's
    constant head) -> where it is started."""
    import ast

    found = {}
    for package in ("enn_core", "tasks", "flows"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (
                    isinstance(node, ast.Call) and ast.unparse(node.func) == "threading.Thread"
                ):
                    continue
                kw = {k.arg: k.value for k in node.keywords}
                daemon = kw.get("daemon")
                if not (isinstance(daemon, ast.Constant) and daemon.value is True):
                    continue
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                name = kw.get("name")
                if isinstance(name, ast.JoinedStr):
                    head = name.values[0] if name.values else None
                    name = head if isinstance(head, ast.Constant) else None
                found[name.value if isinstance(name, ast.Constant) else f"<unnamed> {where}"] = (
                    where
                )
    return found


def test_every_daemon_thread_is_named_and_its_owner_is_in_the_design_table():
    """docs/design.md's table of processes and threads names who starts and who ends each
    daemon thread: a new one without a name, or missing there, fails here."""
    threads = _daemon_threads()
    assert len(threads) >= 10, threads  # the walk found the product's threads
    unnamed = [where for name, where in threads.items() if name.startswith("<unnamed>")]
    assert not unnamed, f"daemon threads without a name: {unnamed}"
    table = (ROOT / "docs" / "design.md").read_text().split("Who starts and ends what")[1]
    missing = {name: where for name, where in threads.items() if f"`{name}" not in table}
    assert not missing, f"daemon threads missing from docs/design.md's table: {missing}"


def test_a_group_left_by_its_ended_leader_is_still_stopped(tmp_path):
    """A trial that died leaves its torchrun in its group: the stop kills the group still."""
    pid_file = tmp_path / "pid"
    code = (
        "import subprocess, sys; from pathlib import Path; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"Path({str(pid_file)!r}).write_text(str(p.pid))"
    )
    child = children.start("test", [sys.executable, "-c", code], session=True)
    left = int(_wait_for(pid_file))
    child.proc.wait(30)
    assert not _gone(left, 0) and os.getpgid(left) == child.pid
    children.stop(child)
    assert _gone(left, 10), "the group's last member outlived the stop"
