"""Layering (docs/ARCHITECTURE.md "Layering"): imports only point down, a learner node needs no vLLM and a serve node no
learner code.

Two checks: the static import graph of every module against the rules below, and a fresh interpreter that imports
every module of one side with the other side's packages made unimportable (so a lazy import inside a function, which
the static graph also sees, cannot hide behind an installed package either).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("inflight", "learner", "vllm_patches", "benchmarks")

# module prefix -> imported prefixes it must never reach (checked on every import statement, lazy ones included)
FORBIDDEN = {
    "inflight.wire": ("inflight.serve", "inflight.learn", "inflight.run", "inflight.tasks", "inflight.models",
                      "learner", "vllm_patches", "vllm", "transformers"),
    "inflight.envs": ("inflight.serve", "inflight.learn", "inflight.run", "inflight.wire", "learner",
                      "vllm_patches", "vllm", "transformers", "torch"),
    "inflight.tasks": ("inflight.serve", "inflight.learn", "inflight.run", "inflight.wire", "learner",
                       "vllm_patches", "vllm", "torch"),
    "vllm_patches": ("learner", "inflight.serve", "inflight.learn", "inflight.run"),
    "learner": ("vllm", "vllm_patches", "inflight.serve", "inflight.learn", "inflight.run"),
    "inflight.learn": ("vllm", "vllm_patches", "inflight.serve"),
    "inflight.serve": ("learner", "inflight.learn", "inflight.run"),
    "inflight.run": ("vllm", "vllm_patches", "learner", "torch"),
}  # fmt: skip


def module_files() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports_of(name: str, path: Path) -> list[tuple[int, str]]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                found.append((node.lineno, node.module))
    return found


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_static_imports_point_down():
    files = module_files()
    assert "inflight.learn.app" in files and "vllm_patches.engine" in files  # the walk found the tree
    broken = []
    for name, path in sorted(files.items()):
        for rule, banned in FORBIDDEN.items():
            if not under(name, rule):
                continue
            for lineno, target in imports_of(name, path):
                hits = [b for b in banned if under(target, b)]
                if hits:
                    broken.append(f"{path.relative_to(ROOT)}:{lineno} imports {target} ({rule} must not use {hits[0]})")
    assert not broken, "layering broken:\n" + "\n".join(broken)


def test_rules_catch_a_violation():
    """The checker itself: a lazy import of vLLM inside a learner function is found."""
    tree = "def f():\n    from vllm_patches.engine import InflightEngine\n"
    path = ROOT / "learner" / "_probe_layering.py"
    try:
        path.write_text(tree)
        with pytest.raises(AssertionError, match="learner/_probe_layering.py:2 imports vllm_patches.engine"):
            test_static_imports_point_down()
    finally:
        path.unlink(missing_ok=True)


BLOCKING_IMPORTER = """
import importlib, pkgutil, sys

class Block:
    def __init__(self, names):
        self.names = names
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names or any(fullname == n or fullname.startswith(n + ".")
                                                       for n in self.names):
            raise ModuleNotFoundError(f"{fullname} is blocked: this node does not install it", name=fullname)
        return None

sys.meta_path.insert(0, Block(set(sys.argv[1].split(","))))
imported = 0
for root in sys.argv[2].split(","):
    mod = importlib.import_module(root)
    imported += 1
    for info in pkgutil.walk_packages(getattr(mod, "__path__", []), root + "."):
        if info.name.split(".")[-1] == "__main__":
            continue
        importlib.import_module(info.name)
        imported += 1
print("imported", imported)
"""


def run_blocked(blocked: str, roots: str, *extra: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(BLOCKING_IMPORTER) + "\n".join(extra)
    return subprocess.run([sys.executable, "-c", code, blocked, roots], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_learner_node_runs_without_vllm():
    """Every learner-side module imports, and the learner parses its flags, with vllm and vllm_patches absent."""
    proc = run_blocked("vllm,vllm_patches", "inflight.wire,inflight.learn,learner,inflight.run,inflight.tasks",
                       "from inflight.learn.app import main",
                       "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code",
                       "assert 'vllm' not in sys.modules")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--groups-per-step" in proc.stdout
    assert int(proc.stdout.split("imported ")[1].split()[0]) > 15


def test_serve_node_runs_without_learner_code():
    """Every serve-side module imports with learner and inflight.learn absent."""
    proc = run_blocked(
        "learner,inflight.learn,inflight.run", "inflight.wire,inflight.serve,vllm_patches,inflight.tasks"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split("imported ")[1].split()[0]) > 15


def test_blocking_is_real():
    """The blocker does block: the learner's package cannot be imported by a process that blocks it."""
    proc = run_blocked("learner", "learner")
    assert proc.returncode != 0 and "learner is blocked" in proc.stderr
