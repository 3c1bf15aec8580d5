"""Benchmark workloads as token ids, so every engine runs exactly the same requests."""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

from ridge.datasets import iter_sharegpt
from ridge.hub import pull_dataset
from ridge.tokenizer import RidgeTokenizer


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    session: int | None = None  # requests of one session go one after another, each once the last is answered
    # the prompt continues its session's conversation: sent after the session's previous prompt and the reply the
    # server gave it (its token ids), as a chat client sends a conversation's next turn
    continues: bool = False


def sharegpt(tokenizer: RidgeTokenizer, num_requests: int, max_prompt_len: int = 1024,
             max_output_len: int = 1024, path: Path | None = None) -> list[Request]:
    """Prompt = a conversation's first human turn (truncated); output length = the reply's length.

    Conversations whose prompt or reply is under 4 tokens are skipped, as vLLM's benchmark does.
    """
    path = path or pull_dataset("sharegpt")
    requests: list[Request] = []
    for record in iter_sharegpt(path):
        turns = record.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt = tokenizer.encode(turns[0]["value"])[:max_prompt_len]
        reply_len = len(tokenizer.encode(turns[1]["value"], add_special_tokens=False))
        if len(prompt) < 4 or reply_len < 4:
            continue
        requests.append(Request(prompt, min(reply_len, max_output_len)))
        if len(requests) == num_requests:
            break
    return requests


def multiturn(tokenizer: RidgeTokenizer, num_conversations: int, max_turns: int = 4, max_prompt_len: int = 2048,
              max_output_len: int = 512, path: Path | None = None) -> list[Request]:
    """ShareGPT conversations replayed turn by turn: turn k's prompt is the conversation so far (human and
    recorded assistant turns, in the model's chat format) up to the k-th human message; its output length is
    the recorded reply's. The history uses the recorded replies, not the served ones, so every server gets
    the same prompts; each turn still starts with the previous turn's whole prompt, which a prefix cache reuses.
    """
    path = path or pull_dataset("sharegpt")
    requests: list[Request] = []
    sessions = 0
    for record in iter_sharegpt(path):
        turns = [t for t in record.get("conversations") or [] if t.get("from") in ("human", "gpt")]
        pairs = [(turns[i]["value"], turns[i + 1]["value"]) for i in range(0, len(turns) - 1, 2)
                 if turns[i]["from"] == "human" and turns[i + 1]["from"] == "gpt"][:max_turns]
        if len(pairs) < 2:
            continue
        messages: list[dict[str, str]] = []
        conversation = []
        for human, gpt in pairs:
            messages.append({"role": "user", "content": human})
            prompt = tokenizer.encode_chat(messages)
            reply_len = min(len(tokenizer.encode(gpt, add_special_tokens=False)), max_output_len)
            if len(prompt) + reply_len > max_prompt_len or reply_len < 4:
                break
            conversation.append(Request(prompt, reply_len, sessions))
            messages.append({"role": "assistant", "content": gpt})
        if len(conversation) >= 2:
            requests.extend(conversation)
            sessions += 1
            if sessions == num_conversations:
                break
    return requests


def chat_requests(vocab_size: int, num_conversations: int, max_turns: int, input_len: int, output_len: int,
                  seed: int = 0) -> list[Request]:
    """Conversations of max_turns turns, each a message of input_len random tokens that continues the conversation
    so far, the server's own replies included (closed loop: a turn is sent once the previous reply came, whose
    tokens it repeats), as chat clients send them; each reply output_len tokens."""
    messages = random_requests(vocab_size, num_conversations * max_turns, input_len, output_len, seed)
    return [Request(m.prompt_ids, m.max_tokens, session=i // max_turns, continues=i % max_turns > 0)
            for i, m in enumerate(messages)]


def random_requests(vocab_size: int, num_requests: int, input_len: int, output_len: int,
                    seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(100, vocab_size - 100) for _ in range(input_len)], output_len)
            for _ in range(num_requests)]


def prefix_requests(vocab_size: int, num_requests: int, prefix_len: int, input_len: int, output_len: int,
                    share_fraction: float = 1.0, seed: int = 0) -> list[Request]:
    """Prompts of prefix_len + input_len random tokens. A share_fraction of them (spread evenly) start with
    one common prefix; the rest with a prefix of their own, so every prompt costs the same cold."""
    if not 0 <= share_fraction <= 1:
        raise ValueError(f"share fraction: must be in [0, 1], got {share_fraction}")
    shared = random_requests(vocab_size, 1, prefix_len, 1, seed + 1)[0].prompt_ids
    own = random_requests(vocab_size, num_requests, prefix_len, 1, seed + 2)
    suffixes = random_requests(vocab_size, num_requests, input_len, output_len, seed)
    sharing = round(share_fraction * num_requests)
    rng = random.Random(seed + 3)
    shares = set(rng.sample(range(num_requests), sharing))
    return [Request((shared if i in shares else own[i].prompt_ids) + r.prompt_ids, r.max_tokens)
            for i, r in enumerate(suffixes)]


def tenant_requests(vocab_size: int, num_requests: int, num_tenants: int, prefix_len: int, input_len: int,
                    output_len: int, seed: int = 0) -> list[Request]:
    """A multi-tenant workload: each request is one of num_tenants system prompts of prefix_len random tokens (the
    tenant drawn uniformly) and a question of its own of input_len tokens."""
    prompts = random_requests(vocab_size, num_tenants, prefix_len, 1, seed + 1)
    questions = random_requests(vocab_size, num_requests, input_len, output_len, seed)
    rng = random.Random(seed + 2)
    return [Request(prompts[rng.randrange(num_tenants)].prompt_ids + q.prompt_ids, q.max_tokens) for q in questions]


def humaneval_problems(path: Path | None = None) -> list[dict]:
    with gzip.open(path or pull_dataset("humaneval"), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval(tokenizer: RidgeTokenizer, num_requests: int, max_tokens: int) -> list[Request]:
    """HumanEval problems as chat requests: complete the function (code from scratch: a drafter's test)."""
    return [Request(tokenizer.encode_chat([{"role": "user", "content":
                                            f"Complete this Python function.\n```python\n{p['prompt']}```"}]),
                    max_tokens)
            for p in humaneval_problems()[:num_requests]]


def code_edit(tokenizer: RidgeTokenizer, num_requests: int, max_tokens: int) -> list[Request]:
    """An input-echoing task: rewrite a HumanEval solution with one name changed. The answer copies most
    of the prompt, which is what n-gram prompt lookup can draft."""
    requests = []
    for p in humaneval_problems()[:num_requests]:
        code = p["prompt"] + p["canonical_solution"]
        ask = (f"Rename the function `{p['entry_point']}` to `solution` in this code. Reply with the whole "
               f"code and nothing else; change nothing else.\n```python\n{code}```")
        requests.append(Request(tokenizer.encode_chat([{"role": "user", "content": ask}]), max_tokens))
    return requests
