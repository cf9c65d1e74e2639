"""The GPU harness's optimizer (paddle_fastffn.torch.llama.FusedMasterAdamW) with the low-memory state
(moments="int8", master_weights="compensated") steps on the C API's CPU kernels through the core
optimizer step and matches the independent numpy reference (tests/adamw_low_memory_ref.py) for every
output, step by step; the default layout still calls the kernel entry the traces record."""

import numpy as np
import pytest
import torch

from paddle_fastffn.core import optimizer as core_optimizer
from paddle_fastffn.torch import c_api
from paddle_fastffn.torch.llama import FusedMasterAdamW
from tests import adamw_low_memory_ref as ref
from tests.gpu.gpu_checks import TOL

HYPER = dict(beta1=0.9, beta2=0.95, epsilon=1e-8, weight_decay=0.1)
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def copy_of(t: torch.Tensor) -> np.ndarray:
    """A numpy copy (not a view: the optimizer updates the tensor in place), 16-bit values as fp32."""
    return (t.detach().float() if t.is_floating_point() else t).cpu().numpy().ravel().copy()


def reference_state(param, state) -> dict:
    """The optimizer's state of one parameter as the reference's numpy dict."""
    out = {"param": copy_of(param)}
    for key in ("master", "compensation"):
        if state[key] is not None:
            out[key] = copy_of(state[key])
    if state["moment1_absmax"] is not None:
        for k in (1, 2):
            out[f"codes{k}"], out[f"absmax{k}"] = copy_of(state[f"moment{k}"]), copy_of(state[f"moment{k}_absmax"])
    else:
        out.update(moment1=copy_of(state["moment1"]), moment2=copy_of(state["moment2"]))
    return out


def check_against_reference(dtype, device: str) -> None:
    """Three steps of FusedMasterAdamW with int8 moments and compensation on `device`, each against
    the reference from the optimizer's own previous state (tests/gpu/test_adamw_kernels.py runs it
    on the GPU)."""
    torch.manual_seed(0)
    # An 8-bit tensor with an uneven last block, and one under min_8bit_size (fp32 moments).
    params = [torch.nn.Parameter(torch.randn(3 * 256 + 77).to(dtype).to(device)),
              torch.nn.Parameter(torch.randn(255).to(dtype).to(device))]
    opt = FusedMasterAdamW(params, lr=1e-3, betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["epsilon"],
                           weight_decay=HYPER["weight_decay"], moments="int8", master_weights="compensated",
                           min_8bit_size=256)
    assert [s["moment1"].dtype for s in opt.states] == [torch.uint8, torch.float32]
    assert all((s["compensation"] is not None) == (dtype != torch.float32) and s["master"] is None for s in opt.states)
    for step in range(3):
        before = [reference_state(p, s) for p, s in zip(params, opt.states)]
        pows = [(float(b1), float(b2)) for b1, b2 in opt.beta_pows]
        for p in params:
            p.grad = (torch.randn(p.shape) * 10.0 ** -step).to(dtype).to(device)
        opt.step()
        for i, (p, state) in enumerate(zip(params, opt.states)):
            expected = ref.adamw_low_memory_step(before[i], copy_of(p.grad), NAMES[dtype], lr=1e-3,
                                                 beta1_pow=pows[i][0], beta2_pow=pows[i][1], **HYPER)
            ref.assert_state_close(reference_state(p, state), expected, *TOL[torch.float32],
                                   f"{NAMES[dtype]} tensor {i} step {step} on {device}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=NAMES.get)
def test_low_memory_state_matches_the_reference_step_by_step(dtype):
    check_against_reference(dtype, "cpu")


def test_the_default_layout_keeps_the_recorded_entry_and_the_low_memory_one_calls_its_own(monkeypatch):
    calls = []
    kernels = c_api.kernels()
    for name in ("adamw", "adamw_with_state"):
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _f=original, _n=name, **k: (calls.append(_n), _f(*a, **k)))
    for options in ({}, {"moments": "int8"}):
        param = torch.nn.Parameter(torch.randn(4096).to(torch.bfloat16))
        opt = FusedMasterAdamW([param], lr=1e-3, **options)
        param.grad = torch.randn(4096).to(torch.bfloat16)
        opt.step()
    assert calls == ["adamw", "adamw_with_state"]


def test_state_memory_of_the_harness_layouts():
    """state_memory's numbers are the bytes the optimizer allocates, in each layout."""
    params = [torch.nn.Parameter(torch.randn(8192).to(torch.bfloat16)), torch.nn.Parameter(torch.randn(100).to(torch.bfloat16))]
    for fmt in (core_optimizer.StateFormat(), core_optimizer.StateFormat("int8", "compensated")):
        opt = FusedMasterAdamW(params, moments=fmt.moments, master_weights=fmt.master_weights)
        allocated = sum(t.numel() * t.element_size() for s in opt.states for k, t in s.items()
                        if t is not None and k != "master" and k != "compensation")
        masters = sum(t.numel() * t.element_size() for s in opt.states for k in ("master", "compensation")
                      if (t := s[k]) is not None)
        memory = opt.state_memory()
        assert (memory["moments"], memory["masters"]) == (allocated, masters)
