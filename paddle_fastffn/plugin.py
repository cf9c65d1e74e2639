"""Run a PaddleNLP or PaddleFormers script we did not write with paddle_fastffn loaded.

    python -m paddle_fastffn -m paddleformers.cli.launcher train sft.yaml            # PaddleFormers' launcher

    python -m paddle_fastffn finetune_generation.py llama/sft_argument.json      # PaddleNLP's llm/ script
    python -m paddle_fastffn -m paddle.distributed.launch --gpus 0,1 finetune_generation.py llama/sft_argument.json
    paddle-fastffn finetune_generation.py llama/sft_argument.json                 # the console script

The script then parses `use_fast_ffn` and every `fast_ffn_*` key as fields of PaddleNLP's
TrainingArguments (JSON or command line): `paddlenlp.trainer.TrainingArguments` is
FastFFNTrainingArguments in that process, from the moment paddlenlp.trainer is imported, so the
TrainingArguments subclass that the script's own argument.py defines has them. With
`use_fast_ffn: true` the LLaMA layers are patched when the model is built (as with our
scripts/run_finetune.py); with the flag false or absent the script runs stock PaddleNLP. When the
Trainer is built, one log line says how many decoder layers are on the fast path and which parts
are off and why.

Processes the script starts itself get the plugin too: `python -m paddle_fastffn` sets
PADDLE_FASTFFN_PLUGIN=1 and puts paddle_fastffn/_bootstrap on PYTHONPATH, whose sitecustomize
loads the same import hook at interpreter start (the ranks of paddle.distributed.launch). That hook
imports nothing until paddlenlp.trainer is imported.

PADDLE_FASTFFN_REPORT=<path>: each process also writes the fast path's report as JSON to <path>
at exit (`{rank}` in the path is replaced by the process's rank): the layer counts, the parts that
are off and why, and how often each compiled op ran.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
from pathlib import Path

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "_bootstrap"
REPORT_ENV_VAR = "PADDLE_FASTFFN_REPORT"
USAGE = ("usage: python -m paddle_fastffn SCRIPT.py [ARGS...]\n"
         "       python -m paddle_fastffn -m MODULE [ARGS...]   (e.g. -m paddle.distributed.launch ..., or\n"
         "                                                        -m paddleformers.cli.launcher train x.yaml)\n"
         "Runs SCRIPT (or MODULE) with paddle_fastffn loaded: `use_fast_ffn` and the fast_ffn_* keys parse as\n"
         "fields of PaddleNLP's or PaddleFormers' TrainingArguments, in this process and in the processes it starts.")

_STATE = {"report": None}  # the last Trainer's fast-path report, for PADDLE_FASTFFN_REPORT


def extend_paddlenlp_trainer(module) -> None:
    """paddlenlp.trainer with FastFFNTrainingArguments as its TrainingArguments, and a Trainer that
    reports the fast path when it is built. Called by the import hook right after the module ran."""
    from .finetune import checkpoint  # noqa: F401  (offers the patch its Hub-folder loader)

    if _with_fast_ffn_fields(module):
        _report_when_built(module.Trainer)
        _load_hub_folders_through_checkpoint()


def extend_paddleformers_training_args(module) -> None:
    """paddleformers.trainer.training_args (where paddleformers.trainer's lazy TrainingArguments comes
    from) with the fields: every subclass defined after it has them, PaddleFormers' FinetuningArguments
    (the launcher's) among them. Its lazy package is not touched: reading its attributes here would
    import the Trainer while paddleformers.transformers is still being imported."""
    _with_fast_ffn_fields(module)


def extend_paddleformers_trainer(module) -> None:
    """paddleformers.trainer.trainer: its Trainer reports the fast path when it is built."""
    _report_when_built(module.Trainer)


def extend_paddleformers_parser(module) -> None:
    """paddleformers.cli.hparams.parser, the parser of `paddleformers.cli.launcher train x.yaml`: its
    FinetuningArguments in _TRAIN_ARGS with the fields, where it lacks them (it has them when
    paddleformers.trainer.training_args was extended before FinetuningArguments was defined)."""
    from .integration.training_args import has_fast_ffn_fields, with_fast_ffn_fields

    for index, cls in enumerate(module._TRAIN_ARGS):
        if cls.__name__ == "FinetuningArguments" and not has_fast_ffn_fields(cls):
            module._TRAIN_ARGS[index] = with_fast_ffn_fields(cls, "FinetuningArguments")


def _with_fast_ffn_fields(module) -> bool:
    """module.TrainingArguments with the fields; False where it has them already."""
    from .integration.training_args import has_fast_ffn_fields, with_fast_ffn_fields

    if has_fast_ffn_fields(module.TrainingArguments):
        return False
    module.TrainingArguments = with_fast_ffn_fields(module.TrainingArguments, "FastFFNTrainingArguments")
    return True


def _report_when_built(trainer_class) -> None:
    """trainer_class.__init__ followed by the fast path's report line (and PADDLE_FASTFFN_REPORT);
    once per class (a second install finds it wrapped)."""
    original_init = trainer_class.__init__
    if getattr(original_init, "_fast_ffn_reports", False):
        return

    def init_and_report(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if getattr(self.args, "use_fast_ffn", False):
            from .integration.library import logger
            from .integration.report import fast_path_report, report_line

            report = fast_path_report(self.model, self.args)
            _STATE["report"] = report
            logger().info(report_line(report))

    init_and_report._fast_ffn_reports = True
    trainer_class.__init__ = init_and_report
    if os.environ.get(REPORT_ENV_VAR):
        atexit.register(_write_report, os.environ[REPORT_ENV_VAR])


def _hub_llama_folder(path) -> bool:
    """A local Hugging Face Hub LLaMA folder (torch-format weights), which PaddleNLP 2.8.1's Auto
    classes cannot load (paddle_fastffn/finetune/checkpoint.py says why)."""
    from .finetune import checkpoint

    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        return False
    config_file = Path(path) / "config.json"
    return (config_file.is_file() and json.loads(config_file.read_text()).get("model_type") == "llama"
            and checkpoint.is_hf_checkpoint(path))


def _load_hub_folders_through_checkpoint() -> None:
    """While the fast path is enabled, AutoModelForCausalLM / AutoTokenizer.from_pretrained on a Hub
    LLaMA folder (as PaddleNLP's llm scripts call them) load it through paddle_fastffn.finetune.checkpoint:
    the weights converted in memory into the model built from the script's own config (its
    use_flash_attention, recompute, ... settings), the tokenizer from tokenizer.model. Everything
    else, and every call while the fast path is off, is PaddleNLP's own."""
    from paddlenlp.transformers import AutoModelForCausalLM, AutoTokenizer

    from .integration.registry import enabled_options

    model_from_pretrained = AutoModelForCausalLM.from_pretrained.__func__
    tokenizer_from_pretrained = AutoTokenizer.from_pretrained.__func__

    def model_from_hub_folder(cls, pretrained_model_name_or_path, *args, **kwargs):
        if enabled_options() is None or args or not _hub_llama_folder(pretrained_model_name_or_path):
            return model_from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs)
        from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

        from .finetune import checkpoint

        for local_only in ("from_aistudio", "from_hf_hub", "convert_from_torch", "cache_dir", "subfolder"):
            kwargs.pop(local_only, None)
        config = kwargs.pop("config", None) or LlamaConfig.from_pretrained(str(pretrained_model_name_or_path))
        state_dict = checkpoint.llama_state_dict_from_hf(checkpoint.hf_weight_files(pretrained_model_name_or_path),
                                                         config)
        dtype = kwargs.pop("dtype", None) or getattr(config, "dtype", None)
        return LlamaForCausalLM.from_pretrained(None, config=config, state_dict=state_dict, dtype=dtype, **kwargs)

    def tokenizer_from_hub_folder(cls, pretrained_model_name_or_path, *args, **kwargs):
        # checkpoint.load_tokenizer calls back in with vocab_file (the Hub's tokenizer.model).
        if (enabled_options() is None or args or "vocab_file" in kwargs
                or not _hub_llama_folder(pretrained_model_name_or_path)):
            return tokenizer_from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs)
        from .finetune import checkpoint

        return checkpoint.load_tokenizer(pretrained_model_name_or_path)

    AutoModelForCausalLM.from_pretrained = classmethod(model_from_hub_folder)
    AutoTokenizer.from_pretrained = classmethod(tokenizer_from_hub_folder)


def _write_report(path_template: str) -> None:
    from .ops import _loader

    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0") or 0)
    report = dict(_STATE["report"] or {"use_fast_ffn": False})
    report["kernel_calls"] = dict(_loader.CALL_COUNTS)
    report["rank"] = rank
    path = Path(path_template.replace("{rank}", str(rank)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))


def load_into_this_process_and_children() -> None:
    """Set up the import hook here and, through PYTHONPATH and PADDLE_FASTFFN_PLUGIN, in every
    Python process started from this one."""
    bootstrap = str(BOOTSTRAP_DIR)
    os.environ["PADDLE_FASTFFN_PLUGIN"] = "1"
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != bootstrap]
    # The package itself must be importable in the children as it is here (a checkout on sys.path).
    package_root = str(Path(__file__).resolve().parents[1])
    if package_root not in paths and not _installed_in_site_packages(package_root):
        paths.insert(0, package_root)
    os.environ["PYTHONPATH"] = os.pathsep.join([bootstrap, *paths])
    if bootstrap not in sys.path:
        sys.path.insert(0, bootstrap)
    import paddle_fastffn_autoload

    paddle_fastffn_autoload.install()


def _installed_in_site_packages(package_root: str) -> bool:
    import site

    return package_root in set(site.getsitepackages() + [site.getusersitepackages()])


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    load_into_this_process_and_children()
    try:
        _run(argv)
    except _user_errors() as error:  # the user's fast_ffn_* arguments: one line, as run_finetune.py says them
        print(f"python -m paddle_fastffn: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _user_errors() -> tuple:
    """The errors that name a fast_ffn_* argument the user set (a bad value; FP8 where it cannot run)."""
    from paddle_fastffn.integration.fp8_attach import Fp8UnavailableError
    from paddle_fastffn.integration.options import OptionError

    return OptionError, Fp8UnavailableError


def _run(argv: list[str]) -> None:
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(f"python -m paddle_fastffn -m: a module name is expected after -m\n{USAGE}")
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, args = argv[0], argv[1:]
    if not os.path.isfile(script):
        raise SystemExit(f"python -m paddle_fastffn: SCRIPT {script!r} is not a file (expected a Python "
                         f"script such as PaddleNLP's llm/finetune_generation.py, or -m MODULE)\n{USAGE}")
    # As `python SCRIPT` would: the script's folder first on sys.path (its argument.py, data.py, utils.py).
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
