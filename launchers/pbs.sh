#!/bin/bash
# PBS / Torque script: 2 nodes x 4 ranks of a commwire job.
#
#   qsub -v ARGS="python examples/train_horovod.py --steps 200" launchers/pbs.sh
#
# PBS lists the allocated slots in $PBS_NODEFILE (one line per slot); commwire
# passes it to the launcher as the hostfile (Hydra's -f / Open MPI's --hostfile
# both accept one host per line).
#PBS -N commwire
#PBS -l select=2:ncpus=4:mpiprocs=4
#PBS -l walltime=00:30:00
#PBS -j oe

set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"
source "${VENV_DIR:-$HOME/.venvs/commwire}/bin/activate"

NP=$(wc -l < "$PBS_NODEFILE")
commwire info
# shellcheck disable=SC2086 # ARGS is a command line on purpose
commwire run -np "$NP" --hostfile "$PBS_NODEFILE" -x OMP_NUM_THREADS=1 $ARGS
