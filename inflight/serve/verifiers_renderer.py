"""AppendingRenderer: the renderer verifiers' train client uses in a serve, so each turn only appends to the ids the
engine already saw.

Loaded by import path from the train client's config (inflight/serve/verifiers_runner.py); `renderers` comes with
verifiers. renderers' fallback for a model it has no hand-written renderer for (`DefaultRenderer`: the model's own
chat template) re-renders the whole conversation every turn, so an earlier turn's sampled text is tokenised again:
a sampled token sequence that is not the tokenizer's own encoding of its text (common at temperature 1) then differs
from what the engine sampled, and verifiers' trace forks into a second branch. This subclass keeps the template and the
parsing and adds the bridge renderers' typed renderers have: the next turn's prompt is the previous prompt and
completion verbatim, then what the template renders after an assistant turn (its closing, unless the completion
ended on it; the new messages; the next assistant header), as inflight/serve/episodes.py:TurnTokens does for the
serve's own environments. A template that renders earlier turns differently once a message follows them, tools, or
an assistant message among the new ones fall back to the full render (renderers' contract: `None`).
"""

from __future__ import annotations

from renderers import DefaultRenderer, DefaultRendererConfig, RenderedTokens

_U, _A = "inflight-user-7f3a", "inflight-assistant-9c1e"  # stand-ins to find where a template opens/closes a turn


class AppendingRenderer(DefaultRenderer):
    config_class = DefaultRendererConfig

    def _text(self, messages: list, generation_prompt: bool) -> str:
        kwargs = dict(self.config.model_extra or {})
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
        if tools or not new_messages or any(m.get("role") == "assistant" for m in new_messages):
            return None
        base = [{"role": "user", "content": _U}, {"role": "assistant", "content": _A}]
        done = self._text(base, False)
        closing = done[done.rindex(_A) + len(_A) :]
        ended = self._tokenizer.decode(previous_completion_ids[-1:], skip_special_tokens=False)
        if ended and closing.startswith(ended):  # the completion ended on the template's end-of-turn token
            closing = closing[len(ended) :]
        ids = [*previous_prompt_ids, *previous_completion_ids, *self._encode(closing)]
        indices = [-1] * len(ids)
        for i in range(len(new_messages)):
            text = self._text(base + list(new_messages[: i + 1]), False)
            if not text.startswith(done):
                return None
            piece = self._encode(text[len(done) :])
            ids, indices, done = ids + piece, indices + [i] * len(piece), text
        full = self._text(base + list(new_messages), True)
        if not full.startswith(done):
            return None
        header = self._encode(full[len(done) :])
        return RenderedTokens(
            token_ids=ids + header,
            message_indices=indices + [-1] * len(header),
            message_roles=[m.get("role") or "" for m in new_messages],
        )
