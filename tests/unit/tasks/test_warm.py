"""While distributed-train's workers run, the stages after it have their heavy imports made in
the background: only those of the stages that will run, for the formats configured."""

from __future__ import annotations

import subprocess
import sys

from enn_core.stages import COLLAPSE_CHECK, EXPORT, PREDICT, VALIDATE
from tasks.warm import later_imports
from tests.fixtures.project import ROOT


def test_the_later_stages_imports_are_those_of_the_stages_that_will_run():
    """validate's scikit-learn; export imports its own modules as it runs."""
    assert later_imports((VALIDATE, PREDICT, COLLAPSE_CHECK, EXPORT)) == [
        "sklearn.linear_model",
        "sklearn.ensemble",
    ]
    assert later_imports((PREDICT, COLLAPSE_CHECK, EXPORT)) == []


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    """`code` run in a fresh interpreter of this checkout (this one has the modules already)."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )


def test_the_warm_thread_imports_them_and_matplotlib_headless():
    """In a fresh interpreter (this one has them already): after the thread, the modules are
    loaded and pyplot is on Agg (no display is ever opened)."""
    code = (
        "import sys\n"
        "from enn_core.stages import VALIDATE, EXPORT\n"
        "from tasks.warm import warm_later\n"
        "warm_later((VALIDATE, EXPORT), plots=True).join()\n"
        "import matplotlib\n"
        "from mlflow.utils import requirements_utils as r\n"
        "print(sorted(m for m in ('sklearn.ensemble', 'torch.export._trace',"
        " 'matplotlib.pyplot') if m in sys.modules), matplotlib.get_backend().lower(),"
        " r._MODULES_TO_PACKAGES is not None)\n"
    )
    out = _fresh(code)
    # and MLflow's map of installed packages is built (export's model logging reads it), quietly
    assert out.stdout.split("\n")[0] == ("['matplotlib.pyplot', 'sklearn.ensemble'] agg True"), (
        out.stdout + out.stderr
    )
    assert "mismatch" not in out.stderr.lower(), out.stderr


def test_only_the_warm_thread_runs_at_idle_priority():
    """The idle class is set on the calling thread: the process's other threads (the flow, the
    watchdog) keep their priority. In a fresh interpreter, so that this one stays as it is."""
    code = (
        "import os, threading\n"
        "from tasks.warm import idle_priority\n"
        "seen = {}\n"
        "def run():\n"
        "    seen['set'] = idle_priority()\n"
        "    seen['thread'] = os.sched_getscheduler(0)\n"
        "t = threading.Thread(target=run); t.start(); t.join()\n"
        "print(seen['set'], seen['thread'] == os.SCHED_IDLE,"
        " os.sched_getscheduler(0) == os.SCHED_OTHER)\n"
    )
    out = _fresh(code)
    assert out.stdout.split() == ["True", "True", "True"], out.stdout + out.stderr


def test_the_imports_end_with_distributed_train():
    """The thread's owner is distributed-train: when the stage ends, the imports are done and
    the thread is gone, so their memory is that stage's at every table size (before: they
    finished in whichever stage the clock reached, and the scale test's per-stage peaks moved
    by 40 MiB between two runs). In a fresh interpreter, which has not imported them yet."""
    code = (
        "import sys, threading\n"
        "from enn_core.stages import TRAINING, DISTRIBUTED_TRAIN\n"
        "from tasks.warm import after_stage, before_stage\n"
        "before_stage(DISTRIBUTED_TRAIN, TRAINING, plots=False)\n"
        "after_stage(DISTRIBUTED_TRAIN)\n"
        "print('sklearn.ensemble' in sys.modules,"
        " [t.name for t in threading.enumerate() if t.name == 'enn-warm-imports'])\n"
    )
    out = _fresh(code)
    assert out.stdout.split("\n")[0] == "True []", out.stdout + out.stderr
