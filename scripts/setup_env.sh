#!/usr/bin/env bash
# Creates .venv (or $FASTFFN_VENV) with Paddle 3.3.1 CPU, PaddleNLP 2.8.1 and its pins, and this
# package in editable mode, then builds the custom operators once (a compile error shows here).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${FASTFFN_VENV:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip "setuptools>=77" wheel
"$venv/bin/python" -m pip install -q -e ".[cpu,test]" --no-build-isolation
"$venv/bin/python" -c "from paddle_fastffn import ops; ops.ensure_loaded(); print('paddle_fastffn operators ready')"
