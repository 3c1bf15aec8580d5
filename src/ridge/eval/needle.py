"""Needle in a haystack: is a fact planted at some depth of a long context retrieved?

A chat prompt holds held-out text (Hamlet and Macbeth, eval/perplexity.py's) of about `length` tokens with one
sentence planted at `depth` (0: the start of the text, 1: its end, on a line boundary): "The secret number of
the lighthouse keeper is NNNNNNN." and asks for that number; the greedy answer is right when it holds the
number. A length at or past the model's limit (max_model_len) is cut to leave the answer its tokens: "32768" on a
32k model is a prompt of 32768 - answer tokens. Each cell of the length x depth grid has its own number (seeded), so
that no answer carries over. All
cells run as one batch through the engine, so the KV cache each reads is the engine's: its --kv-cache-dtype, its
--kv-eviction (a sink-window budget loses a needle that lies outside the sinks and the recent window: the trade
the grid shows).
"""

from __future__ import annotations

import random
import sys
import textwrap
from dataclasses import dataclass

NEEDLE = "The secret number of the lighthouse keeper is {code}."
QUESTION = "What is the secret number of the lighthouse keeper? Answer with the number only."


@dataclass(frozen=True)
class Cell:
    length: int  # the prompt's tokens, chat template included
    depth: float  # where in the text the needle sits, 0 to 1
    code: str
    answer: str

    @property
    def found(self) -> bool:
        return self.code in self.answer


def haystack_prompt(llm, lines: list[str], line_tokens: list[int], length: int, depth: float, code: str) -> list[int]:
    """A chat prompt of at most `length` tokens (a few below it): the text's first lines, the needle between two
    of them at `depth` of the text's tokens, then the question. ValueError where the text is too short for
    `length`."""
    frame = llm.render_chat([{"role": "user", "content": f"Read the text, then answer.\n\n\n\n{QUESTION}"}])
    budget = length - len(frame) - len(llm.tokenizer.encode(NEEDLE.format(code=code))) - 2
    total, count = 0, 0
    while count < len(lines) and total + line_tokens[count] <= budget:
        total += line_tokens[count]
        count += 1
    if count == len(lines) or budget <= 0:
        raise ValueError(f"lengths: {length} tokens is more than the held-out text holds (or less than the "
                         "prompt's frame)")

    def build(count: int) -> list[int]:
        total = sum(line_tokens[:count])
        at, seen = 0, 0
        while at < count and seen + line_tokens[at] <= depth * total:  # the line boundary nearest below the depth
            seen += line_tokens[at]
            at += 1
        text = "\n".join(lines[:at] + [NEEDLE.format(code=code)] + lines[at:count])
        return llm.render_chat([{"role": "user", "content": f"Read the text, then answer.\n\n{text}\n\n{QUESTION}"}])

    prompt = build(count)
    while len(prompt) > length and count > 1:  # lines tokenized alone can count fewer tokens than joined
        count -= max(1, (len(prompt) - length) * count // total)
        prompt = build(count)
    return prompt


def run_needle(llm, lengths: list[int], depths: list[float], seed: int = 0, max_tokens: int = 16) -> list[Cell]:
    from ridge.eval.perplexity import held_out_text
    from ridge.sampling_params import SamplingParams

    lines = [line for line in held_out_text("shakespeare").splitlines() if line.strip()]
    line_tokens = [len(llm.tokenizer.encode(line + "\n")) for line in lines]
    rng = random.Random(seed)
    grid = [(length, depth, str(rng.randrange(1_000_000, 10_000_000))) for length in lengths for depth in depths]
    room = llm.engine.max_model_len - max_tokens  # the longest prompt whose answer still fits the model
    prompts = [haystack_prompt(llm, lines, line_tokens, min(length, room), depth, code)
               for length, depth, code in grid]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=True)
    return [Cell(len(prompt), depth, code, out.outputs[0].text)
            for prompt, (_, depth, code), out in zip(prompts, grid, outputs, strict=True)]


def plot_needle(panels: list[tuple[str, list[Cell]]], lengths: list[int], depths: list[float], path: str) -> None:
    """One heatmap per variant: rows the depths, columns the lengths, green where the needle was found."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(panels), figsize=(2.2 + 2.4 * len(panels), 3.6), squeeze=False)
    for ax, (title, cells) in zip(axes[0], panels, strict=True):
        grid = np.array([[float(cells[i * len(depths) + j].found) for i in range(len(lengths))]
                         for j in range(len(depths))])
        ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("context (tokens)")
        wrapped = textwrap.fill(title.replace(",", ", "), 30, break_on_hyphens=False)
        ax.set_title(f"{wrapped}\n{int(grid.sum())} of {grid.size} found", fontsize=8)
    axes[0][0].set_ylabel("needle depth")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)
