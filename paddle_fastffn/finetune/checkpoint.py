"""Model and tokenizer from a checkpoint folder, for fine-tuning: PaddleNLP's own folders, and
Hugging Face Hub LLaMA folders as downloaded (tokenizer.model; model.safetensors or
pytorch_model.bin, one file or shards with an index), which PaddleNLP 2.8.1 does not load as they are:

- LlamaTokenizer looks for sentencepiece.bpe.model only: "LlamaTokenizer.__init__() missing 1
  required positional argument: 'vocab_file'". The Hub's tokenizer.model is passed as vocab_file
  (tokenizer.json, where present, stays unread: PaddleNLP 2.8.1 has no fast LLaMA tokenizer).
- from_pretrained(convert_from_torch=True) on sharded checkpoints converts the weights, then matches
  them by the index's Hugging Face names and fails: "The state dictionary of the model you are
  trying to load is corrupted". On one-file checkpoints it loads, but first writes the converted
  weights as model_state.pdparams into the checkpoint folder: a second copy of the model there,
  and a failure where that folder is read-only.

Hub LLaMA weights are therefore read here (PaddleNLP's own reader for .bin, safetensors' for
.safetensors), renamed and transposed by PaddleNLP's LLaMA name mappings, and handed to
from_pretrained as a state dict: dtype casting, key checks and fused-projection / tensor-parallel
conversion stay PaddleNLP's. Nothing is written next to the checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from paddlenlp.generation import GenerationConfig
from paddlenlp.transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from paddlenlp.utils.log import logger
from paddlenlp.utils.serialization import load_torch
from safetensors import safe_open

from ..integration import state as _integration_state

# (index, one-file name) per Hub weight format; safetensors first, as transformers and PaddleNLP prefer.
HF_WEIGHT_NAMES = (("model.safetensors.index.json", "model.safetensors"),
                   ("pytorch_model.bin.index.json", "pytorch_model.bin"))
# PaddleNLP calls the Hub's tokenizer.model sentencepiece.bpe.model (LlamaTokenizer.resource_files_names).
HUB_TOKENIZER_MODEL, PADDLENLP_TOKENIZER_MODEL = "tokenizer.model", "sentencepiece.bpe.model"
WEIGHT_PATTERNS = ("model*.safetensors", "model_state*.pdparams", "pytorch_model*.bin")


def load_model_and_tokenizer(path: str | os.PathLike, dtype: str = "float32", **config_overrides):
    """(model, tokenizer) from `path`: a PaddleNLP checkpoint folder or model name, or a Hugging Face
    Hub LLaMA folder. `config_overrides` update the model config (PaddleNLP's from_pretrained kwargs)."""
    return load_model(path, dtype, **config_overrides), load_tokenizer(path)


def load_tokenizer(path: str | os.PathLike):
    folder = _local_folder(path)
    if folder is None:
        return AutoTokenizer.from_pretrained(str(path))
    if not (folder / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"model_name_or_path={str(path)!r}: no tokenizer_config.json in {folder}, so "
                                f"there is no tokenizer to fine-tune with (a Hub LLaMA folder has "
                                f"tokenizer_config.json and {HUB_TOKENIZER_MODEL})")
    kwargs = {}
    if not (folder / PADDLENLP_TOKENIZER_MODEL).is_file() and (folder / HUB_TOKENIZER_MODEL).is_file():
        kwargs["vocab_file"] = str(folder / HUB_TOKENIZER_MODEL)
    return AutoTokenizer.from_pretrained(str(folder), **kwargs)


def load_model(path: str | os.PathLike, dtype: str = "float32", **config_overrides):
    """A causal LM from `path`; Hub LLaMA folders (any layout) converted in memory, everything
    else by PaddleNLP's from_pretrained as before."""
    folder = _local_folder(path)
    if folder is None:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **config_overrides)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"model_name_or_path={str(path)!r}: no config.json in {folder}; a checkpoint "
                                f"folder has config.json next to its weights")
    if not any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise FileNotFoundError(f"model_name_or_path={str(path)!r}: no weights in {folder} (looked for "
                                f"{', '.join(WEIGHT_PATTERNS)})")
    weight_files = hf_weight_files(folder)
    model_type = json.loads(config_file.read_text()).get("model_type")
    if not weight_files or model_type != "llama":
        # PaddleNLP's own checkpoints; other families' HF checkpoints keep PaddleNLP's conversion.
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype,
                                                    convert_from_torch=bool(weight_files), **config_overrides)

    config = LlamaConfig.from_pretrained(str(folder), **config_overrides)
    logger.info(f"paddle_fastffn: converting the Hugging Face LLaMA weights in {folder} "
                f"({', '.join(f.name for f in weight_files)}) in memory")
    state_dict = llama_state_dict_from_hf(weight_files, config)
    # No path: from_pretrained would resolve the folder's index again and match its HF names.
    model = LlamaForCausalLM.from_pretrained(None, config=config, state_dict=state_dict, dtype=dtype)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    return model


def hf_weight_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of a Hugging Face (PyTorch) checkpoint folder: the shards its index lists,
    or its one file. [] for PaddleNLP checkpoints (their safetensors say format "np", not "pt")."""
    folder = Path(path)
    for index_name, file_name in HF_WEIGHT_NAMES:
        index = folder / index_name
        if index.is_file():
            files = _shards_listed_in(index)
        elif (folder / file_name).is_file():
            files = [folder / file_name]
        else:
            continue
        if files[0].suffix == ".safetensors" and _safetensors_format(files[0]) != "pt":
            return []
        return files
    return []


def is_hf_checkpoint(path: str | os.PathLike) -> bool:
    """A Hugging Face (PyTorch) checkpoint folder: torch-format safetensors or .bin weights."""
    return bool(hf_weight_files(path))


def llama_state_dict_from_hf(weight_files: list[Path], config) -> dict:
    """PaddleNLP LlamaForCausalLM weights from Hugging Face LLaMA files: llama.* names, Paddle's
    [in, out] Linear layout, by LlamaForCausalLM._get_name_mappings (what convert_from_torch uses)."""
    hf = {}
    for file in weight_files:
        hf.update(_read_weight_file(file))
    # Rotary inv_freq is a buffer computed from the config: older Hub checkpoints store it, newer do not.
    hf = {name: tensor for name, tensor in hf.items() if not name.endswith("rotary_emb.inv_freq")}
    if not config.architectures:  # the mappings' model./llama. prefixes depend on it
        config.architectures = ["LlamaForCausalLM"]
    mappings = [m for m in LlamaForCausalLM._get_name_mappings(config)
                if not m.source_name.endswith("rotary_emb.inv_freq")
                and not (config.tie_word_embeddings and m.source_name == "lm_head.weight")]
    missing = [m.source_name for m in mappings if m.source_name not in hf]
    if missing:
        raise ValueError(f"{weight_files[0].parent}: not the LLaMA checkpoint its config.json describes "
                         f"({config.num_hidden_layers} layers): {len(missing)} of {len(mappings)} weights "
                         f"missing from {[f.name for f in weight_files]}, e.g. {missing[:3]}")
    state_dict = {m.target_name: m.run(hf, m.source_name) for m in mappings}
    state_dict.update(hf)  # anything left is not LLaMA's: from_pretrained reports it as unexpected
    return state_dict


def _local_folder(path) -> Path | None:
    """The checkpoint folder `path` names, or None for a PaddleNLP model name (downloaded by
    PaddleNLP). A path that is clearly a filesystem path must exist."""
    text = os.path.expanduser(str(path))
    if os.path.isdir(text):
        return Path(text)
    if os.path.isabs(text) or text.startswith((".", "~")) or os.path.exists(text):
        raise FileNotFoundError(f"model_name_or_path={str(path)!r} is not a checkpoint folder "
                                f"({'a file' if os.path.exists(text) else 'no such directory'})")
    return None


def _shards_listed_in(index: Path) -> list[Path]:
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: no weight_map (tensor name -> shard file), so the shards are unknown")
    files = [index.parent / name for name in sorted(set(weight_map.values()))]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise FileNotFoundError(f"{index} lists shards that are not in {index.parent}: {absent}")
    return files


def _safetensors_format(file: Path) -> str | None:
    with safe_open(str(file), framework="np") as f:
        return (f.metadata() or {}).get("format")


def _read_weight_file(file: Path) -> dict:
    if file.suffix == ".safetensors":
        # framework="paddle": numpy has no bfloat16 (the Hub's LLaMA-3 weights are bf16).
        with safe_open(str(file), framework="paddle") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    # The reader convert_from_torch uses (torch.save's zip format, without torch). It picks the
    # format by file name: pytorch_model.bin or pytorch_model-*.
    if not (file.name == "pytorch_model.bin" or file.name.startswith("pytorch_model-")):
        raise ValueError(f"{file}: PaddleNLP reads .bin weights named pytorch_model.bin or pytorch_model-*.bin")
    return load_torch(str(file))


def load_hub_folder(path, kwargs: dict):
    """LlamaForCausalLM.from_pretrained's Hub-folder path while the fast path is enabled (the patch
    calls it through integration.state.hub_loader): the model loaded from a Hugging Face Hub folder,
    or None where `path` holds no Hub weights (PaddleNLP then loads it as its own)."""
    if not hf_weight_files(path):
        return None
    kwargs.pop("convert_from_torch", None)  # the conversion happens in memory
    return load_model(path, kwargs.pop("dtype", None), **kwargs)


# The patch (integration/) sits below this layer and never imports it: this module offers it the loader.
_integration_state.set_hub_loader(load_hub_folder)
