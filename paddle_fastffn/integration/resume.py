"""Trainer checkpoints of a fast-path model: the optimizer state in the stock layout, and the FP8
scaling state beside it, so that training resumes exactly, and across stock and fast runs.

Optimizer state. Paddle keys an optimizer's state by parameter *names* (`linear_3.w_0_moment1_0`,
`master_weights: {"linear_3.w_0": ...}`), which a per-process counter hands out as layers are
built. A model built on the fast path has one Linear (qkv_proj, gate_up_fused_proj) where stock
PaddleNLP builds two or three, so every Linear built after the first fused one has another name
than in stock, and each fused one holds one [H, q+k+v] / [H, 2I] moment where stock holds one per
part. The weights are saved stock already (llama.py's save_pretrained hook); StockOptimizerLayout
does the same for the optimizer: with it installed, optimizer.state_dict() returns what stock
PaddleNLP saves for the unfused model built in the same order (the names its counter gives, each
fused moment and master weight split by PaddleNLP's own split function, the per-parameter scalars,
beta powers, copied to each part), and optimizer.set_state_dict() takes that layout and fuses it
back with PaddleNLP's fuse function. Every value is a copy of its elements, so a save and a resume
change no bit; a checkpoint saved by stock PaddleNLP resumes on the fast path and the other way
round. (A checkpoint of the fused layout, written before this existed, still loads as it is.)
Not installed where the fused layout is what is saved (fast_ffn_save_fused_checkpoint, PaddleNLP's
fused checkpoint) nor under unified_checkpoint, which keys the optimizer by the model's structured
names and under which the fast path builds no fused projections (training_args.py).

FP8 scaling state. The amax histories, scales and their warm-start flags of every Fp8Linear and
Fp8FFN (fp8/) are training state too: a resume without them restarts calibration. They go into
the checkpoint folder as one more file, FP8_STATE_FILE (stock PaddleNLP ignores it; its weights
and optimizer files are untouched), keyed by the sub-layer each FP8 object belongs to, and are
restored on resume; a checkpoint without the file (stock, or bf16) starts FP8 fresh, one info line.

integration/trainer.py installs both through PaddleNLP's Trainer (create_optimizer,
_save_checkpoint, _load_optimizer_and_scheduler), so every Trainer and subclass gets them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np
import paddle

from .family import FAMILIES, family_for

FP8_STATE_FILE = "fast_ffn_fp8_state.pdparams"
# What a Trainer checkpoint folder holds whatever wrote it (PaddleNLP's TRAINER_STATE_NAME): a
# folder without it is not a Trainer checkpoint.
TRAINER_STATE_FILE = "trainer_state.json"

# "linear_12" (Layer.full_name(): the class's name scope and the counter's number)
_LAYER_NAME = re.compile(r"^(?P<scope>.+)_(?P<index>\d+)$")
# The parameter name an optimizer state key starts with: "linear_12.w_0" of "linear_12.w_0_moment1_0"
# (also of "linear_12.w_0_fp32_master_0_moment1_0", the accumulators of a master weight).
_PARAMETER_OF_KEY = re.compile(r"^[^.]+\.[a-z]+_\d+")
_NOT_PER_PARAMETER = ("master_weights", "LR_Scheduler")


@dataclass(frozen=True)
class _FusedParameter:
    """A fused weight and the stock parameters it stands for."""

    stock_names: tuple[str, ...]
    part_shapes: tuple[tuple[int, ...], ...]
    shape: tuple[int, ...]
    split: object  # PaddleNLP's split function: fused value -> parts
    fuse: object  # PaddleNLP's fuse function: parts -> fused value


class StockOptimizerLayout:
    """Name and layout conversion between the optimizer state of `model` (a fast-path model with
    fused projections) and the state stock PaddleNLP keeps for the same model unfused.

    The stock names are counted as Paddle counts them: Linear layers take consecutive numbers of
    one counter in the order they are built, and a fused layer stands for len(parts) consecutive
    numbers, so each later Linear's stock number is its own plus the parts fused before it."""

    def __init__(self, model):
        self.fused: dict[str, _FusedParameter] = {}
        self.to_stock_name: dict[str, str] = {}  # fast parameter name -> stock name (same tensor)
        family = family_for(_base_config(model).model_type)  # its ModelFamily (family.py)
        fused = _fused_linears(model, family.FUSED_LAYOUTS)
        shift = 0
        for index, scope, layer in _layers_counted_with(model, fused):
            kind, owner = fused.get(id(layer), (None, None))
            stock_layers = [f"{scope}_{index + shift + j}" for j in range(_part_count(kind, family.FUSED_LAYOUTS))]
            for param in layer.parameters(include_sublayers=False):
                if not param.name.startswith(layer.full_name() + "."):
                    continue  # a parameter named by hand: the counter does not name it
                suffix = param.name[len(layer.full_name()):]  # ".w_0"
                if kind:
                    self.fused[param.name] = _fused_parameter(layer, param, kind, owner, model,
                                                              [name + suffix for name in stock_layers], family)
                else:
                    self.to_stock_name[param.name] = stock_layers[0] + suffix
            shift += len(stock_layers) - 1
        self.to_fast_name = {stock: fast for fast, stock in self.to_stock_name.items()}
        self.part_of = {stock: (fast, j) for fast, entry in self.fused.items()
                        for j, stock in enumerate(entry.stock_names)}
        self.parameter_names = {p.name for p in model.parameters()}

    @classmethod
    def of(cls, model) -> "StockOptimizerLayout | None":
        """The layout for `model`, or None where its optimizer state is stock already (no fused
        projections, or the fused checkpoint layout asked for)."""
        from .fused_projections import fast_fused_kinds, saves_fused_layout

        if not fast_fused_kinds(model) or saves_fused_layout(_base_config(model)):
            return None
        return cls(model)

    # --- fast -> stock --------------------------------------------------------------------------
    def to_stock(self, state: dict) -> dict:
        """The stock layout of an optimizer state_dict() of the fast model: a new dict whose
        renamed accumulators are the live tensors under their stock keys (the loader reads values
        by key), fused ones split into host copies (the copies must not double the state on the
        GPU), master weights host copies named as stock names them (the loader adopts the master
        tensor itself, and names its accumulators after it)."""
        stock = {}
        for key, value in state.items():
            if key == "master_weights":
                stock[key] = {}
                for name, master in value.items():
                    stock[key].update(self._entry_to_stock(name, master, master_weight=True))
            elif key in _NOT_PER_PARAMETER:
                stock[key] = value
            else:
                stock.update(self._entry_to_stock(key, value))
        return stock

    def _entry_to_stock(self, key: str, value, master_weight: bool = False) -> dict:
        param = _parameter_of(key)
        tail = key[len(param):]
        if param in self.fused:
            entry = self.fused[param]
            host = value.cpu() if isinstance(value, paddle.Tensor) else value
            if tuple(value.shape) == entry.shape:
                parts = entry.split(host)
            else:  # a per-parameter scalar (beta powers): each stock part has its own
                parts = [host.clone() if isinstance(host, paddle.Tensor) else np.copy(host) for _ in entry.stock_names]
            return {name + tail: _named(part, _renamed(value, param, name))
                    for name, part in zip(entry.stock_names, parts)}
        if param in self.to_stock_name:
            name = self.to_stock_name[param]
            if master_weight and isinstance(value, paddle.Tensor):
                value = _named(_host_copy(value), _renamed(value, param, name))
            return {name + tail: value}
        return {key: value}

    # --- stock -> fast --------------------------------------------------------------------------
    def from_stock(self, state: dict) -> dict:
        """An optimizer state of the stock layout (stock PaddleNLP's, or to_stock's) for the fast
        model's set_state_dict; a state of the fast model's own layout passes unchanged."""
        if self._is_fast_layout(state):
            return state
        fast = {}
        parts: dict[tuple[str, str], dict[int, object]] = {}  # (fast name, key tail) -> {part: value}
        for key, value in state.items():
            if key == "master_weights":
                fast[key] = self._masters_from_stock(value)
            elif key in _NOT_PER_PARAMETER:
                fast[key] = value
            else:
                param = _parameter_of(key)
                if param in self.part_of:
                    name, index = self.part_of[param]
                    parts.setdefault((name, key[len(param):]), {})[index] = value
                else:
                    fast[self.to_fast_name.get(param, param) + key[len(param):]] = value
        for (name, tail), values in parts.items():
            fast[name + tail] = self._fused_value(name, tail, values)
        self._check_parameters(fast)
        return fast

    def _masters_from_stock(self, masters: dict) -> dict:
        fast, parts = {}, {}
        for param, value in masters.items():
            if param in self.part_of:
                name, index = self.part_of[param]
                parts.setdefault(name, {})[index] = value
            else:
                name = self.to_fast_name.get(param, param)
                fast[name] = _named(value, _renamed(value, param, name))
        for name, values in parts.items():
            fast[name] = self._fused_value(name, "", values)
        return fast

    def _fused_value(self, name: str, tail: str, values: dict):
        entry = self.fused[name]
        missing = [entry.stock_names[j] + tail for j in range(len(entry.stock_names)) if j not in values]
        if missing:
            raise ValueError(f"paddle_fastffn: the optimizer state has {entry.stock_names[min(values)] + tail} but "
                             f"not {missing}: the parts of the fused {name} must all be there (a checkpoint of "
                             f"another model?)")
        ordered = [values[j] for j in range(len(entry.stock_names))]
        first = ordered[0]
        if all(tuple(v.shape) == shape for v, shape in zip(ordered, entry.part_shapes)):
            fused = entry.fuse(ordered)
        else:
            # Per-parameter scalars (beta powers): the parts were updated together, so they agree.
            arrays = [np.asarray(v.numpy() if isinstance(v, paddle.Tensor) else v) for v in ordered]
            if any(a.shape != arrays[0].shape or not np.array_equal(a, arrays[0]) for a in arrays[1:]):
                raise ValueError(f"paddle_fastffn: optimizer state {[n + tail for n in entry.stock_names]} "
                                 f"differs between the parts ({[a.tolist() for a in arrays]}) or has shapes "
                                 f"{[tuple(v.shape) for v in ordered]} where the parts' shapes are "
                                 f"{list(entry.part_shapes)}: the fused {name} cannot hold them")
            fused = first
        return _named(fused, _renamed(first, entry.stock_names[0], name))

    def _is_fast_layout(self, state: dict) -> bool:
        """A fused moment under a fused parameter's name: the fast model's own layout."""
        for key, value in state.items():
            if key in _NOT_PER_PARAMETER:
                continue
            entry = self.fused.get(_parameter_of(key))
            if entry is not None and tuple(getattr(value, "shape", ())) == entry.shape:
                return True
        return False

    def _check_parameters(self, state: dict) -> None:
        foreign = sorted(key for key in state if key not in _NOT_PER_PARAMETER
                         and _parameter_of(key) not in self.parameter_names)
        foreign += sorted(name for name in state.get("master_weights", {}) if name not in self.parameter_names)
        if foreign:
            raise ValueError(f"paddle_fastffn: the optimizer state holds {len(foreign)} entries for parameters this "
                             f"model does not have, e.g. {foreign[:3]} (this model's parameters, stock-named: "
                             f"{sorted(self.to_fast_name)[:3]} ...): the checkpoint is of another model or another "
                             f"build order")


def _fused_linears(model, layouts: dict) -> dict:
    """{id(fused Linear): (kind, the attention / MLP layer that owns it)} of the fast path's fused
    projections in `model` (`layouts`: its family's FUSED_LAYOUTS)."""
    return {id(getattr(owner, layouts[owner._fast_ffn_fused].fused)): (owner._fast_ffn_fused, owner)
            for owner in model.sublayers(include_self=True) if getattr(owner, "_fast_ffn_fused", None)}


def _layers_counted_with(model, fused: dict) -> list:
    """[(number, scope, layer)] of the layers named by the fused layers' counter ("linear"), in the
    order it numbered them (the order they were built)."""
    scopes = {_LAYER_NAME.match(layer.full_name())["scope"] for layer in model.sublayers() if id(layer) in fused}
    counted = []
    for layer in model.sublayers(include_self=True):
        match = _LAYER_NAME.match(layer.full_name())
        if match and match["scope"] in scopes:
            counted.append((int(match["index"]), match["scope"], layer))
    return sorted(counted, key=lambda item: item[0])


def _part_count(kind, layouts: dict) -> int:
    return len(layouts[kind].parts) if kind else 1


def _fused_parameter(layer, param, kind: str, owner, model, stock_names, family) -> _FusedParameter:
    if param is not layer.weight:
        raise NotImplementedError(f"paddle_fastffn: the fused {family.FUSED_LAYOUTS[kind].fused} has a parameter "
                                  f"besides its weight ({param.name}); only bias-free fused projections are supported")
    config = getattr(owner, "config", None) or _base_config(model)
    widths, _ = layer._fast_ffn_stock_parts
    return _FusedParameter(tuple(stock_names), tuple((param.shape[0], width) for width in widths),
                           tuple(param.shape), family.split_fn(kind, config), family.fuse_fn(kind, config))


def _base_config(model):
    from .library import module

    unwrap_model = module("transformers.model_utils").unwrap_model

    model = unwrap_model(model)
    return getattr(model, "config", None) or getattr(getattr(model, "model", None), "config", None)


def _parameter_of(key: str) -> str:
    match = _PARAMETER_OF_KEY.match(key)
    return match.group(0) if match else key


def _renamed(value, old_param: str, new_param: str) -> str | None:
    """The tensor name `value` gets under its new parameter: Paddle names an accumulator and a
    master weight after their parameter, and a master weight's own accumulators after it."""
    name = getattr(value, "name", None)
    if isinstance(value, paddle.Tensor) and isinstance(name, str) and name.startswith(old_param):
        return new_param + name[len(old_param):]
    return None


def _host_copy(tensor: paddle.Tensor) -> paddle.Tensor:
    """A copy in host memory (Tensor.cpu() of a host tensor is the tensor itself)."""
    copy = tensor.cpu()
    return copy.clone() if copy.data_ptr() == tensor.data_ptr() else copy


def _named(value, name: str | None):
    if name is not None and isinstance(value, paddle.Tensor):
        value.name = name
    return value


def install_stock_layout(optimizer, model) -> bool:
    """Make `optimizer` save (state_dict) and load (set_state_dict) the stock layout of `model`'s
    optimizer state, where it differs; True where installed."""
    layout = StockOptimizerLayout.of(model)
    if layout is None or getattr(optimizer, "_fast_ffn_stock_layout", None) is not None:
        return False
    fast_state_dict, fast_set_state_dict = optimizer.state_dict, optimizer.set_state_dict

    def state_dict():
        return layout.to_stock(fast_state_dict())

    def set_state_dict(state_dict):
        return fast_set_state_dict(layout.from_stock(state_dict))

    optimizer.state_dict, optimizer.set_state_dict = state_dict, set_state_dict
    optimizer._fast_ffn_stock_layout = layout
    return True


# ---------------------------------------------------------------------------------------------
# FP8 scaling state

def fp8_state_file(folder: str, world_size: int = 1, process_index: int = 0) -> str:
    """Each process keeps its own amax histories (they see their own batches): one file each."""
    name = FP8_STATE_FILE if world_size <= 1 else FP8_STATE_FILE.replace(".pdparams", f".rank{process_index}.pdparams")
    return os.path.join(folder, name)


def fp8_checkpoint_layers(model):
    """(recipe, {sub-layer name: FP8 object}) of `model`, through its family (family.py); (None, {})
    for a model no family serves (the Trainer hooks see every model)."""
    config = _base_config(model)
    family = FAMILIES.get(getattr(config, "model_type", None))
    return family.fp8_checkpoint_layers(model) if family is not None else (None, {})


def fp8_state_dict(model) -> dict | None:
    """{"recipe": Fp8Recipe fields, "layers": {sub-layer name: its FP8 states}} of `model`, or None
    where nothing in it computes in FP8."""
    recipe, layers = fp8_checkpoint_layers(model)
    if not layers:
        return None
    return {"recipe": recipe.as_dict(), "layers": {name: fp8.fp8_state_dict() for name, fp8 in layers.items()}}


def set_fp8_state_dict(model, state: dict, source: str = "the FP8 state") -> None:
    """Restore fp8_state_dict's output into `model`'s FP8 objects (attached first where the first
    forward has not attached them yet). The same layers must compute in FP8 with the same recipe."""
    recipe, layers = fp8_checkpoint_layers(model)
    saved = state["layers"]
    if set(saved) != set(layers):
        raise ValueError(f"paddle_fastffn: {source} is for FP8 layers {sorted(set(saved) - set(layers))[:3]} that this "
                         f"model does not compute in FP8, and lacks {sorted(set(layers) - set(saved))[:3]}: "
                         f"a checkpoint of another model or FP8 configuration")
    if recipe is not None and state["recipe"] != recipe.as_dict():
        differing = {k: (v, recipe.as_dict().get(k)) for k, v in state["recipe"].items() if recipe.as_dict().get(k) != v}
        raise ValueError(f"paddle_fastffn: {source} was saved with another FP8 recipe, {{field: (saved, now)}} = "
                         f"{differing}; resume with the recipe it was saved with (fast_ffn_fp8_*)")
    for name, fp8 in layers.items():
        fp8.set_fp8_state_dict(saved[name])


def save_fp8_state(model, folder: str, world_size: int = 1, process_index: int = 0) -> str | None:
    state = fp8_state_dict(model)
    if state is None:
        return None
    os.makedirs(folder, exist_ok=True)
    path = fp8_state_file(folder, world_size, process_index)
    paddle.save(state, path)
    return path


def load_fp8_state(model, folder: str, world_size: int = 1, process_index: int = 0) -> bool:
    """Restore the FP8 states saved in checkpoint `folder`; False (FP8 starts fresh, one info line)
    where it has none, or where the model computes nothing in FP8."""
    from .library import logger

    _, layers = fp8_checkpoint_layers(model)
    if not layers:
        return False
    path = fp8_state_file(folder, world_size, process_index)
    if not os.path.isfile(path):
        logger().info(f"paddle_fastffn: {folder} has no FP8 scaling state ({os.path.basename(path)}: saved by stock "
                      f"PaddleNLP or without fast_ffn_precision=fp8): the FP8 amax histories and scales start fresh")
        return False
    set_fp8_state_dict(model, paddle.load(path, return_numpy=True), source=path)
    return True


# The config fields that make a checkpoint another model's (a foreign one loads partly, then fails
# on a shape deep inside set_state_dict or the optimizer).
_ARCHITECTURE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads")


def check_checkpoint_folder(path, model=None, option: str = "resume_from_checkpoint") -> None:
    """A clear error for a resume from a folder that is not a Trainer checkpoint of `model`: it
    names the path and what is missing or different (PaddleNLP's own errors come later, from deep
    inside the load, or name neither)."""
    import json

    path = str(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{option}={path!r}: no such directory")
    if not os.path.isdir(path):
        raise NotADirectoryError(f"{option}={path!r} is a file; it must be a Trainer checkpoint folder "
                                 f"(checkpoint-<step>, with {TRAINER_STATE_FILE})")
    if not os.path.isfile(os.path.join(path, TRAINER_STATE_FILE)):
        present = sorted(os.listdir(path))[:8]
        raise FileNotFoundError(f"{option}={path!r} is not a Trainer checkpoint: no {TRAINER_STATE_FILE} in it "
                                f"(it holds {present}); pass a checkpoint-<step> folder that a Trainer saved")
    config = _base_config(model) if model is not None else None
    config_file = os.path.join(path, "config.json")
    if config is None or not os.path.isfile(config_file):
        return
    with open(config_file) as f:
        saved = json.load(f)
    differing = {name: (saved[name], getattr(config, name, None)) for name in _ARCHITECTURE_FIELDS
                 if name in saved and saved[name] != getattr(config, name, None)}
    if differing:
        raise ValueError(f"{option}={path!r} is a checkpoint of another model: {{field: (checkpoint, this model)}} "
                         f"= {differing}")
