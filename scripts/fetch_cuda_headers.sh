#!/usr/bin/env bash
# Fetches the headers of the CUDA math libraries (cuBLAS, cuDNN, cuRAND, cuSPARSE, cuSOLVER,
# cuFFT) from their PyPI wheels into DEST/include. Paddle's GPU headers include them, so the
# Paddle GPU bindings can only be compile-checked against the CPU wheel with them on the path.
# Only include/ is kept (the libraries are not needed to compile). Idempotent.
set -euo pipefail
dest=${1:-${HOME}/.cache/paddle_fastffn/cuda_math_headers}
if [ -f "$dest/COMPLETE" ]; then echo "$dest"; exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
  --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$tmp" nvidia-cublas-cu12 nvidia-cudnn-cu12 nvidia-curand-cu12 nvidia-cusparse-cu12 \
  nvidia-cusolver-cu12 nvidia-cufft-cu12 >&2
mkdir -p "$dest/include"
for wheel in "$tmp"/*.whl; do
  python3 - "$wheel" "$dest/include" <<'PY'
import sys, zipfile, os
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as zf:
    for name in zf.namelist():
        parts = name.split("/")
        if len(parts) > 3 and parts[0] == "nvidia" and parts[2] == "include" and not name.endswith("/"):
            target = os.path.join(out, *parts[3:])
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with zf.open(name) as src, open(target, "wb") as dst:
                dst.write(src.read())
PY
done
touch "$dest/COMPLETE"
echo "$dest"
