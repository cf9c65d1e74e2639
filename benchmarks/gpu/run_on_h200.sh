#!/usr/bin/env bash
# One device call: build the CUDA kernels, run the GPU tests, run the benchmarks. Everything that
# must come back is written under $OUT (gpu_tests.log, fp8_ffn.json/.log, gpu_bench.json/.log, ptxas.txt).
#   device run: bash benchmarks/gpu/run_on_h200.sh [--quick]   (with .whl carried for Liger)
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
python3 -c "from benchmarks.gpu.harness import definition; print(\"cublasLt.h from:\", definition.cublas_include_dirs() or definition.cuda_home() / \"include\")"
python3 -c "from benchmarks.gpu import harness; harness.build(verbose=True)" > "$OUT/ptxas.txt" 2>&1 \
  || { echo "build failed"; tail -50 "$OUT/ptxas.txt"; exit 1; }
grep -c "spill" "$OUT/ptxas.txt" | sed 's/^/ptxas reports: /'
grep -E "[1-9][0-9]* bytes spill" "$OUT/ptxas.txt" && echo "WARNING: spills above"
python3 -m pytest tests/gpu -q -p no:cacheprovider -rfE 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
# FP8 FFN against bf16 and torchao float8 (carry torchao==0.18.0 in .whl); FASTFFN_FP8_ARGS picks shapes.
python3 -m benchmarks.gpu.bench_fp8_ffn --out "$OUT/fp8_ffn.json" ${FASTFFN_FP8_ARGS:-} 2>&1 | tee "$OUT/fp8_ffn.log" | tail -30
python3 -m benchmarks.gpu.bench_gpu --out "$OUT/gpu_bench.json" "$@" 2>&1 | tee "$OUT/gpu_bench.log" | tail -40
