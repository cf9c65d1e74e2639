#!/usr/bin/env bash
# One device call: build the CUDA kernels, run the GPU tests, then the parts named in FASTFFN_RUN
# (comma-separated, in this order; default: all):
#   tests        tests/gpu                                       -> gpu_tests.log
#   kernels      bf16 kernels vs eager and Liger (bench_gpu)      -> gpu_bench.json/.log
#   projections  fused vs split projection GEMMs, torch vs our provider (bench_gpu) -> gpu_bench.json/.log
#   decoder      decoder layer bf16/FP8 vs HF eager/compile/Liger -> gpu_bench.json/.log (with kernels)
#   fp8          quantisation kernels and the FP8 FFN (bench_fp8_ffn, FASTFFN_FP8_ARGS) -> fp8_ffn.json/.log
#   step         fused loss and the whole training step (bench_step, FASTFFN_STEP_ARGS) -> step.json/.log
#   optimizer    our AdamW kernel vs the three-pass master-weight AdamW (bench_optimizer,
#                FASTFFN_OPTIMIZER_ARGS, e.g. --sweep for the kernel's build-time knobs) -> optimizer.json/.log
#   profile      kernel timeline of the whole step, ours vs peers (profile_step, FASTFFN_PROFILE_ARGS)
#                -> profile_step.json/.log
#   convergence  FP8 vs bf16 training of a ~100M LLaMA (FASTFFN_CONVERGENCE_ARGS) -> convergence.json/.log
# Everything that must come back is written under $OUT; ptxas.txt holds the register/spill report.
#   device run: FASTFFN_RUN=tests,step bash benchmarks/gpu/run_on_h200.sh   (carry .whl for Liger, torchao)
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
RUN=${FASTFFN_RUN:-tests,kernels,decoder,fp8,step,optimizer,convergence}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Outside the working tree, so that a warm machine keeps the build across calls.
export FASTFFN_GPU_BUILD=${FASTFFN_GPU_BUILD:-/tmp/fastffn_gpu_build}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
wants() { [[ ",$RUN," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
python3 -c "from benchmarks.gpu.harness import definition; print(\"cublasLt.h from:\", definition.cublas_include_dirs() or definition.cuda_home() / \"include\")"
start=$(date +%s)
python3 -c "from benchmarks.gpu import harness; harness.build(verbose=True)" > "$OUT/ptxas.txt" 2>&1 \
  || { echo "build failed"; tail -50 "$OUT/ptxas.txt"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
grep -c "spill" "$OUT/ptxas.txt" | sed 's/^/ptxas reports: /'
grep -E "[1-9][0-9]* bytes spill" "$OUT/ptxas.txt" && echo "WARNING: spills above"
if wants tests; then
  python3 -m pytest tests/gpu -q -p no:cacheprovider -rfE 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
sections=()
wants kernels && sections+=(kernels)
wants projections && sections+=(projections)
wants decoder && sections+=(decoder)
if (( ${#sections[@]} )); then
  joined=$(IFS=,; echo "${sections[*]}")
  python3 -m benchmarks.gpu.bench_gpu --out "$OUT/gpu_bench.json" --sections "$joined" 2>&1 \
    | tee "$OUT/gpu_bench.log" | tail -40
fi
if wants fp8; then
  # FP8 FFN against bf16 and torchao float8 (carry torchao==0.18.0 in .whl)
  python3 -m benchmarks.gpu.bench_fp8_ffn --out "$OUT/fp8_ffn.json" ${FASTFFN_FP8_ARGS:-} 2>&1 \
    | tee "$OUT/fp8_ffn.log" | tail -60
fi
if wants step; then
  python3 -m benchmarks.gpu.bench_step --out "$OUT/step.json" ${FASTFFN_STEP_ARGS:-} 2>&1 | tee "$OUT/step.log" | tail -40
fi
if wants optimizer; then
  python3 -m benchmarks.gpu.bench_optimizer --out "$OUT/optimizer.json" ${FASTFFN_OPTIMIZER_ARGS:-} 2>&1 \
    | tee "$OUT/optimizer.log" | tail -20
fi
if wants profile; then
  python3 -m benchmarks.gpu.profile_step --out "$OUT/profile_step.json" ${FASTFFN_PROFILE_ARGS:-} 2>&1 \
    | tee "$OUT/profile_step.log" | tail -20
fi
if wants convergence; then
  python3 -m benchmarks.gpu.convergence --out "$OUT/convergence.json" ${FASTFFN_CONVERGENCE_ARGS:-} 2>&1 \
    | tee "$OUT/convergence.log" | tail -30
fi
echo "total: $(( $(date +%s) - start )) s"
