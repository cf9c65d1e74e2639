"""The embedded default: a small instruction dataset generated from templates, a real
sentencepiece tokenizer trained on it, and a randomly initialised LLaMA-2-architecture model
(grouped-query attention, SwiGLU MLP, RMSNorm, rotary), saved in PaddleNLP format. Nothing is
downloaded; the same seed gives the same files.

    python -m paddle_fastffn.finetune.demo_assets --out demo_data
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ["apple", "river", "garden", "planet", "window", "music", "silver", "forest", "bridge",
         "candle", "rocket", "pepper", "castle", "dragon", "island", "mirror", "orange", "pencil",
         "summer", "winter", "yellow", "purple", "butter", "cotton", "engine", "falcon", "guitar",
         "helmet", "jacket", "kettle", "ladder", "magnet", "needle", "oyster", "parrot", "rabbit"]
OPPOSITES = {"hot": "cold", "big": "small", "fast": "slow", "early": "late", "happy": "sad",
             "light": "dark", "open": "closed", "up": "down", "full": "empty", "old": "new",
             "strong": "weak", "high": "low", "loud": "quiet", "wet": "dry", "hard": "soft"}
FRENCH = {"cat": "chat", "dog": "chien", "house": "maison", "water": "eau", "bread": "pain",
          "book": "livre", "sun": "soleil", "moon": "lune", "tree": "arbre", "car": "voiture",
          "friend": "ami", "school": "école", "apple": "pomme", "flower": "fleur", "city": "ville"}


def make_example(rng: random.Random) -> dict:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return {"src": f"What is {a} plus {b}?", "tgt": f"{a} plus {b} is {a + b}."}
    if kind == 1:
        w = rng.choice(WORDS)
        return {"src": f"Reverse the word {w}.", "tgt": f"The word {w} reversed is {w[::-1]}."}
    if kind == 2:
        w, o = rng.choice(sorted(OPPOSITES.items()))
        if rng.random() < 0.5:
            w, o = o, w
        return {"src": f"What is the opposite of {w}?", "tgt": f"The opposite of {w} is {o}."}
    if kind == 3:
        w = rng.choice(WORDS)
        return {"src": f"How many letters are in {w}?", "tgt": f"{w} has {len(w)} letters."}
    w, f = rng.choice(sorted(FRENCH.items()))
    return {"src": f"Translate to French: {w}", "tgt": f"In French, {w} is {f}."}


def write_dataset(out: Path, train: int, dev: int, seed: int) -> Path:
    rng = random.Random(seed)
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, count in (("train.json", train), ("dev.json", dev)):
        with open(data / name, "w", encoding="utf-8") as f:
            for _ in range(count):
                f.write(json.dumps(make_example(rng), ensure_ascii=False) + "\n")
    return data


def train_tokenizer(data: Path, out: Path, vocab_size: int) -> Path:
    import sentencepiece as spm
    from paddlenlp.transformers import LlamaTokenizer

    corpus = out / "tokenizer_corpus.txt"
    with open(corpus, "w", encoding="utf-8") as f:
        for name in ("train.json", "dev.json"):
            for line in open(data / name, encoding="utf-8"):
                row = json.loads(line)
                f.write(row["src"] + "\n" + row["tgt"] + "\n")
    prefix = out / "spm"
    # LLaMA's conventions: <unk>=0, <s>=1, </s>=2, byte fallback, no pad piece.
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(prefix), vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=1.0,
        num_threads=2, minloglevel=2)
    model_dir = out / "model"
    tokenizer = LlamaTokenizer(vocab_file=str(prefix) + ".model")
    tokenizer.pad_token = tokenizer.unk_token
    tokenizer.save_pretrained(str(model_dir))
    corpus.unlink()
    return model_dir


def build_model(model_dir: Path, vocab_size: int, seed: int, hidden: int, layers: int) -> None:
    import paddle
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    paddle.seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3 + 63) // 64 * 64,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(model_dir))


def ulp_twin(model_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """A copy of the model folder whose every weight is one fp32 ulp away from the original (up or
    down at random): the smallest change float32 can make, to measure how far rounding-level
    differences carry through training (the demo's noise floor)."""
    import shutil

    import numpy as np
    import paddle

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    state = paddle.load(str(model_dir / "model_state.pdparams"))
    rng = np.random.default_rng(seed)
    for name, tensor in state.items():
        values = np.asarray(tensor.numpy() if hasattr(tensor, "numpy") else tensor)
        towards = np.where(rng.random(values.shape) < 0.5, -np.inf, np.inf).astype(values.dtype)
        state[name] = paddle.to_tensor(np.nextafter(values, towards))
    paddle.save(state, str(out_dir / "model_state.pdparams"))
    return out_dir


def build(out: str | Path = "demo_data", train: int = 4000, dev: int = 200, seed: int = 7,
          vocab_size: int = 600, hidden: int = 256, layers: int = 4) -> Path:
    out = Path(out)
    data = write_dataset(out, train, dev, seed)
    model_dir = train_tokenizer(data, out, vocab_size)
    from paddlenlp.transformers import LlamaTokenizer

    build_model(model_dir, len(LlamaTokenizer.from_pretrained(str(model_dir))), seed, hidden, layers)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo_data")
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--dev", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ulp-twin-of", help="write a one-ulp twin of this model folder to --out instead")
    args = parser.parse_args()
    if args.ulp_twin_of:
        print(f"one-ulp twin of {args.ulp_twin_of} in {ulp_twin(args.ulp_twin_of, args.out)}/")
        return
    out = build(args.out, args.train, args.dev, hidden=args.hidden, layers=args.layers)
    print(f"demo model, tokenizer and data in {out}/")


if __name__ == "__main__":
    main()
