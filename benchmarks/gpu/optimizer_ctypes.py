"""ctypes mirrors of fastffn/optimizer.h's structs, without torch: the GPU harness (harness.py)
and the CPU tests of the C entry points' statuses (tests/optim) share them."""

import ctypes


class Scalar(ctypes.Structure):
    """fastffn_scalar: `value`, or the fp32 at address `ptr` when it is not NULL."""
    _fields_ = [("value", ctypes.c_float), ("ptr", ctypes.c_void_p)]


class AdamwArgs(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int64), ("param_dtype", ctypes.c_int), ("grad_dtype", ctypes.c_int),
                ("beta1", ctypes.c_float), ("beta2", ctypes.c_float), ("epsilon", ctypes.c_float),
                ("coeff", ctypes.c_float), ("lr_ratio", ctypes.c_float), ("with_decay", ctypes.c_int),
                ("lr", Scalar), ("beta1_pow", Scalar), ("beta2_pow", Scalar), ("grad_scale", Scalar)]
