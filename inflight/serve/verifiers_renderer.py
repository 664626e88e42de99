"""AppendingRenderer: the renderer verifiers' train client uses in a serve, so each turn only appends to the ids the
engine already saw, and tools are offered and called in the model's own chat-template format.

Loaded by import path from the train client's config (inflight/serve/verifiers_runner.py); `renderers` comes with
verifiers. Runs in the serve process (verifiers' renderer pool, on a thread). renderers' fallback for a model it has no
hand-written renderer for (`DefaultRenderer`: the model's own chat template) re-renders the whole conversation every
turn, so an earlier turn's sampled text is tokenised again: a sampled token sequence that is not the tokenizer's own
encoding of its text (common at temperature 1) then differs from what the engine sampled, and verifiers' trace forks
into a second branch. This subclass keeps the template and the parsing and adds the bridge renderers' typed renderers
have: the next turn's prompt is the previous prompt and completion verbatim, then what the template renders after an
assistant turn (its closing, unless the completion ended on it; the new messages; the next assistant header), as
inflight/serve/episodes.py:TurnTokens does for the serve's own environments. A template that renders earlier turns
differently once a message follows them, or an assistant message among the new ones, fall back to the full render
(renderers' contract: `None`).

Tools (verifiers' `bash` harness offers its bash and edit tools): their definitions are rendered by the chat template's
own `tools` support (`apply_chat_template(..., tools=...)`), and a completion's tool calls are parsed by vLLM's own
`hermes` tool parser (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the format of Qwen2.5/Qwen3 and Hermes
templates) into the OpenAI-style calls the harness runs. `tool_template_gap` checks a template does both (a stand-in
tool, its call rendered by the template and parsed back); the serve checks it at start for a harness that offers tools
(inflight/serve/verifiers_runner.py), and a request with tools to a template that cannot is refused naming the gap.
"""

from __future__ import annotations

import dataclasses
import json
import os
from functools import cache

from renderers import DefaultRenderer, DefaultRendererConfig, RenderedTokens
from renderers.base import ParsedResponse, ParsedToolCall

_U, _A = "inflight-user-7f3a", "inflight-assistant-9c1e"  # stand-ins to find where a template opens/closes a turn
_TOOL = "inflight_probe_tool"  # a stand-in tool: whether, and in which format, a template renders tools
TOOL_CALL_PARSER = "hermes"  # vLLM's name for the `<tool_call>` JSON format's parser (vllm.tool_parsers)


@cache
def _parser_class():
    from vllm.tool_parsers import ToolParserManager  # the serve has vLLM; imported here, on the first tool probe

    return ToolParserManager.get_tool_parser(TOOL_CALL_PARSER)


def tool_call_parser(tokenizer):
    """vLLM's hermes tool parser for `tokenizer` (its non-streaming `extract_tool_calls(text, request)`)."""
    return _parser_class()(tokenizer)


def tool_template_gap(tokenizer) -> str | None:
    """None where `tokenizer`'s chat template renders tool definitions and renders a tool call so that vLLM's hermes
    parser reads the same call back; else what it lacks, as a phrase ("renders no tool definitions", ...)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": _TOOL, "description": "a probe", "parameters": schema}}]
    call = {"id": "call_0", "type": "function", "function": {"name": _TOOL, "arguments": {"n": 7}}}
    user = [{"role": "user", "content": _U}]
    try:
        offered = tokenizer.apply_chat_template(user, tools=tools, tokenize=False, add_generation_prompt=True)
        called = tokenizer.apply_chat_template(
            [*user, {"role": "assistant", "content": "", "tool_calls": [call]}], tools=tools, tokenize=False
        )
    except Exception as exc:  # a template that cannot take tools or tool calls at all
        return f"fails on tools ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if _TOOL not in offered:
        return "renders no tool definitions (it ignores `tools`)"
    head = offered.rsplit(_U, 1)[0]  # the system part with the tool definitions, before the user's message
    reply = called[called.rindex(_U) + len(_U) :]
    found = tool_call_parser(tokenizer).extract_tool_calls(reply, None) if called.startswith(head) else None
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in found.tool_calls] if found else []
    if calls != [(_TOOL, {"n": 7})]:
        return f"renders tool calls in a format vLLM's {TOOL_CALL_PARSER!r} parser does not read back"
    return None


class AppendingRenderer(DefaultRenderer):
    config_class = DefaultRendererConfig

    def __init__(self, tokenizer, config: DefaultRendererConfig | None = None):
        super().__init__(tokenizer, config)
        self.tool_gap = tool_template_gap(tokenizer)
        self._tool_calls = tool_call_parser(tokenizer) if self.tool_gap is None else None

    @property
    def supports_tools(self) -> bool:
        return self.tool_gap is None

    def _require_tools(self, tools) -> None:
        if tools and self.tool_gap is not None:
            name = getattr(self._tokenizer, "name_or_path", "the model")
            raise ValueError(f"the environment offers the model tools, and {name}'s chat template {self.tool_gap}")

    def render(self, messages, *, tools=None, add_generation_prompt: bool = False) -> RenderedTokens:
        self._require_tools(tools)
        return super().render(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def parse_response(self, token_ids, *, tools=None, prompt_ids=None) -> ParsedResponse:
        """DefaultRenderer's parse, then, where the request offered tools, vLLM's hermes parser on its content: each
        call as renderers' `ParsedToolCall` (name, JSON arguments, vLLM's call id)."""
        parsed = super().parse_response(token_ids, tools=tools, prompt_ids=prompt_ids)
        if not tools or self._tool_calls is None:
            return parsed
        found = self._tool_calls.extract_tool_calls(parsed.content, None)
        if not found.tools_called:  # none, or one vLLM could not read (it then keeps the whole text as content)
            return parsed
        calls = [
            ParsedToolCall(raw=_call_text(c), name=c.function.name, arguments=c.function.arguments, id=c.id)
            for c in found.tool_calls
        ]
        return dataclasses.replace(parsed, content=found.content or "", tool_calls=calls)

    def _text(self, messages: list, generation_prompt: bool, tools) -> str:
        kwargs = dict(self.config.model_extra or {})
        if tools:
            kwargs["tools"] = tools
        return self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False)) if text else []

    def bridge_to_next_turn(
        self, previous_prompt_ids: list[int], previous_completion_ids: list[int], new_messages: list, *, tools=None
    ) -> RenderedTokens | None:
        """`previous_prompt_ids + previous_completion_ids` and the tokens `new_messages` append (module docstring);
        None where the template cannot be trusted to append."""
        self._require_tools(tools)
        if not new_messages or any(m.get("role") == "assistant" for m in new_messages):
            return None
        base = [{"role": "user", "content": _U}, {"role": "assistant", "content": _A}]
        done = self._text(base, False, tools)
        full = self._text(base + list(new_messages), False, tools)
        header = self._text(base + list(new_messages), True, tools)
        if not full.startswith(done) or not header.startswith(full):
            return None
        closing = done[done.rindex(_A) + len(_A) :]
        ended = self._tokenizer.decode(previous_completion_ids[-1:], skip_special_tokens=False)
        if ended and closing.startswith(ended):  # the completion ended on the template's end-of-turn token
            closing = closing[len(ended) :]
        ids = [*previous_prompt_ids, *previous_completion_ids, *self._encode(closing)]
        indices = [-1] * len(ids)
        for i, (start, end) in enumerate(_message_cuts(self, base, new_messages, len(done), full, tools)):
            piece = self._encode(full[start:end])
            ids, indices = ids + piece, indices + [i] * len(piece)
        tail = self._encode(header[len(full) :])
        return RenderedTokens(
            token_ids=ids + tail,
            message_indices=indices + [-1] * len(tail),
            message_roles=[m.get("role") or "" for m in new_messages],
        )


def _call_text(call) -> str:
    """A parsed call as the JSON object the hermes format writes (renderers' `raw`)."""
    return f'{{"name": {json.dumps(call.function.name)}, "arguments": {call.function.arguments}}}'


def _message_cuts(renderer: AppendingRenderer, base: list, new_messages: list, start: int, full: str, tools):
    """Each new message's [start, end) in `full` (the template's text with all of them): up to where the text with
    only the messages so far stops agreeing with it (at a line's end). A template that groups consecutive messages
    (tool results in one user turn) closes the group only after its last one; that closing goes to the last."""
    cuts, at = [], start
    for i in range(len(new_messages)):
        if i == len(new_messages) - 1:
            end = len(full)
        else:
            text = renderer._text(base + list(new_messages[: i + 1]), False, tools)
            end = len(os.path.commonprefix([text, full]))
            if end < len(text):  # the group goes on: cut after the last whole line they agree on
                end = full.rfind("\n", at, end) + 1 or at
            end = max(at, end)
        cuts.append((at, end))
        at = end
    return cuts
