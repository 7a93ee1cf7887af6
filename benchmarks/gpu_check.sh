#!/usr/bin/env bash
# One prepared GPU check of commwire, for a fresh GPU machine that received this working tree.
#
#   bash benchmarks/gpu_check.sh          # on the GPU machine; the report lands in $OUT (or ./gpu_check_out)
#   bash benchmarks/gpu_check.sh --cpu    # dry run of every stage on a CPU-only machine (small sizes)
#
# Stages, each with its own timeout inside one deadline (CHECK_BUDGET seconds, default 460: the whole
# run stays under 8 minutes on one H200); a stage that fails or times out is recorded and the next runs:
#   setup     the machine's python3 as it is (its CUDA torch and cupy), commwire from this tree on
#             PYTHONPATH (no build, no network), and only the missing pieces installed into a folder of
#             their own: from PyPI when it answers, else from wheels carried in .whl/
#             (or $COMMWIRE_WHEELS); pyproject's extras name them: cupy-cuda12x/-cuda13x ([cuda12] /
#             [cuda13], chosen from torch's CUDA version), mpich ([mpich]), a CUDA torch.
#   ranks     mpiexec -n 2 must make one 2-rank job (another MPI's mpiexec makes two 1-rank jobs that pass
#             vacuously); numba compiles the codec kernels once into NUMBA_CACHE_DIR for the later stages.
#   probe     does MPI take device buffers? MPIX_Query_cuda_support, then a real Allreduce of a CUDA
#             tensor in a subprocess (a non-CUDA-aware MPI crashes it). Sets COMMWIRE_GPU_CUDA_AWARE.
#   tests-n1  python -m pytest tests/gpu -rs (one rank)
#   tests-n2  mpiexec -n 2 python -m pytest tests/gpu (two ranks sharing the GPU)
#   nccl      tests/gpu/test_nccl.py on one rank per GPU: the torch transport on NCCL (collectives against
#             host references, the compressed all-reduce with payloads over NCCL, the DDP hook on an NCCL group)
#   codecs    encode/decode GB/s of every codec vs a device-to-device copy (benchmarks/gpu_bench.py)
#   allreduce FP32 vs compressed all-reduce of 64 MiB, 1 and 2 ranks on the local GPU(s)
#   optimizer DistributedOptimizer step vs torch DDP over NCCL, same model (1 rank; 2 ranks: DDP over gloo)
#   lab       only as root with ip, tc and network namespaces: 8 emulated hosts at 1 Gbit/s, FP32
#             all-reduce on 2/4/8 of them, then the cost model's calibration and validation
#             (benchmarks/calibrate.py); the lab is always taken down (trap), even on a timeout.
# Each pytest stage's note gives every rank's pass/skip/fail counts. On the GPU machine a skipped stage
# makes the run fail like a failed one. Then report.md and report.json (every stage's status, time and rows) and gpu_check.log (all output)
# are written to $OUT — three files, within what a device run brings back.
#
# Assumptions: Linux x86-64, bash, coreutils' timeout; python3 >= 3.10 with venv; an NVIDIA driver
# (nvidia-smi) for the GPU mode. No network is needed when python3 already has torch (CUDA), cupy,
# numba, ml_dtypes, mpi4py, click, pytest, scikit-learn, threadpoolctl (the workplace's CUDA image
# does) and an MPI library is there or carried: e.g. here, before the run,
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl mpich==5.0.2
# and carry .whl. MPICH's wheel is not CUDA-aware: the direct tier then skips (saying so) and the
# staged tier runs; a CUDA-aware MPI (an Open MPI wheel with OMPI_MCA_opal_cuda_support, a site MPI)
# is picked up when the probe passes.
set -uo pipefail

MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT_DIR=${OUT:-$REPO/gpu_check_out}
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d /tmp/commwire-gpu-check.XXXXXX)
LOG="$OUT_DIR/gpu_check.log"
STAGES="$WORK/stages.tsv"
: >"$LOG"
: >"$STAGES"
BUDGET=${CHECK_BUDGET:-460}
START=$(date +%s)
export NUMBA_CACHE_DIR=$WORK/numba-cache PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_opal_cuda_support=true
export COMMWIRE_TIMEOUT=${COMMWIRE_TIMEOUT:-120}  # a hung collective ends its stage with a report, not the run

log() {  # inside a stage the output already goes to the log
    local line="[gpu_check $(( $(date +%s) - START ))s] $*"
    if [ -n "${IN_STAGE:-}" ]; then echo "$line"; else echo "$line" | tee -a "$LOG"; fi
}

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# stage NAME MAX_SECONDS CMD...: run CMD (a command, or a function of this script) with a timeout of
# min(MAX, time left - 20 s) in its own process group, and record the outcome in $STAGES.
stage() {
    local name=$1 max=$2
    shift 2
    local room=$(( $(left) - 20 ))
    if [ "$room" -lt 15 ]; then
        printf '%s\tskipped\t0\tout of time (budget %ss)\n' "$name" "$BUDGET" >>"$STAGES"
        log "$name: skipped (out of time)"
        return 0
    fi
    local limit=$(( max < room ? max : room )) t0=$(date +%s) rc
    log "$name: start (timeout ${limit}s): $*"
    # bash -c runs exported functions too; timeout signals the whole group (mpiexec and its ranks)
    IN_STAGE=1 timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@" >"$WORK/$name.out" 2>&1
    rc=$?
    cat "$WORK/$name.out" >>"$LOG"
    local took=$(( $(date +%s) - t0 )) status=ok note
    # pytest's summary line of each rank ("12 passed, 3 skipped in 4.2s"), so that skips show
    note=$(grep -aoE '^=*[ ]*[0-9]+ (passed|failed|skipped|error)[^=]* in [0-9.]+s' "$WORK/$name.out" \
        | sed -E 's/^=+ *//; s/ in [0-9.]+s$//' | sort | uniq -c | sed -E 's/^ *([0-9]+) /\1 rank(s): /' | paste -sd';')
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=timeout; note="stopped after ${limit}s${note:+; $note}"
    elif [ "$rc" -ne 0 ]; then status=failed; note="exit $rc${note:+; $note}"; fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$took" "$note" >>"$STAGES"
    log "$name: $status ($took s) $note"
    return 0
}

skip_stage() { printf '%s\tskipped\t0\t%s\n' "$1" "$2" >>"$STAGES"; log "$1: skipped ($2)"; }

# ------------------------------------------------------------------ setup
# Writes the interpreter to use into $WORK/python and extra PATH/PYTHONPATH entries into $WORK/env.
setup() {
    if [ -n "${GPU_CHECK_PYTHON:-}" ]; then  # an environment that already has everything (e.g. the dry run)
        echo "$GPU_CHECK_PYTHON" >"$WORK/python"
        "$GPU_CHECK_PYTHON" -c 'import commwire, torch, numba; from mpi4py import MPI; print(MPI.Get_library_version()[:40])'
        return
    fi
    # The base interpreter itself, commwire from this tree and missing pieces in a folder of their own
    # on PYTHONPATH: a venv would hide the base site-packages from libraries that look for their CUDA
    # libraries there (cupy, numba find the nvidia-* wheels through site.getsitepackages()).
    local py=${GPU_CHECK_BASE_PYTHON:-python3} target=$WORK/site
    mkdir -p "$target"
    echo "export PYTHONPATH=\"$REPO:$target\${PYTHONPATH:+:\$PYTHONPATH}\" PATH=\"$target/bin:\$PATH\"" >"$WORK/env"
    echo "$py" >"$WORK/python"
    . "$WORK/env"
    local wheels=${COMMWIRE_WHEELS:-$REPO/.whl} online=0 cuda_major=13
    if timeout 20 "$py" -m pip download -q --no-deps -d "$WORK/probe" click >/dev/null 2>&1; then online=1; fi
    log "setup: PyPI reachable: $online; carried wheels: $(ls "$wheels"/*.whl 2>/dev/null | wc -l)"
    # cupy must match the CUDA that torch was built for (nvidia-smi shows the driver's maximum instead)
    cuda_major=$("$py" -c 'import torch; print((torch.version.cuda or "13").split(".")[0])' 2>/dev/null || echo 13)
    local need=()
    "$py" -c 'import numpy, ml_dtypes, numba, click' 2>/dev/null || need+=(numpy ml_dtypes numba click)
    "$py" -c 'import pytest' 2>/dev/null || need+=(pytest)
    "$py" -c 'import sklearn, threadpoolctl' 2>/dev/null || need+=(scikit-learn threadpoolctl)
    "$py" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null || need+=(torch)
    "$py" -c 'import cupy' 2>/dev/null || need+=("cupy-cuda$([ "$cuda_major" -ge 13 ] && echo 13 || echo 12)x")
    "$py" -c 'import mpi4py' 2>/dev/null || need+=(mpi4py)
    if ! "$py" -c 'from mpi4py import MPI' 2>/dev/null || ! command -v mpiexec >/dev/null; then need+=(mpich); fi
    if [ "${#need[@]}" -gt 0 ]; then
        log "setup: installing ${need[*]}"
        local into=(--target "$target")
        if ls "$wheels"/*.whl >/dev/null 2>&1; then
            "$py" -m pip install -q --no-index --find-links "$wheels" "${into[@]}" "${need[@]}" \
                || "$py" -m pip install -q --no-index --no-deps "${into[@]}" "$wheels"/*.whl || true
        fi
        if [ "$online" = 1 ]; then
            "$py" -m pip install -q "${into[@]}" "${need[@]}" || return 1
        fi
    fi
    "$py" -c 'import commwire, torch, numba, ml_dtypes; from mpi4py import MPI; print("commwire", commwire.__file__, "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available(), MPI.Get_library_version()[:60])'
    command -v mpiexec
}

# ------------------------------------------------------------------ ranks
ranks() {
    local sizes
    # Another MPI's mpiexec on the PATH starts N size-1 jobs that pass every test vacuously.
    sizes=$(timeout 60 mpiexec -n 2 "$PY" -c 'from mpi4py import MPI
c = MPI.COMM_WORLD
n = c.allreduce(1)
if c.Get_rank() == 0:
    print("ranks", c.Get_size(), n)' | paste -sd' ')
    log "ranks: mpiexec -n 2 gave: $sizes"
    [ "$sizes" = "ranks 2 2" ] || { log "ranks: mpiexec -n 2 did not make one 2-rank job (mpiexec from another MPI than mpi4py's?)"; return 1; }
    # numba compiles the codec kernels once, here, into a cache the later stages reuse
    "$PY" -c 'import numpy as np; from commwire.codecs import get
for spec in ("fp8-e4m3", "fp8-e5m2:block=128", "nvfp4", "ef+nvfp4:sr", "bf16", "hadamard+fp8-e4m3"):
    c = get(spec); c.decode(c.encode(np.ones(4096, np.float32)))
print("numba kernels compiled")'
}

# ------------------------------------------------------------------ probe
probe() {
    cat >"$WORK/probe.py" <<'EOF'
import sys
import torch
from mpi4py import MPI
x = torch.full((1024,), 2.0, device="cuda")
y = torch.empty_like(x)
torch.cuda.synchronize()
MPI.COMM_WORLD.Allreduce(x, y, MPI.SUM)
sys.exit(0 if float(y.sum()) == 2048.0 * MPI.COMM_WORLD.Get_size() else 3)
EOF
    local mpix
    mpix=$("$PY" -c 'from commwire.comm.runtime import query_mpi_cuda_support as q; from mpi4py import MPI; print(int(q()))' 2>/dev/null)
    log "probe: MPIX_Query_cuda_support = ${mpix:-?}"
    if timeout 45 mpiexec -n 1 "$PY" "$WORK/probe.py"; then
        echo 1 >"$WORK/cuda_aware"
        log "probe: a CUDA tensor went through MPI: CUDA-aware (direct tier runs)"
    else
        echo 0 >"$WORK/cuda_aware"
        log "probe: MPI did not take a CUDA buffer: not CUDA-aware (staged tier only)"
    fi
}

# ------------------------------------------------------------------ lab
lab_possible() {  # prints why not, and fails, when the lab stage cannot run here
    [ "$(id -u)" = 0 ] || { echo "needs root"; return 1; }
    command -v ip >/dev/null && command -v tc >/dev/null || { echo "needs ip and tc"; return 1; }
    [ "$(left)" -ge 130 ] || { echo "only $(left)s left of the budget (the lab stage needs 130)"; return 1; }
    local ns=cw-gpucheck-probe why=""
    ip netns add $ns 2>/dev/null || { echo "cannot create network namespaces"; return 1; }
    ip netns exec $ns ip link add cwp0 type veth peer name cwp1 2>/dev/null || why="cannot create veth pairs"
    [ -z "$why" ] && { ip netns exec $ns ip link add cwpbr type bridge 2>/dev/null || why="cannot create bridges"; }
    [ -z "$why" ] && { ip netns exec $ns ip link set cwp0 up && ip netns exec $ns tc qdisc add dev cwp0 root tbf \
        rate 1gbit burst 256kb latency 50ms 2>/dev/null || why="cannot shape links with tc tbf"; }
    ip netns del $ns
    [ -z "$why" ] || { echo "$why"; return 1; }
    if "$PY" -m commwire lab status 2>/dev/null | grep -q '^lab up'; then
        echo "a lab is already up here (someone else's?): not touching it"
        return 1
    fi
}

lab() {
    trap '"$PY" -m commwire lab down >>"$LOG" 2>&1' EXIT
    "$PY" -m commwire lab up --hosts 8 --bandwidth 1gbit || return 1
    local sizes=16,4K,64K,256K,1M,4M,16M
    for n in 2 4 8; do
        "$PY" -m commwire run -np "$n" --lab "$PY" -m commwire.bench.allreduce --sizes "$sizes" --repeats 3 \
            --budget 0.1 --json "$WORK/lab$n.json" || return 1
    done
    "$PY" benchmarks/calibrate.py --calibrate "$WORK"/lab{2,4,8}.json --fit-sizes 16,4K,256K,16M \
        --validate "$WORK"/lab{2,4,8}.json --cores "$(nproc)" | tee "$WORK/lab_validation.txt"
    "$PY" - "$WORK" <<'EOF'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
rows = [{"line": line} for line in (work / "lab_validation.txt").read_text().splitlines() if line.strip()]
(work / "parts" / "lab.json").write_text(json.dumps({"bench": "lab cost-model validation (8 hosts, 1 Gbit/s)",
                                                     "rows": rows}))
EOF
}

# ------------------------------------------------------------------ run
export REPO WORK LOG STAGES START BUDGET
export -f log left setup ranks probe lab
LAB_UP=0
trap '[ "$LAB_UP" = 1 ] && "$PY" -m commwire lab down >>"$LOG" 2>&1; rm -rf "$WORK"' EXIT
mkdir -p "$WORK/parts"
log "mode $MODE; repo $REPO; out $OUT_DIR; budget ${BUDGET}s"
stage setup 120 setup
PY=$(cat "$WORK/python" 2>/dev/null || echo python3)
[ -f "$WORK/env" ] && . "$WORK/env"
[ -n "${GPU_CHECK_PYTHON:-}" ] && export PATH="$(dirname "$GPU_CHECK_PYTHON"):$PATH"
export PY
stage ranks 150 ranks
if [ "$MODE" = gpu ]; then
    stage probe 60 probe
    CUDA_AWARE=$(cat "$WORK/cuda_aware" 2>/dev/null || echo 0)
    export COMMWIRE_GPU_CUDA_AWARE=$CUDA_AWARE COMMWIRE_CUDA_AWARE=$CUDA_AWARE
    MIB=64
    CODEC_MIB=64
    BENCH_CPU=()
    OPT=(--layers 8 --width 2048 --batch 64)
else
    export COMMWIRE_GPU_EMULATE=cpu COMMWIRE_GPU_CUDA_AWARE=0
    skip_stage probe "--cpu: no device buffers to probe"
    MIB=2
    CODEC_MIB=0.25
    BENCH_CPU=(--cpu)
    OPT=(--layers 2 --width 128 --batch 16)
fi
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts= -rs)
stage tests-n1 130 "${PYTEST[@]}" tests/gpu --ignore=tests/gpu/test_nccl.py
stage tests-n2 100 mpiexec -n 2 "${PYTEST[@]}" tests/gpu --ignore=tests/gpu/test_nccl.py
# The torch transport on NCCL: collectives against host references, the compressed all-reduce (payloads
# over NCCL), the DDP hook on an NCCL group. NCCL takes one GPU per rank: one rank per device.
GPUS=1
[ "$MODE" = gpu ] && GPUS=$("$PY" -c 'import torch; print(max(1, torch.cuda.device_count()))' 2>/dev/null || echo 1)
stage nccl 90 mpiexec -n "$GPUS" "${PYTEST[@]}" tests/gpu/test_nccl.py
BENCH=("$PY" benchmarks/gpu_bench.py)
stage codecs 40 "${BENCH[@]}" codecs "${BENCH_CPU[@]}" --mib "$CODEC_MIB" --budget 0.3 --json "$WORK/parts/codecs.json"
stage allreduce-n1 30 mpiexec -n 1 "${BENCH[@]}" allreduce "${BENCH_CPU[@]}" --mib "$MIB" --budget 0.5 \
    --json "$WORK/parts/allreduce_n1.json"
stage allreduce-n2 45 mpiexec -n 2 "${BENCH[@]}" allreduce "${BENCH_CPU[@]}" --mib "$MIB" --budget 0.5 \
    --json "$WORK/parts/allreduce_n2.json"
stage optimizer-n1 40 mpiexec -n 1 "${BENCH[@]}" optimizer "${BENCH_CPU[@]}" "${OPT[@]}" --budget 1 \
    --json "$WORK/parts/optimizer_n1.json"
stage optimizer-n2 40 mpiexec -n 2 "${BENCH[@]}" optimizer "${BENCH_CPU[@]}" "${OPT[@]}" --budget 1 \
    --json "$WORK/parts/optimizer_n2.json"
if [ "$MODE" = cpu ]; then
    skip_stage lab "not run with --cpu (8 emulated hosts need the GPU machine's 16 cores)"
elif WHY=$(lab_possible); then
    LAB_UP=1
    stage lab 90 lab
    "$PY" -m commwire lab down >>"$LOG" 2>&1  # also when a timeout ended the stage before its own trap
    LAB_UP=0
else
    skip_stage lab "$WHY"
fi

"$PY" benchmarks/gpu_bench.py report --out "$WORK/parts" --stages "$STAGES" >>"$LOG" 2>&1 \
    || log "report: failed (see the log)"
cp "$WORK/parts/report.md" "$WORK/parts/report.json" "$OUT_DIR/" 2>/dev/null
log "done in $(( $(date +%s) - START ))s: $OUT_DIR/report.md"
if [ "$MODE" = gpu ]; then
    ! grep -qE $'\t(failed|timeout|skipped)\t' "$STAGES"  # a skipped stage is not a pass
else
    ! grep -qE $'\t(failed|timeout)\t' "$STAGES"
fi
