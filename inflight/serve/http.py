"""`--http-port`: the serve's own engine also answers vLLM's OpenAI-compatible API, to evaluate the live policy.

Built from vLLM's own app factory (`build_app` + `init_app_state`) on the same AsyncLLM the rollout driver uses, run by
uvicorn in the same event loop. `WeightVersionMiddleware` makes responses say which weights answered:
`x-inflight-weight-version-start` (version when the request arrived) and `x-inflight-weight-version` (when the response
started); equal values mean one version produced the whole answer. It also adds the engine's per-version `cache_salt`
to completion requests, so an API request never reuses KV computed by other weights. A serve with a LoRA adapter
(`--lora-rank`) answers under the adapter's name (vllm_patches/adapter.py:ADAPTER_NAME, registered as a vLLM LoRA
module under the same LoRA id the rollouts use, so both see every in-flight adapter update) and under the base
model's name, which the middleware maps to the adapter: the served name is the live policy, adapter included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # vLLM is imported by start_http, once an API is asked for
    from vllm_patches.engine import InflightEngine

log = logging.getLogger("inflight.serve")
ASGIApp = Callable[..., Awaitable[None]]  # (scope, receive, send)
SALTED_PATHS = ("/v1/chat/completions", "/v1/completions")


class WeightVersionMiddleware:
    def __init__(self, app: ASGIApp, engine: InflightEngine, served_name: str = "", adapter_name: str = ""):
        self.app, self.engine = app, engine
        self.served_name, self.adapter_name = served_name, adapter_name  # adapter_name '': no adapter to map to

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start_version = self.engine.version
        if scope["method"] == "POST" and scope["path"] in SALTED_PATHS:
            receive = await self._salted(receive)

        async def send_with_version(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"x-inflight-weight-version-start", str(start_version).encode()))
                headers.append((b"x-inflight-weight-version", str(self.engine.version).encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_version)

    async def _salted(self, receive):
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            obj = json.loads(body)
            if isinstance(obj, dict):
                body = json.dumps(self._rewritten(obj)).encode()
        except ValueError:
            pass  # not JSON: let vLLM answer with its own error
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replay

    def _rewritten(self, obj: dict) -> dict:
        """The request with this version's cache salt and, with an adapter, the base model's name mapped to it."""
        obj = {"cache_salt": self.engine.cache_salt, **obj}
        if self.adapter_name and obj.get("model", self.served_name) == self.served_name:
            obj["model"] = self.adapter_name
        return obj


def _quiet_server_class():
    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn without its own signal handlers: serve's shutdown path owns SIGINT/SIGTERM."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return QuietServer


async def start_http(engine: InflightEngine, model_path: str, served_name: str, host: str, port: int) -> asyncio.Task:
    """Serve the OpenAI API on host:port from `engine.llm`; returns the uvicorn task (cancel it to stop)."""
    import uvicorn
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", model_path, "--served-model-name", served_name, "--host", host, "--port", str(port)]
    adapter = ""
    if engine.lora is not None:  # the first static LoRA module gets LoRA id 1: the rollouts' (ADAPTER_ID)
        adapter = engine.lora.lora_name
        argv += ["--enable-lora", "--lora-modules", f"{adapter}={engine.lora.lora_path}"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    tasks = await engine.llm.get_supported_tasks()
    app = build_app(args, tasks, engine.llm.model_config)
    await init_app_state(engine.llm, app.state, args, tasks)
    config = uvicorn.Config(
        WeightVersionMiddleware(app, engine, served_name, adapter),
        host=host,
        port=port,
        log_level="warning",
        lifespan="off",
    )
    server = _quiet_server_class()(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises the bind error
        await asyncio.sleep(0.05)
    log.info("OpenAI API on http://%s:%d/v1 (model name %r)", host, port, served_name)
    return task
