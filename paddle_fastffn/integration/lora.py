"""LoRA on a model whose projections the fast path fused, for every model family: before
PaddleNLP's LoRAModel places adapters, the fused layers its target patterns reach are split back
into the stock sub-layers and the patterns that name fused layers are aimed at the parts, so the
adapters, their initialisation and their saved names are the ones stock PaddleNLP gives the
unfused model. The hooks on LoRAModel are installed once (install_lora_hooks) and act only on
models with fused layers (fused_projections.fast_fused_layers); the model's family (family.py)
says how its layers are named, split and rebuilt."""

from __future__ import annotations

import re

import paddle
from paddle import nn

from .family import family_for
from .fused_projections import fast_fused_layers, saves_fused_layout, stock_checkpoint, stock_config_values
from .messages import info_once

_HOOKS: dict = {}


def _family_of(model):
    """The ModelFamily (family.py) of a model the fast path fused, by its config's model_type."""
    return family_for(model.config.model_type)


def install_lora_hooks() -> None:
    """LoRAModel places adapters on stock sub-layers and saves the stock config (once per process)."""
    if _HOOKS:
        return
    from paddlenlp.peft import LoRAModel

    lora_init, lora_save = LoRAModel.__init__, LoRAModel.save_pretrained
    _HOOKS.update(lora_init=lora_init, lora_save=lora_save)

    def init_on_stock_layers(self, model, lora_config, *args, **kwargs):
        unfuse_for_lora(model, lora_config)
        lora_init(self, model, lora_config, *args, **kwargs)

    def save_with_stock_config(self, save_directory, merge_tensor_parallel=False, **kwargs):
        base = self.model
        if stock_config_values(getattr(base, "config", None)) is None or not kwargs.get("save_model_config", True):
            return lora_save(self, save_directory, merge_tensor_parallel=merge_tensor_parallel, **kwargs)
        lora_save(self, save_directory, merge_tensor_parallel=merge_tensor_parallel,
                  **{**kwargs, "save_model_config": False})
        if kwargs.get("is_main_process", paddle.distributed.get_rank() == 0):
            _, config = stock_checkpoint(base, {}, base.config, saves_fused_layout(base.config),
                                          _family_of(base).FUSED_LAYOUTS)
            if merge_tensor_parallel:
                config.tensor_parallel_degree = -1
            config.save_pretrained(save_directory)

    LoRAModel.__init__ = init_on_stock_layers
    LoRAModel.save_pretrained = save_with_stock_config


def _part_name(fused_module_name: str, part: str) -> str:
    return fused_module_name.rsplit(".", 1)[0] + "." + part if "." in fused_module_name else part


def unfuse_for_lora(model, lora_config, family=None) -> None:
    """Before LoRAModel places adapters: split the fused projections (of the kinds the target
    patterns reach) back into PaddleNLP's stock sub-layers, and aim patterns that name the fused
    layers at their parts, so the adapters, their initialisation and their saved names are the
    ones stock PaddleNLP gives the unfused model. A no-op for models the fast path did not fuse.
    `family`: the model's ModelFamily (found by its config's model_type when not given)."""
    owners = fast_fused_layers(model)
    if not owners or lora_config.target_modules is None:
        return
    family = family or _family_of(model)
    layouts = family.FUSED_LAYOUTS
    patterns = [lora_config.target_modules] if isinstance(lora_config.target_modules, str) else list(lora_config.target_modules)
    enables = lora_config.enable_lora_list
    if isinstance(lora_config.target_modules, str):
        enables = [enables]
    elif enables is None:
        enables = [None] * len(patterns)
    fused_names = {f"{name}.{layouts[kind].fused}" if name else layouts[kind].fused: kind
                   for name, kind in owners.items()}
    reached = set()
    for fused_name, kind in fused_names.items():
        names = [fused_name] + [_part_name(fused_name, part) for part in layouts[kind].parts]
        if any(re.fullmatch(pattern, name) for pattern in patterns for name in names):
            reached.add(kind)
    if not reached:
        return
    other_names = [name for name, _ in model.named_sublayers() if name not in fused_names]
    new_patterns, new_enables = retarget(patterns, enables, {n: k for n, k in fused_names.items() if k in reached},
                                         other_names, layouts)
    for layer in model.sublayers(include_self=True):
        if getattr(layer, "_fast_ffn_fused", None) in reached:
            _unfuse_layer(layer, model.config, family)
    stock = stock_config_values(model.config) or {}
    for kind in reached:
        flag = layouts[kind].config_flag
        setattr(model.config, flag, stock.get(flag, False))
    if isinstance(lora_config.target_modules, str) and len(new_patterns) == 1:
        lora_config.target_modules, lora_config.enable_lora_list = new_patterns[0], new_enables[0]
    else:
        lora_config.target_modules = new_patterns
        lora_config.enable_lora_list = None if all(e is None for e in new_enables) else new_enables
    split = " and ".join(f"{layouts[k].fused} -> {'/'.join(layouts[k].parts)}" for k in sorted(reached))
    info_once("lora", f"LoRA adapts this model's projections: the fused layers are split back into PaddleNLP's "
                      f"sub-layers ({split}), so the adapters sit on the stock layers; the SwiGLU output is "
                      f"stored (recompute needs the fused gate/up projection and a plain down_proj)",
              covers=("recompute_unfused", "recompute_down_proj", "built_unfused"))


def retarget(patterns, enables, fused_names: dict, other_names: list, layouts: dict):
    """LoRA target patterns with the same meaning on the unfused model: a pattern that names a
    fused layer (qkv_proj, gate_up_fused_proj) targets its parts instead (one pattern per part,
    in PaddleNLP's order, so adapters are created in stock order; one pattern for all parts if
    per-part patterns would also match another layer more than once); every other pattern means
    on the unfused layers what it means for stock PaddleNLP. `layouts`: the family's FUSED_LAYOUTS."""
    new_patterns, new_enables = [], []
    for pattern, enable in zip(patterns, enables):
        hits = [name for name in fused_names if re.fullmatch(pattern, name)]
        if not hits:
            if pattern not in new_patterns:  # a list naming a part and its fused layer: the part once
                new_patterns.append(pattern)
                new_enables.append(enable)
            continue
        produced = []
        for kind in [k for k in layouts if k in {fused_names[n] for n in hits}]:
            fused, parts, _flag = layouts[kind]
            kind_hits = [n for n in hits if fused_names[n] == kind]
            chosen = [p for i, p in enumerate(parts) if enable is None or (i < len(enable) and enable[i])]
            part_names = [_part_name(n, p) for n in kind_hits for p in parts]
            if fused in pattern:
                candidates = [pattern.replace(fused, part) for part in chosen]
                if any(sum(bool(re.fullmatch(c, n)) for c in candidates) > 1 for n in other_names):
                    candidates = [pattern.replace(fused, "(?:" + "|".join(chosen) + ")")]
            elif enable is None and any(re.fullmatch(pattern, n) for n in part_names):
                candidates = [pattern]  # already means the parts it matches (e.g. ".*proj.*")
            else:
                candidates = ["(?:" + "|".join(re.escape(_part_name(n, p)) for n in kind_hits for p in chosen) + ")"]
            produced += [c for c in candidates if c not in produced]
        produced = [c for c in produced if c not in new_patterns]  # LoRAModel would adapt a layer twice
        new_patterns += produced
        new_enables += [None] * len(produced)
    return new_patterns, new_enables


def _unfuse_layer(owner, config, family) -> None:
    """Replace owner's fused projection by its stock parts (same values, same dtype, no random
    draws), in the sub-layer order stock PaddleNLP builds."""
    from paddlenlp.transformers.model_utils import dtype_guard

    kind = owner._fast_ffn_fused
    fused_name, parts, flag = family.FUSED_LAYOUTS[kind]
    fused = getattr(owner, fused_name)
    weight = fused.weight
    pieces = family.split_fn(kind, config)(weight.detach())
    new_layers = []
    linear_class = family.unfused_linear_class()  # what PaddleNLP builds for the stock parts on this device
    with dtype_guard(str(weight.dtype).split(".")[-1]):
        for part, piece in zip(parts, pieces):
            # A constant initialiser draws no random numbers: later draws (LoRA's A) stay stock.
            linear = linear_class(piece.shape[0], piece.shape[1], bias_attr=False,
                                  weight_attr=paddle.ParamAttr(initializer=nn.initializer.Constant(0.0)))
            linear.weight.set_value(piece)
            linear.weight.stop_gradient = weight.stop_gradient
            new_layers.append((part, linear))
    items = list(owner._sub_layers.items())
    owner._sub_layers.clear()
    for name, layer in items:
        if name == fused_name:
            owner._sub_layers.update(new_layers)
        else:
            owner._sub_layers[name] = layer
    setattr(owner, flag, False)  # e.g. LlamaAttention.fuse_attention_qkv / LlamaMLP.fuse_attention_ffn
    del owner._fast_ffn_fused
