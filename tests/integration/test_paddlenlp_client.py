"""PaddleNLP's own fine-tune script (the 2.8 llm/ line, kept unmodified in ../shared/clients beside
the repository), run as its users run it: stock, and through `python -m paddle_fastffn` with
`"use_fast_ffn": true` in its own SFT and LoRA JSONs, cut only in paths, sizes and device (CPU:
fp16 off, tensor_parallel_degree 1, report_to none). Single process and under
paddle.distributed.launch (2 ranks, gloo)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from tests.integration.distributed_launch import run_launch
from tolerances import FP8_TRAINING_LOSS_RTOL, FP32_TRAINING_LOSS_RTOL

# CI clones the repository with a copy of shared/ beside it; a worktree elsewhere names the folder
# (the test run's header says which: tests/conftest.py).
from shared_assets import CLIENT, REPO, SHARED_ENV, client_present  # noqa: E402

pytestmark = pytest.mark.skipif(
    not client_present(),
    reason=f"PaddleNLP's llm/ script is not at {CLIENT} (CI puts shared/ beside the repository; "
           f"elsewhere set {SHARED_ENV} to the shared/ folder)")

# The kernels each decoder layer runs on the default fast path, and the fused loss and optimizer.
FAST_PATH_KERNELS = ("fastffn_rms_norm_fwd", "fastffn_rms_norm_bwd", "fastffn_rotary", "fastffn_swiglu_fwd",
                     "fastffn_cross_entropy", "fastffn_adamw_")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny PaddleNLP-format LLaMA folder (GQA, 2 layers) with its tokenizer, {"src", "tgt"} data
    (the format of the script's data.py), and LoRA adapters saved as the script's LoRA flow makes
    them (its target modules, r=lora_rank, alpha=2*r), for lora_path: stock LoRA draws adapters before
    the Trainer seeds, so both runs start from these."""
    from paddlenlp.peft import LoRAConfig, LoRAModel
    from paddlenlp.transformers import AutoModelForCausalLM

    from paddle_fastffn.finetune.demo_assets import build

    root = build(tmp_path_factory.mktemp("client"), train=48, dev=8, vocab_size=400, hidden=64, layers=2)
    model = AutoModelForCausalLM.from_pretrained(str(root / "model"))
    paddle.seed(11)
    targets = [f".*{name}.*" for name in ("q_proj", "v_proj", "k_proj", "o_proj", "gate_proj", "down_proj", "up_proj")]
    lora = LoRAModel(model, LoRAConfig(target_modules=targets, r=8, lora_alpha=16, merge_weights=False,
                                       dtype="float32", base_model_name_or_path=str(root / "model")))
    lora.save_pretrained(str(root / "lora_init"))
    return root


def cut_json(name: str, assets: Path, out: Path, **overrides) -> Path:
    """The shipped llama/<name> with paths, sizes and device cut for a tiny CPU run."""
    config = json.loads((CLIENT / "llama" / name).read_text())
    config.update(model_name_or_path=str(assets / "model"), dataset_name_or_path=str(assets / "data"),
                  output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  per_device_eval_batch_size=4, eval_accumulation_steps=2, max_steps=3, warmup_steps=1,
                  src_length=32, max_length=64, fp16=False, fp16_opt_level="O1", tensor_parallel_degree=1,
                  device="cpu", report_to="none")
    config.update(overrides)
    path = out.parent / f"{out.name}.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def run_client(config: Path, plugin: bool, launch: bool = False) -> dict:
    """Run finetune_generation.py from its own folder, as PaddleNLP documents; returns its per-step
    losses, the fast path's report (plugin runs) and the log."""
    out = Path(json.loads(config.read_text())["output_dir"])
    target = ["finetune_generation.py", str(config)]
    report = out.parent / f"{out.name}_report.{{rank}}.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), PADDLE_FASTFFN_REPORT=str(report), OMP_NUM_THREADS="1")
    if launch:
        report_paths = [str(report).format(rank=rank) for rank in range(2)]
        result, worker_logs = run_launch(target, Path(str(out) + "_logs"), reset=(out, *report_paths), cwd=CLIENT, env=env,
                                         via=["-m", "paddle_fastffn"] if plugin else [])
        logs = result.stdout + result.stderr + "".join(worker_logs.values())
    else:
        cmd = [sys.executable, *(["-m", "paddle_fastffn"] if plugin else []), *target]
        result = subprocess.run(cmd, cwd=CLIENT, capture_output=True, text=True, env=env, timeout=600)
        logs = result.stdout + result.stderr
    assert result.returncode == 0, logs[-6000:]
    state = json.loads((out / "trainer_state.json").read_text())
    reports = [json.loads(p.read_text()) for p in sorted(out.parent.glob(f"{out.name}_report.*.json"))]
    return {"losses": np.array([row["loss"] for row in state["log_history"] if "loss" in row]),
            "reports": reports, "log": logs, "out": out}


def assert_fast_path_ran(run: dict, ranks: int = 1) -> None:
    assert len(run["reports"]) == ranks
    for report in run["reports"]:
        assert report["use_fast_ffn"] and report["fast_path_layers"] == report["decoder_layers"] == 2, report
        missing = [k for k in FAST_PATH_KERNELS if not report["kernel_calls"].get(k)]
        assert not missing, f"compiled ops that never ran: {missing} ({report['kernel_calls']})"
    assert "paddle_fastffn: 2/2 LLaMA decoder layers on the fast path" in run["log"]


def changed_parameters(before: dict, after: dict) -> dict:
    assert sorted(before) == sorted(after)
    return {name: not np.array_equal(np.asarray(before[name]), np.asarray(after[name])) for name in before}


# llama/sft_argument.json ships recompute (non-reentrant), eval with compute_metrics (accuracy) and
# load_best_model_at_end; its later version beside it (sft_argument.2b13c68.json) adds zero_padding and
# use_flash_attention (and use_sparse_mask, a key of later PaddleNLP that this argument.py rejects), so
# the SFT runs add those two. Rows of max_length 64 hold about three of these examples (~20 tokens).
PACKED = dict(zero_padding=True, use_flash_attention=True)


def cut_sft_json(assets: Path, out: Path, **overrides) -> Path:
    return cut_json("sft_argument.json", assets, out, **{**PACKED, **overrides})


@pytest.fixture(scope="module")
def stock_sft(assets, tmp_path_factory):
    return run_client(cut_sft_json(assets, tmp_path_factory.mktemp("sft") / "stock"), plugin=False)


def test_client_sft_json_trains_on_the_fast_path_with_the_stock_losses(assets, stock_sft, tmp_path):
    stock = stock_sft
    assert "Creating Zero Padding Data Stream" in stock["log"]
    off = run_client(cut_sft_json(assets, tmp_path / "off", use_fast_ffn=False), plugin=True)
    fast = run_client(cut_sft_json(assets, tmp_path / "fast", use_fast_ffn=True), plugin=True)
    # The flag false: the plugin is loaded and the script runs stock, bit for bit, no op of ours.
    np.testing.assert_array_equal(off["losses"], stock["losses"])
    assert [r["kernel_calls"] for r in off["reports"]] == [{}] and "on the fast path" not in off["log"]
    assert_fast_path_ran(fast)
    assert fast["reports"][0]["off"] == {}
    assert len(fast["losses"]) == 3
    np.testing.assert_allclose(fast["losses"], stock["losses"], rtol=FP32_TRAINING_LOSS_RTOL)
    # Every parameter stock trains is trained, and saved in the stock layout (unfused names).
    initial = paddle.load(str(assets / "model" / "model_state.pdparams"))
    stock_changed = changed_parameters(initial, paddle.load(str(stock["out"] / "model_state.pdparams")))
    fast_changed = changed_parameters(initial, paddle.load(str(fast["out"] / "model_state.pdparams")))
    assert all(stock_changed.values())
    assert fast_changed == stock_changed


@pytest.fixture(scope="module")
def stock_lora(assets, tmp_path_factory):
    return run_client(cut_json("lora_argument.json", assets, tmp_path_factory.mktemp("lora") / "stock",
                               lora_path=str(assets / "lora_init")), plugin=False)


def test_client_lora_json_trains_on_the_fast_path_with_the_stock_losses(assets, stock_lora, tmp_path):
    adapters = {"lora_path": str(assets / "lora_init")}
    stock = stock_lora
    fast = run_client(cut_json("lora_argument.json", assets, tmp_path / "fast", use_fast_ffn=True, **adapters),
                      plugin=True)
    assert_fast_path_ran(fast)
    # LoRA's adapters sit on PaddleNLP's separate projections; the report says so.
    assert set(fast["reports"][0]["off"]) == {"fuse_projections", "swiglu_recompute"}
    np.testing.assert_allclose(fast["losses"], stock["losses"], rtol=FP32_TRAINING_LOSS_RTOL)
    initial = paddle.load(str(assets / "lora_init" / "lora_model_state.pdparams"))
    stock_changed = changed_parameters(initial, paddle.load(str(stock["out"] / "lora_model_state.pdparams")))
    fast_changed = changed_parameters(initial, paddle.load(str(fast["out"] / "lora_model_state.pdparams")))
    assert any(stock_changed.values()) and fast_changed == stock_changed


def test_client_under_paddle_distributed_launch(assets, tmp_path):
    # Data parallel on CPU (gloo): each rank is a process the launcher starts itself, so the plugin
    # reaches it through PYTHONPATH's sitecustomize (paddle_fastffn/_bootstrap).
    sizes = dict(max_steps=2)
    stock = run_client(cut_sft_json(assets, tmp_path / "stock", **sizes), plugin=False, launch=True)
    fast = run_client(cut_sft_json(assets, tmp_path / "fast", use_fast_ffn=True, **sizes), plugin=True, launch=True)
    assert_fast_path_ran(fast, ranks=2)
    assert sorted(r["rank"] for r in fast["reports"]) == [0, 1]
    np.testing.assert_allclose(fast["losses"], stock["losses"], rtol=FP32_TRAINING_LOSS_RTOL)


@pytest.fixture(scope="module")
def hub_reference(assets, tmp_path_factory):
    """The tiny model as a Hub folder's weights and tokenizer, saved in PaddleNLP's format (what stock
    2.8.1 loads), and the stock run on it: a Hub tokenizer_config says padding_side "right" where
    PaddleNLP's LlamaTokenizer pads left, which moves the positions of packed rows."""
    from paddlenlp.transformers import AutoModelForCausalLM

    from hub_checkpoints import write_hub_tokenizer
    from paddle_fastffn.finetune.checkpoint import load_tokenizer

    root = tmp_path_factory.mktemp("hub_reference")
    (root / "hub_tokenizer").mkdir()
    write_hub_tokenizer(assets / "spm.model", root / "hub_tokenizer")
    AutoModelForCausalLM.from_pretrained(str(assets / "model")).save_pretrained(str(root / "model"))
    load_tokenizer(root / "hub_tokenizer").save_pretrained(str(root / "model"))
    return run_client(cut_sft_json(assets, root / "stock", model_name_or_path=str(root / "model")), plugin=False)


@pytest.mark.parametrize("layout", ["sharded_safetensors", "bin"])
def test_client_loads_a_hub_folder_with_the_plugin(assets, hub_reference, tmp_path, layout):
    # Stock 2.8.1 fails on such a folder (its tokenizer wants sentencepiece.bpe.model; the weights
    # are torch-format); with the plugin the script's AutoModelForCausalLM / AutoTokenizer load it
    # into the model its own config describes: the stock run of the same weights and tokenizer.
    from paddlenlp.transformers import AutoModelForCausalLM

    from hub_checkpoints import save_hub_checkpoint

    model = AutoModelForCausalLM.from_pretrained(str(assets / "model"))
    hub = save_hub_checkpoint(model, tmp_path / "hub", layout, tokenizer_model=assets / "spm.model", dtype="float32")
    assert not (hub / "sentencepiece.bpe.model").exists() and (hub / "tokenizer.model").exists()
    fast = run_client(cut_sft_json(assets, tmp_path / "fast", use_fast_ffn=True, model_name_or_path=str(hub)),
                      plugin=True)
    assert_fast_path_ran(fast)
    np.testing.assert_allclose(fast["losses"], hub_reference["losses"], rtol=FP32_TRAINING_LOSS_RTOL)


# PaddleNLP's model switches through the script, on top of the SFT runs' JSON. None changes stock's
# math on CPU (recompute granularity and reentrancy, attention kernel, fused projections), so each run
# is held to the stock run of the shipped JSON. use_fused_rope is Paddle's GPU kernel (stock turns it
# off on CPU); use_fused_rms_norm needs PaddleNLP's fused_ln package in stock (absent: stock fails),
# and our fused RMSNorm serves it.
SWITCH_SETS = {
    "full_attn_fused_everything": dict(recompute_granularity="full_attn", use_fused_rms_norm=True,
                                       use_fused_rope=True, fuse_attention_qkv=True, fuse_attention_ffn=True),
    "core_attn_reentrant_no_flash": dict(recompute_granularity="core_attn", recompute_use_reentrant=True,
                                         use_flash_attention=False),
}


@pytest.mark.parametrize("switches", list(SWITCH_SETS))
def test_client_switches_take_the_fast_path(assets, stock_sft, tmp_path, switches):
    fast = run_client(cut_sft_json(assets, tmp_path / "fast", use_fast_ffn=True, **SWITCH_SETS[switches]),
                      plugin=True)
    assert_fast_path_ran(fast)
    assert fast["reports"][0]["off"] == {}
    if SWITCH_SETS[switches].get("use_fused_rms_norm"):
        assert "use_fused_rms_norm: paddle_fastffn's fused RMSNorm serves it" in fast["log"]
    np.testing.assert_allclose(fast["losses"], stock_sft["losses"], rtol=FP32_TRAINING_LOSS_RTOL)


def run_ours(config: Path) -> np.ndarray:
    """scripts/run_finetune.py on a JSON of PaddleNLP's llm script; its per-step losses."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "run_finetune.py"), str(config)],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    out = Path(json.loads(config.read_text())["output_dir"])
    summary = json.loads((out / "run_summary.json").read_text())
    return np.array([row["loss"] for row in summary["log_history"]])


def test_our_script_takes_the_client_jsons(assets, stock_sft, stock_lora, tmp_path):
    # The same JSONs (zero_padding by PaddleNLP's InTokens stream, eval accuracy for
    # metric_for_best_model, LoRA alpha 2 x rank) through scripts/run_finetune.py on the fast path
    # train as PaddleNLP's own script does stock.
    sft = run_ours(cut_sft_json(assets, tmp_path / "sft", use_fast_ffn=True, sample_prompts=0))
    np.testing.assert_allclose(sft, stock_sft["losses"], rtol=FP32_TRAINING_LOSS_RTOL)
    lora = run_ours(cut_json("lora_argument.json", assets, tmp_path / "lora", use_fast_ffn=True, sample_prompts=0,
                             lora_path=str(assets / "lora_init")))
    np.testing.assert_allclose(lora, stock_lora["losses"], rtol=FP32_TRAINING_LOSS_RTOL)


def test_our_arguments_are_the_client_scripts_argument_set(monkeypatch):
    """Every key of the llm script's dataclasses (argument.py, and finetune_generation.py's own
    FinetuneArguments) is a key of scripts/run_finetune.py with the same default."""
    import dataclasses
    import importlib

    from paddlenlp.trainer import TrainingArguments as PaddleNLPTrainingArguments

    from paddle_fastffn.finetune import llm_arguments as arguments

    monkeypatch.syspath_prepend(str(CLIENT))
    for name in ("argument", "data", "utils", "finetune_generation"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    client = importlib.import_module("finetune_generation")
    theirs = [client.GenerateArgument, client.QuantArgument, client.ModelArgument, client.DataArgument,
              client.FinetuneArguments]
    ours = {f.name: f for cls in arguments.ARGUMENT_CLASSES for f in dataclasses.fields(cls)}
    base = {f.name for f in dataclasses.fields(PaddleNLPTrainingArguments)}
    checked = 0
    for cls in theirs:
        for f in dataclasses.fields(cls):
            if f.name in base:
                continue
            assert f.name in ours, f"{cls.__name__}.{f.name} is not a key of scripts/run_finetune.py"
            assert arguments._default(ours[f.name]) == f.default, (f.name, ours[f.name].default, f.default)
            assert f"`{f.name}`" in arguments.support_table()
            checked += 1
    assert checked == 79  # the 2.8 llm script declares 79 keys beyond PaddleNLP's TrainingArguments
    for name in ("argument", "data", "utils", "finetune_generation"):
        sys.modules.pop(name, None)


def test_chat_template_conversations_tokenize_as_the_client_script_does(assets, monkeypatch):
    """Multi-turn data through a chat template: scripts/run_finetune.py's tokenization
    (paddle_fastffn/finetune/chat.py) gives the token ids and labels of the llm script's data.py,
    rounds dropped and the last round cut where they do not fit."""
    import copy
    import importlib
    from types import SimpleNamespace

    from paddle_fastffn.finetune.chat import tokenize_conversation
    from paddle_fastffn.finetune.checkpoint import load_tokenizer

    monkeypatch.syspath_prepend(str(CLIENT))
    monkeypatch.delitem(sys.modules, "data", raising=False)
    client_data = importlib.import_module("data")
    tokenizer = load_tokenizer(assets / "model")
    tokenizer.init_chat_template({"system": "You answer briefly. ",
                                  "conversation": ["[Round {{index}}] User: {{user}} Bot:", " {{bot}}</s>"]})
    examples = [
        {"src": "What is 2 plus 3?", "tgt": "2 plus 3 is 5."},
        {"src": ["Reverse the word apple.", "And river?"], "tgt": ["elppa", "revir"]},
        {"src": ["one", "two", "three"], "tgt": ["first answer", "second answer", "third answer"]},
        {"src": ["Translate to French: " + "cat " * 40], "tgt": ["chat " * 40]},
    ]
    for max_length, src_length in ((64, 32), (24, 16)):
        limits = SimpleNamespace(max_length=max_length, src_length=src_length)
        for example in examples:
            theirs = client_data.convert_rounds_example_common(copy.deepcopy(example), tokenizer, limits, is_test=False)
            ours = tokenize_conversation(tokenizer, copy.deepcopy(example), max_length, src_length)
            assert ours["input_ids"] == theirs["input_ids"] and ours["labels"] == theirs["labels"], (example, max_length)
    sys.modules.pop("data", None)


def test_our_script_evaluates_by_generation(assets, tmp_path):
    # eval_with_do_generation (rouge/bleu on generated answers; the JSON's metric_for_best_model moves
    # to one of them) and save_generation_output, on the fast path, whose generate() runs on Paddle 3.x
    # (stock 2.8.1's fails there: its generation mask reaches paddle.where as a float).
    out = tmp_path / "gen"
    config = cut_json("lora_argument.json", assets, out, use_fast_ffn=True, sample_prompts=0,
                      lora_path=str(assets / "lora_init"), eval_with_do_generation=True,
                      save_generation_output=True, metric_for_best_model="rouge1", max_length=48)
    run_ours(config)
    rows = [json.loads(line) for line in (out / "generated_output.json").read_text().splitlines()]
    references = [json.loads(line)["tgt"] for line in (assets / "data" / "dev.json").read_text().splitlines()]
    assert [row["tgt"] for row in rows] == references and all(isinstance(row["output"], str) for row in rows)
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    evaluation = [row for row in state["log_history"] if "eval_rouge1" in row]
    assert evaluation and {"eval_rouge2", "eval_rougel", "eval_bleu4"} <= set(evaluation[0])


def test_client_sft_json_trains_with_the_fp8_lm_head(assets, stock_sft, tmp_path):
    """The shipped SFT JSON (packing, recompute) with emulated FP8 and the LM head in FP8 too: the fused
    loss runs, the report says the head is in FP8, and the losses stay within the FP8 training
    budget of stock's fp32 run."""
    fast = run_client(cut_sft_json(assets, tmp_path / "fp8_head", use_fast_ffn=True, fast_ffn_precision="fp8",
                                   fast_ffn_fp8_emulate=True, fast_ffn_fp8_lm_head="fp8"), plugin=True)
    assert "the LM head + loss's GEMMs in FP8 too (fast_ffn_fp8_lm_head=fp8)" in fast["log"]
    assert fast["reports"][0]["kernel_calls"].get("fastffn_cross_entropy"), fast["reports"][0]["kernel_calls"]
    np.testing.assert_allclose(fast["losses"], stock_sft["losses"], rtol=FP8_TRAINING_LOSS_RTOL)
    assert not np.array_equal(fast["losses"], stock_sft["losses"])


def test_client_with_a_fast_ffn_mistake_stops_with_one_line(assets, tmp_path):
    """PaddleNLP's own script through `python -m paddle_fastffn`, asked for FP8 on this CPU without
    emulation or fallback: the run stops with the plugin's one-line error and status 2, no traceback
    and nothing trained."""
    config = cut_json("sft_argument.json", assets, tmp_path / "fp8", use_fast_ffn=True, fast_ffn_precision="fp8")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "paddle_fastffn", "finetune_generation.py", str(config)],
                            cwd=CLIENT, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "python -m paddle_fastffn: error: fast_ffn_precision=fp8 needs an NVIDIA Hopper GPU (sm_90) and this Paddle "
        "build has no GPU: set fast_ffn_fp8_emulate=true for emulated FP8 (no speed-up), fast_ffn_fp8_fallback=bf16 "
        "to train in bf16 instead, or fast_ffn_precision=bf16")
    assert not (tmp_path / "fp8" / "trainer_state.json").exists()
