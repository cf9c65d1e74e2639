"""AdamW's low-memory state (fastffn/optimizer.h: 8-bit blockwise moments, Kahan-compensated 16-bit
weights) on the CPU: the kernel against the independent numpy reference (tests/adamw_low_memory_ref.py)
step by step for every output, FastAdamW's options, checkpoints in stock AdamW's layout both ways
and bit-exact resumes of our own, bad arguments, and a convergence check of the compensation.
Tolerances: tests/tolerances.py."""

import numpy as np
import paddle
import pytest

import adamw_low_memory_ref as ref
from paddle_fastffn.core import optimizer as core_optimizer
from paddle_fastffn.optim import FastAdamW, adamw_update_
from paddle_fastffn.optim.adamw import (QUANT_ABSMAX_KEY, QUANT_CODES_KEY, _adamw_op, dequantize_blockwise,
                                        quantize_blockwise)
from tolerances import COMPENSATED_VS_PLAIN_BF16_DISTANCE_RATIO, TOLERANCES, adamw_tolerance

OP = "fastffn_adamw_"
HYPER = dict(beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.1)
FP32_ROW = TOLERANCES[paddle.float32]
# Three full blocks and an uneven one of 77; one block exactly; a single short block.
SIZES = [3 * 256 + 77, 256, 77]


def numpy_of(t) -> np.ndarray:
    return (t.astype(paddle.float32) if t.dtype in (paddle.bfloat16, paddle.float16) else t).numpy().ravel()


def kernel_state(param, dtype, moments, weights):
    """(Paddle tensors the kernel updates, their numpy twins for the reference) of a fresh state."""
    n = param.size
    tensors = {"param": param}
    if weights == "master":
        tensors["master"] = param.astype(paddle.float32)
    elif weights == "compensated":
        tensors["compensation"] = paddle.zeros([n], dtype)
    if moments == "int8":
        blocks = core_optimizer.absmax_blocks(n)
        tensors.update(codes1=paddle.full([n], 127, paddle.uint8), codes2=paddle.zeros([n], paddle.uint8),
                       absmax1=paddle.zeros([blocks]), absmax2=paddle.zeros([blocks]))
    else:
        tensors.update(moment1=paddle.zeros([n]), moment2=paddle.zeros([n]))
    return tensors, {k: (v.numpy().ravel() if v.dtype == paddle.uint8 else numpy_of(v)) for k, v in tensors.items()}


def kernel_step(tensors, grad, lr, beta_pows):
    int8 = "codes1" in tensors
    adamw_update_(tensors["param"], grad, paddle.to_tensor([lr]),
                  tensors["codes1" if int8 else "moment1"], tensors["codes2" if int8 else "moment2"],
                  *beta_pows, tensors.get("master"), compensation=tensors.get("compensation"),
                  moment1_absmax=tensors.get("absmax1"), moment2_absmax=tensors.get("absmax2"), **HYPER)


def observed(tensors) -> dict:
    return {k: (v.numpy().ravel() if v.dtype == paddle.uint8 else numpy_of(v)) for k, v in tensors.items()}


# (moments, param dtype, where the fp32 weight comes from): every layout with 8-bit moments or a
# compensation (fp32 moments with param or master: tests/optim/test_adamw.py).
LAYOUTS = [("int8", "float32", "param"), ("int8", "bfloat16", "master"), ("int8", "bfloat16", "compensated"),
           ("int8", "float16", "compensated"), ("int8", "bfloat16", "param"), ("fp32", "bfloat16", "compensated"),
           ("fp32", "float16", "compensated")]


@pytest.mark.parametrize("n", SIZES, ids=str)
@pytest.mark.parametrize("moments, dtype, weights", LAYOUTS, ids="-".join)
def test_update_matches_the_numpy_reference_step_by_step(n, moments, dtype, weights, kernel_calls):
    """Every output (param, master or compensation, codes and absmax or fp32 moments) after each of
    four steps, against the reference run from the kernel's own previous state. Block 1 gets zero
    gradients in the first step: an all-zero block (absmax 0, the code of 0.0) that later fills."""
    rng = np.random.default_rng(n)
    param = paddle.to_tensor(rng.standard_normal(n).astype(np.float32)).astype(dtype)
    tensors, expected = kernel_state(param, dtype, moments, weights)
    beta_pows = [paddle.to_tensor([0.9]), paddle.to_tensor([0.999])]
    lr = 1e-3
    for step in range(4):
        grad32 = rng.standard_normal(n).astype(np.float32) * np.float32(10.0 ** -step)
        if step == 0:
            grad32[256:512] = 0
        grad = paddle.to_tensor(grad32).astype(dtype)
        pows = [float(b.item()) for b in beta_pows]
        expected = ref.adamw_low_memory_step(expected, numpy_of(grad), dtype, lr=lr, beta1_pow=pows[0],
                                             beta2_pow=pows[1], **HYPER)
        kernel_step(tensors, grad, lr, beta_pows)
        ref.assert_state_close(observed(tensors), expected, *FP32_ROW, f"{dtype} {weights} {moments} step {step}")
        if step == 0 and moments == "int8" and n > 512:
            assert tensors["absmax1"].numpy()[1] == 0 and (tensors["codes1"].numpy()[256:512] == 127).all()
        expected = observed(tensors)  # the next step starts from the kernel's state
    assert kernel_calls() == {OP: 4}


def test_the_kernels_maps_are_bitsandbytes_dynamic_maps():
    for signed in (True, False):
        np.testing.assert_array_equal(np.asarray(core_optimizer.dynamic_map(signed), np.float32),
                                      ref.dynamic_map(signed))


def test_blockwise_quantisation_in_paddle_ops_matches_the_reference():
    """FastAdamW's checkpoint conversion (quantize_blockwise / dequantize_blockwise) is the kernel's
    rule: an uneven last block, an all-zero block, values spanning seven decades."""
    rng = np.random.default_rng(3)
    values = (rng.standard_normal(3 * 256 + 5) * 10.0 ** rng.uniform(-7, 0, 3 * 256 + 5)).astype(np.float32)
    values[256:512] = 0
    for signed in (True, False):
        x = values if signed else np.abs(values)
        codes, absmax = quantize_blockwise(paddle.to_tensor(x), signed)
        want_codes, want_absmax = ref.quantize(x, signed)
        ref.assert_state_close({"codes": codes.numpy(), "absmax": absmax.numpy()},
                               {"codes": want_codes, "absmax": want_absmax}, *FP32_ROW, f"signed={signed}")
        np.testing.assert_array_equal(dequantize_blockwise(codes, absmax, signed).numpy(),
                                      ref.dequantize(codes.numpy(), absmax.numpy(), signed))


def test_requantising_dequantised_moments_keeps_the_codes_but_not_every_absmax():
    """Why checkpoints carry the codes and absmax: a block whose largest |m1| is negative
    dequantises to a largest |value| of 0.99297 absmax (the signed map ends there, not at -1.0), so
    quantising again gives that block a smaller absmax (the codes stay: 0.7% is less than half of
    any gap between neighbouring entries); m2 (unsigned, its largest element maps to 1.0) comes back
    bit for bit."""
    rng = np.random.default_rng(5)
    m1 = rng.standard_normal(4 * 256).astype(np.float32)
    m1[0] = -10.0  # block 0 is led by a negative value
    m2 = np.abs(m1) ** 2
    for values, signed in ((m1, True), (m2, False)):
        codes, absmax = ref.quantize(values, signed)
        again_codes, again_absmax = ref.quantize(ref.dequantize(codes, absmax, signed), signed)
        np.testing.assert_array_equal(again_codes, codes)
        if signed:
            assert again_absmax[0] == np.float32(ref.dynamic_map(True)[0] * np.float32(-10.0))
            np.testing.assert_array_equal(again_absmax[1:] < absmax[1:], m1.reshape(4, 256)[1:].min(1) ==
                                          -np.abs(m1.reshape(4, 256)[1:]).max(1))
        else:
            np.testing.assert_array_equal(again_absmax, absmax)


# --- FastAdamW ---------------------------------------------------------------------------------

def parameter(values, dtype="float32"):
    """A parameter holding values rounded to dtype (set_value: an Assign initializer given a bf16
    tensor writes its bit patterns as numbers)."""
    values = np.asarray(values, dtype=np.float32)
    param = paddle.create_parameter(list(values.shape), dtype, default_initializer=paddle.nn.initializer.Constant(0.0))
    param.set_value(paddle.to_tensor(values).astype(dtype))
    return param


SHAPES = [(33, 130), (4096,), (7,), (63, 65)]  # 4290, 4096 (at the threshold), 7 and 4095 elements


def make_params(dtype="float32", seed=0, values=None):
    """Parameters of SHAPES (random, or `values`), named as in a new process: a checkpoint of one
    set loads into another by the parameters' names."""
    rng = np.random.default_rng(seed)
    values = values if values is not None else [rng.standard_normal(s) for s in SHAPES]
    with paddle.utils.unique_name.guard():
        return [parameter(v, dtype) for v in values]


def grads_for(params, rng, scale=1.0):
    return [paddle.to_tensor(rng.standard_normal(p.shape).astype(np.float32) * scale) for p in params]


def run(opt, params, grads):
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.astype(p.dtype).clone()
        opt.step()
        opt.clear_grad()


def fresh(cls, params, grads=(), state=None, **options):
    """A new optimizer named as in a new process (its accumulators are named at its first step),
    given `state` (set_state_dict) and then run over grads."""
    with paddle.utils.unique_name.guard():
        opt = cls(learning_rate=0.01, parameters=params, weight_decay=0.05, **options)
        if state is not None:
            opt.set_state_dict(state)
        run(opt, params, grads)
    return opt


def test_small_tensors_keep_fp32_moments_and_the_threshold_is_an_argument():
    params = make_params()
    opt = fresh(FastAdamW, params, [grads_for(params, np.random.default_rng(1))], moments="int8")
    state = opt.state_dict()
    quantized = {k.split("_moment")[0] for k in state if k.endswith(QUANT_CODES_KEY)}
    assert quantized == {params[0].name, params[1].name}  # 4290 and 4096 elements; 7 and 4095 keep fp32
    opt = fresh(FastAdamW, params, [grads_for(params, np.random.default_rng(1))], moments="int8", min_8bit_size=5)
    assert sum(k.endswith(QUANT_CODES_KEY) for k in opt.state_dict()) == 2 * len(params)


@pytest.mark.parametrize("moments, master_weights, dtype",
                         [("int8", "fp32", "float32"), ("int8", "compensated", "bfloat16"),
                          ("fp32", "compensated", "bfloat16"), ("int8", "fp32", "bfloat16")])
def test_save_load_continues_bit_exactly(moments, master_weights, dtype, tmp_path):
    """Ours -> paddle.save -> paddle.load -> a new FastAdamW (as in a new process, set_state_dict
    before its first step) -> three more steps: bit-identical to six uninterrupted steps."""
    rng = np.random.default_rng(11)
    grads = [grads_for(make_params(), rng) for _ in range(6)]
    options = dict(moments=moments, master_weights=master_weights, multi_precision=dtype != "float32")
    straight = make_params(dtype)
    fresh(FastAdamW, straight, grads, **options)
    resumed = make_params(dtype)
    paddle.save(fresh(FastAdamW, resumed, grads[:3], **options).state_dict(), str(tmp_path / "opt.pdopt"))
    fresh(FastAdamW, resumed, grads[3:], paddle.load(str(tmp_path / "opt.pdopt")), **options)
    for a, b in zip(resumed, straight):
        np.testing.assert_array_equal(numpy_of(a), numpy_of(b), err_msg=a.name)


def test_stock_adamw_resumes_from_our_8bit_checkpoint(tmp_path):
    """Stock AdamW loads our state_dict (the dequantised moments under its names) and continues as
    FastAdamW with fp32 moments continues from the same dict: the checkpoint is stock AdamW state."""
    rng = np.random.default_rng(12)
    grads = [grads_for(make_params(), rng) for _ in range(6)]
    params = make_params()
    ours = fresh(FastAdamW, params, grads[:3], moments="int8")
    paddle.save(ours.state_dict(), str(tmp_path / "opt.pdopt"))
    weights = [p.numpy().copy() for p in params]
    results = []
    for cls in (paddle.optimizer.AdamW, FastAdamW):
        resumed = make_params(values=weights)
        fresh(cls, resumed, grads[3:], paddle.load(str(tmp_path / "opt.pdopt")))
        results.append(resumed)
    atol, rtol = adamw_tolerance(3, 0.01)
    for stock, fast in zip(*results):
        np.testing.assert_allclose(fast.numpy(), stock.numpy(), atol=atol, rtol=rtol, err_msg=stock.name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_our_low_memory_state_resumes_from_a_stock_checkpoint(dtype, tmp_path):
    """Stock AdamW's state (fp32 moments; for bf16 multi_precision's fp32 masters, written here by
    FastAdamW's default layout since Paddle's CPU build cannot step bf16) loads into FastAdamW with
    int8 moments (and compensation for bf16): its next step is the reference step from the stock
    state quantised (codes by the reference, compensation = master - weight rounded)."""
    rng = np.random.default_rng(13)
    grads = [grads_for(make_params(), rng) for _ in range(4)]
    params = make_params(dtype)
    multi_precision = dtype != "float32"
    stock = fresh(FastAdamW if multi_precision else paddle.optimizer.AdamW, params, grads[:3],
                  multi_precision=multi_precision)
    paddle.save(stock.state_dict(), str(tmp_path / "opt.pdopt"))
    saved = paddle.load(str(tmp_path / "opt.pdopt"))
    owner = params[0].name + ("_fp32_master_0" if multi_precision else "")
    before = {"param": numpy_of(params[0])}
    before["codes1"], before["absmax1"] = ref.quantize(saved[f"{owner}_moment1_0"].numpy(), True)
    before["codes2"], before["absmax2"] = ref.quantize(saved[f"{owner}_moment2_0"].numpy(), False)
    if multi_precision:
        master = saved["master_weights"][params[0].name].numpy().ravel()
        before["compensation"] = ref.to_bfloat16(master - before["param"])
    pows = [float(saved[f"{owner}_beta{k}_pow_acc_0"].item()) for k in (1, 2)]

    for p, g in zip(params, grads[3]):
        p.grad = g.astype(dtype) if p is params[0] else None
    with paddle.utils.unique_name.guard():
        ours = FastAdamW(learning_rate=0.01, parameters=params, weight_decay=0.05, moments="int8",
                         master_weights="compensated", multi_precision=multi_precision)
        ours.set_state_dict(paddle.load(str(tmp_path / "opt.pdopt")))
        ours.step()
    expected = ref.adamw_low_memory_step(before, numpy_of(grads[3][0].astype(dtype)), dtype, lr=0.01,
                                         beta1_pow=pows[0], beta2_pow=pows[1], **{**HYPER, "weight_decay": 0.05})
    state = ours.state_dict()
    got = {"param": numpy_of(params[0])}
    for k in (1, 2):
        got[f"codes{k}"] = state[f"{owner}_moment{k}_0{QUANT_CODES_KEY}"].numpy()
        got[f"absmax{k}"] = state[f"{owner}_moment{k}_0{QUANT_ABSMAX_KEY}"].numpy()
    if multi_precision:
        got["compensation"] = numpy_of(ours._compensations[params[0].name])
    ref.assert_state_close(got, expected, *FP32_ROW, f"{dtype} resumed from stock")


def test_our_compensated_checkpoint_holds_the_masters_stock_adamw_loads(tmp_path):
    """master_weights of a compensated run: float32(weight) + float32(compensation), under the names
    stock multi_precision AdamW gives its masters; stock AdamW loads them and its moments as they are."""
    params = make_params("bfloat16")
    ours = fresh(FastAdamW, params, [grads_for(params, np.random.default_rng(14)) for _ in range(3)], moments="int8",
                 master_weights="compensated", multi_precision=True)
    saved = ours.state_dict()
    paddle.save(saved, str(tmp_path / "opt.pdopt"))
    for p in params:
        master = saved["master_weights"][p.name]
        assert master.name == f"{p.name}_fp32_master_0" and master.dtype == paddle.float32
        np.testing.assert_array_equal(master.numpy().ravel(),
                                      numpy_of(p) + numpy_of(ours._compensations[p.name]))
    stock = fresh(paddle.optimizer.AdamW, params, state=paddle.load(str(tmp_path / "opt.pdopt")), multi_precision=True)
    loaded = stock.state_dict()  # stock Paddle cannot step bf16 parameters on the CPU
    for key, value in saved.items():
        if key == "master_weights":
            for name, master in value.items():
                np.testing.assert_array_equal(loaded[key][name].numpy(), master.numpy())
        elif not key.endswith((QUANT_CODES_KEY, QUANT_ABSMAX_KEY)):
            np.testing.assert_array_equal(loaded[key].numpy(), value.numpy(), err_msg=key)


@pytest.mark.filterwarnings("ignore:Accumulating with FP16 or BF16")  # Paddle's, for the plain bf16 run
def test_compensated_bf16_tracks_fp32_master_adamw_where_plain_bf16_drifts():
    """A tiny least-squares regression, 300 AdamW steps at lr 1e-3 with bf16 weights: most updates
    are below half a bf16 ulp of the weights. The compensated weights stay next to the fp32-master
    run's; plain bf16 AdamW (no master) loses those updates and drifts."""
    rng = np.random.default_rng(21)
    x = rng.standard_normal((64, 96)).astype(np.float32)
    target = x @ rng.standard_normal((96, 48)).astype(np.float32)
    start = rng.standard_normal((96, 48)).astype(np.float32)
    runs = {}
    for name, options in {"master": dict(multi_precision=True),
                          "compensated": dict(multi_precision=True, master_weights="compensated"),
                          "plain": dict(multi_precision=False)}.items():
        w = parameter(start, "bfloat16")
        opt = FastAdamW(learning_rate=1e-3, parameters=[w], weight_decay=0.0, **options)
        for _ in range(300):
            w32 = numpy_of(w).reshape(start.shape)
            w.grad = paddle.to_tensor(2 * x.T @ (x @ w32 - target) / len(x)).astype("bfloat16")
            opt.step()
        runs[name] = numpy_of(w)
    compensated = np.linalg.norm(runs["compensated"] - runs["master"])
    plain = np.linalg.norm(runs["plain"] - runs["master"])
    assert plain > 0 and compensated <= COMPENSATED_VS_PLAIN_BF16_DISTANCE_RATIO * plain, (compensated, plain)


def test_memory_accounting_per_layout():
    """bytes per element of a 7B-like set (one 16-bit matrix of 2^20 elements, one norm of 4096):
    masters 4 B -> 2 B compensated; moments 8 B -> 2 + 8/256 B for the matrix only."""
    params = [(1 << 20, 2), (4096 - 1, 2)]
    plain = core_optimizer.state_memory(params)
    low = core_optimizer.state_memory(params, core_optimizer.StateFormat("int8", "compensated"))
    n = (1 << 20) + 4095
    assert plain == {"weights": 2 * n, "masters": 4 * n, "moments": 8 * n, "gradients": 2 * n, "total": 16 * n}
    assert low["masters"] == 2 * n
    assert low["moments"] == 2 * ((1 << 20) + 4 * (1 << 20) // 256) + 8 * 4095
    assert low["total"] == low["weights"] + low["masters"] + low["moments"] + low["gradients"]


@pytest.mark.parametrize("change, error, message", [
    (dict(moment1_absmax=None), ValueError, "`moment1_absmax` is needed"),
    (dict(moment2_absmax=paddle.zeros([3])), ValueError, "`moment2_absmax` must be float32 with 2 elements"),
    (dict(moment1_absmax=paddle.zeros([2], "float64")), ValueError, "`moment1_absmax` must be float32"),
    (dict(moment2=paddle.zeros([300])), TypeError, "`moment2` must be paddle.uint8"),
    (dict(compensation=paddle.zeros([300], "float16")), TypeError, "`compensation` must be paddle.bfloat16"),
    (dict(compensation=paddle.zeros([299], "bfloat16")), ValueError, "`compensation` must have the 300 elements"),
    (dict(master_param=paddle.zeros([300])), ValueError, "`master_param` and `compensation` exclude each other"),
])
def test_bad_state_buffers_are_named(change, error, message):
    args = dict(param=paddle.zeros([300], "bfloat16"), grad=paddle.zeros([300], "bfloat16"),
                learning_rate=paddle.to_tensor([0.1]), moment1=paddle.zeros([300], "uint8"),
                moment2=paddle.zeros([300], "uint8"), beta1_pow=paddle.to_tensor([0.9]),
                beta2_pow=paddle.to_tensor([0.999]), compensation=paddle.zeros([300], "bfloat16"),
                moment1_absmax=paddle.zeros([2]), moment2_absmax=paddle.zeros([2]))
    args.update(change)
    with pytest.raises(error, match=message):
        adamw_update_(**args)


def test_the_binding_names_bad_state_buffers_too():
    """The compiled op checks on its own (a caller that skips adamw_update_'s checks)."""
    n = 300
    base = [paddle.zeros([n]), paddle.zeros([n]), paddle.to_tensor([0.1]), paddle.zeros([n], "uint8"),
            paddle.zeros([n], "uint8"), paddle.to_tensor([0.9]), paddle.to_tensor([0.999]), None, None]
    with pytest.raises(Exception, match="`moment1_absmax` is needed with uint8"):
        _adamw_op(*base, 0.9, 0.999, 1e-8, 1.0, 0.0, True, None, None, paddle.zeros([2]))
    with pytest.raises(Exception, match="`moment2_absmax` must have 2 elements"):
        _adamw_op(*base, 0.9, 0.999, 1e-8, 1.0, 0.0, True, None, paddle.zeros([2]), paddle.zeros([3]))
    with pytest.raises(Exception, match="compensation needs a FLOAT16 or BFLOAT16 param"):
        _adamw_op(*base, 0.9, 0.999, 1e-8, 1.0, 0.0, True, paddle.zeros([n]), paddle.zeros([2]), paddle.zeros([2]))


@pytest.mark.parametrize("options, message", [
    (dict(moments="int4"), "`moments` must be one of"),
    (dict(master_weights="bf16"), "`master_weights` must be one of"),
    (dict(min_8bit_size=-1), "`min_8bit_size` must be an int >= 0"),
    (dict(moments="int8", amsgrad=True), "`amsgrad` cannot go with"),
    (dict(master_weights="compensated", lazy_mode=True), "`lazy_mode` cannot go with"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        FastAdamW(parameters=make_params(), **options)
