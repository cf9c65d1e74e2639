"""Argument checks of scripts/run_finetune.py that PaddleNLP's PdArgumentParser does not make.

PdArgumentParser rejects a JSON key or command-line flag that no parsed dataclass has with "Some
specified arguments are not used by the PdArgumentParser: [...]" (command line) or a dataclass
TypeError (JSON), without naming the nearest known argument: a typo such as `use_fastffn` or
`learning_rte` costs a launch. unknown_argument_error names the argument, where it came from and
the closest known names (difflib).
"""

from __future__ import annotations

import dataclasses
import difflib


def known_arguments(dataclass_types) -> set[str]:
    """Every name PdArgumentParser accepts for these dataclasses, including the `no_<name>` flag
    it adds for bool fields that default to True."""
    names = set()
    for cls in dataclass_types:
        for field in dataclasses.fields(cls):
            if not field.init:
                continue
            names.add(field.name)
            if field.type in (bool, "bool") and field.default is True:
                names.add(f"no_{field.name}")
    return names


def command_line_names(argv) -> list[str]:
    """The argument names of `--name value` / `--name=value` tokens."""
    return [token[2:].split("=", 1)[0] for token in argv if token.startswith("--") and len(token) > 2]


def unknown_argument_error(dataclass_types, json_values: dict | None = None, argv=(), json_path=None):
    """A ValueError naming each unknown argument, its source and the nearest known names, or None."""
    known = known_arguments(dataclass_types)
    unknown = [(name, f"in {json_path}" if json_path else "in the JSON") for name in (json_values or {})
               if name not in known]
    unknown += [(name, "on the command line") for name in command_line_names(argv) if name not in known]
    if not unknown:
        return None
    lines = []
    for name, source in unknown:
        close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" + (f" (or {', '.join(map(repr, close[1:]))})" if close[1:] else "") \
            if close else "no known argument is close to it"
        lines.append(f"unknown argument {name!r} {source}: {hint}")
    classes = ", ".join(cls.__name__ for cls in dataclass_types)
    return ValueError("; ".join(lines) + f" (the arguments are the fields of {classes})")
