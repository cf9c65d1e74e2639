"""ctypes mirrors of fastffn/optimizer.h's structs, without torch (now defined with every other
mirror in c_structs.py, which checks them against the library): the GPU harness (harness.py) and
the CPU tests of the C entry points' statuses (tests/optim) import them from here too."""

from benchmarks.gpu.c_structs import AdamwArgs, Scalar

__all__ = ["AdamwArgs", "Scalar"]
