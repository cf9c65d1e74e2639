"""scripts/run_finetune.py's arguments (paddle_fastffn/finetune/llm_arguments.py): PaddleNLP's llm keys
parse, keys it does not implement stop the run naming the key, PaddleNLP's dtype and LoRA alpha
rules, the NEFTune hook; and `python -m paddle_fastffn`'s usage errors."""

import json
import subprocess
import sys
from pathlib import Path

import paddle
import pytest
from paddlenlp.trainer import PdArgumentParser

from paddle_fastffn.finetune import llm_arguments as arguments, llm_flow

REPO = Path(__file__).resolve().parents[2]


def parse(tmp_path, **keys):
    config = tmp_path / "args.json"
    config.write_text(json.dumps({"output_dir": str(tmp_path / "out"), "model_name_or_path": "m",
                                  "dataset_name_or_path": "d", **keys}))
    parser = PdArgumentParser(arguments.ARGUMENT_CLASSES)
    return parser.common_parse(parser.read_json(str(config)), False)


@pytest.mark.parametrize("key, value, named", [
    ("prefix_tuning", True, "use lora"),
    ("do_ptq", True, "quantisation"),
    ("weight_quantize_algo", "nf4", "quantisation"),
    ("lazy", True, "lazy false"),
    ("pipeline_parallel_degree", 2, "Pipe model"),
    ("from_aistudio", True, "model_name_or_path"),
])
def test_unsupported_keys_stop_the_run_naming_the_key(tmp_path, key, value, named):
    parsed = parse(tmp_path, **{key: value})
    if key == "pipeline_parallel_degree":
        # One process: PaddleNLP's TrainingArguments resets the degree to its world size; under a
        # launch of 2+ ranks it keeps it, as here.
        parsed[-1].pipeline_parallel_degree = value
    with pytest.raises(ValueError, match=f"{key}={value!r} is not supported by scripts/run_finetune.py") as error:
        arguments.check_supported(*parsed)
    assert named in str(error.value)


def test_client_json_keys_parse_and_their_defaults_pass(tmp_path):
    parsed = parse(tmp_path, zero_padding=True, use_flash_attention=True, recompute=True, lora=True,
                   metric_for_best_model="accuracy", eval_with_do_generation=False, fp16_opt_level="O2",
                   bf16=True, tensor_parallel_degree=1, pipeline_parallel_degree=1)
    arguments.check_supported(*parsed)
    gen_args, quant_args, model_args, data_args, training_args = parsed
    assert data_args.zero_padding and model_args.use_flash_attention and training_args.recompute


def test_deprecated_spellings_keep_their_meaning(tmp_path):
    _, _, _, data_args, _ = parse(tmp_path, intokens=True, task_name_or_path="old_data")
    assert data_args.zero_padding and data_args.dataset_name_or_path == "old_data"


def test_dtype_follows_paddlenlp_o2_rule_unless_named(tmp_path):
    _, _, model_args, _, training_args = parse(tmp_path, bf16=True, fp16_opt_level="O2")
    assert arguments.model_dtype(model_args, training_args) == "bfloat16"
    _, _, model_args, _, training_args = parse(tmp_path, fp16=True, fp16_opt_level="O2")
    assert arguments.model_dtype(model_args, training_args) == "float16"
    _, _, model_args, _, training_args = parse(tmp_path, bf16=True, fp16_opt_level="O1")
    assert arguments.model_dtype(model_args, training_args) == "float32"
    _, _, model_args, _, training_args = parse(tmp_path, bf16=True, fp16_opt_level="O2", dtype="float32")
    assert arguments.model_dtype(model_args, training_args) == "float32"
    _, _, model_args, _, training_args = parse(tmp_path, fp16_opt_level="O2")
    with pytest.raises(ValueError, match="fp16_opt_level='O2'.*fp16 or bf16"):
        arguments.model_dtype(model_args, training_args)


def test_lora_alpha_is_paddlenlps_rule_unless_given(tmp_path):
    assert arguments.lora_alpha(parse(tmp_path, lora_rank=8)[2]) == 16
    assert arguments.lora_alpha(parse(tmp_path, lora_rank=8, rslora=True)[2]) == 4
    assert arguments.lora_alpha(parse(tmp_path, lora_rank=8, lora_alpha=32)[2]) == 32


def test_neftune_adds_bounded_noise_in_training_only():
    embedding = paddle.nn.Embedding(50, 16)

    class Model(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.embed = embedding

        def get_input_embeddings(self):
            return self.embed

    model = Model()
    ids = paddle.randint(0, 50, [2, 8])
    clean = embedding(ids)
    handle = llm_flow.add_neftune(model, noise_alpha=5.0)
    noisy = embedding(ids)
    bound = 5.0 / (2 * 8) ** 0.5  # PaddleNLP's scale: alpha / sqrt(batch x sequence)
    difference = (noisy - clean).abs()
    assert float(difference.max()) <= bound and float(difference.max()) > 0.5 * bound
    embedding.eval()
    assert bool(paddle.equal_all(embedding(ids), clean))
    handle.remove()
    embedding.train()
    assert bool(paddle.equal_all(embedding(ids), clean))


def test_plugin_runner_names_a_missing_script():
    result = subprocess.run([sys.executable, "-m", "paddle_fastffn", "no_such_script.py"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode != 0 and "SCRIPT 'no_such_script.py' is not a file" in result.stderr
