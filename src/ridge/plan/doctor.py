"""`ridge doctor`: measure this machine's ceilings, run ridge on a short latency and a short throughput
workload, and say how close each phase came to the roofline, which wall binds, and where the rest went.

Figures per phase: bytes moved and FLOPs done (from the model's shape, plan/arithmetic.py, and the weight
bytes ridge actually holds), over the measured time; as fractions of the measured read bandwidth and
matmul FLOP/s. The roofline bound of a phase is the larger of bytes / bandwidth and FLOPs / FLOP/s; the
measured time above it is overhead. For batch-1 decode, a profile splits the step into the matmuls
(whose own bandwidth is reported) and everything else.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from ridge.plan import arithmetic as a
from ridge.plan.machine import DTYPE_NAMES, hardware_from_roofline
from ridge.plan.roofline import timings
from ridge.plan.specs import HardwareSpec, ModelSpec


@dataclass(frozen=True)
class PhaseMeasurement:
    name: str
    seconds: float  # measured, per step (decode) or per prompt (prefill)
    bytes: float
    flops: float
    bound_seconds: float  # roofline: max(bytes / bandwidth, FLOPs / FLOP/s)
    bandwidth_fraction: float  # achieved bytes/s over the measured read bandwidth
    compute_fraction: float  # achieved FLOP/s over the measured matmul FLOP/s
    wall: str  # bandwidth, compute, or overhead (measured > 2x the bound)
    overhead_seconds: float  # measured - bound

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


@dataclass(frozen=True)
class StepBreakdown:
    """Where a batch-1 decode step's time went, from a CPU profile of a few steps."""
    step_seconds: float
    matmul_seconds: float  # linear layers and the vocabulary projection
    matmul_gb_s: float  # weight bytes / matmul time: how well the matmuls alone stream
    other_seconds: float  # attention, norms, rotary, sampling, scheduling, Python


@dataclass(frozen=True)
class DoctorReport:
    model: str
    weight_format: str
    hardware: HardwareSpec
    compute_dtype: str
    phases: list[PhaseMeasurement]
    predicted_decode_seconds: float  # batch 1, from the measured bandwidth
    measured_decode_seconds: float
    breakdown: StepBreakdown | None
    binding_wall: str
    recommendation: str
    notes: list[str] = field(default_factory=list)
    device: str = "this machine"  # what ran it: the CPU, or the GPU's name
    gpu_busy_fraction: float | None = None  # of a batch-1 decode step, on a GPU


def _phase(name: str, seconds: float, bytes_: float, flops: float, hw: HardwareSpec, dtype: str) -> PhaseMeasurement:
    bound = a.bound(bytes_, flops, hw, dtype)
    wall = "overhead" if seconds > 2 * bound.seconds else bound.wall
    return PhaseMeasurement(name, seconds, bytes_, flops, bound.seconds, bytes_ / seconds / (hw.bandwidth_gb_s * 1e9),
                            flops / seconds / hw.flops(dtype), wall, seconds - bound.seconds)


def _median_seconds(fn, repeats: int) -> float:
    """fn() timed `repeats` times after a warm-up. Each call must draw prompts of its own: a repeated
    prompt would be served from the prefix cache, and its prefill not measured."""
    return statistics.median(timings(fn, repeats))


MATMUL_NAMES = ("linear", "mm", "matmul", "_weight_int", "mkldnn")  # CPU ops
# GPU kernels: cuBLAS (nvjet, xmma, cutlass), tinygemm, and the Triton quantized matmuls (_gemv_kernel, _matmul_kernel)
CUDA_MATMUL_NAMES = ("gemm", "gemv", "cutlass", "nvjet", "xmma", "tinygemm", "_matmul_kernel")


def time_shares(llm, prompt: list[int], tokens: int, greedy) -> tuple[float, float | None]:
    """Of batch-1 decode time: the share spent in matmuls, and on a GPU the share it is busy at all (the rest
    it waits on the host). A profiled run of `tokens` tokens less one of a single token (the prefill), so that
    the prompt's work does not count."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # kineto's start / stop lines otherwise land on stderr
    from torch.profiler import ProfilerActivity, profile

    cuda = llm.engine.config.device.startswith("cuda")

    def profiled(n: int) -> tuple[float, float, float]:
        activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            llm.generate(prompt, greedy(n))
            wall = time.perf_counter() - start
        events = prof.key_averages()
        if cuda:
            kernels = [e for e in events if e.self_device_time_total > 0]
            matmul = sum(e.self_device_time_total for e in kernels if any(k in e.key.lower()
                                                                          for k in CUDA_MATMUL_NAMES))
            return wall, matmul / 1e6, sum(e.self_device_time_total for e in kernels) / 1e6
        matmul = sum(e.self_cpu_time_total for e in events if any(k in e.key for k in MATMUL_NAMES)) / 1e6
        return wall, matmul, 0.0

    prompt_wall, prompt_matmul, prompt_busy = profiled(1)
    prompt = prompt[1:] + prompt[:1]  # not the cached prompt: its prefill again, like the 1-token run's
    wall, matmul, busy = profiled(tokens)

    def share(part: float, prompt_part: float) -> float:
        return min(max((part - prompt_part) / (wall - prompt_wall), 0.0), 1.0)

    return share(matmul, prompt_matmul), share(busy, prompt_busy) if cuda else None


def run_doctor(model: str, spec: ModelSpec, llm, hw: HardwareSpec | None = None, prompt_len: int = 128,
               output_len: int = 32, batch: int = 16, repeats: int = 3, progress: bool = True) -> DoctorReport:
    """`llm`: a ridge LLM on `model`; `spec`: its shape (for FLOPs and KV bytes)."""
    from ridge import SamplingParams
    from ridge.linear import model_weight_bytes
    from ridge.plan.roofline import measure

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    dtype_name = DTYPE_NAMES[str(llm.engine.config.torch_dtype).removeprefix("torch.")]
    if hw is None:
        hw = hardware_from_roofline(measure(dtypes=(llm.engine.config.torch_dtype,), device=llm.engine.config.device))
    weights = model_weight_bytes(llm.engine.loaded.model)
    kv_dtype = dtype_name
    vocab = llm.engine.loaded.model.cfg.vocab_size
    generator = torch.Generator().manual_seed(0)

    def prompts(count: int) -> list[list[int]]:
        return torch.randint(1, vocab, (count, prompt_len), generator=generator).tolist()

    # latency: one request, prefill timed alone (1 token), decode from the rest
    prefill_s = _median_seconds(lambda: llm.generate(prompts(1)[0], greedy(1)), repeats)
    total_s = _median_seconds(lambda: llm.generate(prompts(1)[0], greedy(output_len)), repeats)
    step_s = (total_s - prefill_s) / (output_len - 1)
    fill = a.prefill(spec, prompt_len)
    context = prompt_len + output_len // 2
    phases = [
        _phase("prefill, batch 1", prefill_s, weights + a.kv_bytes(spec, kv_dtype, prompt_len), fill.flops, hw,
               dtype_name),
        _phase("decode, batch 1", step_s, weights + a.kv_read_bytes(spec, kv_dtype, context),
               a.decode_step_flops(spec, 1, context), hw, dtype_name),
    ]
    # throughput: `batch` requests decoded together; their prefill is timed on its own first
    batch_prefill_s = _median_seconds(lambda: llm.generate(prompts(batch), greedy(1)), 1)
    batch_total_s = _median_seconds(lambda: llm.generate(prompts(batch), greedy(output_len)), 1)
    batch_step_s = (batch_total_s - batch_prefill_s) / (output_len - 1)
    phases.append(_phase(f"decode, batch {batch}", batch_step_s,
                         weights + batch * a.kv_read_bytes(spec, kv_dtype, context),
                         a.decode_step_flops(spec, batch, context), hw, dtype_name))
    phases.append(_phase(f"prefill, batch {batch}", batch_prefill_s,
                         weights + batch * a.kv_bytes(spec, kv_dtype, prompt_len), batch * fill.flops, hw, dtype_name))
    llm.engine.check_integrity()

    share, busy = time_shares(llm, prompts(1)[0], output_len, greedy)
    matmul_s = step_s * share
    breakdown = StepBreakdown(step_s, matmul_s, weights / matmul_s / 1e9 if matmul_s else 0.0, step_s - matmul_s)
    predicted = phases[1].bound_seconds
    binding, advice = _diagnose(phases[1], breakdown, phases[2], batch)
    notes = [f"decode step bytes: {weights / 1e6:,.0f} MB of weights as held ({llm.engine.loaded.weight_format}) "
             f"+ KV; FLOPs from the model's shape ({spec.source})"]
    if busy is None:
        notes.append("CPU: the matmul FLOP/s ceiling is torch's own large matmul, not a datasheet peak")
    else:
        notes.append(f"GPU: busy {busy:.0%} of a batch-1 decode step, idle {1 - busy:.0%} (waiting on the host: "
                     "Python, scheduling, kernel launches); ceilings from a device-to-device copy and an "
                     "8192-cubed matmul")
    device = llm.engine.config.device
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else "this machine's CPU"
    return DoctorReport(model, llm.engine.loaded.weight_format, hw, dtype_name, phases, predicted, step_s,
                        breakdown, binding, advice, notes, where, busy)


def _diagnose(decode: PhaseMeasurement, breakdown: StepBreakdown, batched: PhaseMeasurement,
              batch: int) -> tuple[str, str]:
    """The wall that binds batch-1 decode, and what to do about it."""
    predicted, step_s, matmul_s = decode.bound_seconds, breakdown.step_seconds, breakdown.matmul_seconds
    if decode.wall == "overhead":
        return "overhead", (
            f"batch-1 decode runs {step_s / predicted:.1f}x its bandwidth bound ({predicted * 1e3:.1f} ms): "
            f"the matmuls take {matmul_s * 1e3:.1f} ms ({matmul_s / predicted:.1f}x the bound: kernels that "
            f"stream below the measured bandwidth) and {breakdown.other_seconds * 1e3:.1f} ms goes outside "
            "them (attention, small ops, Python). Fuse the small ops, batch more sequences (batch "
            f"{batch} reached {batched.bandwidth_fraction:.0%} of the bandwidth); shrinking the weights "
            "(--quantization) only cuts the matmul share")
    if decode.wall == "bandwidth":
        return "bandwidth", ("decode is at the bandwidth wall: move fewer bytes (weight quantization: --quantization "
                             "int4 or gguf; a smaller KV dtype at long context), or batch more sequences per weight "
                             "read")
    return decode.wall, "decode is compute-bound: fewer FLOPs (smaller batch per replica, lower-precision matmuls)"


def render(report: DoctorReport) -> str:
    hw = report.hardware
    lines = [f"ridge doctor: {report.model} ({report.weight_format}) on {report.device}",
             f"  ceilings measured: read {hw.bandwidth_gb_s:.1f} GB/s, matmul {report.compute_dtype} "
             f"{hw.flops(report.compute_dtype) / 1e9:,.0f} GFLOP/s (ridge point "
             f"{hw.ridge_point(report.compute_dtype):.0f} FLOP/B)", "",
             f"  {'phase':<20} {'time':>10} {'GB/s':>7} {'of bw':>6} {'GFLOP/s':>8} {'of peak':>7} "
             f"{'bound':>10} {'overhead':>9}  wall"]
    for p in report.phases:
        lines.append(f"  {p.name:<20} {p.seconds * 1e3:>8.2f}ms {p.bytes / p.seconds / 1e9:>7.1f} "
                     f"{p.bandwidth_fraction:>6.0%} {p.flops / p.seconds / 1e9:>8.0f} {p.compute_fraction:>7.0%} "
                     f"{p.bound_seconds * 1e3:>8.2f}ms {p.overhead_seconds * 1e3:>7.2f}ms  {p.wall}")
    ratio = report.measured_decode_seconds / report.predicted_decode_seconds
    lines += ["", f"  batch-1 decode: predicted {report.predicted_decode_seconds * 1e3:.2f} ms from the measured "
                  f"bandwidth, measured {report.measured_decode_seconds * 1e3:.2f} ms ({ratio:.2f}x)"]
    if report.breakdown:
        b = report.breakdown
        lines.append(f"  of the step: matmuls {b.matmul_seconds * 1e3:.2f} ms (weights streamed at {b.matmul_gb_s:.1f} "
                     f"GB/s), everything else {b.other_seconds * 1e3:.2f} ms (attention, norms, sampling, scheduling)")
    lines += ["", f"  binding wall: {report.binding_wall}", f"  recommendation: {report.recommendation}"]
    lines += [f"  note: {n}" for n in report.notes]
    return "\n".join(lines)
