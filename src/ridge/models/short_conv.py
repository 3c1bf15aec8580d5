"""LFM2's gated short convolution: a token mixer in place of attention (Liquid AI's LFM2).

One projection gives B, C and x (each hidden-wide); the layer convolves B * x causally over the last few tokens,
each channel with its own taps (conv_L_cache of them, 3 in LFM2's models), and gates the result by C:
    y_t = out_proj(C_t * sum_k w_k * (B * x)_{t-k})
so a sequence's past is the last ssm_conv_kernel - 1 values of B * x: a fixed state as a Mamba-2 layer's, kept in
the same slots (kv/state_cache.py, whose SSM part is empty for these layers) in float32, the convolution summed in
float32 too, and a prompt chunk continues from it. The work is two matmuls and a few elementwise ops: torch does it
as well as a kernel would (the fused decode step runs the same ops from C++, kernels/decode_stack.h's ShortConv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ridge.config import ModelConfig
from ridge.kv.state_cache import StateStep


class ShortConvMixer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        hidden = cfg.hidden_size
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=cfg.ssm_conv_bias)
        self.conv_weight = nn.Parameter(torch.empty(hidden, cfg.ssm_conv_kernel))  # depthwise taps
        self.conv_bias = nn.Parameter(torch.empty(hidden)) if cfg.ssm_conv_bias else None
        self.out_proj = nn.Linear(hidden, hidden, bias=cfg.ssm_conv_bias)

    def forward(self, x: torch.Tensor, step: StateStep) -> torch.Tensor:
        """x: [T, hidden] of the step's sequences (decodes first) -> [T, hidden]; their slots' states advanced."""
        gate_b, gate_c, inputs = self.in_proj(x).chunk(3, dim=-1)
        gated = (gate_b * inputs).float()  # what the convolution runs over, and the state holds
        state = step.cache.conv[self.layer_index]  # [slots, hidden, taps - 1], float32
        taps = self.conv_weight.float()
        out = torch.empty_like(gated)
        decodes = slice(0, step.num_decodes)
        if step.num_decodes:
            slots = step.slots[decodes]
            window = torch.cat([state[slots], gated[decodes, :, None]], dim=-1)  # [D, hidden, taps]
            state[slots] = window[:, :, 1:]
            out[decodes] = (window * taps).sum(-1)
        for seq, (start, length) in enumerate(step.chunks, start=step.num_decodes):
            rows, slot = slice(start, start + length), int(step.slots[seq])
            window = torch.cat([state[slot], gated[rows].T], dim=-1)  # [hidden, taps - 1 + length]
            state[slot] = window[:, window.shape[1] - state.shape[2]:]
            out[rows] = F.conv1d(window[None], taps[:, None], groups=taps.shape[0])[0].T
        if self.conv_bias is not None:
            out += self.conv_bias.float()
        return self.out_proj((gate_c.float() * out).to(x.dtype))
