"""Write docs/config_reference.md from the run-config dataclasses in jaxrl_llm/run/config.py.

    python scripts/gen_config_reference.py            # rewrite docs/config_reference.md
    python scripts/gen_config_reference.py --check    # exit 1 when the checked-in file is stale

Types and defaults come from the dataclasses, allowed values from the config's validation table, and
the prose from the source: a section's documentation is its class docstring, a field's is the block of
`#` comment lines directly above it followed by its trailing `#` comment (read with `tokenize`, so
config.py stays plain dataclasses). A field without any comment is an error naming its file and line.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import io
import pathlib
import sys
import tokenize
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "config_reference.md"
REGENERATE = "python scripts/gen_config_reference.py"


class UndocumentedFieldError(ValueError):
    """A config field has neither a comment above it nor a trailing comment."""


def field_comments(source: str) -> dict[str, dict[str, tuple[int, str]]]:
    """{class name: {field name: (line, documentation)}} for every annotated field of every class in `source`.

    The documentation is the full-line `#` comments directly above the field (no blank line between)
    joined with its trailing `#` comment; "" when it has none.
    """
    lines = source.splitlines()
    trailing: dict[int, str] = {}
    full_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        row = tok.start[0]
        text = tok.string.lstrip("#").strip()
        if lines[row - 1].lstrip().startswith("#"):
            full_line[row] = text
        else:
            trailing[row] = text
    out: dict[str, dict[str, tuple[int, str]]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        fields = {}
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            above = []
            row = item.lineno - 1
            while row in full_line:
                above.insert(0, full_line[row])
                row -= 1
            after = [trailing[r] for r in range(item.lineno, item.end_lineno + 1) if r in trailing]
            fields[item.target.id] = (item.lineno, " ".join(part for part in above + after if part))
        out[node.name] = fields
    return out


def yaml_value(value: Any) -> str:
    """A default as it is written in a YAML preset: null, true/false, quoted strings, floats with a dot."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        if e and "." not in mantissa:  # PyYAML reads 1e-05 as a string, 1.0e-05 as a float
            text = f"{mantissa}.0e{exponent}"
        return text
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(module=None, source: str | None = None) -> str:
    """The markdown reference of `module` (default jaxrl_llm.run.config) with comments from `source`."""
    module = module or importlib.import_module("jaxrl_llm.run.config")
    source = source if source is not None else inspect.getsource(module)
    where = getattr(module, "__file__", "<config>")
    comments = field_comments(source)
    allowed = getattr(module, "_ALLOWED", {})
    undocumented = []
    parts = [
        "# Configuration reference",
        "",
        f"Generated from the dataclasses in `jaxrl_llm/run/config.py` by `{REGENERATE}`; do not edit by hand",
        "(`tests/test_docs.py` fails when this file differs from what the script writes).",
        "",
        "A run is configured by a YAML file of sections (`jaxrl-llm train --config F`; a preset may start with",
        "`base: other.yaml` to inherit another) and by `section.key=value` overrides after it, parsed as YAML.",
        "An unknown key fails at start with the closest valid key; a bad value fails with the reason. The",
        "defaults below are the embedded demo; the presets in `configs/` are described on the algorithm pages",
        "of [the documentation](index.md).",
        "",
        "```yaml",
        "base: raftpp.yaml",
        "sampling:",
        "  allocation: gvm",
        "train:",
        "  steps: 50",
        "```",
    ]
    for section in dataclasses.fields(module.RunConfig):
        cls = section.default_factory
        docs = comments.get(cls.__name__, {})
        parts += ["", f"## `{section.name}`", ""]
        doc = inspect.getdoc(cls)
        if doc and not doc.startswith(f"{cls.__name__}("):  # dataclasses invent a signature docstring
            parts += [doc, ""]
        parts += ["| key | type | default | description |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            line, text = docs.get(f.name, (0, ""))
            if not text:
                undocumented.append(f"{where}:{line}: {section.name}.{f.name}")
                continue
            options = allowed.get((section.name, f.name))
            if options:
                text += " (one of: " + ", ".join(f"`{o}`" for o in sorted(options)) + ")"
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            parts.append(f"| `{section.name}.{f.name}` | `{_cell(kind)}` | `{_cell(yaml_value(f.default))}` | "
                         f"{_cell(text)} |")
    if undocumented:
        raise UndocumentedFieldError("config fields without documentation (add a `# ...` comment on or above "
                                     "the field): " + "; ".join(undocumented))
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the checked-in file is out of date")
    parser.add_argument("--out", type=pathlib.Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is out of date: run {REGENERATE}", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
        return 0
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing
    sys.exit(main())
