"""OpenAI request bodies (with vLLM's extra sampling fields) and the error every endpoint raises.

Field limits live in SamplingParams; this module only maps names (max_completion_tokens, top_logprobs,
logit_bias keyed by strings) and reports a bad field as a RequestError naming it. Bodies are read
strictly: a bool is not a number, a number not a string, and every string must be valid Unicode (JSON's
escapes can spell a lone surrogate, which no tokenizer can encode).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, StrictInt, StrictStr, model_validator

from ridge.engine.beam_search import BeamSearchParams
from ridge.sampling_params import SamplingParams, StructuredOutputsParams
from ridge.serve.tool_grammars import UnenforceableSchema, calls_grammar
from ridge.tokenizer import ChatOptions

log = logging.getLogger("ridge")


class RequestError(Exception):
    """An error the client caused (or may retry), rendered as OpenAI's envelope with an HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "BadRequestError",  # noqa: A002 - OpenAI's field name
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {exc.start}") from None
    return text


Text = Annotated[StrictStr, AfterValidator(valid_unicode)]


def check_unicode(value: Any, where: str) -> None:
    """Every string inside a free-form value (a message's extra fields) must be valid Unicode."""
    if isinstance(value, str):
        try:
            valid_unicode(value)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, where)
            check_unicode(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode(item, f"{where}.{i}")


class Body(BaseModel):
    """A request body: strict types; unknown fields are ignored (OpenAI's clients send many)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(Body):
    include_usage: bool = False  # the usage in a last chunk of its own
    continuous_usage_stats: bool = False  # vLLM's: and in every chunk, the tokens so far

    @model_validator(mode="after")
    def _usage_asked(self) -> StreamOptions:
        if self.continuous_usage_stats and not self.include_usage:
            raise ValueError("stream_options.continuous_usage_stats: needs include_usage: true (the usage in every "
                             "chunk comes with the usage at the end)")
        return self


def refuse_unsupported(data: Any, table: dict[str, str], harmless: dict[str, tuple[Any, ...]] | None = None) -> None:
    """ValueError naming the first field of `table` (name -> why) a body sets to anything that asks for something;
    harmless[name]: values of it that ask for nothing."""
    if not isinstance(data, dict):
        return
    for name, why in table.items():
        value = data.get(name)
        if asks(value) and value not in (harmless or {}).get(name, ()):
            raise ValueError(f"{name}: {why}")


def log_labels(data: dict[str, Any], names: tuple[str, ...]) -> None:
    """Say in the log which of these label fields a body sets: accepted, nothing to act on."""
    for name in names:
        if asks(data.get(name)):
            log.warning("ridge: request field %s=%r accepted and not acted on (a label)", name, data[name])


def asks(value: Any) -> bool:
    """Whether a field's value asks for something (None, False, 0, "" and empty collections do not)."""
    return value is not None and value is not False and value != 0 and value != "" and value != [] and value != {}


# Fields of OpenAI's or vLLM's request bodies that ridge does not implement: a request that sets one to anything
# that asks for something is refused with a 400 naming it, never answered as if it had not been sent.
# docs/api-fields.md lists every field and ridge's answer.
UNSUPPORTED = {
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "logits_processors": "not supported",
    "mm_processor_kwargs": "this server reads text only",
    "audio": "this server reads and writes text only",
    "prediction": "predicted outputs are not supported",
    "store": "this server stores nothing",
    "web_search_options": "not supported",
}
# Fields one endpoint honours and the other has not: refused by name where the request's body lacks them.
ONE_ENDPOINT = {
    "suffix": "fill-in-the-middle is a completions field (a prompt and its suffix)",
}
# Fields that only label or prioritise a request: accepted, and said in the log when they ask for something.
LABELS = ("user", "metadata", "service_tier", "request_id", "safety_identifier")
# OpenAI's prompt_cache_key, a routing hint (requests that share it share a cache) is not among them: this server's
# prefix cache holds every prompt's blocks whatever the key, and `ridge router` routes by it (cluster/hash_ring.py).


class JsonSchemaFormat(Body):
    name: Text | None = None
    description: Text | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the grammar enforces the schema either way

    @model_validator(mode="after")
    def _unicode(self) -> JsonSchemaFormat:
        check_unicode(self.json_schema, "response_format.json_schema.schema")
        return self


class StructureFormat(Body):
    """One structure of a structural_tag response format (vLLM's): a trigger opens `begin`, JSON of `schema` follows,
    then `end`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    begin: Text
    schema_: dict[str, Any] = Field(alias="schema")
    end: Text


class ResponseFormat(Body):
    """OpenAI's response_format: text (no constraint), any JSON object, or a JSON schema; or vLLM's structural_tag
    (free text whose triggers open structures)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[StructureFormat] | None = None
    triggers: list[Text] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> ResponseFormat:
        """A field of another type's format would be dropped: refused by name."""
        others = {"json_schema": self.json_schema} if self.type != "json_schema" else {}
        if self.type != "structural_tag":
            others.update(structures=self.structures, triggers=self.triggers)
        for name, value in others.items():
            if value is not None:
                raise ValueError(f"response_format.{name}: not a field of a {self.type} response format")
        return self

    def structural_tag(self) -> str:
        """A structural_tag format as StructuredOutputsParams' JSON text (its parts checked when it compiles)."""
        if self.structures is None or self.triggers is None:
            raise RequestError("response_format: a structural_tag format needs structures and triggers",
                               "response_format")
        return json.dumps({"structures": [s.model_dump(by_alias=True) for s in self.structures],
                           "triggers": self.triggers})


class StructuredOutputsField(Body):
    """vLLM's structured_outputs: exactly one constraint, and the options vLLM's StructuredOutputsParams gives it. A
    key it does not know is refused (a 400 naming it), never dropped."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # the fields that are constraints (field names: json's is json_), the rest options that shape them
    CONSTRAINTS: ClassVar[frozenset[str]] = frozenset(
        {"json_", "json_object", "regex", "choice", "grammar", "structural_tag"})

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    whitespace_pattern: Text | None = None  # a JSON constraint's whitespace between tokens (a regex)
    disable_any_whitespace: bool = False  # a JSON constraint with none
    disable_additional_properties: bool = False  # a JSON schema's objects without keys it does not name
    disable_fallback: bool = False  # honoured as it stands: llguidance serves every constraint, with no fallback
    structural_tag: Text | None = None  # vLLM's: the JSON text of {"structures": [...], "triggers": [...]}

    @model_validator(mode="after")
    def _unicode(self) -> StructuredOutputsField:
        check_unicode(self.json_, "structured_outputs.json")
        return self


class KVTransferParams(Body):
    model_config = ConfigDict(extra="forbid", strict=True)

    push_to: Text  # the decode server's base URL


class SamplingFields(Body):
    """The sampling fields shared by completions and chat completions."""

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            # (with no functions, refused when given, function_call none or auto chooses nothing)
            refuse_unsupported(data, UNSUPPORTED, {"function_call": ("none", "auto")})
            for name, why in ONE_ENDPOINT.items():
                if name not in cls.model_fields and asks(data.get(name)):
                    raise ValueError(f"{name}: {why}")
            best_of = data.get("best_of")
            if "best_of" not in cls.model_fields and asks(best_of) and best_of != data.get("n", 1):
                raise ValueError("best_of: only completions rank samples; here, ask for n samples")
            if data.get("modalities") not in (None, ["text"]):
                raise ValueError("modalities: this server reads and writes text only")
            log_labels(data, LABELS)
        return data

    model: Text | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    logit_bias: dict[Text, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: Text | None = None
    priority: int = 0  # vLLM's: lower goes first, on a server started with --schedule-policy priority
    # disaggregated prefill (serve/kv_transfer.py): on a --role prefill server, push the prompt's KV to a decode server
    kv_transfer_params: KVTransferParams | None = None
    prompt_logprobs: int | None = None  # vLLM's: top-n alternatives per prompt token, with the prompt's own
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    allowed_token_ids: list[int] | None = None
    bad_words: list[Text] | None = None
    use_beam_search: bool = False
    beam_width: int | None = None  # default: n, the number of beams returned
    length_penalty: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # what the output must match (one of these at most): OpenAI's response_format, vLLM's structured_outputs,
    # and vLLM's older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    structural_tag: Text | None = None  # vLLM's older field, as structured_outputs.structural_tag
    guided_decoding_backend: Text | None = None
    guided_whitespace_pattern: Text | None = None  # vLLM's: the whitespace a JSON constraint allows between tokens
    # vLLM's: the prompt's last k tokens only (-1: as many as the context holds), cut before anything is checked
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name each token "token_id:<id>", not its text
    # how the model's replies hold a constraint (a harmony reply's: on its final channel), set by the route
    _constraint_form: Callable[[StructuredOutputsParams], StructuredOutputsParams] | None = PrivateAttr(default=None)

    def constrain_as(self, form: Callable[[StructuredOutputsParams], StructuredOutputsParams]) -> None:
        """Hold the request's constraint as form(constraint) does: the route's, for a model whose replies wrap
        their answer (serve/harmony.py)."""
        self._constraint_form = form

    @property
    def num_samples(self) -> int:
        """Samples generated per prompt (best_of draws more than the n returned)."""
        return self.n

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        return last_tokens(ids, self.truncate_prompt_tokens, max_model_len)

    @property
    def structured_field(self) -> str | None:
        """The request field that carries its output constraint (the first, if several do)."""
        given = self._constraints()
        return given[0][0] if given else None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's output constraint, from whichever of its fields names one; RequestError naming the
        fields when several do, or when one is malformed."""
        given = self._constraints()
        if self.guided_decoding_backend not in (None, "auto", "guidance", "llguidance"):
            raise RequestError(f"guided_decoding_backend: {self.guided_decoding_backend!r} is not available; this "
                               "server constrains outputs with llguidance (auto, guidance)", "guided_decoding_backend")
        shaping = self._json_shaping()
        if not given:
            if shaping:
                raise RequestError(f"{shaping[0]}: shapes a JSON constraint, and the request has none", shaping[0])
            return None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise RequestError(f"{given[1][0]}: conflicts with {given[0][0]}; give one output constraint ({names} "
                               "were given)", given[1][0])
        name, fields = given[0]
        if shaping:
            fields = self._shaped_json(name, fields, *shaping)
        try:
            params = StructuredOutputsParams(**fields)
        except ValueError as exc:  # "structured_outputs[.field]: ..." -> the request's own field name
            message = str(exc).replace("structured_outputs", name, 1) if name != "structured_outputs" else str(exc)
            raise RequestError(message, message.split(":")[0]) from exc
        if self._constraint_form is None:
            return params
        try:
            return self._constraint_form(params)
        except ValueError as exc:  # the grammar's error, named as the engine's are (Gateway.admit)
            message = str(exc) if name == "structured_outputs" else f"{name}:{str(exc).split(':', 1)[1]}"
            raise RequestError(message, message.split(":")[0]) from exc

    def _json_shaping(self) -> tuple[str, str | None, bool] | None:
        """(the field that asks, the whitespace pattern, whether objects take no keys their schema does not name)
        where the request shapes its JSON constraint: guided_whitespace_pattern, or structured_outputs'
        whitespace_pattern, disable_any_whitespace (no whitespace) and disable_additional_properties."""
        given = self.structured_outputs
        asked = [(name, value) for name, value in (
            ("guided_whitespace_pattern", self.guided_whitespace_pattern),
            ("structured_outputs.whitespace_pattern", given and given.whitespace_pattern),
            ("structured_outputs.disable_any_whitespace", "" if given and given.disable_any_whitespace else None))
            if value is not None]
        if len({value for _, value in asked}) > 1:
            raise RequestError(f"{asked[1][0]}: conflicts with {asked[0][0]}; give one whitespace rule", asked[1][0])
        closed = bool(given and given.disable_additional_properties)
        if not asked and not closed:
            return None
        return (asked[0][0] if asked else "structured_outputs.disable_additional_properties",
                asked[0][1] if asked else None, closed)

    @staticmethod
    def _shaped_json(name: str, fields: dict[str, Any], asked_by: str, pattern: str | None,
                     closed: bool) -> dict[str, Any]:
        """A JSON constraint's fields with the whitespace between its tokens held to `pattern` (a regex: llguidance's
        whitespace_pattern option, in the schema's x-guidance), and, closed, every object of its schema without
        additional properties where it does not say."""
        if fields.get("json_object"):
            schema: Any = {"type": "object"}
        elif "json" in fields:
            schema = fields["json"]
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise RequestError(f"{name}: not valid JSON: {exc}", name) from exc
        else:
            raise RequestError(f"{asked_by}: shapes a JSON constraint; {name} gives another kind", asked_by)
        if not isinstance(schema, dict):
            raise RequestError(f"{name}: a JSON schema must be an object", name)
        if closed:
            schema = _closed_objects(schema)
        if pattern is not None:
            schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), "whitespace_pattern": pattern}}
        return {"json": schema}

    def _constraints(self) -> list[tuple[str, dict[str, Any]]]:
        """(request field, StructuredOutputsParams fields) of every field that constrains the output."""
        given: list[tuple[str, dict[str, Any]]] = []
        if self.response_format is not None and self.response_format.type != "text":
            if self.response_format.type == "json_object":
                given.append(("response_format", {"json_object": True}))
            elif self.response_format.type == "structural_tag":
                given.append(("response_format", {"structural_tag": self.response_format.structural_tag()}))
            else:
                spec = self.response_format.json_schema
                if spec is None or spec.json_schema is None:
                    raise RequestError("response_format.json_schema.schema: a json_schema response format needs its "
                                       "schema", "response_format.json_schema.schema")
                given.append(("response_format", {"json": spec.json_schema}))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True, exclude_none=True,
                                                        include=StructuredOutputsField.CONSTRAINTS)
            given.append(("structured_outputs", fields))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar"), ("structural_tag", "structural_tag")):
            if getattr(self, name) is not None:
                given.append((name, {key: getattr(self, name)}))
        return given

    def scored_prompt(self) -> int | None:
        """Top alternatives per prompt token the reply needs, or None when it shows no prompt logprobs."""
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        structured = self.structured_outputs_params()
        bias = None
        if self.logit_bias:
            try:
                bias = {int(token): value for token, value in self.logit_bias.items()}
            except ValueError as exc:
                raise RequestError(f"logit_bias: keys must be token ids, got {exc}", "logit_bias") from exc
        try:
            return SamplingParams(
                n=self.num_samples, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
                min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=self.scored_prompt(), logit_bias=bias,
                allowed_token_ids=self.allowed_token_ids or None, bad_words=self.bad_words or None,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens, cache_salt=self.cache_salt,
                structured_outputs=structured,
            )
        except ValueError as exc:  # SamplingParams messages start with the field's name
            raise RequestError(str(exc), str(exc).split()[0].rstrip(":")) from exc

    def beam_search_params(self, params: SamplingParams) -> BeamSearchParams | None:
        """With use_beam_search, the search's settings (params are the already checked sampling fields);
        fields a beam search does not honour are refused rather than ignored."""
        if not self.use_beam_search:
            return None
        width = self.beam_width if self.beam_width is not None else params.n
        if params.n > width:
            raise RequestError(f"n: {params.n} beams asked for, but beam_width is {width}; n must be at most "
                               "beam_width", "n")
        for name, unsupported in (("stop", params.stop_strings), ("logprobs", params.logprobs is not None),
                                  ("prompt_logprobs", params.prompt_logprobs is not None),
                                  ("allowed_token_ids", params.allowed_token_ids), ("bad_words", params.bad_words),
                                  ("structured_outputs", params.structured_outputs is not None)):
            if unsupported:
                raise RequestError(f"{name}: not supported with use_beam_search", name)
        try:
            return BeamSearchParams(beam_width=width, max_tokens=params.max_tokens,
                                    length_penalty=self.length_penalty, ignore_eos=params.ignore_eos,
                                    cache_salt=params.cache_salt)
        except ValueError as exc:  # BeamSearchParams messages start with the field's name
            raise RequestError(str(exc), str(exc).split()[0]) from exc

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """A stream's every chunk carries the usage so far (vLLM's continuous_usage_stats)."""
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: Text | None = None  # fill in the middle: the text the completion must lead into
    best_of: int | None = None  # samples drawn per prompt; the n with the highest cumulative logprob are returned

    @model_validator(mode="after")
    def _nothing_to_generate(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is allowed only with echo (the prompt alone, scored with logprobs)")
        if self.best_of is not None and self.best_of != self.n:
            if not isinstance(self.n, int) or self.best_of < self.n:
                raise ValueError(f"best_of: must be at least n ({self.n}), got {self.best_of}")
            for name, refused in (("stream", self.stream), ("use_beam_search", self.use_beam_search)):
                if refused:
                    raise ValueError(f"best_of: not supported with {name} (the best samples are known only at "
                                     "the end)")
        if self.suffix and self.echo:
            raise ValueError("echo: not supported with suffix (the prompt the model reads is a fill-in-the-middle "
                             "one, not the prompt given)")
        return self

    @property
    def num_samples(self) -> int:
        return self.best_of if self.best_of is not None else self.n

    @property
    def ranks_samples(self) -> bool:
        """best_of above n: the samples are ranked by cumulative logprob, and the best n returned."""
        return self.num_samples > self.n

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo: the reply is the prompt (one token is generated, and not shown)."""
        return self.echo and self.max_tokens == 0

    def generated_max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    def scored_prompt(self) -> int | None:
        """echo with logprobs shows the prompt's tokens with their logprobs too (lm-eval's loglikelihood)."""
        echoed = self.logprobs if self.echo and self.logprobs is not None else None
        if echoed is None or self.prompt_logprobs is None:
            return echoed if echoed is not None else self.prompt_logprobs
        return max(echoed, self.prompt_logprobs)


class ContentPart(Body):
    """One part of a message's content: text, or an image (image_url, for a vision model); the others are refused by
    name (plain_messages), never dropped."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Text
    text: Text | None = None

    @model_validator(mode="after")
    def _text_has_text(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs a `text` string")
        check_unicode(self.model_extra, "content part")
        return self


class ChatMessage(Body):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_calls, ...: passed to the chat template

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = None

    @model_validator(mode="after")
    def _extras_are_unicode(self) -> ChatMessage:
        check_unicode(self.model_extra, "message")
        return self


class ToolFunction(Body):
    name: Annotated[Text, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # enforced by the grammar under tool_choice required / named; refused under auto

    @model_validator(mode="after")
    def _unicode(self) -> ToolFunction:
        check_unicode(self.parameters, "parameters")
        return self


class Tool(Body):
    type: Literal["function"]
    function: ToolFunction


class NamedToolChoice(Body):
    type: Literal["function"]
    function: dict[str, Text]


class ChatRendering(Body):
    """How a conversation is rendered beyond its messages (chat completions and /tokenize alike)."""

    continue_final_message: bool = False
    chat_template: Text | None = None  # run only on a server that trusts requests' templates (the gateway checks)
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: a template variable where the model's template reads it (gpt-oss's), refused elsewhere
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    # vLLM's (HF's apply_chat_template's): retrieved documents, a variable of templates that read it (Command R's)
    documents: list[dict[Text, Text]] | None = None

    @model_validator(mode="after")
    def _template_kwargs_unicode(self) -> ChatRendering:
        check_unicode(self.chat_template_kwargs, "chat_template_kwargs")
        return self

    def chat_options(self) -> ChatOptions:
        return ChatOptions(self.continue_final_message, self.chat_template, self.chat_template_kwargs or {},
                           self.reasoning_effort, self.documents)


class ChatCompletionRequest(SamplingFields, ChatRendering):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # vLLM's: with a --reasoning-parser, whether reasoning_content is returned
    echo: bool = False  # vLLM's: the reply's content opens with the last message's, where that is the assistant's
    # the model's call format and its tags' grammar terms (serve/tool_grammars.py), set by the route
    _call_format: tuple[str, dict[str, str]] = PrivateAttr(default=("hermes", {}))

    def use_call_format(self, form: str, markers: dict[str, str]) -> None:
        self._call_format = form, markers

    @property
    def calling_tools(self) -> bool:
        """Whether the model is offered tools (and its reply parsed for calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them, or None when none are offered."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.calling_tools else None

    def named_tool(self) -> str | None:
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        name = self.tool_choice.function.get("name")
        if not self.tools or name not in {t.function.name for t in self.tools}:
            raise RequestError(f"tool_choice: function {name!r} is not among the request's tools", "tool_choice")
        return name

    def _constraints(self) -> list[tuple[str, dict[str, Any]]]:
        given = super()._constraints()
        if self.calling_tools and self.tool_choice in (None, "auto"):
            strict = next((i for i, t in enumerate(self.tools) if t.function.strict), None)
            if strict is not None:  # the model may answer in text there: its calls cannot be held to the schema
                raise RequestError(f"tools.{strict}.function.strict: strict arguments are enforced only with "
                                   "tool_choice 'required' or a named function", f"tools.{strict}.function.strict")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            if self.tool_choice != "auto":
                raise RequestError("tool_choice: names a tool call, but the request has no tools", "tool_choice")
        elif self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice):
            form, markers = self._call_format
            try:
                grammar = calls_grammar(self.tool_dicts(), self.named_tool(), self.parallel_tool_calls, form, markers)
            except UnenforceableSchema as exc:
                raise RequestError(str(exc), exc.field) from exc
            given.append(("tool_choice", {"grammar": grammar.grammar}))
        return given

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def echoed(self) -> str:
        """The text echo puts before the reply's content: the last message's, where it is the assistant's (the
        reply continues it: continue_final_message), else nothing, as vLLM's echo."""
        if not self.echo:
            return ""
        if self.calling_tools:
            raise RequestError("echo: not supported with tools (a reply's content may give way to calls)", "echo")
        last = self.messages[-1]
        if last.role != "assistant" or last.content is None:
            return ""
        return content_text(last.content)

    def logprobs_asked(self) -> int | None:
        """Top alternatives per token, or None without logprobs; top_logprobs alone is refused, as vLLM does."""
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs: needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


# where a JSON schema holds subschemas: a map of them by name, a list of them, or one
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def _closed_objects(schema: Any) -> Any:
    """The schema with additionalProperties false in every object schema that does not set it (vLLM's
    disable_additional_properties), its subschemas included."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            closed[key] = {name: _closed_objects(sub) for name, sub in schema[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            closed[key] = [_closed_objects(sub) for sub in schema[key]]
    for key in _SCHEMA_ONE:
        if key in schema:
            closed[key] = _closed_objects(schema[key])
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def plain_messages(messages: list[ChatMessage], images: bool = False) -> list[dict[str, Any]]:
    """Messages for the chat template; content given as text parts becomes their text, and content with image parts
    (images: the model reads them) stays a list of parts (multimodal/messages.py's split_images takes the images
    out). Other parts are refused by name."""
    readable = ("text", "image_url") if images else ("text",)
    out = []
    for i, m in enumerate(messages):
        message = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type not in readable:
                    raise RequestError(f"messages.{i}.content.{j}.type: {part.type!r} parts are not supported; "
                                       f"this server reads {' and '.join(readable)} parts"
                                       + ("" if images else " (images need a vision model: Qwen2-VL, Qwen2.5-VL)"),
                                       f"messages.{i}.content.{j}.type")
            if all(part.type == "text" for part in m.content):
                message["content"] = content_text(m.content)
        out.append(message)
    return out


def content_text(content: str | list[ContentPart]) -> str:
    """A message's content as text: a string as it is, parts as their text joined."""
    return content if isinstance(content, str) else "".join(part.text or "" for part in content)


def last_tokens(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """A prompt's last `keep` tokens (vLLM's truncate_prompt_tokens; -1: the context's length), or all of it (None)."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if keep < 1 or keep > max_model_len:
        raise RequestError(f"truncate_prompt_tokens: {keep} is not -1 (the context's length) or 1 to the context's "
                           f"{max_model_len} tokens", "truncate_prompt_tokens")
    return ids[-keep:]


class EmbeddingRequest(Body):
    """OpenAI's /v1/embeddings body (a pooling runner's), with vLLM's fields."""

    model: Text | None = None
    input: Text | list[Text] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # refused: cutting an embedding short is right only for models trained to allow it
    user: Text | None = None
    priority: int = 0  # vLLM's: lower goes first, on a server started with --schedule-policy priority
    truncate_prompt_tokens: int | None = None  # vLLM's: each input's last k tokens embedded
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS / EOS around a text input
    normalize: bool = True  # vLLM's; false refused: the engine hands embeddings over normalized

    @model_validator(mode="after")
    def _refusals(self) -> EmbeddingRequest:
        if self.dimensions is not None:
            raise ValueError("dimensions: not supported; this server returns each embedding whole (cutting it short "
                             "is right only for models trained for it)")
        if not self.normalize:
            raise ValueError("normalize: false is not supported; embeddings are returned L2-normalized")
        check_unicode(self.input, "input")
        log_labels({"user": self.user}, ("user",))
        return self

    def prompts(self) -> list[str | list[int]]:
        return input_prompts(self.input)


def input_prompts(given: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A pooling request's `input` as its prompts, each a text or token ids (an empty one refused naming it)."""
    prompts: list[Any] = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else list(given)
    if not prompts or any(not p for p in prompts):
        raise RequestError("input: must not be empty", "input")
    return prompts


class TokenizeRequest(ChatRendering):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class LoadLoRAAdapterRequest(Body):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: Text = Field(min_length=1)
    lora_path: Text = Field(min_length=1)
    load_inplace: bool = False  # vLLM's: replace an adapter of that name; refused (unload it first)


class UnloadLoRAAdapterRequest(Body):
    """vLLM's /v1/unload_lora_adapter body."""

    lora_name: Text = Field(min_length=1)
    lora_int_id: StrictInt | None = None  # vLLM's; the name alone says which here


class DetokenizeRequest(Body):
    model: Text | None = None
    tokens: list[StrictInt]
