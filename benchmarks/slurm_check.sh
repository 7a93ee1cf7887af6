#!/usr/bin/env bash
# commwire under Slurm, on a one-node cluster built on this machine (Debian's slurm-wlm).
#
#   sudo bash benchmarks/slurm_check.sh            # from a checkout, with commwire's venv active
#
# Needs root (it installs slurm-wlm and munge with apt if they are missing, writes
# /etc/slurm/slurm.conf unless one exists, and starts munged, slurmctld and slurmd); the
# daemons it started are stopped when it ends. MpiDefault=none, as on many clusters: srun
# then starts every task as a world of its own unless told the MPI's plugin.
# Prints one line per check, PASS or FAIL, and exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
python -c "import commwire" || { echo "activate the environment commwire is installed in first" >&2; exit 2; }
if ! command -v slurmctld >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null || exit 2
fi
node="$(hostname -s)"
if [ ! -f /etc/slurm/slurm.conf ]; then
    cat > /etc/slurm/slurm.conf <<EOF
ClusterName=commwire-check
SlurmctldHost=$node
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
$(slurmd -C | head -1)
PartitionName=check Nodes=$node Default=YES MaxTime=INFINITE OverSubscribe=FORCE State=UP
EOF
fi
mkdir -p /run/munge /run/slurm /var/spool/slurmctld /var/spool/slurmd
chown munge:munge /run/munge
started=()
pgrep -x munged >/dev/null || { runuser -u munge -- /usr/sbin/munged && started+=(munged); }
pgrep -x slurmctld >/dev/null || { slurmctld && started+=(slurmctld); }
pgrep -x slurmd >/dev/null || { slurmd && started+=(slurmd); }
trap 'for d in "${started[@]}"; do pkill -x "$d"; done' EXIT
for _ in $(seq 30); do sinfo -h -o %t 2>/dev/null | grep -q idle && break; sleep 1; done

work="$(mktemp -d)"
cat > "$work/sum.py" <<'EOF'
import numpy as np, commwire as cw
cw.init()
print(f"rank {cw.rank()} of {cw.size()} sum {cw.allreduce(np.ones(2) * (cw.rank() + 1))[0]:g}", flush=True)
EOF
failed=0
check() {  # check NAME EXPECTED-REGEX COMMAND...: PASS if the command's output matches
    local name="$1" want="$2"; shift 2
    local out; out="$(timeout 300 "$@" 2>&1)"
    if grep -Eq "$want" <<<"$out"; then echo "PASS  $name"; else echo "FAIL  $name"; failed=1; tail -5 <<<"$out" | sed 's/^/      /'; fi
}
vendor="$(python -c 'import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print(MPI.get_vendor()[0])')"
plugin="$(python -c "from commwire.comm.rankenv import SLURM_MPI_PLUGINS as p; print(p.get('$vendor', ''))")"
check "srun --mpi=$plugin: one 2-rank world" "rank 1 of 2 sum 3" srun -n 2 --mpi="$plugin" python "$work/sum.py"
check "srun --mpi=none: refused at init, naming --mpi=$plugin" "srun --mpi=$plugin" srun -n 2 --mpi=none python "$work/sum.py"
check "commwire run in an allocation passes --mpi=$plugin" "rank 1 of 2 sum 3" salloc -n 2 commwire run -np 2 python "$work/sum.py"
check "a batch script's own process runs alone" "rank 0 of 1 sum 1" salloc -n 2 python "$work/sum.py"
check "a killed rank ends the step; the elastic job resets and finishes" '"event": "done", "step": 16, "size": 3' \
    bash -c "salloc -n 3 -O commwire run -np 3 --min-np 2 --max-np 3 -H $node:3 --blacklist-cooldown-range 1 2 \
             python -m commwire.bench.elastic_job --log $work/train.jsonl --steps 16 --commit-every 5 --die-at 7 \
             --die-rank 1 >/dev/null; tail -1 $work/train.jsonl"
check "launchers/slurm.sbatch: 2 ranks, timeline written" "rank 1 of 2 sum 3" \
    bash -c "cd $work && VENV_DIR='${VIRTUAL_ENV:-}' sbatch -W -n 2 --ntasks-per-node=2 --nodes=1 --cpus-per-task=1 \
             $PWD/launchers/slurm.sbatch python $work/sum.py >/dev/null; cat $work/commwire-*.out; ls $work/*.trace.json"
rm -rf "$work"
exit "$failed"
