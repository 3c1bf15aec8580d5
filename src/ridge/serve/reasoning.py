"""A reasoning model's thinking split from its answer, as vLLM's --reasoning-parser does: the message's
reasoning_content holds what the model wrote between <think> and </think>, its content what follows.

Three parsers, for the two ways templates open the thinking:
  deepseek_r1  the reply is thinking until </think> (DeepSeek-R1's and QwQ's templates end the prompt with <think>,
               so the reply has no opening tag; one the model writes anyway is dropped); a reply cut off before
               </think> is all thinking
  qwen3        thinking only between a leading <think> and </think> (Qwen3 with enable_thinking off writes none, or
               an empty pair); a reply that does not open with <think> is all answer
  seed_oss     qwen3's rule between Seed-OSS's own tags, <seed:think> and </seed:think>
The text is not stripped: a streamed reply's deltas join to the whole reply's fields.

A structured-output constraint (a schema, a regex, tool_choice's call grammar) holds the whole reply here, the
thinking with the answer (vLLM holds only what follows the thinking): such a reply thinks only where the
constraint opens <think>, so it is read by the qwen3 rule whatever the parser (under deepseek_r1's, a JSON answer
with no </think> would be taken for thinking).
"""

from __future__ import annotations

from dataclasses import dataclass

PARSERS = ("deepseek_r1", "qwen3", "seed_oss")
START, END = "<think>", "</think>"
# the tags each parser reads the thinking between (deepseek_r1's and qwen3's: START, END)
TAGS = {"seed_oss": ("<seed:think>", "</seed:think>")}


def tags(parser: str) -> tuple[str, str]:
    return TAGS.get(parser, (START, END))


@dataclass
class Split:
    reasoning: str | None  # None where the reply has none
    content: str | None


def constrained_parser(parser: str | None, constrained: bool) -> str | None:
    """The parser a reply is read by: under a constraint, the qwen3 rule (the module's docstring says why), which
    seed_oss's is."""
    return "qwen3" if parser == "deepseek_r1" and constrained else parser


def split_reply(text: str, parser: str) -> Split:
    """A whole reply's thinking and answer."""
    reasoning, content = ReasoningStream(parser).feed(text, final=True)
    return Split(reasoning or None, content or None)


class ReasoningStream:
    """A reply's thinking and answer as its text streams in: each feed returns the new text of each, holding back
    what may still be the start of a tag until the text that follows tells."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning_parser: {parser!r} is not one of {', '.join(PARSERS)}")
        self.parser = parser
        self._start, self._end = tags(parser)
        self._phase = "start"  # start (a leading <think> may still come) -> thinking -> answer
        self._held = ""

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """The reply's next text -> (thinking, answer) it completes; final: the reply ended."""
        self._held += text
        thinking = answer = ""
        if self._phase == "start":
            lead = self._held.lstrip()
            if not final and len(lead) < len(self._start) and self._start.startswith(lead):
                return "", ""  # still may open with the tag
            if lead.startswith(self._start):
                self._held, self._phase = lead[len(self._start):], "thinking"
            else:
                self._phase = "thinking" if self.parser == "deepseek_r1" else "answer"
        if self._phase == "thinking":
            end = self._held.find(self._end)
            if end < 0:
                keep = 0 if final else _partial_tag(self._held, self._end)
                thinking, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
                return thinking, ""
            thinking, self._held, self._phase = self._held[:end], self._held[end + len(self._end):], "answer"
        answer, self._held = self._held, ""
        return thinking, answer


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (what the next text may complete into it)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
