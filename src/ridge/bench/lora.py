"""`ridge bench lora`: what serving LoRA adapters costs a decode step, beside the base model and HF PEFT's batches.

On one model, --adapters random adapters of --rank over every projection of every layer are written as PEFT
directories. Then the decode time per step of --batch sequences of --context tokens (prompts prefilled first,
untimed; --steps steps timed) for: the base model on an engine without --enable-lora (the fused decode step), the
base model on an engine with it (its steps take the same fused path), every sequence with one adapter, and the
sequences spread over all the adapters (max_loras of them), each with the bytes a step reads (weights, the
adapters in the step, the KV cache) as a fraction of the machine's measured read bandwidth. Beside them, HF
transformers with PEFT's mixed-adapter batches on the same prompts (where peft is installed; --skip-peer leaves it
out). The question it answers: what do N fine-tunes served from one base cost against the base alone, and in
memory against N merged copies.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from ridge.bench.kv_formats import add_decode_step_args, decode_step_len, decode_step_ms
from ridge.plan import arithmetic, roofline

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(cfg, folder: Path, rank: int, seed: int, scale: float = 0.02) -> Path:
    """A PEFT LoRA directory of `rank` over every projection of every layer of a dense attention model (`cfg`, a
    ModelConfig), its factors drawn (B's entries of deviation `scale`: small, as a fine-tune's):
    adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file

    if cfg.num_experts or cfg.ssm_layers or cfg.is_mla or cfg.kv_shared_layers or not cfg.gated_mlp:
        raise ValueError(f"model: bench lora writes adapters for dense attention models with gated MLPs, not "
                         f"{cfg.architecture}")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        q = cfg.num_heads * cfg.layer_head_dim(layer)
        kv = cfg.layer_kv_heads(layer) * cfg.layer_head_dim(layer)
        hidden, inner = cfg.hidden_size, cfg.intermediate_size
        shapes = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv),
                  "self_attn.o_proj": (q, hidden), "mlp.gate_proj": (hidden, inner), "mlp.up_proj": (hidden, inner),
                  "mlp.down_proj": (inner, hidden)}
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * fan_in**-0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(PROJECTIONS), "bias": "none", "use_rslora": False, "use_dora": False}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


def cmd_lora(args: argparse.Namespace) -> int:
    from ridge import LLM, LoRARequest
    from ridge.flags import engine_kwargs
    from ridge.linear import model_weight_bytes

    print(f"[bench] measuring the read bandwidth of {args.device} ...", file=sys.stderr)
    roof = roofline.measure(dtypes=(), device=args.device)
    kwargs = {**engine_kwargs(args), "enable_prefix_caching": False, "enable_lora": False, "lora_modules": (),
              "max_model_len": decode_step_len(args)}
    scratch = Path(tempfile.mkdtemp(prefix="ridge-bench-lora-"))
    rows = []
    llm = LLM(args.model, progress=not args.json, **kwargs)
    cfg, spec = llm.engine.loaded.config, llm.engine.loaded.spec
    folders = [write_random_adapter(cfg, scratch / f"adapter{i}", args.rank, i) for i in range(args.adapters)]
    requests = [LoRARequest(f"adapter{i}", i + 1, str(folder)) for i, folder in enumerate(folders)]
    weight_bytes = model_weight_bytes(llm.engine.loaded.model, args.batch)
    dtype = llm.engine.config.torch_dtype
    kv_bytes = args.batch * arithmetic.kv_bytes(spec, "bf16" if dtype.itemsize == 2 else "fp32", args.context)

    def measure(name: str, engine, adapters: list | None) -> None:
        ms = decode_step_ms(engine, args.context, args.batch, args.steps, adapters)
        used = {r.lora_name: r for r in adapters or () if r is not None}
        adapter_bytes = sum(engine.adapters.adapters[engine.adapters.index(r)].nbytes for r in used.values())
        rows.append({"variant": name, "engine": "ridge", "step_ms": ms, "tok_s": args.batch * 1e3 / ms,
                     "step_bytes": weight_bytes + adapter_bytes + kv_bytes, "adapters_in_step": len(used)})

    print("[bench] ridge: the base model without --enable-lora", file=sys.stderr)
    measure("base model, no --enable-lora", llm.engine, None)
    del llm
    gc.collect()
    llm = LLM(args.model, progress=not args.json, **{
        **kwargs, "lora_modules": tuple(f"{r.lora_name}={r.lora_path}" for r in requests), "max_loras": args.adapters})
    engine = llm.engine
    spread = [requests[i % args.adapters] for i in range(args.batch)]
    for name, adapters in (("base model, --enable-lora", [None] * args.batch),
                           ("1 adapter", [requests[0]] * args.batch),
                           (f"{args.adapters} adapters", spread)):
        print(f"[bench] ridge: {name}", file=sys.stderr)
        measure(name, engine, adapters)
    adapter_mib = engine.adapters.adapters[0].nbytes / 2**20
    del llm, engine
    gc.collect()
    peer = None if args.skip_peer else hf_peft_rows(args, folders, dtype)
    if isinstance(peer, str):
        print(f"[bench] HF PEFT: {peer}", file=sys.stderr)
    else:
        rows.extend(peer or [])
    for row in rows:
        row["read_fraction"] = row["step_bytes"] / (row["step_ms"] / 1e3) / 1e9 / roof.read_gb_s if row.get(
            "step_bytes") else None
    report = {"benchmark": "lora", "model": args.model, "context": args.context, "batch": args.batch,
              "rank": args.rank, "adapters": args.adapters, "adapter_mib": adapter_mib,
              "weight_mib": weight_bytes / 2**20, "machine": dataclasses.asdict(roof), "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"\n{args.model}: {args.batch} sequences of {args.context} tokens decoding; {args.adapters} adapters of rank "
          f"{args.rank} on every projection, {adapter_mib:.1f} MiB each beside {weight_bytes / 2**20:.0f} MiB of "
          f"weights; read bandwidth {roof.read_gb_s:.1f} GB/s")
    for line in lora_table(report):
        print(line)
    return 0


def hf_peft_rows(args: argparse.Namespace, folders: list[Path], dtype: torch.dtype) -> list[dict] | str:
    """HF transformers with PEFT's adapters over the same prompts: base, one adapter, all of them mixed in one batch
    (PEFT's adapter_names); a decode step's time from two generate calls' difference. A reason where it cannot."""
    try:
        from peft import PeftModel
    except ImportError:
        return "peft is not installed (pip install peft); left out"
    from ridge.bench.hf_models import hf_causal_lm
    from ridge.engine.loading import ModelFile

    print("[bench] HF PEFT: loading the model", file=sys.stderr)
    model = hf_causal_lm(ModelFile.open(args.model).path)
    if isinstance(model, str):
        return model
    model = model.to(dtype).eval()
    model = PeftModel.from_pretrained(model, str(folders[0]), adapter_name="adapter0")
    for i, folder in enumerate(folders[1:], start=1):
        model.load_adapter(str(folder), adapter_name=f"adapter{i}")
    rng = random.Random(args.context)
    vocab = model.config.vocab_size
    prompts = torch.tensor([[rng.randrange(10, vocab - 10) for _ in range(args.context)] for _ in range(args.batch)])

    def step_ms(names: list[str]) -> float:
        times = []
        for tokens in (2, 2 + args.steps):
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=tokens,
                               min_new_tokens=tokens, do_sample=False, adapter_names=names)
            times.append(time.perf_counter() - start)
        return 1e3 * (times[1] - times[0]) / args.steps

    rows = []
    for name, names in (("base model", ["__base__"] * args.batch), ("1 adapter", ["adapter0"] * args.batch),
                        (f"{args.adapters} adapters", [f"adapter{i % args.adapters}" for i in range(args.batch)])):
        print(f"[bench] HF PEFT: {name}", file=sys.stderr)
        ms = step_ms(names)
        rows.append({"variant": name, "engine": "HF PEFT", "step_ms": ms, "tok_s": args.batch * 1e3 / ms})
    return rows


def lora_table(report: dict) -> list[str]:
    rows = report["rows"]
    base = rows[0]
    lines = ["| engine | sequences run with | decode ms a step | tok/s | vs ridge's base | MB a step reads | "
             "of read bandwidth |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        read = f"{r['step_bytes'] / 1e6:,.0f} | {100 * r['read_fraction']:.0f}%" if r.get("step_bytes") else "- | -"
        lines.append(f"| {r['engine']} | {r['variant']} | {r['step_ms']:.1f} | {r['tok_s']:.1f} | "
                     f"{base['step_ms'] / r['step_ms']:.2f}x | {read} |")
    return lines


def add_lora_parser(bsub, add_engine_args) -> None:
    p = bsub.add_parser("lora", help="LoRA adapters: a decode step's cost with one and with several adapters, beside "
                                     "the base model and HF PEFT", description=__doc__.split("\n\n", 1)[1],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--adapters", type=int, default=4, help="adapters written and mixed (default %(default)s)")
    p.add_argument("--rank", type=int, default=16, help="each adapter's rank (default %(default)s)")
    add_decode_step_args(p, context=256)
    p.add_argument("--skip-peer", action="store_true", help="leave HF PEFT out")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_lora)
