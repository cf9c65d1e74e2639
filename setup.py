"""Packaging hook: a wheel carries the C++/CUDA sources (csrc/) as package data under
paddle_fastffn/_csrc, since the operators compile on first use on the user's machine (against
the user's own Paddle build). Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SOURCE_SUFFIXES = {".h", ".cc", ".cu", ".cuh"}


class BuildPyWithKernelSources(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the checkout's csrc/ directly
        source_root = Path(__file__).resolve().parent / "csrc"
        target_root = Path(self.build_lib) / "paddle_fastffn" / "_csrc"
        for path in source_root.rglob("*"):
            if path.suffix in SOURCE_SUFFIXES:
                target = target_root / path.relative_to(source_root)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)


setup(cmdclass={"build_py": BuildPyWithKernelSources})
