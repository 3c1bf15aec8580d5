"""--reasoning-parser: a reasoning model's thinking split into the chat message's reasoning_content, whole and as it
streams (serve/reasoning.py)."""

from __future__ import annotations

import re

import openai
import pytest

from conftest import HTTP, running_server
from ridge.config import EngineConfig
from ridge.serve.gateway import ServerConfig
from ridge.serve.reasoning import ReasoningStream, split_reply

REPLIES = ["<think>\nabc\n</think>\n\nhello", "abc</think>done", "<think>abc", "hello world", "  <thin",
           "<think></think>x", "<think>a</thi", "x</think>", ""]


@pytest.mark.parametrize(("parser", "reply", "thinking", "answer"), [
    ("deepseek_r1", "<think>\nabc\n</think>\n\nhello", "\nabc\n", "\n\nhello"),
    ("deepseek_r1", "abc</think>done", "abc", "done"),  # the template opened <think> in the prompt
    ("deepseek_r1", "cut off while thinking", "cut off while thinking", None),
    ("qwen3", "<think>\nabc\n</think>\n\nhello", "\nabc\n", "\n\nhello"),
    ("qwen3", "abc</think>done", None, "abc</think>done"),  # no leading <think>: thinking was off
    ("qwen3", "<think>\n\n</think>\n\nhi", "\n\n", "\n\nhi"),
    ("seed_oss", "<seed:think>abc</seed:think>hello", "abc", "hello"),  # Seed-OSS's own tags, qwen3's rule
    ("seed_oss", "<think>abc</think>hello", None, "<think>abc</think>hello"),
    ("seed_oss", "abc</seed:think>done", None, "abc</seed:think>done"),
])
def test_a_whole_reply_splits_at_the_tags(parser, reply, thinking, answer):
    split = split_reply(reply, parser)
    assert (split.reasoning, split.content) == (thinking, answer)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3", "seed_oss"])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_a_streamed_reply_splits_as_the_whole_one(parser, size):
    """Fed a few characters at a time (a tag split anywhere), the deltas join to the whole reply's fields."""
    replies = [r.replace("think>", "seed:think>").replace("<thin", "<seed:th") for r in REPLIES] \
        if parser == "seed_oss" else REPLIES
    for reply in replies:
        stream, thinking, answer = ReasoningStream(parser), "", ""
        pieces = [reply[i:i + size] for i in range(0, len(reply), size)] or [""]
        for k, piece in enumerate(pieces):
            more_thinking, more_answer = stream.feed(piece, final=k == len(pieces) - 1)
            thinking, answer = thinking + more_thinking, answer + more_answer
        whole = split_reply(reply, parser)
        assert (thinking or None, answer or None) == (whole.reasoning, whole.content), reply


def test_an_unknown_parser_is_refused_by_name():
    """At the server's start (its config), not at its first request."""
    with pytest.raises(ValueError, match="reasoning_parser: 'r2' is not one of deepseek_r1, qwen3, seed_oss"):
        ServerConfig("m", reasoning_parser="r2")
    with pytest.raises(ValueError, match="reasoning_parser: 'r2' is not one of deepseek_r1, qwen3, seed_oss"):
        ReasoningStream("r2")


@pytest.fixture(scope="module")
def client(smollm2_path):
    config = EngineConfig(model=str(smollm2_path), dtype="float32", kv_cache_memory="64MiB")
    with running_server(config, ServerConfig("smollm2", reasoning_parser="deepseek_r1",
                                             trust_request_chat_template=True)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


# SmolLM2 is no reasoning model: a regex holds its reply to a thinking-then-answer shape, its letters its own
SHAPED = {"structured_outputs": {"regex": "<think>[a-z]{3,8}</think>[a-z]{3,8}"}}
ASK = [{"role": "user", "content": "Think, then answer."}]


def test_the_server_returns_the_thinking_apart_whole_and_streamed(client):
    """A reply of the shape <think>...</think>answer: reasoning_content and content, the tags in neither; streamed,
    the deltas join to the same; include_reasoning false leaves the thinking out."""
    whole = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=40, temperature=0,
                                           extra_body=SHAPED).choices[0].message
    thinking, answer = whole.model_extra["reasoning_content"], whole.content
    assert re.fullmatch("[a-z]{3,8}", thinking) and re.fullmatch("[a-z]{3,8}", answer), (thinking, answer)
    chunks = list(client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=40, temperature=0,
                                                 extra_body=SHAPED, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thinking
    assert "".join(d.content or "" for d in deltas) == answer
    quiet = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=40, temperature=0,
                                           extra_body={**SHAPED, "include_reasoning": False}).choices[0].message
    assert quiet.content == answer and (quiet.model_extra or {}).get("reasoning_content") is None


def test_a_constrained_reply_thinks_only_where_its_constraint_opens_think(client):
    """The constraint holds the whole reply: one that allows no <think> is all answer, under deepseek_r1's parser
    too (which would otherwise take a reply without </think> for thinking cut off)."""
    plain = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=20, temperature=0,
                                           extra_body={"structured_outputs": {"regex": "[a-z]{3,8}"}}).choices[0]
    assert re.fullmatch("[a-z]{3,8}", plain.message.content)
    assert (plain.message.model_extra or {}).get("reasoning_content") is None


def test_reasoning_effort_reaches_a_template_that_reads_it(client):
    """OpenAI's reasoning_effort is a variable of gpt-oss's template: rendered where a template reads it (here a
    request's own, as gpt-oss's "Reasoning: {{ reasoning_effort }}"), refused by name where the model's does not
    (SmolLM2's would never show it)."""
    template = ("{{ 'Reasoning: ' + reasoning_effort }}{% for m in messages %}\n{{ m.content }}{% endfor %}\n")
    out = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=1, reasoning_effort="high",
                                         extra_body={"chat_template": template, "return_token_ids": True})
    server = str(client.base_url).removesuffix("/v1/")
    text = HTTP.post(f"{server}/detokenize", json={"tokens": out.model_extra["prompt_token_ids"]}).json()["prompt"]
    assert text.startswith("Reasoning: high") and "Think, then answer." in text  # trim_blocks took the newline
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=1, reasoning_effort="low")
    assert caught.value.body["param"] == "reasoning_effort" and "does not read it" in caught.value.body["message"]


def test_documents_reach_a_template_that_reads_them(client):
    """vLLM's documents (retrieved passages, a variable of HF's apply_chat_template): rendered where a template reads
    them (here a request's own, looping over them as Command R's does); refused by name where the model's does not
    (tests/test_server.py)."""
    template = ("{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                "{% for m in messages %}\n{{ m.content }}{% endfor %}\n")
    documents = [{"title": "Moon", "text": "The Moon orbits Earth."}, {"title": "Sun", "text": "A star."}]
    out = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=1, extra_body={
        "chat_template": template, "return_token_ids": True, "documents": documents})
    server = str(client.base_url).removesuffix("/v1/")
    text = HTTP.post(f"{server}/detokenize", json={"tokens": out.model_extra["prompt_token_ids"]}).json()["prompt"]
    assert text.startswith("[Moon: The Moon orbits Earth.][Sun: A star.]") and "Think, then answer." in text
