"""Tool calling through the OpenAI API on Qwen2.5-Coder-0.5B (Hermes' <tool_call> format; Qwen3-Coder's
<function=...> form parsed too): tools rendered by the
chat template, calls parsed into message.tool_calls, tool_choice "required" and a named function enforced by a
grammar over the calls, the tool's reply fed back, streams that reassemble to the whole answer. On the same server:
the chat request's other rendering options (continue_final_message, a request's own template and its variables)
and fill-in-the-middle completions (`suffix`), which Qwen2.5-Coder's tokens make possible."""

from __future__ import annotations

import contextlib
import json
import logging

import openai
import pytest
import torch

from conftest import HTTP, running_server
from ridge.config import EngineConfig
from ridge.serve.app import ServerConfig
from ridge.serve.tools import parse_reply

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test dependency: `make test` installs it")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"],
                   "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def server(qwen_path):
    with running_server(EngineConfig(model=str(qwen_path), kv_cache_memory="256MiB"),
                        ServerConfig("qwen", trust_request_chat_template=True)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def arguments(call, tool: dict) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_tools_need_a_template_that_renders_them_in_a_format_ridge_parses():
    from ridge.serve.tools import supports_tools

    hermes = "{% for tool in tools %}{{ tool | tojson }}{% endfor %} reply in <tool_call></tool_call>"
    unknown_format = "{% if tools %}<|START_ACTION|> {{ tools | tojson }}{% endif %}"  # Command R's
    assert supports_tools(hermes) and supports_tools(hermes, "hermes")
    assert not supports_tools(unknown_format) and supports_tools(unknown_format, "hermes")  # the operator says so
    for blind in (None, "", "{{ messages }} <tool_call>"):  # no template, or one that never shows the tools
        assert not supports_tools(blind, "hermes")


def test_parse_reply_finds_calls_and_keeps_the_rest():
    reply = parse_reply('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
                        '<tool_call>{"name": "g", "arguments": {}}</tool_call><tool_call>not json</tool_call>')
    assert [c["function"]["name"] for c in reply.tool_calls] == ["f", "g"]
    assert json.loads(reply.tool_calls[0]["function"]["arguments"]) == {"a": 1}
    assert reply.content == "Let me check.\n\n<tool_call>not json</tool_call>"
    assert parse_reply("no calls").tool_calls == []


XML_TEMPLATE = ("{% for tool in tools %}{{ tool | tojson }}{% endfor %} reply in <tool_call>\n<function=NAME>\n"
                "<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>")
BOOKING = {"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
    "note": {"type": "string"}, "seats": {"type": "integer"}, "window": {"type": "boolean"},
    "stops": {"type": "array"}, "fare": {"type": ["number", "null"]}}}}}


def test_qwen3_coder_calls_are_read_as_their_parameters_type_them():
    """Qwen3-Coder's form (Qwen3.5's, Qwen3-Next's templates): the template shows it; each parameter's text is a
    string where its schema says so (kept whole across lines), else JSON; a block that is not a call stays content;
    fed in pieces, the stream parses the same calls."""
    from ridge.serve.tools import CallStream, call_format

    assert call_format(XML_TEMPLATE) == "qwen3_coder" and call_format(XML_TEMPLATE, "hermes") == "hermes"
    assert call_format("{% for tool in tools %}{{ tool }}{% endfor %}", "qwen3_coder") == "qwen3_coder"
    text = ("I will book it.\n<tool_call>\n<function=book>\n<parameter=note>\nAisle, please\n42\n</parameter>\n"
            "<parameter=seats>\n2\n</parameter>\n<parameter=window>\ntrue\n</parameter>\n<parameter=stops>\n"
            '["Lyon", "Dijon"]\n</parameter>\n<parameter=fare>\nnull\n</parameter>\n<parameter=extra>\n7\n'
            "</parameter>\n</function>\n</tool_call>\n<tool_call>no function</tool_call>")
    reply = parse_reply(text, "qwen3_coder", [BOOKING])
    (call,) = reply.tool_calls
    assert call["function"]["name"] == "book" and json.loads(call["function"]["arguments"]) == {
        "note": "Aisle, please\n42", "seats": 2, "window": True, "stops": ["Lyon", "Dijon"], "fare": None,
        "extra": "7"}  # a parameter the schema does not know: its text
    assert reply.content == "I will book it.\n\n<tool_call>no function</tool_call>"
    stream = CallStream("qwen3_coder", [BOOKING])
    pieces = [stream.feed(text[i:i + 7], i + 7 >= len(text)) for i in range(0, len(text), 7)]
    assert "".join(c for c, _ in pieces) == reply.content
    assert [json.loads(c["function"]["arguments"]) for _, calls in pieces for c in calls] == [
        json.loads(call["function"]["arguments"])]


def test_glm_and_minimax_calls_are_read_as_their_parameters_type_them():
    """GLM-4.5's form (the function's name, then an <arg_key> / <arg_value> pair per argument), GLM-4.7's (the
    same without newlines) and MiniMax-M2's (<invoke> blocks of <parameter name=...>): the template shows which;
    values typed as Qwen3-Coder's are; a block that is not calls (text after the pairs, inside an invoke) stays
    content."""
    from ridge.serve.tools import call_format

    glm45 = "{% for t in tools %}{{ t }}{% endfor %}<tool_call>{{ name }}\n<arg_key>{{ k }}</arg_key>\n<arg_value>"
    assert call_format(glm45) == "glm45" and call_format(glm45.replace("</arg_key>\n", "</arg_key>")) == "glm47"
    assert call_format("{{ tools }}<minimax:tool_call>\n<invoke name=") == "minimax_m2"
    not_a_calls = {"glm45": "<tool_call>book<arg_key>a</arg_key><arg_value>1</arg_value>x</tool_call>",
                   "minimax_m2": '<minimax:tool_call><invoke name="book">x</invoke></minimax:tool_call>'}
    expected = {"glm45": {"fare": None, "unit": "celsius", "route": {"city": "Lyon", "then": None}},
                "glm47": {"window": True},
                "minimax_m2": {"fare": None, "unit": "celsius", "route": {"city": "Lyon", "then": None}}}
    for form, extra in expected.items():
        not_a_call = not_a_calls.get(form, not_a_calls["glm45"])
        reply = parse_reply(f"Booking.\n{CALLS[form][0]}{not_a_call}", form, [TRIP])
        (call,) = reply.tool_calls
        assert call["function"]["name"] == "book" and reply.content == f"Booking.\n{not_a_call}"
        assert json.loads(call["function"]["arguments"]) == {"note": "Aisle\nplease", "seats": 2, **extra}


def test_seed_oss_calls_are_qwen3_coder_s_in_its_own_tags():
    """Seed-OSS's form: the template shows its <seed:tool_call> tags; a block holds one call or several in
    Qwen3-Coder's form, each value inside its parameter's tags, typed as its schema says; a block that is not only
    calls stays content; fed in pieces, the stream parses the same calls."""
    from ridge.serve.tools import CallStream, call_format

    assert call_format("{{ tools }}<seed:tool_call>\n<function=") == "seed_oss"
    time = "<function=get_time>\n<parameter=timezone>UTC</parameter>\n</function>"
    text = (f"Booking.\n{CALLS['seed_oss'][0].replace('</function>', '</function>' + chr(10) + time)}"
            f"<seed:tool_call>{time}text</seed:tool_call>")
    reply = parse_reply(text, "seed_oss", [TRIP, TIME])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls] == [
        ("book", {"note": "Aisle\nplease", "seats": 2, "fare": None, "unit": "celsius",
                  "route": {"city": "Lyon", "then": None}}), ("get_time", {"timezone": "UTC"})]
    assert reply.content == f"Booking.\n<seed:tool_call>{time}text</seed:tool_call>"
    stream = CallStream("seed_oss", [TRIP, TIME])
    pieces = [stream.feed(text[i:i + 5], i + 5 >= len(text)) for i in range(0, len(text), 5)]
    assert "".join(c for c, _ in pieces) == reply.content
    assert [c for _, calls in pieces for c in calls] == [
        {**c, "id": got["id"]} for c, got in zip(reply.tool_calls, [c for _, cs in pieces for c in cs], strict=True)]


@pytest.mark.parametrize("reply,calls,content", [
    ('{"name": "book", "parameters": {"seats": 2}}', [("book", {"seats": 2})], None),
    ('<|python_tag|>{"name": "book", "arguments": {}}; {"name": "get_time", "parameters": {"zone": "UTC"}}',
     [("book", {}), ("get_time", {"zone": "UTC"})], None),
    ('  {"answer": 42}', [], '{"answer": 42}'),  # JSON, but not a call: content
    ('Let me check: {"name": "book", "parameters": {}}', [], 'Let me check: {"name": "book", "parameters": {}}'),
])
def test_llama3_json_calls_are_the_whole_reply(reply, calls, content):
    """Llama 3's calls: the reply is a call's JSON (after <|python_tag|> where the model writes one), "; " between
    several; a reply that begins as text, or JSON that is not a call, is content; streamed, the same."""
    from ridge.serve.tools import CallStream, call_format

    llama = "<|start_header_id|>system<|end_header_id|>{{ tools }} Respond in the format {\"name\": function name, " \
            "\"parameters\": dictionary of argument name and its value}"
    assert call_format(llama) == "llama3_json"
    parsed = parse_reply(reply, "llama3_json")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == calls
    assert parsed.content == content
    stream = CallStream("llama3_json")
    pieces = [stream.feed(reply[i:i + 4], i + 4 >= len(reply)) for i in range(0, len(reply), 4)]
    assert ("".join(c for c, _ in pieces) or None) == content and sum(len(c) for _, c in pieces) == len(calls)


@pytest.mark.parametrize("reply,calls,content", [
    ('[TOOL_CALLS][{"name": "book", "arguments": {"seats": 2}}, {"name": "get_time", "arguments": {}}]',
     [("book", {"seats": 2}), ("get_time", {})], None),
    ('Sure.[TOOL_CALLS]book[ARGS]{"seats": 2}[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}',
     [("book", {"seats": 2}), ("get_time", {"zone": "UTC"})], "Sure."),
    ("[TOOL_CALLS]book[ARGS]not json", [], "[TOOL_CALLS]book[ARGS]not json"),
])
def test_mistral_calls_run_from_their_tag_to_the_reply_s_end(reply, calls, content):
    """Mistral's calls: [TOOL_CALLS] then a JSON list of calls, or (its v11 tokenizers) each call's name, [ARGS] and
    its arguments, to the reply's end; text before the tag is content; what does not parse stays content."""
    from ridge.serve.tools import CallStream, call_format

    assert call_format("{{ tools }}[AVAILABLE_TOOLS][TOOL_CALLS]") == "mistral"
    parsed = parse_reply(reply, "mistral")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == calls
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in parsed.tool_calls)  # what its templates accept
    assert parsed.content == content
    stream = CallStream("mistral")
    pieces = [stream.feed(reply[i:i + 5], i + 5 >= len(reply)) for i in range(0, len(reply), 5)]
    assert ("".join(c for c, _ in pieces) or None) == content and sum(len(c) for _, c in pieces) == len(calls)


def test_pythonic_calls_are_read_as_python_literals_and_nothing_runs():
    """LFM2's form: a Python list of calls between its tags, several in one block, each keyword's value a literal
    (True, None, tuples and nested lists to JSON's forms); a block with a name, a positional argument or an
    expression that is not a literal stays content (literal_eval runs nothing); streamed in pieces, the same."""
    from ridge.serve.tools import PYTHONIC_OPEN, PYTHONIC_TOOL_LIST, CallStream, call_format

    assert call_format("{{ tools }}" + PYTHONIC_TOOL_LIST) == "pythonic"
    text = (f"Checking.{PYTHONIC_OPEN}[get_weather(city='Paris', days=(1, 2), alert=True), get_time(zone=None, "
            f"opts={{'a': [1.5]}})]<|tool_call_end|> {PYTHONIC_OPEN}[f(x=__import__('os'))]<|tool_call_end|>"
            f"{PYTHONIC_OPEN}[g(1)]<|tool_call_end|>{PYTHONIC_OPEN}not python(<|tool_call_end|>")
    reply = parse_reply(text, "pythonic")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2], "alert": True}), ("get_time", {"zone": None, "opts": {
            "a": [1.5]}})]
    assert reply.content == ("Checking. <|tool_call_start|>[f(x=__import__('os'))]<|tool_call_end|>"
                             "<|tool_call_start|>[g(1)]<|tool_call_end|>"
                             "<|tool_call_start|>not python(<|tool_call_end|>")
    stream = CallStream("pythonic")
    pieces = [stream.feed(text[i:i + 5], i + 5 >= len(text)) for i in range(0, len(text), 5)]
    assert "".join(c for c, _ in pieces) == reply.content
    assert [c["function"]["name"] for _, calls in pieces for c in calls] == ["get_weather", "get_time"]


TRIP = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "required": ["note", "seats"], "$defs": {"stop": {"type": "object", "properties": {
        "city": {"type": "string"}, "then": {"anyOf": [{"$ref": "#/$defs/stop"}, {"type": "null"}]}},
        "required": ["city"]}},
    "properties": {"note": {"type": "string", "maxLength": 12}, "seats": {"type": "integer", "minimum": 1},
                   "window": {"type": "boolean"}, "fare": {"type": ["number", "null"]},
                   "unit": {"enum": ["celsius", "fahrenheit"]}, "route": {"$ref": "#/$defs/stop"}}}}}
# a call in each format, and edits of it the grammar must refuse: a bound broken, a required argument left out, a
# value outside its enum, its type or its length
CALLS = {
    "hermes": ('<tool_call>\n{"name": "book", "arguments": {"note": "Aisle", "seats": 2, "route": {"city": "Lyon", '
               '"then": {"city": "Dijon", "then": null}}}}\n</tool_call>',
               [('"seats": 2', '"seats": 0'), ('"seats": 2, ', ""), ('"Aisle"', '"A very long note"'),
                ('"then": null', '"then": 7')]),
    "qwen3_coder": ("<tool_call>\n<function=book>\n<parameter=note>\nAisle\nplease\n</parameter>\n<parameter=seats>\n"
                    "2\n</parameter>\n<parameter=fare>\nnull\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n"
                    '<parameter=route>\n{"city": "Lyon", "then": null}\n</parameter>\n</function>\n</tool_call>',
                    [("seats>\n2", "seats>\n0"), ("<parameter=seats>\n2\n</parameter>\n", ""),
                     ("\ncelsius", "\nkelvin"), ("\ncelsius", '\n"celsius"'), ("Aisle\nplease", "Aisle, a window"),
                     ("fare>\nnull", 'fare>\n"cheap"')]),
    "seed_oss": ("<seed:tool_call>\n<function=book>\n<parameter=note>Aisle\nplease</parameter>\n<parameter=seats>2"
                 "</parameter>\n<parameter=fare>null</parameter>\n<parameter=unit>celsius</parameter>\n"
                 '<parameter=route>{"city": "Lyon", "then": null}</parameter>\n</function>\n</seed:tool_call>',
                 [("seats>2", "seats>0"), ("<parameter=seats>2</parameter>\n", ""), ("celsius", "kelvin"),
                  ("Aisle\nplease", "Aisle, a window"), ("fare>null", 'fare>"cheap"'), ("seats>2", "seats>\n2")]),
    "glm45": ("<tool_call>book\n<arg_key>note</arg_key>\n<arg_value>Aisle\nplease</arg_value>\n"
              "<arg_key>seats</arg_key>\n<arg_value>2</arg_value>\n<arg_key>fare</arg_key>\n<arg_value>null</arg_value>\n<arg_key>unit</arg_key>\n"
              '<arg_value>celsius</arg_value>\n<arg_key>route</arg_key>\n<arg_value>{"city": "Lyon", "then": null}'
              "</arg_value>\n</tool_call>",
              [("seats</arg_key>\n<arg_value>2", "seats</arg_key>\n<arg_value>0"), ("<arg_key>seats</arg_key>\n"
               "<arg_value>2</arg_value>\n", ""), ("celsius", "kelvin"), ("Aisle\nplease", "Aisle, a window"),
               ("<arg_value>null", '<arg_value>"cheap"')]),
    "glm47": ("<tool_call>book<arg_key>note</arg_key><arg_value>Aisle\nplease</arg_value><arg_key>seats</arg_key>"
              "<arg_value>2</arg_value><arg_key>window</arg_key><arg_value>true</arg_value></tool_call>",
              [("<arg_value>2", "<arg_value>0"), ("<arg_key>seats</arg_key><arg_value>2</arg_value>", ""),
               ("<arg_value>true", "<arg_value>True"), ("Aisle\nplease", "Aisle, a window")]),
    "minimax_m2": ('<minimax:tool_call>\n<invoke name="book">\n<parameter name="note">Aisle\nplease</parameter>\n'
                   '<parameter name="seats">2</parameter>\n<parameter name="fare">null</parameter>\n'
                   '<parameter name="unit">celsius</parameter>\n<parameter name="route">{"city": "Lyon", "then": null}'
                   "</parameter>\n</invoke>\n</minimax:tool_call>",
                   [('"seats">2', '"seats">0'), ('<parameter name="seats">2</parameter>\n', ""), ("celsius", "kelvin"),
                    ("Aisle\nplease", "Aisle, a window"), ('"fare">null', '"fare">"cheap"')]),
    "llama3_json": ('{"name": "book", "parameters": {"note": "Aisle", "seats": 2, "route": {"city": "Lyon", "then": '
                    '{"city": "Dijon", "then": null}}}}',
                    [('"seats": 2', '"seats": 0'), ('"seats": 2, ', ""), ('"Aisle"', '"A very long note"'),
                     ('"parameters"', '"arguments"')]),
    "mistral": ('[TOOL_CALLS]book[ARGS]{"note": "Aisle", "seats": 2, "unit": "celsius"}',
                [('"seats": 2', '"seats": 0'), ('"seats": 2, ', ""), ("celsius", "kelvin"), ("[ARGS]", " ")]),
    "pythonic": ('<|tool_call_start|>[book(note="Aisle", seats=2, window=True, fare=None, route={"city": "Lyon", '
                 '"then": {"city": "Dijon", "then": None}})]<|tool_call_end|>',
                 [("seats=2", "seats=0"), ("seats=2, ", ""), ("True", "true"), ("fare=None", "fare=null"),
                  ('"Aisle"', '"A very long note"'), ('"Lyon"', "7")]),
}


@pytest.fixture(scope="module")
def grammar_check(qwen_path):
    """Whether a grammar takes a text whole (its tokens as Qwen2.5's tokenizer makes them; the tags its tokens)."""
    from ridge.engine.structured import GrammarCompiler
    from ridge.tokenizer import RidgeTokenizer

    tokenizer = RidgeTokenizer.from_path(qwen_path)
    compiler = GrammarCompiler(tokenizer, tokenizer.tokenizer.get_vocab_size())

    def follows(spec, text: str) -> bool:
        grammar = compiler.matcher(spec)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return grammar.valid_prefix(ids) == len(ids) and (grammar.accept(ids) or grammar.matcher.is_accepting())

    return follows, tokenizer.tokenizer.token_to_id


@pytest.mark.parametrize("form", list(CALLS))
def test_required_calls_grammar_holds_each_format_to_the_schema(grammar_check, form):
    """The grammar of tool_choice "required" in each call format takes a call the schema allows (through a
    recursive $ref, a nullable number, an enum), parsed back to those arguments, and refuses each spoiled one."""
    from ridge.serve.tool_grammars import call_markers, calls_grammar

    follows, token_id = grammar_check
    text, spoils = CALLS[form]
    spec = calls_grammar([TRIP, TIME], None, parallel=True, form=form, markers=call_markers(form, token_id))
    assert follows(spec, text)
    (call,) = parse_reply(text, form, [TRIP]).tool_calls
    jsonschema.validate(json.loads(call["function"]["arguments"]), TRIP["function"]["parameters"])
    if form in ("pythonic", "minimax_m2"):  # two calls in one block
        another = '<invoke name="get_time">\n<parameter name="timezone">UTC</parameter>\n</invoke>'
        two = text.replace("[book(", '[get_time(timezone="UTC"), book(').replace("</invoke>", f"</invoke>\n{another}")
    else:
        two = text + {"glm47": "", "mistral": "", "llama3_json": "; "}.get(form, "\n") + text
    assert follows(spec, two)
    for was, spoilt in spoils:
        assert text.count(was) == 1, was
        assert not follows(spec, text.replace(was, spoilt)), spoilt
    named = calls_grammar([TRIP, TIME], "get_time", parallel=False, form=form, markers=call_markers(form, token_id))
    assert not follows(named, text)


def test_each_tool_s_definitions_are_its_own(grammar_check):
    """Two tools may define one name differently: a pythonic call's $ref reads its own tool's definition."""
    from ridge.serve.tool_grammars import call_markers, calls_grammar

    def tool(name: str, unit: str) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "$defs": {"unit": {"enum": [unit]}}, "properties": {"u": {"$ref": "#/$defs/unit"}},
            "required": ["u"]}}}

    follows, token_id = grammar_check
    spec = calls_grammar([tool("f", "a"), tool("g", "b")], None, parallel=True, form="pythonic",
                         markers=call_markers("pythonic", token_id))
    assert follows(spec, '<|tool_call_start|>[f(u="a"), g(u="b")]<|tool_call_end|>')
    assert not follows(spec, '<|tool_call_start|>[g(u="a")]<|tool_call_end|>')


@pytest.mark.parametrize("form,schema,field", [
    ("qwen3_coder", {"properties": {"day": {"type": "string", "pattern": "^[0-9]+$"}}}, "properties.day.pattern"),
    ("qwen3_coder", {"anyOf": [{"type": "object"}]}, "anyOf"),
    ("pythonic", {"properties": {"first-name": {"type": "string"}}}, "properties.first-name"),
    ("pythonic", {"properties": {"tags": {"type": "array", "uniqueItems": True}}}, "properties.tags.uniqueItems"),
    ("pythonic", {"properties": {"x": {"$ref": "#/$defs/missing"}}}, "properties.x.$ref"),
])
def test_a_schema_a_format_cannot_hold_to_is_refused_by_name(form, schema, field):
    from ridge.serve.tool_grammars import UnenforceableSchema, calls_grammar

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", **schema}}}
    with pytest.raises(UnenforceableSchema) as caught:
        calls_grammar([TIME, tool], None, parallel=False, form=form)
    assert caught.value.field == f"tools.1.function.parameters.{field}"
    assert calls_grammar([TIME, tool], None, parallel=False, form="hermes").grammar  # JSON holds to all of it


@pytest.fixture(scope="module")
def parser_client(qwen_path):
    """A client of a server under --tool-call-parser `parser`, started when a test asks for that parser: one such
    server at a time, since each holds an engine."""
    current: dict[str, object] = {}
    with contextlib.ExitStack() as servers:

        def client(parser: str) -> openai.OpenAI:
            if current.get("parser") != parser:
                servers.close()  # the previous parser's server
                srv = servers.enter_context(running_server(
                    EngineConfig(model=str(qwen_path), kv_cache_memory="128MiB"),
                    ServerConfig("qwen", tool_call_parser=parser)))
                current.update(parser=parser, client=openai.OpenAI(base_url=srv.url + "/v1", api_key="unused",
                                                                   max_retries=0))
            return current["client"]

        yield client


def test_a_server_reads_qwen3_coder_calls(parser_client):
    """Under --tool-call-parser qwen3_coder, a reply in that form (held to it here by a request's own grammar:
    Qwen2.5 writes Hermes' form; its tags are tokens of their own) comes back as a call, whole or streamed."""
    xml_client = parser_client("qwen3_coder")
    url = str(xml_client.base_url).removesuffix("/").removesuffix("/v1")
    opening, closing = (HTTP.post(url + "/tokenize", json={"prompt": tag}).json()["tokens"] for tag in
                        ("<tool_call>", "</tool_call>"))
    body = json.dumps("\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n"
                      "</parameter>\n</function>\n")
    grammar = f"start: <[{opening[0]}]> {body} <[{closing[0]}]>"  # the tags' own tokens
    kwargs = dict(model="qwen", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=64,
                  extra_body={"structured_outputs": {"grammar": grammar}})
    choice = xml_client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert arguments(choice.message.tool_calls[0], WEATHER) == {"city": "Paris", "unit": "celsius"}
    streamed = [call for chunk in xml_client.chat.completions.create(stream=True, **kwargs)
                for c in chunk.choices for call in c.delta.tool_calls or []]
    assert [json.loads(c.function.arguments) for c in streamed] == [{"city": "Paris", "unit": "celsius"}]
    dated = {"type": "function", "function": {"name": "on", "parameters": {"type": "object", "properties": {
        "day": {"type": "string", "pattern": "^[0-9]{8}$"}}}}}
    with pytest.raises(openai.BadRequestError) as caught:  # a raw-text argument cannot be held to a pattern
        xml_client.chat.completions.create(model="qwen", messages=ASK, tools=[dated], tool_choice="required",
                                           max_tokens=4)
    assert caught.value.body["param"] == "tools.0.function.parameters.properties.day.pattern"


# the layouts that differ in kind: raw-text arguments in blocks (GLM's and MiniMax's alike), Python literals, and JSON
# with no closing tag (Llama 3's alike); every form's grammar is held to its schemas above, without a server
@pytest.mark.parametrize("form", ["qwen3_coder", "pythonic", "mistral"])
def test_required_and_named_calls_in_each_format_follow_the_schemas(parser_client, form):
    """tool_choice "required" and a named function under other parsers than Hermes' (the tests above): the grammar
    writes the calls in the model's own format, and they come back parsed, valid against their tools' schemas."""
    client = parser_client(form)
    out = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                         parallel_tool_calls=False, temperature=0, max_tokens=64)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    arguments(call, WEATHER if call.function.name == "get_weather" else TIME)
    named = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           parallel_tool_calls=False, max_tokens=64)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and arguments(call, WEATHER)["unit"] in ("celsius", "fahrenheit")


def test_required_and_named_calls_follow_the_schemas(client):
    out = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                         parallel_tool_calls=False, temperature=0, max_tokens=96)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    arguments(choice.message.tool_calls[0], WEATHER if choice.message.tool_calls[0].function.name == "get_weather"
              else TIME)
    named = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           parallel_tool_calls=False, max_tokens=96)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and named.choices[0].finish_reason == "tool_calls"
    arguments(call, TIME)


def test_parallel_calls_each_follow_their_schema(client):
    """With parallel calls the model decides how many (this small one keeps going until max_tokens): every
    complete call parses and is valid."""
    out = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                         temperature=0, max_tokens=96)
    calls = out.choices[0].message.tool_calls
    assert calls
    for call in calls:
        arguments(call, WEATHER if call.function.name == "get_weather" else TIME)


def test_auto_parses_what_the_model_chose(client):
    out = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=96)
    choice = out.choices[0]
    if choice.message.tool_calls:  # the model's choice; when it calls, the call is parsed whole
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls[0].function.name == "get_weather"
        json.loads(choice.message.tool_calls[0].function.arguments)
    else:
        assert choice.message.content
    plain = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=16)
    assert plain.choices[0].message.tool_calls is None


def test_the_round_trip_with_a_tool_reply(client):
    first = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=96)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None,
                       "tool_calls": [{"id": call.id, "type": "function",
                                       "function": {"name": call.function.name,
                                                    "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    reply = client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER], temperature=0,
                                           max_tokens=48)
    assert reply.choices[0].message.content or reply.choices[0].message.tool_calls


@pytest.mark.parametrize("choice,messages", [("required", ASK),
                                            ("auto", [{"role": "user", "content": "Say hello in French."}])])
def test_a_stream_reassembles_to_the_whole_answer(client, choice, messages):
    """Content streams as it comes, each call once whole; together they are the non-streamed reply, and so are
    the token ids (return_token_ids) of the chunks, those of the chunks a call holds back included."""
    kwargs = dict(model="qwen", messages=messages, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False,
                  temperature=0, max_tokens=96, extra_body={"return_token_ids": True})
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls, content, finish, roles, token_ids = {}, [], None, [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for delta_choice in chunk.choices:
            delta = delta_choice.delta
            token_ids += delta_choice.model_extra["token_ids"]
            roles.append(delta.role)
            content.append(delta.content or "")
            for call in delta.tool_calls or []:
                calls.setdefault(call.index, {"name": "", "arguments": ""})
                calls[call.index]["name"] += call.function.name or ""
                calls[call.index]["arguments"] += call.function.arguments or ""
            finish = delta_choice.finish_reason or finish
    expected = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls or []]
    assert [calls[i] for i in sorted(calls)] == expected and finish == whole.finish_reason
    assert ("".join(content) or None) == whole.message.content and roles[0] == "assistant"
    assert token_ids == whole.model_extra["token_ids"]
    if choice == "auto":  # a text answer streams in pieces, not whole at the end
        assert whole.message.content and sum(1 for piece in content if piece) > 1


def test_calls_whose_tags_are_control_tokens_reach_the_parser(tmp_path_factory):
    """LFM2's tags are control tokens of its vocabulary, which a reply's text skips by default: with tools offered
    the text keeps them (vLLM's parsers ask the same), or the call would come back as content. A random model with
    such a vocabulary, held to a call by tool_choice "required"; and a reasoning parser's tags (Seed-OSS's) alike,
    a reply held to thinking then an answer by a grammar of those tokens."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from test_models_random import byte_tokenizer

    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens(["<|tool_call_start|>", "<|tool_call_end|>", "<|im_end|>", "<seed:think>",
                                  "</seed:think>"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=tokenizer.token_to_id("<|im_end|>")))
    path = tmp_path_factory.mktemp("control-tags")
    model.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    template = ("{% if tools %}<|tool_list_start|>{{ tools | tojson }}<|tool_list_end|>{% endif %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: ")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|im_end|>"}))
    unit = {"type": "function", "function": {"name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"]}}}
    think = [tokenizer.token_to_id(tag) for tag in ("<seed:think>", "</seed:think>")]
    with running_server(EngineConfig(model=str(path), kv_cache_memory="16MiB"),
                        ServerConfig("random", reasoning_parser="seed_oss")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        choice = client.chat.completions.create(model="random", messages=ASK, tools=[unit], tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=32).choices[0]
        grammar = f'start: <[{think[0]}]> "abc" <[{think[1]}]> "ok"'
        thought = client.chat.completions.create(model="random", messages=ASK, max_tokens=16, extra_body={
            "structured_outputs": {"grammar": grammar}}).choices[0].message
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert json.loads(choice.message.tool_calls[0].function.arguments)["unit"] in ("celsius", "fahrenheit")
    assert (thought.reasoning_content, thought.content) == ("abc", "ok")


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}}}]}, "tools.0.function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
])
def test_bad_tools_get_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="qwen", messages=ASK, max_tokens=4, extra_body=extra)
    assert caught.value.body["param"] == param, caught.value.body


def test_strict_tools_need_a_choice_that_enforces_them(client):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="qwen", messages=ASK, tools=[strict], max_tokens=4)
    assert caught.value.body["param"] == "tools.0.function.strict"
    out = client.chat.completions.create(model="qwen", messages=ASK, tools=[strict], tool_choice="required",
                                         parallel_tool_calls=False, temperature=0, max_tokens=96)
    arguments(out.choices[0].message.tool_calls[0], WEATHER)


def test_continue_final_message_continues_the_assistant_s_text(client, server):
    start = "Soft rain on the"
    messages = [{"role": "user", "content": "Write a haiku about rain."}, {"role": "assistant", "content": start}]
    options = {"continue_final_message": True, "add_generation_prompt": False}
    cont = client.chat.completions.create(model="qwen", messages=messages, max_tokens=8, temperature=0,
                                          extra_body=options)
    assert not cont.choices[0].message.content.lstrip().startswith("Soft rain")  # not a new turn from the top
    opening = HTTP.post(server.url + "/tokenize", json={"messages": messages[:1]}).json()["tokens"]
    prompt = HTTP.post(server.url + "/detokenize", json={"tokens": opening}).json()["prompt"] + start
    continued = HTTP.post(server.url + "/tokenize", json={"messages": messages, **options}).json()["tokens"]
    assert continued == HTTP.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert cont.usage.prompt_tokens == len(continued)


def test_a_request_s_own_template_and_its_variables(client, server):
    template = "{{ greeting }}{% for m in messages %} {{ m.content }}{% endfor %}"
    out = client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "one two"}],
                                         max_tokens=1, extra_body={"chat_template": template,
                                                                   "chat_template_kwargs": {"greeting": "Hola"}})
    expected = HTTP.post(server.url + "/tokenize", json={"prompt": "Hola one two"}).json()["count"]
    assert out.usage.prompt_tokens == expected
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="qwen", messages=ASK, max_tokens=1,
                                       extra_body={"chat_template": "{% for %}"})
    assert caught.value.body["param"] == "chat_template"


def test_suffix_fills_in_the_middle_with_the_model_s_tokens(client, server):
    prefix, suffix = "def fib(n):\n    ", "\n    return fib(n - 1) + fib(n - 2)\n"
    filled = client.completions.create(model="qwen", prompt=prefix, suffix=suffix, max_tokens=16, temperature=0)
    marked = HTTP.post(server.url + "/tokenize",
                       json={"prompt": f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"}).json()["tokens"]
    by_ids = client.completions.create(model="qwen", prompt=marked, max_tokens=16, temperature=0)
    assert filled.choices[0].text == by_ids.choices[0].text and "return" in filled.choices[0].text
    assert filled.usage.prompt_tokens == len(marked)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="qwen", prompt=prefix, suffix=suffix, echo=True, max_tokens=4)
    assert caught.value.body["param"] == "echo"


# ---- OpenAI's Responses API (serve/responses.py): the same requests through /v1/responses ------------------------

def responses_tool(tool: dict) -> dict:
    """A chat tool in the Responses API's flat form."""
    return {"type": "function", **tool["function"]}


def test_responses_give_the_chat_reply_as_output_items(client):
    """Text in, text out: the Response's message is the chat completion's, its usage the same tokens; instructions
    are the system message; a reply cut by max_output_tokens is incomplete."""
    system, question = "Answer in one short sentence.", "Say hello in French."
    chat = client.chat.completions.create(model="qwen", temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": question}])
    got = client.responses.create(model="qwen", instructions=system, temperature=0, max_output_tokens=24,
                                  input=[{"role": "user", "content": [{"type": "input_text", "text": question}]}])
    assert got.object == "response" and got.id.startswith("resp_") and got.model == "qwen"
    assert got.output_text == chat.choices[0].message.content and [o.type for o in got.output] == ["message"]
    assert (got.usage.input_tokens, got.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                 chat.usage.completion_tokens)
    assert got.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    cut = client.responses.create(model="qwen", input=question, temperature=0, max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 2


def test_responses_call_functions_and_read_their_outputs_back(client):
    """A required call comes as a function_call item valid against its schema; the call and its output sent back
    as input items give the chat round trip's reply."""
    tools = [responses_tool(WEATHER)]
    first = client.responses.create(model="qwen", input=ASK[0]["content"], tools=tools, tool_choice="required",
                                    parallel_tool_calls=False, temperature=0, max_output_tokens=96)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    weather = json.dumps({"temperature": 18, "sky": "clear"})
    reply = client.responses.create(model="qwen", tools=tools, temperature=0, max_output_tokens=48, input=[
        *ASK, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": weather}])
    chat = client.chat.completions.create(model="qwen", tools=[WEATHER], temperature=0, max_tokens=48, messages=[
        *ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": weather}])
    message = chat.choices[0].message
    assert reply.output_text == (message.content or "")
    assert [(o.name, o.arguments) for o in reply.output if o.type == "function_call"] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls or []]


@pytest.mark.parametrize("tool_choice", ["required", "none"])
def test_a_responses_stream_builds_the_same_response(client, tool_choice):
    """The stream's events, in order: created, each item added / its deltas / done, completed; the deltas add up to
    the items, and the completed response is the non-streamed one (but for its ids and the calls' ids)."""
    kwargs = dict(model="qwen", input="What is the weather like in Paris? Answer briefly.",
                  tools=[responses_tool(WEATHER)], tool_choice=tool_choice, parallel_tool_calls=False,
                  temperature=0, max_output_tokens=64)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text and (text != "") == (tool_choice == "none")
    done = [e.item for e in events if e.type == "response.output_item.done"]
    final = events[-1].response
    for items in (done, final.output):
        assert [i.model_dump(exclude={"id", "call_id"}) for i in items] == [
            i.model_dump(exclude={"id", "call_id"}) for i in whole.output]
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize(("extra", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x " * 40000}, "input"),
    ({"tools": [{"type": "function", "name": "f", "strict": True, "parameters": {"type": "object"}}]},
     "tools.0.strict"),
])
def test_responses_refuse_what_they_cannot_do_by_name(client, extra, param):
    body = {"model": "qwen", "input": "Hi", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/responses", body=body, cast_to=object)
    assert caught.value.body["param"] == param, caught.value.body


def test_a_reply_s_reasoning_becomes_a_reasoning_item_before_the_message():
    """Under a reasoning parser (or gpt-oss's channels) the chat reply's reasoning_content: a reasoning item first,
    whole or streamed as reasoning_text deltas, its tokens counted in the usage."""
    import asyncio

    from ridge.serve.responses import ResponseBuilder, ResponsesRequest

    builder = ResponseBuilder(ResponsesRequest(input="Hi"), "m", 0, lambda text: len(text.split()))
    usage = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    whole = builder.from_chat({"choices": [{"finish_reason": "stop", "message": {
        "role": "assistant", "reasoning_content": "one two three", "content": "Hello."}}], "usage": usage})
    assert [(o["type"], o.get("content")) for o in whole["output"]] == [
        ("reasoning", [{"type": "reasoning_text", "text": "one two three"}]),
        ("message", [{"type": "output_text", "text": "Hello.", "annotations": [], "logprobs": []}])]
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": 3} and whole["status"] == "completed"

    def chunk(**delta) -> str:
        return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}) + "\n\n"

    async def events() -> list[dict]:
        chunks = [chunk(role="assistant", reasoning_content="one two"), chunk(reasoning_content=" three"),
                  chunk(content="Hel"), chunk(content="lo."), "data: " + json.dumps({"choices": [], "usage": usage})
                  + "\n\n", "data: [DONE]\n\n"]

        async def feed():
            for c in chunks:
                yield c

        return [json.loads(e.split("data: ", 1)[1]) async for e in builder.events(feed())]

    streamed = asyncio.run(events())
    assert not any("obfuscation" in e for e in streamed)  # padded only where asked (below)
    assert [e["type"] for e in streamed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    final = streamed[-1]["response"]
    strip = [{k: v for k, v in o.items() if k != "id"} for o in final["output"]]
    assert strip == [{k: v for k, v in o.items() if k != "id"} for o in whole["output"]]
    assert final["usage"] == whole["usage"]

    # stream_options.include_obfuscation: every delta event padded with random characters of random length (the
    # padding's lengths differ between events: 20 draws of 1..48 are all equal with odds of 48^-19); others not
    builder = ResponseBuilder(ResponsesRequest(input="Hi", stream_options={"include_obfuscation": True}), "m", 0,
                              lambda text: len(text.split()))  # events() reads it
    streamed = [asyncio.run(events()) for _ in range(5)]
    deltas = [e for run in streamed for e in run if e["type"].endswith(".delta")]
    assert len(deltas) == 20 and all(isinstance(e["obfuscation"], str) for e in deltas)
    assert len({len(e["obfuscation"]) for e in deltas}) > 1
    assert not any("obfuscation" in e for run in streamed for e in run if not e["type"].endswith(".delta"))


def test_responses_labels_are_logged_and_a_day_s_cache_retention_refused(caplog):
    from ridge.serve.responses import ResponsesRequest

    with caplog.at_level(logging.WARNING, logger="ridge"):
        ResponsesRequest.model_validate({"input": "Hi", "user": "u1", "safety_identifier": "s1",
                                         "prompt_cache_key": "tenant-7", "prompt_cache_retention": "in_memory"})
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "user='u1'" in logged and "safety_identifier='s1'" in logged and "prompt_cache_key" not in logged
    with pytest.raises(ValueError, match="prompt_cache_retention"):
        ResponsesRequest.model_validate({"input": "Hi", "prompt_cache_retention": "24h"})
