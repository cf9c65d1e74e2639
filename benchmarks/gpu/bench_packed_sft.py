"""Packed SFT on the H200: a whole training step on real SFT length profiles,
every contender in the same run:

    python3 -m benchmarks.gpu.bench_packed_sft --out packed_sft.json [--profiles gsm8k oasst1_zh]

Model: LLaMA-2-7B width (hidden 4096, intermediate 11008, 32 heads, vocab 32000), 8 layers, bf16
weights. Data: a step is the examples of the first `--rows-per-step` rows of `--row-tokens` (4096)
tokens that PaddleNLP's zero_padding rule fills from the profile in shuffled order (random token
ids, the profile's real lengths under PaddleNLP's truncation with max_length = the row length,
labels on response tokens only; benchmarks/sft_packed_steps.py). Every contender trains exactly
these examples with the same ids and labels, so each step carries the same labelled tokens, and
its loss is the mean over them:

- ours_packed: paddle_fastffn.torch.llama.FastLlama (the Paddle fast path's composition) on the zero_padding rows
  as the product's collator gives them (PackedCollator's default): flattened to one row
  [1, tokens], no padding, so the same token work as the padding-free peer (the per-row layout,
  each row padded to the longest, is sft_packed_steps.packed_layout(flatten=False)); rotary at
  per-token position ids (restarting per example; the rope table spans the row), attention per
  segment as one variable-length flash-attention call over PackedSegments' cu_seqlens (the Paddle
  path's flash_attn_unpadded contract; torch's built-in varlen kernel, paddle_fastffn.torch.llama.packed_attention),
  the fused loss on the labelled rows only (ops.labelled_rows, as the Paddle op).
- hf_liger_padding_free: Hugging Face's LlamaForCausalLM on its flash-attention padding-free path
  (hf_varlen_attention: Hugging Face's flash path with torch's varlen kernel in place of the
  flash-attn package, so attention is the same kernel as ours), patched by Liger (rope, RMSNorm,
  SwiGLU, fused linear cross-entropy), on one row of all the examples concatenated with position
  ids restarting and the examples' cu_seq_lens as DataCollatorWithFlattening(return_flash_attn_kwargs=True)
  gives them.
- hf_liger_padded: the same model with sdpa (Hugging Face's default) on micro-batches of
  `--padded-batch-size` examples padded to their longest (its default collator) with their
  attention_mask, gradient accumulation over the step (num_items_in_batch = the step's labelled
  tokens, so the summed loss is the same mean).
Hugging Face forwards run with use_cache=False, as a training forward: with its KV cache on, Hugging
Face does not detect packed sequences and the padding-free row would attend across examples.

Hugging Face contenders get the labels pre-shifted as `shift_labels` (which Liger's and Hugging
Face's losses use in place of shifting `labels`), so no example loses its last label to the shift. Every contender steps the
same optimizer, the one-pass master-weight AdamW kernel (bench_step.fused_master_adamw). Timing:
round-robin over rebuilt contenders (bench_gpu.round_robin_rebuilt: every round builds, warms up,
times and frees each contender once, in rotated order, at least 3 rounds; each figure is the median
of the round medians with its spread, common.TIE_RULE). Reported: labelled tokens/s (the step's
labelled tokens / the step's median time), step time, forward+backward and optimizer apart, peak
memory, and each contender's first loss (same weights, same examples: they must agree).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time

import torch

from benchmarks.common import MIN_REPEATS, compare
from benchmarks.gpu import hf_varlen_attention
from benchmarks.gpu.bench_gpu import _liger_version, environment, liger_patched, round_robin_rebuilt
from benchmarks.gpu.bench_step import fused_master_adamw, hf_config, measure_training, new_hf_model
from benchmarks import sft_lengths
from benchmarks.sft_packed_steps import ROW_TOKENS, build_step

# LLaMA-2-7B width, 8 layers; seq is the longest position a row can hold (rope tables, HF config).
MODEL = dict(hidden=4096, inter=11008, heads=32, kv_heads=32, layers=8, vocab=32000, seq=ROW_TOKENS)
PROFILES = ("gsm8k", "oasst1_zh")
# Each contender and the layout of the step it trains (sft_packed_steps.StepBatches).
CONTENDERS = {"ours_packed": "packed", "hf_liger_padding_free": "flattened", "hf_liger_padded": "padded"}
# The project's targets for ours_packed in labelled tokens/s (ratios of step times on equal work).
TARGETS = {"hf_liger_padded": 1.8, "hf_liger_padding_free": 1.15}


def on_device(batch: dict, device="cuda") -> dict:
    """numpy int64 arrays -> device tensors (host-side entries such as cu_seqlens stay as they are)."""
    return {k: torch.as_tensor(v, device=device) if k in ("input_ids", "labels", "position_ids", "attention_mask",
                                                              "attn_mask_startend_row_indices")
            else v for k, v in batch.items()}


def hf_model(attn_implementation: str, base, model=None):
    """A Hugging Face LlamaForCausalLM with `base`'s weights and the given attention (built inside
    liger_patched by the caller, so Liger's classes and forward are the ones it gets)."""
    if attn_implementation == hf_varlen_attention.NAME:
        hf_varlen_attention.register()
    config = hf_config(model or MODEL)
    config._attn_implementation = attn_implementation
    model = new_hf_model(config)
    model.load_state_dict(base.state_dict())
    return model


def hf_padding_free_loss(model, flat):
    """Hugging Face's padding-free forward: one row, position ids restarting per example, no
    attention_mask, and the flash-attention kwargs of DataCollatorWithFlattening where the batch has
    them (cu_seq_lens_q/k, max_length_q/k). use_cache=False as in training: with a KV cache Hugging
    Face skips its packed-sequence detection (masking_utils._preprocess_mask_arguments) and every
    example would attend to the ones before it in the row."""
    flash = {k: flat[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k") if k in flat}
    return model(input_ids=flat["input_ids"], position_ids=flat["position_ids"], labels=flat["labels"],
                 shift_labels=flat["labels"], use_cache=False, **flash).loss


def hf_padded_loss(model, batch, labelled_tokens):
    """One padded micro-batch's share of the step's loss: its sum over labelled tokens divided by
    the step's labelled tokens (num_items_in_batch, as Hugging Face's Trainer under gradient
    accumulation)."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                 shift_labels=batch["labels"], num_items_in_batch=labelled_tokens, use_cache=False).loss


def accumulating_forward(model, micro_batches, labelled_tokens, accumulation=1):
    """forward() over padded micro-batches with gradient accumulation: every micro-batch but the
    last runs its backward inside; the returned loss is the last one's (whose backward the
    training step runs) plus the earlier ones' values, so it is the step's loss. Each micro-batch's
    loss is its sum over labelled tokens / the step's labelled tokens (hf_padded_loss).
    accumulation: how many times the training step runs this forward before its optimizer step
    (bench_step.accumulated_backward, which divides the returned loss by it): the backwards run
    here are divided by it too, so every micro-batch weighs the same."""
    def forward():
        earlier = None
        for batch in micro_batches[:-1]:
            loss = hf_padded_loss(model, batch, labelled_tokens)
            (loss / accumulation if accumulation > 1 else loss).backward()
            earlier = loss.detach() if earlier is None else earlier + loss.detach()
        loss = hf_padded_loss(model, micro_batches[-1], labelled_tokens)
        return loss if earlier is None else loss + earlier
    return forward


def contenders(base, step):
    """{name: () -> (model, forward, make_optimizer)} over the step's three layouts."""
    from paddle_fastffn.torch.llama import FastLlama

    packed, flat = on_device(step.packed), on_device(step.flattened)
    padded = [on_device(b) for b in step.padded]
    labelled = step.labelled_tokens

    def ours_packed():
        model = FastLlama(base)
        return model, lambda: model(packed["input_ids"], packed["labels"], packed["position_ids"],
                                    row_ends=packed["attn_mask_startend_row_indices"]), fused_master_adamw

    flat.update(hf_varlen_attention.collator_kwargs(flat["position_ids"]))

    def hf_liger_padding_free():
        model = hf_model(hf_varlen_attention.NAME, base)
        return model, lambda: hf_padding_free_loss(model, flat), fused_master_adamw

    def hf_liger_padded():
        model = hf_model("sdpa", base)
        return model, accumulating_forward(model, padded, labelled), fused_master_adamw

    return {"ours_packed": ours_packed, "hf_liger_padding_free": hf_liger_padding_free,
            "hf_liger_padded": hf_liger_padded}


def profile_section(profile, args, report, save, started):
    step = build_step(profile, rows_per_step=args.rows_per_step, row_tokens=args.row_tokens,
                      padded_batch_size=args.padded_batch_size, vocab_size=MODEL["vocab"], seed=args.seed,
                      src_length=args.src_length)
    summary = step.summary()
    report[profile] = section = {"step": summary}
    print(f"{profile}: {summary['examples']} examples, {summary['labelled_tokens']} labelled tokens, packed "
          f"{summary['packed_shape']}, flattened {summary['token_slots']['flattened']} tokens, padded "
          f"{len(step.padded)} micro-batches ({summary['padding_share']['padded']:.1%} padding)", flush=True)
    torch.manual_seed(0)
    base = new_hf_model(hf_config(MODEL))
    builders = contenders(base, step)

    def measured(name):
        def run():
            patch = liger_patched(fused_linear_cross_entropy=True) if name.startswith("hf_liger") \
                else contextlib.nullcontext()
            with patch:
                model, forward, make_optimizer = builders[name]()
                row = measure_training(forward, model, make_optimizer, steps=args.steps)
            row["optimizer_used"] = " ".join(make_optimizer.__doc__.split("\n\n")[0].split())
            row["layout"] = CONTENDERS[name]
            return row
        return run

    def progress(name, index, row):
        print(f"{profile} {name} round {index}: step {row.get('step_ms', row.get('error'))} ms (fwd+bwd "
              f"{row.get('forward_backward_ms')}, optimizer {row.get('optimizer_ms')}), peak "
              f"{row.get('peak_bytes', 0) / 2**30:.2f} GiB, first loss {row.get('first_losses', [None])[0]} at "
              f"{time.time() - started:.0f}s", flush=True)
        section.setdefault("rounds_so_far", []).append({"contender": name, "round": index, **row})
        save()

    results = round_robin_rebuilt({name: measured(name) for name in CONTENDERS if name in args.contenders},
                                  args.rounds, progress)
    section.pop("rounds_so_far", None)
    for row in results.values():
        if "step" in row:
            row.update({k: row["step"][k] for k in ("p50_ms", "p20_ms", "p80_ms", "spread_ms", "repeats")})
            row["labelled_tokens_per_s"] = summary["labelled_tokens"] / (row["p50_ms"] * 1e-3)
    section["results"] = results
    section["comparison"] = compare_contenders(results)
    section["timing"] = (f"round-robin over rebuilt contenders, {max(args.rounds, MIN_REPEATS)} rounds of "
                         f"{args.steps} timed steps (after 3 warm-up steps), median of round medians")
    save()
    del base, builders
    gc.collect()
    torch.cuda.empty_cache()


def compare_contenders(results: dict) -> dict:
    """ours_packed against each peer on equal work: speedup in labelled tokens/s (= the peer's
    step time / ours), the tie rule's verdict, the TARGETS entry, and the first-step losses'
    relative difference (the same weights and examples: a check that the work is the same)."""
    ours = results.get("ours_packed", {})
    out = {}
    for peer, target in TARGETS.items():
        row = results.get(peer, {})
        if "p50_ms" not in ours or "p50_ms" not in row:
            continue
        first_ours, first_peer = ours["first_losses"][0], row["first_losses"][0]
        out[peer] = {**compare(ours, row), "target": target,
                     "meets_target": row["p50_ms"] / ours["p50_ms"] >= target,
                     "first_loss_relative_difference": abs(first_ours - first_peer) / abs(first_peer)}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES))
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS))
    parser.add_argument("--rows-per-step", type=int, default=4)
    parser.add_argument("--row-tokens", type=int, default=ROW_TOKENS)
    parser.add_argument("--padded-batch-size", type=int, default=8,
                        help="examples per padded micro-batch of hf_liger_padded")
    parser.add_argument("--src-length", type=int, default=1024, help="PaddleNLP's src_length (prompt cut)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per contender per round")
    parser.add_argument("--rounds", type=int, default=3, help="round-robin rounds (at least 3)")
    args = parser.parse_args()
    if args.row_tokens > MODEL["seq"]:
        parser.error(f"--row-tokens must be at most {MODEL['seq']} (the model's rope table and positions)")
    unknown = sorted(set(args.contenders) - set(CONTENDERS))
    if unknown:
        parser.error(f"--contenders: unknown {unknown}; choose from {list(CONTENDERS)}")
    missing = [name for name in args.profiles if name in sft_lengths.PROFILES
               and not (sft_lengths.DATA_DIR / sft_lengths.PROFILES[name]).exists()]
    if missing:
        raise SystemExit(f"length profiles {missing} not found in {sft_lengths.DATA_DIR}: copy "
                         f"/work/shared/data/sft_lengths_*.json into .sft_lengths/ and carry it, or set "
                         f"FASTFFN_SFT_LENGTHS_DIR")
    if _liger_version() is None:
        raise SystemExit("liger-kernel is missing: carry its wheel (shared/gpu.md); the peers need it")
    torch.backends.cuda.matmul.allow_tf32 = True
    started = time.time()
    report = {"environment": environment(),
              "command": "python3 -m benchmarks.gpu.bench_packed_sft " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                  for k, v in vars(args).items()),
              "model": MODEL, "targets": TARGETS,
              "note": "Ours: the csrc/kernels CUDA sources through ctypes in the Paddle fast path's composition; "
                      "torch's cuBLAS, embedding and built-in flash-attention varlen kernel (over cu_seqlens) stand in "
                      "for Paddle's GEMMs and flash_attn_unpadded; the padding-free peer runs Hugging Face's flash "
                      "padding-free path over the same kernel. "
                      "Every contender steps the one-pass master-weight AdamW kernel.",
              "packed_sft": {}}

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2, default=str)

    for profile in args.profiles:
        profile_section(profile, args, report["packed_sft"], save, started)
    save()
    print(f"wrote {args.out} in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
