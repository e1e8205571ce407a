"""What `enn run` imports while its temporary Prefect API starts (issue 43): the modules the run
will import anyway, never more. `--until stage-data` imports no torch; a tracking server needs
no local store; tracking off imports no MLflow."""

from __future__ import annotations

import json
import subprocess
import sys

from enn_core.config import load_config
from flows.commands import flow_imports
from tests.fixtures.project import ROOT

TRAIN, PREDICT, STORE = "enn_core.train.stage", "enn_core.predict.stage", "sqlalchemy_store"


def test_the_imports_follow_the_stages_of_the_run_and_the_store_it_uses(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(None, [])
    whole = flow_imports("training", cfg)
    assert whole[0] == "flows.training" and TRAIN in whole and PREDICT in whole
    assert any(n.endswith(STORE) for n in whole)  # the default store: SQLite under work/
    assert not {TRAIN, PREDICT} & set(flow_imports("training", cfg, "stage-data"))
    assert TRAIN in flow_imports("training", cfg, "distributed-train")
    assert PREDICT not in flow_imports("training", cfg, "distributed-train")
    prediction = flow_imports("prediction", cfg)
    assert prediction[0] == "flows.prediction" and TRAIN not in prediction and PREDICT in prediction
    assert flow_imports("tuning", cfg)[0] == "flows.tuning"
    server = load_config(None, ["tracking.uri=http://127.0.0.1:5000"])
    assert not any(n.endswith(STORE) for n in flow_imports("training", server))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.invalid")  # the tracker's
    assert not any(n.endswith(STORE) for n in flow_imports("training", cfg))
    off = load_config(None, ["tracking.enabled=false"])
    assert not any(n.startswith("mlflow") for n in flow_imports("training", off))


def test_a_run_until_stage_data_imports_no_torch_while_the_api_starts():
    """In a fresh interpreter, as `enn run --until stage-data` calls it."""
    code = (
        "import json, sys\n"
        "from enn_core.config import load_config\n"
        "from flows.commands import _import_flow\n"
        "_import_flow('training', load_config(None, ['tracking.enabled=false']), 'stage-data')\n"
        "print(json.dumps(['torch' in sys.modules, 'flows.training' in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, True], out.stdout
