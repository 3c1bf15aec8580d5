"""`ridge plan` for an encoder (BERT, RoBERTa, XLM-RoBERTa: embedding models and cross-encoders): no decode and no
KV kept between requests, a batch of prompts embedded in one pass whose every token attends to all the others. What
binds is that pass: its weights read once for the batch against its FLOPs, which grow with the tokens it holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ridge.plan import arithmetic as a
from ridge.plan.advice import Advice
from ridge.plan.report import KERNELS_PER_LAYER, LAUNCH_SECONDS, Parameters, Phase, _phase, _seconds, _si
from ridge.plan.specs import HardwareSpec, ModelSpec, Workload, dtype_bytes

CONVENTIONS = ("FLOPs count a multiply-accumulate as 2; an encoder's attention scores every pair of a prompt's "
               "tokens (T^2); a pass reads every weight once for its whole batch, and its activations are not "
               "counted; no output head (a classifier's is a rounding); GB = 1e9 bytes; bounds assume ideal kernels.")


@dataclass(frozen=True)
class EncoderPlan:
    model: ModelSpec
    hardware: HardwareSpec
    workload: Workload
    conventions: str
    parameters: Parameters
    weight_bytes: float
    usable_bytes: float
    fits: bool
    prompt_tokens: int  # the workload's prompt, within the model's positions
    ridge_point: float
    embed: Phase  # one pass of `batch` prompts
    attention_flops: float  # of the pass
    attention_overtakes_at: int | None  # the prompt length from which attention's FLOPs pass the linear layers'
    prompts_per_second: float
    tokens_per_second: float
    tokens_to_ridge: int  # tokens a pass must hold for its weights' bytes to be paid by its FLOPs
    overhead_floor_seconds: float
    advice: list[Advice]

    @property
    def binding_wall(self) -> str:
        return "capacity" if not self.fits else self.embed.wall

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "binding_wall": self.binding_wall, "encoder": True}


def pass_bound(plan_model: ModelSpec, hw: HardwareSpec, workload: Workload, tokens: int, batch: int) -> a.Bound:
    """A pass of `batch` prompts of `tokens`: the weights read once, every pair of each prompt's tokens scored."""
    one = a.prefill(plan_model, tokens, bidirectional=True)
    return a.bound(a.weight_bytes(plan_model, workload.dtype), one.flops * batch, hw, a.compute_dtype(workload.dtype),
                   workload.gpus)


def build_encoder_plan(model: ModelSpec, hw: HardwareSpec, workload: Workload) -> EncoderPlan:
    model, workload = model.validate(), workload.validate()
    counts = a.count_parameters(model)
    compute = a.compute_dtype(workload.dtype)
    tokens = min(workload.prompt_tokens, model.max_position_embeddings)
    weights = a.weight_bytes(model, workload.dtype)
    usable = hw.memory_gb * 1e9 * workload.memory_utilization * workload.gpus
    one = a.prefill(model, tokens, bidirectional=True)
    floor = model.num_layers * KERNELS_PER_LAYER * LAUNCH_SECONDS if hw.name != "this-machine" else 0.0
    embed = _phase(pass_bound(model, hw, workload, tokens, workload.batch), floor)
    seconds = max(embed.seconds, floor)
    per_token = 2.0 * counts.per_token_linear
    plan = EncoderPlan(
        model=model, hardware=hw, workload=workload, conventions=CONVENTIONS,
        parameters=Parameters(counts.embeddings, counts.output_head, counts.attention, counts.ssm, counts.ffn_stored,
                              counts.ffn_active, counts.norms, counts.stored, counts.active),
        weight_bytes=weights, usable_bytes=usable, fits=weights <= usable, prompt_tokens=tokens,
        ridge_point=hw.ridge_point(compute), embed=embed, attention_flops=one.attention_flops * workload.batch,
        attention_overtakes_at=_attention_crossover(model),
        prompts_per_second=workload.batch / seconds, tokens_per_second=workload.batch * tokens / seconds,
        tokens_to_ridge=int(hw.ridge_point(compute) * weights / per_token) + 1, overhead_floor_seconds=floor,
        advice=[])
    return dataclasses.replace(plan, advice=_advice(plan))


def _attention_crossover(m: ModelSpec) -> int | None:
    """The first prompt length, within the model's positions, whose attention FLOPs pass its linear layers'."""
    def larger(t: int) -> bool:
        one = a.prefill(m, t, bidirectional=True)
        return one.attention_flops > one.linear_flops

    low, high = 1, m.max_position_embeddings
    if not larger(high):
        return None
    while low < high:
        mid = (low + high) // 2
        low, high = (mid + 1, high) if not larger(mid) else (low, mid)
    return low


def _advice(plan: EncoderPlan) -> list[Advice]:
    w, wall = plan.workload, plan.binding_wall
    pass_tokens = w.batch * plan.prompt_tokens
    advice = []
    trap = "a larger batch waits longer to fill: a request's latency grows with the batch it joins"
    if wall == "bandwidth":
        advice.append(Advice(
            "batch more prompts a pass", wall, min(plan.tokens_to_ridge / pass_tokens, 64.0),
            f"a pass of {pass_tokens:,} tokens reads the {_si(plan.weight_bytes, 'B')} of weights for too little "
            f"work: from ~{plan.tokens_to_ridge:,} tokens a pass (--max-num-batched-tokens) its FLOPs pay for them, "
            "and the prompts/s ceiling grows with the batch until then", trap))
    if wall == "overhead":
        enough = int(pass_tokens * plan.overhead_floor_seconds / plan.embed.seconds) + 1
        advice.append(Advice(
            "batch more prompts a pass", wall, min(enough / pass_tokens, 64.0),
            f"the pass's kernel launches ({_seconds(plan.overhead_floor_seconds)}) outlast its arithmetic "
            f"({_seconds(plan.embed.seconds)}): from ~{enough:,} tokens a pass (--max-num-batched-tokens) the work "
            "covers them, and the prompts/s ceiling grows with the batch until then", trap))
    compute = a.compute_dtype(w.dtype)
    eight_bit = max(plan.hardware.flops(d) for d in ("int8", "fp8")) / plan.hardware.flops(compute)
    if wall == "compute" and dtype_bytes(w.dtype) > dtype_bytes("int8") and eight_bit > 1:
        advice.append(Advice(
            f"8-bit weights and activations ({w.dtype} -> int8 / fp8)", "compute", eight_bit,
            f"the pass is compute-bound: this hardware's 8-bit matmuls run {eight_bit:.1f}x its {compute} FLOP/s",
            "embeddings move with the rounding: check retrieval quality (the cosine between the two engines' "
            "vectors, `ridge bench embed`)"))
    if plan.attention_overtakes_at and plan.prompt_tokens >= plan.attention_overtakes_at:
        advice.append(Advice(
            "shorter chunks of text", "compute", plan.prompt_tokens / plan.attention_overtakes_at,
            f"from {plan.attention_overtakes_at:,} tokens a prompt's attention (every pair of its tokens) costs more "
            "than its linear layers: documents split into passages cost less per token",
            "a passage's embedding no longer sees the rest of its document"))
    return sorted(advice, key=lambda adv: -adv.gain)


def render_encoder(plan: EncoderPlan) -> str:
    m, hw, w, p = plan.model, plan.hardware, plan.workload, plan.parameters
    cut = (f" (the {w.prompt_tokens:,} asked for, cut to the model's positions)"
           if plan.prompt_tokens < w.prompt_tokens else "")
    lines = [
        f"{m.name} (an encoder: every token attends to all the others; embeddings and scores) on {hw.name}"
        f"{f' x {w.gpus}' if w.gpus > 1 else ''}: weights {w.dtype}, prompts of {plan.prompt_tokens:,} tokens{cut}, "
        f"batch {w.batch}",
        f"  model: {m.source}",
        f"  hardware: {hw.memory_gb:g} GB, {hw.bandwidth_gb_s:g} GB/s, "
        + ", ".join(f"{k} {v:g} TFLOP/s" for k, v in hw.tflops.items()) + f"  ({hw.source})",
        "",
        "parameters",
        f"  embeddings {_si(p.embeddings, '')} (a lookup), attention {_si(p.attention, '')}, "
        f"FFN {_si(p.ffn_stored, '')}",
        f"  total {_si(p.stored, '')}",
        "",
        "memory",
        f"  weights {_si(plan.weight_bytes, 'B')} at {w.dtype}; no KV kept between requests (a pass's own keys and "
        "values only)",
        f"  usable {_si(plan.usable_bytes, 'B')}: {'fits' if plan.fits else 'DOES NOT FIT'}",
        "",
        f"a pass of {w.batch} prompt{'s' if w.batch > 1 else ''} ({w.batch * plan.prompt_tokens:,} tokens)",
        f"  {_si(plan.embed.flops, 'FLOP')}; attention {_si(plan.attention_flops, 'FLOP')}"
        + (f"; attention outgrows the linear layers from {plan.attention_overtakes_at:,}-token prompts"
           if plan.attention_overtakes_at else "; attention stays below the linear layers within its positions"),
        f"  intensity {plan.embed.intensity:,.0f} FLOP/B vs ridge point {plan.ridge_point:,.0f}: "
        f"{plan.embed.wall}-bound; a pass >= {_seconds(max(plan.embed.seconds, plan.overhead_floor_seconds))}",
        f"  ceiling {plan.prompts_per_second:,.0f} prompts/s ({plan.tokens_per_second:,.0f} tokens/s); the weights "
        f"are paid by a pass's FLOPs from ~{plan.tokens_to_ridge:,} tokens",
        "",
        f"binding wall: {plan.binding_wall}",
        "recommendations (by gain)",
    ]
    for i, adv in enumerate(plan.advice, 1):
        lines.append(f"  {i}. {adv.technique} [{adv.wall}]: {adv.why}")
        if adv.trap:
            lines.append(f"     trap: {adv.trap}")
    if not plan.advice:
        lines.append("  none: the pass runs at its wall")
    lines += ["", "conventions: " + plan.conventions]
    return "\n".join(lines)
