"""The optimizer benchmark's baseline, stock Paddle's AdamW ported into the harness
(benchmarks/gpu/paddle_adamw.py, paddle_adamw.cu), against the float64 reference of Paddle's formula
(test_adamw_kernels.paddle_adamw_ref) and against our kernel (FusedMasterAdamW, the same formula),
and its global-norm clip against the clip computed in float64 and as the step applies it.

Each update step is compared from the port's own state before it (a one-step comparison): masters
and moments within the fp32 row (fp32 math against float64), the bf16 parameter equal to its
master rounded once."""

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


def test_paddle_adamw_port_matches_our_kernel_without_clip():
    """The same formula in the same precision (the beta powers the same fp32 products, on the host
    in both, per parameter): masters and moments within the fp32 row."""
    from benchmarks.gpu.paddle_adamw import PaddleAdamW
    from paddle_fastffn.torch.llama import FusedMasterAdamW

    paddle_p, ours_p = bf16_parameters(1), bf16_parameters(1)
    settings = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    paddle, ours = PaddleAdamW(paddle_p, **settings), FusedMasterAdamW(ours_p, **settings)
    for _ in range(4):
        for a, b in zip(paddle_p, ours_p):
            g = torch.randn(a.shape, device="cuda").to(torch.bfloat16)
            a.grad, b.grad = g.clone(), g.clone()
        paddle.step()
        ours.step()
    for i in range(len(SHAPES)):
        close(paddle.masters[i], ours.masters[i], torch.float32, f"master {i}")
        close(paddle.m[i], ours.m[i], torch.float32, f"moment1 {i}")
        close(paddle.v[i], ours.v[i], torch.float32, f"moment2 {i}")


def test_paddle_adamw_step_clips_the_gradients_before_the_update():
    """With max_grad_norm, step() is clip_grads (deterministic: no atomics in the norm) and then
    Paddle's update on the clipped bf16 gradients. (Against our kernel the clip differs by design:
    both round each squared norm to bf16, but Paddle also rounds their sum, the coefficient and each
    scaled gradient to bf16, where ours sums in fp32 and scales in fp32 inside the update.)"""
    from benchmarks.gpu.paddle_adamw import PaddleAdamW

    params = bf16_parameters(3)
    opt = PaddleAdamW(params, lr=1e-2, betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                      weight_decay=HYPER["weight_decay"], max_grad_norm=0.5)
    grads = [torch.randn(p.shape, device="cuda").to(torch.bfloat16) for p in params]
    clipped = [g.clone() for g in grads]
    opt.clip_grads(clipped)
    before = [(m.clone(), a.clone(), b.clone()) for m, a, b in zip(opt.masters, opt.m, opt.v)]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    for i, (g, (master, m1, m2)) in enumerate(zip(clipped, before)):
        assert torch.equal(params[i].grad, g), f"gradient {i} clipped in place as clip_grads does"
        ref_p, ref_m1, ref_m2 = paddle_adamw_ref(master, g, m1, m2, lr=1e-2, beta1_pow=HYPER["beta1"],
                                                 beta2_pow=HYPER["beta2"], **HYPER)
        close(opt.masters[i], ref_p, torch.float32, f"master {i}")
        close(opt.m[i], ref_m1, torch.float32, f"moment1 {i}")
        close(opt.v[i], ref_m2, torch.float32, f"moment2 {i}")


def test_paddle_clip_scales_gradients_by_the_global_norm():
    """ClipGradByGlobalNorm's coefficient max_norm / max(norm, max_norm) from the float64 norm of
    all gradients. Paddle's path rounds each squared norm, their sum and the coefficient to bf16 and
    the product once more (four roundings of 2^-9 relative at most, about 0.8%): the bf16 row, on
    the gradients divided by the float64 coefficient (values of order 1, so its atol does not hide
    a wrong coefficient of ~1e-3). Below max_norm the coefficient is exactly 1 and nothing changes."""
    from benchmarks.gpu.paddle_adamw import PaddleAdamW

    params = bf16_parameters(2)
    grads = [torch.randn(p.shape, device="cuda").to(torch.bfloat16) for p in params]
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
    clipped = [g.clone() for g in grads]
    PaddleAdamW(params, max_grad_norm=0.5).clip_grads(clipped)
    coefficient = 0.5 / norm
    assert coefficient < 1e-2  # the test clips hard
    for i, (g, c) in enumerate(zip(grads, clipped)):
        close(c.double() / coefficient, g.double(), torch.bfloat16, f"clipped gradient {i} / coefficient")
    unclipped = [g.clone() for g in grads]
    PaddleAdamW(params, max_grad_norm=2 * norm).clip_grads(unclipped)
    assert all(torch.equal(g, u) for g, u in zip(grads, unclipped))
