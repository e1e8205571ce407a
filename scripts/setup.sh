#!/usr/bin/env bash
# Create .venv and install the project with its pinned constraints. Idempotent: it re-installs
# only when pyproject.toml or constraints.txt changed. Needs only python3.11 with venv and pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if ! "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
  echo "error: Python 3.11 is required (found $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.enn-install-stamp
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing the project and its pinned dependencies into .venv (a few minutes the first time)"
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade "pip>=24"
  # torch is pinned to 2.13.0 (the CPU build on this machine); constraints.txt pins the rest.
  # setuptools' "Editable installation" box warns that folders named like the packages in the
  # working directory take precedence at import: here they are the very folders the editable
  # install points at, so the box says nothing to act on (it printed in the Quick start).
  PYTHONWARNINGS="ignore:Editable installation" \
    .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test,postgres]"
  echo "$want" > "$stamp"
fi
# Migrated, empty Prefect and MLflow databases for new work directories (tasks/store_seeds.py):
# the first `enn run` then does not wait for their migrations. Once per tool version.
.venv/bin/python -m tasks.store_seeds ||
  echo "setup: warning: no seed databases; the first enn run migrates its own (slower)" >&2
# DVC's site cache inside work/, as an absolute path (a relative one would follow the current
# directory, e.g. prediction/), for the training project and the prediction pipeline's own
# DVC project (prediction/.dvc); .dvc/config.local is not committed.
root=$PWD
.venv/bin/dvc config --local core.site_cache_dir "$root/work/dvc-site-cache" >/dev/null
(cd prediction && "$root/.venv/bin/dvc" config --local core.site_cache_dir "$root/work/dvc-site-cache" >/dev/null)
