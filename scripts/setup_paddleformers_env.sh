#!/usr/bin/env bash
# Creates .pf-venv (or $FASTFFN_PF_VENV): Paddle 3.3.1 CPU, PaddleFormers 1.2.0 and the pins its
# Trainer needs to import, and this package in editable mode (scripts/setup_env.sh's paddleformers profile).
set -euo pipefail
exec bash "$(dirname "$0")/setup_env.sh" paddleformers
