"""Tokenizer, chat template, incremental detokenizer and stop strings.

A GGUF file's vocabulary becomes a `tokenizers` pipeline (gguf_vocab.py); an HF directory's tokenizer.json
is loaded as it is. A chat template comes from the file, or, for a family whose files may lack one, from
chat_templates.py.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from ridge.chat_templates import BUILTIN
from ridge.gguf_vocab import vocabulary_tokenizer
from ridge.models.gguf_file import GGUFFile, read_gguf
from ridge.sampling_params import SamplingParams

log = logging.getLogger("ridge")

# Tokens that end a turn in the chat formats we know; generation stops on them as on EOS.
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eom_id|>")

# Fill-in-the-middle tokens (prefix, suffix, middle) of the families that have them, in prefix-suffix-middle
# order: Qwen2.5-Coder and CodeGemma, StarCoder and SmolLM, DeepSeek-Coder.
_FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
               ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))


@dataclass
class TokenizerInfo:
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos: bool
    chat_template: str | None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    fim_token_ids: tuple[int, int, int] | None = None  # (prefix, suffix, middle): None when it cannot infill
    # the tokenizer's post-processor closes a text with a special token (BERT's [CLS] text [SEP], RoBERTa's
    # <s> text </s>): its template is then the text's special tokens, not add_bos
    wraps: bool = False
    # the special token a pair template puts between its two texts (BERT's [SEP], RoBERTa's </s>): a cross-encoder's
    # token types count them
    pair_separator: int | None = None


def tokenizer_from_gguf(gguf: GGUFFile) -> tuple[Tokenizer, TokenizerInfo]:
    tok = vocabulary_tokenizer(gguf)
    bos, eos = gguf.fields.get("tokenizer.ggml.bos_token_id"), gguf.fields.get("tokenizer.ggml.eos_token_id")
    arch = gguf.fields.get("general.architecture", "")
    template = gguf.fields.get("tokenizer.chat_template")
    if template is None and arch in BUILTIN:
        log.info("ridge: the file has no chat template; using the built-in %s one", arch)
        template = BUILTIN[arch]
    info = TokenizerInfo(
        bos_token_id=bos,
        eos_token_id=eos,
        # llama.cpp adds no BOS to GLM-4's vocabulary whatever the file says: its template writes [gMASK]<sop>
        add_bos=bool(gguf.fields.get("tokenizer.ggml.add_bos_token", False))
        and gguf.fields.get("tokenizer.ggml.pre") not in ("glm4", "chatglm-bpe"),
        chat_template=template,
    )
    eot = gguf.fields.get("tokenizer.ggml.eot_token_id")
    info.stop_token_ids = _stop_ids(tok.get_vocab(), eos, eot)
    if gguf.fields.get("tokenizer.ggml.model") == "bert":  # its post-processor wraps a text (gguf_vocab.py)
        info.wraps = True
        info.pair_separator = gguf.fields.get("tokenizer.ggml.seperator_token_id", eos)
    fim = tuple(gguf.fields.get(f"tokenizer.ggml.fim_{part}_token_id") for part in ("pre", "suf", "mid"))
    info.fim_token_ids = fim if None not in fim else _fim_ids(tok.get_vocab())
    return tok, info


def tokenizer_from_hf_dir(path: Path) -> tuple[Tokenizer, TokenizerInfo]:
    text = (path / "tokenizer.json").read_text()
    tok = Tokenizer.from_str(text)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}

    def token_id(value: Any) -> int | None:
        if isinstance(value, dict):
            value = value.get("content")
        return tok.token_to_id(value) if isinstance(value, str) else None

    bos, eos = token_id(cfg.get("bos_token")), token_id(cfg.get("eos_token"))
    gen_eos = gen.get("eos_token_id")
    extra = set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    info = TokenizerInfo(
        bos_token_id=bos,
        eos_token_id=eos,
        add_bos=bool(cfg.get("add_bos_token", False)),
        chat_template=hf_chat_template(path, cfg),
    )
    info.stop_token_ids = _stop_ids(tok.get_vocab(), eos, None) | frozenset(extra)
    info.fim_token_ids = _fim_ids(tok.get_vocab())
    processor = json.loads(text).get("post_processor")
    info.wraps = _closes_text(processor)
    info.pair_separator = _pair_separator(processor)
    return tok, info


def _pair_separator(processor: dict[str, Any] | None) -> int | None:
    """The id of the special token an HF tokenizer.json's post-processor puts right after a pair's first text."""
    if not processor:
        return None
    kind = processor.get("type")
    if kind in ("BertProcessing", "RobertaProcessing"):
        return int(processor["sep"][1])
    if kind == "Sequence":
        return next((sep for p in processor.get("processors") or [] if (sep := _pair_separator(p)) is not None), None)
    if kind != "TemplateProcessing":
        return None
    pieces = [piece for piece in processor.get("pair") or [] if isinstance(piece, dict)]
    first = next((i for i, piece in enumerate(pieces) if piece.get("Sequence", {}).get("id") == "A"), None)
    after = pieces[first + 1] if first is not None and first + 1 < len(pieces) else {}
    token = (processor.get("special_tokens") or {}).get(after.get("SpecialToken", {}).get("id"))
    return int(token["ids"][0]) if token and token.get("ids") else None


def _closes_text(processor: dict[str, Any] | None) -> bool:
    """Whether an HF tokenizer.json's post-processor puts a special token after a single text."""
    if not processor:
        return False
    kind = processor.get("type")
    if kind in ("BertProcessing", "RobertaProcessing"):
        return True
    if kind == "Sequence":
        return any(_closes_text(p) for p in processor.get("processors") or [])
    if kind == "TemplateProcessing":
        pieces = [next(iter(piece)) for piece in processor.get("single") or [] if isinstance(piece, dict)]
        return "Sequence" in pieces and "SpecialToken" in pieces[pieces.index("Sequence"):]
    return False


def hf_chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """An HF directory's chat template, where HF transformers finds it: chat_template.jinja (what it saves since
    4.43; gpt-oss, Qwen3 and others ship it so), else tokenizer_config.json's, whose named form (a list of
    {name, template}) serves its "default"; else a processor's chat_template.json."""
    if (jinja := path / "chat_template.jinja").exists():
        return jinja.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        if "default" not in named:
            raise ValueError(f"{path / 'tokenizer_config.json'}: chat_template: named templates "
                             f"{sorted(map(str, named))} have no 'default'")
        return named["default"]
    if template is None and (processor := path / "chat_template.json").exists():
        return json.loads(processor.read_text()).get("chat_template")
    return template


def byte_level_tokenizer(vocab_size: int) -> tuple[Tokenizer, TokenizerInfo]:
    """For a model that comes with no tokenizer (random weights): text encodes to its UTF-8 bytes, ids 0-255;
    the ids above decode to a placeholder "<r{id}>" each. No BOS, no stop token, no chat template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {char: i for i, char in enumerate(alphabet)}
    vocab.update({f"<r{i}>": i for i in range(len(alphabet), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok, TokenizerInfo(bos_token_id=None, eos_token_id=None, add_bos=False, chat_template=None)


def _stop_ids(vocab: dict[str, int], eos: int | None, eot: int | None) -> frozenset[int]:
    ids = {i for i in (eos, eot) if i is not None}
    ids.update(vocab[t] for t in _END_OF_TURN if t in vocab)
    return frozenset(ids)


def _fim_ids(vocab: dict[str, int]) -> tuple[int, int, int] | None:
    for names in _FIM_TOKENS:
        if all(name in vocab for name in names):
            return vocab[names[0]], vocab[names[1]], vocab[names[2]]
    return None


class RidgeTokenizer:
    """Encode/decode plus the model's BOS rule and chat template."""

    def __init__(self, tokenizer: Tokenizer, info: TokenizerInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template = _compile_template(info.chat_template) if info.chat_template else None

    @classmethod
    def from_path(cls, path: Path, gguf: GGUFFile | None = None) -> RidgeTokenizer:
        if path.is_dir():
            return cls(*tokenizer_from_hf_dir(path))
        return cls(*tokenizer_from_gguf(gguf or read_gguf(path)))

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.info.stop_token_ids

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if add_special_tokens and self.info.wraps:
            return self.tokenizer.encode(text).ids  # the post-processor's template: [CLS] text [SEP] (BERT's)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.info.bos_token_id
        # A template that already starts with BOS must not get a second one (llama.cpp warns about that).
        if add_special_tokens and self.info.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Two texts as one input, by the tokenizer's pair template ([CLS] first [SEP] second [SEP]: BERT's): what a
        cross-encoder scores. ValueError where the tokenizer has no such template."""
        if not self.info.wraps:
            raise ValueError("text_2: this model's tokenizer has no template for a pair of texts (a cross-encoder's "
                             "[CLS] a [SEP] b [SEP])")
        return self.tokenizer.encode(first, second).ids

    def encode_prompt(self, prompt: str | list[int] | dict[str, Any]) -> list[int]:
        """A prompt's token ids: a text encoded (an empty one refused, BOS or not), or ids as given; vLLM's
        TextPrompt ({"prompt": text}) and TokensPrompt ({"prompt_token_ids": ids}) as the text or ids they hold."""
        if isinstance(prompt, dict):
            if len(prompt) != 1 or not set(prompt) <= {"prompt", "prompt_token_ids"}:
                raise ValueError(f"prompt: a dict prompt is {{'prompt': text}} or {{'prompt_token_ids': ids}} (vLLM's "
                                 f"TextPrompt, TokensPrompt); got the keys {sorted(prompt)}")
            prompt = next(iter(prompt.values()))
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty (0 characters)")
            return self.encode(prompt)
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt: token ids must be integers")
        return ids

    def encode_infill(self, prefix: str | list[int], suffix: str) -> list[int]:
        """A fill-in-the-middle prompt: the model writes what goes between prefix and suffix (prefix, suffix,
        middle order, as llama.cpp's /infill builds it); ValueError naming `suffix` for a model that cannot."""
        if self.info.fim_token_ids is None:
            raise ValueError("suffix: this model's tokenizer has no fill-in-the-middle tokens, so it cannot complete "
                             "between a prompt and a suffix")
        pre, suf, mid = self.info.fim_token_ids
        head = self.encode(prefix, add_special_tokens=False) if isinstance(prefix, str) else list(prefix)
        bos = [self.info.bos_token_id] if self.info.add_bos and self.info.bos_token_id is not None else []
        return [*bos, pre, *head, suf, *self.encode(suffix, add_special_tokens=False), mid]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, options: ChatOptions | None = None) -> str:
        """The conversation as the model's template (or options.template) writes it; `tools` (OpenAI's shape)
        go to the template as HF passes them."""
        options = options or ChatOptions()
        try:
            template = _compile_template(options.template) if options.template is not None else self._template
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat_template: not a valid Jinja template: {exc}") from exc
        if template is None:
            raise ValueError("messages: this model has no chat template; pass a plain prompt instead")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}]: each message needs 'role' and 'content'")
        if options.continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: cannot be used with add_generation_prompt (set it to false): "
                             "the reply continues the last message instead of opening a new one")
        bos, eos = self.info.bos_token_id, self.info.eos_token_id
        variables = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                     "bos_token": self.token_text(bos) if bos is not None else "",
                     "eos_token": self.token_text(eos) if eos is not None else "", "tools": tools}
        source = options.template if options.template is not None else self.info.chat_template or ""
        for name, value, reader in (("reasoning_effort", options.reasoning_effort, "gpt-oss's does"),
                                    ("documents", options.documents, "Command R's and Granite's do")):
            if value is None:
                continue
            if name not in source:
                raise ValueError(f"{name}: this model's chat template does not read it ({reader}); the model would "
                                 "not see it")
            variables[name] = value
        clash = sorted(set(options.template_kwargs) & set(variables))
        if clash:
            raise ValueError(f"chat_template_kwargs: {', '.join(clash)} are set by the request's own fields")
        try:
            text = template.render(**options.template_kwargs, **variables)
        except jinja2.TemplateError as exc:
            where = "chat_template" if options.template is not None else "messages"
            raise ValueError(f"{where}: the chat template failed to render: {exc}") from exc
        if options.continue_final_message:
            text = _cut_after_final_message(text, messages[-1]["content"])
        return text

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, options: ChatOptions | None = None) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, options))


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered beyond its messages: vLLM's / HF's chat request options."""

    continue_final_message: bool = False  # the reply continues the last (assistant) message: no end of turn
    template: str | None = None  # a template of the request's own, in place of the model's
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra template variables (enable_thinking)
    reasoning_effort: str | None = None  # OpenAI's field, a variable of templates that read it (gpt-oss's)
    documents: list[dict[str, str]] | None = None  # retrieved documents, a variable of templates that read it


def _cut_after_final_message(text: str, final: Any) -> str:
    """The rendered conversation up to the end of its last message's content, as HF's continue_final_message
    cuts it (what the template closes the turn with is dropped)."""
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message: the last message needs text content to continue")
    for needle in (final, final.strip()):
        end = text.rfind(needle)
        if end >= 0:
            return text[:end + len(needle)]
    raise ValueError("continue_final_message: the chat template does not write the last message's content "
                     "verbatim, so it cannot be continued")


@functools.lru_cache(maxsize=16)  # the model's template, and the few a client sends with each request
def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    A byte-level BPE token may hold part of a character; decoding it alone yields U+FFFD. We keep
    a short window of tokens (from `prefix` to the end) and release text only once the window's
    decoding no longer ends in U+FFFD.
    """

    def __init__(self, tokenizer: RidgeTokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoding window
        self._read = 0  # tokens before this index are already released

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        full_text = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return full_text[len(prefix_text) :]
        return ""


def find_stop(text: str, new_from: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string that ends in text[new_from:] -> (its start index, the string).

    Only matches that end inside the new text count; a stop spanning several tokens is found once
    its last character arrives.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, new_from - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


class OutputText:
    """One sample's text as its tokens arrive: detokenized incrementally and cut at the first stop string.

    The output processor keeps one per sample (engine/output_processor.py), for `LLM` and for the server
    alike, so the engine's step loop never decodes text.
    """

    def __init__(self, tokenizer: RidgeTokenizer, params: SamplingParams) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self._params = params
        self.text = ""

    def add(self, token_id: int, num_outputs: int) -> str | None:
        """Append the sample's num_outputs-th token; return the stop string it completes (the text is then
        cut there), or None. Stop strings count only from min_tokens on."""
        params = self._params
        new_from = len(self.text)
        self.text += self._detokenizer.add(token_id)
        if num_outputs < params.min_tokens or not params.stop_strings:
            return None
        hit = find_stop(self.text, new_from, params.stop_strings)
        if hit is None:
            return None
        idx, stop = hit
        self.text = self.text[: idx + len(stop) if params.include_stop_str_in_output else idx]
        return stop
