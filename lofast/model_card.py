"""The shipped models' figures as the markdown tables of the README and the model card,
generated from ``checkpoints/registry.json``, their one source.

    python -m lofast.model_card          # rewrite both tables in place (from the repository root)
    python -m lofast.model_card --check  # exit 1 where a table differs from the registry

Each table sits between ``<!-- registry: NAME -->`` and ``<!-- /registry -->`` lines; the
text around it is written by hand. ``benchmarks/model_card.py`` measures the figures.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lofast.certification.records import eps_key
from lofast.checkpoint import list_models, read_registry

# The model card's eps columns: (heading, the registry's figures' key, an ``eps_key``).
EPS_COLUMNS = tuple((heading, eps_key(eps)) for heading, eps in
                    (("0.02", 0.02), ("0.05", 0.05), ("0.1", 0.1), ("36/255", 36 / 255)))

REPOSITORY = Path(__file__).resolve().parent.parent


def _percent(value: float) -> str:
    return f"{100 * value:.2f} %"


def _drop(value: float) -> str:
    """Points of accuracy: one decimal, two where the second one counts (0.04)."""
    return f"{value:.1f}" if round(value, 1) == value else f"{value:.2f}"


def _rows(registry: dict[str, Any], columns: list[tuple[str, Callable[[dict], float],
                                                         Callable[[float], str], bool]],
          ) -> list[str]:
    """Markdown lines: a header, then one row per registered model (the default first); a
    column marked best has its largest value in bold."""
    names = list_models()
    figures = {name: registry["models"][name]["figures"] for name in names}
    lines = ["| checkpoint | " + " | ".join(c[0] for c in columns) + " |",
             "| --- " * (len(columns) + 1) + "|"]
    best = {heading: max(read(figures[n]) for n in names)
            for heading, read, _, bold in columns if bold}
    for name in names:
        cells = []
        for heading, read, show, bold in columns:
            value = read(figures[name])
            text = show(value)
            cells.append(f"**{text}**" if bold and value == best[heading] and len(names) > 1
                         else text)
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return lines


def _accuracy_columns(best: bool) -> list:
    columns = [("clean", lambda f: f["clean"], _percent, best)]
    for heading, key in EPS_COLUMNS:
        columns.append((heading, lambda f, key=key: f["certified"][key], _percent, best))
    return columns


def card_table(registry: dict[str, Any]) -> str:
    """The model card's figures: accuracy per eps, mean radius, ablation drop, time."""
    return "\n".join(_rows(registry, _accuracy_columns(True) + [
        ("mean radius", lambda f: f["mean_radius"], lambda v: f"{v:.4f}", True),
        ("ablation drop", lambda f: f["ablation_drop"], _drop, True),
        ("ms/sample", lambda f: f["ms_per_sample"], lambda v: f"{v:.1f}", False),
    ]))


def readme_table(registry: dict[str, Any]) -> str:
    """The README's table: accuracy per eps and the attention ablation drop."""
    return "\n".join(_rows(registry, _accuracy_columns(False) + [
        ("attention ablation drop", lambda f: f["ablation_drop"],
         lambda v: f"{_drop(v)} points", False),
    ]))


# file (relative to the repository) -> table name -> generator
TABLES: dict[str, dict[str, Callable[[dict[str, Any]], str]]] = {
    "README.md": {"figures": readme_table},
    "checkpoints/README.md": {"figures": card_table},
}


def with_tables(text: str, tables: dict[str, str], path: str) -> str:
    """``text`` with the block of every named table replaced; ValueError where a block is
    missing."""
    for name, table in tables.items():
        pattern = re.compile(rf"(<!-- registry: {re.escape(name)} -->\n).*?(<!-- /registry -->)",
                             flags=re.DOTALL)
        if not pattern.search(text):
            raise ValueError(f"{path} has no <!-- registry: {name} --> block")
        text = pattern.sub(lambda m, table=table: m.group(1) + table + "\n" + m.group(2), text,
                           count=1)
    return text


def stale_files(root: Path = REPOSITORY, write: bool = False) -> list[str]:
    """The files whose tables differ from the registry's (rewritten where ``write``)."""
    registry = read_registry()
    stale = []
    for relative, tables in TABLES.items():
        path = root / relative
        text = path.read_text(encoding="utf-8")
        fresh = with_tables(text, {name: make(registry) for name, make in tables.items()},
                            relative)
        if fresh != text:
            stale.append(relative)
            if write:
                path.write_text(fresh, encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only report tables that differ from the registry (exit 1)")
    args = parser.parse_args(argv)
    missing = [name for name in TABLES if not (REPOSITORY / name).is_file()]
    if missing:  # an installed wheel carries the registry, not the repository's documents
        print(f"lofast.model_card: {REPOSITORY} is not a lofast checkout (no "
              f"{', '.join(missing)}); run it from the repository", file=sys.stderr)
        return 2
    stale = stale_files(write=not args.check)
    for relative in stale:
        print(f"{relative}: {'differs from' if args.check else 'rewritten from'} the registry")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
