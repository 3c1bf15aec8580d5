"""The quantized matmul kernels alone on a GPU, at one row (a batch-1 decode's GEMVs) or --rows, on a model's
four shapes: each tuning candidate's time and HBM rate, against cuBLAS on the bfloat16 weight and torch's CUDA
int4 kernel (tinygemm), every call reading weights from HBM (copies larger than L2 read in turn).

    python scripts/quant_kernels.py [--hidden 4096 --intermediate 14336 --kv-heads 8 --head-dim 128 --rows 1]

Run by scripts/gpu-check.sh (part `kernels`); prints a table and writes JSON to $OUT/kernels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from ridge.linear import int4pack  # noqa: E402
from ridge.linear.triton import TritonQuantLinear  # noqa: E402
from ridge.quant.methods import quantize_weight  # noqa: E402
from ridge.triton_kernels import quant_matmul, quant_tuning  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rows", type=int, default=1)
    args = parser.parse_args()
    device = torch.device("cuda")
    mp = torch.cuda.get_device_properties(device).multi_processor_count
    h = args.hidden
    shapes = {"qkv": ((args.heads + 2 * args.kv_heads) * args.head_dim, h), "o": (h, args.heads * args.head_dim),
              "gate_up": (2 * args.intermediate, h), "down": (h, args.intermediate)}
    tuner = quant_tuning.Tuner()
    results = []
    torch.manual_seed(0)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        x = torch.randn(args.rows, k, device=device, dtype=torch.bfloat16)
        dense = quant_tuning.weight_copies(w, device, lambda t: t.nbytes)
        ms = do_bench_cudagraph(quant_tuning.cycling(dense, lambda t, x=x: F.linear(x, t)), rep=20)
        results.append(dict(shape=name, n=n, k=k, format="bf16", config="cuBLAS", ms=ms, gb_s=w.nbytes / ms / 1e6))
        for fmt, group in (("int8", None), ("fp8", None), ("int4", 32), ("int4", 128)):
            qw = quantize_weight(w.float(), fmt, group or 32, None)
            layer = TritonQuantLinear(qw, None, torch.bfloat16, device)
            label = fmt if group is None else f"{fmt}-g{group}"
            if layer.int4pack is not None:  # tinygemm (and widened for cuBLAS), then Triton on the same codes
                packed = (layer.int4pack, layer.scales_and_zeros)
                ways = {"tinygemm": lambda p, x=x, g=group: int4pack.multiply(x, *p, g),
                        "widened + cuBLAS": lambda p, x=x, g=group: x @ int4pack.dense(*p, g, x.dtype).T}
                if args.rows <= quant_matmul.GEMV_MAX_ROWS:
                    del ways["widened + cuBLAS"]
                nbytes = layer.weight_bytes
                for way, ms in tuner.timings(ways, packed, lambda p: p[0].nbytes + p[1].nbytes, device).items():
                    results.append(dict(shape=name, n=n, k=k, format=label, config=way, ms=ms, gb_s=nbytes / ms / 1e6))
                weight = quant_matmul.PackedWeight(quant_matmul.pack_nibbles(qw.qweight.to(torch.uint8)),
                                                   quant_matmul.NIBBLES, qw.scales.half(), qw.minimums.half(), group, n)
            else:
                weight = quant_matmul.PackedWeight(layer.codes, layer.kind, layer.scales, layer.minimums,
                                                   layer.group_size, n)
            nbytes = sum(t.nbytes for t in (weight.codes, weight.scales, weight.minimums) if t is not None)
            options = {c: (lambda w, c=c, x=x: quant_matmul.quant_matmul(x, w, c, mp))
                       for c in tuner.candidates(x, weight)}
            timings = tuner.timings(options, weight, lambda w: w.codes.nbytes, device)
            for config, ms in sorted(timings.items(), key=lambda item: item[1]):
                results.append(dict(shape=name, n=n, k=k, format=label, config=str(config), ms=ms,
                                    gb_s=nbytes / ms / 1e6))
    best: dict[tuple[str, str], dict] = {}
    for r in results:
        key = (r["shape"], r["format"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    print(f"{'shape':<8} {'format':<9} {'best us':>8} {'GB/s':>7}  config")
    for (shape, fmt), r in best.items():
        print(f"{shape:<8} {fmt:<9} {r['ms'] * 1e3:8.1f} {r['gb_s']:7.0f}  {r['config']}")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "kernels.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": args.rows, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
