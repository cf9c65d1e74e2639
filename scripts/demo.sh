#!/usr/bin/env bash
# The main job on a fresh machine: set up, build the embedded LLaMA-2-architecture demo model,
# tokenizer and dataset, then fine-tune it with use_fast_ffn=True and, beside it, on the stock
# path, and stock twice more for the noise floor (another thread count; weights one ulp away).
# One screen after set-up: a line per run (its full log in output/), losses, the loss drift of
# each against stock, throughput, memory and the fine-tuned model's answers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
venv=${FASTFFN_VENV:-.venv}
mkdir -p output
if [ ! -f demo_data/model/config.json ]; then
    "$venv/bin/python" -m paddle_fastffn.finetune.demo_assets --out demo_data > output/demo_assets.log 2>&1 \
        || { tail -20 output/demo_assets.log; exit 1; }
    echo "demo model, tokenizer and 4,000 examples built in demo_data/ (log: output/demo_assets.log)"
fi
# Results go to output/: benchmarks/results/ holds the committed measurements.
"$venv/bin/python" -m benchmarks.cpu.bench_finetune --results-dir output "$@"
