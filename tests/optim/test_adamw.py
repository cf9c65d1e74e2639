"""FastAdamW and the AdamW kernel on the CPU against stock paddle.optimizer.AdamW (several steps,
models and raw parameters, schedulers, decay exclusions, lr_ratio, clipping, checkpoints both
ways) and against the pure-Paddle reference adamw_ref, one step at a time, where stock Paddle
cannot run (16-bit parameters: Paddle's CPU build has no 16-bit AdamW kernel). Tolerances:
tests/tolerances.py (adamw_tolerance and ADAMW_MOMENT_RTOL say where they come from)."""

import numpy as np
import paddle
import pytest

from paddle_fastffn.ops import _loader
from paddle_fastffn.optim import FastAdamW, adamw_ref, adamw_update_
from tolerances import (ADAMW_BETA_POW_RTOL, ADAMW_MOMENT_RTOL, adamw_model_moment_tolerance,
                        adamw_moment1_tolerance, adamw_tolerance, assert_close, assert_within)

OP = "fastffn_adamw_"
ACCUMULATORS = ("moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc")
# One element, odd lengths below and above a vector and an OpenMP chunk, 2-D and 3-D odd shapes.
AWKWARD_SHAPES = [(1,), (3,), (7,), (4097,), (65537,), (5, 3), (3, 7, 11)]


def parameter(values, dtype="float32", **attr):
    """A trainable parameter holding `values` (cast to dtype)."""
    values = paddle.to_tensor(np.asarray(values, dtype=np.float32)).astype(dtype)
    return paddle.create_parameter(values.shape, dtype, attr=paddle.ParamAttr(**attr),
                                   default_initializer=paddle.nn.initializer.Assign(values))


def twin_parameters(shapes, dtype="float32", seed=0, **attr):
    """Two lists of parameters with the same values (ours, stock)."""
    rng = np.random.default_rng(seed)
    values = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    return [parameter(v, dtype, **attr) for v in values], [parameter(v, dtype, **attr) for v in values]


def set_grads(params, grads):
    """Each parameter its own copy (stock Paddle clips gradients in place)."""
    for p, g in zip(params, grads):
        p.grad = g.astype(p.dtype).clone()


def random_grads(shapes, rng, scale=1.0):
    return [paddle.to_tensor(rng.standard_normal(s).astype(np.float32) * scale) for s in shapes]


def assert_same_state(ours, stock, params, stock_params, steps, lr, model=False):
    """Parameters (or master weights) within adamw_tolerance, moments within ADAMW_MOMENT_RTOL
    (given the same gradients; m1 also within adamw_moment1_tolerance's absolute term) or adamw_model_moment_tolerance (a model's own gradients), beta
    powers identical (both multiply fp32 values by fp32 betas)."""
    atol, rtol = adamw_tolerance(steps, lr)
    for p, q in zip(params, stock_params):
        mine = ours._master_weights.get(p.name, p)
        assert_within(mine, q, atol, rtol, f"{p.name} after {steps} steps")
        for acc in ACCUMULATORS:
            a = ours._get_accumulator_master(acc, p).numpy()
            b = stock._get_accumulator_master(acc, q).numpy()
            if acc.startswith("beta"):
                np.testing.assert_array_equal(a, b, err_msg=f"{acc} of {p.name}")
            else:
                tol = (adamw_model_moment_tolerance(steps, float(np.abs(b).max())) if model
                       else adamw_moment1_tolerance(b, _beta1(stock)) if acc == "moment1"
                       else (0.0, ADAMW_MOMENT_RTOL))
                assert_within(a, b, *tol, f"{acc} of {p.name}")


def _beta1(optimizer) -> float:
    beta1 = optimizer._beta1
    return float(beta1.item() if isinstance(beta1, paddle.Tensor) else beta1)


def step_twins(ours, stock, ours_p, stock_p, steps, seed, grad_scale=1.0, after_step=None):
    """`steps` steps of both optimizers on the same random gradients; after_step(grads)."""
    rng = np.random.default_rng(seed)
    shapes = [p.shape for p in ours_p]
    for _ in range(steps):
        grads = random_grads(shapes, rng, grad_scale)
        set_grads(ours_p, grads)
        set_grads(stock_p, grads)
        ours.step()
        stock.step()
        if after_step is not None:
            after_step(grads)


def run_twins(shapes, steps=5, grad_scale=1.0, seed=0, **options):
    """FastAdamW and stock AdamW, the same options and gradients, `steps` steps."""
    ours_p, stock_p = twin_parameters(shapes, seed=seed)
    ours = FastAdamW(parameters=ours_p, **options)
    stock = paddle.optimizer.AdamW(parameters=stock_p, **options)
    step_twins(ours, stock, ours_p, stock_p, steps, seed + 1, grad_scale)
    return ours, stock, ours_p, stock_p


@pytest.mark.parametrize("shape", AWKWARD_SHAPES, ids=str)
def test_raw_parameters_match_stock_adamw(shape, kernel_calls):
    ours, stock, ours_p, stock_p = run_twins([shape], steps=4, learning_rate=0.01,
                                             weight_decay=0.1)
    assert_same_state(ours, stock, ours_p, stock_p, 4, 0.01)
    assert kernel_calls() == {OP: 4}


class TinyModel(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed = paddle.nn.Embedding(11, 12)
        self.norm = paddle.nn.LayerNorm(12)
        self.proj = paddle.nn.Linear(12, 7)
        self.head = paddle.nn.Linear(7, 5)

    def forward(self, ids):
        return self.head(paddle.nn.functional.silu(self.proj(self.norm(self.embed(ids)))))


def twin_models(seed=0):
    paddle.seed(seed)
    ours, stock = TinyModel(), TinyModel()
    stock.set_state_dict(ours.state_dict())
    return ours, stock


def train_twins(make_optimizer, steps=6, seed=0, between_steps=lambda: None):
    """A small model trained by FastAdamW and by stock AdamW on the same batches."""
    ours_model, stock_model = twin_models(seed)
    ours = make_optimizer(FastAdamW, ours_model.parameters())
    stock = make_optimizer(paddle.optimizer.AdamW, stock_model.parameters())
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = paddle.to_tensor(rng.integers(0, 11, (3, 9)))
        for model, opt in ((ours_model, ours), (stock_model, stock)):
            (model(ids) ** 2).mean().backward()
            opt.step()
            opt.clear_grad()
        between_steps()
    return ours, stock, ours_model.parameters(), stock_model.parameters()


def no_decay_for_norms_and_biases(model_params):
    decayed = {p.name for p in model_params if len(p.shape) > 1 and "layer_norm" not in p.name}
    return lambda name: name in decayed


def test_model_with_decay_exclusions_matches_stock_adamw(kernel_calls):
    def make(cls, params):
        params = list(params)
        return cls(learning_rate=3e-3, parameters=params, weight_decay=0.05, beta2=0.95,
                   apply_decay_param_fun=no_decay_for_norms_and_biases(params))

    ours, stock, ours_p, stock_p = train_twins(make)
    assert_same_state(ours, stock, ours_p, stock_p, 6, 3e-3, model=True)
    assert kernel_calls() == {OP: 6 * len(ours_p)}


def test_lr_scheduler_warmup_then_cosine_matches_stock_adamw(kernel_calls):
    schedulers = []

    def make(cls, params):
        cosine = paddle.optimizer.lr.CosineAnnealingDecay(learning_rate=0.01, T_max=4)
        schedulers.append(paddle.optimizer.lr.LinearWarmup(cosine, warmup_steps=3, start_lr=0.0,
                                                            end_lr=0.01))
        return cls(learning_rate=schedulers[-1], parameters=params, weight_decay=0.01)

    def step_schedulers():
        for s in schedulers:
            s.step()

    ours, stock, ours_p, stock_p = train_twins(make, steps=8, between_steps=step_schedulers)
    assert ours.get_lr() == stock.get_lr() != 0.01
    assert_same_state(ours, stock, ours_p, stock_p, 8, 0.01, model=True)
    assert kernel_calls()[OP] == 8 * len(ours_p)


def test_lr_ratio_matches_stock_parameter_group_learning_rates(kernel_calls):
    """lr_ratio(p) scales p's learning rate, decay included: stock Paddle refuses lr_ratio on the
    CPU, so the stock run gets the same per-parameter rates from parameter groups (the group's
    scale multiplies the learning-rate tensor, which the kernel then multiplies by 1)."""
    ratio = {0: 1.0, 1: 0.25}
    shapes = [(6, 5), (5,)]
    ours_p, stock_p = twin_parameters(shapes)
    ratios = {p.name: ratio[i] for i, p in enumerate(ours_p)}
    with pytest.raises(NotImplementedError, match="lr_ratio"):
        paddle.optimizer.AdamW(parameters=stock_p, lr_ratio=lambda p: 1.0)
    ours = FastAdamW(learning_rate=0.02, parameters=ours_p, lr_ratio=lambda p: ratios[p.name])
    stock = paddle.optimizer.AdamW(learning_rate=0.02, parameters=[
        {"params": [stock_p[0]]}, {"params": [stock_p[1]], "learning_rate": ratio[1]}])
    step_twins(ours, stock, ours_p, stock_p, 5, 3)
    assert_same_state(ours, stock, ours_p, stock_p, 5, 0.02)
    assert kernel_calls() == {OP: 10}


def test_parameter_groups_with_their_own_betas_and_decay_match_stock_adamw():
    shapes = [(4, 3), (9,)]

    def groups(params):
        return [{"params": [params[0]], "weight_decay": 0.2, "beta1": 0.8},
                {"params": [params[1]], "beta2": 0.9, "epsilon": 1e-6}]

    ours_p, stock_p = twin_parameters(shapes)
    ours = FastAdamW(learning_rate=0.05, parameters=groups(ours_p))
    stock = paddle.optimizer.AdamW(learning_rate=0.05, parameters=groups(stock_p))
    step_twins(ours, stock, ours_p, stock_p, 4, 4)
    assert_same_state(ours, stock, ours_p, stock_p, 4, 0.05)


@pytest.mark.parametrize("clip_norm", [1e-2, 1e6], ids=["clipping", "not_clipping"])
@pytest.mark.parametrize("auto_skip_clip", [False, True], ids=["always", "auto_skip"])
def test_global_norm_clip_is_fused_and_matches_stock(clip_norm, auto_skip_clip, kernel_calls):
    """The coefficient is Paddle's; the kernel applies it to every gradient whose parameter has
    need_clip (not to need_clip=False ones); .grad keeps its unclipped values."""
    shapes = [(8, 5), (5,), (3,)]
    ours_p, stock_p = twin_parameters(shapes)
    for params in (ours_p, stock_p):
        params[2].need_clip = False

    def make(cls, params):
        return cls(learning_rate=0.01, parameters=params,
                   grad_clip=paddle.nn.ClipGradByGlobalNorm(clip_norm, auto_skip_clip=auto_skip_clip))

    ours, stock = make(FastAdamW, ours_p), make(paddle.optimizer.AdamW, stock_p)
    def grad_unclipped(grads):
        np.testing.assert_array_equal(ours_p[0].grad.numpy(), grads[0].numpy())

    step_twins(ours, stock, ours_p, stock_p, 4, 5, 3.0, after_step=grad_unclipped)
    assert_same_state(ours, stock, ours_p, stock_p, 4, 0.01)
    assert kernel_calls() == {OP: 12}
    assert not ours.deferred


def test_global_norm_clip_reaches_parameters_that_take_paddles_update(monkeypatch, kernel_calls):
    """A parameter the kernel does not take (simulated: on the CPU every configuration stock Paddle
    runs is one the kernel takes; float64 beside float32 parameters fails in Paddle itself, whose
    learning rate takes the first parameter's dtype) gets Paddle's update of its gradient scaled by
    the same coefficient, as Paddle's clip would have scaled it."""
    shapes = [(6,), (4, 3)]
    ours_p, stock_p = twin_parameters(shapes)
    taken_by_paddle = ours_p[1].name
    original = FastAdamW._parameter_reason

    def reason(self, param, *args):
        return "simulated" if param.name == taken_by_paddle else original(self, param, *args)

    monkeypatch.setattr(FastAdamW, "_parameter_reason", reason)
    ours = FastAdamW(learning_rate=0.01, parameters=ours_p, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.1))
    stock = paddle.optimizer.AdamW(learning_rate=0.01, parameters=stock_p,
                                   grad_clip=paddle.nn.ClipGradByGlobalNorm(0.1))
    step_twins(ours, stock, ours_p, stock_p, 3, 6, 2.0)
    assert ours.deferred == {"simulated": 3} and kernel_calls() == {OP: 3}
    assert_same_state(ours, stock, ours_p, stock_p, 3, 0.01)


def test_clip_by_value_runs_paddles_clip_then_the_kernel(kernel_calls):
    ours, stock, ours_p, stock_p = run_twins(
        [(7, 3)], steps=3, grad_scale=4.0, learning_rate=0.01,
        grad_clip=paddle.nn.ClipGradByValue(0.5))
    assert_same_state(ours, stock, ours_p, stock_p, 3, 0.01)
    assert kernel_calls() == {OP: 3}


@pytest.mark.parametrize("dtype", [paddle.bfloat16, paddle.float16], ids=["bf16", "fp16"])
def test_16bit_parameters_with_master_weights_follow_fp32_adamw(dtype, kernel_calls):
    """multi_precision: the fp32 masters follow stock AdamW on fp32 copies given the same (upcast)
    gradients, the parameters are the masters rounded (Paddle's CPU build has no 16-bit AdamW
    kernel, so stock Paddle runs the fp32 copies)."""
    shapes = [(33, 7), (4097,)]
    rng = np.random.default_rng(7)
    values = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    ours_p = [parameter(paddle.to_tensor(v).astype(dtype).astype("float32").numpy(), dtype) for v in values]
    stock_p = [parameter(p.astype("float32").numpy()) for p in ours_p]
    ours = FastAdamW(learning_rate=0.01, parameters=ours_p, multi_precision=True,
                     grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    stock = paddle.optimizer.AdamW(learning_rate=0.01, parameters=stock_p,
                                   grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    for _ in range(5):
        grads = [g.astype(dtype) for g in random_grads(shapes, rng)]
        set_grads(ours_p, grads)
        set_grads(stock_p, [g.astype("float32") for g in grads])
        ours.step()
        stock.step()
        for p in ours_p:
            master = ours._master_weights[p.name]
            assert p.dtype == dtype and master.dtype == paddle.float32
            np.testing.assert_array_equal(p.astype("float32").numpy(),
                                          master.astype(dtype).astype("float32").numpy())
    assert_same_state(ours, stock, ours_p, stock_p, 5, 0.01)
    assert kernel_calls() == {OP: 10}


def one_step_reference(param, grad, lr, state, master=None, **hyper):
    """adamw_ref in float64 from the same state the kernel starts from."""
    m1, m2, b1, b2 = state
    return adamw_ref(param, grad, lr, m1, m2, b1, b2, master, **hyper)


def fresh_state(n, beta1=0.9, beta2=0.999):
    return [paddle.zeros([n]), paddle.zeros([n]), paddle.to_tensor([beta1]), paddle.to_tensor([beta2])]


@pytest.mark.parametrize("dtype", [paddle.bfloat16, paddle.float16, paddle.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("with_master", [True, False], ids=["master", "no_master"])
@pytest.mark.parametrize("fp32_grad", [False, True], ids=["grad_like_param", "fp32_grad"])
@pytest.mark.parametrize("n", [1, 7, 4097], ids=str)
def test_update_matches_reference_step_by_step(dtype, with_master, fp32_grad, n):
    """Each step against adamw_ref (float64) from the kernel's own state. A 16-bit parameter
    without a master is rounded every step: where the fp32 value straddles a rounding boundary it
    lands one ulp (2^-7 relative for bf16, 2^-10 for fp16) from the rounded float64 value, inside
    the dtype's row of the table; masters and moments: the fp32 row."""
    rng = np.random.default_rng(n)
    param = paddle.to_tensor(rng.standard_normal(n).astype(np.float32)).astype(dtype)
    master = param.astype("float32") if with_master else None
    state = fresh_state(n)
    lr = paddle.to_tensor([0.05])
    hyper = dict(weight_decay=0.1, epsilon=1e-6)
    for _ in range(3):
        grad = paddle.to_tensor(rng.standard_normal(n).astype(np.float32))
        grad = grad if fp32_grad else grad.astype(dtype)
        ref = one_step_reference(param, grad, lr, state, master, **hyper)
        adamw_update_(param, grad, lr, *state, master, **hyper)
        assert_close(param, ref[0], dtype, "param")
        if with_master:
            assert_close(master, ref[1], paddle.float32, "master")
        assert_close(state[0], ref[2], paddle.float32, "moment1")
        assert_close(state[1], ref[3], paddle.float32, "moment2")
        for mine, expected in zip(state[2:], ref[4:]):
            np.testing.assert_allclose(mine.numpy(), expected.numpy(), rtol=ADAMW_BETA_POW_RTOL)


def test_grad_scale_multiplies_the_gradient_first():
    n = 129
    rng = np.random.default_rng(8)
    param = paddle.to_tensor(rng.standard_normal(n).astype(np.float32))
    grad = paddle.to_tensor(rng.standard_normal(n).astype(np.float32))
    scale = paddle.to_tensor([0.37])
    state = fresh_state(n)
    ref = one_step_reference(param, grad, paddle.to_tensor([0.1]), state, grad_scale=scale)
    adamw_update_(param, grad, paddle.to_tensor([0.1]), *state, grad_scale=scale)
    assert_close(param, ref[0].astype("float64"), paddle.float32, "param")
    assert_close(state[1], ref[3], paddle.float32, "moment2 (of the scaled gradient)")


def test_nan_and_inf_in_the_gradient_propagate_as_in_paddle():
    ours, stock, ours_p, stock_p = run_twins([(6,)], steps=1, learning_rate=0.01)
    grad = paddle.to_tensor([1.0, float("nan"), -2.0, float("inf"), 0.5, 0.0])
    for p, opt in ((ours_p[0], ours), (stock_p[0], stock)):
        p.grad = grad
        opt.step()
    mine, theirs = ours_p[0].numpy(), stock_p[0].numpy()
    np.testing.assert_array_equal(np.isnan(mine), np.isnan(theirs))
    assert np.isnan(mine[[1, 3]]).all() and np.isfinite(mine[[0, 2, 4, 5]]).all()
    m2 = ours._get_accumulator_master("moment2", ours_p[0]).numpy()
    assert np.isnan(m2[1]) and np.isinf(m2[3])


def test_found_inf_skips_the_whole_step_as_in_paddle(kernel_calls):
    """GradScaler's dygraph path: found_inf set, Paddle skips every update (and the beta powers)
    before any optimizer op runs."""
    ours, stock, ours_p, stock_p = run_twins([(5,)], steps=1, learning_rate=0.01)
    before = [ours_p[0].numpy().copy(), ours._get_accumulator_master("beta1_pow_acc", ours_p[0]).numpy()]
    for p, opt in ((ours_p[0], ours), (stock_p[0], stock)):
        p.grad = paddle.ones([5])
        opt._set_auxiliary_var("found_inf", paddle.to_tensor(True))
        opt.step()
    np.testing.assert_array_equal(ours_p[0].numpy(), before[0])
    np.testing.assert_array_equal(ours._get_accumulator_master("beta1_pow_acc", ours_p[0]).numpy(), before[1])
    assert_same_state(ours, stock, ours_p, stock_p, 1, 0.01)
    assert kernel_calls() == {OP: 1}


@pytest.mark.parametrize("first", ["fast", "stock"])
def test_checkpoints_move_between_fast_and_stock_adamw(first, tmp_path):
    """Three steps with one optimizer, its state_dict saved and loaded by the other, three more:
    the same as six steps of stock AdamW."""
    shapes = [(9, 4), (4,)]
    classes = {"fast": FastAdamW, "stock": paddle.optimizer.AdamW}
    second = "stock" if first == "fast" else "fast"
    rng = np.random.default_rng(9)
    grads = [random_grads(shapes, rng) for _ in range(6)]
    resumed, straight = twin_parameters(shapes)

    def make(cls, params):
        scheduler = paddle.optimizer.lr.StepDecay(0.02, step_size=2, gamma=0.5)
        return cls(learning_rate=scheduler, parameters=params, weight_decay=0.03), scheduler

    def run(opt, scheduler, params, steps):
        for g in steps:
            set_grads(params, g)
            opt.step()
            opt.clear_grad()
            scheduler.step()

    # Each optimizer names its accumulators afresh, as in a new process (a second optimizer of
    # the same parameters in one process would get the next unique names, moment1_1, ...).
    with paddle.utils.unique_name.guard():
        opt, scheduler = make(classes[first], resumed)
        run(opt, scheduler, resumed, grads[:3])
        paddle.save(opt.state_dict(), str(tmp_path / "opt.pdopt"))
    with paddle.utils.unique_name.guard():
        opt, scheduler = make(classes[second], resumed)
        opt.set_state_dict(paddle.load(str(tmp_path / "opt.pdopt")))
        run(opt, scheduler, resumed, grads[3:])
    with paddle.utils.unique_name.guard():
        reference, ref_scheduler = make(paddle.optimizer.AdamW, straight)
        run(reference, ref_scheduler, straight, grads)
    assert opt.get_lr() == reference.get_lr()
    assert_same_state(opt, reference, resumed, straight, 6, 0.02)


def test_master_weight_checkpoint_loads_into_stock_adamw(tmp_path):
    params = [parameter(np.linspace(-1, 1, 12).reshape(3, 4), "bfloat16")]
    ours = FastAdamW(learning_rate=0.01, parameters=params, multi_precision=True)
    set_grads(params, [paddle.ones([3, 4])])
    ours.step()
    saved = ours.state_dict()
    paddle.save(saved, str(tmp_path / "opt.pdopt"))
    stock = paddle.optimizer.AdamW(learning_rate=0.01, parameters=params, multi_precision=True)
    stock.set_state_dict(paddle.load(str(tmp_path / "opt.pdopt")))
    loaded = stock.state_dict()  # stock Paddle cannot step bf16 parameters on the CPU
    assert set(loaded) == set(saved)
    for key, value in saved.items():
        if key == "master_weights":
            for name, master in value.items():
                np.testing.assert_array_equal(loaded[key][name].numpy(), master.numpy())
        else:
            np.testing.assert_array_equal(loaded[key].numpy(), value.numpy())


def test_amsgrad_and_float64_take_paddles_update_with_one_info_line(kernel_calls, info_lines, monkeypatch):
    """One info line per reason, however many parameters and steps take Paddle's update."""
    # Reasons an earlier test already reported count as new here.
    monkeypatch.setattr("paddle_fastffn.optim.adamw._INFORMED", set())
    ours, stock, ours_p, stock_p = run_twins([(4,), (3,)], steps=2, learning_rate=0.01, amsgrad=True)
    assert ours.deferred == {"amsgrad": 4}
    assert info_lines == ["paddle_fastffn: FastAdamW: amsgrad: those parameters take Paddle's own AdamW update"]
    for p, q in zip(ours_p, stock_p):
        np.testing.assert_array_equal(p.numpy(), q.numpy())
    p64 = paddle.create_parameter([3], "float64")
    opt = FastAdamW(parameters=[p64])
    p64.grad = paddle.ones([3], "float64")
    opt.step()
    assert opt.deferred == {"paddle.float64 parameters": 1}
    assert info_lines[1:] == ["paddle_fastffn: FastAdamW: paddle.float64 parameters: those parameters take "
                              "Paddle's own AdamW update"]
    assert kernel_calls() == {}


def test_lr_ratio_on_a_parameter_paddle_would_update_on_the_cpu_raises():
    p64 = paddle.create_parameter([3], "float64")
    opt = FastAdamW(parameters=[p64], lr_ratio=lambda p: 0.5)
    p64.grad = paddle.ones([3], "float64")
    with pytest.raises(NotImplementedError, match="lr_ratio.*decay only"):
        opt.step()


def _args(n=4, dtype="float32"):
    return dict(param=paddle.zeros([n], dtype), grad=paddle.zeros([n], dtype),
                learning_rate=paddle.to_tensor([0.1]), moment1=paddle.zeros([n]),
                moment2=paddle.zeros([n]), beta1_pow=paddle.to_tensor([0.9]),
                beta2_pow=paddle.to_tensor([0.999]))


@pytest.mark.parametrize("change, error, message", [
    (dict(param=paddle.zeros([4], "float64")), TypeError, "`param` must be float32, float16 or bfloat16"),
    (dict(grad=paddle.zeros([5])), ValueError, "`grad` must have the 4 elements of `param`"),
    (dict(grad=paddle.zeros([4], "int32")), TypeError, "`grad` must be"),
    (dict(moment1=paddle.zeros([4], "float16")), TypeError, "`moment1` must be paddle.float32"),
    (dict(moment2=paddle.zeros([3])), ValueError, "`moment2` must have the 4 elements"),
    (dict(learning_rate=paddle.to_tensor([0.1, 0.2])), TypeError, "`learning_rate` must be a one-element float32"),
    (dict(beta1_pow=paddle.to_tensor([0.9], "float64")), TypeError, "`beta1_pow` must be a one-element float32"),
    (dict(grad=[0.0] * 4), TypeError, "`grad` must be a paddle.Tensor"),
], ids=["param_dtype", "grad_size", "grad_dtype", "moment1_dtype", "moment2_size", "lr_shape",
        "beta1_pow_dtype", "grad_type"])
def test_bad_arguments_are_named(change, error, message):
    args = {**_args(), **change}
    with pytest.raises(error, match=message):
        adamw_update_(**args)


def test_the_binding_names_the_argument_too():
    """Past the Python checks (a direct op call), the binding refuses with the argument's name."""
    from paddle_fastffn.optim.adamw import _adamw_op

    a = _args()
    with pytest.raises(Exception, match="`moment2` must have the 4 elements of `param`"):
        _adamw_op(a["param"], a["grad"], a["learning_rate"], a["moment1"], paddle.zeros([3]),
                  a["beta1_pow"], a["beta2_pow"], None, None, 0.9, 0.999, 1e-8, 1.0, 0.01, True)
    with pytest.raises(Exception, match="`grad_scale` must hold one value"):
        _adamw_op(a["param"], a["grad"], a["learning_rate"], a["moment1"], a["moment2"],
                  a["beta1_pow"], a["beta2_pow"], None, paddle.ones([2]), 0.9, 0.999, 1e-8, 1.0,
                  0.01, True)


def test_kernel_statuses_for_bad_pointers_and_dtypes():
    """The C entry point itself: INVALID_ARGUMENT (1) for NULL tensors or n < 0,
    UNSUPPORTED_DTYPE (2) for a float64 parameter or a gradient of a third dtype."""
    import ctypes

    from paddle_fastffn.torch.c_structs import AdamwArgs as Args, Scalar

    _loader.ensure_loaded()
    fn = ctypes.CDLL(str(_loader.library_path())).fastffn_adamw_cpu
    fn.restype = ctypes.c_int
    buf = (ctypes.c_float * 4)()
    p = ctypes.cast(buf, ctypes.c_void_p)

    def status(n=4, param_dtype=0, grad_dtype=0, grad=p):
        args = Args(n, param_dtype, grad_dtype, 0.9, 0.999, 1e-8, 0.0, 1.0, 0, Scalar(0.1, None),
                    Scalar(0.9, None), Scalar(0.999, None), Scalar(1.0, None))
        return fn(args, p, grad, None, p, p)

    assert status() == 0
    assert status(grad=None) == 1 and status(n=-1) == 1
    assert status(param_dtype=3, grad_dtype=3) == 2
    assert status(param_dtype=2, grad_dtype=1) == 2


# --- no device work that changes nothing (core/optimizer.py; the trace test holds the whole step) ---

def test_clear_grad_releases_the_gradients_by_default_and_zero_fills_on_request():
    params, _ = twin_parameters([(5,), (3, 7)])
    opt = FastAdamW(parameters=params)
    set_grads(params, [paddle.ones(p.shape) for p in params])
    opt.step()
    opt.clear_grad()
    assert all(p.grad is None or not p.grad._is_initialized() for p in params)
    set_grads(params, [paddle.ones(p.shape) for p in params])
    opt.clear_grad(set_to_zero=True)
    for p in params:
        np.testing.assert_array_equal(p.grad.numpy(), np.zeros(p.shape, np.float32))


def test_gradient_accumulation_into_released_gradients_is_bit_identical_to_zeroed_ones():
    """The Trainer's gradient_accumulation_steps 4: four backward passes accumulate into the
    gradients released by clear_grad() exactly as into Paddle's zero-filled ones (both FastAdamW,
    so the updates are bit-identical too)."""
    released_model, zeroed_model = twin_models(0)
    released = FastAdamW(learning_rate=3e-3, parameters=released_model.parameters())
    zeroed = FastAdamW(learning_rate=3e-3, parameters=zeroed_model.parameters())
    rng = np.random.default_rng(5)
    for _ in range(3):
        for _ in range(4):
            ids = paddle.to_tensor(rng.integers(0, 11, (3, 9)))
            for model in (released_model, zeroed_model):
                ((model(ids) ** 2).mean() / 4).backward()
        for p, q in zip(released_model.parameters(), zeroed_model.parameters()):
            np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy(), err_msg=p.name)
        released.step()
        zeroed.step()
        released.clear_grad()
        zeroed.clear_grad(set_to_zero=True)
    for p, q in zip(released_model.parameters(), zeroed_model.parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=p.name)


def test_a_schedulers_learning_rate_is_written_only_when_it_changes(monkeypatch):
    """Paddle fills the learning-rate tensor before every step; FastAdamW when the value changed."""
    from paddle_fastffn.optim.adamw import PaddleOptimizerBackend

    writes, fill = [], PaddleOptimizerBackend.fill_
    monkeypatch.setattr(PaddleOptimizerBackend, "fill_",
                        lambda self, t, value: (writes.append(value), fill(self, t, value))[1])
    params, stock_params = twin_parameters([(7,), (5, 3)])
    scheduler = paddle.optimizer.lr.StepDecay(0.01, step_size=2, gamma=0.5)
    stock_scheduler = paddle.optimizer.lr.StepDecay(0.01, step_size=2, gamma=0.5)
    ours = FastAdamW(learning_rate=scheduler, parameters=params)
    stock = paddle.optimizer.AdamW(learning_rate=stock_scheduler, parameters=stock_params)
    rng = np.random.default_rng(2)
    for _ in range(5):
        grads = random_grads([p.shape for p in params], rng)
        set_grads(params, grads)
        set_grads(stock_params, grads)
        ours.step()
        stock.step()
        scheduler.step()
        stock_scheduler.step()
    assert writes == [0.005, 0.0025]  # created with 0.01 at the first step; steps 2 and 4 change it
    assert_same_state(ours, stock, params, stock_params, 5, 0.01)
