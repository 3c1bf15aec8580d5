"""The routed experts of a mixture-of-experts block (models/moe.py) on CUDA, as two Triton grouped matmuls.

MoEBlock's own path sorts the step's (token, slot) choices by expert on the host and runs one matmul per chosen
expert: a host synchronisation and half a dozen launches per expert per layer, which leaves a GPU idle at decode
batch sizes and keeps CUDA graphs out. Here everything stays on the device: the choices are sorted by expert and
laid out in blocks of BLOCK_M rows, each block one expert's (its last block padded), in a layout sized by the
step's shape alone (at most ceil(C / BLOCK_M) + min(E, C) blocks for C choices of E experts), so a CUDA graph
captures it. One kernel then runs each block's rows through its expert's gate and up rows with SiLU(gate) * up
fused, one more through its down projection times the choice's weight; each expert's weights are read once per
block of its tokens, and at batch 1 only the chosen experts' are read at all. The k choices of a token are summed
in torch. This is vLLM's fused-MoE design (sorted, block-aligned choices and a grouped matmul); ridge's kernels and
layout are its own.

Dense experts in the model's dtype, SwiGLU, gpt-oss's clamped SwiGLU or Gemma's GELU-tanh gate, with or without
biases (stack_experts says why another block cannot use it).
Runs under Triton's interpreter on the CPU (TRITON_INTERPRET=1), which is how the test suite checks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn

from ridge.triton_kernels.paged_attention import _float32_dot

BLOCK_M = 16  # choices per block (tl.dot's smallest M)
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, bias_ptr, choices_ptr, block_experts_ptr, choice_weights_ptr, out_ptr, top_k,
                    hidden, width, limit, alpha, stride_x, stride_we, stride_wn, stride_be, stride_o,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                    FLOAT32_DOT: tl.constexpr, HAS_BIAS: tl.constexpr, GATE: tl.constexpr,
                    SCALE_INPUT: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= 0:  # blocks past the step's last hold nothing
        choice = tl.load(choices_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = choice >= 0
        token = tl.where(valid, choice // top_k, 0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        weights = w_ptr + expert * stride_we
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + token[:, None] * stride_x + k[None, :], mask=valid[:, None] & (k < hidden)[None, :],
                        other=0.0)
            w_mask = (k < hidden)[:, None] & (n < width)[None, :]
            w_gate = tl.load(weights + n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)  # [K, N]
            w_up = tl.load(weights + (width + n)[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
            if FLOAT32_DOT:
                a, w_gate, w_up = a.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
            gate += tl.dot(a, w_gate, input_precision=PRECISION)
            up += tl.dot(a, w_up, input_precision=PRECISION)
        if SCALE_INPUT:  # Llama 4's: the expert reads its token times the choice's weight, which is linear in it
            scale = tl.load(choice_weights_ptr + choice, mask=valid, other=0.0)[:, None]
            gate *= scale
            up *= scale
        if HAS_BIAS:  # gate's, then up's, as the gate_up layer's bias holds them
            gate += tl.load(bias_ptr + expert * stride_be + n, mask=n < width, other=0.0).to(tl.float32)[None, :]
            up += tl.load(bias_ptr + expert * stride_be + width + n, mask=n < width, other=0.0).to(tl.float32)[None, :]
        if GATE == "swiglu_oai":  # gpt-oss's clamped SwiGLU (models/layers.py's GatedMLP)
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            act = gate * tl.sigmoid(gate * alpha) * (up + 1)
        elif GATE == "gelu_tanh":  # 0.5 g (1 + tanh(z)) = g sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
            act = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)) * up
        else:
            act = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + choice[:, None] * stride_o + n[None, :], act.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & (n < width)[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, bias_ptr, choices_ptr, block_experts_ptr, choice_weights_ptr, out_ptr, hidden,
                 width, stride_a, stride_we, stride_wn, stride_be, stride_o,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 FLOAT32_DOT: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_INPUT: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= 0:
        choice = tl.load(choices_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = choice >= 0
        rows = tl.where(valid, choice, 0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        weights = w_ptr + expert * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, width, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(act_ptr + rows[:, None] * stride_a + k[None, :], mask=valid[:, None] & (k < width)[None, :],
                        other=0.0)
            w_mask = (k < width)[:, None] & (n < hidden)[None, :]
            w = tl.load(weights + n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
            if FLOAT32_DOT:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(a, w, input_precision=PRECISION)
        if HAS_BIAS:  # the expert's output, bias included, is what the choice's weight scales
            acc += tl.load(bias_ptr + expert * stride_be + n, mask=n < hidden, other=0.0).to(tl.float32)[None, :]
        if not SCALE_INPUT:  # scaled on the way in otherwise
            acc *= tl.load(choice_weights_ptr + rows, mask=valid, other=0.0)[:, None]
        tl.store(out_ptr + choice[:, None] * stride_o + n[None, :], acc, mask=valid[:, None] & (n < hidden)[None, :])


def expert_blocks(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, k] (each token's choices; choice c is token c // k's slot c % k) -> the choices sorted by expert
    in blocks of BLOCK_M, each expert's blocks padded with -1 [blocks * BLOCK_M], and each block's expert [blocks]
    (-1 past the last). Device operations only, no host synchronisation; the number of blocks depends on T alone."""
    choices = experts.flatten()
    count, device = choices.numel(), choices.device
    per_expert = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(
        0, choices, torch.ones_like(choices))
    padded = (per_expert + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = padded.cumsum(0)
    order = choices.argsort(stable=True)
    expert_of = choices[order]
    first_of_expert = per_expert.cumsum(0) - per_expert  # in `order`
    places = ends[expert_of] - padded[expert_of] + torch.arange(count, device=device) - first_of_expert[expert_of]
    num_blocks = triton.cdiv(count, BLOCK_M) + min(num_experts, count)
    sorted_choices = torch.full((num_blocks * BLOCK_M,), -1, dtype=torch.long, device=device)
    sorted_choices[places] = order
    block_experts = torch.searchsorted(ends, torch.arange(num_blocks, device=device) * BLOCK_M, right=True)
    return sorted_choices, torch.where(block_experts < num_experts, block_experts, -1)


@dataclass
class FusedExperts:
    """A block's experts stacked: gate_up [E, 2 * width, hidden] (gate rows, then up rows) and down [E, hidden,
    width], as the experts' GatedMLPs hold them (whose weights become views of these), with their biases [E, rows]
    where they have them; gate: the experts' activation (GatedMLP's: silu, swiglu_oai with its swiglu_limit and
    slope swiglu_alpha, gelu_tanh); scale_input: Llama 4's experts, which read their tokens times the choices'
    weights and whose outputs join unweighted."""

    gate_up: torch.Tensor
    down: torch.Tensor
    top_k: int
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    gate: str = "silu"
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    scale_input: bool = False

    def __call__(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], each token's experts and weights [T, k] (MoEBlock.route) -> the weighted sum of its
        experts' outputs [T, hidden], in x's dtype."""
        tokens, hidden = x.shape
        num_experts, width = self.down.shape[0], self.down.shape[2]
        choices, block_experts = expert_blocks(experts, num_experts)
        count = experts.numel()
        act = x.new_empty(count, width)
        out = torch.empty(count, hidden, dtype=torch.float32, device=x.device)
        flags = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                     PRECISION="ieee" if x.dtype == torch.float32 else "tf32", FLOAT32_DOT=_float32_dot(x.dtype, None))
        blocks = block_experts.shape[0]
        gate_up_bias = self.gate_up_bias if self.gate_up_bias is not None else self.gate_up  # unread without one
        down_bias = self.down_bias if self.down_bias is not None else self.down
        choice_weights = weights.flatten().float().contiguous()
        _gate_up_kernel[(blocks, triton.cdiv(width, BLOCK_N))](
            x, self.gate_up, gate_up_bias, choices, block_experts, choice_weights, act, self.top_k, hidden, width,
            self.swiglu_limit, self.swiglu_alpha, x.stride(0), self.gate_up.stride(0), self.gate_up.stride(1),
            gate_up_bias.stride(0), act.stride(0), HAS_BIAS=self.gate_up_bias is not None,
            GATE=self.gate, SCALE_INPUT=self.scale_input, **flags)
        _down_kernel[(blocks, triton.cdiv(hidden, BLOCK_N))](
            act, self.down, down_bias, choices, block_experts, choice_weights, out, hidden,
            width, act.stride(0), self.down.stride(0), self.down.stride(1), down_bias.stride(0), out.stride(0),
            HAS_BIAS=self.down_bias is not None, SCALE_INPUT=self.scale_input, **flags)
        return out.view(tokens, self.top_k, hidden).sum(1).to(x.dtype)


def stack_experts(experts: nn.ModuleList, top_k: int, scale_input: bool = False) -> tuple[FusedExperts | None, str]:
    """The experts (GatedMLPs) stacked for the kernels, their weights (and biases) then views of the stack; or None
    and why they cannot be (quantized layers, a gate the kernel has not). scale_input: FusedExperts'."""
    for expert in experts:
        if expert.activation not in ("silu", "swiglu_oai", "gelu_tanh"):
            return None, f"{expert.activation}-gated experts"
        for layer in (expert.gate_up, expert.down):
            if type(layer) is not nn.Linear:
                return None, f"experts as {type(layer).__name__} layers (quantized)"

    def stacked(name: str, part: str) -> torch.Tensor | None:
        tensors = [getattr(getattr(e, name), part) for e in experts]
        return None if tensors[0] is None else torch.stack([t.detach() for t in tensors])

    first = experts[0]
    clamped = first.activation == "swiglu_oai"
    fused = FusedExperts(stacked("gate_up", "weight"), stacked("down", "weight"), top_k, stacked("gate_up", "bias"),
                         stacked("down", "bias"), first.activation, first.limit if clamped else 0.0, first.alpha,
                         scale_input)
    for i, expert in enumerate(experts):  # one copy of the weights: the experts' own read the stack
        expert.gate_up.weight = nn.Parameter(fused.gate_up[i], requires_grad=False)
        expert.down.weight = nn.Parameter(fused.down[i], requires_grad=False)
        if fused.gate_up_bias is not None:
            expert.gate_up.bias = nn.Parameter(fused.gate_up_bias[i], requires_grad=False)
        if fused.down_bias is not None:
            expert.down.bias = nn.Parameter(fused.down_bias[i], requires_grad=False)
    return fused, ""
