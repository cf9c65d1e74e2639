"""paddle_fastffn/core/fp8 is framework-neutral: the torch harness (no Paddle on the GPU machine)
imports it, so no module of it may import Paddle or torch."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE_FP8 = ("backend", "recipe", "recompute", "scaling", "weight_cache")


def test_core_fp8_imports_neither_paddle_nor_torch():
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('paddle', 'torch'):\n"
        "            raise ImportError(f'core imported {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
        + "".join(f"import paddle_fastffn.core.fp8.{name}\n" for name in CORE_FP8)
        + "from paddle_fastffn.core.fp8.recipe import Fp8Recipe\nFp8Recipe(scaling='current')\n"
    )
    result = subprocess.run([sys.executable, "-c", blocker], cwd=ROOT, capture_output=True, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
