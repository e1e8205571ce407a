#!/usr/bin/env bash
# The main job: install what is needed, then run the whole training flow (seven stages) on
# generated demo data with the embedded defaults: Prefect's local API on SQLite, MLflow on
# SQLite and DVC, all under work/ in this checkout. Extra arguments go to `enn run`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/enn run "$@"
echo
echo "Done. Outputs: outputs/<stage>/; metrics: .venv/bin/dvc metrics show;"
echo "runs: .venv/bin/mlflow ui --backend-store-uri sqlite:///$PWD/work/mlflow/mlflow.db --host 127.0.0.1"
