#!/usr/bin/env python3
"""Count the tokens of the crate's production code (`src/`, whose unit tests live in
`tests/unit/`): identifiers and keywords, numbers, and every other mark one token
each, on every line that is not a comment line (`//`, `///`, `//!`), inside string
literals too. Blank space and line breaks count nothing, so no layout change moves
the count; only code does.

Usage: scripts/count-tokens.py [--max N] [--by-file]
Exit status 1 when the count is above N (CI runs it with the ceiling in `.ci/run`).
"""
import argparse
import pathlib
import re
import sys

TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9][0-9A-Za-z_.]*|\S")


def count(text: str) -> int:
    lines = (l for l in text.splitlines() if not l.lstrip().startswith("//"))
    return sum(len(TOKEN.findall(l)) for l in lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max", type=int, help="fail above this many tokens")
    ap.add_argument("--by-file", action="store_true", help="list each file's count")
    ap.add_argument("--root", default=pathlib.Path(__file__).resolve().parent.parent)
    args = ap.parse_args()
    root = pathlib.Path(args.root)
    files = sorted((root / "src").rglob("*.rs"))
    counts = {f.relative_to(root): count(f.read_text()) for f in files}
    total = sum(counts.values())
    if args.by_file:
        for f, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"{n:8} {f}")
    print(f"src/ production code: {total} tokens in {len(files)} files")
    if args.max is not None and total > args.max:
        print(f"above the ceiling of {args.max} tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
