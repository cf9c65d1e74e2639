"""Fused projections and the checkpoint layout, for every model family.

A model built while the fast path is enabled gets PaddleNLP's own fused projections (one GEMM for
several stock sub-layers: qkv_proj for q/k/v_proj, gate_up_fused_proj for gate_proj/up_proj), where
the family's config flags ask PaddleNLP to build them. The checkpoint contract stays stock: this
module remembers the config as it was before the fast path changed it, draws fused weights as their
stock parts (so a seed gives stock's model), and writes and reads the stock unfused layout through
PaddleNLP's own fuse/split mappings. The family says which projections it fuses and how
(ModelFamily.FUSED_LAYOUTS, fuse_fn, split_fn: family.py); everything here acts only on layers the
fast path fused (those carrying `_fast_ffn_fused`), so stock models are untouched.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from typing import NamedTuple

import paddle

from ..core.fp8.weight_cache import weights_changed
from . import state
from .messages import info_once


class FusedLayout(NamedTuple):
    """One kind of fused projection: the fused sub-layer's name, its stock parts in PaddleNLP's
    order, and the config flag that makes PaddleNLP build the fused one."""
    fused: str
    parts: tuple
    config_flag: str


# id(config) -> (weakref to it, {key: value before the fast path changed it}, save_fused_checkpoint)
_STOCK: dict = {}
# The config keys the fast path may change (every PaddleNLP decoder family reads these names).
PATCHED_CONFIG_KEYS = ("use_flash_attention", "fuse_attention_qkv", "fuse_attention_ffn")


def remember_stock(config, save_fused: bool | None = None) -> None:
    """Record `config`'s values of the keys the fast path changes, the first time it sees it.
    Kept off the config itself: PretrainedConfig serialises every attribute into config.json."""
    key = id(config)
    entry = _STOCK.get(key)
    if entry is None or entry[0]() is not config:
        values = {name: bool(getattr(config, name, False)) for name in PATCHED_CONFIG_KEYS}
        entry = [weakref.ref(config, lambda _ref, key=key: _STOCK.pop(key, None)), values, False]
        _STOCK[key] = entry
    if save_fused is not None:
        entry[2] = save_fused


def stock_config_values(config) -> dict | None:
    """{use_flash_attention, fuse_attention_qkv, fuse_attention_ffn} as they were before the fast
    path changed `config`; None for a config it never touched."""
    entry = _STOCK.get(id(config))
    return dict(entry[1]) if entry is not None and entry[0]() is config else None


def saves_fused_layout(config) -> bool:
    """Whether `config`'s model saves PaddleNLP's fused layout (save_fused_checkpoint: the enabled
    options', or those the model was built with once the fast path is off)."""
    options = state.current()
    if options is not None:
        return options.save_fused_checkpoint
    entry = _STOCK.get(id(config))
    return bool(entry is not None and entry[0]() is config and entry[2])


def distributed_layers(config) -> str | None:
    """Why this config builds PaddleNLP's sharded layers, or None for plain Linear layers."""
    if (getattr(config, "tensor_parallel_degree", 1) or 1) > 1:
        return f"tensor_parallel_degree={config.tensor_parallel_degree}"
    if (getattr(config, "pipeline_parallel_degree", 1) or 1) > 1:
        return f"pipeline_parallel_degree={config.pipeline_parallel_degree}"
    return None


def keeps_distributed_layers(config) -> bool:
    """Tensor / pipeline parallel models keep PaddleNLP's sharded sub-layers (one info line)."""
    distributed = distributed_layers(config)
    if distributed:
        info_once("distributed_layers", f"{distributed}: the model keeps PaddleNLP's own (sharded) q/k/v and "
                                        f"gate/up projection sub-layers, no fused projections, and stores the "
                                        f"SwiGLU output (recompute needs the fused gate/up projection and a plain "
                                        f"Linear down_proj); the fused SwiGLU, RMSNorm and rotary kernels still apply",
                  covers=("recompute_unfused", "recompute_down_proj"))
    return distributed is not None


def fast_fused_layers(model) -> dict:
    """{sub-layer name: kind} of the layers of `model` (a family's attention / MLP) whose
    projections the fast path fused (a key of the family's FUSED_LAYOUTS: "qkv", "ffn")."""
    return {name: layer._fast_ffn_fused for name, layer in model.named_sublayers(include_self=True)
            if getattr(layer, "_fast_ffn_fused", None)}


def fast_fused_kinds(model) -> set:
    return set(fast_fused_layers(model).values())


def mark_fused(owner, kind: str, fused, widths: tuple, fuse) -> None:
    """Record that the fast path fused `owner`'s projection `fused` (of `kind`), whose stock parts
    have these output widths and fuse into it with `fuse` (initialisation, saving, loading, LoRA)."""
    owner._fast_ffn_fused = kind
    fused._fast_ffn_stock_parts = (tuple(widths), fuse)


# ---------------------------------------------------------------------------------------------
# Hooks that keep the checkpoint contract stock (a family installs them once on its pretrained
# model class; they act only on layers the fast path fused, so stock models are untouched).

def init_weights_like_stock(original):
    def _init_weights(self, layer):
        spec = getattr(layer, "_fast_ffn_stock_parts", None)
        if spec is None or getattr(layer.weight, "is_distributed", False):
            return original(self, layer)
        # Stock draws each part with the same generator in this order; drawing the parts and
        # fusing them gives the weights a stock model built from the same seed has.
        widths, fuse = spec
        std = self.config.initializer_range
        parts = [paddle.tensor.normal(mean=0.0, std=std, shape=[layer.weight.shape[0], width]) for width in widths]
        layer.weight.set_value(fuse(parts))
    return _init_weights


def stock_checkpoint(model, state_dict: dict, config_to_save, save_fused: bool, layouts: dict):
    """(state_dict, config) as stock PaddleNLP would save this model: fused projections split by
    PaddleNLP's own split mappings, fuse_attention_* and use_flash_attention as before the fast
    path. With save_fused, the fused weights stay and only use_flash_attention is restored."""
    config_to_save = copy.deepcopy(config_to_save)
    stock = stock_config_values(model.config) or {}
    if "use_flash_attention" in stock:
        config_to_save.use_flash_attention = stock["use_flash_attention"]
    kinds = fast_fused_kinds(model)
    if save_fused or not kinds:
        return state_dict, config_to_save
    state_dict = dict(state_dict)
    fused_suffixes = tuple(f".{layouts[kind].fused}.weight" for kind in kinds)
    for key, value in state_dict.items():
        # Split on the host: the split copies must not double the fused weights on the GPU.
        if key.endswith(fused_suffixes) and isinstance(value, paddle.Tensor) and not value.place.is_cpu_place():
            state_dict[key] = value.cpu()
    for kind in kinds:
        setattr(config_to_save, layouts[kind].config_flag, False)
    state_dict, _ = type(model).convert_fuse_and_split(config_to_save, state_dict)
    return state_dict, config_to_save


def save_pretrained_stock(original, layouts: dict):
    signature = inspect.signature(original)

    def save_pretrained(self, save_dir, *args, **kwargs):
        from paddlenlp.transformers.model_utils import get_parameter_dtype, unwrap_model

        model = unwrap_model(self)
        stock = stock_config_values(model.config)
        if stock is None or distributed_layers(model.config):
            return original(self, save_dir, *args, **kwargs)
        bound = signature.bind(self, save_dir, *args, **kwargs)
        arguments = dict(bound.arguments)
        extra, positional = dict(arguments.pop("kwargs", {})), arguments.pop("args", ())
        arguments.pop("self")
        state_dict = arguments.get("state_dict")
        if state_dict is None:
            state_dict = model.state_dict()
        # As PaddleNLP's save_pretrained does before it copies the config.
        model.config.dtype = str(get_parameter_dtype(model)).split(".")[1]
        config_to_save = extra.get("config_to_save") or model.config
        arguments["state_dict"], extra["config_to_save"] = stock_checkpoint(
            model, state_dict, config_to_save, saves_fused_layout(model.config), layouts)
        if positional:  # arguments past `variant` given by position: keep them positional
            return original(self, *arguments.values(), *positional, **extra)
        return original(self, **arguments, **extra)
    return save_pretrained


def set_state_dict_fusing(original):
    def set_state_dict(self, state_dict, *args, **kwargs):
        if fast_fused_kinds(self):
            # A stock-layout checkpoint (what save_pretrained writes) into a model whose
            # projections the fast path fused: the Trainer's resume and best-model reload call
            # set_state_dict directly, without from_pretrained's conversion.
            state_dict, _ = type(self).convert_fuse_and_split(self.config, dict(state_dict))
        try:
            return original(self, state_dict, *args, **kwargs)
        finally:  # the FP8 copies of the loaded weights are re-made (core/fp8/weight_cache.py)
            weights_changed(self.parameters())
    return set_state_dict


