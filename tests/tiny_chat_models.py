"""A tiny chat model whose tool calls, JSON schemas and templates are real (tests of the pass-through).

`write_tool_chat` writes a random-weight llama model (as `tiny_models.write_llama`) whose vocabulary adds the
chat markers as special tokens and whose header carries a ChatML chat template with tools, written here for
the tests. No space prefix is added to text, so llama-server's grammars (tools, `json_schema`, `json_object`)
accept its generation prompt. The template writes tool calls in the XML shape llama-server
recognizes by its markers (`<tool_call>`, `<function=…>`, `<parameter=…>`), so the server builds a grammar for
a request with tools and parses the answer's calls itself. A random model wanders: a request that must end in
a tool call (`tool_choice: "required"`, integer parameters, whose values the grammar bounds) biases the call's
opening and the end of the answer (`TOOL_BIAS`), the same body to the front door and to the server.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from tests.tiny_models_engine import _DENSE, _GLOBALS, _attention_dims, _ffn_dims, _spec, _transformer, _write

__all__ = ["CHAT_TEMPLATE", "IM_END", "TOOL_BIAS", "TOOL_CALL", "TOOL_CALL_END", "write_tool_chat"]

#: The markers, appended to the byte vocabulary (ids 259..262).
IM_START: Final = 259
IM_END: Final = 260
TOOL_CALL: Final = 261
TOOL_CALL_END: Final = 262
_MARKERS: Final = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
#: `logit_bias` that makes a grammar-constrained answer open a tool call, close its strings and end.
TOOL_BIAS: Final = {str(IM_END): 110, str(TOOL_CALL): 100}

CHAT_TEMPLATE: Final = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{%- for tool in tools %}
<function>
<name>{{ tool.function.name }}</name>
<parameters>{{ tool.function.parameters | tojson }}</parameters>
</function>
{%- endfor %}
</tools>
To call a function, answer:
<tool_call>
<function=NAME>
<parameter=ARGUMENT>
VALUE
</parameter>
</function>
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for call in message.tool_calls %}
<tool_call>
<function={{ call.function.name }}>
{%- for name, value in call.function.arguments.items() %}
<parameter={{ name }}>
{{ value if value is string else value | tojson }}
</parameter>
{%- endfor %}
</function>
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def write_tool_chat(
    path: str | os.PathLike[str], *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2
) -> Path:
    """A llama model with the chat markers as special tokens and `CHAT_TEMPLATE`."""
    n_ff = 2 * n_embd
    dims = _attention_dims(n_embd, n_head, n_head_kv)
    header = _transformer(n_layer, n_embd, n_head, n_head_kv, n_ff)
    spec = _spec("llama", 259, header, {"rope.dimension_count": dims["head"]})
    spec.kv["tokenizer.ggml.tokens"] = [*spec.kv["tokenizer.ggml.tokens"], *_MARKERS]
    spec.kv["tokenizer.ggml.scores"] = [*spec.kv["tokenizer.ggml.scores"], *[0.0] * len(_MARKERS)]
    spec.kv["tokenizer.ggml.token_type"] = [*spec.kv["tokenizer.ggml.token_type"], *[1] * len(_MARKERS)]
    spec.kv["tokenizer.ggml.eos_token_id"] = IM_END
    spec.kv["tokenizer.ggml.add_space_prefix"] = False
    spec.kv["tokenizer.chat_template"] = CHAT_TEMPLATE
    return _write(path, spec, dims | _ffn_dims(n_ff), [_DENSE] * n_layer, globals_=_GLOBALS)
