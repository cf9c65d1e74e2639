"""Records everything the Paddle fast path executes on CPU, forward and backward, and writes the
expected traces tests/traces/*.json that the GPU harness must also execute (issue 20, item 3).

    python -m tests.integration.trace_paddle --write     # regenerate tests/traces/*.json
    python -m tests.integration.trace_paddle --show decoder_layer  # print one canonical trace

How the recorder sees everything (checked on Paddle 3.3.1 CPU):
- paddle.profiler (record_shapes=True) names every forward API and every grad node with the
  kernels it launches (`matmul_grad kernel launch` under `Global_MatmulGradNode`), but on CPU its
  `input_shapes` / `input_dtypes` stay empty for every event, and a read to the host (`.item()`,
  `.numpy()`) leaves no event at all: no element counts, so no bytes.
- Wrapping `paddle._C_ops` sees the forward APIs with their tensors, but no backward: grad nodes
  run inside the C++ autograd engine and never come back through `_C_ops`.
- Paddle's eager debug log (`paddle.base.core.set_vlog_level(7)`, switchable at run time) prints
  every forward API ("Forward Debug Info") and every grad node ("Running_AD_API_GRAD", then its
  inputs and outputs) with each tensor's dtype and shape (from verbosity 6), and the autograd
  engine's gradient sums, which run outside any grad node (from 7), in execution order. That is
  the recorder: glog writes to file descriptor 2, redirected to a file while recording. Addresses
  in the log tie each grad node to the forward op that created it (regions, below).
Python-level events go into the same stream as marker lines written to descriptor 2, so they
interleave in execution order with the log: our compiled ops (`paddle._C_ops._run_custom_op`,
wrapped; their names, inputs and outputs), reads to the host (Tensor.item / numpy / tolist /
__float__ / __int__ / __bool__, wrapped), the in-place zeroing of gradients by clear_grad
(Tensor.clear_gradient, wrapped: it runs in C++ without a log line), attention as a region
(PaddleNLP's scaled_dot_product_attention, wrapped: on CPU a composite of transposes, a GQA
expand, matmuls, a causal mask and softmax, standing for one flash_attn call on a GPU; its grad
nodes are found by address) and the phase boundaries (forward / backward / optimizer).
Blind spot: work inside a compiled op's C++ binding (allocations, and on CUDA only the rotary
binding's read of its position flag to the host) is not seen; the torch recorder leaves the
harness's binding-side ATen ops out the same way, but records their host reads.
A PyLayer's own record in the log (any PyLayer subclass: _pylayer_names) is dropped by the canonicaliser: the kernels
and ops it runs are recorded one by one.

The traces are built as users build the model: FastFFNTrainingArguments(use_fast_ffn=True), then
LlamaForCausalLM.from_pretrained of a stock checkpoint (tests/integration/parity_matrix.build), and
the optimizer the Trainer creates from those arguments (FastAdamW). Paddle CPU runs fp32 (no bf16
matmul on CPU): the canonical traces compare element counts and op identity; bytes are reported
in each side's dtype (paddle_fastffn/core/trace.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import paddle

from paddle_fastffn.core import trace

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "tests" / "traces"
MARK = "@@fastffn-trace@@"

# The tiny GQA shape both sides run (every GPU kernel accepts it; FP8-aligned widths).
MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
BATCH, SEQ = 2, 64
SHAPE = dict(MODEL, batch=BATCH, seq=SEQ, head_dim=MODEL["hidden_size"] // MODEL["num_attention_heads"])


# --- the recorder --------------------------------------------------------------------------------

def _mark(kind: str, **fields) -> None:
    os.write(2, f"\n{MARK}{json.dumps(dict(kind=kind, **fields))}\n".encode())


def _tensor_info(t):
    if isinstance(t, paddle.Tensor) and t._is_initialized():
        return [str(t.dtype).replace("paddle.", ""), int(np.prod(t.shape)) if t.shape else 1]
    return None


def _address(t):
    return t.data_ptr() if isinstance(t, paddle.Tensor) and t._is_initialized() and t.size else None


def _flat(values):
    for v in values if isinstance(values, (list, tuple)) else [values]:
        if isinstance(v, (list, tuple)):
            yield from _flat(v)
        else:
            yield v


@contextlib.contextmanager
def recording(out: list):
    """Records into `out` the raw entries (trace.RawOp) of everything run inside the block."""
    from paddle.base import core

    originals = {"_run_custom_op": paddle._C_ops._run_custom_op}
    reads = ("item", "numpy", "tolist", "__float__", "__int__", "__bool__")
    originals.update({name: getattr(paddle.Tensor, name) for name in reads + ("clear_gradient",)})
    depth = [0]  # a host read inside another (tolist calls numpy) is one read

    def custom_op(name, *args):
        outputs = originals["_run_custom_op"](name, *args)
        inputs = list(_flat(args))
        read = {_address(a) for a in inputs} - {None}
        # an in-place result (the same memory as an input) is not a second operand
        _mark("kernel", name=name, inputs=[_tensor_info(a) for a in inputs],
              outputs=[_tensor_info(o) for o in _flat(outputs) if _address(o) not in read])
        return outputs

    def clear_gradient(self, set_to_zero=True):
        # Zeroing a gradient in place runs in C++ without a log line: the marker records the fill.
        if set_to_zero and self.grad is not None and self.grad._is_initialized():
            _mark("fill", name="clear_gradient", inputs=[], outputs=[_tensor_info(self.grad)])
        return originals["clear_gradient"](self, set_to_zero)

    inside = [False]  # regions do not nest: the patched attention of a packed batch calls ops.packed_attention

    def attention(function):
        def region(query_states, config, key_states, value_states, *args, **kwargs):
            if inside[0]:
                return function(query_states, config, key_states, value_states, *args, **kwargs)
            inside[0] = True
            _mark("region_begin", name="attention",
                  inputs=[_tensor_info(t) for t in (query_states, key_states, value_states)], outputs=[])
            try:
                out = function(query_states, config, key_states, value_states, *args, **kwargs)
            finally:
                inside[0] = False
            _mark("region_end", name="attention", inputs=[],
                  outputs=[_tensor_info(out[0] if isinstance(out, tuple) else out)])
            return out
        return region

    def packed_region(function):
        """ops.packed_attention as one region, wherever it is called from: on a GPU one
        flash_attn_unpadded call over the segments' cu_seqlens (with its copy of them); on the CPU
        the grouped SDPA that stands for it."""
        def region(q, k, v, segments):
            if inside[0]:
                return function(q, k, v, segments)
            inside[0] = True
            _mark("region_begin", name="attention", inputs=[_tensor_info(t) for t in (q, k, v)], outputs=[])
            try:
                out = function(q, k, v, segments)
            finally:
                inside[0] = False
            _mark("region_end", name="attention", inputs=[], outputs=[_tensor_info(out)])
            return out
        return region

    from paddlenlp.transformers.llama import modeling

    from paddle_fastffn import ops
    from paddle_fastffn.core.rotary import POSITION_CHECK

    originals_sdpa = modeling.scaled_dot_product_attention
    originals_packed = ops.packed_attention

    def host_read(name):
        def read(self, *args, **kwargs):
            depth[0] += 1
            try:
                if depth[0] == 1:
                    _mark("host_read", name=name, inputs=[_tensor_info(self)], outputs=[])
                return originals[name](self, *args, **kwargs)
            finally:
                depth[0] -= 1
        return read

    sys.stderr.flush()
    log = tempfile.TemporaryFile(mode="w+b")
    saved_fd = os.dup(2)
    try:
        paddle._C_ops._run_custom_op = custom_op
        modeling.scaled_dot_product_attention = attention(originals_sdpa)
        ops.packed_attention = packed_region(originals_packed)
        deferred, POSITION_CHECK.defer_on_cpu = POSITION_CHECK.defer_on_cpu, True  # the rotary position flag read once a step, as on a GPU
        for name in reads:
            setattr(paddle.Tensor, name, host_read(name))
        paddle.Tensor.clear_gradient = clear_gradient
        os.dup2(log.fileno(), 2)
        core.set_vlog_level(VERBOSITY)
        yield
    finally:
        core.set_vlog_level(0)
        sys.stderr.flush()
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
        paddle._C_ops._run_custom_op = originals.pop("_run_custom_op")
        modeling.scaled_dot_product_attention = originals_sdpa
        ops.packed_attention = originals_packed
        POSITION_CHECK.defer_on_cpu = deferred
        POSITION_CHECK.pending()  # a recording cut short leaves no flag for the next forward
        for name, function in originals.items():
            setattr(paddle.Tensor, name, function)
        log.seek(0)
        text = log.read().decode(errors="replace")
        if os.environ.get("FASTFFN_TRACE_LOG"):  # the raw log, to debug the parser
            Path(os.environ["FASTFFN_TRACE_LOG"]).write_text(text)
        out.extend(parse_log(text))
        log.close()


def phase(name: str) -> None:
    """Marks where the next phase (forward, backward, optimizer) begins in the recorded stream."""
    _mark("phase", name=name)


# --- the log's grammar ---------------------------------------------------------------------------
# Each glog record starts with its header; inside a PyLayer's forward or backward every line of a
# record is indented by one more tab (the nesting depth), which _dedent removes.
_RECORD = re.compile(r"^(\t*)[IWE]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] ", re.M)
# An operand's TensorInfo sits one tab deep; its gradient's (under ADInfo) deeper: not an operand.
_TENSOR = re.compile(r"^\tTensorInfo: \{ \n\t\tType: \w+,\n\t\tDtype: (\w+),\n\t\tPlace: [^\n]*\n"
                     r"\t\tShape: ([\d, ]*),", re.M)


def _tensors(text: str):
    """[dtype, elements] of each tensor printed at the top level of one Input/Output list (a
    tensor's ADInfo prints its gradient's TensorInfo deeper: those are not operands)."""
    out = []
    for dtype, shape in _TENSOR.findall(text):
        dims = [int(d) for d in shape.replace(" ", "").split(",") if d]
        out.append([dtype, int(np.prod(dims)) if dims else 1])
    return out


def _split_io(body: str):
    """Inputs and outputs of a debug print `... Input: [ ... ] ... Output: [ ... ]`."""
    head, _, tail = body.partition("Output: [")
    return _tensors(head.partition("Input: [")[2]), _tensors(tail)


# Gradient accumulation, which no grad node logs (verbosity 7 shows it): a gradient handed to a
# grad node's input slot that already holds one is added to it ("Add grad_output_tensor ..." with
# the gradient's dims, then the holder's "Add Tensor for buffer_"; a first gradient is moved in
# without that line), and a leaf's GradNodeAccumulation adds into a .grad that holds values
# ("CopyOrAddTensor: Add Tensor"; "Move Copy" is a move).
_HOLDER_GRAD = re.compile(r"Add grad_output_tensor to GradTensorHolder, grad_output_tensor info [^,]*,(\w+), "
                          r"\(([\d, ]*)\)")
_HOLDER_SUM = "GradTensorHolder: Add Tensor for buffer_"
_LEAF_ADD = "CopyOrAddTensor: Add Tensor"
VERBOSITY = 7
_NODE_CREATED = re.compile(r"Create node \w+ addr (0x[0-9a-f]+)")
_NODE_RUNNING = re.compile(r"gradnode_ptr = (0x[0-9a-f]+)")



def _pylayer_names() -> set:
    """The class names of every PyLayer defined so far (ours are built by pylayer(core op)): the eager
    log records a PyLayer's apply as an API of that name, around the ops it runs, which are recorded
    one by one."""
    from paddle.autograd import PyLayer

    names, todo = set(), [PyLayer]
    while todo:
        for sub in todo.pop().__subclasses__():
            names.add(sub.__name__)
            todo.append(sub)
    return names

def parse_log(text: str) -> list:
    """Raw entries, in execution order, from the log and the markers. A region (attention) is the
    forward ops run between its markers and, in backward, the grad nodes those ops created (known
    by address: the log prints each node's address when it is created and when it runs); it
    becomes one RawOp of source "region"."""
    entries, current_phase, grad_name, grad_region = [], "forward", None, None
    region, regions, node_region = None, {}, {}
    last_grad = None
    pieces = _RECORD.split(text)  # [before, indent, record, indent, record, ...]
    for indent, chunk in zip([""] + pieces[1::2], pieces[0::2]):
        chunk = re.sub(f"^{indent}", "", chunk, flags=re.M) if indent else chunk
        for line in chunk.splitlines():
            if not line.startswith(MARK):
                continue
            event = json.loads(line[len(MARK):])
            if event["kind"] == "phase":
                current_phase = event["name"]
            elif event["kind"] == "region_begin":
                region = f"{event['name']}#{len(regions)}"
                regions[region] = event
            elif event["kind"] == "region_end":
                regions[region]["outputs"] = event["outputs"]
                region = None
            else:
                entries.append(trace.RawOp(event["kind"], event["name"], event["inputs"], event["outputs"],
                                           current_phase, region))
        if region is not None:
            for address in _NODE_CREATED.findall(chunk):
                node_region[address] = region
        handed = _HOLDER_GRAD.search(chunk)
        if handed:
            dims = [int(d) for d in handed.group(2).replace(" ", "").split(",") if d]
            last_grad = [handed.group(1), int(np.prod(dims)) if dims else 1]
        elif _HOLDER_SUM in chunk and last_grad is not None:
            entries.append(trace.RawOp("grad", "grad_accumulate", [last_grad, last_grad], [last_grad], current_phase))
            last_grad = None
        if _LEAF_ADD in chunk:
            entries.append(trace.RawOp("grad", "grad_accumulate", [last_grad, last_grad], [last_grad], current_phase))
        running = _NODE_RUNNING.search(chunk)
        if running:
            grad_region = node_region.get(running.group(1))
        if "Forward Debug Info {" in chunk:
            found = re.search(r"API_Name: (\w+?)\d*\s", chunk)
            if found is None:
                raise RuntimeError("unparsed forward record:\n" + chunk[:2000])
            inputs, outputs = _split_io(chunk.partition("Forward Debug Info {")[2])
            kind = "pylayer" if found.group(1) in _pylayer_names() else "api"
            entries.append(trace.RawOp(kind, found.group(1), inputs, outputs, current_phase, region))
        elif "Running_AD_API_GRAD: " in chunk:
            grad_name, grad_region = re.search(r"Running_AD_API_GRAD: (\w+)", chunk).group(1), None
        elif grad_name and " Output: [" in chunk and chunk.lstrip().startswith("{ Input: ["):
            inputs, outputs = _split_io(chunk)
            entries.append(trace.RawOp("grad", grad_name, inputs, outputs, current_phase, grad_region))
            grad_name = None
    return _collapse_regions(entries, regions)


def _collapse_regions(entries, regions) -> list:
    """Each run of entries of one region -> one RawOp: forward (q, k, v) -> out; backward d_out ->
    (d_q, d_k, d_v), with the element counts the region's markers recorded."""
    out = []
    for entry in entries:
        if entry.region is None:
            out.append(entry)
            continue
        if out and out[-1].source == "region" and out[-1].region == entry.region and out[-1].phase == entry.phase:
            continue
        event = regions[entry.region]
        if entry.phase == "forward":
            inputs, outputs = event["inputs"], event["outputs"]
        else:
            inputs, outputs = event["outputs"], event["inputs"]
        out.append(trace.RawOp("region", event["name"], inputs, outputs, entry.phase, entry.region))
    return out


# --- what is recorded ----------------------------------------------------------------------------

def build_model(work_dir: str):
    """(TrainingArguments, model, optimizer) as a user of the Trainer gets them."""
    from paddlenlp.trainer import Trainer

    from tests.integration import parity_matrix

    cell = parity_matrix.Cell("trace", model=MODEL)
    # Saving the stock checkpoint reverts the fast path (save_stock_checkpoint builds a stock model):
    # it must exist before build() enables the fast path through the arguments.
    parity_matrix.stock_checkpoint_dir(MODEL)
    args, model = parity_matrix.build(cell, fast=True, output_dir=work_dir)
    trainer = Trainer(model=model, args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    model.train()
    if type(trainer.optimizer).__name__ != "FastAdamW" or not paddle_fastffn_patched(model):
        raise RuntimeError(f"the fast path is not on: optimizer {type(trainer.optimizer).__name__}")
    return args, model, trainer.optimizer


def paddle_fastffn_patched(model) -> bool:
    from paddle_fastffn.integration.llama import patched_layer_count

    return patched_layer_count(model) == MODEL["num_hidden_layers"]


def batch():
    """input_ids [B, S] and labels shifted by one (the last position ignored), as PaddleNLP's data
    pipeline hands its criterion (and paddle_fastffn/torch/llama.shift_labels)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, MODEL["vocab_size"], size=(BATCH, SEQ))
    labels = np.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    return paddle.to_tensor(ids, dtype="int64"), paddle.to_tensor(labels, dtype="int64")


def record_layer(model) -> list:
    """One decoder layer's forward and backward on hidden states [B, S, H] (causal, no mask: the
    training path's is_causal attention)."""
    layer = model.llama.layers[0]
    paddle.seed(1)
    hidden = paddle.randn([BATCH, SEQ, MODEL["hidden_size"]], dtype="float32")
    hidden.stop_gradient = False
    d_out = paddle.randn([BATCH, SEQ, MODEL["hidden_size"]], dtype="float32")
    raw = []
    with recording(raw):
        phase("forward")
        out = layer(hidden)
        out = out[0] if isinstance(out, tuple) else out
        phase("backward")
        out.backward(d_out)
    return raw


def record_step(model, optimizer, packed=None) -> list:
    """One training step: forward (embedding, every layer, final norm, fused loss), backward, the
    optimizer's step and clear_grad, as the Trainer's training_step and optimizer step run them.
    packed: a packed batch's tensors (packed_batch) in place of the uniform rows."""
    if packed is None:
        ids, labels = batch()
        inputs = {"input_ids": ids, "labels": labels}
    else:
        inputs = packed

    def step():
        loss = model(**inputs)
        (loss[0] if isinstance(loss, tuple) else loss.loss).backward()
        optimizer.step()
        optimizer.clear_grad()

    # The first step also creates the optimizer's moments and beta powers (the harness's
    # FusedMasterAdamW allocates them in its constructor): record the second.
    step()
    raw = []
    with recording(raw):
        phase("forward")
        loss = model(**inputs)
        loss = loss[0] if isinstance(loss, tuple) else loss.loss
        phase("backward")
        loss.backward()
        phase("optimizer")
        optimizer.step()
        optimizer.clear_grad()
    return raw


def packed_batch():
    """core.trace.packed_batch as paddle tensors: one flattened row of three examples, as the
    product's PackedCollator gives a packed batch to the fast path."""
    packed = trace.packed_batch(SHAPE)
    return {key: paddle.to_tensor(packed[key]) for key in
            ("input_ids", "labels", "position_ids", "attn_mask_startend_row_indices")}


def traces() -> dict:
    """{name: canonical trace document} for every committed trace."""
    with tempfile.TemporaryDirectory() as work_dir:
        _, model, optimizer = build_model(work_dir)
        recorded = {"decoder_layer": record_layer(model), "training_step": record_step(model, optimizer),
                    "packed_training_step": record_step(model, optimizer, packed_batch())}
    return {name: trace.document(name, trace.canonicalise(raw, "paddle"), SHAPE, "paddle", raw)
            for name, raw in recorded.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="regenerate tests/traces/*.json")
    parser.add_argument("--show", help="print one trace (decoder_layer, training_step or packed_training_step)")
    parser.add_argument("--raw", action="store_true", help="with --show: the raw Paddle ops, not canonical")
    options = parser.parse_args(argv)
    documents = traces()
    if options.write:
        TRACES.mkdir(parents=True, exist_ok=True)
        for name, document in documents.items():
            (TRACES / f"{name}.json").write_text(trace.dumps(document))
            print(f"wrote tests/traces/{name}.json ({len(document['entries'])} entries)")
    if options.show:
        document = documents[options.show]
        rows = document["raw"] if options.raw else document["entries"]
        print("\n".join(trace.format_entry(e) for e in rows))


if __name__ == "__main__":
    main()
