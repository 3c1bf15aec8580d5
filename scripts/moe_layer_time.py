"""One MoE layer of a random model at batch 1: the decode stack's experts (C++, side by side on the threads)
against the Python block (models/moe.py), bit for bit equal, timed over the same inputs.

    .venv/bin/python scripts/moe_layer_time.py ["random:qwen3-30b-a3b,num_layers=2"]
"""

from __future__ import annotations

import sys
import time

import torch

from ridge import LLM
from ridge.kernels import cpu_ops
from ridge.kernels.decode_stack import native_experts


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "random:qwen3-30b-a3b,num_layers=2"
    # enforce_eager: the block keeps its Python path (its C++ form is made here, beside it)
    llm = LLM(name, progress=False, kv_cache_memory="256MiB", max_model_len=512, dtype="bfloat16", enforce_eager=True)
    block = llm.engine.loaded.model.layers[0].mlp
    native = native_experts(cpu_ops.load(), block)
    xs = [torch.randn(1, block.router.in_features, dtype=torch.bfloat16) for _ in range(64)]
    expert = block.experts[0]
    read = block.top_k * (expert.gate_up.weight_bytes + expert.down.weight_bytes)

    def seconds(layer: torch.nn.Module, calls: int = 200) -> float:
        for x in xs[:20]:
            layer(x)
        start = time.perf_counter()
        for i in range(calls):
            layer(xs[i % len(xs)])
        return (time.perf_counter() - start) / calls

    with torch.inference_mode():
        assert all(torch.equal(native(x), block(x)) for x in xs[:8])
        for _ in range(2):
            stack, python = seconds(native), seconds(block)
            print(f"{torch.get_num_threads()} threads, {read / 1e6:.1f} MB of experts a call: "
                  f"stack {stack * 1e6:.0f} us ({read / stack / 1e9:.1f} GB/s), "
                  f"Python block {python * 1e6:.0f} us ({read / python / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
