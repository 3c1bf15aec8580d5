"""Structured outputs: a request's grammar masks, each step, every token that would leave it.

llguidance does the grammar work (chosen over xgrammar, docs/notes/structured-outputs.md): it needs no other
package at run time, builds a matcher in microseconds to milliseconds (no per-grammar precomputation, so a new
schema costs nothing in time to first token), and computes a step's masks for the whole batch in parallel
Rust threads. A JSON schema, any JSON object, a regex, a choice of strings and a Lark or GBNF grammar all
become llguidance grammars; each is checked against the tokenizer when its request is added, so a bad one is
a ValueError naming the field, before anything runs.

A sequence holds its own matcher (Sequence.grammar). A step fills one bitmask row per constrained row, the
sampler sets the logits of masked tokens to -inf, and the engine feeds the sampled token back to the matcher.
A complete grammar allows only the stop tokens, so the output ends as the model's own would, its stop token
included (with ignore_eos too: nothing may follow it).

With speculative decoding, a draft is cut at its first token the grammar refuses, and the target's rows that
check it are masked by the grammar's state after each draft token in turn (llguidance computes those masks
in one parallel call), so accepting drafts samples exactly the constrained distribution.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Mapping
from functools import cached_property

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from ridge.sampling_params import StructuredOutputsParams
from ridge.tokenizer import RidgeTokenizer

log = logging.getLogger("ridge")

CACHED_GRAMMARS = 256  # compiled grammar texts kept, by request spec


class Grammar:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.failed = False  # the matcher refused a token its own mask allowed: the sequence ends there

    def accept(self, tokens: list[int]) -> None:
        """Advance past sampled tokens. The mask allowed them, so a refusal is llguidance disagreeing with itself
        (seen with a token whose text the grammar spells literally, when the vocabulary marks it as added): the
        sequence then ends (finish_reason "error", said in the log), and the step's other sequences go on."""
        # one at a time: consume_tokens refuses a stop token after a complete grammar, which consume_token takes
        if not self.failed and not all(self.matcher.consume_token(token) for token in tokens):
            self.failed = True
            log.warning("ridge: structured outputs: the grammar refused tokens %s its mask allowed; the sequence "
                        "ends: %s", tokens, self.matcher.get_error().splitlines()[0])

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar would take from where it stands (a draft is cut there)."""
        return 0 if self.failed else self.matcher.validate_tokens(tokens)

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Grammars for one tokenizer and vocabulary: compiled from requests (cached by their spec), matchers made,
    and a step's masks filled for a batch."""

    def __init__(self, tokenizer: RidgeTokenizer, vocab_size: int) -> None:
        self._source = tokenizer
        self.vocab_size = vocab_size
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self.mask_seconds = 0.0  # time spent filling masks, for `ridge bench structured`

    @cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary: every token's bytes (made once, on the first constrained request:
        about a second for a 150k vocabulary). Masks span the model's vocabulary; ids past the tokenizer's are
        never allowed; any stop token ends a complete grammar."""
        return llguidance.LLTokenizer(self._source.tokenizer.to_str(), n_vocab=self.vocab_size,
                                      eos_token=sorted(self._source.stop_token_ids) or None)

    @cached_property
    def added_tokens(self) -> dict[str, int]:
        """The vocabulary's added tokens (text -> id), which llguidance matches as tokens only."""
        return {t.content: i for i, t in self._source.tokenizer.get_added_tokens_decoder().items()}

    @cached_property
    def executor(self) -> llguidance.LLExecutor:
        return llguidance.LLExecutor()

    def grammar(self, spec: StructuredOutputsParams) -> str:
        """The llguidance grammar of a request's spec, checked; ValueError naming the field otherwise."""
        key = json.dumps([spec.kind, spec.json, spec.regex, spec.choice, spec.grammar, spec.structural_tag],
                         sort_keys=True)
        if key in self._grammars:
            self._grammars.move_to_end(key)
            return self._grammars[key]
        field = f"structured_outputs.{spec.kind}"
        text = grammar_text(spec, self.added_tokens)
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise ValueError(f"{field}: {error}")
        self._grammars[key] = text
        if len(self._grammars) > CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return text

    def matcher(self, spec: StructuredOutputsParams) -> Grammar:
        matcher = llguidance.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{spec.kind}: {matcher.get_error()}")
        return Grammar(matcher)

    def masks(self, grammars: list[Grammar]) -> torch.Tensor:
        """bool [len(grammars), vocab_size]: the tokens each may take next (computed in parallel)."""
        started = time.perf_counter()
        bits = self._bits(len(grammars))
        self.executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(grammars)], bits.ctypes.data,
                                              bits.shape[1] * 4, len(grammars))
        return self._unpack(bits, started)

    def draft_masks(self, drafts: list[tuple[Grammar, list[int]]]) -> torch.Tensor:
        """bool [sum of len(draft) + 1, vocab_size]: for each grammar, the tokens it allows next and after each
        of its draft's tokens in turn (rows in that order; the grammars' states are left as they were). Every
        draft token must be one the grammar allows (drafts are cut with valid_prefix first)."""
        started = time.perf_counter()
        starts = np.cumsum([0] + [len(tokens) + 1 for _, tokens in drafts])
        bits = self._bits(int(starts[-1]))
        self.executor.unsafe_compute_mask_ptr_with_draft_token(
            [(g.matcher, int(start), tokens) for (g, tokens), start in zip(drafts, starts, strict=False)],
            bits.ctypes.data, bits.shape[1] * 4, bits.shape[0])
        return self._unpack(bits, started)

    def _bits(self, rows: int) -> np.ndarray:
        return np.zeros((rows, (self.vocab_size + 31) // 32), dtype=np.uint32)  # token t: bit t % 32 of word t // 32

    def _unpack(self, bits: np.ndarray, started: float) -> torch.Tensor:
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size]
        self.mask_seconds += time.perf_counter() - started
        return torch.from_numpy(allowed.view(np.bool_))


def structural_tag_lark(text: str, added_tokens: Mapping[str, int] | None = None) -> str:
    """vLLM's structural tag (JSON text of {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}) as a
    Lark grammar: free text, where a trigger may open only the structures whose begin starts with it (the longest
    trigger that does), each JSON of its schema between its begin and end, then free text again. ValueError naming
    the part that is not one.

    Written here rather than by llguidance's StructTag.to_grammar, which writes a begin's rest and an end as text:
    llguidance matches a vocabulary's added tokens (Qwen's `<tool_call>`, `</tool_call>`) only as token references,
    never as the text they spell, so every added token's text in a trigger, begin or end is written as one (by id:
    added_tokens maps each one's text to it)."""
    added_tokens = added_tokens or {}
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from exc
    if not isinstance(tag, dict) or set(tag) - {"type"} != {"structures", "triggers"}:
        raise ValueError('needs vLLM\'s form {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]} '
                         "and nothing else (xgrammar's `format` form is not supported)")
    triggers, structures = tag["triggers"], tag["structures"]
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("triggers: must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structures: must be a non-empty list")
    opened: dict[str, list[str]] = {}  # trigger -> what may follow it: each structure's rest
    for i, structure in enumerate(structures):
        if not isinstance(structure, dict) or set(structure) != {"begin", "schema", "end"}:
            raise ValueError(f"structures[{i}]: needs begin, schema and end, and nothing else")
        begin, schema, end = structure["begin"], structure["schema"], structure["end"]
        if not isinstance(begin, str) or not isinstance(end, str) or not isinstance(schema, dict):
            raise ValueError(f"structures[{i}]: begin and end are strings, schema a JSON schema (an object)")
        starting = [t for t in triggers if begin.startswith(t)]
        if not starting:
            raise ValueError(f"structures[{i}].begin: {begin!r} starts with none of the triggers {triggers}")
        trigger = max(starting, key=len)
        rest = " ".join(_lark_text(begin[len(trigger):], added_tokens) + ["%json " + json.dumps(schema)]
                        + _lark_text(end, added_tokens))
        opened.setdefault(trigger, []).append(rest)
    lines = ["%llguidance {}", "start: (" + " | ".join(f"tag_{i}" for i in range(len(opened))) + ")* TAG_TEXT",
             r"TAG_TEXT: /(.|\n)*/"]
    for i, (trigger, rests) in enumerate(opened.items()):
        pieces = " ".join(_lark_text(trigger, added_tokens))
        if trigger in added_tokens:  # free text cannot hold the token: it ends where the token comes
            lines.append(f"tag_{i}: TAG_TEXT {pieces} ({' | '.join(rests)})")
        else:  # the shortest text up to the trigger's first appearance
            lines += [f"tag_{i}_trigger[lazy]: TAG_TEXT {pieces}", f"tag_{i}: tag_{i}_trigger ({' | '.join(rests)})"]
    return "\n".join(lines)


def _lark_text(text: str, added_tokens: Mapping[str, int]) -> list[str]:
    """`text` as Lark pieces: string literals, and token references for the added tokens it spells."""
    if not text:
        return []
    pattern = "|".join(re.escape(t) for t in sorted(added_tokens, key=len, reverse=True) if t in text)
    pieces = re.split(f"({pattern})", text) if pattern else [text]
    return [f"<[{added_tokens[piece]}]>" if piece in added_tokens else json.dumps(piece) for piece in pieces if piece]


def grammar_text(spec: StructuredOutputsParams, added_tokens: Mapping[str, int] | None = None) -> str:
    """The llguidance grammar of a spec, not yet checked against a vocabulary: Lark text, or llguidance's JSON
    form of its grammars (TopLevelGrammar); ValueError naming the field where the spec is not one. added_tokens: the
    vocabulary's added tokens (text -> id), which a structural tag's strings match as tokens."""
    try:
        return _grammar_text(spec, added_tokens)
    except ValueError as exc:
        raise ValueError(f"structured_outputs.{spec.kind}: {exc}") from exc


def _grammar_text(spec: StructuredOutputsParams, added_tokens: Mapping[str, int] | None) -> str:
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if spec.json is not None:
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not valid JSON ({exc})") from exc
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:  # Lark string literals are JSON strings
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    if spec.structural_tag is not None:
        return llguidance.LLMatcher.grammar_from_lark(structural_tag_lark(spec.structural_tag, added_tokens))
    text = spec.grammar
    if text.lstrip().startswith('{"grammars"'):  # llguidance's own JSON form (a harmony reply's: serve/harmony.py)
        return text
    if "::=" in text:  # GBNF / EBNF rules (llama.cpp's, vLLM's guided_grammar)
        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # the converter raises its GbnfToLarkError, and plain Exceptions for bad rules
            raise ValueError(f"not a GBNF grammar llguidance can read ({exc})") from exc
    return llguidance.LLMatcher.grammar_from_lark(text)
