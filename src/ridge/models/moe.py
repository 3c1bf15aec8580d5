"""A mixture-of-experts FFN: a router picks num_experts_per_tok of num_experts gated FFNs for each token.

The step's tokens are grouped by expert (one sort of the (token, slot) choices), and each expert that any
token chose runs once, as one matmul over its tokens: at batch 1 only the chosen experts' weights are read,
and no loop ever runs over tokens. Each expert is a GatedMLP with ordinary linear layers, so quantized
formats and CPU kernels apply to experts as to any dense layer (DecoderModel.replace_linears).
On the CPU (unless enforce_eager), the block runs in C++ (kernels/decode_stack.h's Experts, `native`): the same
routing op for op and the same experts' kernels, the experts side by side on the threads; decode steps call it from
the fused decode stack, or through forward() in models the stack does not take (a tensor-parallel OLMoE).

The router (Mixtral, Qwen2/3-MoE, OLMoE): softmax over every expert's logit in float32, the top k, and with
norm_topk_prob those k weights renormalised to sum to 1 (gpt-oss's softmax over the top k logits is that; its
router's logits and its experts' projections have biases, its experts gpt-oss's clamped SwiGLU). Qwen2-MoE adds a
shared expert that every token runs, its output scaled by sigmoid(shared_expert_gate(x)). DeepSeek-V2's: softmax
scores, with group_limited_greedy the top k within the router_topk_groups groups of the best single score, the
weights times routed_scaling_factor; its shared experts run ungated. DeepSeek-V3's: sigmoid scores; the experts split
into router_groups groups, each group rated by its two best scores plus the per-expert correction bias, the
top k chosen (by score + bias) within the router_topk_groups best groups, weighted by their scores without
the bias (renormalised), times routed_scaling_factor; its shared experts run ungated. Ernie 4.5's: softmax scores,
the top k chosen by score + bias, weighted by their scores renormalised, beside ungated shared experts. Llama 4's:
sigmoid scores of the top k logits, each chosen expert reading its token times that score (not weighing its
output), beside an ungated shared expert. Gemma 4's (26B-A4B): softmax scores of logits of the stream RMS-normed and
scaled per channel, the top k renormalised and each times its expert's own scale; the whole mixture beside the
layer's dense MLP (MLPBesideExperts).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ridge.config import ModelConfig
from ridge.models.layers import GatedMLP, RMSNorm

log = logging.getLogger("ridge")


class Router(nn.Linear):
    """The router's logits. Its own class, so that replace_linears (which swaps plain nn.Linear) and quantization
    (keep_dense) leave it as it is: a few thousand weights whose rounding would move tokens between experts."""

    keep_dense = True


class MoEBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.sigmoid, self.scaling = cfg.router_scoring == "sigmoid", cfg.routed_scaling_factor
        self.norm_eps = cfg.router_norm_eps if self.sigmoid else 0.0
        self.groups, self.topk_groups = cfg.router_groups, cfg.router_topk_groups
        self.group_rating = cfg.router_group_rating
        self.router = Router(cfg.hidden_size, cfg.num_experts, bias=cfg.router_logit_bias)
        # DeepSeek-V3's e_score_correction_bias (Ernie 4.5's moe_statics): moves which experts are chosen, not their
        # weights
        self.router_bias = nn.Parameter(torch.zeros(cfg.num_experts)) if cfg.router_choice_bias else None
        self.scales_input = cfg.router_scales_input
        # Gemma 4's: the router's input RMS-normed without a weight, times this per-channel scale and hidden ** -0.5;
        # each chosen weight times its expert's own scale
        self.router_input_scale = nn.Parameter(torch.ones(cfg.hidden_size)) if cfg.router_normed_input else None
        self.expert_scales = nn.Parameter(torch.ones(cfg.num_experts)) if cfg.router_expert_scales else None
        self.norm_eps_input = cfg.rms_norm_eps
        self.experts = nn.ModuleList(GatedMLP(cfg, cfg.moe_intermediate_size, bias=cfg.expert_bias)
                                     for _ in range(cfg.num_experts))
        # whether the C++ form of the block (kernels/decode_stack.h's Experts) computes these experts: SwiGLU ones,
        # gpt-oss's clamped ones (their biases are their layers', its router's on the router's logits), squared-ReLU
        # ones, or Gemma 4's GeGLU ones (its router's normed input and per-expert scales)
        self.native_activation = cfg.hidden_act in ("silu", "swiglu_oai", "relu2", "gelu_tanh")
        # the experts this process runs: all, or under expert parallelism its rank's (cluster/shards.py; the others'
        # places hold an empty module, and their tokens' share of the output is summed in from the other ranks)
        self.held = range(cfg.num_experts)
        width = cfg.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(cfg, width) if width else None
        self.shared_expert_gate = Router(cfg.hidden_size, 1, bias=False) if cfg.shared_expert_gate else None
        # this block in C++, where the runner made it (kernels/decode_stack.py), for steps of up to native_max_rows
        # rows: its kernel calls are the Python path's up to there (the stack's limit)
        self.native: Any = None
        self.native_max_rows = 0
        # set where a LoRA adapter adapts the shared expert (lora/apply.py): the C++ block would pass by that
        # projection's hook, so the block runs in Python (the fused decode step's base-model steps keep it)
        self.adapted = False
        # on CUDA, the routed experts stacked for Triton's grouped matmuls (triton_kernels/moe.py), where the runner
        # made them: no host synchronisation, so a CUDA graph captures the block
        self.fused: Any = None

    def read_bytes(self, read: Callable[[nn.Module], float], batch: int) -> float:
        """Weight bytes a decode step of `batch` tokens reads here (linear.model_weight_bytes): the router, the
        shared expert, and the routed experts it touches (all k at batch 1; for more tokens, as many as uniform
        routing touches on average, the plan's count)."""
        experts = len(self.experts)
        touched = experts * (1 - (1 - self.top_k / experts) ** batch)
        always = [m for m in (self.router, self.shared_expert, self.shared_expert_gate) if m is not None]
        bias = sum(p.nbytes for p in (self.router_bias, self.router_input_scale, self.expert_scales) if p is not None)
        return bias + sum(read(m) for m in always) + touched * sum(read(e) for e in self.experts) / experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] and their weights [T, k] (float32), x the router's input."""
        if self.router_input_scale is not None:
            normed = F.rms_norm(x.float(), x.shape[-1:], None, self.norm_eps_input).to(x.dtype)
            x = normed * self.router_input_scale * x.shape[-1] ** -0.5
        logits = self.router(x).float()
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        choice = scores + self.router_bias.float() if self.router_bias is not None else scores
        if self.groups > 1:
            grouped = choice.view(x.shape[0], self.groups, -1)
            rating = grouped.topk(2, dim=-1).values.sum(dim=-1) if self.group_rating == "top2" else grouped.amax(-1)
            best = rating.topk(self.topk_groups, dim=-1).indices
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.norm_eps)
        if self.expert_scales is not None:
            weights = weights * self.expert_scales.float()[experts]
        return experts, weights * self.scaling if self.scaling != 1.0 else weights

    def forward(self, x: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
        """router_input: what the router reads, where not the experts' input x (Gemma 4's: the stream, x normed)."""
        if self.native is not None and not self.adapted and x.shape[0] <= self.native_max_rows:
            return self.native(x, router_input)
        routing = self.route(x if router_input is None else router_input)
        out = self.fused(x, *routing) if self.fused is not None else self._routed(x, *routing)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out += shared
        return out

    def _routed(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum, each chosen expert one matmul over its tokens."""
        choices = experts.flatten()  # choice c is token c // k's slot c % k
        order = choices.argsort(stable=True)
        counts = torch.bincount(choices, minlength=len(self.experts)).tolist()
        tokens, slot_weights = order // self.top_k, weights.flatten()[order].unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            if expert not in self.held:
                start += count
                continue
            rows, weight = tokens[start:start + count], slot_weights[start:start + count]
            scaled = (self.experts[expert](x[rows] * weight.to(x.dtype)) if self.scales_input
                      else self.experts[expert](x[rows]) * weight)
            out.index_add_(0, rows, scaled.to(out.dtype))
            start += count
        return out


class MLPBesideExperts(nn.Module):
    """Gemma 4 26B-A4B's FFN: a dense MLP and a mixture of experts side by side, each output normed, their sum the
    layer's FFN output. The MLP reads the layer's normed input; the mixture reads the stream itself, its experts
    through a norm of their own, its router through its own (MoEBlock's router_input_scale)."""

    reads_stream = True  # DecoderLayer hands it the stream beside its normed input
    # under tensor parallelism each branch's output is a partial sum, made whole here before its norm, so the
    # layer does not sum the block's output again (DecoderLayer.forward)
    reduces_its_output = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.mlp = GatedMLP(cfg)
        self.mlp_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.experts_in_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.experts_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.moe = MoEBlock(cfg)
        self.all_reduce: Callable[[torch.Tensor], None] | None = None  # cluster/collectives.py's, over ranks

    def forward(self, x: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        dense = self.mlp(x)
        routed = self.moe(self.experts_in_norm(stream.to(x.dtype)), router_input=stream.to(x.dtype))
        if self.all_reduce is not None:
            self.all_reduce(dense)
            self.all_reduce(routed)
        return self.mlp_out_norm(dense) + self.experts_out_norm(routed)


def attach_fused_experts(model: nn.Module) -> bool:
    """On CUDA: give each mixture-of-experts block of `model` (all of whose experts this process holds) its experts
    stacked for Triton's grouped matmuls (triton_kernels/moe.py), which its forward() runs; whether every block has
    them. A block that cannot keeps one matmul per expert, said at warning level."""
    from ridge.triton_kernels import moe  # Triton comes with CUDA torch; only on this path

    every = True
    for name, block in model.named_modules():
        if isinstance(block, MoEBlock):
            if len(block.held) != len(block.experts):
                block.fused, why = None, "expert parallelism (a rank holds some experts)"
            else:
                block.fused, why = moe.stack_experts(block.experts, block.top_k, block.scales_input)
            if block.fused is None:
                every = False
                log.warning("ridge: %s runs one matmul per expert on CUDA, not the fused Triton experts: %s",
                            name, why)
    return every
