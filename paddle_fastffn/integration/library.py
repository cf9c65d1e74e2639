"""Which Paddle LLM library this environment trains with, and the few things the family-neutral
parts take from it (its logger, its Trainer class, its LoRALinear).

PaddleNLP 2.8.1 and PaddleFormers 1.2 cannot share one environment: they pin opposite sides of
huggingface_hub (<0.26 vs >=1.3), aistudio-sdk (<=0.2.1 vs >=0.3) and datasets (<3 vs >=3), and
whichever was installed second breaks the other's import. Each has its install profile
(`pip install paddle_fastffn[paddlenlp]` / `[paddleformers]`), and the fast path serves the one
that is installed: registry.py registers that library's model families only. Where both are
found (a broken mix), PaddleNLP's families serve, as before PaddleFormers was supported.
"""

from __future__ import annotations

import importlib
import importlib.util

PADDLENLP, PADDLEFORMERS = "paddlenlp", "paddleformers"
LIBRARIES = (PADDLENLP, PADDLEFORMERS)


def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def active() -> str:
    """The library the fast path serves here (PaddleNLP where both are installed)."""
    for name in LIBRARIES:
        if installed(name):
            return name
    raise ImportError("paddle_fastffn: neither PaddleNLP nor PaddleFormers is installed; install one profile: "
                      "pip install paddle_fastffn[paddlenlp] or pip install paddle_fastffn[paddleformers]")


def module(path: str):
    """`<active library>.<path>`, e.g. module("trainer.trainer")."""
    return importlib.import_module(f"{active()}.{path}")


def logger():
    return module("utils.log").logger


def trainer_class():
    return module("trainer.trainer").Trainer


def checkpoint_prefix() -> str:
    """The Trainer's checkpoint folder prefix ("checkpoint" in both libraries)."""
    return module("trainer.trainer").PREFIX_CHECKPOINT_DIR


def lora_linear_class():
    try:
        return module("peft.lora.lora_layers").LoRALinear
    except ImportError:  # pragma: no cover
        return None
