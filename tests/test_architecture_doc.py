"""docs/ARCHITECTURE.md stays true to the code: every `path.py:name` it cites exists; its two paths are drawn in full.

The document is what a newcomer follows from a token's sampling to its gradient; a renamed function would send them
to nothing, silently. References are the backticked spans `path/to/file.py`, `path/to/file.py:name` and
`path/to/file.py:Class.method`; they are resolved with `ast` (nothing is imported, so neither vLLM nor torch is
needed). The layering rules in words must name every rule of tests/test_layering.py's FORBIDDEN table, and every
`docs/ARCHITECTURE.md "Section"` the code cites must be a section of the document.

The token path and the weight path are each drawn as a ```hops block: every function the datum passes through, in
order, one `<kind> path.py:Qualified.name` a line. Each hop is checked against the one before it on the functions'
`ast` (nested functions included), so a list with a hop left out, or a hop the code does not take, fails:
- `start`: the first line only;
- `call`: the previous function calls this one directly (an `ast.Call` whose callee — `Name.id` or `Attribute.attr` —
  is this function's last name); `call:<name>` where it calls it through another name it holds it by (a torch module
  called for its `forward`, an autograd Function's `apply`, a callback or callable object);
- `returns` (`returns:<name>`): the datum comes back to this function, which calls the previous one directly (as
  above): the previous one's return value, or what this function handed it and still holds;
- `via:<Name>`: a boundary that is not a Python call (a queue, a ZeroMQ socket, a thread, an RPC, a broadcast):
  both functions mention `<Name>` — an identifier, attribute or string constant in their definitions, or their own
  name.

Files are counted once each, and none is crossed twice: once the path leaves a file it does not come back, except
  - by returning (`returns`) to a function it has already passed through: the same visit, resumed;
  - into a module of REVISITED, where the honest path must come back: the wire's codecs are the contract both ends
    share (a record is encoded on the serve and decoded on the learner; the weights are packed and sent by the
    learner and received and unpacked by the worker); an update's prepared weights are
    built on the staging thread and swapped in at the commit by the same module; the rollout store holds a
    rollout from its receipt until a step takes it out; and learner/step.py both makes the batch and trains on it,
    inflight/learn/app.py choosing the rank's slice between. Each is named with its reason in REVISITED, and
    REVISITED names no file that the paths do not come back to.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PATH_SECTIONS = ("The token path", "The weight path")
# Issue 29 asked for at most 12 files per path. Counted in full, each file left is one stage the datum really passes
# (token: sampling, episode, group driver, reward, record codec, transport, intake, buffer, journal, samples and
# advantages, trainer loop, batch and step, model, logprobs, loss; weights: step, loop, gather, publisher, layout,
# transfer, group, staging, prepared weights, update choreography, EngineCore utility, worker RPC, commit) and no hop
# is a pass-through any more: fewer means merging two of those concepts into one file. The bound is each path's
# honest count, a ratchet: a longer path fails, a shorter one lowers it. The weight path's 13th file is the update's
# EngineCore half, split from its front-end half so that a file's name says which process runs it (issue 39).
MAX_FILES_PER_PATH = {"The token path": 12, "The weight path": 13}
REVISITED = {
    "inflight/wire/rollouts.py": "the rollout channel: its record encoded on the serve, decoded on the learner",
    "inflight/wire/weights.py": "the update's layout: planned and checksummed by the learner, unpacked by the worker",
    "inflight/wire/transfer.py": "the buckets: sent by the learner, received by the worker",
    "vllm_patches/prepared.py": "the prepared weights: built on the staging thread, swapped in at the commit",
    "inflight/learn/store.py": "a store: a rollout goes in on receipt and out for a step, the service's loop between",
    "learner/step.py": "the batch: made by make_batch and trained by train_step, the learner taking its slice between",
}
# One hop: its kind (`via` with the boundary's name, `call`/`returns` with an optional callee name), file, name.
HOP = re.compile(r"^(start|call|returns|via)(?::(\w+))? ([\w./-]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)$")
FIRST_HOP = {
    "The token path": "vllm_patches/generation.py:VersionedGeneration._generate_once",
    "The weight path": "learner/step.py:train_step",
}
# What each path must pass through, at least one function in each file it crosses, the last one where it ends.
LANDMARKS = {
    "The token path": (
        "vllm_patches/generation.py:spans_to_versions",
        "inflight/serve/driver.py:rollout_record",
        "inflight/serve/episodes.py:Episode.add_policy",
        "inflight/tasks/rewards.py:score_group",
        "inflight/wire/rollouts.py:make_rollout",
        "inflight/wire/rollouts.py:RolloutStream.pump",
        "inflight/wire/rollouts.py:RolloutReceiver.receive_raw",
        "inflight/learn/store.py:RolloutBuffer.add",
        "inflight/learn/service.py:LearnerService.next_groups",
        "inflight/learn/store.py:RolloutJournal.append",
        "inflight/learn/samples.py:build_samples",
        "inflight/learn/samples.py:group_advantages",
        "inflight/learn/app.py:broadcast_samples",
        "learner/step.py:make_batch",
        "inflight/learn/app.py:Learner._train",
        "learner/model.py:PolicyModel.forward",
        "learner/model.py:token_logprobs",
        "learner/losses.py:policy_loss",
        "learner/step.py:train_step",
    ),
    "The weight path": (
        "inflight/learn/app.py:Learner.run",
        "inflight/learn/publisher.py:RankSender.publish",
        "learner/export.py:iter_full_pieces",
        "inflight/learn/publisher.py:WeightPublisher.publish_stream",
        "inflight/learn/publisher.py:StreamedUpdate.put",
        "inflight/wire/weights.py:plan_layout",
        "inflight/wire/transfer.py:StreamSender.put",
        "inflight/wire/group.py:WeightsGroup.broadcast",
        "inflight/wire/transfer.py:receive_update",
        "vllm_patches/staging.py:StagedUpdate._run",
        "vllm_patches/update_frontend.py:StagedSignals.wait",
        "vllm_patches/update_enginecore.py:inflight_commit",
        "vllm_patches/worker_extension.py:InflightWorkerExtension.inflight_commit_staged",
        "vllm_patches/commit.py:LiveWeights.commit",
        "vllm_patches/prepared.py:PreparedWeights.swap_in",
    ),
}
# The control messages that gate each path: a reader following it reads their definitions too (the token path is
# admitted by the learner's Progress and reported by Status; the weight path is announced, joined and answered by
# the rest). Lines read = every hop's own definition, once, plus these; the whole files they sit in are reported
# beside it. A ratchet, like MAX_FILES_PER_PATH: a longer path fails, a shorter one lowers it.
GATES = {
    "The token path": ("inflight/wire/control.py:Progress", "inflight/wire/control.py:Status"),
    "The weight path": (
        "inflight/wire/control.py:Hello",
        "inflight/wire/control.py:JoinGroup",
        "inflight/wire/control.py:Joined",
        "inflight/wire/control.py:UpdateWeights",
        "inflight/wire/control.py:UpdateDone",
    ),
}
# The token path's bound rose from 794 with the catch-up order a late serve gets from every learner rank (issue 41:
# inflight/learn/app.py:broadcast_samples waits for it on the other ranks); both rose (from 799 and 636) when the
# learner's resolved --autocast became train_step's argument, no longer a second declaration in TrainConfig (issue 39);
# the weight path's from 640 with the one line by which the preparer hands its tensors to the arena's tail (issue 40:
# `low`'s layers prepared over the staged tensors they replace, vllm_patches/arenas.py:ReusingTail); the token path's
# from 809 with the two lines by which a group the engine fails is counted and frees its admission slot
# (inflight/serve/driver.py:failed; before, it held the slot for good and the serve idled at 0 tok/s, saying nothing)
MAX_LINES_READ = {"The token path": 811, "The weight path": 642}
HOPS_BLOCK = re.compile(r"^```hops\n(.*?)^```$", flags=re.MULTILINE | re.DOTALL)

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


def definition(tree: ast.AST, dotted: str) -> ast.AST | None:
    """The definition of `dotted` (`f`, `Class`, `Class.method`, `Class.Inner.method`), walking class bodies; None
    where there is none."""
    scope = tree
    for part in dotted.split("."):
        if not isinstance(scope, ast.Module | ast.ClassDef):
            return None  # a function's locals are not part of its module's surface
        found = [n for n in scope.body if isinstance(n, DEFINITIONS) and n.name == part]
        if not found:
            return None
        scope = found[0]
    return scope


def defines(tree: ast.AST, dotted: str) -> bool:
    """True if `dotted` is defined in `tree` (see `definition`)."""
    return definition(tree, dotted) is not None


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


@dataclass(frozen=True)
class Hop:
    """One line of a ```hops block: `kind` (start, call, returns, via), `alias` (the callee's name for
    `call:`/`returns:`, the boundary's for `via:`; "" when none), the file and the function's dotted name."""

    kind: str
    alias: str
    path: str
    name: str

    def __str__(self) -> str:
        kind = f"{self.kind}:{self.alias}" if self.alias else self.kind
        return f"{kind} {self.path}:{self.name}"


def parse_hops(block: str) -> list[Hop]:
    """The hops of one block, in order; raises ValueError naming a line not of the form `<kind> path.py:name`."""
    hops = []
    for line in block.strip().splitlines():
        match = HOP.fullmatch(line.strip())
        if match is None:
            raise ValueError(f"hop {line!r}: expected `<start|call|returns|via>[:<name>] path.py:Qualified.name`")
        kind, alias, path, name = match.groups()
        hops.append(Hop(kind, alias or "", path, name))
    return hops


def path_hops(doc: str, title: str) -> list[Hop]:
    """The ```hops block of the section `title` (exactly one), parsed."""
    blocks = HOPS_BLOCK.findall(sections(doc).get(title, ""))
    assert len(blocks) == 1, f"'## {title}' in {DOC.relative_to(ROOT)} has {len(blocks)} ```hops blocks, expected 1"
    return parse_hops(blocks[0])


def callees(fn: ast.AST) -> set[str]:
    """The names `fn` calls anything by (`f(...)`, `x.f(...)`), nested functions included."""
    names = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name):
                names.add(node.func.id)
            elif isinstance(node.func, ast.Attribute):
                names.add(node.func.attr)
    return names


def mentions_of(fn: ast.AST) -> set[str]:
    """Every identifier, attribute and string constant in `fn`'s definition (signature included), and its own name."""
    names = {fn.name}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names


def link_error(previous: Hop, prev_fn: ast.AST, hop: Hop, fn: ast.AST) -> str | None:
    """Why `hop` does not follow `previous` in the code, or None when it does (the rules in the module docstring)."""
    if hop.kind == "call":
        callee = hop.alias or hop.name.split(".")[-1]
        ok, why = callee in callees(prev_fn), f"{previous.name} calls nothing named {callee!r}"
    elif hop.kind == "returns":
        callee = hop.alias or previous.name.split(".")[-1]
        ok, why = callee in callees(fn), f"{hop.name} calls nothing named {callee!r}"
    elif hop.kind == "via":
        absent = [h.name for h, f in ((previous, prev_fn), (hop, fn)) if hop.alias not in mentions_of(f)]
        ok, why = not absent, f"{' and '.join(absent)} never mention {hop.alias!r}"
    else:
        ok, why = False, "`start` is for the first hop only"
    return None if ok else why


def stack_error(hop: Hop, callers: list[Hop]) -> str | None:
    """Calls and returns nest: a `call` is returned from to its caller, so a `returns` must go back to the function
    the open call came from (the one before it may rise freely above the first hop, or past a `via`). `callers` is the
    open calls' callers, updated here; why `hop` breaks the nesting, or None."""
    if hop.kind == "via":
        callers.clear()  # another thread, process or socket: what called the sender is not this side's caller
    elif hop.kind == "call":
        return None
    elif hop.kind == "returns" and callers:
        caller = callers.pop()
        if (caller.path, caller.name) != (hop.path, hop.name):
            return f"returns to {hop.name}, but the open call came from {caller.path}:{caller.name}"
    return None


def hop_errors(hops: list[Hop], root: Path = ROOT) -> list[str]:
    """Every hop that does not resolve with `ast`, does not follow the one before it, stays where it is, or returns
    to a function other than its caller, as `hop: why`."""
    if not hops or hops[0].kind != "start":
        return ["the first hop must be `start`"]
    errors, previous, prev_fn, callers = [], None, None, []
    for hop in hops:
        file = root / hop.path
        fn = definition(_module(file), hop.name) if file.is_file() else None
        why = stack_error(hop, callers)
        if fn is None or isinstance(fn, ast.ClassDef):
            why = f"no function {hop.name} in {hop.path}"
        elif previous is not None and (previous.path, previous.name) == (hop.path, hop.name):
            why = "the same function as the hop before it"
        elif previous is not None and prev_fn is not None:
            why = link_error(previous, prev_fn, hop, fn) or why
        if why is not None:
            errors.append(f"{hop}: {why}")
        if hop.kind == "call":
            callers.append(previous)
        previous, prev_fn = hop, fn
    return errors


def landmark_errors(hops: list[Hop], title: str) -> list[str]:
    """The path must start at FIRST_HOP, pass every landmark (at least one in each file it crosses) and end at the
    last one: with the links checked hop by hop, no stretch and no file can be left out."""
    listed = {f"{hop.path}:{hop.name}" for hop in hops}
    errors = [f"'{title}' does not pass {landmark}" for landmark in LANDMARKS[title] if landmark not in listed]
    if hops and f"{hops[0].path}:{hops[0].name}" != FIRST_HOP[title]:
        errors.append(f"'{title}' starts at {hops[0]}, not {FIRST_HOP[title]}")
    if hops and f"{hops[-1].path}:{hops[-1].name}" != LANDMARKS[title][-1]:
        errors.append(f"'{title}' ends at {hops[-1]}, not {LANDMARKS[title][-1]}")
    return errors


def reentries(hops: list[Hop]) -> list[Hop]:
    """The hops that enter a file the path already left, other than by returning to a function it passed through."""
    found, left, passed = [], set(), set()
    for previous, hop in zip([None, *hops], hops, strict=False):
        if previous is not None and previous.path != hop.path:
            left.add(previous.path)
            returning = hop.kind == "returns" and (hop.path, hop.name) in passed
            if hop.path in left and not returning:
                found.append(hop)
        passed.add((hop.path, hop.name))
    return found


def crossing_errors(hops: list[Hop]) -> list[str]:
    """Every hop that enters a file the path already left, but for a return or a REVISITED module (the module
    docstring says why those may be)."""
    return [f"{hop}: the path already left {hop.path}" for hop in reentries(hops) if hop.path not in REVISITED]


def files_crossed(hops: list[Hop]) -> list[str]:
    """The distinct files of `hops`, in the order the path first enters them."""
    return list(dict.fromkeys(hop.path for hop in hops))


@pytest.mark.parametrize("title", PATH_SECTIONS)
def test_each_path_is_drawn_hop_by_hop_and_every_hop_is_one_the_code_takes(doc, title):
    hops = path_hops(doc, title)
    assert len(hops) >= 20, f"'{title}' lists {len(hops)} hops: the path in full is longer"
    errors = hop_errors(hops)
    assert not errors, f"'{title}' in {DOC.relative_to(ROOT)} has hops the code does not take:\n" + "\n".join(errors)


@pytest.mark.parametrize("title", PATH_SECTIONS)
def test_each_path_starts_where_its_datum_is_made_and_passes_every_landmark(doc, title):
    hops = path_hops(doc, title)
    assert not landmark_errors(hops, title), "\n".join(landmark_errors(hops, title))
    in_landmarks = {landmark.split(":")[0] for landmark in (FIRST_HOP[title], *LANDMARKS[title])}
    assert in_landmarks == set(files_crossed(hops)), "every file the path crosses has a landmark, and only those"


@pytest.mark.parametrize("title", PATH_SECTIONS)
def test_each_path_crosses_at_most_the_bound_of_files_and_none_twice(doc, title):
    hops = path_hops(doc, title)
    errors = crossing_errors(hops)
    assert not errors, f"'{title}' crosses a file twice:\n" + "\n".join(errors)
    files = files_crossed(hops)
    assert len(files) <= MAX_FILES_PER_PATH[title], f"'{title}' crosses {len(files)} files: {files}"
    stated = re.findall(r"^That is (\d+) files, counted in full", sections(doc)[title], flags=re.MULTILINE)
    assert stated == [str(len(files))], f"'{title}' should say 'That is {len(files)} files, counted in full'"


def lines_read(hops: list[Hop], gates: tuple[str, ...], root: Path = ROOT) -> tuple[int, int]:
    """(lines of every hop's and gate's definition, each counted once; lines of the files they sit in)."""
    refs = dict.fromkeys([(hop.path, hop.name) for hop in hops] + [tuple(g.split(":")) for g in gates])
    spans = 0
    for path, name in refs:
        node = definition(_module(root / path), name)
        assert node is not None, f"{path}:{name} is not defined"
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        spans += node.end_lineno - first + 1
    files = dict.fromkeys(path for path, _ in refs)
    return spans, sum(len((root / path).read_text().splitlines()) for path in files)


@pytest.mark.parametrize("title", PATH_SECTIONS)
def test_each_path_states_the_lines_a_reader_reads_and_stays_within_its_bound(doc, title):
    """The measure a reader pays: the definitions the path passes through and the messages gating it, not the
    files (a file count falls by merging files without anything becoming shorter to read)."""
    spans, in_files = lines_read(path_hops(doc, title), GATES[title])
    stated = re.findall(r"^Lines read: (\d+), in files of (\d+) lines", sections(doc)[title], flags=re.MULTILINE)
    # The files' figure is context, kept within 10% (any edit of those files moves it); the lines read are exact.
    assert len(stated) == 1 and int(stated[0][0]) == spans and abs(int(stated[0][1]) - in_files) <= in_files // 10, (
        f"'{title}' should say 'Lines read: {spans}, in files of {in_files} lines' (it says {stated})"
    )
    assert spans <= MAX_LINES_READ[title], f"'{title}' reads {spans} lines, over its bound {MAX_LINES_READ[title]}"


def test_every_file_the_paths_may_come_back_to_is_one_they_do_come_back_to(doc):
    """REVISITED is an exception to "none twice", kept to what the paths need: a stale entry would excuse a new one."""
    revisited = {hop.path for title in PATH_SECTIONS for hop in reentries(path_hops(doc, title))}
    assert revisited == set(REVISITED), f"the paths come back to {sorted(revisited)}; REVISITED: {sorted(REVISITED)}"


def test_a_path_with_a_middle_hop_left_out_or_a_made_up_hop_fails_the_check(doc):
    """The check cannot pass on a shortened list: every middle hop of both paths, taken out, breaks a link, the
    nesting of calls and returns, or leaves a landmark out."""
    for title in PATH_SECTIONS:
        hops = path_hops(doc, title)
        shortened = [hops[:i] + hops[i + 1 :] for i in range(1, len(hops) - 1)]
        passing = [str(hops[i + 1]) for i, s in enumerate(shortened) if not hop_errors(s) + landmark_errors(s, title)]
        assert not passing, f"'{title}' still checks with each of these hops left out: {passing}"
    hops = path_hops(doc, "The token path")
    made_up = [*hops[:3], Hop("call", "", "vllm_patches/generation.py", "no_such_function"), *hops[3:]]
    assert hop_errors(made_up)[0] == (
        "call vllm_patches/generation.py:no_such_function: no function no_such_function in vllm_patches/generation.py"
    )
    wrong_call = [hops[0], Hop("call", "", "learner/losses.py", "policy_loss")]
    assert hop_errors(wrong_call) == [
        "call learner/losses.py:policy_loss: VersionedGeneration._generate_once calls nothing named 'policy_loss'"
    ]
    no_boundary = [hops[0], Hop("via", "outbox", "learner/losses.py", "policy_loss")]
    assert hop_errors(no_boundary) == [
        "via:outbox learner/losses.py:policy_loss: VersionedGeneration._generate_once and policy_loss never mention "
        "'outbox'"
    ]


def test_a_path_that_comes_back_to_a_file_it_left_is_refused_unless_it_returns_to_its_caller():
    down = Hop("call", "", "inflight/learn/service.py", "LearnerService.next_groups")
    out = Hop("call", "", "inflight/learn/samples.py", "build_samples")
    back = Hop("returns", "", "inflight/learn/service.py", "LearnerService.next_groups")
    elsewhere = Hop("call", "", "inflight/learn/service.py", "RolloutIntake.take")
    assert crossing_errors([down, out, back]) == []
    assert crossing_errors([down, out, elsewhere]) == [
        "call inflight/learn/service.py:RolloutIntake.take: the path already left inflight/learn/service.py"
    ]
    assert files_crossed([down, out, back]) == ["inflight/learn/service.py", "inflight/learn/samples.py"]


def test_a_return_to_a_function_other_than_the_caller_or_a_hop_that_stays_put_is_refused():
    """`RolloutBuffer.add` calls an `append` too: only the nesting tells that the journal is not written from it."""
    receive = Hop("start", "", "inflight/learn/service.py", "RolloutIntake.receive")
    add = Hop("call", "", "inflight/learn/store.py", "RolloutBuffer.add")
    back = Hop("returns", "", "inflight/learn/service.py", "RolloutIntake.receive")
    journal = Hop("call", "", "inflight/learn/store.py", "RolloutJournal.append")
    assert hop_errors([receive, add, back, journal, back]) == []
    assert hop_errors([receive, add, journal, back]) == [
        "returns inflight/learn/service.py:RolloutIntake.receive: returns to RolloutIntake.receive, but the open call "
        "came from inflight/learn/store.py:RolloutBuffer.add"
    ]
    assert hop_errors([receive, add, Hop("returns", "", "inflight/learn/store.py", "RolloutBuffer.add")]) == [
        "returns inflight/learn/store.py:RolloutBuffer.add: the same function as the hop before it"
    ]


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
