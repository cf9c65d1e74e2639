#!/usr/bin/env bash
# Creates .pf-venv (or $FASTFFN_PF_VENV): Paddle 3.3.1 CPU, PaddleFormers 1.2.0 and the pins its
# Trainer needs to import (the [paddleformers] profile of pyproject.toml), and this package in
# editable mode; then builds the custom operators once. A venv of its own: PaddleNLP 2.8.1 (.venv)
# and PaddleFormers cannot be installed together (pyproject.toml says why).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${FASTFFN_PF_VENV:-.pf-venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip "setuptools>=77" wheel
"$venv/bin/python" -m pip install -q -e ".[cpu,paddleformers,test]"
"$venv/bin/python" -c "from paddleformers.trainer import Trainer; import paddleformers.cli.train.sft.workflow" \
  || { echo "setup_paddleformers_env: PaddleFormers' Trainer does not import (see above)" >&2; exit 1; }
"$venv/bin/python" -c "from paddle_fastffn import ops; ops.ensure_loaded(); print('paddle_fastffn operators ready (PaddleFormers)')"
