"""Latent attention's decode calls at batch 1 (models/mla.py's LatentAttention.forward, layer by layer: the engine
runs with enforce_eager so the layers are called from Python), timed over a 64-token generation after a 100-token
prompt; compare two commits by running it from each.

    .venv/bin/python scripts/mla_layer_time.py ["random:deepseek-v2-lite,num_layers=4"]
"""

from __future__ import annotations

import sys
import time

from ridge import LLM, SamplingParams
from ridge.models import mla


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "random:deepseek-v2-lite,num_layers=4"
    llm = LLM(name, progress=False, kv_cache_memory="256MiB", max_model_len=1024, dtype="bfloat16",
              enforce_eager=True)
    forward, spent = mla.LatentAttention.forward, {"seconds": 0.0, "calls": 0}

    def timed(self, x, *args, **kwargs):  # noqa: ANN001, ANN202 - forward's own signature
        start = time.perf_counter()
        out = forward(self, x, *args, **kwargs)
        if x.shape[0] == 1:  # decode calls only
            spent["seconds"] += time.perf_counter() - start
            spent["calls"] += 1
        return out

    mla.LatentAttention.forward = timed
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for _ in range(2):
        spent.update(seconds=0.0, calls=0)
        llm.generate([list(range(5, 105))], params, use_tqdm=False)
        print(f"{spent['calls']} decode calls: {spent['seconds'] / spent['calls'] * 1e6:.0f} us a call")


if __name__ == "__main__":
    main()
