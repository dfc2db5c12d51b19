#!/usr/bin/env bash
# The first thing to run on a machine with a GPU (one H100: under 8 minutes, by the plan printed first):
#   1. the CUDA tests (pytest -m cuda): pinned memory-tier slots, the staging buffer, GPU-side waits,
#      restore onto the device, a refused registration leaving no CUDA error;
#   2. kill and resume on the GPU, from disk and from the memory tier, bit for bit
#      (tests/integration/test_gpu_resume.py, part of 1);
#   3. the training-loop benchmark (python -m benchmarks.gpu), three runs, each mode against its own
#      run's "none":
#      a. the 1B-parameter model (12.5 GB of state), fused AdamW: the memory-tier modes and the
#         default, with the hardware's limits and the memory tier's copy;
#      b. the same model with torch's default (non-fused) AdamW, whose step counters are CPU tensors:
#         the fence must not wait for the device-to-host copy there;
#      c. a 4-layer model (about 4 GB of state) for the disk-bound modes (policy=10, DCP), which do
#         not need 1B parameters to show what they cost.
#   Each mode prints its step time measured on the training stream beside the stall checkfreq's
#   events saw.
#
# Runs from a plain copy of the repository, nothing installed: bash benchmarks/gpu_check.sh
# It needs python3 with torch (CUDA), safetensors, numpy, xxhash, fsspec, typer, rich, pytest, psutil.
# Figures go to $OUT if set, else ./gpu-check: versions.txt, plan.txt, pytest-cuda.txt,
# gpu-benchmark-{full,adamw,small}.{md,json,log} (the JSON written after every mode, so a run cut
# short keeps what it measured), summary.txt. docs/performance.md ("GPU") says which figures go where.
# Everything this script puts in /dev/shm is under one directory of its own, removed on any exit.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
PY="${PYTHON:-python3}"
out="${OUT:-$PWD/gpu-check}"
mkdir -p "$out"
start=$(date +%s)

# Nothing can be installed on the lent machine: say at once what its python lacks, before any device time
missing=$("$PY" -c '
import importlib.util
need = ["torch", "safetensors", "numpy", "xxhash", "fsspec", "typer", "rich", "pytest", "psutil"]
print(" ".join(name for name in need if importlib.util.find_spec(name) is None))
')
if [ -n "$missing" ]; then
    echo "gpu_check: $PY lacks $missing (checkfreq's and its tests' dependencies); nothing was run" | tee "$out/summary.txt"
    exit 2
fi

shm_root="${GPU_CHECK_SHM:-/dev/shm}"
export CHECKFREQ_SHM_DIR="$shm_root/checkfreq-gpu-check-$$"
mkdir -p "$CHECKFREQ_SHM_DIR"
marker="$(mktemp)"
cleanup() {
    rm -rf "$CHECKFREQ_SHM_DIR"
    # a test killed by its timeout leaves its private region directory behind: those made by this run
    find "$shm_root" -maxdepth 1 -name 'checkfreq-test-*' -newer "$marker" -exec rm -rf {} + 2>/dev/null
    rm -f "$marker"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The plan, in seconds on one H100 (PCIe gen5, ~55 GB/s pinned D2H, a local NVMe at >= 2 GB/s), each
# part cut at its limit by timeout:
#   tests: the CUDA tests (about 20 of them; the kill-and-resume runs the longest)        150
#   a. 1B fused: start and 3 warm-up steps 25, limits 10, memory tier copy 25 (region made,
#      2 slots registered, 3 snapshots sealed), 5 modes x 20+3 steps of ~0.3 s = 35, the
#      memory modes' ends (restore from memory 3 s each, from disk once 8 s, persist at
#      close 7 s each) 40, the default's persists 15: 165                               170
#   b. 1B non-fused AdamW: start 25, 3 modes x 23 steps of ~0.33 s = 23, ends 30: 78      90
#   c. 4 layers, fused: start 10, 3 modes x 23 steps of ~0.1 s = 7, persists and DCP 25:
#      42                                                                                50
#   versions, summaries, clean-up                                                        20
tests_limit=150; full_limit=170; adamw_limit=90; small_limit=50; rest=20
plan=$(( tests_limit + full_limit + adamw_limit + small_limit + rest ))
{
    echo "plan: tests $tests_limit s + 1B fused $full_limit s + 1B non-fused AdamW $adamw_limit s + 4 layers $small_limit s + the rest $rest s = $plan s (8 minutes: 480 s)"
    [ "$plan" -le 480 ] && echo "the plan fits 8 minutes" || echo "THE PLAN DOES NOT FIT 8 MINUTES"
} | tee "$out/plan.txt"

steps=(--steps 20 --warmup 3)
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    if [ "${GPU_CHECK_CPU:-0}" != 1 ]; then
        echo "no CUDA device: nothing to check here (GPU_CHECK_CPU=1 rehearses the script on the CPU)" \
            | tee "$out/summary.txt"
        exit 2
    fi
    steps=(--tiny --device cpu --steps 5 --warmup 1)  # a rehearsal: the CUDA tests are skipped
fi
{
    "$PY" -c "import torch, sys; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda); print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
    nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.max,pcie.link.width.max,driver_version --format=csv 2>/dev/null
    df -h "$shm_root" "${TMPDIR:-/tmp}" 2>/dev/null
    free -g 2>/dev/null
} > "$out/versions.txt" 2>&1
cat "$out/versions.txt"

echo "== 1-2. CUDA tests and kill-and-resume on the GPU (at most $tests_limit s)"
tests_start=$(date +%s)
timeout "$tests_limit" "$PY" -m pytest -q -m cuda -p no:cacheprovider \
    tests/unit/api/test_checkpointer.py tests/unit/integrations/test_loss.py \
    tests/unit/storage/test_host_pinning.py tests/unit/pipeline/test_staging.py \
    tests/integration/test_gpu_resume.py 2>&1 | tee "$out/pytest-cuda.txt"
tests_rc=${PIPESTATUS[0]}
tests_s=$(( $(date +%s) - tests_start ))

bench() {  # name, limit, benchmark arguments...
    local name=$1 limit=$2
    shift 2
    echo "== 3. benchmark: $name (at most $limit s)"
    local t0=$(date +%s)
    timeout "$limit" "$PY" -m benchmarks.gpu "${steps[@]}" "$@" --json "$out/gpu-benchmark-$name.json" 2>&1 \
        | tee "$out/gpu-benchmark-$name.log"
    local rc=${PIPESTATUS[0]}
    sed -n '/^[^|]*GB of state/,$p' "$out/gpu-benchmark-$name.log" > "$out/gpu-benchmark-$name.md"
    echo "benchmark $name: exit $rc in $(( $(date +%s) - t0 )) s (124: cut short; the JSON holds the modes finished)" \
        >> "$out/summary.parts"
    [ "$rc" -eq 0 ]
}
: > "$out/summary.parts"
bench_rc=0
bench full "$full_limit" --modes none,memory=1,memory=True,default,memory=2+gpu_staging || bench_rc=1
bench adamw "$adamw_limit" --optimizer adamw --no-limits --modes none,memory=1,default || bench_rc=1
bench small "$small_limit" --size small --no-limits --modes "none,policy=10,DCP async_save/10" || bench_rc=1

{
    echo "cuda tests: exit $tests_rc in ${tests_s} s"
    cat "$out/summary.parts"
    echo "total: $(( $(date +%s) - start )) s (plan: $plan s)"
} | tee "$out/summary.txt"
rm -f "$out/summary.parts"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
