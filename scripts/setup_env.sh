#!/usr/bin/env bash
# Creates .venv (or $FASTFFN_VENV) with Paddle 3.3.1 CPU, PaddleNLP 2.8.1 and its pins, and this
# package in editable mode, then builds the custom operators once (a compile error shows here).
#
# Everything installs with pip's normal build isolation (this package's build needs only
# setuptools; its operators compile on first use). --no-build-isolation once made every seqeval
# sdist report version 0.0.0 under the venv's setuptools >= 77; pip settled on seqeval 0.0.10
# (Keras 3, no scikit-learn), and `import paddlenlp` then failed on scipy.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${FASTFFN_VENV:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip "setuptools>=77" wheel
"$venv/bin/python" -m pip install -q -e ".[cpu,paddlenlp,test]"
"$venv/bin/python" -c "import paddlenlp, scipy, sklearn" \
  || { echo "setup_env: PaddleNLP's dependencies are incomplete (see above)" >&2; exit 1; }
"$venv/bin/python" -c "from paddle_fastffn import ops; ops.ensure_loaded(); print('paddle_fastffn operators ready')"
