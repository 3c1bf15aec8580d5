"""gpt-oss's harmony replies read off their token ids (serve/harmony.py): the thinking, the answer and the tool
calls, whole and as they stream; through the server on a gpt-oss whose weights are set to write one harmony reply.

No gpt-oss tokenizer can be downloaded here: the tests' vocabulary is bytes with harmony's markers as special
tokens (as in o200k_harmony) and a few words as tokens of their own."""

from __future__ import annotations

import io
import json

import openai
import pytest
import torch
from tokenizers import AddedToken

from conftest import running_server
from ridge.config import EngineConfig
from ridge.serve.gateway import ServerConfig
from ridge.serve.harmony import MARKERS, HarmonyStream, HarmonyTokens, chat_message, harmony_reply
from ridge.tokenizer import RidgeTokenizer, TokenizerInfo
from test_models_random import VOCAB, byte_tokenizer

WORDS = ["assistant", "analysis", "final", "commentary", " to=functions.get_weather", " json", "Hello there",
         '{"city": "Paris"}']


def harmony_vocabulary():
    tok = byte_tokenizer()
    tok.add_special_tokens([AddedToken(m, special=True) for m in MARKERS.values()])
    tok.add_tokens([AddedToken(w, normalized=False) for w in WORDS])
    assert tok.get_vocab_size() <= VOCAB
    return tok


@pytest.fixture(scope="module")
def tokenizer() -> RidgeTokenizer:
    return RidgeTokenizer(harmony_vocabulary(), TokenizerInfo(None, None, False, None))


@pytest.fixture(scope="module")
def markers(tokenizer) -> HarmonyTokens:
    return HarmonyTokens.of(tokenizer.tokenizer.token_to_id)


THINK_THEN_ANSWER = ("<|channel|>analysis<|message|>The user greets; ✓ answer.<|end|>"
                     "<|start|>assistant<|channel|>final<|message|>Hi! Ça va?<|return|>")
CALL_AFTER_THINKING = ("<|channel|>analysis<|message|>Need weather.<|end|>"
                       '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":  '
                       '"Paris"}<|call|>')
CALL_RECIPIENT_AFTER_CHANNEL = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                                '{"city": "Oslo"}<|call|>')
PREAMBLE_THEN_CALL = ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary '
                      'to=functions.lookup<|message|>{"q": 1}<|call|>')


@pytest.mark.parametrize(("reply", "reasoning", "content", "calls"), [
    (THINK_THEN_ANSWER, "The user greets; ✓ answer.", "Hi! Ça va?", []),
    (CALL_AFTER_THINKING, "Need weather.", "", [("get_weather", '{"city": "Paris"}')]),
    (CALL_RECIPIENT_AFTER_CHANNEL, "", "", [("get_weather", '{"city": "Oslo"}')]),
    (PREAMBLE_THEN_CALL, "", "Checking.", [("lookup", '{"q": 1}')]),
    ("<|channel|>analysis<|message|>cut off while thin", "cut off while thin", "", []),
    ('<|channel|>commentary to=functions.f<|message|>{"a": ', "", '{"a": ', []),  # a call cut off: its text kept
    ("plain text, no harmony at all", "", "plain text, no harmony at all", []),
    # continuing the prompt's last message (continue_final_message): its rest, then the next message
    ("the rest.<|end|><|start|>assistant<|channel|>final<|message|>Done<|return|>", "", "the rest.Done", []),
])
def test_a_whole_reply_reads_as_its_channels(tokenizer, markers, reply, reasoning, content, calls):
    ids = tokenizer.encode(reply)
    assert markers.channel in ids or "<|" not in reply  # the markers are single special tokens
    got = harmony_reply(markers, tokenizer, ids, calls_offered=True)
    assert (got.reasoning, got.content) == (reasoning, content)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got.calls] == calls


def test_a_call_where_no_tools_were_offered_stays_text(tokenizer, markers):
    got = harmony_reply(markers, tokenizer, tokenizer.encode(CALL_RECIPIENT_AFTER_CHANNEL), calls_offered=False)
    assert (got.content, got.calls) == ('{"city": "Oslo"}', [])


@pytest.mark.parametrize("size", [1, 2, 5])
def test_a_streamed_reply_reads_as_the_whole_one(tokenizer, markers, size):
    """Fed a few ids at a time (a marker, a header, a UTF-8 character split anywhere), the deltas join to the whole
    reply's fields, and no delta holds half a character."""
    for reply in (THINK_THEN_ANSWER, CALL_AFTER_THINKING, PREAMBLE_THEN_CALL, "<|channel|>final<|message|>Ça"):
        ids = tokenizer.encode(reply)
        stream, reasoning, content, calls = HarmonyStream(markers, tokenizer, True), "", "", []
        pieces = [ids[i:i + size] for i in range(0, len(ids), size)]
        for k, piece in enumerate(pieces):
            got = stream.feed(piece, final=k == len(pieces) - 1)
            assert "\ufffd" not in got.reasoning + got.content
            reasoning, content, calls = reasoning + got.reasoning, content + got.content, calls + got.calls
        whole = harmony_reply(markers, tokenizer, ids, True)
        assert (reasoning, content) == (whole.reasoning, whole.content), reply
        assert [c["function"] for c in calls] == [c["function"] for c in whole.calls]


def test_the_chat_message_of_a_reply(tokenizer, markers):
    reply = harmony_reply(markers, tokenizer, tokenizer.encode(CALL_AFTER_THINKING + PREAMBLE_THEN_CALL), True)
    message, called = chat_message(reply, include_reasoning=True, parallel_tool_calls=False)
    assert called and message["reasoning_content"] == "Need weather." and len(message["tool_calls"]) == 1
    quiet, _ = chat_message(reply, include_reasoning=False, parallel_tool_calls=True)
    assert "reasoning_content" not in quiet and len(quiet["tool_calls"]) == 2


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}


@pytest.mark.parametrize(("reply", "held"), [
    ('<|channel|>analysis<|message|>The user greets; ✓ answer.<|end|><|start|>assistant<|channel|>final<|message|>'
     '{"city": "Paris"}<|return|>', True),
    ('<|channel|>final<|message|>{"city":"Oslo"}<|return|>', True),  # no thinking
    ('<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>'
     '<|start|>assistant<|channel|>final<|message|>{"city": "Oslo"}<|return|>', True),
    ('<|channel|>final<|message|>Hello there<|return|>', False),  # not the schema's
    ('<|channel|>final<|message|>{"city": "Rome"}<|return|>', False),
    ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>'
     '{"city": "Paris"}<|return|>', False),  # a preamble would join the answer's content
    ('{"city": "Paris"}<|return|>', False),  # the answer outside the final channel
    ('<|channel|>final<|message|>{"city": "Paris"}<|end|>', False),  # only a stop token ends it
])
def test_a_constraint_holds_the_final_channel_only(tokenizer, reply, held):
    """A request's constraint on a harmony reply: free thinking first, then the final channel's message in the
    grammar, then a stop token; the same constraint whatever form it came in."""
    from ridge.engine.structured import GrammarCompiler
    from ridge.sampling_params import StructuredOutputsParams
    from ridge.serve.harmony import final_channel_constraint

    info = TokenizerInfo(None, None, False, None)
    info.stop_token_ids = frozenset(tokenizer.tokenizer.token_to_id(m) for m in ("<|return|>", "<|call|>"))
    compiler = GrammarCompiler(RidgeTokenizer(tokenizer.tokenizer, info), VOCAB)
    for spec in (StructuredOutputsParams(json=CITY), StructuredOutputsParams(json=json.dumps(CITY)),
                 StructuredOutputsParams(regex=r'\{"city": ?"(Paris|Oslo)"\}'),
                 StructuredOutputsParams(grammar='start: "{\\"city\\":" " "? CITY "}"\nCITY: "\\"Paris\\"" | '
                                                 '"\\"Oslo\\""'),
                 StructuredOutputsParams(grammar='root ::= "{\\"city\\":" " "? ("\\"Paris\\"" | "\\"Oslo\\"") "}"'),
                 StructuredOutputsParams(grammar=json.dumps({"grammars": [  # llguidance JSON: one naming another
                     {"name": "city_object", "lark_grammar": 'start: "{\\"city\\":" " "? @city_name "}"'},
                     {"name": "city_name", "lark_grammar": 'start: "\\"Paris\\"" | "\\"Oslo\\""'}]}))):
        grammar = compiler.matcher(final_channel_constraint(spec))
        ids = tokenizer.encode(reply)
        taken = grammar.valid_prefix(ids)
        assert (taken == len(ids)) == held, (spec, taken, len(ids))
    with pytest.raises(ValueError, match="structured_outputs.json: not valid JSON"):
        final_channel_constraint(StructuredOutputsParams(json="{not json"))


def test_parsers_that_do_not_read_the_model_are_refused_at_start(markers):
    assert HarmonyTokens.of(byte_tokenizer().token_to_id) is None
    with pytest.raises(ValueError, match="reasoning_parser: openai_gptoss reads gpt-oss's harmony channels"):
        ServerConfig("m", reasoning_parser="openai_gptoss").check_parsers(None)
    with pytest.raises(ValueError, match="tool_call_parser: openai reads gpt-oss's harmony channels"):
        ServerConfig("m", tool_call_parser="openai").check_parsers(None)
    with pytest.raises(ValueError, match="reasoning_parser: qwen3 reads tags this model does not write"):
        ServerConfig("m", reasoning_parser="qwen3").check_parsers(markers)
    with pytest.raises(ValueError, match="tool_call_parser: hermes reads tags this model does not write"):
        ServerConfig("m", tool_call_parser="hermes").check_parsers(markers)
    ServerConfig("m", reasoning_parser="openai_gptoss", tool_call_parser="openai").check_parsers(markers)


# ---- through the server: a gpt-oss whose weights write one reply --------------------------------------------
TEMPLATE = ("{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor %}"
            "{%- if tools %}<|start|>developer<|message|># Tools: namespace functions"
            "{%- for t in tools %} type {{ t.function.name }} = () => any;{%- endfor %}<|end|>{%- endif %}"
            "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")
REPLIES = {"answer": "<|channel|>final<|message|>Hello there<|return|>",
           "call": ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
           "thought": "<|channel|>analysis<|message|>Hello there<|end|><|return|>"}


def chain_gpt_oss(path, reply: str) -> None:
    """A random gpt-oss whose layers add nothing to the residual stream (o_proj and the experts' down projections
    zeroed), so that its next token is a function of the current one, set to follow `reply` from the prompt's last
    token (`assistant`, which the template ends with): one-hot embeddings and a head that maps each to the next."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    tok = harmony_vocabulary()
    chain = [tok.token_to_id("assistant"), *tok.encode(reply).ids]
    assert len(set(chain)) == len(chain)  # a token's successor is fixed: each once
    stops = [tok.token_to_id(m) for m in ("<|return|>", "<|call|>")]
    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
                          tie_word_embeddings=False, eos_token_id=stops, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            for tensor in (layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias, layer.mlp.experts.down_proj,
                           layer.mlp.experts.down_proj_bias):
                tensor.zero_()
        model.lm_head.weight.zero_()
        for i, (token, following) in enumerate(zip(chain, chain[1:], strict=False)):
            model.model.embed_tokens.weight[token] = torch.nn.functional.one_hot(torch.tensor(i), 64).float()
            model.lm_head.weight[following, i] = 10.0
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))


@pytest.fixture(scope="module")
def chained(tmp_path_factory):
    """A model directory per reply of REPLIES, by name."""
    paths = {}
    for name, reply in REPLIES.items():
        paths[name] = tmp_path_factory.mktemp(f"harmony-{name}")
        chain_gpt_oss(paths[name], reply)
    return paths


@pytest.fixture(scope="module", params=["answer", "call"])
def client(request, chained):
    config = EngineConfig(model=str(chained[request.param]), dtype="float32", kv_cache_memory="16MiB")
    with running_server(config, ServerConfig("gpt-oss")) as srv:
        yield request.param, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_the_server_reads_the_reply_s_channels_whole_and_streamed(client):
    """The answer as content (the markers and the channel's name in neither field), or the call as a tool call with
    finish_reason tool_calls; streamed, the deltas join to the same."""
    kind, api = client
    tools = TOOLS if kind == "call" else None
    whole = api.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=20, temperature=0,
                                        tools=tools or openai.NOT_GIVEN).choices[0]
    if kind == "answer":
        assert (whole.message.content, whole.finish_reason) == ("Hello there", "stop")
    else:
        (call,) = whole.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert whole.message.content is None and whole.finish_reason == "tool_calls"
    chunks = list(api.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=20, temperature=0,
                                              tools=tools or openai.NOT_GIVEN, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == (whole.message.content or "")
    streamed_calls = [call.function for d in deltas for call in d.tool_calls or []]
    assert [(f.name, f.arguments) for f in streamed_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    if kind == "call":  # no tools offered: the call's text is the reply
        plain = api.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=20, temperature=0)
        assert plain.choices[0].message.content == '{"city": "Paris"}' and not plain.choices[0].message.tool_calls


def test_the_responses_api_reads_the_channels_as_output_items(client):
    """/v1/responses on a harmony reply: the final channel as a message item, a commentary call as a function_call
    item; streamed, the completed response holds the same items."""
    kind, api = client
    tools = [{"type": "function", **TOOLS[0]["function"]}] if kind == "call" else openai.NOT_GIVEN
    kwargs = dict(model="gpt-oss", input=ASK[0]["content"], max_output_tokens=20, temperature=0, tools=tools)
    whole = api.responses.create(**kwargs)
    if kind == "answer":
        assert [o.type for o in whole.output] == ["message"] and whole.output_text == "Hello there"
    else:
        (call,) = whole.output
        assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    final = list(api.responses.create(stream=True, **kwargs))[-1]
    assert final.type == "response.completed"
    assert [o.model_dump(exclude={"id", "call_id"}) for o in final.response.output] == [
        o.model_dump(exclude={"id", "call_id"}) for o in whole.output]


def test_the_analysis_channel_is_a_reasoning_item(chained):
    """A reply that only thinks: its analysis channel as the Response's reasoning item, counted in the usage."""
    config = EngineConfig(model=str(chained["thought"]), dtype="float32", kv_cache_memory="16MiB")
    with running_server(config, ServerConfig("gpt-oss")) as srv:
        api = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        got = api.responses.create(model="gpt-oss", input=ASK[0]["content"], max_output_tokens=20, temperature=0)
    (item,) = got.output
    assert item.type == "reasoning" and [c.text for c in item.content] == ["Hello there"]
    assert got.output_text == "" and got.usage.output_tokens_details.reasoning_tokens > 0


@pytest.mark.parametrize(("field", "body"), [
    ("response_format", {"tools": TOOLS, "response_format": {"type": "json_object"}}),
    ("tool_choice", {"tools": TOOLS, "tool_choice": "required"}),
    ("stop", {"stop": ["x"]}),
    ("skip_special_tokens", {"skip_special_tokens": False}),
])
def test_what_a_harmony_reply_cannot_honour_is_refused_by_name(client, field, body):
    _, api = client
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=5, extra_body=body)
    assert caught.value.body["param"] == field and "harmony" in caught.value.body["message"]


def test_the_server_constrains_the_final_channel(chained):
    """response_format on a harmony model: the model opens its final channel as it would, and the answer is the
    schema's (the model's own words, "Hello there", masked), whole and streamed, finish_reason stop."""
    config = EngineConfig(model=str(chained["answer"]), dtype="float32", kv_cache_memory="16MiB")
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": {
        "type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
        "additionalProperties": False}}}
    with running_server(config, ServerConfig("gpt-oss")) as srv:
        api = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        whole = api.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=30, temperature=0,
                                            response_format=schema, extra_body={"return_token_ids": True}).choices[0]
        assert json.loads(whole.message.content) == {"city": "Paris"} and whole.finish_reason == "stop"
        tok = harmony_vocabulary()  # the answer came in its channel, as the model opened it
        assert whole.model_extra["token_ids"][:3] == tok.encode("<|channel|>final<|message|>").ids
        chunks = list(api.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=30, temperature=0,
                                                  response_format=schema, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
        text_format = {"type": "json_schema", "name": "city", "schema": schema["json_schema"]["schema"]}
        answer = api.responses.create(model="gpt-oss", input=ASK[0]["content"], max_output_tokens=30, temperature=0,
                                      text={"format": text_format})
        assert json.loads(answer.output_text) == {"city": "Paris"}
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=5,
                                        extra_body={"guided_json": "{not json"})
        assert caught.value.body["param"] == "guided_json"


@pytest.mark.parametrize("kind", ["answer", "thought"])
def test_ridge_chat_prints_the_thinking_apart(chained, kind, capsys, monkeypatch):
    """`ridge chat` on a harmony model: the answer alone on stdout (and in the history), the thinking on stderr."""
    from ridge.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    assert main(["chat", "--model", str(chained[kind]), "--dtype", "float32", "--kv-cache-memory", "16MiB",
                 "--temperature", "0", "--max-tokens", "20"]) == 0
    out, err = capsys.readouterr()
    assert out.replace(">", "").strip() == ("Hello there" if kind == "answer" else "")  # input()'s prompts aside
    assert ("Hello there" in err) == (kind == "thought") and "analysis" not in out + err
