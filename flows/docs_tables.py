"""Result tables in the docs, rendered from their committed data. A block

    <!-- table: benchmarks/x.yaml benchmarks/results/a-results.json benchmarks/results/b.json | columns: Δ seen -->
    | # | row | ... |
    <!-- end table -->

holds what `python -m flows.table benchmarks/x.yaml --merge a-results.json b.json` prints (their seeds joined,
today's statistics; `flows.table_report`), the rows no file ran left out, cut to the columns named (`#`, `row` and
`seeds` always) and to the rows numbered in `| rows: 1, 2, 3` if given. Without a spec first, the spec is the one the
first results file carries (for a file older than its spec's rows). `| replace` and `| mixed-code` are `--merge`'s
options. Under a block whose rows lack per-task outcomes (results written before they were recorded) a line says
so: their intervals count each episode as a task of its own, and they show no paired difference.

    python -m flows.docs_tables           # write every block again
    python -m flows.docs_tables --check   # exit 1 naming each block that differs (tests/test_docs_tables.py)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from flows.table_report import SPLITS, markdown, merge
from flows.table_spec import Row, Spec, load_spec
from flows.workspace import ROOT

DOCS = ("README.md", "docs/*.md", "benchmarks/README.md")
BLOCK = re.compile(r"(?P<head><!-- table: (?P<args>[^\n]*?) -->\n)(?P<body>.*?)(?P<end><!-- end table -->)", re.S)
ALWAYS = ("#", "row", "seeds")


def render(args: str, root: Path = ROOT) -> str:
    """The table a block's arguments name, as markdown lines ending in a newline."""
    files, *options = [part.strip() for part in args.split("|")]
    names = files.split()
    embedded = bool(names) and names[0].endswith(".json")
    paths = [root / f for f in names[0 if embedded else 1 :]]
    if not paths:
        raise ValueError(f"table block {args!r}: expected a spec and its results files")
    opts = dict((o.split(":", 1) + [""])[:2] for o in options)
    spec = embedded_spec(paths[0]) if embedded else load_spec(root / names[0])
    results, _ = merge(spec, paths, replace="replace" in opts, mixed="mixed-code" in opts)
    results = [r for r in results if r["seeds"]]  # a row of the spec that these files never ran
    table = [line for line in markdown(results, spec.by_type, spec.splits()).split("\n") if line.startswith("|")]
    if "rows" in opts:
        keep = {n.strip() for n in opts["rows"].split(",")}
        table = table[:2] + [line for line in table[2:] if line.split("|")[1].strip() in keep]
    if "columns" in opts:
        table = select(table, [c.strip() for c in opts["columns"].split(",")], args)
    shown = {line.split("|")[1].strip() for line in table[2:]}
    missing = [
        i
        for i, r in enumerate(results, 1)
        if str(i) in shown and any(not any(k.endswith("/tasks") for k in s) for s in r["seeds"])
    ]
    note = (
        f"\nRows {', '.join(f'#{i}' for i in missing)}: their results files hold no per-task outcomes, so each episode "
        "counts as a task of its own in the interval and no paired difference is shown.\n"
        if missing
        else ""
    )
    return "\n".join(table) + "\n" + note


def embedded_spec(path: Path) -> Spec:
    """The spec a results file carries, as far as its table needs it (name, rows, splits): a spec cut to some
    workspaces, or written before a rule of today's, need not pass `Spec`'s checks of a run."""
    d = json.loads(path.read_text())["spec"]
    return Spec.model_construct(
        name=d["name"],
        rows=[Row.model_validate(r) for r in d["rows"]],
        pair=d.get("pair", list(SPLITS)),
        by_type=d.get("by_type"),
    )


def select(table: list[str], wanted: list[str], args: str) -> list[str]:
    header = [c.strip() for c in table[0].strip("|").split("|")]
    unknown = [w for w in wanted if w not in header]
    if unknown:
        raise ValueError(f"table block {args!r}: no column(s) {unknown}; the table has {header}")
    keep = [i for i, c in enumerate(header) if c in ALWAYS or c in wanted]
    rows = [[c.strip() for c in line.strip().removeprefix("|").removesuffix("|").split("|")] for line in table]
    return [
        "| " + " | ".join(row[i] for i in keep) + " |" if n != 1 else "|" + "|".join(row[i] for i in keep) + "|"
        for n, row in enumerate(rows)
    ]


def files(root: Path = ROOT) -> list[Path]:
    return sorted({p for pattern in DOCS for p in root.glob(pattern)})


def differing(root: Path = ROOT, write: bool = False) -> list[str]:
    """Each block whose table is not what its data renders, as `file:line`; with `write`, rendered again."""
    found = []
    for path in files(root):
        text = path.read_text()

        def again(m: re.Match) -> str:
            want = render(m["args"], root)
            if m["body"] != want:
                found.append(f"{path.relative_to(root)}:{text[: m.start()].count(chr(10)) + 1}")
            return m["head"] + want + m["end"]

        new = BLOCK.sub(again, text)
        if write and new != text:
            path.write_text(new)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs")
    args = parser.parse_args(argv)
    found = differing(write=not args.check)
    for where in found:
        print(f"{where}: the table differs from what its results files render" + ("" if args.check else " (written)"))
    return 1 if found and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
