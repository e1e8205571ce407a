# Sourced by the batch scripts of deploy/slurm/ (bash): what a job says about itself at the top
# of its output: where its records go, which node each srun task number is, its time left.
#
# A job reaches the servers with what the submitting environment holds (sbatch passes it to
# the script, srun to every task: SLURM's default --export=ALL); never put the values into a
# script:
#   PREFECT_API_URL           Prefect's server (http://node3:4200/api); without it each `enn`
#                             starts a temporary API of its own, which no server sees
#   PREFECT_API_AUTH_STRING   the user:password that server was started with
#                             (PREFECT_SERVER_API_AUTH_STRING)
#   MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD
#                             the tracking server's user (its URL: tracking.uri in params.yaml)
#   PGPASSWORD                a PostgreSQL study (tune.storage), or ~/.pgpass on every node

enn_servers() {   # $1: the script's name
  local api=${PREFECT_API_URL:-}
  if [ -n "$api" ]; then
    # a user or token in the URL stays out of the output
    api=$(printf '%s' "$api" | sed -E 's#//[^/@]*@#//#')
    echo "$1: Prefect API $api (PREFECT_API_URL): the job's flow runs show there, named with their host"
  else
    echo "$1: no PREFECT_API_URL: each enn starts a temporary Prefect API of its own (no server sees this job's flow runs); export PREFECT_API_URL and PREFECT_API_AUTH_STRING before sbatch"
  fi
}

enn_task_hosts() {   # srun --label's task numbers (one task per node): "0: node1, 1: node2"
  scontrol show hostnames "$SLURM_JOB_NODELIST" | awk '{printf "%s%d: %s", (NR > 1 ? ", " : ""), NR - 1, $0}'
}

enn_time_left() {   # seconds left of the job's time limit; nothing when it has none
  local left d=0 h=0 m=0 sec
  local -a f
  left=$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null) || return 0
  case "$left" in "" | UNLIMITED | NOT_SET | INVALID) return 0 ;; esac
  if [[ $left == *-* ]]; then d=${left%%-*}; left=${left#*-}; fi   # days-hours:minutes:seconds
  IFS=: read -r -a f <<<"$left"
  sec=${f[-1]}
  if [ "${#f[@]}" -ge 2 ]; then m=${f[-2]}; fi
  if [ "${#f[@]}" -ge 3 ]; then h=${f[-3]}; fi
  echo $((10#$d * 86400 + 10#$h * 3600 + 10#$m * 60 + 10#$sec))
}
