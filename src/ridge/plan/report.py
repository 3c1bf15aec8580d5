"""`ridge plan`: a model on a machine under a workload, sized and bounded phase by phase.

build_plan does the arithmetic (plan/arithmetic.py) for one workload and returns a Plan, a tree of small
dataclasses that `--json` prints as it is; render() writes it for a terminal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ridge.plan import arithmetic as a
from ridge.plan.advice import Advice, recommend
from ridge.plan.specs import HardwareSpec, ModelSpec, Workload, resolve_link

CONVENTIONS = ("FLOPs count a multiply-accumulate as 2 (MACs = FLOPs / 2); causal attention scores T^2/2 pairs; "
               "prefill computes the last position's logits only; decode reads every stored weight once per "
               "step except an untied input embedding table, and in MoE layers the experts the batch routes to; "
               "GB = 1e9 bytes; bounds assume ideal kernels (no overhead); with --gpus, bandwidth and FLOP/s add "
               "up across the GPUs and each pass pays tensor parallelism's ring all-reduces over --link (one after "
               "each layer's attention and FFN, of tokens x hidden activations: 2(n-1) latencies + 2(n-1)/n of the "
               "bytes over the link each) and the logits' gather, not overlapped with compute.")
# GPU kernels a decoder layer launches per step without CUDA graphs or fusion (norms, projections,
# attention, activation, residuals), and what one launch costs: the floor below which a step is
# overhead-bound whatever its bytes
KERNELS_PER_LAYER, LAUNCH_SECONDS = 12, 5e-6


@dataclass(frozen=True)
class Parameters:
    embeddings: int
    output_head: int
    attention: int
    ssm: int
    ffn_stored: int
    ffn_active: int
    norms: int
    stored: int
    active: int
    per_layer_table: int = 0  # per-layer embeddings (Gemma 4's E models): the table, a lookup
    per_layer_linear: int = 0  # and the projections that make and gate each layer's input


@dataclass(frozen=True)
class Memory:
    weight_bytes: float
    kv_bytes_per_token: float
    state_bytes_per_sequence: float  # state-space layers' recurrent state, whatever the context
    kv_bytes_per_sequence: float  # at the workload's context, the recurrent state included
    kv_bytes_total: float  # x batch
    usable_bytes: float  # device memory x utilization x gpus
    fits: bool
    max_batch: int  # sequences at this context that fit after the weights


@dataclass(frozen=True)
class Phase:
    bytes: float
    flops: float
    intensity: float  # FLOPs per byte
    memory_seconds: float
    compute_seconds: float
    seconds: float  # the bound: the larger of the two
    wall: str  # bandwidth, compute or overhead


@dataclass(frozen=True)
class Scaling:
    gpus: int
    step_seconds: float  # a decode step: the bound split over the GPUs, plus its communication
    communication_seconds: float
    tokens_per_second: float


@dataclass(frozen=True)
class TensorParallel:
    """What --gpus costs in communication, and where adding GPUs stops paying."""

    link: str
    link_bandwidth_gb_s: float
    link_latency_us: float
    allreduces_per_pass: int
    decode_bytes_per_allreduce: float
    decode_communication_seconds: float  # per step
    prefill_communication_seconds: float
    scaling: list[Scaling]  # decode at the workload's batch over 1, 2, 4, ... GPUs
    stops_paying_at: int | None  # the first GPU count that gains less than 10% over half as many


# a doubling of GPUs that speeds decode up by less than this no longer pays for itself
WORTH_A_DOUBLING = 1.1


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    hardware: HardwareSpec
    workload: Workload
    conventions: str
    parameters: Parameters
    memory: Memory
    ridge_point: float  # the hardware's FLOPs per byte at the compute dtype
    prefill: Phase
    prefill_macs: float
    prefill_attention_flops: float
    attention_overtakes_at: int | None  # prompt length where attention FLOPs pass the linear ones
    decode: Phase  # one step of `batch` sequences
    decode_bytes_per_token: float
    decode_tokens_per_second: float  # the ceiling, all sequences together
    overhead_floor_seconds: float
    cost_per_million_tokens: float | None
    advice: list[Advice]
    tensor_parallel: TensorParallel | None = None  # with --gpus above 1

    @property
    def binding_wall(self) -> str:
        """Capacity when the workload does not fit (nothing else matters until it does), else decode's wall."""
        return "capacity" if not self.memory.fits else self.decode.wall

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "binding_wall": self.binding_wall}


def _phase(bound: a.Bound, overhead_floor: float) -> Phase:
    wall = "overhead" if bound.seconds < overhead_floor else bound.wall
    return Phase(bound.bytes, bound.flops, bound.intensity, bound.memory_s, bound.compute_s, bound.seconds, wall)


def build_plan(model: ModelSpec, hw: HardwareSpec, workload: Workload) -> Plan:
    model, workload = model.validate(), workload.validate()
    counts = a.count_parameters(model)
    compute = a.compute_dtype(workload.dtype)
    weights = a.weight_bytes(model, workload.dtype)
    kv_token = a.kv_bytes_per_token(model, workload.kv_dtype)
    kv_sequence = a.sequence_cache_bytes(model, workload.kv_dtype, workload.context)
    usable = hw.memory_gb * 1e9 * workload.memory_utilization * workload.gpus
    memory = Memory(weights, kv_token, a.state_bytes(model), kv_sequence, kv_sequence * workload.batch, usable,
                    fits=weights + kv_sequence * workload.batch <= usable,
                    max_batch=max(int((usable - weights) // kv_sequence), 0))
    floor = model.num_layers * KERNELS_PER_LAYER * LAUNCH_SECONDS if hw.name != "this-machine" else 0.0

    fill = a.prefill(model, workload.prompt_tokens)
    prompt_kv = a.sequence_cache_bytes(model, workload.kv_dtype, workload.prompt_tokens)
    prefill_phase = _phase(a.bound(a.decode_weight_bytes(model, workload.dtype, workload.prompt_tokens) + prompt_kv,
                                   fill.flops, hw, compute, workload.gpus), floor)

    step = a.step_bound(model, hw, workload, workload.batch)
    decode_phase = _phase(step, floor)
    tp = _tensor_parallel(model, hw, workload, floor) if workload.gpus > 1 else None
    step_seconds = max(step.seconds, floor) + (tp.decode_communication_seconds if tp else 0.0)
    tokens_per_second = workload.batch / step_seconds
    priced = workload.throughput or tokens_per_second
    cost = (a.cost_per_million_tokens(workload.price_per_hour, priced)
            if workload.price_per_hour is not None else None)
    plan = Plan(
        model=model, hardware=hw, workload=workload, conventions=CONVENTIONS,
        parameters=Parameters(counts.embeddings, counts.output_head, counts.attention, counts.ssm, counts.ffn_stored,
                              counts.ffn_active, counts.norms, counts.stored, counts.active,
                              counts.per_layer_table, counts.per_layer_linear),
        memory=memory, ridge_point=hw.ridge_point(compute), prefill=prefill_phase, prefill_macs=fill.macs,
        prefill_attention_flops=fill.attention_flops, attention_overtakes_at=a.attention_crossover(model),
        decode=decode_phase, decode_bytes_per_token=step.bytes / workload.batch,
        decode_tokens_per_second=tokens_per_second, overhead_floor_seconds=floor,
        cost_per_million_tokens=cost, advice=[], tensor_parallel=tp)
    return dataclasses.replace(plan, advice=recommend(plan))


def _tensor_parallel(model: ModelSpec, hw: HardwareSpec, workload: Workload, floor: float) -> TensorParallel:
    link = resolve_link(hw, workload.link)
    activation = 4.0 if a.compute_dtype(workload.dtype) == "fp32" else 2.0
    scaling, gpus = [], 1
    while gpus <= max(8, workload.gpus):
        at = dataclasses.replace(workload, gpus=gpus)
        bound = a.step_bound(model, hw, at, workload.batch)
        comm = a.tp_communication(model, workload.batch, workload.batch, gpus, link, activation).seconds
        seconds = max(bound.seconds, floor) + comm
        scaling.append(Scaling(gpus, seconds, comm, workload.batch / seconds))
        gpus *= 2
    stops = next((s.gpus for before, s in zip(scaling, scaling[1:], strict=False)
                  if s.tokens_per_second < WORTH_A_DOUBLING * before.tokens_per_second), None)
    decode = a.tp_communication(model, workload.batch, workload.batch, workload.gpus, link, activation)
    prefill = a.tp_communication(model, workload.prompt_tokens, 1, workload.gpus, link, activation)
    return TensorParallel(link.name, link.bandwidth_gb_s, link.latency_us, decode.allreduces,
                          decode.bytes_per_allreduce, decode.seconds, prefill.seconds, scaling, stops)


def _si(x: float, unit: str) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def render(plan: Plan) -> str:
    m, hw, w, p, mem = plan.model, plan.hardware, plan.workload, plan.parameters, plan.memory
    gpus = f" x {w.gpus}" if w.gpus > 1 else ""
    lines = [
        f"{m.name} ({m.attention_kind}{', MoE' if m.is_moe else ''}{', state space' if m.ssm_layers else ''}) on "
        f"{hw.name}{gpus}: weights {w.dtype}, "
        f"KV {w.kv_dtype}, context {w.context:,}, batch {w.batch}",
        f"  model: {m.source}",
        f"  hardware: {hw.memory_gb:g} GB, {hw.bandwidth_gb_s:g} GB/s, "
        + ", ".join(f"{k} {v:g} TFLOP/s" for k, v in hw.tflops.items()) + f"  ({hw.source})",
        "",
        "parameters",
        f"  embeddings {_si(p.embeddings, '')}" + (f", output head {_si(p.output_head, '')}" if p.output_head
                                                   else " (tied output head)")
        + (f"; per-layer embeddings {_si(p.per_layer_table, '')} (a lookup) and their projections "
           f"{_si(p.per_layer_linear, '')}" if p.per_layer_table else ""),
        f"  attention {_si(p.attention, '')}, "
        + (f"state-space mixers {_si(p.ssm, '')}, " if p.ssm else "") + f"FFN {_si(p.ffn_stored, '')}"
        + (f" stored / {_si(p.ffn_active, '')} active per token" if m.is_moe else ""),
        f"  total {_si(p.stored, '')}" + (f" stored, {_si(p.active, '')} active per token" if m.is_moe else ""),
        "",
        "memory",
        f"  weights {_si(mem.weight_bytes, 'B')} at {w.dtype}",
        (f"  KV {mem.kv_bytes_per_token:,.0f} B per token ({m.attention_kind})" if mem.kv_bytes_per_token
         else "  no KV (no attention layers)")
        + (f" + a recurrent state of {_si(mem.state_bytes_per_sequence, 'B')} (float32)"
           if mem.state_bytes_per_sequence else "")
        + f", {_si(mem.kv_bytes_per_sequence, 'B')} per sequence at {w.context:,} tokens, "
        f"{_si(mem.kv_bytes_total, 'B')} for the batch",
        f"  usable {_si(mem.usable_bytes, 'B')}: {'fits' if mem.fits else 'DOES NOT FIT'}; largest batch at this "
        f"context: {mem.max_batch}",
        "",
        f"prefill ({w.prompt_tokens:,}-token prompt)",
        f"  {_si(plan.prefill.flops, 'FLOP')} ({_si(plan.prefill_macs, 'MAC')}); attention "
        f"{_si(plan.prefill_attention_flops, 'FLOP')}"
        + (f"; attention outgrows the linear layers from {plan.attention_overtakes_at:,} tokens"
           if plan.attention_overtakes_at else "; attention never outgrows the linear layers"),
        f"  intensity {plan.prefill.intensity:,.0f} FLOP/B vs ridge point {plan.ridge_point:,.0f}: "
        f"{plan.prefill.wall}-bound; TTFT >= {_seconds(plan.prefill.seconds)}",
        "",
        f"decode (batch {w.batch})",
        f"  {_si(plan.decode_bytes_per_token, 'B')} read per token ({_si(plan.decode.bytes, 'B')} per step), "
        f"intensity {plan.decode.intensity:,.1f} FLOP/B: {plan.decode.wall}-bound",
        f"  per-token latency >= {_seconds(plan.decode.seconds)}; ceiling {plan.decode_tokens_per_second:,.0f} tok/s"
        + (f" (overhead floor {_seconds(plan.overhead_floor_seconds)} per step without CUDA graphs)"
           if plan.decode.wall == "overhead" else ""),
    ]
    if (tp := plan.tensor_parallel) is not None:
        lines += ["", f"tensor parallel over {w.gpus} GPUs, {tp.link} ({tp.link_bandwidth_gb_s:g} GB/s, "
                      f"{tp.link_latency_us:g} us a ring step)",
                  f"  {tp.allreduces_per_pass} all-reduces a pass, {_si(tp.decode_bytes_per_allreduce, 'B')} each at "
                  f"decode: {_seconds(tp.decode_communication_seconds)} a step; prefill "
                  f"{_seconds(tp.prefill_communication_seconds)} (TTFT adds it)",
                  "  decode by GPUs: " + ", ".join(
                      f"{s.gpus}: {s.tokens_per_second:,.0f} tok/s ({s.communication_seconds / s.step_seconds:.0%} "
                      "communication)" for s in tp.scaling),
                  f"  stops paying at {tp.stops_paying_at} GPUs (each doubling gains under "
                  f"{WORTH_A_DOUBLING - 1:.0%} from there)" if tp.stops_paying_at else
                  f"  still pays at {tp.scaling[-1].gpus} GPUs"]
    if plan.cost_per_million_tokens is not None:
        priced = w.throughput or plan.decode_tokens_per_second
        lines += ["", f"cost: ${plan.cost_per_million_tokens:.3f} per million output tokens at "
                      f"${w.price_per_hour:g}/h and {priced:,.0f} tok/s"
                      + (" (the decode ceiling; --throughput to price a measured rate)" if not w.throughput else "")]
    lines += ["", f"binding wall: {plan.binding_wall}", "recommendations (the binding wall's first, then by gain)"]
    for i, adv in enumerate(plan.advice, 1):
        lines.append(f"  {i}. {adv.technique} [{adv.wall}]: {adv.why}")
        if adv.trap:
            lines.append(f"     trap: {adv.trap}")
    lines += ["", "conventions: " + plan.conventions]
    return "\n".join(lines)
