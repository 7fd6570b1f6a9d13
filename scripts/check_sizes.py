#!/usr/bin/env python
"""House limits: no module of asr_spec/, benchmarks/ or scripts/ over MAX_MODULE_LINES lines, no function over
MAX_FUNCTION_LINES lines unless its `def` line carries a comment `# long function: REASON`. Prints each offender;
exit code 1 if there is any.

    python -m scripts.check_sizes            # from the repository root
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
EXEMPT = "# long function:"


def offenders(package: Path) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) > MAX_MODULE_LINES:
            found.append(f"{path}: module of {len(lines)} lines (max {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse("\n".join(lines), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES and EXEMPT not in lines[node.lineno - 1]:
                found.append(f"{path}:{node.lineno}: {node.name} has {length} lines (max {MAX_FUNCTION_LINES}; "
                             f"or say why on its def line: '{EXEMPT} REASON')")
    return found


CHECKED = ("asr_spec", "benchmarks", "scripts")  # the folders of the repository whose Python files are checked


def main() -> int:
    repo = Path(__file__).resolve().parent.parent
    found = [line for folder in CHECKED for line in offenders(repo / folder)]
    print("\n".join(found) or "ok")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
