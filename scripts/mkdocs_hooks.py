"""The docs site's one hook: pages that live outside docs/ join the site, and links between them keep working.

Run by `mkdocs build` (mkdocs.yml `hooks:`; `make docs`, and `make test` right after ruff), in the mkdocs process;
nothing in the package imports it. README.md is the site's home page and BENCHMARKS.md its figures page, yet both
stay at the repository root, where GitHub and a clone show them; the dated benchmark history stays beside the raw
results it cites. Every link in every page is written as it resolves in the repository (README.md links
`docs/gpus.md`, a guide links `../BENCHMARKS.md#soak`), so it works on GitHub; this hook rewrites each one to the
page's place in the site. A link to a repository file that is not a page is left alone, and `mkdocs build --strict`
then fails on it, as it fails on a missing page or anchor: a guide names source files as `code`, not as links.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
# repository path -> the page's path in the site (its src_uri); the guides under docs/ are added by mkdocs itself
OUTSIDE_DOCS = {
    "README.md": "index.md",
    "BENCHMARKS.md": "figures.md",  # not BENCHMARKS/: it would be benchmarks/ on a case-insensitive disk
    "benchmarks/results/history.md": "benchmarks/results/history.md",
}
LINK = re.compile(r"(\]\()([^)\s]+)(\))")  # an inline markdown link's target
# a URL, an anchor on the same page, an absolute path: left as written
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:|^#|^/", re.IGNORECASE)


def on_files(files: Files, config) -> Files:
    for repo_path, site_path in OUTSIDE_DOCS.items():
        files.append(File.generated(config, site_path, abs_src_path=str(ROOT / repo_path)))
    return files


def repo_path_of(site_path: str) -> str:
    """Where a site page lives in the repository."""
    for repo_path, site in OUTSIDE_DOCS.items():
        if site == site_path:
            return repo_path
    return f"docs/{site_path}"


def site_path_of(repo_path: str) -> str | None:
    """Where a repository file is in the site; None for a file that is not a page."""
    if repo_path in OUTSIDE_DOCS:
        return OUTSIDE_DOCS[repo_path]
    return repo_path.removeprefix("docs/") if repo_path.startswith("docs/") else None


def site_link(target: str, page_site_path: str) -> str:
    """A link as written in the repository -> the same link from the page's place in the site."""
    if EXTERNAL.match(target):
        return target
    path, hash_, anchor = target.partition("#")
    here = posixpath.dirname(repo_path_of(page_site_path))
    site_target = site_path_of(posixpath.normpath(posixpath.join(here, path)))
    if site_target is None:
        return target  # not a page: mkdocs reports it, and --strict fails
    relative = posixpath.relpath(site_target, posixpath.dirname(page_site_path) or ".")
    return relative + hash_ + anchor


def on_page_markdown(markdown: str, page, config, files) -> str:
    return LINK.sub(lambda m: m[1] + site_link(m[2], page.file.src_uri) + m[3], markdown)
