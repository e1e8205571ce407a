#!/usr/bin/env bash
# Run every test tier that can run on CPU, each within its budget:
#   fast (unit) <= 6 min, slow (unit tests that fit real models) <= 10 min, distributed
#   (multi-process gloo) <= 25 min, multi-host (hosts in network namespaces, PostgreSQL-backed
#   servers, SLURM; needs root) <= 20 min, end-to-end <= 45 min.
# GPU tests are collected in the fast tier and skip cleanly without CUDA.
# Each test also has its own timeout (pytest-timeout), so nothing waits on a 30-minute default.
# The fast and end-to-end tiers run on two pytest-xdist workers (an end-to-end test waits on
# servers and child processes about half its time; `--dist loadfile` keeps a file's module
# fixture on one worker). The distributed tier stays on one: its hang tests time workers'
# heartbeats in seconds, which a second test's workers on the same two cores would blur. The
# multi-host tier too: one test bed (three hosts, one PostgreSQL) per session.
# Under CI=true a multi-host test that cannot run fails instead of skipping
# (tests/multihost/conftest.py), and the tier fails if any test of it was skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
bash scripts/setup-multihost.sh
export PYTHONUNBUFFERED=1 DO_NOT_TRACK=true TORCH_DISTRIBUTED_DEBUG=DETAIL
PYTEST=".venv/bin/python -m pytest"
status=0

tier() {  # name, budget seconds, per-test timeout, marker expression, pytest options
  local name=$1 budget=$2 per_test=$3 expr=$4
  shift 4
  echo "=== tier: $name (budget ${budget}s, per-test timeout ${per_test}s) ==="
  local t0=$SECONDS
  rm -f "work/test-$name.xml"  # each tier's per-test times (and the multi-host skip check) are this run's
  timeout --signal=TERM --kill-after=30 "$budget" $PYTEST -m "$expr" --timeout="$per_test" --durations=10 -q \
    --junitxml="work/test-$name.xml" "$@"
  local rc=$?
  local took=$((SECONDS - t0))
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "tier $name exceeded its budget of ${budget}s" >&2
    status=1
  elif [ $rc -eq 5 ]; then
    echo "tier $name: no tests selected"
  elif [ $rc -ne 0 ]; then
    status=1
  fi
  echo "=== tier: $name finished in ${took}s (rc=$rc) ==="
}

tier fast 360 120 "not slow and not distributed and not e2e and not multihost" -n 2
tier slow 600 300 "slow and not distributed and not e2e and not multihost" -n 2
tier distributed 1500 300 "distributed"
tier multihost 1500 600 "multihost" -rs
if [ "${CI:-}" = "true" ] && grep -q "<skipped" work/test-multihost.xml 2>/dev/null; then
  echo "tier multihost: tests were skipped; on CI every multi-host test must run" >&2
  status=1
fi
tier e2e 2700 900 "e2e" -n 2 --dist loadfile
exit $status
