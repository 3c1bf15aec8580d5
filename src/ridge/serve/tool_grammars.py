"""tool_choice "required" or a named function, enforced: the grammar (llguidance's Lark) of a reply made of calls
only, written in the model's own call format, each call naming a tool and giving arguments its parameters allow.

Hermes' calls are JSON: one JSON schema of the call is the whole grammar (Llama 3's and Mistral's alike).
Qwen3-Coder's form writes each argument in a block of its own (GLM-4.5's as an <arg_key> / <arg_value> pair,
MiniMax-M2's as a <parameter name=...>), a string as raw text up to the block's closing tag and any other value as
JSON, so its arguments are laid out in their schema's order (the required ones always, the others optional): a raw
string is text that cannot close its block early, any other value JSON its schema holds. LFM2's pythonic calls are
Python literals, compiled here from the schema: strings and numbers as JSON writes them (a JSON string or number is
a Python literal of the same value, so llguidance's JSON schema grammar holds them, with their patterns, formats
and bounds), True / False / None, and lists and dicts built around them. A schema keyword such a layout cannot
hold is refused by name (UnenforceableSchema), never dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ridge.sampling_params import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"  # Hermes', Qwen3-Coder's and GLM-4.5's tags
GLM_FORMS = ("glm45", "glm47")  # GLM-4.5's (and 4.6's) calls, and GLM-4.7's: the same without newlines
PYTHONIC_OPEN, PYTHONIC_CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"  # LFM2's
MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"  # MiniMax-M2's
SEED_OPEN, SEED_CLOSE = "<seed:tool_call>", "</seed:tool_call>"  # Seed-OSS's: Qwen3-Coder's calls in its own tags
# Mistral's: its calls run from the tag to the reply's end (a JSON list, or from its v11 tokenizers each call's name,
# [ARGS] and its JSON arguments); Llama 3's: the reply is the call's JSON, after <|python_tag|> where it writes one
MISTRAL_OPEN, MISTRAL_ARGS, PYTHON_TAG = "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"

ANNOTATIONS = frozenset({"title", "description", "examples", "default", "$comment", "$schema", "$id", "deprecated",
                         "readOnly", "writeOnly"})
DEFINITIONS = ("$defs", "definitions")
# what a parameters schema may say at its top for the per-argument layouts: additionalProperties changes nothing
# there, since only the declared arguments are ever written
TOP_LEVEL = ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "strict", *DEFINITIONS}
RAW_STRING = ANNOTATIONS | {"type", "enum", "const", "minLength", "maxLength"}  # what a raw string can hold to


class UnenforceableSchema(ValueError):
    """A tool's schema says what the call format's grammar cannot hold to; `field` names where."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def tags(form: str) -> tuple[str, str]:
    """The tags around a form's block of calls ("" where the block runs to the reply's end)."""
    return {"pythonic": (PYTHONIC_OPEN, PYTHONIC_CLOSE), "minimax_m2": (MINIMAX_OPEN, MINIMAX_CLOSE),
            "seed_oss": (SEED_OPEN, SEED_CLOSE),
            "mistral": (MISTRAL_OPEN, ""), "llama3_json": (PYTHON_TAG, "")}.get(form, (OPEN, CLOSE))


def call_markers(form: str, token_id: Callable[[str], int | None]) -> dict[str, str]:
    """The grammar's terms for the form's tags that are tokens of the vocabulary (Qwen's, LFM2's, Mistral's): the
    tokens themselves, since llguidance allows such a token where its text is expected but will not consume it as
    text. A tag missing here is written as its text."""
    return {tag: f"<[{i}]>" for tag in (*tags(form), MISTRAL_ARGS) if tag and (i := token_id(tag)) is not None}


def are_control_tokens(texts: tuple[str, ...], token_id: Callable[[str], int | None],
                       decode: Callable[[list[int]], str]) -> bool:
    """Whether the vocabulary holds any of `texts` (a call format's tags: LFM2's, MiniMax-M2's, GLM's; a reasoning
    parser's) as control tokens, which decoding that skips special tokens drops: a reply's text must then keep them,
    or what they mark is lost as text."""
    ids = [token_id(text) for text in texts if text]
    return any(i is not None and decode([i]) == "" for i in ids)


def raw_string(schema: Any) -> bool:
    """Whether Qwen3-Coder's form writes a parameter's value as raw text (a string); else it is JSON."""
    if not isinstance(schema, dict):
        return True
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "string" in kinds:
        return True
    choices = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    return kinds == [None] and bool(choices) and all(isinstance(c, str) for c in choices)


def calls_grammar(tools: list[dict[str, Any]], only: str | None, parallel: bool, form: str = "hermes",
                  markers: dict[str, str] | None = None) -> StructuredOutputsParams:
    """The grammar of a reply made of calls only (tool_choice "required", or `only` that function) in `form`
    (serve/tools.py's call_format): one call, or with parallel calls several. `markers`: the tags' grammar terms
    (call_markers'). UnenforceableSchema where a tool's parameters say what the form cannot hold to."""
    chosen = [(f"tools.{i}.function", t["function"]) for i, t in enumerate(tools)
              if only is None or t["function"]["name"] == only]

    def term(tag: str) -> str:
        return (markers or {}).get(tag, _lit(tag))

    opening, closing = (term(tag) for tag in tags(form))
    grammar = _Grammar()
    if form == "llama3_json":  # the reply is the calls' JSON, "; " between them
        calls = " | ".join(_json_call(function, "parameters") for _, function in chosen)
        grammar.rules["call"] = calls
        start = f"call ({_lit('; ')} call)*" if parallel else "call"
    elif form == "mistral":  # a JSON list of calls, or (v11 tokenizers) each call's name, [ARGS] and its arguments
        choices = [_call_schema(f, "arguments") for _, f in chosen]
        listed = {"type": "array", "items": {"anyOf": choices}, "minItems": 1, **({} if parallel else {"maxItems": 1}),
                  **_shared_definitions([(field, f) for field, f in chosen])}
        named = " | ".join(f"{_lit(f['name'])} {term(MISTRAL_ARGS)} {_json_schema_term(f.get('parameters'))}"
                           for _, f in chosen)
        more = f" ({opening} ({named}))*" if parallel else ""
        grammar.rules["call"] = f"{opening} (%json {json.dumps(listed)} | ({named}){more})"
        start = "call"
    elif form == "pythonic":
        calls = " | ".join(grammar.pythonic_call(function, field) for field, function in chosen)
        listed = f'"[" ({calls}) (", " ({calls}))* "]"' if parallel else f'"[" ({calls}) "]"'
        grammar.rules["call"] = f"{opening} {listed} {closing}"
        start = "call"
    elif form == "minimax_m2":  # several calls are <invoke> blocks in one block of calls
        calls = " | ".join(grammar.minimax_call(function, field) for field, function in chosen)
        more = f" ({_lit(chr(10))} ({calls}))*" if parallel else ""
        grammar.rules["call"] = f"{opening} {_lit(chr(10))} ({calls}){more} {_lit(chr(10))} {closing}"
        start = "call"
    elif form in GLM_FORMS:
        newline = "\n" if form == "glm45" else ""
        calls = " | ".join(grammar.glm_call(function, field, newline) for field, function in chosen)
        grammar.rules["call"] = f"{opening} ({calls}) {closing}"
        start = f"call ({_lit(newline)} call)*" if parallel and newline else "call call*" if parallel else "call"
    else:
        calls = " | ".join(grammar.xml_call(function, field, value_lines=form == "qwen3_coder")
                           if form in ("qwen3_coder", "seed_oss") else _hermes_call(function)
                           for field, function in chosen)
        grammar.rules["call"] = f"{opening} {_lit(chr(10))} ({calls}) {_lit(chr(10))} {closing}"
        start = f"call ({_lit(chr(10))} call)*" if parallel else "call"
    return StructuredOutputsParams(grammar=grammar.text(start))


def _hermes_call(function: dict[str, Any]) -> str:
    return _json_call(function, "arguments")


def _json_call(function: dict[str, Any], arguments: str) -> str:
    return f"%json {json.dumps(_call_schema(function, arguments))}"


def _call_schema(function: dict[str, Any], arguments: str) -> dict[str, Any]:
    """The call as one JSON schema, its arguments under `arguments` ("parameters" in Llama 3's calls); the
    parameters' definitions lifted to its root, where their $refs ("#/$defs/...") point once the parameters sit
    under that key."""
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, arguments: parameters},
            "required": ["name", arguments], "additionalProperties": False,
            **{key: parameters[key] for key in DEFINITIONS if key in parameters}}


def _shared_definitions(chosen: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The tools' parameters' definitions at the root of a schema that holds several calls (a list of them), where
    their $refs point; two tools defining one name differently cannot share that root."""
    shared: dict[str, dict[str, Any]] = {}
    for field, function in chosen:
        parameters = function.get("parameters") or {}
        for key in DEFINITIONS:
            for name, definition in (parameters.get(key) or {}).items():
                if shared.setdefault(key, {}).setdefault(name, definition) != definition:
                    raise UnenforceableSchema("defined differently by another tool, in a grammar holding both",
                                              f"{field}.parameters.{key}.{name}")
    return shared


def _json_schema_term(parameters: dict[str, Any] | None) -> str:
    return f"%json {json.dumps(parameters or {'type': 'object'})}"


class _Grammar:
    """Lark rules made as a request's tools are compiled; text() is the grammar."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}
        # a $ref's rule by its tool's parameters and the ref, made once (so a recursive schema is a recursive rule)
        self._refs: dict[tuple[int, str], str] = {}
        self._root: dict[str, Any] = {}  # the parameters schema being compiled: its $refs resolve there

    def text(self, start: str) -> str:
        return "\n".join([f"start: {start}", *(f"{name}: {body}" for name, body in self.rules.items())])

    def _rule(self, body: str, stem: str = "r") -> str:
        name = f"{stem}{len(self.rules)}"
        self.rules[name] = body
        return name

    # Qwen3-Coder's form (value_lines: each value on lines of its own), and Seed-OSS's (each value inside its tags)
    def xml_call(self, function: dict[str, Any], field: str, value_lines: bool = True) -> str:
        parameters, field = self._parameters(function, field)
        entries = []
        newline = "\n" if value_lines else ""
        for key, schema, required in _arguments(parameters):
            head = _lit(f"<parameter={key}>{newline}")
            value = self._value(schema, f"{field}.properties.{key}", f"{newline}</parameter>\n")
            entries.append((f"{head} {value}", required))
        name = function["name"]
        return f"{_lit(f'<function={name}>' + chr(10))} {_ordered(entries, None)} {_lit('</function>')}"

    # GLM-4.5's form (GLM-4.7's without the newlines)
    def glm_call(self, function: dict[str, Any], field: str, newline: str) -> str:
        parameters, field = self._parameters(function, field)
        entries = [(f"{_lit(f'<arg_key>{key}</arg_key>{newline}<arg_value>')} "
                    f"{self._value(schema, f'{field}.properties.{key}', '</arg_value>' + newline)}", required)
                   for key, schema, required in _arguments(parameters)]
        return f"{_lit(function['name'] + newline)} {_ordered(entries, None)}"

    # MiniMax-M2's form
    def minimax_call(self, function: dict[str, Any], field: str) -> str:
        parameters, field = self._parameters(function, field)
        entries = [(f"{_lit(f'<parameter name={json.dumps(key)}>')} "
                    f"{self._value(schema, f'{field}.properties.{key}', '</parameter>' + chr(10))}", required)
                   for key, schema, required in _arguments(parameters)]
        head = f'<invoke name={json.dumps(function["name"])}>\n'
        return f"{_lit(head)} {_ordered(entries, None)} {_lit('</invoke>')}"

    def _value(self, schema: Any, field: str, closing: str) -> str:
        """An argument's value and the tag that closes it: raw text where the parser reads it as a string, else
        JSON."""
        if raw_string(schema):
            return self._raw_string(schema, field, closing)
        return f"{self._json(schema)} {_lit(closing)}"

    def _raw_string(self, schema: Any, field: str, closing: str) -> str:
        """A raw string argument and its block's `closing` tag: one of its enum's texts, or text of its length that
        ends at the first closing tag (a lazy rule: llguidance ends it where the suffix appears)."""
        schema = schema if isinstance(schema, dict) else {}
        _refuse_beyond(schema, RAW_STRING, field, "calls in this format write this argument as raw text")
        choices = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
        if choices is not None:
            texts = (c if isinstance(c, str) else json.dumps(c) for c in choices)
            return f"({' | '.join(_lit(text) for text in texts)}) {_lit(closing)}"
        low, high = schema.get("minLength", 0), schema.get("maxLength", "")
        name = f"raw{len(self.rules)}"
        self.rules[f"{name}[suffix={_lit(closing)}]"] = f"/(.|\\n){{{low},{high}}}/"
        return name

    def _json(self, schema: Any) -> str:
        """A value as JSON its schema holds; the parameters' definitions go along, so its $refs resolve."""
        schema = schema if isinstance(schema, dict) else {}
        definitions = {key: self._root[key] for key in DEFINITIONS if key in self._root and key not in schema}
        return f"%json {json.dumps({**schema, **definitions})}"

    def _parameters(self, function: dict[str, Any], field: str) -> tuple[dict[str, Any], str]:
        parameters = function.get("parameters") or {}
        field += ".parameters"
        _refuse_beyond(parameters, TOP_LEVEL, field, "calls in this format are laid out argument by argument")
        if parameters.get("type", "object") != "object":
            raise UnenforceableSchema("arguments are an object", f"{field}.type")
        self._root = parameters
        return parameters, field

    # LFM2's pythonic form
    def pythonic_call(self, function: dict[str, Any], field: str) -> str:
        parameters, field = self._parameters(function, field)
        entries = []
        for key, schema, required in _arguments(parameters):
            if not key.isidentifier():
                raise UnenforceableSchema("not a Python name, so no keyword argument of a pythonic call",
                                          f"{field}.properties.{key}")
            entries.append((f"{_lit(key + '=')} {self._python(schema, f'{field}.properties.{key}')}", required))
        return f"{_lit(function['name'] + '(')} {_ordered(entries, _lit(', '))} {_lit(')')}"

    def _python(self, schema: Any, field: str) -> str:
        """A Python literal its schema holds."""
        if not isinstance(schema, dict) or not set(schema) - ANNOTATIONS:
            return self._any_python()
        if "$ref" in schema:
            _refuse_beyond(schema, ANNOTATIONS | {"$ref"}, field, "a $ref is taken alone")
            return self._ref(schema["$ref"], field)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                _refuse_beyond(schema, ANNOTATIONS | {key}, field, f"{key} is taken alone")
                return "(" + " | ".join(self._python(s, f"{field}.{key}.{i}") for i, s in enumerate(schema[key])) + ")"
        choices = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
        if choices is not None:
            return "(" + " | ".join(_lit(_python_text(c)) for c in choices) + ")"
        kinds = schema.get("type", "object" if "properties" in schema else "array" if "items" in schema else None)
        if isinstance(kinds, list):
            return "(" + " | ".join(self._python({**schema, "type": k}, field) for k in kinds) + ")"
        if kinds in ("string", "number", "integer"):  # JSON writes these as Python does
            return self._json(schema)
        if kinds == "boolean":
            return '("True" | "False")'
        if kinds == "null":
            return '"None"'
        if kinds == "array":
            return self._python_list(schema, field)
        if kinds == "object":
            return self._python_dict(schema, field)
        raise UnenforceableSchema(f"{sorted(set(schema) - ANNOTATIONS)[0]!r} without a type is not held to in "
                                  "pythonic calls", field)

    def _python_list(self, schema: dict[str, Any], field: str) -> str:
        _refuse_beyond(schema, ANNOTATIONS | {"type", "items", "minItems", "maxItems"}, field,
                       "pythonic calls hold lists to items and their count")
        item = self._python(schema.get("items"), f"{field}.items")
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if high == 0:
            return '"[]"'
        more = f'(", " {item}){{{max(low - 1, 0)},{"" if high is None else high - 1}}}'
        return f'"[" ({item} {more}){"" if low else "?"} "]"'

    def _python_dict(self, schema: dict[str, Any], field: str) -> str:
        _refuse_beyond(schema, ANNOTATIONS | {"type", "properties", "required", "additionalProperties"}, field,
                       "pythonic calls hold dicts to their properties")
        if "properties" not in schema:  # any keys, their values as additionalProperties says
            extra = schema.get("additionalProperties")
            value = self._python(extra if isinstance(extra, dict) else None, f"{field}.additionalProperties")
            entry = f"{self._json({'type': 'string'})} {_lit(': ')} {value}"
            return f'"{{" ({entry} (", " {entry})*)? "}}"'
        entries = [(f"{_lit(json.dumps(key) + ': ')} {self._python(value, f'{field}.properties.{key}')}", required)
                   for key, value, required in _arguments(schema)]
        return f'"{{" {_ordered(entries, _lit(", "))} "}}"'

    def _ref(self, ref: str, field: str) -> str:
        key = (id(self._root), ref)  # two tools may define one name differently
        if key not in self._refs:
            parts = ref.split("/")
            target = self._root.get(parts[1]) if len(parts) == 3 and parts[0] == "#" else None
            if not isinstance(target, dict) or not isinstance(target.get(parts[2]), dict):
                raise UnenforceableSchema(f"{ref!r} is not a definition of these parameters", f"{field}.$ref")
            self._refs[key] = name = self._rule("", "ref")  # named first: the definition may refer to itself
            self.rules[name] = self._python(target[parts[2]], f"{field}.$ref")
        return self._refs[key]

    def _any_python(self) -> str:
        if "any_python" not in self.rules:
            self.rules["any_python"] = " | ".join([
                self._json({"type": "string"}), self._json({"type": "number"}), '"True"', '"False"', '"None"',
                '"[" (any_python (", " any_python)*)? "]"',
                f'"{{" ({self._json({"type": "string"})} ": " any_python (", " {self._json({"type": "string"})} ": " '
                'any_python)*)? "}"'])
        return "any_python"


def _arguments(schema: dict[str, Any]) -> list[tuple[str, Any, bool]]:
    """(key, schema, required) in the order a call writes them: the declared properties in their order, then
    required keys they do not declare (whose values may be anything)."""
    properties = schema.get("properties") or {}
    required = schema.get("required") or []
    return ([(key, value, key in required) for key, value in properties.items()]
            + [(key, {}, True) for key in required if key not in properties])


def _ordered(entries: list[tuple[str, bool]], separator: str | None) -> str:
    """The entries in order, the optional ones may be left out, `separator` between those written (None: none).
    Built from the end: `rest` is what may follow entries already written, `first` what opens the list."""
    sep = f"{separator} " if separator else ""
    rest, first = "", ""  # the empty tail
    for body, required in reversed(entries):
        rest_then = f"{sep}{body} {rest}".strip()
        first_then = f"{body} {rest}".strip()
        rest, first = (rest_then, first_then) if required else (
            f"({sep}{body})? {rest}".strip(), f"({first_then} | {first})" if first else f"({first_then})?")
    return first


def _refuse_beyond(schema: dict[str, Any], allowed: frozenset[str] | set[str], field: str, why: str) -> None:
    extra = sorted(set(schema) - set(allowed))
    if extra:
        raise UnenforceableSchema(f"not held to with tool_choice 'required' or a named function ({why}); use "
                                  "tool_choice 'auto'", f"{field}.{extra[0]}")


def _python_text(value: Any) -> str:
    """A JSON value written as a Python literal."""
    if value is True or value is False or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_python_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_python_text(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def _lit(text: str) -> str:
    """A Lark string literal (its escapes are JSON's)."""
    return json.dumps(text, ensure_ascii=False)
