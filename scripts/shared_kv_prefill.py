"""Prefill time of a prompt on a model with KV-shared layers (Gemma 4's E models): the shared layers skipped for the
prompt tokens whose logits nobody reads (a plain request), against every prompt row through them (a request that
asks every prompt token's log-probability, which needs every row's logits):

    .venv/bin/python scripts/shared_kv_prefill.py "random:gemma-4-e2b,vocab_size=49152" --tokens 512

Medians of 3 runs after a warm-up, bf16, the prefix cache off.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from ridge import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="as ridge's --model takes it")
    parser.add_argument("--tokens", type=int, default=512, help="the prompt's length")
    args = parser.parse_args()
    llm = LLM(args.model, dtype="bfloat16", enable_prefix_caching=False)
    rng = random.Random(0)
    vocab = llm.engine.loaded.config.vocab_size
    for name, params in (("the last row alone", SamplingParams(max_tokens=1)),
                         ("every row", SamplingParams(max_tokens=1, prompt_logprobs=0))):
        times = []
        for _ in range(4):
            prompt = [rng.randrange(100, vocab - 100) for _ in range(args.tokens)]
            started = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            times.append(time.perf_counter() - started)
        median = statistics.median(times[1:])
        print(f"{name} through the shared layers: {median:.2f} s, {args.tokens / median:.0f} tok/s")


if __name__ == "__main__":
    main()
