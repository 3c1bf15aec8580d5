"""Structured outputs through the official `openai` client against a running `ridge serve`: 50 varied prompts and
JSON schemas (nested objects, arrays, enums, bounded numbers, required fields), half streamed, each reply parsed
and validated with jsonschema; JSON mode (`json_object`), `guided_choice` and a regex on the same prompts; and,
with `--langchain` / `--litellm`, the same schemas through those clients when they are installed.

    ridge serve --model qwen2.5-coder-0.5b --port 8000 &
    python scripts/structured-check.py --url http://127.0.0.1:8000 [--langchain] [--litellm]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

SUBJECTS = ["a person", "a city", "a book", "a recipe", "a car", "a planet", "a company", "a song", "a movie",
            "a dog", "a laptop", "a football team", "a mountain", "a river", "a programming language"]
FIELDS = {
    "name": {"type": "string", "maxLength": 40},
    "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
    "rating": {"type": "number", "minimum": 0, "maximum": 5},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 4},
    "kind": {"enum": ["small", "medium", "large"]},
    "active": {"type": "boolean"},
    "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10_000},
    "origin": {"type": "object", "properties": {"country": {"type": "string", "maxLength": 30},
                                                "population": {"type": "integer", "minimum": 0}},
               "required": ["country"], "additionalProperties": False},
    "scores": {"type": "array", "items": {"type": "number", "minimum": -1, "maximum": 1}, "maxItems": 3},
}


def schemas(count: int, seed: int = 0) -> list[tuple[str, dict]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        names = rng.sample(sorted(FIELDS), rng.randint(2, 5))
        required = [n for n in names if rng.random() < 0.7] or names[:1]
        schema = {"type": "object", "properties": {n: FIELDS[n] for n in names}, "required": required,
                  "additionalProperties": False}
        if i % 5 == 4:  # an array of such objects
            schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 3}
        subject = SUBJECTS[i % len(SUBJECTS)]
        out.append((f"Describe {subject} as JSON with the fields {', '.join(names)}.", schema))
    return out


def ask(client: openai.OpenAI, model: str, prompt: str, stream: bool, **extra) -> str:
    kwargs = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=256, temperature=0.7,
                  seed=1, **extra)
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def check_openai(client: openai.OpenAI, model: str, cases: list[tuple[str, dict]]) -> dict:
    def one(item: tuple[int, tuple[str, dict]]) -> str | None:
        i, (prompt, schema) = item
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        text = ask(client, model, prompt, stream=i % 2 == 1, response_format=fmt)
        try:
            jsonschema.validate(json.loads(text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            return f"case {i}: {type(exc).__name__}: {str(exc)[:120]} in {text[:120]!r}"
        return None

    with ThreadPoolExecutor(16) as pool:
        failures = [f for f in pool.map(one, enumerate(cases)) if f]
    others = []
    for i, (prompt, _) in enumerate(cases[:10]):
        text = ask(client, model, prompt, stream=i % 2 == 0, response_format={"type": "json_object"})
        others.append(isinstance(json.loads(text), dict))
        choice = ask(client, model, prompt, stream=False, extra_body={"guided_choice": ["yes", "no", "maybe"]})
        others.append(choice in ("yes", "no", "maybe"))
        regex = ask(client, model, prompt, stream=True, extra_body={"guided_regex": r"[A-Z][a-z]{2,10} [0-9]{1,3}"})
        others.append(re.fullmatch(r"[A-Z][a-z]{2,10} [0-9]{1,3}", regex) is not None)
    return {"json_schema_valid": len(cases) - len(failures), "json_schema_cases": len(cases),
            "json_object_choice_regex_ok": sum(others), "json_object_choice_regex_cases": len(others),
            "failures": failures}


def check_langchain(url: str, model: str, cases: list[tuple[str, dict]]) -> dict:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=model, base_url=url + "/v1", api_key="unused", temperature=0, max_tokens=256)
    ok = 0
    objects = [case for case in cases if case[1]["type"] == "object"][:10]  # LangChain's schemas are objects
    for i, (prompt, schema) in enumerate(objects):
        method = "json_schema" if i % 2 == 0 else "json_mode"
        titled = {"title": f"S{i}", "description": "the answer", **schema}
        value = llm.with_structured_output(titled, method=method).invoke(
            prompt if method == "json_schema" else prompt + " Reply in JSON.")
        ok += method == "json_mode" or jsonschema.Draft202012Validator(schema).is_valid(value)
    prompt, schema = objects[0]
    chunks = list(llm.with_structured_output({"title": "S", "description": "the answer", **schema},
                                             method="json_schema").stream(prompt))
    streamed_ok = bool(chunks) and jsonschema.Draft202012Validator(schema).is_valid(chunks[-1])
    weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}},
                                                               "required": ["city"]}}}
    reply = llm.bind_tools([weather], tool_choice="required").invoke("What is the weather in Paris?")
    streamed = None
    for chunk in llm.bind_tools([weather], tool_choice="required").stream("What is the weather in Rome?"):
        streamed = chunk if streamed is None else streamed + chunk
    streamed_calls = streamed.tool_calls if streamed is not None else []
    return {"langchain_structured_ok": ok, "langchain_structured_cases": 10,
            "langchain_streamed_structured_ok": streamed_ok,
            "langchain_tool_call": reply.tool_calls[0]["name"] if reply.tool_calls else None,
            "langchain_streamed_tool_call": streamed_calls[0]["name"] if streamed_calls else None}


def check_litellm(url: str, model: str, cases: list[tuple[str, dict]]) -> dict:
    import litellm

    ok = 0
    for i, (prompt, schema) in enumerate(cases[:10]):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        reply = litellm.completion(model=f"hosted_vllm/{model}", api_base=url + "/v1", api_key="unused",
                                   messages=[{"role": "user", "content": prompt}], response_format=fmt,
                                   max_tokens=256, temperature=0)
        ok += jsonschema.Draft202012Validator(schema).is_valid(json.loads(reply.choices[0].message.content))
    return {"litellm_structured_ok": ok, "litellm_structured_cases": 10}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--cases", type=int, default=50)
    parser.add_argument("--langchain", action="store_true")
    parser.add_argument("--litellm", action="store_true")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    cases = schemas(args.cases)
    report = check_openai(client, model, cases)
    if args.langchain:
        report |= check_langchain(args.url, model, cases)
    if args.litellm:
        report |= check_litellm(args.url, model, cases)
    print(json.dumps(report, indent=2))
    return 0 if not report["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
