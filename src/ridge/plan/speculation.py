"""`ridge plan spec`: what speculative decoding buys a model on a machine, batch size by batch size.

A target pass over k + 1 tokens per sequence reads the weights once, like a one-token step, so while the
step is bandwidth-bound verification is almost free and the expected tokens per pass are the speedup
(less the drafter's cost). As the batch grows the pass turns compute-bound, verification costs up to
k + 1 steps, and speculation loses: the table runs up to the batch where that happens.
"""

from __future__ import annotations

from dataclasses import dataclass

from ridge.plan import arithmetic as a
from ridge.plan.specs import HardwareSpec, ModelSpec, Workload


@dataclass(frozen=True)
class SpecRow:
    batch: int
    step_seconds: float  # a plain one-token step of `batch` sequences
    verify_seconds: float  # a target pass over k + 1 tokens of each
    speedup: float  # tokens per second with speculation / without
    wall: str  # of the verification pass
    fits: bool  # the batch's KV fits beside the weights


def speculation_table(model: ModelSpec, hw: HardwareSpec, accept: float, k: int, draft_cost: float,
                      workload: Workload) -> list[SpecRow]:
    """Batches 1, 2, 4, ... until the verification pass is compute-bound and speculation no longer pays,
    or it is compute-bound past what memory holds (rows beyond that are marked, not dropped: the crossover is
    a property of the arithmetic). At long context the KV reads of a step grow with the batch as the
    weights' do not, so verification, which reads them once for k + 1 tokens, can pay at any batch.
    draft_cost: the drafter's step as a fraction of the target's plain step."""
    expected = a.expected_tokens_per_pass(accept, k)  # validates accept and k
    if draft_cost < 0:
        raise ValueError(f"draft cost: {draft_cost} is negative")
    usable = hw.memory_gb * 1e9 * workload.memory_utilization * workload.gpus - a.weight_bytes(model, workload.dtype)
    fits = max(int(usable // a.kv_bytes(model, workload.kv_dtype, workload.context)), 1)
    rows: list[SpecRow] = []
    batch = 1
    while batch <= 1 << 20:
        plain = a.step_bound(model, hw, workload, batch)
        verify = a.step_bound(model, hw, workload, batch, k + 1)
        speedup = expected * plain.seconds / (k * draft_cost * plain.seconds + verify.seconds)
        rows.append(SpecRow(batch, plain.seconds, verify.seconds, speedup, verify.wall, batch <= fits))
        if verify.wall == "compute" and (speedup < 1 or batch > fits):
            break
        batch *= 2
    return rows
