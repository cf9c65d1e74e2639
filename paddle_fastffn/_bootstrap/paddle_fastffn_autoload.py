"""The import hook that loads paddle_fastffn into a PaddleNLP script we did not write.

This folder (paddle_fastffn/_bootstrap) is put on sys.path and PYTHONPATH by `python -m
paddle_fastffn` (paddle_fastffn/plugin.py), so this module is importable under its own top-level
name without importing the paddle_fastffn package (which imports Paddle): a process pays nothing
until it imports paddlenlp.trainer. Right after that module has run, paddle_fastffn.plugin puts
the `use_fast_ffn` and `fast_ffn_*` fields on its TrainingArguments (PaddleNLP's llm scripts
subclass `paddlenlp.trainer.TrainingArguments` in their own argument.py, so the fields must be
there before that file is imported: importing paddle_fastffn afterwards adds no field).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

ENV_VAR = "PADDLE_FASTFFN_PLUGIN"
# Module -> the paddle_fastffn.plugin function that extends it right after it ran.
TARGETS = {
    "paddlenlp.trainer": "extend_paddlenlp_trainer",
    "paddleformers.trainer.training_args": "extend_paddleformers_training_args",
    "paddleformers.trainer.trainer": "extend_paddleformers_trainer",
    "paddleformers.cli.hparams.parser": "extend_paddleformers_parser",
}


def _extend(module) -> None:
    import paddle_fastffn.plugin

    getattr(paddle_fastffn.plugin, TARGETS[module.__name__])(module)


class _AfterImport(importlib.abc.Loader):
    """Runs the real loader, then hands the module to paddle_fastffn.plugin."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _extend(module)


class TrainerModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _AfterImport(spec.loader)
        return spec


def install() -> None:
    """Extend each target module now if it is imported already, else when it is."""
    for name in TARGETS:
        if name in sys.modules:
            _extend(sys.modules[name])
    if not any(isinstance(finder, TrainerModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, TrainerModuleFinder())


def install_from_environment() -> None:
    if os.environ.get(ENV_VAR) == "1":
        install()
