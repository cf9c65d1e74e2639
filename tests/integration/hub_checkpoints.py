"""Hugging Face Hub checkpoint folders written from a tiny Paddle LLaMA: the file names, layout
and JSON of meta-llama/Llama-2-*-hf, so the tests load what a real download looks like."""

from __future__ import annotations

import collections
import io
import json
import pickle
import shutil
import sys
import zipfile
from pathlib import Path

import numpy as np
import sentencepiece as spm
from safetensors.numpy import save_file

# Weights as one file or sharded with an index, as safetensors or torch.save .bin files.
HUB_LAYOUTS = ("safetensors", "sharded_safetensors", "bin", "sharded_bin")


def hf_state_dict(model, dtype: str = "float32") -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face's names (model.* for llama.*) and layouts (torch
    Linear weights are [out, in], Paddle's are [in, out])."""
    tensors = {}
    for key, value in model.state_dict().items():
        array = value.numpy()
        name = key.replace("llama.", "model.", 1)
        if array.ndim == 2 and "embed_tokens" not in name:
            array = array.T
        tensors[name] = np.ascontiguousarray(array.astype(dtype))
    return tensors


def save_hub_checkpoint(model, directory: str | Path, layout: str = "safetensors",
                        tokenizer_model: str | Path | None = None, dtype: str = "float16",
                        shards: int = 2, tokenizer_json: bool = True) -> Path:
    """Lay out `model` as a Hub LLaMA-2 folder: config.json and generation_config.json, the
    weights in `layout` (one of HUB_LAYOUTS; sharded ones split into `shards` files with an index
    whose weight_map names each tensor's file, as transformers' save_pretrained does), and with
    `tokenizer_model` (a sentencepiece model) tokenizer.model, tokenizer_config.json,
    special_tokens_map.json and, with `tokenizer_json`, tokenizer.json. `dtype` is the stored dtype
    (the Hub's LLaMA-2 files are float16)."""
    if layout not in HUB_LAYOUTS:
        raise ValueError(f"layout must be one of {HUB_LAYOUTS}, got {layout!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model, dtype)
    safetensors = "safetensors" in layout
    stem, suffix = ("model", ".safetensors") if safetensors else ("pytorch_model", ".bin")
    names = list(tensors)
    groups = np.array_split(np.arange(len(names)), shards) if layout.startswith("sharded") else [range(len(names))]
    weight_map = {}
    for number, indices in enumerate(groups, 1):
        file = f"{stem}-{number:05d}-of-{len(groups):05d}{suffix}" if len(groups) > 1 else stem + suffix
        shard = {names[i]: tensors[names[i]] for i in indices}
        if safetensors:
            save_file(shard, str(directory / file), metadata={"format": "pt"})
        else:
            save_torch_state_dict(shard, directory / file)
        weight_map.update(dict.fromkeys(shard, file))
    if len(groups) > 1:
        index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
                 "weight_map": weight_map}
        (directory / f"{stem}{suffix}.index.json").write_text(json.dumps(index, indent=2))

    c = model.config
    config = dict(architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2, hidden_act="silu",
                  hidden_size=c.hidden_size, initializer_range=0.02, intermediate_size=c.intermediate_size,
                  max_position_embeddings=c.max_position_embeddings, model_type="llama",
                  num_attention_heads=c.num_attention_heads, num_hidden_layers=c.num_hidden_layers,
                  num_key_value_heads=c.num_key_value_heads, pretraining_tp=1, rms_norm_eps=c.rms_norm_eps,
                  rope_scaling=None, tie_word_embeddings=False, torch_dtype=dtype,
                  transformers_version="4.31.0.dev0", use_cache=True, vocab_size=c.vocab_size)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    generation = dict(bos_token_id=1, do_sample=True, eos_token_id=2, max_length=c.max_position_embeddings,
                      pad_token_id=0, temperature=0.6, top_p=0.9, transformers_version="4.31.0.dev0")
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if tokenizer_model is not None:
        write_hub_tokenizer(tokenizer_model, directory, tokenizer_json)
    return directory


def _added_token(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False}


def write_hub_tokenizer(tokenizer_model: str | Path, directory: Path, tokenizer_json: bool = True) -> None:
    """tokenizer.model, tokenizer_config.json, special_tokens_map.json and (optionally)
    tokenizer.json as Llama-2-7b-hf has them."""
    shutil.copyfile(tokenizer_model, directory / "tokenizer.model")
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": _added_token("<s>"),
              "clean_up_tokenization_spaces": False, "eos_token": _added_token("</s>"), "legacy": False,
              "model_max_length": 1000000000000000019884624838656, "pad_token": None,
              "padding_side": "right", "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer",
              "unk_token": _added_token("<unk>")}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    if tokenizer_json:
        (directory / "tokenizer.json").write_text(json.dumps(fast_tokenizer_json(tokenizer_model)))


def fast_tokenizer_json(tokenizer_model: str | Path) -> dict:
    """tokenizer.json (the `tokenizers` library's file) for a LLaMA sentencepiece model, as
    transformers' LlamaConverter writes it for Llama-2: byte-fallback BPE whose merges are every
    split of a piece into two pieces, highest-scoring piece first. PaddleNLP 2.8.1 has no fast
    LLaMA tokenizer and never reads it; the Hub folders carry it all the same."""
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = []
    for piece, i in vocab.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges += [(sp.get_score(i), left, right) for left, right in sorted(splits, key=lambda s: (vocab[s[0]], vocab[s[1]]))]
    merges.sort(key=lambda merge: merge[0], reverse=True)  # stable: ties keep vocabulary order

    def special(token):
        return {"id": vocab[token], "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True}

    def sequence(name, type_id):
        return {"Sequence": {"id": name, "type_id": type_id}}

    bos = [{"SpecialToken": {"id": "<s>", "type_id": 0}}]
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [special("<unk>"), special("<s>"), special("</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing", "single": bos + [sequence("A", 0)],
                           "pair": bos + [sequence("A", 0), {"SpecialToken": {"id": "<s>", "type_id": 1}}, sequence("B", 1)],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [vocab["<s>"]], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "vocab": vocab,
                  "merges": [f"{left} {right}" for _, left, right in merges]},
    }


class _TorchGlobal:
    """A name that only torch defines, pickled by reference (GLOBAL 'module name') without torch."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args):  # pickle's REDUCE requires a callable; only the name is written
        raise TypeError(f"{self.module}.{self.name} is a stand-in for pickling")


# One object per type, so that the pickle memoizes them as torch's does (GLOBAL once, then BINGET).
_STORAGE_TYPES = {np.dtype(dtype): _TorchGlobal("torch", name) for dtype, name in (
    ("float32", "FloatStorage"), ("float16", "HalfStorage"), ("float64", "DoubleStorage"), ("int64", "LongStorage"))}
_REBUILD_TENSOR = _TorchGlobal("torch._utils", "_rebuild_tensor_v2")


class _Storage:
    def __init__(self, key: str, array: np.ndarray):
        self.key, self.array = key, array


class _Tensor:
    """Pickles as torch.Tensor.__reduce_ex__ does: _rebuild_tensor_v2(storage, offset, size,
    stride, requires_grad, backward_hooks)."""

    def __init__(self, storage: _Storage):
        self.storage = storage

    def __reduce__(self):
        array = self.storage.array
        stride = tuple(s // array.itemsize for s in array.strides)
        return _REBUILD_TENSOR, (self.storage, 0, array.shape, stride, False, collections.OrderedDict())


class _TorchPickler(pickle._Pickler):
    # The pure-Python pickler, because its dispatch table can be extended to write _TorchGlobal;
    # the C pickler insists on importing every global it writes.
    dispatch = dict(pickle._Pickler.dispatch)

    def save_torch_global(self, obj):
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("ascii"))
        self.memoize(obj)

    dispatch[_TorchGlobal] = save_torch_global

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", _STORAGE_TYPES[obj.array.dtype], obj.key, "cpu", obj.array.size)
        return None


def save_torch_state_dict(tensors: dict[str, np.ndarray], path: str | Path) -> None:
    """Write `tensors` as torch.save(state_dict, path) does, for the pytorch_model*.bin layouts:
    torch is not installed next to Paddle, and PaddleNLP reads these files itself
    (paddlenlp.utils.serialization.load_torch). The format (torch >= 1.6): an uncompressed zip
    whose records all sit in a folder named after the file's stem, data.pkl first (load_torch
    reads the folder name from the first local header), then byteorder, data/<key> with each
    tensor's raw bytes (64-byte aligned through a zip extra field, as torch pads them), and
    version; data.pkl is a protocol-2 pickle whose tensors refer to their data/<key> through
    persistent ids ('storage', torch.<Type>Storage, key, location, element count). (torch >= 2.1
    also writes .data/serialization_id, which readers treat as optional.)"""
    path = Path(path)
    storages = [_Storage(str(key), np.ascontiguousarray(array)) for key, array in enumerate(tensors.values())]
    state_dict = dict(zip(tensors, map(_Tensor, storages)))
    buffer = io.BytesIO()
    _TorchPickler(buffer, protocol=2).dump(state_dict)
    records = [("data.pkl", buffer.getvalue()), ("byteorder", sys.byteorder.encode())]
    records += [(f"data/{s.key}", s.array.tobytes()) for s in storages] + [("version", b"3\n")]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records:
            info = zipfile.ZipInfo(f"{path.stem}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
            data_start = archive.fp.tell() + 30 + len(info.filename) + 4  # local header + "FB" field header
            info.extra = b"FB" + ((-data_start) % 64).to_bytes(2, "little") + b"Z" * ((-data_start) % 64)
            archive.writestr(info, data)
