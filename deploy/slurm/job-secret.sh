# Sourced by the batch scripts of deploy/slurm/ (bash): the job secret, delivered by SLURM.
#
# The rendezvous, the workers' stores and the prediction parts authenticate with a secret only
# the job's processes know (docs/security.md). This makes one per run of the batch script on
# its host (32 random bytes, hex, mode 0600), and `sbcast` copies it to a host-local file on
# every node of the allocation, at a path no other user can guess: never on $ENN_SHARED, which
# other hosts (and their root) read. Only its path travels, in ENN_JOB_SECRET_FILE, which srun
# passes to the job's processes. The copies are removed from every node when the script ends
# (a node that died keeps its copy in its temporary folder until it is cleaned).
#
# A requeued job runs the script again and gets a new secret: prediction parts written under the
# old one are recomputed, never trusted.

enn_job_secret() {
  local tmp=${TMPDIR:-/tmp} src tag
  src=$(umask 077 && mktemp "$tmp/enn-secret.XXXXXXXX")
  head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$src"
  tag=$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')
  ENN_JOB_SECRET_FILE="$tmp/enn-job-$SLURM_JOB_ID-$tag.secret"
  if ! sbcast --force --preserve "$src" "$ENN_JOB_SECRET_FILE"; then
    rm -f "$src"
    echo "error: sbcast could not deliver the job secret to the nodes of job $SLURM_JOB_ID" \
      "($ENN_JOB_SECRET_FILE); check that $tmp exists on every node" >&2
    exit 1
  fi
  rm -f "$src"
  export ENN_JOB_SECRET_FILE
  trap enn_job_secret_remove EXIT
}

enn_job_secret_remove() {
  # bounded: after `scontrol requeue` the allocation is going away and a step may never start
  timeout 30 srun --ntasks-per-node=1 --kill-on-bad-exit=0 rm -f "$ENN_JOB_SECRET_FILE" \
    2>/dev/null || true
  rm -f "$ENN_JOB_SECRET_FILE"
}
