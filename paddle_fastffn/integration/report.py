"""What of the fast path a built model (and its Trainer's arguments) actually runs: how many decoder
layers are patched, and which parts are off and why. One log line for the run (the plugin logs it
when the Trainer is built, paddle_fastffn/plugin.py), and a dict for tests and reports."""

from __future__ import annotations

from . import fp8_attach
from .family import FAMILIES
from .fused_projections import distributed_layers, stock_config_values
from ..ops.linear_cross_entropy import fp8_head_unsupported
from .lm_head import fp8_head_asked
from .options import SWITCHES  # each the fast_ffn_<name> TrainingArguments field
from .registry import enabled_options



def _unwrap(model):
    """The PaddleNLP model under LoRAModel / PrefixModelForCausalLM wrappers."""
    while type(model).__name__ in ("LoRAModel", "PrefixModelForCausalLM") and hasattr(model, "model"):
        model = model.model
    return model


def _count(layers, predicate) -> int:
    return sum(1 for layer in layers if predicate(layer))


def fast_path_report(model, args=None) -> dict:
    """{use_fast_ffn, decoder_layers, fast_path_layers, off: {switch: why}, notes: [...]} for
    `model` (wrappers included) and the Trainer's `args` (FastFFNTrainingArguments or None)."""
    options = enabled_options()
    base = _unwrap(model)
    family = FAMILIES.get(getattr(getattr(base, "config", None), "model_type", None))  # family.py's contract
    decoders = family.decoder_layers(base) if family is not None else []
    report = {"use_fast_ffn": options is not None, "decoder_layers": len(decoders),
              "fast_path_layers": family.patched_layer_count(base) if options is not None and decoders else 0,
              "off": {}, "notes": []}
    if options is None:
        return report
    report["options"] = options.as_dict()
    off, notes = report["off"], report["notes"]
    writer = args._checkpoint_writer_without_split() if hasattr(args, "_checkpoint_writer_without_split") else None
    for switch in SWITCHES:
        if not getattr(options, switch):
            off[switch] = f"fast_ffn_{switch}=false"
    if writer and "fuse_projections" in off and getattr(args, "fast_ffn_fuse_projections", False):
        off["fuse_projections"] = (f"{writer} saves the model's own parameters, so the projections stay in the "
                                   f"stock layout (fast_ffn_save_fused_checkpoint=true fuses them)")
    if not decoders:
        notes.append(f"{type(base).__name__} has no LLaMA decoder layer: nothing is patched")
        return report
    config = decoders[0].config if hasattr(decoders[0], "config") else base.config
    distributed = distributed_layers(config)
    lora = type(model).__name__ == "LoRAModel"
    why_stock_layers = (f"{distributed}: PaddleNLP's sharded projections" if distributed else
                        "LoRA adapts the projections: PaddleNLP's separate sub-layers carry the adapters" if lora else
                        "the model was built before the fast path was enabled")
    attentions = [layer.self_attn for layer in decoders]
    mlps = [layer.mlp for layer in decoders if hasattr(layer, "mlp")]  # a MoE family has experts instead
    if not family.FUSED_LAYOUTS:
        for switch in ("fuse_projections", "swiglu_recompute"):
            off.setdefault(switch, f"{family.causal_lm_class().__name__}: {family.LIBRARY} builds no fused projection "
                                   f"for this family")
    elif "fuse_projections" not in off:
        fused_qkv = _count(attentions, lambda a: getattr(a, "fuse_attention_qkv", False))
        fused_ffn = _count(mlps, lambda m: getattr(m, "fuse_attention_ffn", False))
        if fused_qkv < len(decoders) or fused_ffn < len(decoders):
            off["fuse_projections"] = (f"qkv fused in {fused_qkv}/{len(decoders)} layers, gate_up in "
                                       f"{fused_ffn}/{len(decoders)}: {why_stock_layers}")
    if "swiglu_recompute" not in off and "swiglu" not in off and family.FUSED_LAYOUTS:
        recomputed = _count(mlps, lambda m: getattr(m, "fuse_attention_ffn", False) and family.is_plain_linear(m.down_proj))
        if recomputed < len(mlps):
            off["swiglu_recompute"] = (f"{recomputed}/{len(mlps)} MLPs: it needs the fused gate/up projection and a "
                                       f"plain Linear down_proj ({why_stock_layers})")
    if "rotary" not in off:
        paddle_rope = _count(attentions, lambda a: getattr(a, "use_fused_rope", False))
        if paddle_rope:
            off["rotary"] = (f"use_fused_rope: {paddle_rope}/{len(decoders)} attention layers call Paddle's "
                             f"fused_rotary_position_embedding themselves")
    if "rms_norm" not in off and family.device_keeps_norm(config):
        off["rms_norm"] = "use_fused_rms_norm on this device: LlamaRMSNorm keeps its device kernel"
    if "rms_norm" not in off and getattr(config, "sequence_parallel", False):
        notes.append("sequence_parallel: the residual add and post-attention norm stay PaddleNLP's")
    head = None  # (weight, transpose) where the fused loss reads the head
    if "fused_cross_entropy" not in off:
        if isinstance(base, family.causal_lm_class()):
            weight, transpose, reason = family.fused_head_weight(base)
            if weight is None:
                off["fused_cross_entropy"] = reason
            else:
                head = (weight, transpose)
        else:
            off["fused_cross_entropy"] = f"{type(base).__name__} computes its own loss ({family.causal_lm_class().__name__} only)"
    optim = str(getattr(args, "optim", "adamw")).split(".")[-1].lower()
    if "fused_optimizer" not in off and optim != "adamw":
        off["fused_optimizer"] = f"optim={optim}: the fused update replaces AdamW only"
    stock = stock_config_values(config) or {}
    if "attention" not in off and stock.get("use_flash_attention") is False and config.use_flash_attention:
        notes.append("attention through SDPA where the config says use_flash_attention=false")
    fused_here = [flag for flag in ("fuse_attention_qkv", "fuse_attention_ffn")
                  if stock.get(flag) is False and getattr(config, flag, False)]
    if fused_here:
        notes.append(f"projections fused where the config says {'/'.join(fused_here)}=false (checkpoints stay "
                     f"unfused)")
    if options.precision == "fp8" and family.fp8_recipe() is None:
        notes.append(fp8_attach.fp8_fallback_reason() or "fast_ffn_precision=fp8 cannot run here: bf16")
    elif options.precision == "fp8" and fp8_head_asked(family) is not None:
        # The training forward's own rule (lm_head.fp8_head_recipe), with the weight's dtype for the
        # hidden states' (the fused loss runs only where they match).
        why_not = (off.get("fused_cross_entropy", "fast_ffn_fused_cross_entropy is off") if head is None
                   else fp8_head_unsupported(head[0].dtype, *head))
        notes.append("the LM head + loss's GEMMs in FP8 too (fast_ffn_fp8_lm_head=fp8)" if why_not is None
                     else f"fast_ffn_fp8_lm_head=fp8 asked for, but the LM head stays 16-bit: {why_not}")
    if getattr(config, "use_recompute", False):
        notes.append(f"recompute granularity {getattr(config, 'recompute_granularity', 'full')!r} "
                     f"(use_reentrant={bool(getattr(config, 'recompute_use_reentrant', False))})")
    return report


def report_line(report: dict) -> str:
    head = (f"paddle_fastffn: {report['fast_path_layers']}/{report['decoder_layers']} LLaMA decoder layers on "
            f"the fast path")
    off = report["off"]
    parts = [head, "off: " + "; ".join(f"{k} ({v})" for k, v in off.items()) if off else "every part on"]
    parts += report["notes"]
    return "; ".join(parts)
