"""The demo's model and data for PaddleFormers' own launcher (`python -m paddleformers.cli.launcher
train x.yaml`): the demo's instruction examples (paddle_fastffn/finetune/demo_assets.py, the same
generator and seed) as PaddleFormers' erniekit jsonl ({"src": [prompt], "tgt": [answer]}), a
word-level tokenizer over them (tokenizer.json, which PaddleFormers' AutoTokenizer loads as a
PreTrainedTokenizerFast; nothing is downloaded), and a randomly initialised LLaMA of the demo's
shape saved by PaddleFormers (safetensors, Hugging Face keys). Used by tests/paddleformers and
benchmarks/cpu/bench_paddleformers.py."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from paddle_fastffn.finetune.demo_assets import make_example

SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]
WORD = re.compile(r"\w+|[^\w\s]")
# The demo's model (demo_assets.build: hidden 256, 4 layers, 8 query heads over 4 KV heads).
DEMO_SHAPE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4)


def erniekit_examples(count: int, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    return [{"src": [e["src"]], "tgt": [e["tgt"]]} for e in (make_example(rng) for _ in range(count))]


def write_erniekit(path: Path, examples: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in examples), encoding="utf-8")
    return path


def write_tokenizer(model_dir: Path, examples: list[dict]) -> int:
    """A word-level tokenizer over the examples' words and punctuation; returns its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for e in examples for text in e["src"] + e["tgt"] for w in WORD.findall(text)})
    vocab = {token: i for i, token in enumerate(SPECIAL + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "unk_token": "<unk>",
        "bos_token": "<s>", "eos_token": "</s>", "model_max_length": 512}))
    return len(vocab)


def build(out: Path, train: int = 256, seed: int = 7, **shape) -> Path:
    """out/model (config, safetensors, tokenizer) and out/data/train.jsonl; returns out. fuse_rms_norm
    is saved off so that stock PaddleFormers runs on CPU (its fused norm has no CPU kernel)."""
    import paddle
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    examples = erniekit_examples(train, seed)
    write_erniekit(out / "data" / "train.jsonl", examples)
    vocab_size = write_tokenizer(out / "model", examples)
    paddle.seed(seed)
    config = LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=vocab_size, max_position_embeddings=512,
                         rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=2, eos_token_id=3, tie_word_embeddings=False,
                         fuse_rms_norm=False, **(shape or DEMO_SHAPE))
    LlamaForCausalLM(config).save_pretrained(str(out / "model"))
    return out


def sft_yaml(path: Path, assets: Path, output_dir: Path, **overrides) -> Path:
    """A CPU SFT config for PaddleFormers' launcher over `assets` (build's folder)."""
    values = dict(stage="SFT", fine_tuning="full", model_name_or_path=str(assets / "model"),
                  train_dataset_type="erniekit", train_dataset_path=str(assets / "data" / "train.jsonl"),
                  train_dataset_prob="1.0", template="default", max_seq_len=64, packing=False,
                  _attn_implementation="sdpa", compute_type="float32", amp_master_grad=False, device="cpu",
                  output_dir=str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=1,
                  max_steps=4, learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
                  save_strategy="no", seed=42, do_train=True, do_eval=False, report_to="none", disable_tqdm=True,
                  dataloader_num_workers=0, overwrite_output_dir=True)
    values.update(overrides)
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in values.items()))
    return path
