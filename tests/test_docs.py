"""The documentation stays light and whole (issue 39): a README a newcomer reads in five minutes, every guide on the
site, every relative link pointing at something.

README.md is the short front door (at most README_MAX_LINES lines); the guides are docs/*.md, published by mkdocs as
one site whose nav (mkdocs.yml) must list every guide, or the reader of the site never finds it. `mkdocs build
--strict` (`make docs`, and `make test` right after ruff) checks the links and anchors as the site renders them,
through scripts/mkdocs_hooks.py; the checks here need no mkdocs: they read the files as they are in the repository, as
GitHub shows them. Pure file reading; no engine.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
DOCS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
PAGES = ["README.md", "BENCHMARKS.md", "benchmarks/results/history.md", *DOCS]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def nav_paths() -> list[str]:
    """The page paths of mkdocs.yml's nav (docs/-relative), read as text: the file's toc slugify tag is a Python
    object that a plain YAML loader refuses."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text.split("\nnav:\n", 1)[1]
    block = re.split(r"\n(?=\S)", nav, maxsplit=1)[0]  # up to the next top-level key
    return re.findall(r"([\w./-]+\.md)\s*$", block, flags=re.MULTILINE)


def prose(text: str) -> str:
    """The text outside fenced code blocks (a link-looking `](x)` in code is code)."""
    out, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            continue
        out.append("" if inside else line)
    return "\n".join(out)


def test_the_readme_is_at_most_two_hundred_lines():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; keep it at most {README_MAX_LINES} and move detail into a guide under docs/"
    )


def test_the_readme_shows_the_two_commands_and_links_the_quickstart():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.DOTALL)
    assert block is not None, "README.md has no bash block with the two commands"
    assert re.search(r"^make test\b", block[1], re.MULTILINE) and re.search(r"^make demo\b", block[1], re.MULTILINE)
    assert "(docs/quickstart.md)" in text, "README.md does not link the quickstart"


def test_every_guide_under_docs_is_in_the_site_nav():
    nav = nav_paths()
    missing = [d for d in DOCS if d.removeprefix("docs/") not in nav]
    assert not missing, f"guides not listed in mkdocs.yml's nav (the site would hide them): {missing}"


def test_every_nav_entry_is_a_guide_or_a_page_the_site_hook_adds():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from mkdocs_hooks import OUTSIDE_DOCS
    except ImportError as exc:  # the hook imports mkdocs
        pytest.skip(f"mkdocs is not installed: {exc}")
    finally:
        sys.path.pop(0)
    known = {d.removeprefix("docs/") for d in DOCS} | set(OUTSIDE_DOCS.values())
    assert set(nav_paths()) <= known, sorted(set(nav_paths()) - known)


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_of_a_page_names_a_file_of_the_repository(page):
    """As GitHub resolves it; the anchors are checked by the strict site build."""
    here = (ROOT / page).parent
    broken = []
    for target in LINK.findall(prose((ROOT / page).read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#", target, re.IGNORECASE):
            continue
        path = target.split("#", 1)[0]
        if not (here / path).exists():
            broken.append(target)
    assert not broken, f"{page}: links to nothing: {broken}"


def test_the_site_hook_rewrites_repository_links_to_site_links():
    pytest.importorskip("mkdocs")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from mkdocs_hooks import site_link
    finally:
        sys.path.pop(0)
    assert site_link("docs/gpus.md#install", "index.md") == "gpus.md#install"  # README is the home page
    assert site_link("../BENCHMARKS.md#soak", "lora.md") == "figures.md#soak"
    assert site_link("../../BENCHMARKS.md", "benchmarks/results/history.md") == "../../figures.md"
    assert site_link("benchmarks/results/history.md", "figures.md") == "benchmarks/results/history.md"
    assert site_link("quickstart.md", "lora.md") == "quickstart.md"
    assert site_link("https://example.org/a.md", "lora.md") == "https://example.org/a.md"
    assert site_link("../tests/test_docs.py", "lora.md") == "../tests/test_docs.py"  # not a page: strict build fails
