"""The full-depth benchmark's plan, without torch (benchmarks/gpu/bench_full_depth.py runs it on the
GPU; tests/benchmarks_logic/test_full_depth.py checks it on CPU): the models, the two workloads and
their contenders per data layout, the FLOP counts, the memory the persistent state needs, whether
it fits a device, and how an out-of-memory configuration is reported.

LLaMA-2-7B (or Llama-3-8B) at full depth, rows of 4096 tokens:
  lora  LoRA rank 8, alpha 16, on q/k/v/o/gate/up/down; every base weight frozen in bf16.
  full  full fine-tune: bf16 weights and gradients, fp32 master weights and moments.
Every contender steps the same one-pass master-weight AdamW (paddle_fastffn.torch.llama.FusedMasterAdamW) over its
trainable parameters.
"""

from __future__ import annotations

import re

LLAMA2_7B = dict(batch=1, seq=4096, hidden=4096, inter=11008, heads=32, kv_heads=32, layers=32, vocab=32000)
LLAMA3_8B = dict(batch=1, seq=4096, hidden=4096, inter=14336, heads=32, kv_heads=8, layers=32, vocab=128256,
                 rope_theta=500000.0)
MODELS = {"llama2_7b": LLAMA2_7B, "llama3_8b": LLAMA3_8B}
# --data: the real SFT length profiles (benchmarks/sft_lengths.py), packed; or uniform random rows.
PACKED_DATA = ("gsm8k", "oasst1_zh")
DATA = PACKED_DATA + ("uniform",)
LORA_RANK, LORA_ALPHA = 8, 16.0
# PEFT's names of the adapted projections (PaddleNLP's, after unfuse_for_lora, are the same)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Contenders per workload. ours*: FastLlama (the Paddle fast path's composition; under LoRA the
# unfused list, LLAMA_DECODER_LAYER_UNFUSED); FP8 (delayed and current scaling): FP8 on the base GEMMs
# of every projection under LoRA (Paddle's attach_fp8 gives each LoRALinear an Fp8Linear), the FP8
# linears and FP8 FFN in the full fine-tune. hf_liger*: Hugging Face's LlamaForCausalLM patched by
# Liger (rope, RMSNorm, SwiGLU, fused linear cross-entropy); under LoRA wrapped by PEFT's
# get_peft_model (the real package: no stand-in when it cannot be imported). On packed data each peer
# runs in its users' two layouts: _padding_free (one flattened row, flash-attention varlen through
# the collator's cu_seq_lens) and _padded (micro-batches padded to their longest, sdpa).
OURS = ("ours", "ours_fp8_delayed", "ours_fp8_current")
PEER = {"lora": "hf_liger_peft", "full": "hf_liger"}
WORKLOADS = {workload: OURS + (peer,) for workload, peer in PEER.items()}  # uniform rows
# The full fine-tune in the memory modes that fit one 80 GB card: no fp32 master copy, each
# contender stepping the optimizer its users pick there. ours_int8_compensated: FastAdamW's
# low-memory state through the torch binding (FusedMasterAdamW(moments="int8",
# master_weights="compensated"): 8-bit blockwise moments, Kahan-compensated bf16 weights); *_bf16_adamw:
# torch's fused AdamW on the bf16 weights (bf16 moments, updates below a weight's last bit lost: the
# pure-bf16 recipe); hf_liger_adamw8bit: torchao's AdamW8bit on the bf16 weights. The peers run Hugging
# Face's padding-free layout on packed data.
LOW_MEMORY = ("ours_int8_compensated", "ours_fp8_delayed_int8_compensated", "ours_bf16_adamw",
              "hf_liger_bf16_adamw", "hf_liger_adamw8bit")
WORKLOADS["full_low_memory"] = LOW_MEMORY
PEER["full_low_memory"] = "hf_liger"
PACKED_LAYOUTS = ("padding_free", "padded")
# Imported at startup: a missing one is named, and the run stops unless told to go on without it.
PEER_PACKAGES = {"hf_liger": ("transformers", "liger_kernel"),
                 # peft 0.21's requirements beyond torch (Requires-Dist of its wheel), accelerate's too
                 "hf_liger_peft": ("transformers", "liger_kernel", "peft", "accelerate", "psutil", "yaml", "tqdm",
                                   "safetensors", "huggingface_hub", "packaging", "numpy"),
                 "hf_liger_bf16_adamw": ("transformers", "liger_kernel"),
                 "hf_liger_adamw8bit": ("transformers", "liger_kernel", "torchao")}


def contenders(workload: str, packed: bool) -> tuple[str, ...]:
    """The contenders of `workload` on packed SFT data (the peer in both its layouts) or uniform rows."""
    if not packed or workload == "full_low_memory":
        return WORKLOADS[workload]
    return OURS + tuple(f"{PEER[workload]}_{layout}" for layout in PACKED_LAYOUTS)


def data_from(text: str) -> list[str]:
    """'gsm8k,oasst1_zh' -> ['gsm8k', 'oasst1_zh'] (the order given), each one of DATA."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in DATA]
    if not names or unknown:
        raise ValueError(f"data must be a comma-separated subset of {list(DATA)}, got {text!r}")
    return names


def contenders_from(text: str, workloads, data) -> list[str]:
    """'ours,hf_liger' -> ['ours', 'hf_liger'] (bench_full_depth --contenders): each must be a contender of
    one of the workloads on one of the data (the others' rows are not run)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = {c for w in workloads for d in data for c in contenders(w, d in PACKED_DATA)}
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise ValueError(f"--contenders: {unknown or text!r} are not contenders of {', '.join(workloads)} on "
                         f"{', '.join(data)} (they are: {', '.join(sorted(known))})")
    return names


def workloads_from(text: str) -> list[str]:
    """'lora,full' -> ['lora', 'full'] (the order given), each a key of WORKLOADS."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if not names or unknown:
        raise ValueError(f"workloads must be a comma-separated subset of {sorted(WORKLOADS)}, got {text!r}")
    return names


def missing_packages(workloads, importable) -> dict[str, list[str]]:
    """{contender: [modules it needs that importable(name) says cannot be imported]} for the peers of
    `workloads` (only contenders that miss something)."""
    missing = {}
    for workload in workloads:
        for contender in WORKLOADS[workload]:
            absent = [name for name in PEER_PACKAGES.get(contender, ()) if not importable(name)]
            for layout in PACKED_LAYOUTS if absent else ():
                missing[f"{contender}_{layout}"] = absent
            if absent:
                missing[contender] = absent
    return missing


# --- parameters and FLOPs -------------------------------------------------------------------------

def projection_shapes(hidden, inter, heads, kv_heads, **_) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of a decoder layer, by PEFT's name."""
    kv = kv_heads * hidden // heads
    return {"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, hidden),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def parameter_count(hidden, vocab, layers, **shape) -> int:
    """Every parameter of LlamaForCausalLM with an untied head: embedding, per layer the projections
    and two norms, the final norm, the LM head."""
    per_layer = sum(o * i for o, i in projection_shapes(hidden=hidden, **shape).values()) + 2 * hidden
    return 2 * vocab * hidden + layers * per_layer + hidden


def lora_parameter_count(hidden, layers, rank=LORA_RANK, targets=LORA_TARGETS, **shape) -> int:
    """A [r, in] and B [out, r] per adapted projection and layer."""
    shapes = projection_shapes(hidden=hidden, **shape)
    return layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)


def model_flops(batch, seq, hidden, vocab, layers, **shape) -> float:
    """Model FLOPs of one training step, bench_step.step_flops's convention (MFU's): 3x the forward,
    i.e. 6 x (every GEMM weight, the LM head's included) x tokens, plus causal attention at half,
    6 x layers x batch x seq^2 x hidden (QK^T and PV, 2 x 2 x b s^2 h forward, halved, times 3); the
    embedding lookup, norms, elementwise work, the loss's softmax and the optimizer not counted. The
    LoRA workload is quoted in the same model FLOPs (the model's, not the work a LoRA step does;
    lora_executed_flops is that)."""
    tokens = batch * seq
    gemm_weights = layers * sum(o * i for o, i in projection_shapes(hidden=hidden, **shape).values()) + hidden * vocab
    return 6 * gemm_weights * tokens + 6 * layers * batch * seq * seq * hidden


def step_work(workload: str, shape: dict, tokens: int, labelled_tokens: int, segment_lengths=None,
              accumulation: int = 1) -> dict:
    """What one timed step of bench_full_depth computes: `accumulation` forward+backward passes over
    the step's data (packed: its examples' segment_lengths; uniform rows: None), so every count is
    that many times one pass's. executed_flops and nemo_model_flops are None on packed data."""
    if segment_lengths is not None:
        flops, executed, nemo = packed_model_flops(segment_lengths, **shape), None, None
    else:
        flops, nemo = model_flops(**shape), nemo_model_flops(**shape)
        executed = lora_executed_flops(**shape) if workload == "lora" else flops
    per_pass = {"tokens": tokens, "labelled_tokens": labelled_tokens, "model_flops": flops,
                "executed_flops": executed, "nemo_model_flops": nemo}
    return {key: None if value is None else accumulation * value for key, value in per_pass.items()}


def nemo_model_flops(batch, seq, hidden, vocab, layers, heads, kv_heads, inter, **_) -> float:
    """Model FLOPs of one step as NeMo's performance tables count them (NeMo's flops formula for the
    llama2 and llama3 families, nemo/utils/flops_formulas.py):

        batch x seq x layers x hidden^2 x (12 + 12 kv_heads / heads + 18 inter / hidden
                                           + 12 seq / hidden + 6 vocab / (layers x hidden))

    which is model_flops with attention counted in full: 12 x layers x seq x hidden a token (QK^T and PV
    over every position, no causal halving) where model_flops counts 6. It knows no packing: the
    uniform rows it describes are those of NVIDIA's pretraining tables, so the full-depth benchmark
    quotes it for its uniform rows only."""
    return batch * seq * layers * hidden * hidden * (12 + 12 * kv_heads / heads + 18 * inter / hidden
                                                    + 12 * seq / hidden + 6 * vocab / (layers * hidden))


def packed_model_flops(segment_lengths, hidden, vocab, layers, **shape) -> float:
    """model_flops over a packed step: the GEMMs over every real token (the padding segments of a
    per-row layout are not counted) and causal attention within each example, 6 x layers x sum(n^2)
    x hidden (each example attends only to itself)."""
    lengths = [int(n) for n in segment_lengths]
    tokens = sum(lengths)
    gemm_weights = layers * sum(o * i for o, i in projection_shapes(hidden=hidden, **shape).values()) + hidden * vocab
    return 6 * gemm_weights * tokens + 6 * layers * sum(n * n for n in lengths) * hidden


def fits(workload: str, device_bytes: int, **shape) -> dict:
    """Whether the persistent state (persistent_state_bytes) fits `device_bytes` at all, before any
    activation: {"fits", "persistent_state_bytes", "device_bytes", "short_by_bytes"}."""
    need = persistent_state_bytes(workload, **shape)["total"]
    return {"fits": need <= device_bytes, "persistent_state_bytes": need, "device_bytes": int(device_bytes),
            "short_by_bytes": max(0, need - int(device_bytes))}


def lora_executed_flops(batch, seq, hidden, vocab, layers, rank=LORA_RANK, targets=LORA_TARGETS, **shape) -> float:
    """The GEMM work a LoRA step does: each frozen projection and the LM head forward and input
    gradient (4 x weights x tokens, no weight gradient), attention as model_flops counts it, and
    the adapters' forward, input and weight gradients (6 x adapter weights x tokens). Layer 0's
    frozen q/k/v/gate/up input gradients are counted although autograd skips them (its input, the
    frozen embedding's output, needs none): 5 of 224 projection GEMMs' dgrad, under 2%."""
    tokens = batch * seq
    frozen = layers * sum(o * i for o, i in projection_shapes(hidden=hidden, **shape).values()) + hidden * vocab
    adapters = lora_parameter_count(hidden=hidden, layers=layers, rank=rank, targets=targets, **shape)
    return 4 * frozen * tokens + 6 * layers * batch * seq * seq * hidden + 6 * adapters * tokens


# --- memory ---------------------------------------------------------------------------------------

def persistent_state_bytes(workload: str, **shape) -> dict[str, int]:
    """What a contender holds across steps, before activations: bf16 weights; the trainable
    parameters' bf16 gradients, fp32 masters and two fp32 moments (FusedMasterAdamW: 14 bytes per
    trainable parameter on top of its bf16 copy)."""
    weights = parameter_count(**shape)
    if workload == "full_low_memory":  # its heaviest contender's: bf16 compensation, 8-bit moments (~2 B)
        parts = {"weights_bf16": 2 * weights, "gradients_bf16": 2 * weights, "compensation_bf16": 2 * weights,
                 "moments_int8": 2 * weights}
        return {**parts, "total": sum(parts.values())}
    trainable = weights if workload == "full" else lora_parameter_count(**shape)
    parts = {"weights_bf16": 2 * (weights + (trainable if workload == "lora" else 0)),
             "gradients_bf16": 2 * trainable, "master_fp32": 4 * trainable, "moments_fp32": 8 * trainable}
    return {**parts, "total": sum(parts.values())}


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = r"([0-9.]+) (B|KiB|MiB|GiB|TiB)"


def parse_oom(message: str) -> dict:
    """torch's CUDA out-of-memory message -> {requested_bytes, free_bytes, capacity_bytes} (None
    where the message lacks it): "Tried to allocate 1.95 GiB. GPU 0 has a total capacity of
    139.81 GiB of which 1.02 GiB is free. ..."."""
    def size(pattern):
        match = re.search(pattern, message)
        return None if match is None else round(float(match.group(1)) * _UNITS[match.group(2)])
    return {"requested_bytes": size(r"Tried to allocate " + _SIZE),
            "free_bytes": size(r"of which " + _SIZE + r" is free"),
            "capacity_bytes": size(r"total capacity of " + _SIZE)}


def oom_report(message: str, phase: str, allocated_bytes: int | None = None, peak_bytes: int | None = None) -> dict:
    """The row of a configuration that does not fit: what it asked for against what was free when it
    failed (short_by_bytes: a lower bound of the shortfall, later allocations would have needed more),
    in which phase (build, step), and the allocator's figures at that moment."""
    parsed = parse_oom(message)
    requested, free = parsed["requested_bytes"], parsed["free_bytes"]
    short = requested - free if requested is not None and free is not None else None
    return {"oom": True, "phase": phase, **parsed, "short_by_bytes": short, "allocated_bytes": allocated_bytes,
            "peak_bytes_at_oom": peak_bytes, "message": message.split("\n")[0][:400]}


def gib(n) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


def describe_oom(row: dict) -> str:
    """One line for logs and the report: 'OOM in step: asked 1.95 GiB, 1.02 GiB free (short by at
    least 0.93 GiB) of 139.81 GiB'."""
    line = f"OOM in {row['phase']}: asked {gib(row['requested_bytes'])}, {gib(row['free_bytes'])} free"
    if row.get("short_by_bytes") is not None:
        line += f" (short by at least {gib(row['short_by_bytes'])})"
    if row.get("capacity_bytes") is not None:
        line += f" of {gib(row['capacity_bytes'])}"
    return line
