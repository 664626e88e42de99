"""A tiny model whose chat template offers tools: tiny-qwen2's weights and tokenizer with a ChatML template that renders
tool definitions and Hermes-style `<tool_call>` JSON calls (the format Qwen2.5/Qwen3 and Hermes models use), written
for these tests. The prepared test models all carry SmolLM2's template, which renders no tools, so verifiers' `bash`
harness is refused on them (inflight/serve/verifiers_renderer.py:tool_template_gap). For test_verifiers_env.py and
test_run.py."""

from __future__ import annotations

from pathlib import Path

TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}You may call functions. Their signatures, one JSON object a line:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, reply with <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user
{% endif %}<tool_response>
{{ message['content'] }}
</tool_response>
{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>
{% endif %}
{%- else %}<|im_start|>{{ message['role'] }}
{% if message['content'] %}{{ message['content'] }}{% endif %}
{%- for call in message.get('tool_calls') or [] %}
{%- if call.function is defined %}{% set call = call.function %}{% endif %}
<tool_call>
{"name": "{{ call.name }}", "arguments": {{ call.arguments if call.arguments is string else call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def tool_model(source: Path, dest: Path) -> Path:
    """`dest`: `source`'s files linked, its chat template replaced by TOOL_TEMPLATE."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.name != "chat_template.jinja" and not (dest / path.name).exists():
            (dest / path.name).symlink_to(path.resolve())
    (dest / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return dest
