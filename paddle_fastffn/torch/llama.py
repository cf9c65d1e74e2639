"""The LLaMA of the Paddle fast path, built in the GPU harness from the same kernels and the same
composition, for the benchmarks and the convergence run on the H200 (which has no Paddle):

- FastDecoderLayer: the decoder layer, paddle_fastffn/core/decoder.py (the code the Paddle patch
  runs) executed over this layer's parts, the torch side of its layer-parts protocol; the steps it
  runs are core/decoder_steps.py's lists (tests/integration/test_composition.py checks the Paddle
  side against them, tests/gpu/test_cuda_kernels.py this one). With an Fp8Recipe it runs the FP8
  list (LLAMA_DECODER_LAYER_FP8): qkv_proj and o_proj through fp8_linear, and the FFN as one fp8_ffn
  step (gate_up GEMM -> SwiGLU fused with quantisation -> down GEMM, SwiGLU recomputed), whose C
  calls decoder_steps.fp8_ffn_calls lists (tests/gpu check them; the Paddle FFN is checked against
  the same list on CPU).
- With lora= (LoraSettings): the layer of a PaddleNLP LoRAModel on the fast path, the unfused list
  (LLAMA_DECODER_LAYER_UNFUSED): q/k/v_proj, o_proj, gate/up_proj and down_proj each a LoRA linear
  over its frozen weight (x @ W^T + scaling * ((x @ A^T) @ B^T), PaddleNLP's LoRALinear, the adapter's
  second GEMM accumulating into the base output: core/lora.py), rotary on
  the separate q and k, the two-input SwiGLU between gate/up and down. With an Fp8Recipe as well,
  each of those base GEMMs runs fp8_linear (Paddle's Fp8Linear over a LoRALinear) and the adapters
  stay in bf16.
- FastLlama: embedding, the decoder layers, the final RMSNorm and the fused linear cross-entropy
  (PaddleNLP's LM head layout [H, V] and its criterion: mean over labelled tokens, labels already
  shifted by the data pipeline; only labelled rows reach the head), what the patched
  LlamaForCausalLM computes in a training step. Packed rows (zero_padding) add position ids for
  rotary and the segments' cu_seqlens for attention: one variable-length flash-attention call over
  them (packed_attention: core/packed_attention.py's composition, torch's built-in varlen kernel
  where Paddle calls flash_attn_unpadded).
- MasterWeightAdamW: AdamW over fp32 master copies of 16-bit parameters (PaddleNLP's AMP O2 with
  multi_precision): grads cast into fp32 buffers, torch's fused AdamW, parameters copied back.
- FusedMasterAdamW: the same interface on our one-pass AdamW kernel, stepping the optimizer
  composition Paddle's FastAdamW steps (paddle_fastffn/core/optimizer.py): reads the 16-bit grads
  directly, no fp32 gradient buffers, the global-norm clip fused as a device scalar.

torch supplies cuBLAS GEMMs, SDPA attention, the embedding and the optimizer, standing in for
Paddle's; everything fastffn fuses is the csrc/kernels CUDA code through ctypes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from paddle_fastffn.core import decoder
from paddle_fastffn.core import decoder_steps as COMPOSITION  # the step lists and FP8 call lists
from paddle_fastffn.core.fp8.weight_cache import weights_changed
from paddle_fastffn.core import lora as core_lora
from paddle_fastffn.core import optimizer as core_optimizer
from paddle_fastffn.core import packed_attention as core_packed_attention
from paddle_fastffn.torch import ops
from paddle_fastffn.torch.optimizer import TorchOptimizerBackend, host_beta_pows, new_state

TORCH = ops.BACKEND


@dataclass(frozen=True)
class LoraSettings:
    """PaddleNLP's LoRAConfig as the benchmarks set it: rank r, lora_alpha (scaling = alpha / r, no
    rsLoRA), no dropout, adapters on every projection of the decoder layers (q/k/v/o/gate/up/down)."""
    rank: int = 8
    alpha: float = 16.0

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoraSettings.rank must be a positive integer, got {self.rank!r}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


# The unfused layout's projections: (adapter and FP8-state name, weight attribute, HF sub-layer path).
UNFUSED_PROJECTIONS = (("q", "w_q", "self_attn.q_proj"), ("k", "w_k", "self_attn.k_proj"),
                       ("v", "w_v", "self_attn.v_proj"), ("o", "w_o", "self_attn.o_proj"),
                       ("gate", "w_gate", "mlp.gate_proj"), ("up", "w_up", "mlp.up_proj"),
                       ("down", "w_down", "mlp.down_proj"))


class FastDecoderLayer(torch.nn.Module):
    """The decoder layer of the Paddle fast path: core.decoder.decoder_layer over this layer's
    parts (the methods after _linear, named as core/decoder.py's protocol names them), which hold
    only torch's plumbing. Weights are taken from a Hugging Face LlamaDecoderLayer (copied, fused
    as PaddleNLP fuses them; kept unfused, frozen, with LoRA adapters under lora=).

    variant / mlp_variant: the sub-layers' variants (decoder_steps.ATTENTION_VARIANTS, MLP_VARIANTS);
    steps: the steps a forward runs, in order."""

    def __init__(self, hf_layer, heads, kv_heads, eps, recompute=True, fp8_recipe=None, lora=None):
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.heads, self.kv_heads, self.eps, self.recompute = heads, kv_heads, eps, recompute
        # core.decoder's attention reads the head counts and width under these names.
        self.num_heads, self.num_kv_heads = heads, kv_heads
        self.head_dim = attn.o_proj.weight.shape[1] // heads
        self.lora = lora
        if lora is not None:
            self._init_lora(hf_layer, lora, fp8_recipe)
            return
        cat = lambda *ws: torch.nn.Parameter(torch.cat([w.detach() for w in ws], 0))  # noqa: E731
        # PaddleNLP's interleaved fused qkv_proj (per KV group: its query heads, k head, v head),
        # which ops.qkv_rotary reads in place.
        self.w_qkv = torch.nn.Parameter(ops.fuse_qkv_weight(
            attn.q_proj.weight.detach(), attn.k_proj.weight.detach(), attn.v_proj.weight.detach(),
            heads, kv_heads))
        self.w_o = torch.nn.Parameter(attn.o_proj.weight.detach().clone())
        self.w_gate_up = cat(mlp.gate_proj.weight, mlp.up_proj.weight)
        self.w_down = torch.nn.Parameter(mlp.down_proj.weight.detach().clone())
        self.w_in = torch.nn.Parameter(hf_layer.input_layernorm.weight.detach().clone())
        self.w_post = torch.nn.Parameter(hf_layer.post_attention_layernorm.weight.detach().clone())
        self.fp8, self.frozen_fp8 = None, None
        self.variant, self.mlp_variant = "fused", "fused" if fp8_recipe is None else "fp8"
        if fp8_recipe is not None:
            from paddle_fastffn.torch.fp8.ffn import Fp8FFNState
            from paddle_fastffn.torch.fp8.linear import Fp8LinearState

            device = self.w_qkv.device
            self.fp8 = {"qkv": Fp8LinearState(fp8_recipe, device), "o": Fp8LinearState(fp8_recipe, device),
                        "ffn": Fp8FFNState(fp8_recipe, device)}

    def _init_lora(self, hf_layer, lora, fp8_recipe):
        """LoRAModel's layer: every weight frozen (mark_only_lora_as_trainable), the projections
        unfused, and per projection A [r, in] (Kaiming-uniform, a = sqrt(5)) and B [out, r] (zeros),
        PaddleNLP's LoRALinear initialisation in torch's [out, in] layout (and PEFT's)."""
        self.variant, self.mlp_variant, self.fp8 = "unfused", "unfused", None  # bf16 and FP8 alike
        self.frozen_fp8 = None
        frozen = lambda w: torch.nn.Parameter(w.detach().clone(), requires_grad=False)  # noqa: E731
        self.w_in = frozen(hf_layer.input_layernorm.weight)
        self.w_post = frozen(hf_layer.post_attention_layernorm.weight)
        self.lora_a, self.lora_b = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for name, attribute, path in UNFUSED_PROJECTIONS:
            weight = hf_layer.get_submodule(path).weight
            setattr(self, attribute, frozen(weight))
            a = torch.empty(lora.rank, weight.shape[1], dtype=weight.dtype, device=weight.device)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            self.lora_a[name] = torch.nn.Parameter(a)
            self.lora_b[name] = torch.nn.Parameter(torch.zeros(weight.shape[0], lora.rank, dtype=weight.dtype,
                                                               device=weight.device))
        if fp8_recipe is not None:
            from paddle_fastffn.torch.fp8.linear import Fp8LinearState, freeze_weight

            self.fp8 = {name: Fp8LinearState(fp8_recipe, self.w_in.device) for name, _, _ in UNFUSED_PROJECTIONS}
            if fp8_recipe.frozen_weights != "resident":
                # Each frozen base held only as its forward's FP8 copy; the 16-bit weight moves to
                # host memory (what a merge or a save reads), as the Paddle path's Fp8Linear does.
                self.frozen_fp8 = {}
                for name, attribute, _ in UNFUSED_PROJECTIONS:
                    weight = getattr(self, attribute)
                    self.frozen_fp8[name] = freeze_weight(weight, self.fp8[name],
                                                          both_copies=fp8_recipe.frozen_weights == "fp8_both")
                    weight.data = weight.data.to("cpu", copy=True)

    def invalidate_fp8_weights(self):
        """After each optimizer step: the FP8 weight copies are re-quantised at the next forward.
        Under LoRA the base weights are frozen: their copies stay valid, as Paddle's WeightCache
        keeps a copy until its weight's version changes."""
        if self.lora is not None:
            return
        for state in (self.fp8 or {}).values():
            state.cache.invalidate()

    def fp8_weight_bytes(self) -> tuple[int, int]:
        """(bytes of the frozen weights held only in FP8, bytes of the FP8 copies the weight caches
        hold of the other weights computing in FP8: both stored copies, a byte an element each;
        none for trained weights quantised per use, Fp8Recipe.weight_copies)."""
        if self.fp8 is None:
            return 0, 0
        if self.frozen_fp8 is not None:
            return sum(held.nbytes() for held in self.frozen_fp8.values()), 0
        if not next(iter(self.fp8.values())).recipe.caches_weight(trained=self.lora is None):
            return 0, 0
        if self.lora is not None:
            weights = [getattr(self, attribute) for _, attribute, _ in UNFUSED_PROJECTIONS]
        else:
            weights = [self.w_qkv, self.w_o, self.w_gate_up, self.w_down]
        return 0, sum(2 * w.numel() for w in weights)

    def _linear(self, x, weight, fp8_name):
        """x @ weight^T (FP8 GEMMs with a recipe), plus the LoRA adapter of this projection where
        there is one: core/lora.py's LoraLinear (base and adapter as one node, the adapter's second
        GEMM accumulating into the base output), as the Paddle patch's LoRALinear forward computes
        it for LoRA without dropout."""
        # [tokens, in] rows: each projection's output is then a tensor of its own, which the LoRA sum
        # writes into (core/lora.py)
        rows = TORCH.rows(x)
        frozen = self.frozen_fp8[fp8_name] if self.fp8 is not None and self.frozen_fp8 is not None else None
        if self.lora is not None:
            # The harness's adapters have no dropout and the layer's dtype: LoraLinear, as the Paddle
            # patch runs it for PaddleNLP's default LoRA (core/lora.py fused_applies).
            lora_a, lora_b = self.lora_a[fp8_name], self.lora_b[fp8_name]
            base_weight = None if frozen is not None else weight
            if not core_lora.fused_applies(TORCH, rows, rows, base_weight, None, lora_a, lora_b):
                raise ValueError(f"FastDecoderLayer: the {fp8_name} projection's LoRA needs the adapter's dtypes "
                                 f"({lora_a.dtype}, {lora_b.dtype}) to be the layer's ({rows.dtype}), and no "
                                 f"autocast that changes it")
            fp8_base = None
            if self.fp8 is not None:
                from paddle_fastffn.torch.fp8.linear import fp8_base_of
                fp8_base = fp8_base_of(rows, frozen if frozen is not None else weight, self.fp8[fp8_name])
            base = ops.LoraLinear.apply(rows, base_weight, None, lora_a, lora_b, self.lora.scaling, fp8_base)
        elif self.fp8 is None:
            base = rows @ weight.t()
        else:
            from paddle_fastffn.torch.fp8.linear import fp8_linear
            base = fp8_linear(rows, frozen if frozen is not None else weight, self.fp8[fp8_name])
        return TORCH.reshape(base, (*x.shape[:-1], base.shape[-1]))

    # --- core.decoder's layer parts (its module docstring names them): torch's plumbing only ----------
    @property
    def steps(self) -> tuple:
        return COMPOSITION.decoder_layer_steps(self.variant, self.mlp_variant)

    def input_norm(self, x):
        return ops.RMSNorm.apply(x, self.w_in, self.eps)

    def self_attention(self, x):
        return decoder.attention(TORCH, self, x)

    def qkv(self, x):
        return self._linear(x, self.w_qkv, "qkv")

    def qkv_rotary(self, qkv):
        return ops.qkv_rotary(qkv, self.heads, self.kv_heads, self._cos, self._sin, self._position_ids)

    def q(self, x):
        return self._linear(x, self.w_q, "q")

    def k(self, x):
        return self._linear(x, self.w_k, "k")

    def v(self, x):
        return self._linear(x, self.w_v, "v")

    def rotary(self, q, k):
        return ops.Rotary.apply(q, k, self._cos, self._sin, self._position_ids)

    def attention(self, q, k, v):
        b, s = q.shape[:2]
        if self._packed is not None:  # a packed batch: each example attends to itself
            return packed_attention(q, k, v, self._packed).reshape(b, s, -1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return out.transpose(1, 2).reshape(b, s, -1)

    def o_proj(self, a):
        return self._linear(a, self.w_o, "o")

    def post_norm_add(self, a, residual):
        return ops.AddRMSNorm.apply(a, residual, self.w_post, self.eps)

    def mlp(self, x):
        return decoder.mlp(self, x, self.mlp_variant)

    def gate_up(self, x):
        return x @ self.w_gate_up.t()

    def swiglu_down(self, gate_up):
        return ops.SwiGLUDownProj.apply(gate_up, self.w_down, self.recompute)

    def gate(self, x):
        return self._linear(x, self.w_gate, "gate")

    def up(self, x):
        return self._linear(x, self.w_up, "up")

    def swiglu(self, gate, up):
        return ops.SwiGLUPair.apply(gate, up, True)  # reuse_input_memory: as the Paddle MLP

    def down(self, h):
        return self._linear(h, self.w_down, "down")

    def fp8_ffn(self, x):
        from paddle_fastffn.torch.fp8.ffn import fp8_ffn
        return fp8_ffn(x, self.w_gate_up, self.w_down, self.fp8["ffn"])

    def residual_add(self, residual, y):
        return ops.ResidualAdd.apply(residual, y)

    def forward(self, hidden, cos, sin, position_ids=None, packed=None):
        """core.decoder.decoder_layer over this layer's parts; the rotary tables, positions and
        packed segments (a PackedBatch) are this call's (set here, read by the parts)."""
        self._cos, self._sin, self._position_ids, self._packed = cos, sin, position_ids, packed
        try:
            return decoder.decoder_layer(self, hidden)
        finally:
            self._cos = self._sin = self._position_ids = self._packed = None


def rope_tables(hf_config, seq: int, device="cuda"):
    """fp32 cos/sin [seq, head_dim] from Hugging Face's rotary embedding (its inv_freq and
    attention scaling), what the rotary kernel reads."""
    from transformers.models.llama import modeling_llama

    rope = modeling_llama.LlamaRotaryEmbedding(config=hf_config).to(device)
    probe = torch.zeros(1, seq, 1, device=device, dtype=torch.float32)
    cos, sin = rope(probe, torch.arange(seq, device=device)[None])
    return cos[0].float().contiguous(), sin[0].float().contiguous()


class PackedBatch:
    """The segments of a packed batch as the attention of every layer reads them: the cu_seqlens
    bounds (host int32 [segments + 1] over the flattened batch), copied to the device by the first
    attention call and shared by every layer after it, as the Paddle path's PackedSegments.cu_seqlens_on,
    and the longest segment (a host int, flash-attention's max_seqlen)."""

    def __init__(self, cu_seqlens, tokens: int):
        self.bounds = core_packed_attention.check_cu_seqlens(cu_seqlens, tokens)
        self.longest = int(np.diff(self.bounds).max())
        self._device_cu_seqlens = None

    def cu_seqlens_on(self, device):
        if self._device_cu_seqlens is None or self._device_cu_seqlens.device != torch.device(device):
            self._device_cu_seqlens = torch.as_tensor(self.bounds, device=device)
        return self._device_cu_seqlens


def varlen_flash(q, k, v, cu_seqlens, longest, scale):
    """torch's built-in flash-attention varlen kernel (torch.nn.attention.varlen, torch >= 2.10), the
    contract of Paddle's flash_attn_unpadded: [tokens, heads, d] q, k/v with kv_heads dividing heads
    (native), causal top-left (window (-1, 0)), fp16/bf16 on the GPU, no compilation."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as error:
        raise RuntimeError(f"packed attention needs torch >= 2.10 (torch.nn.attention.varlen); this is torch "
                           f"{torch.__version__}") from error
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, longest, longest, scale=scale, window_size=(-1, 0))


def varlen_reference(q, k, v, cu_seqlens, longest, scale):
    """varlen_flash's contract in plain torch, for fp32 and CPU tensors (flash attention has neither):
    each cu_seqlens interval attends causally to itself through SDPA with native grouped-query heads,
    fp32 math (float64 for float64), the result in q's dtype. Reads the bounds to the host."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    bounds = cu_seqlens.tolist()
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end - start > longest:
            raise ValueError(f"packed_attention: a segment of {end - start} tokens exceeds longest={longest}")
        q_s, k_s, v_s = (t[start:end].to(compute).transpose(0, 1) for t in (q, k, v))
        outputs.append(F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=True, scale=scale,
                                                      enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1))
    return torch.cat(outputs).to(q.dtype)


def packed_attention(q, k, v, packed: PackedBatch):
    """Causal attention of each packed example with itself: core.packed_attention.varlen_attention,
    the composition the Paddle path runs around flash_attn_unpadded, over varlen_flash on the GPU in
    fp16/bf16 and varlen_reference otherwise (as the Paddle op falls back off the GPU).
    q: [b, s, hq, d], k/v: [b, s, hk, d] -> [b, s, hq, d]."""
    cu_seqlens = packed.cu_seqlens_on(q.device)
    return core_packed_attention.varlen_attention(TORCH, varlen_kernel(q), q, k, v, cu_seqlens, packed.longest)


def varlen_kernel(q):
    """varlen_flash for fp16/bf16 CUDA tensors, varlen_reference otherwise."""
    return varlen_flash if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else varlen_reference


class FastLlama(torch.nn.Module):
    """LlamaForCausalLM on the fast path, weights copied from a Hugging Face LlamaForCausalLM.
    forward(input_ids [B, S], labels [B, S] shifted, -100 ignored) -> fp32 scalar loss."""

    def __init__(self, hf_model, recompute=True, fp8_recipe=None, lora=None, layer_recompute=False):
        """lora: LoraSettings for a LoRAModel (every weight frozen, adapters on each projection:
        FastDecoderLayer); layer_recompute: full recompute per decoder layer (the layer's forward
        again in backward, torch.utils.checkpoint; PaddleNLP's recompute_granularity="full"), bf16
        only (the FP8 scaling states would record the recomputed forward a second time)."""
        super().__init__()
        if layer_recompute and fp8_recipe is not None:
            raise ValueError("FastLlama: layer_recompute is not supported with an fp8_recipe (the recomputed forward "
                             "would update the FP8 scaling states twice)")
        config = hf_model.config
        self.config, self.eps, self.layer_recompute = config, config.rms_norm_eps, layer_recompute
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        trainable = lora is None
        self.embed = torch.nn.Parameter(hf_model.model.embed_tokens.weight.detach().clone(), requires_grad=trainable)
        self.layers = torch.nn.ModuleList(
            FastDecoderLayer(layer, heads, kv_heads, self.eps, recompute, fp8_recipe, lora)
            for layer in hf_model.model.layers)
        self.w_norm = torch.nn.Parameter(hf_model.model.norm.weight.detach().clone(), requires_grad=trainable)
        # PaddleNLP's LlamaLMHead keeps [H, V] (an untied head), the layout the fused loss reads.
        self.w_lm_head = torch.nn.Parameter(hf_model.lm_head.weight.detach().t().contiguous(), requires_grad=trainable)
        # The head's GEMMs in FP8 where the recipe asks (Fp8Recipe.lm_head), as the Paddle patch does.
        self.lm_head_fp8 = fp8_recipe if fp8_recipe is not None and fp8_recipe.lm_head == "fp8" else None
        self._rope: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def _tables(self, seq, device):
        if self._rope is None or self._rope[0] < seq:
            self._rope = (seq, *rope_tables(self.config, seq, device))
        return self._rope[1][:seq], self._rope[2][:seq]

    def invalidate_fp8_weights(self):
        for layer in self.layers:
            layer.invalidate_fp8_weights()

    def forward(self, input_ids, labels, position_ids=None, cu_seqlens=None, row_ends=None):
        """A packed batch (Paddle's zero_padding rows) also passes position_ids [B, S] (restarting
        per example, on the device) and its segments: row_ends, the collator's
        attn_mask_startend_row_indices on the device, read to the host and turned into cu_seqlens
        each forward as the Paddle patch does (PackedSegments.from_startend_row_indices), or
        cu_seqlens itself (host int32 [segments + 1] over the flattened batch; a row's padding is a
        segment of its own): rotary reads the
        positions, attention keeps
        each segment to itself (packed_attention: one varlen call over cu_seqlens), as the Paddle
        path's ops.packed_attention does with the collator's attn_mask_startend_row_indices."""
        seq = input_ids.shape[1]
        cos, sin = self._tables(seq, input_ids.device)
        if row_ends is not None:  # the collator's form, read to the host once as the Paddle patch reads it
            if cu_seqlens is not None:
                raise ValueError("FastLlama: pass cu_seqlens or row_ends, not both")
            cu_seqlens = core_packed_attention.cu_seqlens_of(core_packed_attention.segment_lengths_from_row_ends(
                row_ends.reshape(input_ids.shape).cpu().numpy()))
        packed = None if cu_seqlens is None else PackedBatch(cu_seqlens, input_ids.numel())
        x = F.embedding(input_ids, self.embed)
        for layer in self.layers:
            if self.layer_recompute and x.requires_grad:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, position_ids, packed, use_reentrant=False)
            else:
                x = layer(x, cos, sin, position_ids, packed)
        x = ops.RMSNorm.apply(x, self.w_norm, self.eps)
        return ops.linear_cross_entropy(x.reshape(-1, x.shape[-1]), self.w_lm_head, labels.reshape(-1),
                                        fp8_recipe=self.lm_head_fp8)


def shift_labels(input_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """labels[t] = input_ids[t + 1], the last position ignored: what PaddleNLP's data pipeline
    hands its (unshifting) criterion, and what Hugging Face computes inside its loss."""
    labels = torch.full_like(input_ids, ignore_index)
    labels[:, :-1] = input_ids[:, 1:]
    return labels


class MasterWeightAdamW:
    """AdamW on fp32 master weights for 16-bit parameters: each step casts the 16-bit grads into
    fp32 buffers, runs torch's fused AdamW on the masters and copies them back into the
    parameters (PaddleNLP's AMP O2 AdamW with multi_precision, as one set of foreach/fused
    kernels). fp32 parameters are updated in place (no copy)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, max_grad_norm=None):
        self.max_grad_norm = max_grad_norm  # clip the fp32 gradients' global norm (None: no clipping)
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float() if p.dtype != torch.float32 else p.detach() for p in self.params]
        for master in self.masters:
            master.grad = torch.zeros_like(master)
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                           fused=True)

    def set_lr(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        with_grad = [(p, m) for p, m in zip(self.params, self.masters) if p.grad is not None]
        torch._foreach_copy_([m.grad for _, m in with_grad], [p.grad for p, _ in with_grad])
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.masters, self.max_grad_norm, foreach=True)
        self.optimizer.step()
        low = [(p, m) for p, m in zip(self.params, self.masters) if p.dtype != torch.float32]
        if low:
            torch._foreach_copy_([p for p, _ in low], [m for _, m in low])


class FusedMasterAdamW:
    """MasterWeightAdamW's interface on our AdamW kernel, stepping paddle_fastffn/core/optimizer.py's
    composition (the one Paddle's FastAdamW steps; paddle_fastffn/torch/optimizer.py is its torch
    backend): per parameter an fp32 master (None for fp32 parameters, updated in place), fp32 m and
    v, its own beta powers on the host (as Paddle keeps them: advanced after its kernel call, no
    kernel of their own) and one kernel call that reads the 16-bit .grad directly: 28 bytes per
    parameter, no fp32 gradient buffers. The learning rate is an fp32 device scalar, written only
    when set_lr changes it. max_grad_norm: Paddle's ClipGradByGlobalNorm, fused: Paddle's squared
    norm per gradient (fp32 accumulation, in the gradient's dtype), summed in fp32, gives clip =
    max_norm / max(norm, max_norm) on the device, which the kernel multiplies each gradient by as it
    reads it (torch's clip_grad_norm_ divides by norm + 1e-6 instead). zero_grad releases the
    gradients (None), as FastAdamW.clear_grad does.

    moments="int8", master_weights="compensated" (min_8bit_size): FastAdamW's low-memory state
    (fastffn/optimizer.h; new_state in paddle_fastffn/torch/optimizer.py), through the same core step
    and the kernel's fastffn_adamw_with_state entry: 8-bit blockwise moments for tensors of at least
    min_8bit_size elements, a 16-bit Kahan compensation instead of each 16-bit parameter's fp32
    master. core_optimizer.state_memory says what each layout takes."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, max_grad_norm=None,
                 moments="fp32", master_weights="fp32", min_8bit_size=core_optimizer.MIN_8BIT_SIZE):
        self._backend = TorchOptimizerBackend()
        self.params = [p for p in params if p.requires_grad]
        self.state_format = core_optimizer.StateFormat(moments, master_weights, min_8bit_size)
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay, self.max_grad_norm = eps, weight_decay, max_grad_norm
        self.hyper = core_optimizer.AdamWHyper(self.beta1, self.beta2, eps, weight_decay)
        self.clip = None if max_grad_norm is None else core_optimizer.GlobalNormClip(float(max_grad_norm))
        device = self.params[0].device
        self.states = [new_state(p, self.state_format) for p in self.params]
        # per parameter: beta1^t and beta2^t of its next step (Paddle's accumulators start at beta1, beta2)
        self.beta_pows = [host_beta_pows(self.beta1, self.beta2) for _ in self.params]
        self.lr = torch.tensor([lr], dtype=torch.float32, device=device)
        self._lr_slot = core_optimizer.LearningRateSlot(written=float(lr))

    # Each parameter's state by kind (None where its layout has none), for checks and benchmarks.
    @property
    def masters(self):
        return [state["master"] for state in self.states]

    @property
    def m(self):
        return [state["moment1"] for state in self.states]

    @property
    def v(self):
        return [state["moment2"] for state in self.states]

    def state_memory(self) -> dict[str, int]:
        """Bytes of weights, masters (or compensation), moments and gradients of this optimizer's
        parameters in its layout (core_optimizer.state_memory), for the benchmarks to print."""
        return core_optimizer.state_memory([(p.numel(), p.element_size()) for p in self.params], self.state_format)

    def set_lr(self, lr):
        self._lr_slot.set(self._backend, self.lr, lr)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        updates = [core_optimizer.ParameterUpdate(
            p, p.grad, state["moment1"], state["moment2"], state["master"], *self.beta_pows[i],
            compensation=state["compensation"], moment1_absmax=state["moment1_absmax"],
            moment2_absmax=state["moment2_absmax"])
            for i, (p, state) in enumerate(zip(self.params, self.states)) if p.grad is not None]
        try:
            core_optimizer.adamw_step(self._backend, updates, self.lr, self.hyper, self.clip)
        finally:
            # The kernel writes through raw pointers, which torch's version counter does not see:
            # the FP8 weight copies learn of the update here, as on the Paddle side.
            weights_changed([update.param for update in updates])
