"""A wheel carries the C++/CUDA sources and works outside the checkout: built with `pip wheel`,
installed into a fresh virtual environment, imported from another folder, it compiles its
operators on first use, runs one op and a patched tiny LLaMA. The new environment reuses this
environment's installed dependencies through a .pth line (a plain path: the editable install's
finder in this site-packages is not activated), so the check costs no second Paddle download."""

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

from build_tools import run

REPO = Path(__file__).resolve().parents[2]

SMOKE = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import paddle
    import paddle_fastffn
    from paddle_fastffn import ops
    from paddle_fastffn.ops import _loader
    package = os.path.dirname(paddle_fastffn.__file__)
    assert package.startswith(sys.prefix), (package, sys.prefix)
    assert str(_loader.csrc_root()).startswith(package), _loader.csrc_root()
    out = ops.swiglu(paddle.to_tensor([[1.0, 2.0]]))
    assert abs(float(out) - 1.4621172) < 1e-5, float(out)
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=86, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    paddle.seed(0)
    model = LlamaForCausalLM(config)
    ids = paddle.to_tensor(np.arange(3, 19).reshape(2, 8), dtype="int64")
    stock = model(ids)[0].numpy()
    assert paddle_fastffn.apply_fast_ffn_to_llama(model) == 2
    fast = model(ids)[0].numpy()
    np.testing.assert_allclose(fast, stock, rtol=1e-5, atol=1e-5)
    print("WHEEL_OK", _loader.CALL_COUNTS["fastffn_swiglu_fwd"], _loader.CALL_COUNTS["fastffn_rotary"])
    """
)


def test_wheel_installs_and_works_outside_the_checkout(tmp_path):
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp_path / "dist", REPO])
    wheel = next((tmp_path / "dist").glob("paddle_fastffn-*.whl"))
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    new_site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (new_site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # No PYTHONPATH for the install either: with the checkout on it (a developer's
    # `PYTHONPATH=$PWD pytest`), pip sees the checkout's editable install as this version, skips
    # the wheel, and the import below fails for a reason that is not the wheel's.
    env = dict(os.environ, PADDLE_FASTFFN_CACHE=str(tmp_path / "ops_cache"))
    env.pop("PYTHONPATH", None)
    run([python, "-m", "pip", "install", "--no-deps", "-q", wheel], env=env)
    result = run([python, "-c", SMOKE], cwd=tmp_path, env=env)
    assert "WHEEL_OK" in result.stdout
    # the swiglu call, then each of the two layers' SwiGLU and rotary kernels
    assert result.stdout.split("WHEEL_OK")[1].split() == ["3", "2"]
