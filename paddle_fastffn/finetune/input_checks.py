"""The checks scripts/run_finetune.py makes of its inputs before any work: every mistake is one line
(InputError) that names the argument, or the file and line, and what was expected. Nothing is loaded,
downloaded or written before they pass.

- the arguments: a value of the wrong type (`use_fast_ffn: "maybe"`, `max_steps: ten`) is named with
  where it came from; argparse's usage text is for --help only (ArgumentParser);
- model_name_or_path / tokenizer_name_or_path that look like a local folder must exist: PaddleNLP would
  otherwise try its model store first (a hundred lines of network errors, or a hang);
- the dataset: dataset_name_or_path/train.json and dev.json, one JSON object per line with 'src' and
  'tgt' (read_jsonl: file:line:column and the field).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from paddlenlp.trainer import PdArgumentParser

DATA_FIELDS = ("src", "tgt")


class InputError(ValueError):
    """A mistake in the run's arguments or input files, said in one line."""


# argparse's messages for a value its type rejects -> what was expected.
_EXPECTED = ((re.compile(r"Truthy value expected: got (.*) but expected one of .*"),
              "expected a boolean (true/false, yes/no, 1/0)"),
             (re.compile(r"invalid int value: '(.*)'"), "expected an integer"),
             (re.compile(r"invalid float value: '(.*)'"), "expected a number"))


class ArgumentParser(PdArgumentParser):
    """PdArgumentParser whose errors are InputError naming the argument and its source (the JSON
    file or the command line), instead of argparse's usage text followed by exit(2)."""

    def __init__(self, dataclass_types, json_path: str | None = None, command_line=()):
        super().__init__(dataclass_types)
        self.json_path = json_path
        self.command_line = set(command_line)

    def error(self, message):
        found = re.match(r"argument --(\w+)(?:/--\w+)*: (.*)", message)
        if found is None:
            raise InputError(message)
        name, problem = found.groups()
        for pattern, expected in _EXPECTED:
            value = pattern.fullmatch(problem)
            if value:
                problem = f"{expected}, got {value.group(1)!r}"
                break
        source = "on the command line" if name in self.command_line or not self.json_path else f"in {self.json_path}"
        raise InputError(f"{name} {source}: {problem}")


def read_json_config(path: str) -> dict:
    """A PaddleNLP-style JSON config file as a dict; a syntax error is named by file:line:column."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such config file (the first argument is a JSON config)")
    text = Path(path).read_text(encoding="utf-8")
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(f"{path}:{error.lineno}:{error.colno}: not valid JSON ({error.msg})") from None
    if not isinstance(values, dict):
        raise InputError(f"{path}: expected a JSON object of argument names and values, got {_kind(values)}")
    return values


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _field_column(line: str, name: str) -> int:
    """1-based column of `name`'s value on a JSON line (of the key where the value is not found)."""
    found = re.search(r'"%s"\s*:\s*' % re.escape(name), line)
    return found.end() + 1 if found else 1


def _turns(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(item, str) for item in value)


def read_jsonl(path: str | Path, conversations: bool = False) -> list[dict]:
    """The rows of a jsonl data file, each checked: a JSON object with string fields 'src' and 'tgt'
    (with `conversations`, each may instead be a list of turns, as many answers as user turns). A bad
    line raises InputError naming file:line:column and the field."""
    expected = ("string fields 'src' and 'tgt'" if not conversations else
                "fields 'src' and 'tgt', each a string or a list of strings (one answer per user turn)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))  # an unclosed string: its start, not the newline
            except json.JSONDecodeError as error:
                raise InputError(f"{path}:{line_no}:{error.colno}: not valid JSON ({error.msg}); each line is one "
                                 f"JSON object with {expected}") from None
            if not isinstance(row, dict):
                raise InputError(f"{path}:{line_no}:1: expected a JSON object with {expected}, got {_kind(row)}")
            for name in DATA_FIELDS:
                if name not in row:
                    raise InputError(f"{path}:{line_no}: field '{name}' missing; each line is one JSON object with "
                                     f"{expected}")
                value = row[name]
                if not (isinstance(value, str) or (conversations and _turns(value))):
                    raise InputError(f"{path}:{line_no}:{_field_column(line, name)}: field '{name}' is "
                                     f"{_kind(value)}; expected {expected}")
            turns = [len(row[name]) if isinstance(row[name], list) else 1 for name in DATA_FIELDS]
            if turns[0] != turns[1]:
                raise InputError(f"{path}:{line_no}: {turns[0]} user turns in 'src' and {turns[1]} answers in "
                                 f"'tgt'; expected one answer per user turn")
            rows.append(row)
    if not rows:
        raise InputError(f"{path}: no examples (expected one JSON object with {expected} per line)")
    return rows


def looks_local(path: str) -> bool:
    """Whether `path` can only be meant as a folder on this machine, not a model-store name such as
    'meta-llama/Llama-2-7b' or 'facebook/llama-7b': absolute, ./ ../ ~, a trailing slash, more than
    one slash, or a first component that is a folder here (demo_data/modle)."""
    text = os.path.expanduser(path)
    if os.path.isabs(text) or text.startswith((".", "~")) or text.endswith(("/", os.sep)) or os.path.exists(text):
        return True
    parts = text.split("/")
    return len(parts) > 2 or (len(parts) == 2 and os.path.isdir(parts[0]))


def check_model_path(argument: str, path: str | None, needs: tuple = ("config.json",)) -> None:
    """A local-looking checkpoint path must be a folder holding `needs`; a store name passes."""
    if path is None or not looks_local(str(path)):
        return
    folder = Path(os.path.expanduser(str(path)))
    if not folder.is_dir():
        what = "a file, not a folder" if folder.exists() else "no such folder"
        raise InputError(f"{argument}={str(path)!r}: {what} (relative to {os.getcwd()}); expected a checkpoint "
                         f"folder with {' and '.join(needs)}. Nothing was downloaded: a local-looking path is "
                         f"never looked up in the model store")
    missing = [name for name in needs if not (folder / name).is_file()]
    if missing:
        raise InputError(f"{argument}={str(path)!r}: no {' or '.join(missing)} in that folder; expected a "
                         f"checkpoint folder with {' and '.join(needs)} next to its weights")


def local_chat_template(model_name_or_path: str, chat_template: str | None) -> bool | None:
    """Whether the data will go through a chat template (run_finetune.py's select_chat_template rule),
    or None where only the model store's tokenizer can tell."""
    if chat_template is not None and chat_template != model_name_or_path:
        return str(chat_template).lower() != "none"
    folder = Path(os.path.expanduser(str(model_name_or_path)))
    if folder.is_dir():
        return (folder / "chat_template.json").is_file()
    return None


def check_inputs(model_args, data_args, training_args) -> None:
    """Everything checkable before the model loads (see the module docstring); raises InputError."""
    if not model_args.model_name_or_path:
        raise InputError("model_name_or_path is not set: expected a checkpoint folder or a PaddleNLP model name")
    check_model_path("model_name_or_path", model_args.model_name_or_path, ("config.json",))
    check_model_path("tokenizer_name_or_path", model_args.tokenizer_name_or_path, ("tokenizer_config.json",))
    if not data_args.dataset_name_or_path:
        raise InputError("dataset_name_or_path is not set: expected a folder with train.json and dev.json")
    data = Path(data_args.dataset_name_or_path)
    if not data.is_dir():
        raise InputError(f"dataset_name_or_path={str(data)!r}: no such folder (relative to {os.getcwd()}); expected "
                         f"a folder with train.json and dev.json")
    resume = getattr(training_args, "resume_from_checkpoint", None)
    if isinstance(resume, str) and resume and not Path(os.path.expanduser(resume)).is_dir():
        raise InputError(f"resume_from_checkpoint={resume!r}: no such folder (relative to {os.getcwd()}); expected a "
                         f"checkpoint-<step> folder that an earlier run wrote into its output_dir")
    chat = local_chat_template(model_args.model_name_or_path, data_args.chat_template)
    for name in ("train.json", "dev.json"):  # run_finetune.py reads both, whatever do_train / do_eval say
        if not (data / name).is_file():
            raise InputError(f"dataset_name_or_path={str(data)!r}: no {name} there; expected train.json and "
                             f"dev.json, one JSON object with 'src' and 'tgt' per line")
        read_jsonl(data / name, conversations=chat is not False)
