"""Offline: a whole pipeline run makes no connection or DNS lookup to a non-loopback address,
in any process it starts (the flow, the temporary Prefect server, workers, dvc and the stage
commands it runs). Every Python process loads tests/e2e/netguard/sitecustomize.py, which
refuses and records such calls and leaves a `watched-<pid>.json` marker; a poller records the
process tree, so the test proves each child it saw was watched.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import psutil
import pytest

from tests.conftest import make_project

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
GUARD = Path(__file__).parent / "netguard"
NON_PYTHON_OK = {"sh", "bash", "git", "dash", "uname", "ldconfig", "gcc", "cc"}


class TreeWatcher:
    """Polls the descendants of this process and remembers every one it saw."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[str, list[str]]] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    def _loop(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(0.1):
            for p in me.children(recursive=True):
                try:
                    self.seen.setdefault(p.pid, (p.name(), p.cmdline()))
                except psutil.Error:
                    continue


def test_pipeline_run_is_offline_in_every_process(tmp_path):
    guard_dir = tmp_path / "netguard-out"
    project = make_project(tmp_path / "proj", tmp_path / "prefect-home")
    project.env["PYTHONPATH"] = f"{GUARD}:{project.root}"
    project.env["ENN_NETGUARD_DIR"] = str(guard_dir)
    project.set_params(["runtime.world_size=2"])
    with TreeWatcher() as tree:
        project.run("enn", "run", timeout=1100)
        project.set_params(["collapse.max_flat_fraction=0.49"])  # a param change: dvc re-runs collapse-check
        out = project.run("dvc", "repro", timeout=600)
        assert "Running stage 'collapse_check'" in out.stdout
    violations = [json.loads(p.read_text()) for p in guard_dir.glob("violation-*.json")]
    assert not violations, "non-loopback network use:\n" + "\n".join(
        f"{v['kind']} {v['target']} in {' '.join(v['argv'])[:120]}\n{''.join(v['stack'][-4:])}" for v in violations)

    watched = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in guard_dir.glob("watched-*.json")}
    unwatched = []
    for pid, (name, cmd) in tree.seen.items():
        is_python = "python" in name or (cmd and "python" in Path(cmd[0]).name) or name in ("enn", "dvc")
        if is_python and pid not in watched:
            unwatched.append(f"{pid} {' '.join(cmd)[:150]}")
        elif not is_python and name not in NON_PYTHON_OK:
            unwatched.append(f"{pid} (not python: {name}) {' '.join(cmd)[:150]}")
    assert not unwatched, "child processes the guard did not watch:\n" + "\n".join(unwatched)

    cmds = [" ".join(w["argv"]) for w in watched.values()]
    assert any("enn" in c and " run" in c for c in cmds), "the flow process"
    assert any("prefect" in c or "uvicorn" in c for c in cmds), "the temporary Prefect server"
    assert any("multiprocessing" in c or "spawn" in c for c in cmds), "worker processes"
    assert any(c.split(" ")[0].endswith("dvc") or " -m dvc" in c for c in cmds), "dvc"
    assert any("collapse-check" in c for c in cmds), "the stage command dvc ran"
    assert len(watched) >= 5
