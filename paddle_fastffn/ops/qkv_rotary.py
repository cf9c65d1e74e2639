"""TEMPORARY (branch i20-decoder-trace): a pure-Paddle stand-in with the signature of the
qkv_rotary op branch i20-rotary is writing; deleted when that branch is merged."""

import paddle

from .rotary import rotary_embedding


def qkv_rotary(qkv, num_heads, num_kv_heads, cos, sin, position_ids=None):
    b, s, hk, width = qkv.shape
    groups = num_heads // num_kv_heads
    d = width // (groups + 2)
    q = qkv[..., : groups * d].reshape([b, s, num_heads, d])
    k = qkv[..., groups * d: (groups + 1) * d]
    v = qkv[..., (groups + 1) * d:].contiguous()
    q, k = rotary_embedding(q, k, cos, sin, position_ids)
    return q, k, v
