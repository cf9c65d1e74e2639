"""The trace format both sides record and the canonicaliser that makes them comparable (what the
harness times must be what Paddle executes, copies and host reads included).

A recorder (Paddle: tests/integration/trace_paddle.py; torch: tests/gpu/trace_torch.py) turns
everything a framework executes into RawOps, in order; `canonicalise` maps each to zero, one or
more Entries through EQUIVALENCE, the one table that says which framework op is which canonical op
and why. Two sides agree when their canonical entry lists are equal.

An Entry is (category, name, inputs, outputs, role):
- category: kernel (our C entry points, by name), gemm, attention, copy, cast, fill, elementwise,
  reduce, gather, host_read, or unmapped (a framework op the table does not know: it never
  compares equal to anything on the other side, so a new op shows up instead of hiding);
- inputs / outputs: element counts of each operand and result (a GEMM's two operands are sorted,
  since Paddle's [in, out] and torch's [out, in] weight layouts trade the operands of the weight
  gradient; a kernel lists every tensor it touches once, sorted, as inputs: an in-place result is
  not listed twice, and the bindings differ in which buffers they allocate themselves);
- role: forward, backward or optimizer.
Counts, not bytes, are compared: Paddle CPU runs fp32 (it has no bf16 matmul), the GPU harness
bf16. `bytes_moved` gives each entry's bytes in the dtypes its side used, for the report.

Nothing here imports Paddle or torch (the GPU machine imports this file without Paddle).
"""

from __future__ import annotations

import difflib
import json
import re
from typing import NamedTuple

ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
            "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


class RawOp(NamedTuple):
    """One thing a framework executed. source: "api" (a Paddle forward API), "grad" (a Paddle grad
    node), "aten" (a torch ATen op), "kernel" (one of our compiled ops / C entry points),
    "host_read" or "region" (a group collapsed into one op, e.g. Paddle's attention composite).
    inputs / outputs: [dtype, elements] per tensor (None for an absent optional input)."""
    source: str
    name: str
    inputs: list
    outputs: list
    phase: str
    region: str | None = None


class Entry(NamedTuple):
    category: str
    name: str
    inputs: tuple
    outputs: tuple
    role: str
    bytes: int = 0  # not compared (see bytes_moved)

    def key(self):
        return self[:5]


def _counts(tensors) -> tuple:
    return tuple(t[1] for t in tensors if t is not None)


def bytes_moved(raw: RawOp) -> int:
    """Bytes the op reads and writes, in its own dtypes (each operand read once, each result
    written once)."""
    return sum(t[1] * ITEMSIZE.get(t[0], 4) for t in list(raw.inputs) + list(raw.outputs) if t is not None)


# --- the equivalence table ------------------------------------------------------------------------
# name -> (category, canonical name, why). Keys are "paddle:<api or grad node>", "torch:<aten op
# without overload>", or "kernel:<compiled op / C entry point>". A category of None drops the op:
# it only changes metadata in both frameworks (a view), or it is a framework's bookkeeping that
# the other does implicitly. Every drop says why.
VIEW = "a view in both frameworks (Paddle 3.3 stride kernels, torch views): metadata only, no bytes move"
EQUIVALENCE = {
    # our kernels: Paddle custom-op names and the C entry points the harness calls through ctypes.
    # A kernel recorded under its entry point's own name on both sides (fastffn_<name>: the Paddle
    # op named as the C entry point, the harness's c_api.ENTRY_POINTS) is ("kernel", <name>) by
    # _same_kernel, with no row here; the rows are the Paddle ops named otherwise.
    "kernel:fastffn_swiglu_bwd_inplace": ("kernel", "swiglu_bwd", "the Paddle op that writes the C kernel's "
                                                                  "gradient over its input, as the harness's in_place"),
    "kernel:fastffn_swiglu_pair_bwd_inplace": ("kernel", "swiglu_bwd", "the Paddle op that writes the two-input "
                                                                       "gradients over the inputs, as the harness's in_place"),
    "kernel:fastffn_adamw_": ("kernel", "adamw", "the same C kernel (Paddle's in-place op)"),
    "kernel:fastffn_adamw_with_state": ("kernel", "adamw", "the same C kernel over a described state (the torch "
                                                         "harness's entry where it passes param_amax)"),
    # GEMMs
    "paddle:matmul": ("gemm", "gemm", "Paddle's matmul and torch's mm/addmm/bmm: one BLAS GEMM"),
    "paddle:matmul_grad": ("gemm", "gemm", "one GEMM per gradient it writes (d_x, then d_y), as torch's "
                                           "MmBackward runs two mm"),
    "torch:mm": ("gemm", "gemm", "one cuBLAS GEMM"),
    "torch:addmm": ("gemm", "gemm", "one cuBLAS GEMM (the bias/accumulator operand is the output)"),
    "torch:bmm": ("gemm", "gemm", "one cuBLAS GEMM"),
    "torch:matmul": ("gemm", "gemm", "one cuBLAS GEMM"),
    # attention: Paddle CPU has no flash attention; PaddleNLP's scaled_dot_product_attention runs
    # a composite there (transposes, GQA expand, scale, matmul, causal mask, softmax, matmul); on a
    # GPU it is one flash_attn call, for which torch's SDPA kernel stands in.
    "region:attention": ("attention", "attention", "Paddle's flash_attn / SDPA composite (recorded as one region, "
                                                    "forward and its grad nodes) = torch's SDPA kernel"),
    "torch:_scaled_dot_product_flash_attention": ("attention", "attention", "torch's SDPA kernel"),
    "torch:_scaled_dot_product_efficient_attention": ("attention", "attention", "torch's SDPA kernel"),
    "torch:_scaled_dot_product_cudnn_attention": ("attention", "attention", "torch's SDPA kernel"),
    "torch:_flash_attention_forward": ("attention", "attention", "torch's SDPA kernel"),
    "torch:_scaled_dot_product_flash_attention_backward": ("attention", "attention", "torch's SDPA backward kernel"),
    "torch:_scaled_dot_product_efficient_attention_backward": ("attention", "attention", "torch's SDPA backward"),
    "torch:_scaled_dot_product_cudnn_attention_backward": ("attention", "attention", "torch's SDPA backward"),
    "torch:_flash_attention_backward": ("attention", "attention", "torch's SDPA backward kernel"),
    # copies: anything that writes the same values to new memory
    "paddle:split": ("copy", "split", "Paddle 3.3's split writes each part to new memory"),
    "paddle:split_with_num": ("copy", "split", "as split"),
    "paddle:split_grad": ("copy", "concat", "split's backward concatenates the parts' gradients"),
    "paddle:split_with_num_grad": ("copy", "concat", "as split_grad"),
    "paddle:concat": ("copy", "concat", "writes the parts into one tensor"),
    "paddle:concat_grad": ("copy", "split", "concat's backward copies each part's gradient out"),
    "paddle:expand": ("copy", "expand", "Paddle's expand materialises its output"),
    "paddle:expand_grad": ("reduce", "sum", "sums the broadcast gradient back"),
    "paddle:stack": ("copy", "concat", "stack is a concat along a new axis"),
    "paddle:assign": ("copy", "copy", "one copy"),
    "paddle:contiguous": ("copy", "copy", "one copy"),
    "torch:cat": ("copy", "concat", "as Paddle's concat"),
    "torch:stack": ("copy", "concat", "as Paddle's stack"),
    "torch:clone": ("copy", "copy", "one copy"),
    "torch:copy_": ("copy", "copy", "one copy (torch's .contiguous() of a strided view, or an explicit copy_)"),
    "torch:_to_copy": ("cast", "cast", "a dtype conversion (a device move is a host_read, see trace_torch)"),
    "torch:split_with_sizes_copy": ("copy", "split", "as Paddle's split"),
    "torch:expand_copy": ("copy", "expand", "as Paddle's expand"),
    "torch:repeat_interleave": ("copy", "expand", "GQA's repeat of K/V heads: as Paddle's expand"),
    # casts and fills
    "paddle:cast": ("cast", "cast", "a dtype conversion"),
    "paddle:cast_grad": ("cast", "cast", "the cast back of the gradient"),
    "paddle:full": ("fill", "fill", "a new tensor filled with one value"),
    "paddle:full_": ("fill", "fill", "as full, in place"),
    "paddle:full_like": ("fill", "fill", "as full"),
    "paddle:fill_": ("fill", "fill", "as full"),
    "fill:clear_gradient": ("fill", "fill", "Paddle's optimizer.clear_grad(set_to_zero=True) zeroes every .grad in "
                                            "place (FastAdamW releases them in one process; torch's zero_grad() sets None)"),
    "torch:fill_": ("fill", "fill", "as Paddle's full_"),
    "torch:zero_": ("fill", "fill", "as Paddle's full_ with 0"),
    "torch:zeros": ("fill", "fill", "as Paddle's full"),
    "torch:full": ("fill", "fill", "as Paddle's full"),
    "torch:zeros_like": ("fill", "fill", "as Paddle's full_like"),
    "torch:full_like": ("fill", "fill", "as Paddle's full_like"),
    "torch:ones_like": ("fill", "fill", "as Paddle's full_like"),
    "paddle:arange": ("fill", "arange", "an index sequence"),
    "torch:arange": ("fill", "arange", "an index sequence"),
    # gathers of the labelled rows and their backward
    "paddle:nonzero": ("gather", "nonzero", "the labelled rows' indices (a device-to-host size read inside)"),
    "torch:nonzero": ("gather", "nonzero", "as Paddle's nonzero"),
    "paddle:index_elementwise_get": ("gather", "index", "x[indices]: a row gather"),
    "torch:index": ("gather", "index", "x[indices]: a row gather"),
    "paddle:index_elementwise_get_grad": ("gather", "index_backward", "scatters the rows' gradient into zeros"),
    "torch:index_put": ("gather", "index_backward", "IndexBackward0's scatter into zeros (its zeros are a fill)"),
    "torch:index_put_": ("gather", "index_backward", "as index_put"),
    "torch:_index_put_impl_": ("gather", "index_backward", "as index_put"),
    "torch:scalar_tensor": ("fill", "fill", "a one-element tensor of a Python number"),
    "torch:new_zeros": ("fill", "fill", "as Paddle's full"),
    "paddle:embedding": ("gather", "embedding", "rows of the table"),
    "torch:embedding": ("gather", "embedding", "rows of the table"),
    "paddle:embedding_grad": ("gather", "embedding_backward", "scatter-add into the table's gradient"),
    "torch:embedding_dense_backward": ("gather", "embedding_backward", "as Paddle's embedding_grad"),
    # reductions and elementwise ops
    "paddle:sum": ("reduce", "sum", "a sum"),
    "torch:sum": ("reduce", "sum", "a sum"),
    "paddle:squared_l2_norm": ("reduce", "norm", "one gradient's squared norm (ClipGradByGlobalNorm)"),
    "torch:linalg_vector_norm": ("reduce", "norm", "one gradient's norm"),
    "torch:dot": ("reduce", "norm", "g . g, one gradient's squared norm (fp32 accumulation, as squared_l2_norm)"),
    "paddle:all": ("reduce", "all", "a reduction"),
    "paddle:add": ("elementwise", "add", "x + y"),
    "paddle:add_": ("elementwise", "add", "x + y in place"),
    "paddle:add_grad": ("elementwise", "add_grad", "passes the gradient to both addends (a copy where shapes "
                                                   "match: Paddle's add_grad writes both)"),
    "paddle:grad_accumulate": ("elementwise", "add", "autograd adds a tensor's second gradient to the first (torch's "
                                                     "engine: aten add), or a gradient into an existing .grad"),
    "torch:add": ("elementwise", "add", "x + y"),
    "torch:add_": ("elementwise", "add", "x + y in place"),
    "paddle:multiply": ("elementwise", "multiply", "x * y"),
    "torch:mul": ("elementwise", "multiply", "x * y"),
    "torch:mul_": ("elementwise", "multiply", "x * y in place"),
    "paddle:divide": ("elementwise", "divide", "x / y"),
    "torch:div": ("elementwise", "divide", "x / y"),
    "paddle:scale": ("elementwise", "scale", "x * a"),
    "paddle:sqrt": ("elementwise", "sqrt", "sqrt"),
    "torch:sqrt": ("elementwise", "sqrt", "sqrt"),
    "paddle:maximum": ("elementwise", "maximum", "max(x, y)"),
    "torch:maximum": ("elementwise", "maximum", "max(x, y)"),
    "paddle:where": ("elementwise", "where", "select"),
    "torch:where": ("elementwise", "where", "select"),
    "paddle:greater_than": ("elementwise", "compare", "x > y"),
    "torch:gt": ("elementwise", "compare", "x > y"),
    "paddle:not_equal": ("elementwise", "compare", "x != y"),
    "torch:ne": ("elementwise", "compare", "x != y"),
    "paddle:equal": ("elementwise", "compare", "x == y"),
    "torch:eq": ("elementwise", "compare", "x == y"),
    "paddle:bitwise_and": ("elementwise", "and", "x & y"),
    "torch:bitwise_and": ("elementwise", "and", "x & y"),
    "paddle:tril": ("elementwise", "triangle", "a triangular mask"),
    "paddle:triu": ("elementwise", "triangle", "a triangular mask"),
    # host reads
    "host_read:item": ("host_read", "host_read", "a device-to-host read that blocks (Paddle .item(), torch "
                                                 "_local_scalar_dense)"),
    "host_read:numpy": ("host_read", "host_read", "as item"),
    "host_read:tolist": ("host_read", "host_read", "as item"),
    "host_read:__float__": ("host_read", "host_read", "as item"),
    "host_read:__int__": ("host_read", "host_read", "as item"),
    "host_read:__bool__": ("host_read", "host_read", "as item"),
    "torch:_local_scalar_dense": ("host_read", "host_read", "as item"),
    # dropped: views and bookkeeping
    **{f"paddle:{n}": (None, n, VIEW) for n in (
        "reshape", "reshape_", "reshape_grad", "unsqueeze", "unsqueeze_grad", "squeeze", "squeeze_grad", "flatten",
        "flatten_grad", "transpose", "transpose_grad", "slice", "view_shape", "view_dtype")},
    **{f"torch:{n}": (None, n, VIEW) for n in (
        "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "slice", "select", "unsqueeze", "squeeze",
        "expand", "alias", "detach", "as_strided", "split", "split_with_sizes", "unbind", "_reshape_alias",
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh")},
    "paddle:set_value_with_tensor_": ("copy", "copy", "x[a:b] = y: one copy into a slice (the harness's GEMMs "
                                                      "write their slice with out=, no copy)"),
    "paddle:empty": (None, "empty", "an allocation, no kernel (torch's empty is dropped too)"),
    "paddle:GradNodeAccumulation": (None, "accumulate", "hands a leaf its gradient (no kernel for a first gradient)"),
}
# Operands an op takes for their shape only (not read): left out of its entry.
SHAPE_ONLY = {"paddle:embedding_grad": 2}  # the table, for its shape (torch passes num_weights instead)
# Ops whose two operands are one tensor: torch has no squared-norm op, the harness's clip runs
# dot(g, g) (paddle_fastffn/torch/optimizer.py) where Paddle runs squared_l2_norm(g): one operand.
SELF_PRODUCT = {"torch:dot"}


_KERNEL_NAME = re.compile(r"fastffn_([a-z0-9_]+)")


def _same_kernel(key: str):
    """kernel:fastffn_<name> -> the C entry point <name>, the same on both sides (a name with
    anything else in it, e.g. the torch recorder's stray-call note, stays unmapped)."""
    match = _KERNEL_NAME.fullmatch(key.removeprefix("kernel:"))
    return ("kernel", match.group(1), "the same C kernel") if match else None


def _lookup(framework: str, raw: RawOp):
    if raw.source == "kernel":
        key = f"kernel:{raw.name.removesuffix('_cuda')}"
        return EQUIVALENCE.get(key) or _same_kernel(key)
    elif raw.source == "host_read":
        key = f"host_read:{raw.name}"
    elif raw.source in ("region", "fill"):
        key = f"{raw.source}:{raw.name}"
    else:
        key = f"{framework}:{raw.name.split('.')[0]}"
    return EQUIVALENCE.get(key)


def _gemm(raw: RawOp, operands: list, result) -> Entry:
    return Entry("gemm", "gemm", tuple(sorted(_counts(operands))), _counts([result]), raw.phase,
                 bytes_moved(raw._replace(inputs=operands, outputs=[result])))


def canonicalise(raw_ops, framework: str) -> list:
    """The canonical entries of one recorded run ("paddle" or "torch")."""
    entries = []
    for raw in raw_ops:
        if raw.source == "pylayer":  # an autograd container's own record: its ops are recorded one by one
            continue
        found = _lookup(framework, raw)
        if found is None:
            entries.append(Entry("unmapped", f"{framework}:{raw.name}", _counts(raw.inputs), _counts(raw.outputs),
                                 raw.phase, bytes_moved(raw)))
            continue
        category, name, _ = found
        if category is None:
            continue
        if framework == "paddle" and raw.name == "matmul_grad":
            # the grad node's inputs d_out, x, y -> d_x = d_out @ y^T, d_y = x^T @ d_out
            d_out, x, y = raw.inputs[:3]
            for operands, result in (([d_out, y], raw.outputs[0]), ([x, d_out], raw.outputs[1])):
                if result is not None:
                    entries.append(_gemm(raw, operands, result))
            continue
        if category == "gemm":
            entries.append(_gemm(raw, [t for t in raw.inputs if t is not None][-2:], raw.outputs[0]))
            continue
        if category == "kernel":
            # One sorted list of operands: the bindings differ in what they allocate (Paddle's
            # cross-entropy takes its loss buffer as an input, the harness's returns a new one) and
            # in argument order (the harness's rms_norm_fwd takes the residual last).
            entries.append(Entry(category, name, tuple(sorted(_counts(raw.inputs) + _counts(raw.outputs))), (),
                                 raw.phase, bytes_moved(raw)))
            continue
        inputs = list(raw.inputs)
        if f"{framework}:{raw.name}" in SHAPE_ONLY:
            del inputs[SHAPE_ONLY[f"{framework}:{raw.name}"]]
        if f"{framework}:{raw.name}" in SELF_PRODUCT:
            inputs = inputs[:1]
        if category == "fill":
            inputs = []  # a fill reads nothing (Paddle's full_like / full_ and torch's full_like take a tensor)
        counts = _counts(inputs)
        if category == "gather":
            counts = tuple(sorted(counts))  # the frameworks order (values, table, indices) differently
        entries.append(Entry(category, name, counts, _counts(raw.outputs), raw.phase, bytes_moved(raw)))
    return _without_order_the_frameworks_choose(entries)


def _without_order_the_frameworks_choose(entries) -> list:
    """The entries with what each framework orders its own way put in one order, work unchanged:
    - autograd's seed gradient (ones for the loss) opens torch's backward as a one-element fill;
      Paddle makes it in C++ without an op record: dropped on both sides;
    - the two GEMMs of a linear's backward are independent, and Paddle's matmul_grad runs d_x
      first where torch's mm backward runs d_W first: a run of consecutive backward GEMMs is
      compared as a multiset (sorted);
    - the optimizer's per-parameter steps are independent, and the Trainer and the harness list
      parameters in different orders: a run of one optimizer op is compared as a multiset."""
    entries = list(entries)
    first_backward = next((i for i, e in enumerate(entries) if e.role == "backward"), None)
    if (first_backward is not None and entries[first_backward].category == "fill"
            and entries[first_backward].outputs == (1,)):
        del entries[first_backward]

    def unordered(entry):
        if entry.role == "backward" and entry.category == "gemm":
            return ("backward", "gemm")
        if entry.role == "optimizer":
            return ("optimizer", entry.category, entry.name)
        return None

    out, i = [], 0
    while i < len(entries):
        group = unordered(entries[i])
        j = i + 1
        while group is not None and j < len(entries) and unordered(entries[j]) == group:
            j += 1
        out.extend(sorted(entries[i:j], key=lambda e: e.key()) if group is not None else entries[i:j])
        i = j
    return out


# --- documents and comparison ---------------------------------------------------------------------

def document(name: str, entries, shape: dict, framework: str, raw=()) -> dict:
    return {"trace": name, "shape": shape, "recorded_by": framework,
            "entries": [list(e) for e in entries], "raw": [list(r) for r in raw]}


def dumps(doc: dict) -> str:
    """One entry per line, so a diff of the committed file reads entry by entry."""
    head = {k: v for k, v in doc.items() if k not in ("entries", "raw")}
    lines = json.dumps(head, sort_keys=True)[:-1]
    body = []
    for key in ("entries", "raw"):
        rows = ",\n    ".join(json.dumps(r) for r in doc.get(key, []))
        body.append(f'"{key}": [\n    {rows}\n  ]' if rows else f'"{key}": []')
    return lines + ",\n  " + ",\n  ".join(body) + "\n}\n"


def entries_of(doc: dict) -> list:
    """The entries of a document (JSON gives lists; entries hold tuples)."""
    return [Entry(c, n, tuple(i), tuple(o), r, *rest) for c, n, i, o, r, *rest in doc["entries"]]


def format_entry(entry, with_bytes: bool = True) -> str:
    e = entry if isinstance(entry, Entry) else (Entry(*entry) if len(entry) in (5, 6) else entry)
    if isinstance(e, Entry):
        text = f"{e.role:9} {e.category:11} {e.name:20} in={list(e.inputs)} out={list(e.outputs)}"
        return text + (f" bytes={e.bytes}" if with_bytes else "")
    return " ".join(map(str, e))


def difference(expected, actual, context: int = 3) -> str | None:
    """None when the two entry lists are equal (bytes aside); else a message that names the first
    differing entry, with a few entries around it and a unified diff of the whole lists."""
    keys_e, keys_a = [e.key() for e in expected], [a.key() for a in actual]
    if keys_e == keys_a:
        return None
    first = next((i for i, (e, a) in enumerate(zip(keys_e, keys_a)) if e != a), min(len(keys_e), len(keys_a)))
    show = lambda rows, i: format_entry(rows[i]) if i < len(rows) else "(end of trace)"  # noqa: E731
    around = range(max(0, first - context), first + context + 1)
    lines = [f"traces differ at entry {first} (expected {len(expected)} entries, got {len(actual)}):",
             f"  expected: {show(expected, first)}", f"  got:      {show(actual, first)}", "context (expected | got):"]
    lines += [f"  {'>' if i == first else ' '} {i:4} {show(expected, i)}\n         | {show(actual, i)}" for i in around]
    diff = difflib.unified_diff([format_entry(e, False) for e in expected], [format_entry(a, False) for a in actual],
                                "expected", "got", n=1, lineterm="")
    lines += ["full diff:"] + list(diff)[:200]
    return "\n".join(lines)


# The packed trace's examples: one flattened row of batch * seq tokens cut into these shares (one
# group of the CPU grouped attention, which pads little: 3 x 44^2 <= 1.25 x sum(len^2)).
PACKED_SHARES = (40, 44, 44)


def packed_batch(shape: dict) -> dict:
    """The packed batch both recorders train (numpy int64, [1, batch * seq]): examples of
    PACKED_SHARES' lengths (scaled to batch * seq tokens), random ids (seeded), labels shifted within
    each example (its last token unlabelled), positions restarting per example, and the collator's
    attn_mask_startend_row_indices [1, 1, tokens, 1] (each token's example end), as the product's
    PackedCollator flattens a batch."""
    import numpy as np

    tokens = shape["batch"] * shape["seq"]
    lengths = [tokens * share // sum(PACKED_SHARES) for share in PACKED_SHARES]
    lengths[-1] += tokens - sum(lengths)
    rng = np.random.default_rng(0)
    ids, labels, positions, ends = [], [], [], []
    start = 0
    for n in lengths:
        example = rng.integers(0, shape["vocab_size"], n)
        ids.append(example)
        labels.append(np.append(example[1:], -100))
        positions.append(np.arange(n))
        ends.append(np.full(n, start + n))
        start += n
    row = lambda parts: np.concatenate(parts).astype(np.int64)[None]  # noqa: E731
    return {"input_ids": row(ids), "labels": row(labels), "position_ids": row(positions),
            "attn_mask_startend_row_indices": row(ends).astype(np.int32).reshape(1, 1, tokens, 1),
            "lengths": lengths}

