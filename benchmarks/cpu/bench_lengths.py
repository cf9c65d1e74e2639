"""CPU fine-tune benchmark on real SFT lengths: the demo-size LLaMA model trained through Paddle on
batches whose lengths follow a real dataset (benchmarks/sft_lengths.py: random token ids, real
lengths, PaddleNLP's truncation, labels on response tokens), one contender after the other within
each repeat (the first alternates between repeats), on 1 and 2 threads.

    python -m benchmarks.cpu.bench_lengths [--profiles gsm8k oasst1_zh] [--threads 1 2]
        [--examples 24 12] [--repeats 5] [--packed-rows 1] [--contenders ...] [--results-dir DIR]
        [--results-name cpu_lengths]

A contender is a way to build batches plus a model setting (stock PaddleNLP or use_fast_ffn), so
packed rows (PaddleNLP zero_padding) are more entries of CONTENDERS: stock_zero_padding (PaddleNLP's
dense mask, a row each), fast_packed (segments, the batch's rows flattened to one row: the fast
path's collator default) and fast_packed_rows (segments, a row each padded to the batch's longest:
what flattening saves). Packed contenders take --packed-rows rows a step (PaddleNLP's clients set
per_device_train_batch_size 4), padded ones --batch-size examples.
Each thread count runs in its own process with OMP_NUM_THREADS set, as a user would launch it;
within it every repeat rebuilds each contender's model from the same seed and trains it on the
same batches. Effective tokens/s counts labelled tokens only (padding and prompt tokens do not
count). Writes DIR/NAME.json (default benchmarks/results/cpu_lengths.json) with the load average
at start and end (the machine is shared).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from benchmarks import sft_lengths
from benchmarks.common import RESULTS_DIR, cpu_model, write_results

REPO = Path(__file__).resolve().parents[2]
# The embedded demo model's shape (paddle_fastffn/finetune/demo_assets.py: hidden 256, 4 layers,
# GQA 8/4 heads, SwiGLU width 704, its ~600-piece tokenizer), with positions for 2048 tokens.
DEMO_MODEL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=600, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
MAX_LENGTH = 2048  # PaddleNLP's default max_length, which the length profiles' truncation uses
LEARNING_RATE = 1e-3
MODEL_SEED = 7


@dataclass(frozen=True)
class Contender:
    """One row of the benchmark: how its batches are built from the examples, and the model."""
    name: str
    build_batches: Callable[[list, argparse.Namespace], list]  # (examples, args) -> batches (numpy or paddle)
    use_fast_ffn: bool
    fast_ffn_options: dict = field(default_factory=dict)  # apply_fast_ffn_to_llama keywords


def padded(examples, args):
    return sft_lengths.padded_batches(examples, args.batch_size, pad_id=DEMO_MODEL["pad_token_id"])


def packed(form: str, flatten: bool | None = None):
    """Rows of up to MAX_LENGTH tokens, PaddleNLP zero_padding's sequential rule, --packed-rows rows
    a step (paddle_fastffn.finetune.packing: "dense_mask" for stock, "segments" for the fast path;
    flatten as PackedCollator's, None being the form's default)."""
    def build(examples, args):
        from paddle_fastffn.finetune import packing

        return packing.packed_batches(examples, MAX_LENGTH, batch_size=args.packed_rows, form=form,
                                      pad_token_id=DEMO_MODEL["pad_token_id"], flatten=flatten)[0]
    return build


CONTENDERS = {
    "stock_padded": Contender("stock_padded", padded, use_fast_ffn=False),
    "fast_padded": Contender("fast_padded", padded, use_fast_ffn=True),
}
if importlib.util.find_spec("paddle_fastffn.finetune.packing") is not None:  # packed contenders where packing exists
    CONTENDERS["stock_zero_padding"] = Contender("stock_zero_padding", packed("dense_mask"), use_fast_ffn=False)
    CONTENDERS["fast_packed"] = Contender("fast_packed", packed("segments"), use_fast_ffn=True)
    CONTENDERS["fast_packed_rows"] = Contender("fast_packed_rows", packed("segments", flatten=False),
                                               use_fast_ffn=True)


def build_model_and_optimizer(contender: Contender):
    """The demo-size model from MODEL_SEED, stock or with the fast path enabled (class-level patch,
    reverted for stock), and its AdamW (the fast path's Trainer would build FastAdamW)."""
    import paddle
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    import paddle_fastffn

    paddle_fastffn.revert_fast_ffn()
    optimizer_cls = paddle.optimizer.AdamW
    if contender.use_fast_ffn:
        paddle_fastffn.apply_fast_ffn_to_llama(**contender.fast_ffn_options)
        if contender.fast_ffn_options.get("fused_optimizer", True):
            from paddle_fastffn.optim import FastAdamW as optimizer_cls
    paddle.seed(MODEL_SEED)
    model = LlamaForCausalLM(LlamaConfig(**DEMO_MODEL))
    model.train()
    return model, optimizer_cls(learning_rate=LEARNING_RATE, parameters=model.parameters())


def train(model, optimizer, batches) -> list[float]:
    import paddle

    losses = []
    for batch in batches:
        loss = model(**{k: v if isinstance(v, paddle.Tensor) else paddle.to_tensor(v) for k, v in batch.items()})[0]
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    return losses


def time_contender(contender: Contender, batches) -> dict:
    model, optimizer = build_model_and_optimizer(contender)
    start, start_cpu = time.perf_counter(), time.process_time()
    losses = train(model, optimizer, batches)
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - start_cpu,
            "losses": losses}


def worker(args) -> dict:
    """One profile at the thread count this process was started with: every contender `repeats`
    times, alternating the order, after one untimed warm-up batch each."""
    import paddle

    profile = sft_lengths.load_profile(args.profile)
    order = sft_lengths.example_order(len(profile.prompt), seed=args.seed, limit=args.examples[0])
    examples = sft_lengths.make_examples(profile, order, DEMO_MODEL["vocab_size"], seed=args.seed)
    contenders = [CONTENDERS[name] for name in args.contenders]
    batches = {c.name: c.build_batches(examples, args) for c in contenders}
    for c in contenders:
        train(*build_model_and_optimizer(c), batches[c.name][:1])
    runs = {c.name: [] for c in contenders}
    for repeat in range(args.repeats):
        for c in (contenders if repeat % 2 == 0 else contenders[::-1]):
            runs[c.name].append(time_contender(c, batches[c.name]))
            print(f"[{args.profile} {os.environ.get('OMP_NUM_THREADS')}t] repeat {repeat} {c.name}: "
                  f"{runs[c.name][-1]['seconds']:.2f} s ({runs[c.name][-1]['cpu_seconds']:.2f} s CPU)",
                  file=sys.stderr, flush=True)
    rows = {}
    for c in contenders:
        seconds = [r["seconds"] for r in runs[c.name]]
        tokens = sum(sft_lengths.labelled_tokens(b) for b in batches[c.name])
        median = statistics.median(seconds)
        rows[c.name] = {
            "seconds_median": median, "seconds_min": min(seconds), "seconds_max": max(seconds),
            "seconds_every_repeat": seconds, "spread": (max(seconds) - min(seconds)) / median,
            "cpu_seconds_median": statistics.median(r["cpu_seconds"] for r in runs[c.name]),
            "labelled_tokens": tokens, "effective_tokens_per_second": tokens / median,
            "batches": len(batches[c.name]), "token_slots": sum(b["input_ids"].size for b in batches[c.name]),
            "first_losses": runs[c.name][0]["losses"][:3], "use_fast_ffn": c.use_fast_ffn,
            "fast_ffn_options": c.fast_ffn_options}
    return {"profile": args.profile, "threads": int(os.environ.get("OMP_NUM_THREADS", "0")),
            "paddle_threads": paddle.get_num_threads() if hasattr(paddle, "get_num_threads") else None,
            "examples": len(examples), "rows": rows}


def run_worker(args, profile: str, examples: int, threads: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.cpu.bench_lengths", "--worker", "--profile", profile,
           "--examples", str(examples), "--repeats", str(args.repeats), "--batch-size",
           str(args.batch_size), "--packed-rows", str(args.packed_rows), "--seed", str(args.seed),
           "--contenders", *args.contenders]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    out = subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def flattening(results) -> list[dict]:
    """fast_packed (flattened) against fast_packed_rows (the same rows, a row each) where both ran:
    token slots saved and the speedup in effective tokens/s (ratio of median seconds)."""
    out = []
    for result in results:
        flat, rows = (result["rows"].get(name) for name in ("fast_packed", "fast_packed_rows"))
        if flat and rows:
            out.append({"profile": result["profile"], "threads": result["threads"],
                        "token_slots": {"flattened": flat["token_slots"], "rows": rows["token_slots"]},
                        "speedup": rows["seconds_median"] / flat["seconds_median"],
                        "spread": {"flattened": flat["spread"], "rows": rows["spread"]}})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", nargs="+", default=["gsm8k", "oasst1_zh"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--examples", nargs="+", type=int, default=[24, 12],
                        help="examples of each profile, in --profiles order (the first N after a seeded shuffle)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4, help="examples per step of the padded contenders")
    parser.add_argument("--packed-rows", type=int, default=1,
                        help="packed rows (of up to 2048 tokens) per step of the packed contenders")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--results-name", default="cpu_lengths", help="the results file's name, without .json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("batch_size", "packed_rows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.worker:
        print(json.dumps(worker(args)))
        return
    load_start = os.getloadavg()
    if len(args.examples) != len(args.profiles):
        parser.error(f"--examples needs one count per profile ({len(args.profiles)}), got {args.examples}")
    results = [run_worker(args, profile, examples, threads) for threads in args.threads
               for profile, examples in zip(args.profiles, args.examples)]
    load_end = os.getloadavg()
    print(f"\n{'profile':12s}{'threads':>8s}{'contender':>16s}{'median s':>10s}{'spread':>8s}{'eff tok/s':>11s}"
          f"{'vs stock':>9s}")
    for result in results:
        stock = result["rows"].get("stock_padded")
        for name, row in result["rows"].items():
            ratio = stock["seconds_median"] / row["seconds_median"] if stock else float("nan")
            print(f"{result['profile']:12s}{result['threads']:8d}{name:>16s}{row['seconds_median']:10.2f}"
                  f"{row['spread']:8.0%}{row['effective_tokens_per_second']:11.0f}{ratio:9.2f}")
    import paddle
    import paddlenlp

    path = write_results(args.results_name, {
        "device": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "versions": {"paddle": paddle.__version__, "paddlenlp": paddlenlp.__version__},
        "what": ("demo-size LLaMA-2-architecture model (hidden 256, 4 layers, GQA 8/4 heads, SwiGLU 704, "
                 "vocab 600), float32 on CPU, trained with AdamW on batches of real SFT lengths "
                 "(random ids, PaddleNLP truncation src 1024 / max 2048); seconds for all batches of "
                 "one repeat; effective tokens/s = labelled tokens / median seconds"),
        "load_average": {"start": load_start, "end": load_end},
        "batch_size": args.batch_size, "packed_rows_per_step": args.packed_rows,
        "flattening": flattening(results), "examples_per_profile": dict(zip(args.profiles, args.examples)), "repeats": args.repeats,
        "results": results}, results_dir=args.results_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
