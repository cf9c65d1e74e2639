"""Multi-turn data through a tokenizer's chat template (PaddleNLP's chat_template.json), as
PaddleNLP's 2.8 llm script tokenizes it: used whenever the tokenizer has a template, which
from_pretrained loads from the model folder's chat_template.json, and `chat_template` picks.

A line of data: {"src": str | [str, ...], "tgt": str | [str, ...], "context": {...}?}, one user
turn and one answer per round. Rounds are kept from the last one backwards while they fit in
max_length (after the system prompt); a last round longer than that is cut (the user turn to
src_length, the answer to what is left). Labels cover the answers only.
"""

from __future__ import annotations

import os
from pathlib import Path

from paddlenlp.utils.log import logger

from .data import IGNORE_INDEX
from .input_checks import read_jsonl

CHAT_TEMPLATE_FILE = "chat_template.json"


def select_chat_template(tokenizer, model_name_or_path: str, chat_template: str | None) -> None:
    """`chat_template` as PaddleNLP's script reads it: None keeps what the tokenizer loaded (the
    model folder's chat_template.json, if any); "none" drops it; the model path keeps the default;
    a folder means its chat_template.json; a file is the template."""
    if chat_template is None or chat_template == model_name_or_path:
        return
    if str(chat_template).lower() == "none":
        tokenizer.chat_template = None
        return
    path = Path(chat_template)
    if path.is_dir():
        path = path / CHAT_TEMPLATE_FILE
    if not path.is_file():
        # PaddleNLP's script warns and goes on with the tokenizer's own template.
        logger.warning(f"chat_template={chat_template!r}: no {CHAT_TEMPLATE_FILE} there; the tokenizer keeps "
                       f"{'its own template' if tokenizer.chat_template is not None else 'no template'}")
        return
    logger.info(f"loading the chat template {path}")
    tokenizer.init_chat_template(str(path))


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def tokenize_conversation(tokenizer, example: dict, max_length: int, src_length: int) -> dict:
    """input_ids / labels of one multi-turn example, shifted as PaddleNLP's causal LM expects
    (labels[i] is the token after input_ids[i])."""
    sources, targets = _as_list(example["src"]), _as_list(example["tgt"])
    if len(sources) != len(targets):
        raise ValueError(f"a conversation needs one answer per user turn: {len(sources)} src, {len(targets)} tgt "
                         f"in {example}")
    context = dict(example.get("context", {}), is_training=True)
    encoded = tokenizer.encode_chat_inputs([[s, t] for s, t in zip(sources, targets)], context_data=context)
    system = encoded.get("system") or []
    if len(system) >= max_length:
        raise ValueError(f"the chat template's system prompt has {len(system)} tokens, max_length is {max_length}")
    room = max_length - len(system)
    input_ids, labels = [], []
    rounds = encoded["conversations"]
    for index in range(len(rounds) - 1, -1, -1):
        user, bot = rounds[index]
        if len(input_ids) + len(user) + len(bot) > room:
            if index < len(rounds) - 1:
                break  # earlier rounds that do not fit are dropped whole
            user = user[: src_length - len(system)]  # the last round alone is too long: cut it
            bot = bot[: room - len(user)]
            input_ids, labels = user + bot, [IGNORE_INDEX] * len(user) + bot
            break
        input_ids = user + bot + input_ids
        labels = [IGNORE_INDEX] * len(user) + bot + labels
    input_ids, labels = system + input_ids, [IGNORE_INDEX] * len(system) + labels
    return {"input_ids": input_ids[:-1], "labels": labels[1:]}


class ConversationDataset:
    """jsonl conversations tokenized through the tokenizer's chat template (small data: eager)."""

    def __init__(self, tokenizer, path: str | os.PathLike, max_length: int, src_length: int):
        self.rows = read_jsonl(path, conversations=True)
        self.examples = [tokenize_conversation(tokenizer, row, max_length, src_length) for row in self.rows]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, index):
        return self.examples[index]
