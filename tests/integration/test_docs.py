"""The argument reference (docs/usage.md) is checked against the fields users actually parse: every
`use_fast_ffn` / `fast_ffn_*` field of FastFFNTrainingArguments (the fast_ffn_* ones made from the one
declaration of the options, FastFFNOptions in integration/options.py) has one row with its real
default, and no row names a field that does not exist."""

import dataclasses
import json
import re
from pathlib import Path

from paddle_fastffn import FastFFNTrainingArguments

DOCS = Path(__file__).resolve().parents[2] / "docs" / "usage.md"


def documented_arguments() -> dict:
    """{argument: default as written} from the table rows `| `a`, `b` | `da`, `db` | ... |`."""
    out = {}
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        names, defaults = re.findall(r"`([^`]+)`", cells[0]), re.findall(r"`([^`]+)`", cells[1])
        assert len(names) == len(defaults), f"docs/usage.md: {line[:80]}...: names and defaults differ in count"
        out.update(zip(names, defaults))
    return out


def test_every_fast_ffn_argument_is_documented_with_its_default():
    fields = {f.name: f.default for f in dataclasses.fields(FastFFNTrainingArguments)
              if f.name == "use_fast_ffn" or f.name.startswith("fast_ffn_")}
    documented = documented_arguments()
    assert set(documented) == set(fields), (
        f"undocumented: {sorted(set(fields) - set(documented))}; documented but not a field: "
        f"{sorted(set(documented) - set(fields))}")
    for name, default in fields.items():
        assert json.loads(documented[name]) == default, f"{name}: docs say {documented[name]}, the field is {default!r}"
