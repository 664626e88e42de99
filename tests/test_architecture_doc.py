"""docs/ARCHITECTURE.md stays true to the code: every `path.py:name` it cites exists, and its two paths stay short.

The document is what a newcomer follows from a token's sampling to its gradient; a renamed function would send them
to nothing, silently. References are the backticked spans `path/to/file.py`, `path/to/file.py:name` and
`path/to/file.py:Class.method`; they are resolved with `ast` (nothing is imported, so neither vLLM nor torch is
needed). The token path and the weight path may each cross at most 12 files, the layering rules in words must name
every rule of tests/test_layering.py's FORBIDDEN table, and every `docs/ARCHITECTURE.md "Section"` the code cites
must be a section of the document.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PATH_SECTIONS = ("The token path", "The weight path")
MAX_FILES_PER_PATH = 12  # beyond this a newcomer cannot hold the path in their head (issue 29's bound)

# A whole backtick span: a repository-relative .py path, optionally ':' and a dotted name defined in it.
REFERENCE = re.compile(r"`([\w./-]+\.py)(?::([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*))?`")
# Any one-line backtick span that mentions a .py file: one not in the form above (`step.py:train_step()`, a wrapped
# span) would otherwise go unchecked.
PY_SPAN = re.compile(r"`[^`\n]*\.py\b[^`\n]*`")
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
# How code cites a section (whitespace may wrap between file and title), and the notes it must no longer cite.
CITATION = re.compile(r'docs/ARCHITECTURE\.md\s+"([^"]+)"')
OUTSIDE_DOCUMENTS = ("DESIGN.md", "STYLE.md")
CODE_DIRS = ("inflight", "learner", "vllm_patches", "benchmarks", "scripts", "tests")


def references(text: str) -> list[tuple[str, str | None]]:
    """(path, dotted name or None) for every backticked file reference, in order of appearance."""
    return [(m.group(1), m.group(2)) for m in REFERENCE.finditer(text)]


@functools.cache
def _module(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def defines(tree: ast.AST, dotted: str) -> bool:
    """True if `dotted` (`f`, `Class`, `Class.method`, `Class.Inner.method`) is defined, walking class bodies."""
    scope = tree
    for part in dotted.split("."):
        if not isinstance(scope, ast.Module | ast.ClassDef):
            return False  # a function's locals are not part of its module's surface
        found = [n for n in scope.body if isinstance(n, DEFINITIONS) and n.name == part]
        if not found:
            return False
        scope = found[0]
    return True


def missing_references(text: str, root: Path = ROOT) -> list[str]:
    """Every reference whose file does not exist or does not define the name, as `path[:name]: why`."""
    missing = [f"{span}: not of the form `path.py` or `path.py:name`" for span in PY_SPAN.findall(text)
               if not REFERENCE.fullmatch(span)]  # fmt: skip
    for path, name in dict.fromkeys(references(text)):
        shown = f"{path}:{name}" if name else path
        file = root / path
        if not file.is_file():
            missing.append(f"{shown}: no such file")
        elif name and not defines(_module(file), name):
            missing.append(f"{shown}: {name} is not defined in {path}")
    return missing


def sections(text: str) -> dict[str, str]:
    """Second-level heading -> the text under it, up to the next second-level heading."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def files_named(text: str) -> set[str]:
    return {path for path, _ in references(text)}


def forbidden_table() -> dict[str, tuple[str, ...]]:
    """tests/test_layering.py's FORBIDDEN, read as a literal (that module is a test file, not importable)."""
    tree = _module(ROOT / "tests" / "test_layering.py")
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FORBIDDEN" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("tests/test_layering.py has no FORBIDDEN table")


def mentions(text: str, module: str) -> bool:
    """`module` appears as a whole dotted name (`vllm` must not match inside `vllm_patches`), any case."""
    return re.search(rf"(?<![\w.]){re.escape(module)}(?!\w|\.\w)", text, flags=re.IGNORECASE) is not None


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


def test_the_architecture_document_cites_enough_code_to_be_checked(doc):
    """The parser finds the document's references: a broken pattern that finds none would pass everything below."""
    named = {(path, name) for path, name in references(doc) if name}
    assert len(named) >= 20, f"only {len(named)} file:name references found in {DOC.relative_to(ROOT)}"


def test_every_file_function_the_architecture_document_names_exists(doc):
    missing = missing_references(doc)
    assert not missing, f"{DOC.relative_to(ROOT)} names code that does not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("title", PATH_SECTIONS)
def test_the_token_and_weight_paths_each_cross_at_most_ten_files(doc, title):
    body = sections(doc).get(title)
    assert body is not None, f"{DOC.relative_to(ROOT)} has no '## {title}' section"
    steps = re.findall(r"^\d+\. `[\w./-]+\.py:", body, flags=re.MULTILINE)
    assert len(steps) >= 5, f"'{title}' should be a numbered list of file:function steps, found {len(steps)}"
    files = files_named(body)
    assert len(files) <= MAX_FILES_PER_PATH, f"'{title}' crosses {len(files)} files: {sorted(files)}"


def test_the_layering_section_states_every_rule_of_the_layering_test(doc):
    body = sections(doc).get("Layering", "")
    bullets = body.split("\n- ")[1:]
    for rule, banned in forbidden_table().items():
        bullet = next((b for b in bullets if b.startswith(f"`{rule}`")), None)
        assert bullet is not None, f"the Layering section has no bullet starting with `{rule}`"
        absent = [name for name in banned if not mentions(bullet, name)]
        assert not absent, f"the Layering bullet for {rule} does not name {absent}"


def python_sources() -> list[Path]:
    return [f for d in CODE_DIRS for f in sorted((ROOT / d).rglob("*.py"))]


def test_every_section_the_code_cites_exists_and_nothing_cites_a_document_outside_the_repository(doc):
    """Docstrings cite `docs/ARCHITECTURE.md "Section"`; design notes that live outside the repository cannot be read
    by whoever clones it, so the code must not cite them."""
    titles, broken = set(sections(doc)), []
    for source in python_sources():
        if source == Path(__file__).resolve():  # this module names both patterns to look for them
            continue
        text, where = source.read_text(), source.relative_to(ROOT)
        broken += [f"{where}: no section {t!r}" for t in CITATION.findall(text) if t not in titles]
        broken += [f"{where}: cites {name}" for name in OUTSIDE_DOCUMENTS if name in text]
    assert not broken, "\n".join(broken)


def test_a_made_up_reference_is_reported():
    text = (
        "`inflight/learn/app.py:Learner.run` is real; `inflight/learn/app.py:Learner.no_such_method`, "
        "`inflight/learn/app.py:no_such_function`, `no/such/file.py:f`, `no/such/file.py` and "
        "`learner/step.py:train_step()` are not."
    )
    missing = missing_references(text)
    assert missing == [
        "`learner/step.py:train_step()`: not of the form `path.py` or `path.py:name`",
        "inflight/learn/app.py:Learner.no_such_method: Learner.no_such_method is not defined in inflight/learn/app.py",
        "inflight/learn/app.py:no_such_function: no_such_function is not defined in inflight/learn/app.py",
        "no/such/file.py:f: no such file",
        "no/such/file.py: no such file",
    ]


def test_a_function_local_name_is_not_a_reference_target():
    """`_run.start` is a closure inside `_run` in inflight/run/app.py: not something a reader can find by name."""
    tree = _module(ROOT / "inflight" / "run" / "app.py")
    assert defines(tree, "_run") and not defines(tree, "_run.start")
