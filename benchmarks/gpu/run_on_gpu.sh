#!/usr/bin/env bash
# One device call: build the CUDA kernels, then the parts named in FASTFFN_RUN (comma-separated, run in
# the order given; default: the like-for-like re-measurement, `remeasure` below):
#   tests        tests/gpu                                       -> gpu_tests.log
#   step         fused loss and the whole training step (bench_step, FASTFFN_STEP_ARGS) -> step.json/.log
#   optimizer    our AdamW kernel vs stock Paddle's AdamW (ported) and the three-pass stand-in, with and
#                without the global-norm clip (bench_optimizer, FASTFFN_OPTIMIZER_ARGS) -> optimizer.json/.log
#   decoder      decoder layer bf16/FP8 vs HF eager/compile/Liger -> gpu_bench.json/.log
#   kernels      bf16 kernels vs eager, torch.compile and Liger (bench_gpu) -> gpu_bench.json/.log (with decoder)
#   projections  fused vs split projection GEMMs, torch vs our provider (bench_gpu) -> gpu_bench.json/.log
#   rms_sweep    RMSNorm forward per FASTFFN_RMS_NORM_VECS_PER_THREAD build (1, 2, 4, 8), Liger's beside them
#                (bench_gpu) -> gpu_bench.json/.log
#   rope_sweep   rotary fwd and fwd+bwd per FASTFFN_ROTARY_HEADS_PER_THREAD build (1 = default, 2, 4, 8) and
#                Liger's rope in one round-robin table per width (bench_gpu) -> gpu_bench.json/.log; run `tests`
#                in the same call first: it checks those builds (tests/gpu/test_rotary_heads_per_thread.py)
#                and leaves them built for the sweep
#   fp8          the FP8 FFN (bench_fp8_ffn, FASTFFN_FP8_ARGS, default "--sections ffn") -> fp8_ffn.json/.log
#   profile      kernel timeline of the whole step, ours vs peers (profile_step, FASTFFN_PROFILE_ARGS)
#                -> profile_step.json/.log
#   convergence  FP8 vs bf16 training of a ~100M LLaMA (FASTFFN_CONVERGENCE_ARGS) -> convergence.json/.log
#   packed_sft   packed SFT step, 8 layers, on the GSM8K and oasst1-zh length profiles: ours packed vs HF +
#                Liger padding-free (flash varlen) and padded (bench_packed_sft, FASTFFN_PACKED_SFT_ARGS)
#                -> packed_sft.json/.log. Needs the length profiles in the tree (the device has no
#                /work/shared): before the call, `mkdir -p .sft_lengths && cp /work/shared/data/sft_lengths_*.json
#                .sft_lengths/` and carry [".whl", ".sft_lengths"] (FASTFFN_SFT_LENGTHS_DIR overrides).
#   full_depth   the user's job: LLaMA-2-7B at full depth (32 layers) on one GPU, the real length profiles
#                packed (default; needs .sft_lengths as packed_sft does), LoRA and full fine-tune, ours bf16 and
#                FP8 (delayed, current) against HF + Liger (+ PEFT) padding-free and padded (bench_full_depth)
#                -> full_depth.json/.log. A workload whose state exceeds the card's memory is reported, not built.
#                FASTFFN_FULL_DEPTH_WORKLOADS=lora or =full runs one workload (default lora,full);
#                FASTFFN_FULL_DEPTH_ARGS adds arguments (--data uniform, --model llama3_8b, --accumulation 4: the
#                micro-batches per optimizer step of PaddleNLP's sft_argument.json, --contenders ...). The HF LoRA peer
#                needs peft and what it imports where the machine lacks them: their wheels in .whl/full_depth/
#                (peft==0.21.2, accelerate==1.15.0, psutil==7.2.2, downloaded as shared/gpu.md says), installed for
#                this section only; bench_full_depth names what is missing and stops
#                (FASTFFN_ALLOW_MISSING_PEERS=1: runs without it, its rows saying so).
#   remeasure    = tests,step,optimizer,decoder,kernels,fp8: every table round-robin with median and spread
#                (the files of benchmarks/results/run15/).
# Every table is timed round-robin (benchmarks/gpu/bench_gpu.py: round_robin, round_robin_rebuilt).
# A device command may run 10 minutes: a section whose estimate (SECONDS_ESTIMATE, from measured section times
# with their round-robin repeats) would end after FASTFFN_DEADLINE_S (default 570 s from the start) is
# not started; it is listed in $OUT/skipped.txt and at the end, for the next call's FASTFFN_RUN.
# Peers come from wheels carried in .whl (liger-kernel==0.8.5, torchao==0.18.0; shared/gpu.md says how to
# download them); without them the comparison sections would silently lose their peers, so the run stops
# unless FASTFFN_ALLOW_MISSING_PEERS=1.
# Everything that must come back is written under $OUT; ptxas.txt holds the register/spill report.
# The same script on an H100 80 GB and an H200: nothing assumes the card (memory is queried).
#   device run: bash benchmarks/gpu/run_on_gpu.sh   (carry .whl), then FASTFFN_RUN=<skipped> in a second call
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
RUN=${FASTFFN_RUN:-remeasure}
RUN=${RUN//remeasure/tests,step,optimizer,decoder,kernels,fp8}
DEADLINE=${FASTFFN_DEADLINE_S:-570}
FULL_DEPTH_WORKLOADS=${FASTFFN_FULL_DEPTH_WORKLOADS:-lora,full}
IFS=, read -ra full_depth_workloads <<< "$FULL_DEPTH_WORKLOADS"
# tests: the GPU tests took 236 s on an H200 (767 tests on the shared layer), plus three full builds for the
# rotary sweep's variants (48 s each, in parallel; the rope_sweep section then finds them built).
# rms_sweep: four full builds one after another (~50 s each), the timing a few seconds. rope_sweep: the three variant
# builds in parallel when `tests` has not built them (~120 s), Liger's Triton compilation and 3 widths x 2 passes of
# 5 contenders (~30 s); neither sweep measured yet.
# full_depth: uniform rows took 58 s for both workloads at 3 contenders x 3 rounds on an H200; packed data has
# 5 contenders per workload and two profiles: ~100 s per workload that fits (a full fine-tune on an 80 GB card is
# reported without being built).
# step: 203 s measured with 8 step contenders at both widths (run 21, an H100; 330 s on an earlier code's H200 run);
# the cached-weight-copies twin of the FP8-head contender adds one contender's rounds: 240.
# convergence: 362 s with four precisions (run 21).
declare -A SECONDS_ESTIMATE=([tests]=300 [step]=240 [optimizer]=120 [decoder]=90 [kernels]=220 [projections]=60
                            [rms_sweep]=220 [rope_sweep]=150 [fp8]=170 [profile]=150 [convergence]=380 [packed_sft]=360
                            [full_depth]=$(( 100 * ${#full_depth_workloads[@]} )))
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Outside the working tree, so that a warm machine keeps the build across calls.
export FASTFFN_GPU_BUILD=${FASTFFN_GPU_BUILD:-/tmp/fastffn_gpu_build}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
# The commit the results come from, written first: a call cut short by its time limit still names it.
echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' with uncommitted changes')" \
  | tee -a "$OUT/device.txt"
# The device's copy of the tree may sit on an older commit with the tree's files as changes: the hash of the
# files themselves (tracked and untracked, not ignored) names it, = `git rev-parse <commit>^{tree}` of the
# commit that holds exactly them.
tree_index=$(mktemp -u)
echo "tree $(GIT_INDEX_FILE=$tree_index git add -A . 2>/dev/null && GIT_INDEX_FILE=$tree_index git write-tree 2>/dev/null \
  || echo unknown)" | tee -a "$OUT/device.txt"
rm -f "$tree_index"
python3 - <<'EOF' | tee -a "$OUT/device.txt"
import importlib.metadata as m
for name in ("torch", "triton", "transformers", "liger-kernel", "torchao"):
    try:
        print(f"{name} {m.version(name)}")
    except m.PackageNotFoundError:
        print(f"{name} MISSING")
EOF
if grep -q MISSING "$OUT/device.txt" && [[ ${FASTFFN_ALLOW_MISSING_PEERS:-0} != 1 ]]; then
  echo "a peer's package is missing (above): carry its wheel in .whl, or set FASTFFN_ALLOW_MISSING_PEERS=1"; exit 2
fi
python3 -c "from paddle_fastffn.torch.build import definition; print(\"cublasLt.h from:\", definition.cublas_include_dirs() or definition.cuda_home() / \"include\")"
python3 -c "from benchmarks.gpu import paddle_adamw_library as p; from paddle_fastffn.torch import c_api; c_api.build(verbose=True); p.build()" \
  > "$OUT/ptxas.txt" 2>&1 || { echo "build failed"; tail -50 "$OUT/ptxas.txt"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
grep -c "spill" "$OUT/ptxas.txt" | sed 's/^/ptxas reports: /'
grep -E "[1-9][0-9]* bytes spill" "$OUT/ptxas.txt" && echo "WARNING: spills above"

bench_gpu_sections=()
run_section() {
  case $1 in
    tests) python3 -m pytest tests/gpu tests/benchmarks_logic -q -p no:cacheprovider -rfE 2>&1 \
             | tee "$OUT/gpu_tests.log" | tail -15 ;;
    step) python3 -m benchmarks.gpu.bench_step --out "$OUT/step.json" ${FASTFFN_STEP_ARGS:-} 2>&1 \
            | tee "$OUT/step.log" | tail -40 ;;
    optimizer) python3 -m benchmarks.gpu.bench_optimizer --out "$OUT/optimizer.json" ${FASTFFN_OPTIMIZER_ARGS:-} 2>&1 \
                 | tee "$OUT/optimizer.log" | tail -20 ;;
    # bench_gpu's sections share one JSON: collected here, run once after the loop
    kernels|projections|decoder|rms_sweep|rope_sweep) bench_gpu_sections+=("$1") ;;
    fp8) python3 -m benchmarks.gpu.bench_fp8_ffn --out "$OUT/fp8_ffn.json" ${FASTFFN_FP8_ARGS:---sections ffn} 2>&1 \
           | tee "$OUT/fp8_ffn.log" | tail -60 ;;
    profile) python3 -m benchmarks.gpu.profile_step --out "$OUT/profile_step.json" ${FASTFFN_PROFILE_ARGS:-} 2>&1 \
               | tee "$OUT/profile_step.log" | tail -20 ;;
    packed_sft) FASTFFN_SFT_LENGTHS_DIR=${FASTFFN_SFT_LENGTHS_DIR:-$PWD/.sft_lengths} \
                  python3 -m benchmarks.gpu.bench_packed_sft --out "$OUT/packed_sft.json" ${FASTFFN_PACKED_SFT_ARGS:-} 2>&1 \
                  | tee "$OUT/packed_sft.log" | tail -40 ;;
    full_depth)
      full_depth_path=$PYTHONPATH
      if ls .whl/full_depth/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_full_depth \
          .whl/full_depth/*.whl && full_depth_path=/tmp/site_full_depth:$PYTHONPATH
      fi
      allow=(); [[ ${FASTFFN_ALLOW_MISSING_PEERS:-0} == 1 ]] && allow=(--allow-missing-peers)
      FASTFFN_SFT_LENGTHS_DIR=${FASTFFN_SFT_LENGTHS_DIR:-$PWD/.sft_lengths} \
        PYTHONPATH=$full_depth_path PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
        python3 -m benchmarks.gpu.bench_full_depth --out "$OUT/full_depth.json" --workloads "$FULL_DEPTH_WORKLOADS" \
          --stop-after-s $(( DEADLINE - ($(date +%s) - start) - 20 )) ${allow[@]+"${allow[@]}"} ${FASTFFN_FULL_DEPTH_ARGS:-} 2>&1 \
        | tee "$OUT/full_depth.log" | tail -40 ;;
    convergence) python3 -m benchmarks.gpu.convergence --out "$OUT/convergence.json" ${FASTFFN_CONVERGENCE_ARGS:-} 2>&1 \
                   | tee "$OUT/convergence.log" | tail -30 ;;
    *) echo "unknown section $1" ;;
  esac
}

skipped=()
planned=$(( $(date +%s) - start ))  # seconds used, plus the estimates of the sections accepted so far
IFS=, read -ra sections <<< "$RUN"
for section in "${sections[@]}"; do
  estimate=${SECONDS_ESTIMATE[$section]:-60}
  now=$(( $(date +%s) - start ))
  (( now > planned )) && planned=$now  # a section that ran longer than its estimate
  if (( planned + estimate > DEADLINE )); then
    skipped+=("$section"); continue
  fi
  planned=$(( planned + estimate ))
  [[ $section =~ ^(kernels|projections|decoder|rms_sweep|rope_sweep)$ ]] || echo "== $section at $(( $(date +%s) - start )) s"
  run_section "$section"
done
if (( ${#bench_gpu_sections[@]} )); then
  joined=$(IFS=,; echo "${bench_gpu_sections[*]}")
  echo "== bench_gpu $joined at $(( $(date +%s) - start )) s"
  python3 -m benchmarks.gpu.bench_gpu --out "$OUT/gpu_bench.json" --sections "$joined" 2>&1 \
    | tee "$OUT/gpu_bench.log" | tail -40
fi
if (( ${#skipped[@]} )); then
  (IFS=,; echo "${skipped[*]}") > "$OUT/skipped.txt"
  echo "SKIPPED (time budget): FASTFFN_RUN=$(cat "$OUT/skipped.txt") in the next call"
fi
echo "total: $(( $(date +%s) - start )) s"
