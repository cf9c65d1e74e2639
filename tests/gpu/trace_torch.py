"""Records everything the GPU harness executes, forward and backward, in the trace format of
paddle_fastffn/core/trace.py, for tests/gpu/test_trace.py to compare with the committed traces
that the Paddle path executes (tests/traces/*.json, written by tests/integration/trace_paddle.py).

What is seen, and how:
- ATen ops, forward and backward (autograd's backward runs below the dispatcher too), through a
  TorchDispatchMode: GEMMs, SDPA, copies (.contiguous(), copy_, cat), casts, fills, elementwise
  ops and reductions. A read to the host is `_local_scalar_dense` (.item(), int(), float()) or a
  copy whose result lies on the CPU (.tolist(), .cpu()); both become host_read entries.
- Our C kernels: the harness calls them through ctypes, which no dispatch mode sees. While
  recording, the methods of c_api.Kernels that call a C entry point (cross_entropy among them),
  are wrapped: each call is one kernel entry named by its C entry point, with the tensors it reads
  and the new tensors it returns (a result in an input's memory is not listed twice). The ATen ops
  inside those methods (allocating outputs, zeroing a flag) are the binding's part, as the Paddle
  bindings' are inside their C++ op, and are not recorded (the Paddle recorder cannot see those);
  their reads to the host are. Every C function of the library is wrapped too: one called from
  anywhere else shows as an unmapped entry, so a new call site cannot go unseen.
- Attention: F.scaled_dot_product_attention is recorded as one region (the Paddle recorder
  records PaddleNLP's attention the same way); its backward is the SDPA backward kernel.
- Under any dispatch mode torch's IndexBackward0 takes its out-of-place index_put path (tensors
  count as subclass-like), which copies the zeros once more inside the op; the recorded op is
  the same one index_backward entry, but a timed run does not make that copy.

The model is paddle_fastffn/torch/llama.FastDecoderLayer / FastLlama + FusedMasterAdamW at the
shape of tests/integration/trace_paddle.SHAPE, bf16.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from paddle_fastffn.core import trace
from paddle_fastffn.core.rotary import POSITION_CHECK
from paddle_fastffn.torch import c_api
from paddle_fastffn.torch import llama as llama_model

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "tests" / "traces"
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.int64: "int64",
          torch.int32: "int32", torch.bool: "bool", torch.float64: "float64", torch.uint8: "uint8"}
# c_api.Kernels methods -> the C entry point each calls (derived in c_api from the methods)
KERNEL_METHODS = c_api.ENTRY_POINTS


def _info(t):
    return [DTYPES.get(t.dtype, str(t.dtype)), t.numel()] if isinstance(t, torch.Tensor) else None


def _tensors(values):
    return [v for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor)]


class Recorder(TorchDispatchMode):
    """Appends trace.RawOps to `ops`; `phase` is set by the caller (forward, backward, optimizer)."""

    def __init__(self):
        super().__init__()
        self.ops, self.phase, self.muted, self.region = [], "forward", 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        # an `out=` tensor is the result, not an operand
        inputs = _tensors((args, {k: v for k, v in (kwargs or {}).items() if k != "out"}))
        outputs = _tensors(out)
        to_host = any(o.device.type == "cpu" for o in outputs) and any(i.is_cuda for i in inputs)
        if name == "_local_scalar_dense" or to_host:
            # a read to the host is recorded even inside a kernel method or attention: it blocks
            self.ops.append(trace.RawOp("host_read", "item", [_info(i) for i in inputs], [], self.phase))
        elif not (self.muted or self.region is not None):
            self.ops.append(trace.RawOp("aten", name, [_info(i) for i in inputs], [_info(o) for o in outputs],
                                        self.phase))
        return out

    def kernel(self, entry_point, function):
        def call(*args, **kwargs):
            self.muted += 1
            try:
                out = function(*args, **kwargs)
            finally:
                self.muted -= 1
            operands = (args, kwargs)
            if entry_point == "fastffn_adamw":
                # The fp32 master copy of a bf16 parameter is the precision's, not the composition's:
                # Paddle's FastAdamW reads one too under AMP O2 on a GPU, while the committed trace
                # is recorded in fp32 on CPU (no master). Left out, as the dtype is.
                operands = (args[:4], {k: v for k, v in kwargs.items() if k != "master"})
            # One entry per tensor: the harness passes one buffer for several slots (the fused qkv as
            # q, k and v; d_qkv as the three outputs), where Paddle's binding takes it once.
            inputs = list({(i.data_ptr(), i.numel(), i.dtype): i for i in _tensors(operands)}.values())
            read = {i.data_ptr() for i in inputs}
            if self.region is None:
                self.ops.append(trace.RawOp("kernel", entry_point, [_info(i) for i in inputs],
                                            [_info(o) for o in _tensors(out) if o.data_ptr() not in read], self.phase))
            return out
        return call

    def attention(self, function):
        def call(q, k, v, *args, **kwargs):
            if self.region is not None:  # inside a region already (the packed reference runs SDPA)
                return function(q, k, v, *args, **kwargs)
            self.region = "attention"
            try:
                out = function(q, k, v, *args, **kwargs)
            finally:
                self.region = None
            self.ops.append(trace.RawOp("region", "attention", [_info(t) for t in (q, k, v)], [_info(out)],
                                        self.phase))
            return out
        return call


    def stray_c_call(self, name, function):
        """A C entry point called outside the wrapped methods (a new call site): recorded by name
        with no operands, as `unmapped`, so the comparison fails until the recorder wraps it."""
        def call(*args):
            if not self.muted:
                self.ops.append(trace.RawOp("kernel", f"{name} (outside c_api.Kernels' recorded methods)", [], [],
                                            self.phase))
            return function(*args)
        return call


@contextlib.contextmanager
def recording():
    """A Recorder active over the block, with the harness's C-kernel calls and attention wrapped."""
    recorder = Recorder()
    kernels = c_api.kernels()
    saved = {name: getattr(kernels, name) for name in KERNEL_METHODS}
    saved_sdpa = F.scaled_dot_product_attention
    saved_packed = llama_model.packed_attention
    # ctypes keeps each C function the library has resolved in its __dict__: all the harness calls
    c_functions = {name: f for name, f in vars(kernels.lib).items()
                   if name.startswith("fastffn_") and name != "fastffn_status_string"}
    try:
        for name, function in c_functions.items():
            setattr(kernels.lib, name, recorder.stray_c_call(name, function))
        for name, entry_point in KERNEL_METHODS.items():
            setattr(kernels, name, recorder.kernel(entry_point, saved[name]))
        F.scaled_dot_product_attention = recorder.attention(saved_sdpa)
        # Packed batches: the composition around the varlen call (reshapes, the per-call copy of
        # cu_seqlens) is one region, as the Paddle recorder takes ops.packed_attention whole.
        llama_model.packed_attention = recorder.attention(saved_packed)
        deferred, POSITION_CHECK.defer_on_cpu = POSITION_CHECK.defer_on_cpu, True  # on the CPU smoke too, the position flag read as on a GPU
        with recorder:
            yield recorder
    finally:
        for name, function in c_functions.items():
            setattr(kernels.lib, name, function)
        for name in KERNEL_METHODS:
            delattr(kernels, name)  # the instance attribute; the class's method shows again
        F.scaled_dot_product_attention = saved_sdpa
        llama_model.packed_attention = saved_packed
        POSITION_CHECK.defer_on_cpu = deferred
        POSITION_CHECK.pending()  # a recording cut short leaves no flag for the next forward


def canonical(raw) -> list:
    """trace.canonicalise for torch, with SDPA's backward kernel taken at its interface (d_out ->
    d_q, d_k, d_v: it also reads q, k, v, out and the log-sum-exp, as Paddle's flash_attn_grad does)."""
    fixed = []
    for op in raw:
        if op.source == "aten" and ("attention" in op.name or "varlen_attn" in op.name) \
                and op.name.endswith("_backward"):
            if "varlen_attn" in op.name:
                # torch's varlen custom op zero-fills the two gradients it drops (the log-sum-exp's and
                # the rng state's: inputs 5 and 8 of its backward) just before its kernel. That is
                # extra work on the torch side (two tiny fills Paddle's flash_attn_unpadded_grad does
                # not make), so leaving it out of the comparison can only flatter Paddle; nothing
                # else is taken: only zero-fills whose output is one of those two inputs.
                dropped = {tuple(op.inputs[i]) for i in (5, 8) if i < len(op.inputs) and op.inputs[i]}
                back = len(fixed)
                while back and fixed[back - 1].source == "aten" and (
                        fixed[back - 1].name in ("detach", "alias")
                        or (fixed[back - 1].name in ("zeros", "zeros_like", "new_zeros", "zero_", "fill_", "empty")
                            and not any(fixed[back - 1].inputs) and fixed[back - 1].outputs[:1]
                            and tuple(fixed[back - 1].outputs[0]) in dropped)):
                    back -= 1
                fixed[back:] = [o for o in fixed[back:] if o.name in ("detach", "alias")]
            op = op._replace(source="region", name="attention", inputs=op.inputs[:1], outputs=op.outputs[:3])
        if op.source == "aten" and op.name in ("index_put", "index_put_", "_index_put_impl_") and fixed \
                and fixed[-1].name in ("zeros", "zeros_like", "zero_", "fill_", "new_zeros") \
                and fixed[-1].outputs[:1] == op.inputs[:1]:
            # IndexBackward0's zeros + scatter: Paddle's index_elementwise_get_grad zeroes inside its
            # kernel, so the zeroing is part of the one index_backward entry on both sides.
            fixed.pop()
        fixed.append(op)
    return trace.canonicalise(fixed, "torch")


# --- the models --------------------------------------------------------------------------------

def hf_model(shape: dict, device="cuda"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                         intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_hidden_layers"],
                         num_attention_heads=shape["num_attention_heads"],
                         num_key_value_heads=shape["num_key_value_heads"],
                         max_position_embeddings=shape["max_position_embeddings"], rms_norm_eps=shape["rms_norm_eps"],
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def _synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def record_layer(shape: dict, device="cuda") -> list:
    from paddle_fastffn.torch.llama import FastDecoderLayer, rope_tables

    hf = hf_model(shape, device)
    layer = FastDecoderLayer(hf.model.layers[0], shape["num_attention_heads"], shape["num_key_value_heads"],
                             shape["rms_norm_eps"]).to(device)
    cos, sin = rope_tables(hf.config, shape["seq"], device)
    hidden = torch.randn(shape["batch"], shape["seq"], shape["hidden_size"], device=device, dtype=torch.bfloat16,
                         requires_grad=True)
    d_out = torch.randn_like(hidden)
    with recording() as recorder:
        out = layer(hidden, cos, sin)
        recorder.phase = "backward"
        out.backward(d_out)
    _synchronize(device)
    return recorder.ops


def record_step(shape: dict, device="cuda", packed=None) -> list:
    """One FastLlama + FusedMasterAdamW training step (the second: the first builds caches and
    tables, as the Paddle trace); packed: a packed batch (trace.packed_batch's lengths) as the
    product's collator gives it, one flattened row with restarting positions and the
    attn_mask_startend_row_indices the model reads to the host."""
    from paddle_fastffn.torch.llama import FastLlama, FusedMasterAdamW, shift_labels

    model = FastLlama(hf_model(shape, device)).to(device)
    optimizer = FusedMasterAdamW(model.parameters(), lr=3e-3, weight_decay=0.01, max_grad_norm=1.0)
    if packed is None:
        ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), device=device)
        labels, extra = shift_labels(ids), {}
    else:
        ids, labels, positions, row_ends = (torch.as_tensor(packed[k], device=device) for k in
                                            ("input_ids", "labels", "position_ids", "attn_mask_startend_row_indices"))
        extra = {"position_ids": positions, "row_ends": row_ends}

    def step():
        model(ids, labels, **extra).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    with recording() as recorder:
        loss = model(ids, labels, **extra)
        recorder.phase = "backward"
        loss.backward()
        recorder.phase = "optimizer"
        optimizer.step()
        optimizer.zero_grad()
    _synchronize(device)
    return recorder.ops


def traces(shape: dict, device="cuda") -> dict:
    """{name: (canonical entries, raw ops)} of the harness at `shape`."""
    recorded = {"decoder_layer": record_layer(shape, device), "training_step": record_step(shape, device),
                "packed_training_step": record_step(shape, device, trace.packed_batch(shape))}
    return {name: (canonical(raw), raw) for name, raw in recorded.items()}


def committed(name: str) -> dict:
    return json.loads((TRACES / f"{name}.json").read_text())
