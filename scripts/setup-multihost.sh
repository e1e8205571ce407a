#!/usr/bin/env bash
# What the multi-host tier (tests/multihost/) needs besides the project's .venv: PostgreSQL's
# server binaries (initdb, pg_ctl; Debian's postgresql package), iproute2 and SLURM (Debian's
# slurmctld, slurmd, slurm-client and munge: tests/fixtures/slurm.py), installed with
# apt-get when they are missing and this runs as root. Not root, or no apt-get: it says what
# is missing and the tier's tests skip with that reason (they must not skip on CI).
set -uo pipefail
have_pg() { ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1; }
missing=()
have_pg || missing+=(postgresql)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v nsenter >/dev/null 2>&1 || missing+=(util-linux)
for pkg in slurmctld slurmd munge; do
  command -v "$pkg" >/dev/null 2>&1 || [ -x "/usr/sbin/$pkg" ] || missing+=("$pkg")
done
command -v sbatch >/dev/null 2>&1 || missing+=(slurm-client)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup-multihost: installing ${missing[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  before=$(pg_lsclusters -h 2>/dev/null | awk '{print $1, $2}')
  apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || echo "setup-multihost: apt-get could not install ${missing[*]}; the multi-host tests will say so" >&2
  # the SLURM and munge packages' services are not started here (no systemd in a container;
  # where there is one, policy-rc.d decides): the tests start their own daemons in the hosts
  # Debian's package starts a cluster of its own (the tests start private ones): stop that
  # one only, never a cluster this machine ran before
  if [[ " ${missing[*]} " == *" postgresql "* ]] && command -v pg_ctlcluster >/dev/null 2>&1; then
    pg_lsclusters -h 2>/dev/null | awk '{print $1, $2}' | while read -r v c; do
      grep -qxF "$v $c" <<<"$before" || pg_ctlcluster "$v" "$c" stop || true
    done
  fi
else
  echo "setup-multihost: missing ${missing[*]}; install them (as root: apt-get install ${missing[*]})" >&2
fi
exit 0
