"""The FP8 FFN's error budget, shared by the CPU tests of the Paddle FFN (tests/fp8/test_ffn.py,
through tests/tolerances.py) and the GPU tests of the harness's (tests/gpu): pure Python, so the
GPU machine (no Paddle) imports it too.

Norm-wise relative error ||got - ref|| / ||ref|| against an fp32 FFN of the same inputs, for the
composition of fp8/ffn.py and paddle_fastffn/torch/fp8/ffn.py. Rounding to a format with m mantissa
bits leaves a relative error uniform in +-2^-(m+1) times a factor in (1/2, 1] (where the value
sits in its binade): RMS at most eps = 2^-(m+1) / sqrt(3): e4m3 0.036, e5m2 0.072 (the rtol rows
of tests/tolerances.py over sqrt(3)). (Per-tensor scaling keeps random data in the normal range:
e4m3's subnormals start 2^15 below its max.) A GEMM's relative error is the root sum of squares of
its operands' (random errors grow with sqrt(K) like the result does, so they do not average out).
SwiGLU passes u's error and g's times kappa = |d ln silu / d ln g| (<= 1.3, weighted by |h|, for
g ~ N(0, 1)); its derivatives pass d_h's and g's times 1.5.
  gate_up   x, W_gu                          rss(e4, e4)                    0.051
  h         gate_up through SwiGLU, q(h)     rss(1.3 gu, gu, e4)            0.091
  y         h, W_d                           rss(h, e4)                     0.098
  d_h       dy, W_d                          rss(e5, e4)                    0.080
  d_gu      d_h, gate_up through SwiGLU', q  rss(d_h, 1.5 gu, e5)           0.132
  d_x       d_gu, W_gu                       rss(d_gu, e4)                  0.137
  d_W_d     dy, h                            rss(e5, h)                     0.116
  d_W_gu    d_gu, x                          rss(d_gu, e4)                  0.137
A float64 simulation of this composition (exact FP8 and bf16 rounding, current scaling) gave
y 0.066, d_x 0.093, d_W_d 0.080, d_W_gu 0.093 at (64, 256, 688) and (512, 1024, 2752): 0.68 to
0.70 of the estimates (the 1/m factor averages 0.72). Budget: 1.5x the estimates.
"""

import math

EPS = {"e4m3": 2.0**-4 / math.sqrt(3), "e5m2": 2.0**-3 / math.sqrt(3)}
KAPPA_SILU, KAPPA_DSILU = 1.3, 1.5


def rss(*terms):
    return math.sqrt(sum(t * t for t in terms))


def _estimates():
    e4, e5 = EPS["e4m3"], EPS["e5m2"]
    gate_up = rss(e4, e4)
    h = rss(KAPPA_SILU * gate_up, gate_up, e4)
    d_gu = rss(rss(e5, e4), KAPPA_DSILU * gate_up, e5)
    return {"y": rss(h, e4), "d_x": rss(d_gu, e4), "d_w_down": rss(e5, h), "d_w_gate_up": rss(d_gu, e4)}


# {output: the largest norm-wise relative error allowed}: y and the three gradients.
FP8_FFN_BUDGET = {name: 1.5 * value for name, value in _estimates().items()}
