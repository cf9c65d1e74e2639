"""An independent numpy reference of AdamW's low-memory state (fastffn/optimizer.h), shared by the
Paddle tests (tests/optim/test_adamw_low_memory.py) and the torch CPU test of the GPU harness
(tests/torch_cpu/test_low_memory_adamw_cpu.py): pure numpy, so the torch environment (no Paddle)
imports it too.

Written from the descriptions, not from the kernel: bitsandbytes' create_dynamic_map as bitsandbytes
writes it (linspace boundaries, their midpoints, a power of ten per decade, sorted), blockwise
absmax quantisation with a nearest-code search over the whole map, the AdamW update in fp32 in the
order of Paddle's CUDA kernel, and Kahan-compensated 16-bit weights. Every operation is an fp32
numpy operation (IEEE, no fused multiply-add), so on the CPU the kernel's results are expected bit
for bit; the tests still compare through the tolerance table.
"""

from __future__ import annotations

import numpy as np

f32 = np.float32
QUANT_BLOCK = 256

# 8-bit codes against this reference: the same fp32 operations give the same codes; an element whose
# m / absmax lies within an fp32 rounding of the midpoint between two map entries may take the other
# one (another compiler's or device's rounding of the update). A wrong map, block or scale moves
# codes by many steps, and most elements by at least one.
ADAMW_8BIT_CODE_STEPS = 1


def dynamic_map(signed: bool) -> np.ndarray:
    """bitsandbytes.functional.create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), in
    float64, sorted, rounded to float32."""
    data = []
    for i in range(7):
        items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        boundaries = np.linspace(0.1, 1, items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += (10.0 ** (-6 + i) * means).tolist()
        if signed:
            data += (-(10.0 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 256
    return np.sort(np.asarray(data)).astype(f32)


def dequantize(codes: np.ndarray, absmax: np.ndarray, signed: bool) -> np.ndarray:
    return dynamic_map(signed)[codes.astype(np.int64)] * np.repeat(absmax.astype(f32), QUANT_BLOCK)[:codes.size]


def quantize(values: np.ndarray, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 codes, float32 absmax per block): the nearest map entry to value / absmax (the first,
    i.e. lower, on a tie), absmax = max |value| of the block; an all-zero block: absmax 0, code of 0."""
    values = values.astype(f32).ravel()
    blocks = -(-values.size // QUANT_BLOCK)
    padded = np.zeros(blocks * QUANT_BLOCK, f32)
    padded[:values.size] = values
    absmax = np.abs(padded.reshape(blocks, QUANT_BLOCK)).max(axis=1)
    scale = np.repeat(absmax, QUANT_BLOCK)[:values.size]
    with np.errstate(invalid="ignore", divide="ignore"):
        x = np.where(scale > 0, values / np.where(scale > 0, scale, f32(1)), f32(0)).astype(f32)
    table = dynamic_map(signed)
    codes = np.argmin(np.abs(table[None, :] - x[:, None]), axis=1)
    return codes.astype(np.uint8), absmax


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even) -> float32 (finite values)."""
    bits = x.astype(f32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(f32)


def to_float16(x: np.ndarray) -> np.ndarray:
    return x.astype(f32).astype(np.float16).astype(f32)


ROUND = {"float32": lambda x: x.astype(f32), "bfloat16": to_bfloat16, "float16": to_float16}


def adamw_fp32(p, g, m1, m2, *, lr, beta1_pow, beta2_pow, beta1, beta2, epsilon, weight_decay):
    """Paddle's CUDA AdamW in fp32 (fastffn/optimizer.h's formula): (p, m1, m2) after one step."""
    beta1, beta2, epsilon = f32(beta1), f32(beta2), f32(epsilon)
    decay = f32(1) - f32(lr) * f32(weight_decay)
    step = -(f32(lr) / (f32(1) - f32(beta1_pow)))
    bias_correction2 = np.sqrt(f32(1) - f32(beta2_pow))
    p = p.astype(f32) * decay
    m1 = beta1 * m1.astype(f32) + (f32(1) - beta1) * g
    m2 = beta2 * m2.astype(f32) + (f32(1) - beta2) * g * g
    denom = np.sqrt(m2) / bias_correction2 + epsilon
    return p + (m1 / denom) * step, m1, m2


def adamw_low_memory_step(state: dict, grad: np.ndarray, dtype: str, **hyper) -> dict:
    """One step of the kernel's contract on a state of numpy arrays (float32 unless said):
    param (float32 values of the dtype), master (or absent), compensation (float32 values of the
    dtype, or absent), and moment1/moment2 (fp32), or codes1/absmax1/codes2/absmax2 (8-bit).
    Returns the new state, same keys."""
    out = dict(state)
    if "master" in state:
        p = state["master"]
    elif "compensation" in state:
        p = state["param"].astype(f32) + state["compensation"].astype(f32)
    else:
        p = state["param"]
    quantized = "codes1" in state
    if quantized:
        m1 = dequantize(state["codes1"], state["absmax1"], True)
        m2 = dequantize(state["codes2"], state["absmax2"], False)
    else:
        m1, m2 = state["moment1"], state["moment2"]
    p, m1, m2 = adamw_fp32(p, grad.astype(f32), m1, m2, **hyper)
    out["param"] = ROUND[dtype](p)
    if "master" in state:
        out["master"] = p
    if "compensation" in state:
        out["compensation"] = ROUND[dtype](p - out["param"])
    if quantized:
        out["codes1"], out["absmax1"] = quantize(m1, True)
        out["codes2"], out["absmax2"] = quantize(m2, False)
    else:
        out["moment1"], out["moment2"] = m1, m2
    return out


def assert_state_close(actual: dict, expected: dict, atol: float, rtol: float, what: str) -> None:
    """Every array of expected against actual: codes within ADAMW_8BIT_CODE_STEPS, the rest within
    (atol, rtol) of the fp32 row (the 16-bit values are compared as fp32 numbers: the kernel and
    the reference round the same fp32 value). NaN never passes."""
    for key, want in expected.items():
        got = np.asarray(actual[key])
        assert got.shape == want.shape, f"{what}: {key} has shape {got.shape}, expected {want.shape}"
        if key.startswith("codes"):
            steps = np.abs(got.astype(np.int64) - want.astype(np.int64))
            worst = int(np.argmax(steps)) if steps.size else 0
            assert steps.size == 0 or steps.max() <= ADAMW_8BIT_CODE_STEPS, (
                f"{what}: {key}[{worst}] is {got.ravel()[worst]}, expected {want.ravel()[worst]} "
                f"({int((steps > ADAMW_8BIT_CODE_STEPS).sum())} codes off by more than {ADAMW_8BIT_CODE_STEPS})")
            continue
        got, want = got.astype(np.float64), want.astype(np.float64)
        assert np.isfinite(got).all(), f"{what}: {key} is not finite at {np.argwhere(~np.isfinite(got))[:5].tolist()}"
        excess = np.abs(got - want) - (atol + rtol * np.abs(want))
        if excess.size and excess.max() > 0:
            worst = int(np.argmax(excess))
            raise AssertionError(f"{what}: {key}: {int((excess > 0).sum())}/{excess.size} out of tolerance, "
                                 f"worst at {worst}: got {got.ravel()[worst]!r}, expected {want.ravel()[worst]!r}")
