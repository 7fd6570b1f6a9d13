"""The house's structural rules, checked: module and function sizes (scripts/check_sizes.py) and an engine that
imports nothing else from asr_spec."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_no_module_or_function_over_the_limits() -> None:
    spec = importlib.util.spec_from_file_location("check_sizes", REPO / "scripts" / "check_sizes.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert check.offenders(REPO / "asr_spec") == []


def test_engine_imports_nothing_else_from_asr_spec() -> None:
    outside = []
    for path in sorted((REPO / "asr_spec" / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            outside += [f"{path.name}: {n}" for n in names
                        if n.startswith("asr_spec") and not n.startswith("asr_spec.engine")]
    assert outside == []
