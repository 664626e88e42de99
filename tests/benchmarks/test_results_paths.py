"""Every harness writes its results under `benchmarks/results/` by default, wherever it is started from: a default
relative to the working directory made `python -m benchmarks.routing_replay`, started outside the repository, measure
for minutes and then die writing its JSON."""

from __future__ import annotations

import ast
from pathlib import Path

from benchmarks import RESULTS

ROOT = Path(__file__).resolve().parents[2]


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """The string constants of a module's code: docstrings and comments left out."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_no_harness_defaults_to_a_results_path_relative_to_the_working_directory():
    relative = [
        f"{path.relative_to(ROOT)}:{line} {text!r}"
        for path in sorted((ROOT / "benchmarks").glob("*.py"))
        for line, text in _code_strings(path)
        if text.startswith(("benchmarks/results", "results/"))
    ]
    assert relative == []
    assert RESULTS.is_absolute() and RESULTS == ROOT / "benchmarks" / "results"
