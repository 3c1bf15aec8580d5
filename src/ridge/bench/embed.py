"""`ridge bench embed`: embeddings per second under --runner pooling, beside HF transformers' batched forward.

--num-prompts random prompts of --input-len tokens (the same ids for both engines) are embedded by ridge's
LLM.embed (--runner pooling, the prefix cache off, so that every token of every prompt is computed) and by HF
transformers' base model in batches of --hf-batch-size (the final hidden states pooled as ridge pools them: the
model's declared pooling or --pooling-type; normalized), both in the engine's dtype on the same weights, the two in
turn for --repeats rounds (each one's median: the machine's drift weighs on both alike). A decoder (Qwen3-Embedding's
shape) or an encoder (BERT, RoBERTa, XLM-RoBERTa: bge, e5, MiniLM); a random-weight model's weights are drawn once by
HF's initialiser for both. Per engine: prompts and tokens per second, the model's matmul FLOP/s on those tokens (2 x
its linear parameters a token) as a fraction of the machine's measured matmul peak, and the largest cosine distance
between the two engines' embeddings of a prompt. The question it answers: how fast does ridge turn prompts into
embeddings, and how near is it to the compute roofline that prefill runs against.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ridge.bench.hf_models import hf_causal_lm, hf_encoder, saved_random_model
from ridge.plan import arithmetic, roofline


def random_prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(count)]


class HFEmbedder:
    """HF transformers' base model of the same file, embedding prompts of equal lengths (no padding) `batch` at a
    time, pooled by `pooling` (config.POOLING_TYPES) and normalized."""

    def __init__(self, model: torch.nn.Module, batch: int, pooling: str) -> None:
        self.model, self.batch, self.pooling = model, batch, pooling

    @classmethod
    def load(cls, model_path, dtype: torch.dtype, batch: int, pooling: str, encoder: bool) -> HFEmbedder | str:
        """The embedder, warmed up; or the reason it cannot run."""
        model = hf_encoder(model_path) if encoder else hf_causal_lm(model_path)
        if isinstance(model, str):
            return model
        embedder = cls((model if encoder else model.model).to(dtype).eval(), batch, pooling)
        embedder([[10, 11]])  # the first call's one-off costs
        return embedder

    @torch.inference_mode()
    def __call__(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        out = []
        for i in range(0, len(prompts), self.batch):
            hidden = self.model(input_ids=torch.tensor(prompts[i:i + self.batch])).last_hidden_state.float()
            pooled = (hidden.mean(1) if self.pooling == "mean" else hidden[:, 0] if self.pooling == "cls"
                      else hidden[:, -1])
            out += list(torch.nn.functional.normalize(pooled, dim=-1))
        return out


def cmd_embed(args: argparse.Namespace) -> int:
    from ridge.models.random_weights import is_random

    if args.runner != "generate":  # its default: the flag was given
        raise ValueError("--runner: bench embed runs --runner pooling itself; leave the flag out")
    if not is_random(args.model) or args.skip_peer:
        return _bench(args, args.model)
    # a random-weight model: drawn once, by HF's initialiser, into a folder both engines load (the same weights)
    with tempfile.TemporaryDirectory(prefix="ridge-bench-embed-") as folder:
        print(f"[bench] drawing {args.model}'s weights for both engines ...", file=sys.stderr)
        saved = saved_random_model(args.model, Path(folder))
        if isinstance(saved, str):
            print(f"[bench] HF transformers: {saved}", file=sys.stderr)
            args.skip_peer = True
            return _bench(args, args.model)
        return _bench(args, str(saved), shown=args.model)


def _bench(args: argparse.Namespace, model: str, shown: str | None = None) -> int:
    """The benchmark on `model` (`shown` under that name)."""
    from ridge import LLM
    from ridge.flags import engine_kwargs

    kwargs = {**engine_kwargs(args), "runner": "pooling", "enable_prefix_caching": False}
    kwargs["max_model_len"] = args.input_len + 1
    llm = LLM(model, progress=not args.json, **kwargs)
    engine = llm.engine
    dtype = engine.config.torch_dtype
    print(f"[bench] measuring the {dtype} matmul peak ...", file=sys.stderr)
    peak = roofline.measure_matmul(dtype)
    prompts = random_prompts(engine.loaded.config.vocab_size, args.num_prompts, args.input_len)
    counts = arithmetic.count_parameters(engine.loaded.spec)
    # the layers' linears: no vocabulary projection (a pooling runner skips it, as HF's base model does)
    flops_per_token = 2 * (counts.active - counts.embeddings - counts.output_head - counts.norms
                           - counts.per_layer_table)
    llm.embed(prompts[:1])  # warm-up
    model_path, loaded_name = engine.loaded.path, shown or engine.config.model
    pooling, encoder = engine.pooling, not engine.loaded.config.causal
    hf = None
    if not args.skip_peer:
        print("[bench] loading HF transformers' model ...", file=sys.stderr)
        hf = HFEmbedder.load(model_path, dtype, args.hf_batch_size, pooling, encoder)
        if isinstance(hf, str):
            print(f"[bench] HF transformers: {hf}", file=sys.stderr)
            hf = None
    # the engines in turn, round after round: the machine's drift over a run weighs on both alike
    seconds: dict[str, list[float]] = {"ridge": [], "HF transformers": []}
    reference = None
    for _ in tqdm(range(args.repeats), desc="rounds", disable=args.json):
        start = time.perf_counter()
        ours = [torch.tensor(o.outputs.embedding) for o in llm.embed(prompts)]
        seconds["ridge"].append(time.perf_counter() - start)
        if hf is not None:
            start = time.perf_counter()
            reference = hf(prompts)
            seconds["HF transformers"].append(time.perf_counter() - start)
    rows = [_row(name, statistics.median(times), args, flops_per_token, peak) for name, times in seconds.items()
            if times]
    report = {"benchmark": "embed", "model": loaded_name, "pooling": pooling,
              "dtype": str(dtype).removeprefix("torch."),
              "num_prompts": args.num_prompts, "input_len": args.input_len, "hf_batch_size": args.hf_batch_size,
              "repeats": args.repeats, "matmul_peak_gflop_s": peak, "rows": rows}
    if reference is not None:
        report["max_cosine_distance"] = max(1 - float(a @ b) for a, b in zip(ours, reference, strict=True))
        report["speedup"] = rows[0]["tok_s"] / rows[1]["tok_s"]
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"\n{loaded_name}: {args.num_prompts} prompts of {args.input_len} tokens embedded ({pooling} pooling), "
          f"{report['dtype']}; matmul peak {peak:.0f} GFLOP/s")
    for line in embed_table(report):
        print(line)
    if reference is not None:
        print(f"\nridge / HF: {report['speedup']:.2f}x the tokens per second; largest cosine distance between their "
              f"embeddings {report['max_cosine_distance']:.1e}")
    return 0


def _row(engine: str, seconds: float, args: argparse.Namespace, flops_per_token: float, peak: float) -> dict:
    tokens = args.num_prompts * args.input_len
    gflop_s = flops_per_token * tokens / seconds / 1e9
    return {"engine": engine, "seconds": seconds, "prompts_s": args.num_prompts / seconds, "tok_s": tokens / seconds,
            "gflop_s": gflop_s, "roofline_fraction": gflop_s / peak}


def embed_table(report: dict) -> list[str]:
    lines = ["| engine | prompts/s | tokens/s | GFLOP/s (layer matmuls) | of matmul peak |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['engine']} | {r['prompts_s']:.1f} | {r['tok_s']:,.0f} | {r['gflop_s']:.0f} | "
              f"{r['roofline_fraction']:.0%} |" for r in report["rows"]]
    return lines


def add_embed_parser(bsub, add_engine_args) -> None:
    p = bsub.add_parser("embed", help="embeddings per second under --runner pooling, beside HF transformers",
                        description=__doc__.split("\n\n", 1)[1],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=64, help="(default %(default)s)")
    p.add_argument("--input-len", type=int, default=256, help="tokens a prompt (default %(default)s)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="prompts a forward pass of HF's (default "
                   "%(default)s)")
    add_rounds_args(p)
    p.set_defaults(func=cmd_embed)


def add_rounds_args(p: argparse.ArgumentParser) -> None:
    """The flags of a benchmark that runs ridge and HF transformers in turn for rounds (embed, vision)."""
    p.add_argument("--repeats", type=int, default=3, help="rounds of the engines in turn; each one's median "
                   "(default %(default)s)")
    p.add_argument("--skip-peer", action="store_true", help="ridge alone")
    p.add_argument("--json", action="store_true", help="print the report as JSON")

