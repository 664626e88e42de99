"""What a verifiers 0.4 harness needs on this host: checked when `--env verifiers:...` loads, prepared once per serve.

Called by inflight/envs/verifiers_env.py:load_verifiers_env (the checks, at load: a serve that cannot run its harness
refuses at start, in one line) and by inflight/serve/verifiers_runner.py:VerifiersRunner (`prepare_program`, once,
before the serve's first episode). Runs in the serve process.

verifiers' built-in chat harnesses (`null`, `bash`, and the ones built on their program) run a PEP 723 script whose
`setup` calls `Runtime.prepare_uv_script`: `uv sync --script` resolves the script's dependencies into an environment
of its own. Without a `uv` binary on PATH verifiers tries `pip install --user uv`, then a download, in every episode,
which on a serve's budget ends each in a timeout before its first model call. So:
- the `uv` the `envs` extra installs beside this interpreter is put on PATH; none at all refuses the serve;
- the script is prepared once (`prepare_program`) before episodes start: the subprocess runtime keeps prepared
  interpreters per process, so every episode's own `setup` finds it ready;
- a harness that offers the model tools (`bash`: its bash and edit tools) is named by `offered_tools`: the serve
  checks at start that the model's chat template renders tools in a format it parses
  (inflight/serve/verifiers_renderer.py), and refuses in one line where it does not.
"""

from __future__ import annotations

import inspect
import os
import shutil
import sys
from pathlib import Path
from typing import Any

# Built-in harnesses whose program offers the model tools, and what it offers.
TOOL_HARNESSES = {"bash": "bash and edit tools"}
UV_FIX = "`make setup` installs it (the envs extra), or `pip install uv` into the serve's environment"
NULL_HARNESS = '--env-args \'{"agent": {"harness": {"id": "null"}}}\''


def runs_uv_script(harness_cls: type) -> bool:
    """True for a harness whose setup prepares a uv script (verifiers' built-in chat harnesses)."""
    try:
        return "prepare_uv_script" in inspect.getsource(harness_cls.setup)
    except (OSError, TypeError):  # no source to read: a harness of its own, built in C or at runtime
        return False


def find_uv() -> str | None:
    """The `uv` binary on PATH, else the one beside this interpreter (then put on PATH, which the harness programs'
    shell inherits); None if neither."""
    found = shutil.which("uv")
    if found:
        return found
    beside = Path(sys.executable).parent / "uv"
    if beside.is_file() and os.access(beside, os.X_OK):
        os.environ["PATH"] = f"{beside.parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return str(beside)
    return None


def offered_tools(harness_config: Any) -> str | None:
    """What a built-in harness offers the model as tools ("bash and edit tools"), None for one that offers none."""
    return TOOL_HARNESSES.get(getattr(harness_config, "id", None))


def check_harness(name: str, role: str, harness_id: str, harness_cls: type) -> None:
    """ValueError in one line when this serve cannot run the role's harness: what it needs and how to get it (a
    harness's tools are checked against the model's chat template by the serve, at start)."""
    if runs_uv_script(harness_cls) and find_uv() is None:
        raise ValueError(
            f"env verifiers:{name}: {role}'s harness {harness_id!r} prepares its program with uv (a PEP 723 script), "
            f"and no uv binary is on PATH or beside {sys.executable}: {UV_FIX}"
        )


async def prepare_program(name: str, harness_config: Any) -> None:
    """The harness's setup run once in a local subprocess runtime, so that the serve's episodes find its program
    prepared; RuntimeError naming the harness and its setup's last lines if it fails."""
    from verifiers.v1.runtimes import SubprocessConfig, SubprocessRuntime
    from verifiers.v1.utils.loaders import load_harness

    harness = load_harness(harness_config)
    if not runs_uv_script(type(harness)):
        return
    runtime = SubprocessRuntime(SubprocessConfig())
    await runtime.start()
    try:
        await harness.setup(runtime)
    except Exception as exc:
        tail = " | ".join(line.strip() for line in str(exc).strip().splitlines()[-3:] if line.strip())
        raise RuntimeError(
            f"env verifiers:{name}: harness {harness_config.id!r} could not prepare its program ({tail}); uv resolves "
            "its dependencies from its index (PyPI, or UV_DEFAULT_INDEX): point that at this host's package index"
        ) from exc
    finally:
        await runtime.stop()
