"""Every command line in README.md, BENCHMARKS.md and the guides (docs/*.md) parses with its entry point's own parser
(issues 22 and 39).

The command lines come from the fenced code blocks of the docs, and from the inline code spans of their prose that
start with a command (BENCHMARKS.md names every command that way: "`python -m benchmarks.ablate ...`"). A line of a
shell block (```bash, sh, shell, console) that is no such command must still be checked some other way or say why
not: a `pip install` of this package names only extras pyproject.toml has, a script path names an executable file of
the repository, and anything else (a Ray or cluster tool, a GPU-node step) ends with a comment that starts with one of
NOT_RUN_HERE, e.g. `ray start --head   # cluster only: Ray's head node`. So no shell line of a guide goes unchecked
silently. The benchmark history (benchmarks/results/history.md) is a dated record of commands as they were run, and is
not checked.
Nothing is run: a child process (one per entry point, each of its command lines parsed in turn, its output captured)
runs the entry point's `__main__` with argparse patched so that the first complete
parse raises `_ParsedOK`, so placeholder paths (`my/hf-dir`, `/ckpt/base`, `problems.jsonl`) never matter and no
engine, learner or benchmark starts. An unknown or renamed flag makes argparse exit 2 and the case fails naming the
doc line and argparse's message. `torchrun` flags go through torchrun's own parser; `make TARGET` must be a target of
the Makefile; `python -m inflight.run` also parses its `--serve-args` / `--learn-args` with the serve's and the
learner's parsers, as the launcher does before it starts anything.

Run as a script (`python tests/test_readme_commands.py '<json list of argv>' OUT.json`), this file is that child
process.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "BENCHMARKS.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")))
SHELL_FENCE = re.compile(r"\s*(```|~~~)\s*(bash|sh|shell|console)\b")
# A shell line no test runs says so with a trailing comment starting with one of these.
NOT_RUN_HERE = ("GPU only", "cluster only")
PIP_EXTRAS = re.compile(r"""^["']?(?:-e\s+)?["']?(?:\.|inflight)\[([^\]]*)\]["']?$""")
PYTHONS = {"python", "python3"}
LAUNCHERS = PYTHONS | {"torchrun", "make"}
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")
FENCE = re.compile(r"\s*(```|~~~)")
INLINE_SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
MAKE_TARGET = re.compile(r"^([A-Za-z0-9_.-]+(?:\s+[A-Za-z0-9_.-]+)*)\s*:(?!=)", re.MULTILINE)
CHILD_TIMEOUT_S = 180  # one parse takes seconds; the 2-core machine is shared with the suite


@dataclass(frozen=True)
class DocCommand:
    where: str  # "README.md:64" (the line it starts on; "#2" for the second command on that line)
    text: str  # as written, continuation lines joined
    synopsis: bool = False  # an inline span of prose: may use usage notation such as `[--dest DIR]`


# --- extraction ---------------------------------------------------------------------------------------------------


def without_env_prefix(words: list[str]) -> list[str]:
    """`FOO=1 BAR=2 python ...` → `python ...`."""
    while words and ENV_ASSIGNMENT.fullmatch(words[0]):
        words = words[1:]
    return words


def is_command(text: str) -> bool:
    """Does the line start (after any `VAR=value`) with python, python3, torchrun or make?"""
    try:
        words = shlex.split(text)
    except ValueError:  # broken quoting: still found by its plain words, and then fails
        words = text.split()
    words = without_env_prefix(words)
    return bool(words) and os.path.basename(words[0]) in LAUNCHERS


def in_fence(lines: list[str]) -> list[bool]:
    """Per line: is it a fence line or inside a fenced block?"""
    inside, mask = False, []
    for line in lines:
        fence = bool(FENCE.match(line))
        inside ^= fence
        mask.append(inside or fence)
    return mask


def fenced_lines(lines: list[str]) -> list[tuple[int, str]]:
    """(1-based line, logical line) inside fenced blocks, a trailing backslash joining the next line."""
    body = [inside and not FENCE.match(line) for inside, line in zip(in_fence(lines), lines, strict=True)]
    out, i = [], 0
    while i < len(lines):
        start, text = i, lines[i]
        while body[i] and text.rstrip().endswith("\\") and i + 1 < len(lines) and body[i + 1]:
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i].strip()
        if body[start]:
            out.append((start + 1, text.strip()))
        i += 1
    return out


def prose_without_fences(lines: list[str]) -> str:
    """The prose with fenced lines blanked, so that offsets still give line numbers."""
    return "\n".join("" if fenced else line for fenced, line in zip(in_fence(lines), lines, strict=True))


def commands_in(name: str, text: str) -> list[DocCommand]:
    lines = text.splitlines()
    found = [(n, t, False) for n, t in fenced_lines(lines) if is_command(t)]
    prose = prose_without_fences(lines)
    for m in INLINE_SPAN.finditer(prose):
        span = " ".join(m.group(1).split())  # a span may wrap onto the next line
        if is_command(span):
            found.append((prose.count("\n", 0, m.start()) + 1, span, True))
    found.sort(key=lambda f: f[0])
    commands, seen = [], {}
    for line, span, synopsis in found:
        seen[line] = seen.get(line, 0) + 1
        where = f"{name}:{line}" + (f"#{seen[line]}" if seen[line] > 1 else "")
        commands.append(DocCommand(where, span, synopsis))
    return commands


def documented_commands() -> list[DocCommand]:
    return [c for doc in DOCS for c in commands_in(doc, (REPO / doc).read_text())]


def shell_lines(name: str, text: str) -> list[DocCommand]:
    """The logical lines of the shell blocks that are not commands this test parses (nor blank, nor comments)."""
    lines = text.splitlines()
    shell, inside = [], False
    for line in lines:
        if FENCE.match(line):
            inside = not inside and bool(SHELL_FENCE.match(line))
            shell.append(False)
        else:
            shell.append(inside)
    joined = dict(fenced_lines(lines))
    return [
        DocCommand(f"{name}:{n}", joined[n])
        for n in sorted(joined)
        if shell[n - 1] and joined[n] and not joined[n].startswith("#") and not is_command(joined[n])
    ]


def unparsed_shell_lines() -> list[DocCommand]:
    return [c for doc in DOCS for c in shell_lines(doc, (REPO / doc).read_text())]


def pyproject_extras() -> set[str]:
    import tomllib

    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def shell_line_failure(cmd: DocCommand) -> str | None:
    """None when a shell line that is no parsed command is checked another way, or says why no test runs it."""
    code, _, comment = cmd.text.partition(" #")
    if comment.strip().startswith(NOT_RUN_HERE):
        return None
    try:
        words = without_env_prefix(shlex.split(code))
    except ValueError as exc:
        return f"{cmd.where}: `{cmd.text}`\nnot a shell command line: {exc}"
    if words[:2] == ["pip", "install"]:
        wanted = [m[1] for w in words[2:] if (m := PIP_EXTRAS.match(w))]
        unknown = {e.strip() for group in wanted for e in group.split(",")} - pyproject_extras()
        if wanted and not unknown:
            return None
        return (
            f"{cmd.where}: `{cmd.text}`\nextras {sorted(unknown)} not in pyproject.toml's {sorted(pyproject_extras())}"
        )
    script = REPO / words[0] if words else None
    if script is not None and "/" in words[0] and script.is_file() and os.access(script, os.X_OK):
        return None
    return (
        f"{cmd.where}: `{cmd.text}`\nno test runs this line: make it a command the test parses (python, torchrun, "
        f"make), or end it with a comment starting with one of {NOT_RUN_HERE}"
    )


def unfold_synopsis(words: list[str]) -> list[str]:
    """`{a,b}` → a b (as bash expands it), `[--dest DIR]` → --dest DIR, `...` dropped: a usage synopsis in prose is
    checked with every optional part given."""
    out = []
    for word in words:
        if re.fullmatch(r"\{[^{}]*,[^{}]*\}", word):
            out.extend(word[1:-1].split(","))
            continue
        word = word.strip("[]")
        if word and word != "...":
            out.append(word)
    return out


def command_words(cmd: DocCommand) -> list[str]:
    """shlex words from the launcher on: `# comments` dropped, env prefixes dropped (their values are often
    placeholders, and a parse needs none of them)."""
    words = without_env_prefix(shlex.split(cmd.text, comments=True))
    return unfold_synopsis(words) if cmd.synopsis else words


# --- checking (parent side) ---------------------------------------------------------------------------------------


def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return {t for m in MAKE_TARGET.finditer(text) for t in m.group(1).split() if not t.startswith(".")}  # not .PHONY


def make_failure(args: list[str]) -> str | None:
    targets = [a for a in args if not a.startswith("-") and "=" not in a]  # flags and VAR=value are not targets
    missing = [t for t in targets if t not in make_targets()]
    if not targets or missing:
        return f"no Makefile target {missing or targets}; targets: {sorted(make_targets())}"
    return None


def parse_failure(cmd: DocCommand, cwd: Path) -> str | None:
    """None when the command parses; otherwise why not, naming the doc line."""
    try:
        words = command_words(cmd)
    except ValueError as exc:  # shlex: unbalanced quotes
        return f"{cmd.where}: `{cmd.text}`\nnot a shell command line: {exc}"
    if os.path.basename(words[0]) == "make":
        problem = make_failure(words[1:])
    elif cmd in COMMANDS:  # parsed with the other documented command lines of its entry point
        problem = _batch_failures(entry_point(words), cwd)[cmd.where]
    else:
        problem = _child_failures([words], cwd)[0]
    return None if problem is None else f"{cmd.where}: `{cmd.text}`\n{problem}"


def entry_point(words: list[str]) -> str:
    """The program a command line starts, told without importing it: `inflight.run`, `scripts/soak.py`, `torchrun`."""
    if os.path.basename(words[0]) not in PYTHONS:
        return os.path.basename(words[0])
    try:
        return _python_target(words[1:])[1]
    except SystemExit:  # no module or script: its child says so
        return ""


_PARSED: dict[str, dict[str, str | None]] = {}  # entry point -> doc line -> failure (None: it parses)


def _batch_failures(entry: str, cwd: Path) -> dict[str, str | None]:
    """Every documented command line of one entry point, parsed in one child; the first of its tests parses them all
    (in its scratch directory) and the others read their line's answer."""
    if entry not in _PARSED:
        cmds = [c for c in COMMANDS if os.path.basename(command_words(c)[0]) != "make"]
        cmds = [c for c in cmds if entry_point(command_words(c)) == entry]
        failures = _child_failures([command_words(c) for c in cmds], cwd)
        _PARSED[entry] = dict(zip([c.where for c in cmds], failures, strict=True))
    return _PARSED[entry]


def _child_failures(batch: list[list[str]], cwd: Path) -> list[str | None]:
    # A fresh interpreter per entry point: one entry point's imports and patches cannot hide another's errors (the
    # command lines of one entry point share one, each parsed afresh). The cwd is a scratch directory, so even an
    # entry point that wrote something before parsing would write nothing here.
    out = cwd / "parsed.json"
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), json.dumps(batch), str(out)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    if proc.returncode != 0 or not out.exists():
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        return [
            f"the child parsing {len(batch)} command lines exited {proc.returncode}:\n" + "\n".join(lines[-15:])
        ] * len(batch)
    return [None if code == 0 else _failure_text(code, text) for code, text in json.loads(out.read_text())]


def _failure_text(code: int, output: str) -> str:
    lines = output.strip().splitlines()
    errors = [line for line in lines if ": error:" in line]  # argparse's message, without its long usage text
    return f"exit {code}: " + "\n".join(errors or lines[-15:])


# --- the child: parse one command line, run nothing ---------------------------------------------------------------


class _ParsedOK(BaseException):
    """The outermost parse succeeded; a BaseException so that an entry point's `except Exception` cannot swallow it."""

    def __init__(self, namespace: argparse.Namespace | None):
        super().__init__()
        self.namespace = namespace


@contextlib.contextmanager
def _stopping_after_parse():
    """Within: argparse patched so that the first complete parse raises `_ParsedOK` instead of returning.

    parse_args calls parse_known_args, and a subparser's parse runs inside its parent's: only the outermost call may
    stop, else parse_args' own check for unrecognized arguments would be skipped. Abbreviations are refused: a doc
    saying `--minute` would still parse after `--minutes` became `--minutes-total`, so a rename would go unseen."""
    depth = 0

    def wrap(original):
        def parse(self, *args, **kwargs):
            nonlocal depth
            self.allow_abbrev = False
            depth += 1
            try:
                result = original(self, *args, **kwargs)
            except SystemExit as exc:
                if exc.code in (0, None) and depth == 1:  # --help: the flags were fine
                    raise _ParsedOK(None) from None
                raise
            finally:
                depth -= 1
            if depth == 0:
                raise _ParsedOK(result if isinstance(result, argparse.Namespace) else result[0])
            return result

        return parse

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = map(wrap, saved)
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved


def _torchrun_target(words: list[str]) -> list[str]:
    """torchrun's flags through torchrun's own parser (argparse unpatched); what it would start, as python
    arguments."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.allow_abbrev = False  # as for the entry points (see _stopping_after_parse)
    args = parser.parse_args(words)
    return [*(["-m"] if args.module else []), args.training_script, *args.training_script_args]


def _python_target(words: list[str]) -> tuple[str, str, list[str]]:
    """("module" | "script", name, arguments) of a python command line."""
    rest = iter(words)
    for word in rest:
        if word == "-m":
            return "module", next(rest), list(rest)
        if not word.startswith("-"):
            return "script", word, list(rest)
        # interpreter options without a value (-u, -O, -B): nothing to check
    raise SystemExit(f"no `-m MODULE` or script in {words}")


def _run_dirs_only(args: list[str]) -> int:
    if not args or any(a.startswith("-") for a in args):
        print(f"inflight.run.report takes run directories only (RUN_DIR [RUN_DIR ...]), got {args}", file=sys.stderr)
        return 2
    return 0


# Entry points that read sys.argv without argparse: checked here instead of run (running them would do the work).
NO_PARSER = {"inflight.run.report": _run_dirs_only}


def _run_entry_point(kind: str, name: str, args: list[str]) -> None:
    if kind == "module":
        sys.argv = [name, *args]
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    else:
        path = REPO / name
        sys.path.insert(0, str(path.parent))  # as `python path/to/script.py`
        sys.argv = [str(path), *args]
        runpy.run_path(str(path), run_name="__main__")


def _parse_side_args(namespace: argparse.Namespace) -> None:
    """inflight.run hands `--serve-args` / `--learn-args` to the sides verbatim: parse them as each side will."""
    from inflight.config import parse_dataclass
    from inflight.learn.config import LearnConfig
    from inflight.serve.config import ServeConfig

    for dest, cls in (("serve_args", ServeConfig), ("learn_args", LearnConfig)):
        with contextlib.suppress(_ParsedOK):
            parse_dataclass(cls, shlex.split(getattr(namespace, dest)), f"--{dest.replace('_', '-')}", "")


def parse_only(words: list[str]) -> int:
    """The child's work for one command line: 0 when it parses; argparse's exit status and message otherwise."""
    launcher, *rest = words
    if os.path.basename(launcher) == "torchrun":
        rest = _torchrun_target(rest)
    kind, name, args = _python_target(rest)
    if name in NO_PARSER:
        return NO_PARSER[name](args)
    with _stopping_after_parse():
        try:
            _run_entry_point(kind, name, args)
        except _ParsedOK as ok:
            if name == "inflight.run" and ok.namespace is not None:
                _parse_side_args(ok.namespace)
            return 0
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
    print(f"{name} finished without parsing its arguments with argparse: nothing was checked", file=sys.stderr)
    return 3


def parse_batch(batch: list[list[str]]) -> list[tuple[int, str]]:
    """Each command line parsed in turn, its output captured: (exit status, output) per line."""
    results = []
    for words in batch:
        output = io.StringIO()
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            try:
                code = parse_only(words)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
                print(exc.code if not isinstance(exc.code, int) else "", file=sys.stderr)
            except Exception:  # an entry point that fails before it parses: the failure, with its traceback
                code = 1
                traceback.print_exc()
        results.append((code, output.getvalue()))
    return results


# --- the tests ----------------------------------------------------------------------------------------------------

COMMANDS = documented_commands()


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_every_documented_command_line_parses_with_its_entry_points_own_parser(cmd: DocCommand, tmp_path: Path):
    failure = parse_failure(cmd, tmp_path)
    if failure:
        pytest.fail(failure, pytrace=False)


SHELL_LINES = unparsed_shell_lines()


@pytest.mark.parametrize("cmd", SHELL_LINES, ids=[c.where for c in SHELL_LINES])
def test_every_other_shell_line_of_the_docs_is_checked_or_says_why_no_test_runs_it(cmd: DocCommand):
    failure = shell_line_failure(cmd)
    if failure:
        pytest.fail(failure, pytrace=False)


def test_the_extractor_finds_the_commands_of_the_readme_benchmarks_and_guides_in_every_form():
    # An extractor bug must not make the test above pass by finding nothing.
    assert len(COMMANDS) >= 10, [c.where for c in COMMANDS]
    guides = {"docs/quickstart.md", "docs/data-and-rewards.md", "docs/environments.md", "docs/gpus.md"}
    assert {"README.md", "BENCHMARKS.md", *guides} <= {c.where.split(":")[0] for c in COMMANDS}
    words = [command_words(c) for c in COMMANDS]
    assert any(w[0] == "torchrun" and "-m" in w for w in words)
    assert any(w[0] == "make" for w in words)
    assert any(w[:3] == ["python", "-m", "inflight.run"] and "--learn-args" in w for w in words)  # a continued line


def test_extraction_joins_continuations_drops_comments_and_env_prefixes_and_skips_non_commands():
    doc = "\n".join(
        [
            "Run `make test` first.",
            "```bash",
            "FOO=1 BAR='a b' python -m pkg.mod --a 1 \\",
            '    --b "x y"   # a comment',
            '{"python": 1}',
            "| python | table |",
            "make demo",
            "```",
            "```",
            "output line",
            "```",
        ]
    )
    commands = commands_in("doc.md", doc)
    assert [(c.where, c.synopsis) for c in commands] == [("doc.md:1", True), ("doc.md:3", False), ("doc.md:7", False)]
    assert command_words(commands[1]) == ["python", "-m", "pkg.mod", "--a", "1", "--b", "x y"]


def test_a_usage_synopsis_in_prose_is_checked_with_every_optional_part_given():
    cmd = DocCommand("doc.md:1", "python -m inflight.models prepare {a,b} [--dest DIR] [DIR ...]", synopsis=True)
    assert command_words(cmd) == ["python", "-m", "inflight.models", "prepare", "a", "b", "--dest", "DIR", "DIR"]


def test_a_command_with_an_unknown_flag_fails_naming_its_line_and_argparses_message(tmp_path: Path):
    failure = parse_failure(DocCommand("synthetic.md:1", "python -m inflight.serve --no-such-flag 1"), tmp_path)
    assert failure is not None
    assert "synthetic.md:1" in failure and "unrecognized arguments: --no-such-flag 1" in failure


def test_an_unknown_flag_inside_learn_args_of_inflight_run_fails(tmp_path: Path):
    cmd = DocCommand("synthetic.md:2", "python -m inflight.run --steps 2 --learn-args '--loss ppo --no-such-flag 1'")
    failure = parse_failure(cmd, tmp_path)
    assert failure is not None and "--learn-args: error: unrecognized arguments: --no-such-flag 1" in failure


def test_an_abbreviated_flag_fails_since_a_rename_would_keep_it_parsing(tmp_path: Path):
    for text in ("python -m inflight.serve --http-p 8000", "torchrun --nproc-per-nod 2 -m inflight.learn"):
        failure = parse_failure(DocCommand("x.md:1", text), tmp_path)
        assert failure is not None and "unrecognized arguments" in failure, text


def test_a_command_line_with_broken_quoting_fails(tmp_path: Path):
    failure = parse_failure(DocCommand("x.md:1", "python -m inflight.serve --model 'smollm2"), tmp_path)
    assert failure is not None and "not a shell command line: No closing quotation" in failure


def test_a_shell_line_that_is_no_command_passes_only_when_checked_or_marked(tmp_path: Path):
    doc = "\n".join(
        [
            "```bash",
            "ray start --head --port 6379",
            "ray start --address head:6379   # cluster only: joins the head node",
            "nvidia-smi   # GPU only",
            'pip install -e ".[gpu,learn]"',
            "pip install 'inflight[no-such-extra]'",
            "scripts/gpu_check.sh",
            "python -m inflight.serve --model smollm2",
            "```",
            "```text",
            "not a shell line",
            "```",
        ]
    )
    lines = shell_lines("doc.md", doc)
    assert [c.where for c in lines] == [f"doc.md:{n}" for n in (2, 3, 4, 5, 6, 7)]
    failures = {c.where: shell_line_failure(c) for c in lines}
    assert [w for w, f in failures.items() if f] == ["doc.md:2", "doc.md:6"]
    assert "no test runs this line" in failures["doc.md:2"] and "no-such-extra" in failures["doc.md:6"]


def test_an_unknown_make_target_fails():
    assert "no Makefile target ['no-such-target']" in parse_failure(DocCommand("x.md:1", "make no-such-target"), REPO)


if __name__ == "__main__":
    sys.path[0] = str(REPO)  # as `python -m` from the repository root; tests/inflight/ would shadow the package
    Path(sys.argv[2]).write_text(json.dumps(parse_batch(json.loads(sys.argv[1]))))
