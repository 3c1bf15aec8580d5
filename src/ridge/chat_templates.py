"""Chat templates for model files that carry none, by architecture (llama.cpp keeps one per family too).

A file's own `tokenizer.chat_template` always wins; these are the formats the families were trained on,
for files converted without it (gemma3-270m's GGUF, for one).
"""

from __future__ import annotations

# Gemma: two roles, user and model; a system message is the first user turn's opening paragraph.
# BOS is not written here: the tokenizer adds it (tokenizer.ggml.add_bos_token).
_GEMMA = (
    "{% set offset = 0 %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = (messages[0]['content'] | trim) + '\n\n' %}{% set offset = 1 %}"
    "{% else %}{% set system = '' %}{% endif %}"
    "{% for message in messages[offset:] %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{% if role not in ('user', 'model') %}"
    "{{ raise_exception('Gemma has user and assistant turns (and one system message first); got ' + role) }}"
    "{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') + (message['content'] | trim)"
    " + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

BUILTIN: dict[str, str] = {"gemma": _GEMMA, "gemma2": _GEMMA, "gemma3": _GEMMA}
