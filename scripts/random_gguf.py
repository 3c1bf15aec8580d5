"""Write `random:NAME`'s weights as a GGUF whose matrices are in a GGUF block format, and print its path, so that
ridge (`--quantization gguf`) and llama.cpp run the same quantized blocks of a shape no real checkpoint here has:

    f=$(.venv/bin/python scripts/random_gguf.py "random:qwen3-30b-a3b,num_layers=4" Q8_0)
    ridge bench latency --model "$f" --quantization gguf --peer llamacpp=$PEERS/llamacpp/bin/python

The file is cached under ~/.cache/ridge/random-gguf (ridge bench's float16 ones for the peers sit beside it).
"""

from __future__ import annotations

import argparse

from ridge.bench.cli import random_gguf_for
from ridge.bench.random_gguf import BLOCK_TYPES
from ridge.models.random_weights import random_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="random:NAME[,field=value...], as ridge's --model takes it")
    parser.add_argument("block_type", choices=BLOCK_TYPES, help="the GGUF block format of the matrices")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed (ridge's --seed)")
    args = parser.parse_args()
    print(random_gguf_for(random_spec(args.model), args.seed, args.block_type))


if __name__ == "__main__":
    main()
