"""While distributed-train's workers run, the stages after it have their heavy imports made in
the background: only those of the stages that will run, for the formats configured."""

from __future__ import annotations

import subprocess
import sys

from enn_core.config import load_config
from enn_core.stages import COLLAPSE_CHECK, EXPORT, PREDICT, VALIDATE
from tasks.warm import later_imports
from tests.fixtures.project import ROOT


def test_the_later_stages_imports_follow_the_config():
    cfg = load_config(None, [])
    both = later_imports(cfg, (VALIDATE, PREDICT, COLLAPSE_CHECK, EXPORT))
    assert "sklearn.ensemble" in both and "torch.export._trace" in both and "onnxruntime" in both
    pt2 = load_config(None, ["export.formats=[torch_export]", "export.required=[torch_export]"])
    assert "onnxruntime" not in later_imports(pt2, (EXPORT,))
    assert later_imports(cfg, (PREDICT, COLLAPSE_CHECK)) == []


def test_the_warm_thread_imports_them_and_matplotlib_headless():
    """In a fresh interpreter (this one has them already): after the thread, the modules are
    loaded and pyplot is on Agg (no display is ever opened)."""
    code = (
        "import sys\n"
        "from enn_core.config import load_config\n"
        "from enn_core.stages import VALIDATE, EXPORT\n"
        "from tasks.warm import warm_later\n"
        "warm_later(load_config(None, []), (VALIDATE, EXPORT), plots=True).join()\n"
        "import matplotlib\n"
        "print(sorted(m for m in ('sklearn.ensemble', 'torch.export._trace', 'onnxruntime',"
        " 'matplotlib.pyplot') if m in sys.modules), matplotlib.get_backend().lower())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.split("\n")[0] == (
        "['matplotlib.pyplot', 'onnxruntime', 'sklearn.ensemble', 'torch.export._trace'] agg"
    ), out.stdout + out.stderr
