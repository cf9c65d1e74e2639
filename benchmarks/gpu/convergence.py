"""FP8 against bf16, and the optimizer's memory modes against fp32-state AdamW, in convergence: a
~100M-parameter LLaMA (12 layers x 768, GQA 12/4, FFN 3072, byte-level vocabulary of 256) trained
from scratch on real text found on the machine without downloads, the Python standard library's
source files, through the fast path's composition (paddle_fastffn.torch.llama.FastLlama). Every run
starts from the same initial weights and sees the same batches:

    python3 -m benchmarks.gpu.convergence --out convergence.json [--steps 2000]
        [--precisions bf16 fp8_current fp8_delayed] [--optimizers ours_int8_compensated torch_bf16 ...]

--precisions: one run each with AdamW on fp32 masters and fp32 moments (MasterWeightAdamW, the
reference). --optimizers: one bf16 run each with another optimizer state (OPTIMIZERS), as the
memory modes' evidence: ours (FusedMasterAdamW, FastAdamW's kernel) with 8-bit moments and/or the
Kahan-compensated bf16 weights in place of fp32 masters, and the peers Hugging Face users pick to
save that memory: torch's fused AdamW on the bf16 weights (no master) and torchao's AdamW8bit (8-bit
moments, no master). Every optimizer has the same hyper-parameters and clips the global norm to 1.0.

Reports per-step training losses, held-out losses every --eval-every steps, the final losses
(mean of the last 100 training steps, and the last held-out loss), and loss spikes. Every run sees
the same batches, so a spike is measured against bf16 on the same batch: a step after warm-up
whose loss exceeds bf16's by more than benchmarks.common.SPIKE_RATIO. (A rule against the mean of
the previous 50 steps flagged 230 of 2000 steps in bf16 itself, because batches of different
source files differ in loss by more than 10%: that rule's "spikes" are in benchmarks/results/run8/convergence.json
at commit 8c5140e.)
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import torch

from benchmarks.common import same_batch_spikes
from benchmarks.gpu.bench_gpu import DT, environment
from paddle_fastffn.torch.fp8.ffn import Fp8Recipe
from paddle_fastffn.torch.llama import FastLlama, FusedMasterAdamW, MasterWeightAdamW

MODEL = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_key_value_heads=4,
             num_hidden_layers=12, vocab_size=256, rms_norm_eps=1e-5, max_position_embeddings=1024,
             tie_word_embeddings=False)


def corpus(holdout_fraction=0.02) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The standard library's .py files, sorted by path and concatenated as bytes (token = byte);
    the last files (holdout_fraction of the bytes) are the held-out set."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    blobs = [p.read_bytes() for p in files]
    data = b"\n".join(blobs)
    split = int(len(data) * (1 - holdout_fraction))
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    info = {"root": str(root), "files": len(files), "bytes": len(data), "train_bytes": split,
            "heldout_bytes": len(data) - split}
    return tokens[:split], tokens[split:], info


def batches(data: torch.Tensor, batch: int, seq: int, seed: int):
    """Random windows of seq tokens, the same sequence for every run with the same seed."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        yield torch.stack([data[s:s + seq] for s in starts.tolist()]).long()


# What the section trains by default; fp8_delayed_fp8_head: the LM head's GEMMs in FP8 too, whose
# distance from bf16 decides Fp8Recipe.lm_head's default.
PRECISIONS = ("bf16", "fp8_current", "fp8_delayed", "fp8_delayed_fp8_head")
# The bf16 runs with another optimizer state than the reference's fp32 masters and moments, by name:
# (what it keeps per bf16 parameter beside the weight, whose optimizer).
OPTIMIZERS = {
    "fp32_master": "fp32 master, fp32 moments (torch's fused AdamW on the masters: the reference)",
    "ours_fp32": "fp32 master, fp32 moments (FastAdamW's kernel)",
    "ours_int8": "fp32 master, 8-bit blockwise moments (FastAdamW moments='int8')",
    "ours_compensated": "bf16 Kahan compensation, fp32 moments (FastAdamW master_weights='compensated')",
    "ours_int8_compensated": "bf16 compensation, 8-bit moments (FastAdamW's low-memory state)",
    "torch_bf16": "no master, bf16 moments (torch.optim.AdamW(fused=True) on the bf16 weights)",
    "torchao_8bit": "no master, 8-bit moments (torchao.optim.AdamW8bit on the bf16 weights)",
}
MEMORY_MODES = ("ours_int8", "ours_compensated", "ours_int8_compensated", "torch_bf16", "torchao_8bit")
HYPER = dict(betas=(0.9, 0.95), weight_decay=0.1)
MAX_GRAD_NORM = 1.0


class ClippedTorchOptimizer:
    """A torch optimizer stepping the bf16 parameters themselves, after torch's global-norm clip
    of their bf16 gradients (what a Hugging Face Trainer does with max_grad_norm: the norm and the
    scaling in bf16, where the fp32-master reference clips fp32 copies and ours scales in fp32 as
    its kernel reads each gradient; Adam is nearly invariant to that ~0.2% difference in scale)."""

    def __init__(self, optimizer, params):
        self.optimizer, self.params = optimizer, params

    def set_lr(self, lr):
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers hold it as a tensor, written in place
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr

    def step(self):
        torch.nn.utils.clip_grad_norm_(self.params, MAX_GRAD_NORM, foreach=True)
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)


def make_optimizer(name: str, params, lr: float):
    """The optimizer `name` of OPTIMIZERS over `params`, with set_lr(lr), step() and zero_grad()."""
    params = [p for p in params if p.requires_grad]
    if name == "fp32_master":
        return MasterWeightAdamW(params, lr=lr, max_grad_norm=MAX_GRAD_NORM, **HYPER)
    if name.startswith("ours_"):
        fmt = name.removeprefix("ours_")
        return FusedMasterAdamW(params, lr=lr, max_grad_norm=MAX_GRAD_NORM, **HYPER,
                                moments="int8" if "int8" in fmt else "fp32",
                                master_weights="compensated" if "compensated" in fmt else "fp32")
    if name == "torch_bf16":
        return ClippedTorchOptimizer(torch.optim.AdamW(params, lr=lr, fused=True, **HYPER), params)
    if name == "torchao_8bit":
        from torchao.optim import AdamW8bit

        return ClippedTorchOptimizer(AdamW8bit(params, lr=lr, **HYPER), params)
    raise ValueError(f"argument `optimizer` must be one of {list(OPTIMIZERS)}, got {name!r}")


def lr_at(step, steps, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def fp8_recipe_of(precision: str) -> Fp8Recipe:
    """fp8_current, fp8_delayed (the defaults: gate_up's FP8 copy saved for backward, the LM head in
    bf16), fp8_<kind>_gate_up_activation (the 16-bit gate_up saved instead) and fp8_<kind>_fp8_head
    (the LM head's GEMMs in FP8)."""
    kind, _, rest = precision.removeprefix("fp8_").partition("_")
    if rest not in ("", "gate_up_activation", "fp8_head"):
        raise ValueError(f"unknown precision {precision!r}")
    return Fp8Recipe(scaling=kind, saved_gate_up="activation" if rest == "gate_up_activation" else "fp8",
                     lm_head="fp8" if rest == "fp8_head" else "bf16")


def train(precision, initial_state, train_data, heldout, args, model_config=None, device="cuda",
          optimizer_name="fp32_master"):
    """model_config: LlamaConfig's arguments (MODEL when None); optimizer_name: one of OPTIMIZERS."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    config = LlamaConfig(**(MODEL if model_config is None else model_config))
    config._attn_implementation = "sdpa"
    with torch.device(device):
        hf = modeling_llama.LlamaForCausalLM(config)
    hf.load_state_dict(initial_state)
    recipe = None if precision == "bf16" else fp8_recipe_of(precision)
    model = FastLlama(hf.to(DT), fp8_recipe=recipe)
    del hf
    optimizer = make_optimizer(optimizer_name, model.parameters(), args.lr)
    stream = batches(train_data, args.batch, args.seq + 1, seed=1)
    heldout_batches = [b.to(device) for b, _ in zip(batches(heldout, args.batch, args.seq + 1, seed=2), range(8))]
    losses, evals = [], []
    started = time.time()

    def evaluate():
        with torch.no_grad():
            values = [float(model(b[:, :-1], b[:, 1:].contiguous()).item()) for b in heldout_batches]
        return sum(values) / len(values)

    for step in range(args.steps):
        window = next(stream).to(device, non_blocking=True)
        ids, labels = window[:, :-1], window[:, 1:]  # the pipeline shifts; no ignored positions
        optimizer.set_lr(lr_at(step, args.steps, args.lr, args.warmup))
        loss = model(ids, labels.contiguous())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.invalidate_fp8_weights()
        losses.append(loss.detach())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evals.append({"step": step + 1, "heldout_loss": evaluate()})
            print(f"{precision} {optimizer_name} step {step + 1}: train {float(loss.detach()):.4f} heldout {evals[-1]['heldout_loss']:.4f} "
                  f"({time.time() - started:.0f}s)", flush=True)
    losses = [float(v) for v in torch.stack(losses).cpu()]
    return {"train_loss": losses, "heldout": evals, "final_train_loss_last100": sum(losses[-100:]) / 100,
            "final_heldout_loss": evals[-1]["heldout_loss"],
            "nonfinite_steps": [i for i, v in enumerate(losses) if not math.isfinite(v)],
            "seconds": time.time() - started}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--precisions", nargs="*", default=list(PRECISIONS),
                        help="runs with the reference optimizer (fp32 masters and moments)")
    parser.add_argument("--optimizers", nargs="*", default=[], choices=[n for n in OPTIMIZERS if n != "fp32_master"],
                        help=f"bf16 runs with another optimizer state; the memory modes: {' '.join(MEMORY_MODES)}")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    train_data, heldout, info = corpus()
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    torch.manual_seed(0)
    initial = modeling_llama.LlamaForCausalLM(LlamaConfig(**MODEL)).state_dict()
    params = sum(v.numel() for v in initial.values())
    report = {"environment": environment(), "command": "python3 -m benchmarks.gpu.convergence " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}" for k, v in vars(args).items()),
        "model": {**MODEL, "parameters": params}, "data": info,
        "setup": {"tokens_per_step": args.batch * args.seq, "optimizer": "AdamW, betas (0.9, 0.95), weight decay "
                  "0.1, global grad-norm clip 1.0; --precisions runs on fp32 masters and moments (fp32_master)",
                  "optimizers": {name: OPTIMIZERS[name] for name in ["fp32_master", *args.optimizers]}, "schedule": f"linear warm-up {args.warmup} steps, cosine to "
                  "0.1x", "fp8": "e4m3 forward, e5m2 gradients, per-tensor; weights current-scaled; delayed: "
                  "amax history 1024, max"},
        "runs": {}}
    plan = [(precision, "fp32_master") for precision in args.precisions]
    if args.optimizers and "bf16" not in args.precisions:
        plan.insert(0, ("bf16", "fp32_master"))  # the reference every memory mode is compared with
    plan += [("bf16", name) for name in args.optimizers]
    for precision, optimizer_name in plan:
        run_name = precision if optimizer_name == "fp32_master" else f"bf16+{optimizer_name}"
        report["runs"][run_name] = train(precision, initial, train_data, heldout, args,
                                         optimizer_name=optimizer_name)
        report["runs"][run_name]["optimizer"] = optimizer_name
        with open(args.out, "w") as f:
            json.dump(report, f)
    base = report["runs"].get("bf16")
    if base:
        for precision, run in report["runs"].items():
            run["final_train_vs_bf16"] = run["final_train_loss_last100"] / base["final_train_loss_last100"] - 1
            run["final_heldout_vs_bf16"] = run["final_heldout_loss"] / base["final_heldout_loss"] - 1
            run["spikes_vs_bf16"] = same_batch_spikes(run["train_loss"], base["train_loss"])
    with open(args.out, "w") as f:
        json.dump(report, f)
    for precision, run in report["runs"].items():
        print(f"{precision}: final train {run['final_train_loss_last100']:.4f} heldout {run['final_heldout_loss']:.4f} "
              f"vs bf16 {run.get('final_heldout_vs_bf16', 0):+.3%}, max loss ratio to bf16 on the same batch "
              f"{run.get('spikes_vs_bf16', {}).get('max_ratio')} in {run['seconds']:.0f}s")


if __name__ == "__main__":
    main()
