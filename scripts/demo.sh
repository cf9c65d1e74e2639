#!/usr/bin/env bash
# The main job on a fresh machine: set up, build the embedded LLaMA-2-architecture demo model,
# tokenizer and dataset, then fine-tune it with use_fast_ffn=True and, beside it, on the stock
# path; print losses, throughput and memory of both.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
venv=${FASTFFN_VENV:-.venv}
[ -f demo_data/model/config.json ] || "$venv/bin/python" -m paddle_fastffn.finetune.demo_assets --out demo_data
# Results go to output/: benchmarks/results/ holds the committed measurements.
"$venv/bin/python" -m benchmarks.cpu.bench_finetune --results-dir output "$@"
