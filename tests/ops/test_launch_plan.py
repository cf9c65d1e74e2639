"""The CUDA launch plans are pure functions of the device's limits (csrc/kernels/launch_plan.cc),
so they are tested here, without a GPU, for the numbers of several GPUs; the GPU tests check the
limits read from a real device."""

import ctypes

import pytest

from paddle_fastffn.ops import _loader
from paddle_fastffn.torch.c_structs import DeviceLimits, RmsNormBwdPlan, check_abi


@pytest.fixture(scope="module")
def library():
    _loader.ensure_loaded()
    lib = ctypes.CDLL(str(_loader.library_path()))
    check_abi(lib)  # the mirrors used here match the library Paddle built
    return lib


@pytest.fixture(scope="module")
def plan(library):
    function = library.fastffn_plan_rms_norm_bwd
    function.restype = RmsNormBwdPlan
    function.argtypes = [ctypes.c_int64, ctypes.c_int64, DeviceLimits]
    return lambda rows, cols, sms, shared: function(rows, cols, DeviceLimits(sms, shared))


# (SM count, opt-in shared memory per block) as the CUDA attributes report them.
H200, A100, L40 = (132, 232448), (108, 166912), (142, 101376)


@pytest.mark.parametrize("device, widest_shared_row", [(H200, 58080), (A100, 41696), (L40, 25312)],
                         ids=["H200", "A100", "L40"])
def test_rms_norm_backward_partials_fit_the_devices_shared_memory(plan, device, widest_shared_row):
    fits = plan(8192, widest_shared_row, *device)
    assert fits.shared_partials == 1 and fits.shared_bytes == widest_shared_row * 4
    too_wide = plan(8192, widest_shared_row + 1, *device)
    assert too_wide.shared_partials == 0 and too_wide.shared_bytes == 0
    assert too_wide.workspace_bytes == too_wide.blocks * (widest_shared_row + 1) * 4


def test_rms_norm_backward_blocks_follow_the_sm_count(plan):
    assert plan(8192, 4096, *H200).blocks == 4 * 132
    assert plan(8192, 4096, *A100).blocks == 4 * 108
    assert plan(7, 4096, *H200).blocks == 7  # never more blocks than rows
    assert plan(0, 4096, *H200).blocks == 1


def test_a_device_reporting_less_than_the_default_still_gets_48_kib(plan):
    assert plan(16, 12000, 10, 0).shared_partials == 1  # 48000 bytes: no opt-in needed
