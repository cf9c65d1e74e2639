"""The dtype rows of the one tolerance table (tolerances.py), without a framework: the GPU tests
and the torch CPU smoke (no Paddle there) read them by dtype name; tolerances.py keys them by
Paddle's dtypes."""

# (atol, rtol) per storage dtype, by its name (the same in Paddle and torch).
BY_NAME = {
    # float64 storage computes in double in the CPU kernels: only reduction order differs.
    "float64": (1e-10, 1e-9),
    # fp32 math: fast_expf is within ~2 ulp of expf; row reductions of up to ~1e4 terms add
    # sqrt(n) * 2^-24 relative error, about 1e-6.
    "float32": (1e-5, 1e-5),
    # One rounding to fp16 is 2^-11 (4.9e-4) relative; RMSNorm rounds twice (the normalised row
    # before the weight multiply, as PaddleNLP does), so allow 2 ulp.
    "float16": (1e-3, 2e-3),
    # One rounding to bf16 is 2^-8 (3.9e-3) relative; two roundings (RMSNorm) give 7.8e-3.
    "bfloat16": (1e-2, 1.6e-2),
    # FP8, for a value rounded once to the format, compared in the scaled domain (x * scale, where
    # the FP8 grid lives; saturated values excluded): half an ulp relative in the normal range
    # (e4m3 has 3 mantissa bits: 2^-4; e5m2 2: 2^-3), half the smallest subnormal spacing absolute
    # below it (e4m3 2^-10, e5m2 2^-17).
    # FP8 GEMMs (tests/fp8) derive their budget from these rows. With e = rtol * |a| + atol / scale
    # the error of each operand element, every term of sum_k a_k b_k is off by at most
    # e_a |b| + |a| e_b + e_a e_b: the element-wise bound is that sum over K (the worst case). The
    # norm-wise bound is its random-sign estimate: a rounding error below u has RMS at most
    # u / sqrt(3), K independent terms grow like sqrt(K) as does the result itself, so
    # ||error|| / ||result|| <= sqrt(rtol_a^2 + rtol_b^2) / sqrt(3), i.e. about 2^-4 * sqrt(K) times
    # the typical |a||b| per element for e4m3 x e4m3 (0.051 relative; e4m3 x e5m2: 0.081).
    "float8_e4m3fn": (2.0**-10, 2.0**-4),
    "float8_e5m2": (2.0**-17, 2.0**-3),
}
