"""Started with every Python process under `python -m paddle_fastffn` (this folder is on its
PYTHONPATH): the ranks that `python -m paddle.distributed.launch` starts run their script
themselves, so the plugin is loaded here, at interpreter start, when PADDLE_FASTFFN_PLUGIN=1.
The sitecustomize this file shadows (a distribution's or a virtual environment's) runs first."""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_shadowed_sitecustomize() -> None:
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_run_shadowed_sitecustomize()

import paddle_fastffn_autoload  # noqa: E402  (this folder's own module: imports nothing heavy)

paddle_fastffn_autoload.install_from_environment()
