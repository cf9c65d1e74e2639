#!/usr/bin/env bash
# Creates .venv (or $FASTFFN_VENV) with Paddle 3.3.1 CPU, PaddleNLP 2.8.1 and its pins, and this
# package in editable mode, then builds the custom operators once (a compile error shows here).
# With the argument `paddleformers`: .pf-venv (or $FASTFFN_PF_VENV) with PaddleFormers 1.2.0 and the
# pins its Trainer needs instead (pyproject.toml's profiles: the two libraries cannot share a venv).
#
# Everything installs with pip's normal build isolation (this package's build needs only
# setuptools; its operators compile on first use). --no-build-isolation once made every seqeval
# sdist report version 0.0.0 under the venv's setuptools >= 77; pip settled on seqeval 0.0.10
# (Keras 3, no scikit-learn), and `import paddlenlp` then failed on scipy.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${1:-paddlenlp}
case "$profile" in
  paddlenlp)
    venv=${FASTFFN_VENV:-.venv}
    check="import paddlenlp, scipy, sklearn" ;;
  paddleformers)
    venv=${FASTFFN_PF_VENV:-.pf-venv}
    check="from paddleformers.trainer import Trainer; import paddleformers.cli.train.sft.workflow" ;;
  *) echo "setup_env: the profile must be paddlenlp or paddleformers, got '$profile'" >&2; exit 2 ;;
esac
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip "setuptools>=77" wheel
"$venv/bin/python" -m pip install -q -e ".[cpu,$profile,test]"
"$venv/bin/python" -c "$check" \
  || { echo "setup_env: $profile's dependencies are incomplete (see above)" >&2; exit 1; }
"$venv/bin/python" -c "from paddle_fastffn import ops; ops.ensure_loaded(); print('paddle_fastffn operators ready ($profile)')"
