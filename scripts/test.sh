#!/usr/bin/env bash
# Set up and run the whole test suite (CPU; GPU kernel tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
venv=${FASTFFN_VENV:-.venv}
"$venv/bin/python" -m pytest tests -q -p no:cacheprovider "$@"
