"""Recommendations: for the wall that binds, the techniques that relax it, ranked by the gain the
arithmetic predicts for this model, hardware and workload, each with the trap that comes with it.

Each rule is a function of the plan that returns an Advice or None; a rule estimates its gain as the
factor by which it would cut the binding time (or grow what fits), so rules from different walls rank
against each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ridge.plan import arithmetic as a
from ridge.plan.specs import BYTES_PER_VALUE, dtype_bytes

if TYPE_CHECKING:
    from ridge.plan.report import Plan


@dataclass(frozen=True)
class Advice:
    technique: str
    wall: str  # the wall it relaxes: capacity, bandwidth, compute, overhead
    gain: float  # predicted factor on the binding quantity (>1 is better)
    why: str
    trap: str = ""


def _weight_quantization(plan: Plan) -> Advice | None:
    w, target = plan.workload, "int4"
    if dtype_bytes(w.dtype) <= dtype_bytes(target):
        return None
    ratio = dtype_bytes(w.dtype) / dtype_bytes(target)
    trap = ("int4 costs quality on small models (measure perplexity: `ridge eval ppl`); dequantizing in the "
            "kernel must not make large batches compute-bound")
    name = f"weight quantization ({w.dtype} -> int8 / {target})"
    if not plan.memory.fits:
        freed = plan.memory.weight_bytes * (1 - 1 / ratio)
        return Advice(name, "capacity", ratio, f"weights take {plan.memory.weight_bytes / 1e9:.1f} GB; {target} "
                      f"frees {freed / 1e9:.1f} GB for KV", trap)
    if plan.decode.wall != "bandwidth":
        return None
    weights_share = a.decode_weight_bytes(plan.model, w.dtype, w.batch) / plan.decode.bytes
    gain = 1 / (1 - weights_share + weights_share / ratio)
    return Advice(name, "bandwidth", gain, f"weights are {weights_share:.0%} of the bytes a decode step reads; "
                  f"{target} cuts them {ratio:.0f}x: up to {gain:.2f}x decode speed", trap)


def _kv_quantization(plan: Plan) -> Advice | None:
    w, mem = plan.workload, plan.memory
    if w.kv_dtype not in BYTES_PER_VALUE or dtype_bytes(w.kv_dtype) <= 1:  # quantized already (or one of ridge's)
        return None
    kv_share = w.batch * mem.kv_bytes_per_sequence / plan.decode.bytes
    ratio = dtype_bytes(w.kv_dtype) / 1
    if kv_share < 0.2 and mem.fits:
        return None
    gain = 1 / (1 - kv_share + kv_share / ratio)
    wall = "capacity" if not mem.fits or kv_share > 0.5 else "bandwidth"
    mha = (f"; this model is MHA: a GQA model with {plan.model.num_heads // 8} KV heads would hold 8x less"
           if plan.model.attention_kind == "MHA" and plan.model.num_heads >= 8 else "")
    return Advice("KV-cache quantization (fp8 / int8)", wall, max(gain, ratio if wall == "capacity" else gain),
                  f"KV is {kv_share:.0%} of decode bytes at {w.context:,} tokens x {w.batch}; 8-bit KV halves it "
                  f"and doubles the sequences that fit{mha}",
                  "per-head scales needed; long-context retrieval degrades first")


def _batching(plan: Plan) -> Advice | None:
    w, mem = plan.workload, plan.memory
    if plan.decode.wall != "bandwidth" or mem.max_batch <= w.batch:
        return None
    def step(batch: int) -> a.Bound:
        return a.step_bound(plan.model, plan.hardware, w, batch)

    target = w.batch  # doubled while the step stays bandwidth-bound and the batch fits
    while target * 2 <= min(mem.max_batch, 4096) and step(target * 2).wall == "bandwidth":
        target *= 2
    if target == w.batch:
        return None
    tokens_per_second = target / max(step(target).seconds, plan.overhead_floor_seconds)
    gain = tokens_per_second / plan.decode_tokens_per_second
    return Advice(f"continuous batching up to ~{target} sequences", "bandwidth", gain,
                  f"a step reads the weights once for the whole batch: throughput grows ~{gain:.1f}x until KV bytes "
                  f"or compute dominate (largest batch that fits: {mem.max_batch})",
                  "per-token latency rises with the batch; paged KV keeps fragmentation from capping it")


def _speculation(plan: Plan) -> Advice | None:
    w = plan.workload
    if plan.decode.wall == "compute":
        return Advice("no speculative decoding at this batch", "compute", 1.0,
                      "the step is already compute-bound: verifying k drafted tokens costs ~k x the compute",
                      "speculation pays at small batch only")
    accept, k, cost = 0.7, 4, 0.05
    plain = plan.decode.seconds
    verify = a.step_bound(plan.model, plan.hardware, w, w.batch, k + 1).seconds
    gain = a.speculative_speedup(accept, k, cost, verify / plain)
    if gain <= 1.05:
        return None
    return Advice("speculative decoding (draft model or n-gram)", "bandwidth", gain,
                  f"at a={accept}, k={k} and a drafter at {cost:.0%} of the target: ~{gain:.2f}x per sequence "
                  f"(verifying {k + 1} tokens costs {verify / plain:.2f}x a step here); see `ridge plan spec`",
                  "acceptance is workload-specific; as the batch grows verification turns compute-bound and "
                  "speculation slows decoding (`ridge plan spec` shows where)")


def _tensor_parallel(plan: Plan) -> Advice | None:
    mem, w = plan.memory, plan.workload
    if mem.fits:
        return None
    need = plan.memory.weight_bytes + mem.kv_bytes_total
    per_gpu = plan.hardware.memory_gb * 1e9 * w.memory_utilization
    gpus = max(2, int(-(-need // per_gpu)))
    return Advice(f"tensor parallelism over {gpus} GPUs", "capacity", gpus / w.gpus,
                  f"weights + KV need {need / 1e9:.0f} GB; one {plan.hardware.name} offers {per_gpu / 1e9:.0f} GB",
                  "all-reduce per layer: needs NVLink-class links; over PCIe it can eat the gain")


def _overhead(plan: Plan) -> Advice | None:
    if plan.decode.wall != "overhead":
        return None
    bound = max(plan.decode.memory_seconds, plan.decode.compute_seconds)
    return Advice("CUDA graphs / fused kernels", "overhead", plan.overhead_floor_seconds / max(bound, 1e-12),
                  f"the roofline bound per step ({bound * 1e6:.0f} us) is below ~{plan.model.num_layers} layers x "
                  f"kernel launches ({plan.overhead_floor_seconds * 1e6:.0f} us): launches, not bytes, set the pace",
                  "graphs need static shapes: capture per batch size")


def _prefill(plan: Plan) -> Advice | None:
    w = plan.workload
    per_token = plan.prefill.seconds / w.prompt_tokens
    if w.tpot_target is not None:
        if plan.prefill.seconds <= w.tpot_target:
            return None
        chunk = max(int((w.tpot_target - plan.decode.seconds) / per_token), 0)
        why = (f"one {w.prompt_tokens:,}-token prefill takes >= {plan.prefill.seconds * 1e3:.0f} ms, over the "
               f"{w.tpot_target * 1e3:g} ms TPOT target: in chunks of <= {chunk:,} tokens beside the decode step "
               "no running request waits longer" if chunk else
               f"even one prompt token beside the {plan.decode.seconds * 1e3:.1f} ms decode step breaks the "
               f"{w.tpot_target * 1e3:g} ms TPOT target: separate prefill from decode (disaggregation)")
        return Advice("chunked prefill", "compute", plan.prefill.seconds / w.tpot_target, why,
                      "smaller chunks re-read the weights more often: prefill throughput drops")
    if plan.prefill.seconds < 4 * plan.decode.seconds:
        return None
    steps = plan.prefill.seconds / plan.decode.seconds
    return Advice("chunked prefill", "compute", min(steps, 8.0),
                  f"one {w.prompt_tokens:,}-token prefill takes >= {plan.prefill.seconds * 1e3:.0f} ms, "
                  f"{steps:.0f} decode steps: unchunked it stalls every running sequence's next token "
                  "(--tpot-ms sizes the chunk)",
                  "smaller chunks re-read the weights more often; pick the chunk from the TPOT target")


def _attention_kernel(plan: Plan) -> Advice | None:
    t = plan.attention_overtakes_at
    if t is None or plan.workload.prompt_tokens < t / 2:
        return None
    share = plan.prefill_attention_flops / plan.prefill.flops
    # the gain is the share it addresses (its T^2 score traffic), not a FLOP saving: it moves no fewer FLOPs
    return Advice("FlashAttention-style fused attention", "compute", 1 + share,
                  f"attention is {share:.0%} of prefill FLOPs at "
                  f"{plan.workload.prompt_tokens:,} tokens (it overtakes the linear layers at {t:,})",
                  "an unfused kernel writes T^2 scores to memory and turns bandwidth-bound")


def _prefix_caching(plan: Plan) -> Advice | None:
    shared = plan.workload.shared_prefix
    if shared < 0.3:
        return Advice("prefix caching: only with a high shared fraction", "compute", 1.0,
                      f"--shared-prefix {shared:.0%}: too little prompt is shared for cached prefixes to pay",
                      "the cache holds KV blocks other sequences could use") if shared else None
    return Advice("prefix caching with cache-aware scheduling", "compute", 1 / (1 - shared + 1e-9),
                  f"{shared:.0%} of prompt tokens are shared: their prefill (and TTFT share) disappears",
                  "route requests that share a prefix to the same replica, or the hit rate collapses")


def _moe(plan: Plan) -> Advice | None:
    if plan.prefill.wall != "compute" or plan.model.is_moe:
        return None
    # a different model, not a setting: ranked last (gain 1), named because compute binds
    return Advice("an MoE model of the same quality", "compute", 1.0,
                  "compute binds prefill: a mixture of experts runs a fraction of its parameters per token",
                  "MoE stores every expert: memory and the decode bytes at large batch grow")


RULES: list[Callable[[Plan], Advice | None]] = [
    _tensor_parallel, _weight_quantization, _kv_quantization, _batching, _speculation, _overhead, _prefill,
    _attention_kernel, _prefix_caching, _moe,
]


def recommend(plan: Plan) -> list[Advice]:
    """The binding wall's advice first (a model that does not fit must fit before it can be fast), then by
    predicted gain."""
    advice = [adv for rule in RULES if (adv := rule(plan)) is not None]
    return sorted(advice, key=lambda adv: (adv.wall != plan.binding_wall, -adv.gain))
