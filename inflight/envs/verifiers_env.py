"""`--env verifiers:<taskset>`: a verifiers 0.4 environment (its taskset, harness and rewards) as a serve environment.

Loaded by inflight/envs/loading.py; its episodes are run by inflight/serve/verifiers_runner.py. A verifiers 0.4
environment is `load_environment(config)`: an `Env` composing a taskset (the tasks and their `@vf.reward`s), one agent
seat per role (a harness program in a runtime) and the env's own control flow. `<taskset>` is the installed taskset
package (`verifiers.v1.tasksets.<id>` or any importable module exporting a `vf.Taskset`), `--env-args` the rest of its
`EnvConfig` as JSON, exactly as `vf eval`'s `[env]` table (e.g. `{"taskset": {"num_tasks": 8}, "agent": {"max_turns":
4}}`).

This module stays below the serve: it builds and checks the environment and turns its taskset into the serve's problem
stream; it knows nothing of engines or tokens. What cannot be honoured in a serve process is refused or warned about
here, at start, by name:
- a role whose runtime is not the local subprocess (prime sandboxes, docker, modal, e2b, ...) is refused; a role left
  on verifiers' default (a prime sandbox, which needs an account and the network) runs in a subprocess instead;
- a harness that needs a container (claude_code, codex, mini_swe_agent, ...) is refused; one that executes
  model-written code on this host is warned about; one that needs a uv it cannot find is refused
  (inflight/envs/verifiers_harness.py, which also prepares its program once per serve, and names the tools a built-in
  harness offers: the serve checks the model's chat template renders them, at start);
- an env with more than one role is refused: the serve makes one rollout record per episode;
- a role with its own client is refused (its calls would not reach the serve's engine); a judge (`vf.JudgeConfig`
  anywhere in the taskset's config) calls a model that is not the policy: warned about by name, with its endpoint.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from inflight.envs.verifiers_harness import check_harness
from inflight.tasks.base import Problem

log = logging.getLogger("inflight.serve")
INSTALL = "pip install 'inflight[envs]'"
SUPPORTED = ("0.4",)  # verifiers minor versions whose Env/Trace API this module was written against
LOCAL_RUNTIME = "subprocess"
KEPT_TASKS = 4096  # problems admitted but not yet run keep their verifiers task; far more than any admission window


def import_verifiers():
    """The installed `verifiers.v1`, or ValueError with the install line (or the supported versions)."""
    try:
        import verifiers
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ValueError(f"--env verifiers:... needs the verifiers package ({exc}): {INSTALL}") from exc
    version = getattr(verifiers, "__version__", "0.0")
    if not version.startswith(tuple(f"{v}." for v in SUPPORTED)):
        expected = " or ".join(f"{v}.x" for v in SUPPORTED)
        raise ValueError(f"verifiers is {version}, expected {expected} (its Env/Trace API): {INSTALL}")
    return vf


class VerifiersEnv:
    """A loaded verifiers environment: `env` (the verifiers `Env`), `name` (the taskset id), and the problem stream
    its taskset gives (`problems`), each problem's verifiers task kept for the episodes that run it (`task_of`)."""

    stop: tuple[str, ...] = ()
    run_inline = False

    def __init__(self, name: str, env: Any, harness_config: Any = None):
        self.name, self.env = name, env
        self.harness_config = harness_config  # its role's harness (inflight/envs/verifiers_harness.py:prepare_program)
        self._tasks: OrderedDict[str, Any] = OrderedDict()

    def problems(self) -> Iterator[Problem]:
        """The taskset's tasks as problems, in the taskset's order, again from the start when a finite one ends."""
        for epoch in itertools.count():
            empty = True
            for task in self.env.taskset:
                empty = False
                yield self._problem(task, epoch)
            if empty:
                raise ValueError(f"env verifiers:{self.name}: its taskset has no tasks")

    def _problem(self, task: Any, epoch: int) -> Problem:
        data = task.data
        problem_id = f"{self.name}/{task.key[:16]}" + (f"#{epoch}" if epoch else "")
        self._tasks[problem_id] = task
        while len(self._tasks) > KEPT_TASKS:
            self._tasks.popitem(last=False)
        columns = data.model_dump(mode="json")
        prompt = getattr(data, "prompt_text", None) or str(data.prompt or "")
        return Problem(problem_id, prompt, columns.get("answer"), columns=columns)

    def task_of(self, problem_id: str) -> Any:
        task = self._tasks.get(problem_id)
        if task is None:
            raise ValueError(f"problem {problem_id!r} is not one of env verifiers:{self.name}'s recent tasks")
        return task

    def cap_turns(self, max_turns: int) -> None:
        """The serve's `--max-turns` for a role that sets no `max_turns` of its own (verifiers then ends the trace
        with stop condition `max_turns`, refusing the harness's next model call)."""
        from verifiers.v1.configs.agent import agent_config_fields

        for agent in agent_config_fields(self.env.config).values():  # the same objects the Env resolves each episode
            if agent.max_turns is None:
                agent.max_turns = max_turns

    def reset(self, problem: Problem):
        raise TypeError("a verifiers environment runs its own episodes: inflight/serve/verifiers_runner.py")

    step = reset


def load_verifiers_env(name: str, env_args: dict[str, Any]) -> VerifiersEnv:
    """The verifiers environment for taskset `name` with `env_args` as the rest of its EnvConfig, checked (module
    docstring); ValueError naming the field, the value and the fix."""
    vf = import_verifiers()
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    raw = dict(env_args)
    taskset = raw.get("taskset") or {}
    if not isinstance(taskset, dict):
        raise ValueError(f"env_args taskset is {taskset!r:.80}, expected a JSON object of the taskset's config")
    raw["taskset"] = {**taskset, "id": name}
    raw.setdefault("interception", {"type": "server"})  # one loopback server; the default pool would mint tunnels
    try:
        config = resolve_env_config(raw)
    except Exception as exc:  # pydantic's ValidationError or the plugin's ModuleNotFoundError, both name the field
        raise ValueError(f"env verifiers:{name} refused env_args {env_args}: {exc}") from exc
    config = _local_runtimes(vf, name, config, env_args)
    try:
        env = load_environment(config)
    except Exception as exc:
        raise ValueError(f"env verifiers:{name} could not be built: {type(exc).__name__}: {exc}") from exc
    warn_foreign_models(vf, name, config)
    try:  # the taskset's load() runs lazily: a broken one is refused now, not at the first admission
        first = next(iter(env.taskset), None)
    except Exception as exc:
        raise ValueError(f"env verifiers:{name}: its taskset failed to load: {type(exc).__name__}: {exc}") from exc
    if first is None:
        raise ValueError(f"env verifiers:{name}: its taskset has no tasks (env_args taskset: {taskset})")
    return VerifiersEnv(name, env, next(iter(config.agent_harnesses().values())))


def _local_runtimes(vf, name: str, config, env_args: dict[str, Any]):
    """`config` with its role's runtime the local subprocess (verifiers' default, a prime sandbox, replaced when
    `env_args` names none); refuses what cannot run here."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import harness_class

    roles = agent_config_fields(config)
    if len(roles) != 1:
        raise ValueError(
            f"env verifiers:{name} has roles {sorted(roles)}: the serve makes one rollout per episode, "
            "so only single-agent environments (one role) are supported"
        )
    ((role, agent),) = roles.items()
    if agent.client is not None:
        raise ValueError(
            f"env_args {role}.client is set ({getattr(agent.client, 'base_url', agent.client)}): that role's model "
            "calls would go there instead of this serve's engine, unversioned; leave it out"
        )
    kind = getattr(agent.runtime, "type", type(agent.runtime).__name__)
    if kind == "prime" and "runtime" not in (env_args.get(role) or {}):
        agent = agent.model_copy(update={"runtime": vf.SubprocessConfig()})
        config, kind = config.model_copy(update={role: agent}), LOCAL_RUNTIME
    if kind != LOCAL_RUNTIME:
        raise ValueError(
            f"env_args {role}.runtime.type is {kind!r}: a sandbox or container runtime cannot run inside the "
            f'serve; use {{"{role}": {{"runtime": {{"type": "{LOCAL_RUNTIME}"}}}}}} with a harness that needs none'
        )
    harness = config.agent_harnesses()[role]
    cls = harness_class(harness.id)
    if cls.NEEDS_CONTAINER:
        raise ValueError(
            f"env verifiers:{name}: {role}'s harness {harness.id!r} needs a container runtime, which the serve "
            "cannot provide; pick a harness that runs locally (null, or the taskset's own)"
        )
    check_harness(name, role, harness.id, cls)
    if cls.EXECUTES_CODE:
        log.warning(
            "env verifiers:%s: %s's harness %r executes model-written code on this host (subprocess runtime)",
            name,
            role,
            harness.id,
        )
    return config


def warn_foreign_models(vf, name: str, config) -> None:
    """A judge or a role's own client calls a model other than the policy: warned about, with where it goes."""
    from verifiers.v1.configs.agent import agent_config_fields

    for path, judge in _judges(vf, config.taskset, "taskset"):
        log.warning(
            "env verifiers:%s: %s calls judge model %r at %s, not the policy this serve samples (needs that endpoint)",
            name,
            path,
            getattr(judge, "model", None),
            getattr(getattr(judge, "client", None), "base_url", "its default endpoint"),
        )
    for role, agent in agent_config_fields(config).items():
        if agent.model is not None:
            log.warning(
                "env verifiers:%s: %s names model %r: the serve's own model answers it", name, role, agent.model
            )


def _judges(vf, value, path: str) -> Iterator[tuple[str, Any]]:
    """Every `vf.JudgeConfig` inside a pydantic config, with its dotted path."""
    if isinstance(value, vf.JudgeConfig):
        yield path, value
        return
    fields = getattr(type(value), "model_fields", None)
    if fields is None:
        return
    for field in fields:
        yield from _judges(vf, getattr(value, field, None), f"{path}.{field}")
