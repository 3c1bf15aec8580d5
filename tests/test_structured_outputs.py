"""Structured outputs: a JSON schema, any JSON object, a regex, a choice and a grammar constrain what the engine
generates (llguidance's masks), offline and through the server's OpenAI fields; bad constraints are refused by
name before anything runs, and the mask never removes a token the grammar allows."""

from __future__ import annotations

import json
import re

import pytest

from conftest import CHAT_PROMPTS
from ridge import SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test dependency: `make test` installs it")

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
                                                                           "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                 "minItems": 1, "maxItems": 3}},
     "required": ["colors"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "population": {"type": "number", "exclusiveMinimum": 0}},
        "required": ["name", "population"], "additionalProperties": False}, "capital": {"type": "boolean"}},
     "required": ["city", "capital"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
]
QUESTIONS = ["Describe a person.", "Pick some colors.", "Tell me about a city.", "List a few numbers."]


def greedy(max_tokens: int, **constraint) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint) if constraint else None)


@pytest.fixture(scope="module")
def qwen(make_llm, qwen_path):
    return make_llm(qwen_path)


def test_constraint_fields_are_checked():
    with pytest.raises(ValueError, match="set exactly one of .*; got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs.choice: must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="min_tokens: not supported with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))


def test_json_schemas_are_followed_in_a_batch(qwen):
    prompts = [qwen.render_chat([{"role": "user", "content": f"{q} Reply in JSON."}]) for q in QUESTIONS]
    for sampled in (False, True):  # greedy, and sampled with seeds
        params = [SamplingParams(temperature=0.8 if sampled else 0, seed=i if sampled else None, max_tokens=128,
                                 structured_outputs=StructuredOutputsParams(json=schema))
                  for i, schema in enumerate(SCHEMAS)]
        for schema, out in zip(SCHEMAS, qwen.generate(prompts, params), strict=True):
            completion = out.outputs[0]
            assert completion.finish_reason == "stop", completion.text  # the grammar ended it, not the length
            jsonschema.validate(json.loads(completion.text), schema)


def test_json_object_choice_and_regex(qwen):
    prompt = qwen.render_chat([{"role": "user", "content": CHAT_PROMPTS[0]}])
    (out,) = qwen.generate(prompt, greedy(64, json_object=True))
    assert isinstance(json.loads(out.outputs[0].text), dict)
    choices = ["Paris", "London", "Berlin"]
    (out,) = qwen.generate(prompt, greedy(16, choice=choices))
    assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop"
    pattern = r"[A-Z][a-z]+, [0-9]{4}"
    (out,) = qwen.generate(prompt, greedy(24, regex=pattern))
    assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]+/'
    (out,) = qwen.generate(qwen.render_chat([{"role": "user", "content": "What is 12 times 12?"}]),
                           greedy(24, grammar=grammar))
    assert re.fullmatch(r"The answer is [0-9]+\.", out.outputs[0].text), out.outputs[0].text
    gbnf = 'root ::= "yes" | "no"'
    (out,) = qwen.generate(prompt, greedy(8, grammar=gbnf))
    assert out.outputs[0].text in ("yes", "no")


def test_the_mask_keeps_every_token_the_grammar_allows(qwen):
    """A grammar that the unconstrained greedy output satisfies (whole, or as a prefix when it ran out of tokens)
    leaves that output unchanged, token for token, its end-of-turn token included."""
    for question in CHAT_PROMPTS[:4]:
        prompt = qwen.render_chat([{"role": "user", "content": question}])
        (plain,) = qwen.generate(prompt, SamplingParams(temperature=0, max_tokens=24))
        completion = plain.outputs[0]
        pattern = re.escape(completion.text) + (r"(?s:.*)" if completion.finish_reason == "length" else "")
        (constrained,) = qwen.generate(prompt, greedy(24, regex=pattern))
        assert constrained.outputs[0].token_ids == completion.token_ids
        assert constrained.outputs[0].finish_reason == completion.finish_reason


@pytest.mark.parametrize("constraint,message", [
    ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "structured_outputs.json: "),
    ({"regex": "(unclosed"}, "structured_outputs.regex: "),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar: "),
    ({"grammar": "root ::= (unclosed"}, "structured_outputs.grammar: "),
])
def test_bad_constraints_are_refused_before_anything_runs(qwen, constraint, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        qwen.generate("Hello", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**constraint)))
    (out,) = qwen.generate("Hello", SamplingParams(temperature=0, max_tokens=4))  # the engine serves on
    assert len(out.outputs[0].token_ids) == 4


def test_a_refused_token_ends_only_its_own_sequence():
    """Where llguidance refuses a token its own mask allowed, that sequence ends ("error", in the log; a server
    answers 500 saying so), and the step is not failed for the others."""
    from ridge.engine.scheduler import StopRule
    from ridge.engine.sequence import Sequence
    from ridge.engine.structured import Grammar

    class Refusing:
        def consume_token(self, token: int) -> bool:
            return False

        def get_error(self) -> str:
            return "refused\ndetails"

        def is_stopped(self) -> bool:
            return False

    grammar = Grammar(Refusing())
    seq = Sequence(seq_id=0, request_id="r", index=0, prompt_len=1, token_ids=[1, 5],
                   params=SamplingParams(max_tokens=8), grammar=grammar)
    grammar.accept([5])
    assert grammar.failed and StopRule(frozenset({2})).check(seq, 5) == ("error", None)


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}


def structural_tag(*structures: tuple[str, dict, str], triggers: tuple[str, ...] = ("<tool_call>",)) -> str:
    return json.dumps({"structures": [{"begin": b, "schema": s, "end": e} for b, s, e in structures],
                       "triggers": list(triggers)})


def test_a_structural_tag_holds_what_follows_each_trigger(qwen):
    """vLLM's structural tag: text is free until a trigger, which opens only one of its structures (begin, JSON of
    the schema, end), Qwen's added tokens `<tool_call>` and `</tool_call>` among their strings. Qwen asked for the
    weather with a tool in its prompt calls it in the tag's form."""
    from ridge.engine.structured import GrammarCompiler

    begin, end = '<tool_call>\n{"name": "get_weather", "arguments": ', "}\n</tool_call>"
    tag = structural_tag((begin, WEATHER, end))
    compiler = GrammarCompiler(qwen.tokenizer, qwen.engine.loaded.config.vocab_size)

    def takes(text: str) -> bool:
        grammar = compiler.matcher(StructuredOutputsParams(structural_tag=tag))
        ids = qwen.tokenizer.encode(text, add_special_tokens=False)
        return grammar.valid_prefix(ids) == len(ids)

    assert takes("Let me check. " + begin + '{"city": "Paris"}' + end + " Done.")
    assert takes("No tool needed here.")
    assert not takes("Let me check. " + begin + '{"city": 3}' + end)  # the schema holds after the trigger
    assert not takes('<tool_call>\n{"name": "other"')  # the trigger opens its structures only
    # Qwen-Coder 0.5B calls the tool as bare JSON: a tag triggered there makes its arguments take a unit they lack
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    prompt = qwen.tokenizer.encode_chat([{"role": "user", "content": "What is the weather in Paris?"}], True, tools)
    with_unit = {**WEATHER, "properties": {**WEATHER["properties"], "unit": {"enum": ["celsius", "fahrenheit"]}},
                 "required": ["city", "unit"]}
    call = '{"name": "get_weather", "arguments": '
    (plain,) = qwen.generate(prompt, greedy(48))
    assert plain.outputs[0].text.startswith(call) and '"unit"' not in plain.outputs[0].text, plain.outputs[0].text
    (out,) = qwen.generate(prompt, greedy(48, structural_tag=structural_tag((call, with_unit, "}"),
                                                                             triggers=('{"name": ',))))
    text = out.outputs[0].text
    arguments = json.loads(text[text.index(call) + len(call):text.rindex("}")])
    jsonschema.validate(arguments, with_unit)


@pytest.mark.parametrize("tag,message", [
    ('{"format": {"type": "triggered_tags"}}', "needs vLLM's form"),
    (structural_tag(("<fn>", WEATHER, "</fn>")), "structures[0].begin: '<fn>' starts with none of the triggers"),
    (json.dumps({"structures": [{"begin": "<tool_call>", "end": "</tool_call>"}], "triggers": ["<tool_call>"]}),
     "structures[0]: needs begin, schema and end"),
])
def test_bad_structural_tags_are_refused_by_name(qwen, tag, message):
    with pytest.raises(ValueError, match=re.escape(f"structured_outputs.structural_tag: {message}")):
        qwen.generate("Hello", greedy(4, structural_tag=tag))
