#!/usr/bin/env bash
# The main job: install what is needed, then run the whole training flow (seven stages) on
# generated demo data with the embedded defaults: Prefect's local API on SQLite, MLflow on
# SQLite and DVC, all under work/ in this checkout; then the prediction flow on new data with
# the registered champion model. Extra arguments go to `enn run --flow both`: --set KEY=VALUE and
# --config reach the training flow; --until is refused there (it stops one flow).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# 1. the training flow: seven stages; the exported model is registered in MLflow
# 2. the prediction flow on new (generated) data with the registered champion
# in one process and one Prefect API (as `enn run`, then `enn run --flow prediction`)
.venv/bin/enn run --flow both "$@"
echo
echo "Done. Outputs: outputs/<stage>/ and prediction/outputs/<stage>/; metrics: .venv/bin/dvc metrics show;"
echo "runs in the MLflow UI: .venv/bin/enn ui   (http://127.0.0.1:5000)"
