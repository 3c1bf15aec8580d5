"""Shared fixtures: real models (pulled on first use), their HF references, and the KV-leak check.

Every engine goes through `make_llm` (fixtures that share one across tests) or `make_llm_for_test` (an
engine one test builds, freed when it ends: 24 GiB do not hold every engine of the session); after each
test, the block accounting of every live engine is checked, so a leak fails the test that caused it.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ridge import LLM, hub

_ENGINES: list[LLM] = []

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Give me a tip for learning to cook.",
    "What does a CPU do?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Suggest a name for a pet turtle.",
    "What is 12 times 12?",
    "Describe a rainy day in one sentence.",
]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return hub.pull("smollm2", progress=False)


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    return hub.pull("qwen2.5-coder-0.5b", progress=False)


@pytest.fixture(scope="session")
def make_llm() -> Callable[..., LLM]:
    def make(model: str | Path, **engine_args) -> LLM:
        engine_args.setdefault("kv_cache_memory", "256MiB")  # many engines live in one test session
        llm = LLM(str(model), progress=False, **engine_args)
        _ENGINES.append(llm)
        return llm

    return make


@pytest.fixture
def make_llm_for_test(make_llm) -> Iterator[Callable[..., LLM]]:
    """make_llm for engines only one test needs: checked and freed when it ends (every engine of the session
    held at once does not fit in 24 GiB)."""
    made: list[LLM] = []

    def make(model: str | Path, **engine_args) -> LLM:
        made.append(make_llm(model, **engine_args))
        return made[-1]

    yield make
    for llm in made:
        llm.engine.check_integrity()
        _ENGINES.remove(llm)
    made.clear()
    gc.collect()


@pytest.fixture(scope="session")
def smollm2(make_llm, smollm2_path) -> LLM:
    """SmolLM2 in float32 on the default (paged) backend: the reference-comparable engine."""
    return make_llm(smollm2_path, dtype="float32")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def _no_leaked_blocks() -> Iterator[None]:
    yield
    for llm in _ENGINES:
        llm.engine.check_integrity()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, stop_ids) -> list[int]:
    """HF transformers' greedy continuation, stopping where ridge stops (EOS and end-of-turn tokens)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=sorted(stop_ids), pad_token_id=sorted(stop_ids)[0])
    return out[0, len(prompt_ids):].tolist()


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]
