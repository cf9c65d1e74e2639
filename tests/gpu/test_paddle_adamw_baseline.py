"""The optimizer benchmark's baseline, stock Paddle's AdamW ported into the harness
(benchmarks/gpu/paddle_adamw.py, paddle_adamw.cu), against the float64 reference of Paddle's formula
(test_adamw_kernels.paddle_adamw_ref) and against our kernel (FusedMasterAdamW, the same formula),
and its global-norm clip against the clip computed in float64.

Each update step is compared from the port's own state before it (a one-step comparison): masters
and moments within the fp32 row (fp32 math against float64), the bf16 parameter equal to its
master rounded once."""

import pytest
import torch

from gpu_checks import close
from test_adamw_kernels import HYPER, paddle_adamw_ref

SHAPES = [(1,), (7,), (513,), (64, 48), ((1 << 18) + 3,)]


def bf16_parameters(seed):
    torch.manual_seed(seed)
    return [torch.randn(s, device="cuda").to(torch.bfloat16).requires_grad_() for s in SHAPES]


def test_paddle_adamw_port_matches_paddles_formula_each_step():
    from benchmarks.gpu.paddle_adamw import PaddleAdamW

    params = bf16_parameters(0)
    opt = PaddleAdamW(params, lr=1e-2, betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                      weight_decay=HYPER["weight_decay"])
    for step in range(3):
        before = [(m.clone(), a.clone(), b.clone()) for m, a, b in zip(opt.masters, opt.m, opt.v)]
        pows = list(zip(opt.beta1_pows, opt.beta2_pows))
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda").to(torch.bfloat16)
        grads = [p.grad.clone() for p in params]
        opt.step()
        for i, (p, g, (master, m1, m2), (pow1, pow2)) in enumerate(zip(params, grads, before, pows)):
            ref_p, ref_m1, ref_m2 = paddle_adamw_ref(master, g, m1, m2, lr=1e-2, beta1_pow=float(pow1),
                                                     beta2_pow=float(pow2), **HYPER)
            close(opt.masters[i], ref_p, torch.float32, f"step {step} master {i}")
            close(opt.m[i], ref_m1, torch.float32, f"step {step} moment1 {i}")
            close(opt.v[i], ref_m2, torch.float32, f"step {step} moment2 {i}")
            assert torch.equal(p.detach(), opt.masters[i].to(torch.bfloat16)), f"step {step} param {i}"
        opt.zero_grad()
    # Paddle's host accumulators: beta^(t+1) after t steps, fp32 products
    expected = torch.tensor(HYPER["beta1"], dtype=torch.float32)
    for _ in range(3):
        expected = expected * torch.tensor(HYPER["beta1"], dtype=torch.float32)
    assert all(float(b) == float(expected) for b in opt.beta1_pows)


@pytest.mark.parametrize("max_grad_norm", [None, 0.5], ids=["no_clip", "clip"])
def test_paddle_adamw_port_matches_our_kernel(max_grad_norm):
    """Without a clip the same formula in the same precision: masters and moments within the fp32
    row. With the clip, Paddle rounds each squared norm and their sum to bf16 (~2^-9 relative on the
    coefficient), which scales m by c and v by c^2 but leaves m / sqrt(v) (the update) unchanged up
    to epsilon: masters are compared, moments only without the clip."""
    from benchmarks.gpu.llama_model import FusedMasterAdamW
    from benchmarks.gpu.paddle_adamw import PaddleAdamW

    paddle_p, ours_p = bf16_parameters(1), bf16_parameters(1)
    settings = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, max_grad_norm=max_grad_norm)
    paddle, ours = PaddleAdamW(paddle_p, **settings), FusedMasterAdamW(ours_p, **settings)
    for _ in range(4):
        for a, b in zip(paddle_p, ours_p):
            g = torch.randn(a.shape, device="cuda").to(torch.bfloat16)
            a.grad, b.grad = g.clone(), g.clone()
        paddle.step()
        ours.step()
    for i in range(len(SHAPES)):
        close(paddle.masters[i], ours.masters[i], torch.float32, f"master {i}")
        if max_grad_norm is None:
            close(paddle.m[i], ours.m[i], torch.float32, f"moment1 {i}")
            close(paddle.v[i], ours.v[i], torch.float32, f"moment2 {i}")


@pytest.mark.parametrize("max_grad_norm", [0.5, 1e6], ids=["clipping", "below_max_norm"])
def test_paddle_clip_scales_gradients_by_the_global_norm(max_grad_norm):
    """ClipGradByGlobalNorm's coefficient max_norm / max(norm, max_norm) from the float64 norm of
    all gradients. Paddle's path rounds each squared norm, their sum and the coefficient to bf16 and
    the product once more (four roundings of 2^-9 relative at most, about 0.8%): the bf16 row."""
    from benchmarks.gpu.paddle_adamw import PaddleAdamW

    params = bf16_parameters(2)
    opt = PaddleAdamW(params, max_grad_norm=max_grad_norm)
    grads = [torch.randn(p.shape, device="cuda").to(torch.bfloat16) for p in params]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    coefficient = max_grad_norm / max(float(norm), max_grad_norm)
    clipped = [g.clone() for g in grads]
    opt.clip_grads(clipped)
    for i, (g, c) in enumerate(zip(grads, clipped)):
        close(c, g.double() * coefficient, torch.bfloat16, f"clipped gradient {i}")

