#!/usr/bin/env bash
# The first thing to run on a machine with a GPU (one H100: under 8 minutes):
#   1. the CUDA tests (pytest -m cuda): pinned memory-tier slots, the staging buffer, GPU-side waits,
#      restore onto the device;
#   2. kill and resume on the GPU, from disk and from the memory tier, bit for bit
#      (tests/integration/test_gpu_resume.py, part of 1);
#   3. the 1B-parameter training-loop benchmark (python -m benchmarks.gpu): every checkpointing mode
#      against no checkpointing, and the hardware's limits measured in the same run.
#
# Runs from a plain copy of the repository, nothing installed: bash benchmarks/gpu_check.sh
# It needs python3 with torch (CUDA), safetensors, numpy, xxhash, fsspec, typer, rich, pytest, psutil.
# Figures go to $OUT if set, else ./gpu-check: versions.txt, pytest-cuda.txt, gpu-benchmark.md and
# gpu-benchmark.json (written after every mode, so a run cut short keeps what it measured),
# summary.txt. docs/performance.md ("GPU") says which figures to copy where.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
PY="${PYTHON:-python3}"
out="${OUT:-$PWD/gpu-check}"
mkdir -p "$out"
budget="${GPU_CHECK_SECONDS:-450}"  # the whole script, so that it fits a 15-minute slot with the start
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }

bench_args=()
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    if [ "${GPU_CHECK_CPU:-0}" != 1 ]; then
        echo "no CUDA device: nothing to check here (GPU_CHECK_CPU=1 rehearses the script on the CPU)" \
            | tee "$out/summary.txt"
        exit 2
    fi
    bench_args=(--tiny --device cpu --steps 10 --warmup 1)  # a rehearsal: the CUDA tests are skipped
fi
{
    "$PY" -c "import torch, sys; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda); print(torch.cuda.get_device_name())"
    nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.max,pcie.link.width.max,driver_version --format=csv 2>/dev/null
    df -h /dev/shm "${TMPDIR:-/tmp}" 2>/dev/null
    free -g 2>/dev/null
} > "$out/versions.txt" 2>&1
cat "$out/versions.txt"

echo "== 1-2. CUDA tests and kill-and-resume on the GPU"
tests_start=$(date +%s)
timeout 180 "$PY" -m pytest -q -m cuda -p no:cacheprovider \
    tests/unit/api/test_checkpointer.py tests/unit/integrations/test_loss.py \
    tests/unit/storage/test_host_pinning.py tests/unit/pipeline/test_staging.py \
    tests/integration/test_gpu_resume.py 2>&1 | tee "$out/pytest-cuda.txt"
tests_rc=${PIPESTATUS[0]}
tests_s=$(( $(date +%s) - tests_start ))

echo "== 3. the 1B-parameter benchmark ($(left) s left)"
bench_start=$(date +%s)
timeout "$(( $(left) - 10 ))" "$PY" -m benchmarks.gpu ${bench_args[@]+"${bench_args[@]}"} --json "$out/gpu-benchmark.json" 2>&1 \
    | tee "$out/gpu-benchmark.log"
bench_rc=${PIPESTATUS[0]}
bench_s=$(( $(date +%s) - bench_start ))
sed -n '/^| mode/,$p' "$out/gpu-benchmark.log" > "$out/gpu-benchmark.md"

{
    echo "cuda tests: exit $tests_rc in ${tests_s} s"
    echo "benchmark: exit $bench_rc in ${bench_s} s (124: cut short; the JSON holds the modes finished)"
    echo "total: $(( $(date +%s) - start )) s"
} | tee "$out/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
