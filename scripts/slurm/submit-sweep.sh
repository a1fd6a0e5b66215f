#!/bin/bash
# Submit a sweep's workers (scripts/slurm/sweep-array.sbatch as a job array) and its final report
# (scripts/slurm/sweep-report.sbatch, started once every array task has ended: --dependency=afterany).
# Arguments are sbatch options for the array (--array=0-7, --partition, --time, --gpus-per-node ...);
# RL_SWEEP, RL_STORAGE and RL_RUN_DIR must be exported (docs/sweeps.md, "Run a sweep on a cluster"). Prints
# the two job ids.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
for v in RL_SWEEP RL_STORAGE RL_RUN_DIR; do
  if [ -z "${!v:-}" ]; then
    echo "submit-sweep.sh: export $v before submitting (docs/sweeps.md, 'Run a sweep on a cluster')." >&2
    exit 2
  fi
done
case " $* " in
  *" --array="* | *" -a "* | *" --array "*) ;;
  *) echo "submit-sweep.sh: give the workers as --array=0-N (one worker per array task)." >&2; exit 2 ;;
esac
array=$(sbatch --parsable "$@" "$here/sweep-array.sbatch")
array=${array%%;*}  # "id;cluster" on a federation
report=$(sbatch --parsable --dependency="afterany:$array" --kill-on-invalid-dep=yes "$here/sweep-report.sbatch")
echo "workers: job array $array; final report: job ${report%%;*} (after the array)"
