"""Hugging Face Hub LLaMA-2 folders as downloaded (tokenizer.model, safetensors or .bin weights, one
file or sharded with an index) fine-tuned by scripts/run_finetune.py, and the result loaded by stock
PaddleNLP; a sharded Hub folder loaded (from_pretrained with the converted weights) on the fast path."""

import importlib.util
import json
import sys

import numpy as np
import paddle
import pytest
import sentencepiece as spm
from paddlenlp.transformers import AutoTokenizer, LlamaForCausalLM

import paddle_fastffn
from hub_checkpoints import HUB_LAYOUTS, save_hub_checkpoint
from llama_fixtures import logits_of, tiny_model
from paddle_fastffn.finetune.checkpoint import load_model, load_tokenizer
from paddle_fastffn.finetune.demo_assets import train_tokenizer, write_dataset
from test_run_finetune import REPO, losses, run
from tolerances import assert_close


def _import_script(path):
    """scripts/ is not a package: import a script by path (the importlib recipe; its dataclasses
    need it in sys.modules)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = sys.modules[path.stem] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


greedy_answer = _import_script(REPO / "scripts" / "run_finetune.py").greedy_answer


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """assets/data (jsonl train/dev) and a real sentencepiece model trained on it, built once."""
    root = tmp_path_factory.mktemp("hub_assets")
    tokenizer_dir = train_tokenizer(write_dataset(root, train=64, dev=8, seed=7), root, vocab_size=400)
    return root, tokenizer_dir / "sentencepiece.bpe.model"


def dev_texts(data_dir):
    rows = [json.loads(line) for line in (data_dir / "dev.json").read_text().splitlines()]
    return [text for row in rows for text in (row["src"], row["tgt"])]


def assert_encodes_like_sentencepiece(tokenizer, sentencepiece_model, samples):
    sp = spm.SentencePieceProcessor(model_file=str(sentencepiece_model))
    for text in samples:
        assert tokenizer.encode(text, add_special_tokens=False)["input_ids"] == sp.encode(text), text
        assert tokenizer.encode(text)["input_ids"] == [sp.bos_id()] + sp.encode(text), text  # add_bos_token


@pytest.mark.parametrize("layout", HUB_LAYOUTS)
def test_hub_folder_layouts_fine_tune_and_load_in_stock_paddlenlp(assets, tmp_path, layout):
    root, sentencepiece_model = assets
    # tokenizer.json where the Hub has it: the sharded LLaMA-2 repos (7B/13B/70B) carry one.
    hub = save_hub_checkpoint(tiny_model(vocab_size=400), tmp_path / "hub", layout, sentencepiece_model,
                              tokenizer_json=layout.startswith("sharded"))
    hub_files = sorted(p.name for p in hub.iterdir())
    assert_encodes_like_sentencepiece(load_tokenizer(hub), sentencepiece_model, dev_texts(root / "data"))

    out = tmp_path / "out"
    summary = run(root, out, "--model_name_or_path", str(hub), steps=2)
    assert summary["use_fast_ffn"] and summary["global_steps"] == 2
    assert len(losses(summary)) == 2 and np.isfinite(losses(summary)).all()
    assert sorted(p.name for p in hub.iterdir()) == hub_files, "the Hub folder was written to"

    # The saved result in stock PaddleNLP (the autouse fixture reverted the patch).
    stock = LlamaForCausalLM.from_pretrained(str(out))
    assert_encodes_like_sentencepiece(AutoTokenizer.from_pretrained(str(out)), sentencepiece_model,
                                      dev_texts(root / "data"))
    initial = load_model(hub, "float32")
    assert not np.allclose(stock.lm_head.weight.numpy(), initial.lm_head.weight.numpy()), "not the fine-tuned weights"
    # The run answered its sample prompt with the fine-tuned model in memory; stock answers the same.
    sample = summary["samples"][0]
    assert greedy_answer(stock, load_tokenizer(out), sample["prompt"]) == sample["answer"]
    # The fine-tuned model as the run had it: its weights on the fast path.
    paddle_fastffn.apply_fast_ffn_to_llama()
    fine_tuned = LlamaForCausalLM.from_pretrained(str(out))
    ids = paddle.to_tensor(np.random.default_rng(0).integers(3, 400, size=(2, 17)), dtype="int64")
    assert_close(logits_of(stock, ids), logits_of(fine_tuned, ids), paddle.float32, f"{layout}: stock vs fine-tuned")


def test_sharded_hub_safetensors_load_on_the_fast_path_like_stock(tmp_path):
    """apply_fast_ffn_to_llama() first, so from_pretrained builds the model on the fast path."""
    source = tiny_model(vocab_size=400)
    hub = save_hub_checkpoint(source, tmp_path / "hub", "sharded_safetensors", dtype="float32")
    ids = paddle.to_tensor(np.random.default_rng(1).integers(3, 400, size=(2, 17)), dtype="int64")
    stock_logits = logits_of(source, ids)
    paddle_fastffn.apply_fast_ffn_to_llama()
    fast = load_model(hub, "float32")
    assert fast.config.use_flash_attention  # built under the patch (its SDPA path)
    assert_close(logits_of(fast, ids), stock_logits, paddle.float32, "sharded Hub safetensors on the fast path")
    # PaddleNLP's own entry points take the folder as it is while the fast path is on.
    from paddlenlp.transformers import AutoModelForCausalLM, LlamaForCausalLM

    for entry in (LlamaForCausalLM, AutoModelForCausalLM):
        model = entry.from_pretrained(str(hub), dtype="float32", convert_from_torch=True)
        assert_close(logits_of(model, ids), stock_logits, paddle.float32, f"{entry.__name__}.from_pretrained")


def test_folders_that_are_not_llama_checkpoints_are_named_in_the_error(tmp_path):
    hub = save_hub_checkpoint(tiny_model(vocab_size=400), tmp_path / "hub", "sharded_bin", dtype="float32")
    (hub / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"pytorch_model.bin.index.json lists shards .*00002-of-00002"):
        load_model(hub)

    deeper = save_hub_checkpoint(tiny_model(vocab_size=400), tmp_path / "deeper", "safetensors", dtype="float32")
    config = json.loads((deeper / "config.json").read_text())
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"deeper: not the LLaMA checkpoint .* \(3 layers\): 9 of 30 weights missing"):
        load_model(deeper)

    (deeper / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"model_name_or_path=.*deeper.*no config.json"):
        load_model(deeper)
    with pytest.raises(FileNotFoundError, match=r"model_name_or_path=.*no tokenizer_config.json"):
        load_tokenizer(deeper)
    with pytest.raises(FileNotFoundError, match=r"model_name_or_path='\./missing' is not a checkpoint folder"):
        load_model("./missing")
