"""Mamba-2's mixer: a selective state-space layer in place of attention (Dao & Gu, "Transformers are SSMs").

Per head h, with a scalar decay a_t = exp(dt_t * A_h) (dt_t > 0 from the token, A_h < 0 learned):
    state_t = a_t * state_{t-1} + dt_t * x_t B_t^T        (state: [head_dim, state_size])
    y_t     = state_t C_t + D_h * x_t
where x, B, C come from the token through a short causal convolution. A decode step is that recurrence once; a
prompt runs it in chunks of Q tokens (the SSD form): inside a chunk, y is a masked matmul of C B^T weighted by
the decays between positions (attention-like, Q x Q per head), and across chunks only the state carries over.
That is what makes chunked prefill exact too: a chunk of the engine's continues from the state the previous
chunk left in the sequence's slot.

The state lives in the KV manager's slots (kv/state_cache.py), in float32; which slot each sequence of a step
uses comes in a StateStep. Written in torch here: the work is matmuls (the SSD chunks) and elementwise updates,
and no library ridge may depend on has it for the CPU (mamba_ssm's kernels are CUDA-only). A decode token on the
CPU runs the convolution step and the recurrence in one C++ pass over the state (kernels/state_space.cpp); the
torch form below stays for other devices and for a build without the kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from ridge.config import ModelConfig
from ridge.kv.state_cache import StateStep


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.heads, self.head_dim, self.state_size = cfg.ssm_num_heads, cfg.ssm_head_dim, cfg.ssm_state_size
        self.groups, self.chunk_size = cfg.ssm_groups, cfg.ssm_chunk_size
        self.inner, self.channels = cfg.ssm_inner_size, cfg.ssm_conv_channels
        self.eps, self.dt_limit = cfg.rms_norm_eps, cfg.ssm_dt_limit
        # one projection to the gate z, the convolution's input (x, B, C) and dt
        self.in_proj = nn.Linear(cfg.hidden_size, self.inner + self.channels + self.heads, bias=cfg.ssm_proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(self.channels, cfg.ssm_conv_kernel))  # depthwise taps
        self.conv_bias = nn.Parameter(torch.empty(self.channels)) if cfg.ssm_conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))  # A = -exp(A_log)
        self.D = nn.Parameter(torch.empty(self.heads))
        self.norm_weight = nn.Parameter(torch.empty(self.inner))  # RMSNorm of y * silu(z), per group of heads
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=cfg.ssm_proj_bias)
        # under tensor parallelism with fewer groups than ranks, each rank holds one group or a part of one
        # (cluster/shards.py): that group's index and width among all, and the all-reduce that sums each group's
        # squares over the ranks (every rank takes part, whole group or not)
        self.shared_group: tuple[int, int, int] | None = None
        self.all_reduce: Callable[[torch.Tensor], None] | None = None
        self.ops: ModuleType | None = None  # the C++ decode token, set by DecoderModel.use_kernels

    def shard(self, local: ModelConfig, groups: range, whole: ModelConfig, world: int) -> None:
        """Become this rank's part (its weights already cut): `groups` of the model `whole`'s, over `world` ranks."""
        self.heads, self.groups = local.ssm_num_heads, local.ssm_groups
        self.inner, self.channels = local.ssm_inner_size, local.ssm_conv_channels
        if whole.ssm_groups < world:
            self.shared_group = (groups.start, whole.ssm_groups, whole.ssm_inner_size // whole.ssm_groups)

    def forward(self, x: torch.Tensor, step: StateStep) -> torch.Tensor:
        """x: [T, hidden] of the step's sequences (decodes first) -> [T, hidden]; their slots' states advanced."""
        z, xbc, raw_dt = self.in_proj(x).split_with_sizes([self.inner, self.channels, self.heads], dim=-1)
        conv_state, ssm_state = step.cache.conv[self.layer_index], step.cache.ssm[self.layer_index]
        y = torch.empty(x.shape[0], self.heads, self.head_dim, dtype=torch.float32, device=x.device)
        decodes = slice(0, step.num_decodes)
        in_kernel = step.num_decodes and self.ops is not None and x.device.type == "cpu"
        if in_kernel:
            y[decodes] = self.decode_token(xbc[decodes], raw_dt[decodes], step.slots[decodes], conv_state,
                                           ssm_state).view(-1, self.heads, self.head_dim)
        if in_kernel and not step.chunks:
            return self._output(y, z, x.dtype)
        dt = F.softplus(raw_dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)  # [T, heads]
        A = -torch.exp(self.A_log.float())
        if step.num_decodes and not in_kernel:
            slots = step.slots[decodes]
            window = torch.cat([conv_state[slots], xbc[decodes, :, None].float()], dim=-1)  # [D, channels, kernel]
            conv_state[slots] = window[:, :, 1:]
            conv_out = (window * self.conv_weight.float()).sum(-1)
            y[decodes] = self._step(conv_out, dt[decodes], A, ssm_state, slots)
        for seq, (start, length) in enumerate(step.chunks, start=step.num_decodes):
            rows, slot = slice(start, start + length), int(step.slots[seq])
            window = torch.cat([conv_state[slot], xbc[rows].float().T], dim=-1)  # [channels, kernel - 1 + length]
            conv_state[slot] = window[:, window.shape[1] - conv_state.shape[2]:]
            conv_out = F.conv1d(window[None], self.conv_weight.float()[:, None], groups=self.channels)[0].T
            y[rows] = self._scan(conv_out, dt[rows], A, ssm_state, slot)
        return self._output(y, z, x.dtype)

    def _output(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The recurrence's y [T, heads, head_dim] (float32) gated by z, normed per group and projected out."""
        y = self._group_norm(y.flatten(1) * F.silu(z.float()))
        return self.out_proj((y * self.norm_weight).to(dtype))  # y float32: the product widens the weight

    def decode_token(self, xbc: torch.Tensor, raw_dt: torch.Tensor, slots: torch.Tensor, conv_state: torch.Tensor,
                     ssm_state: torch.Tensor) -> torch.Tensor:
        """The C++ decode token (the convolution step, dt's softplus, the recurrence and D's skip) of rows whose
        in_proj gave xbc [D, channels] and raw_dt [D, heads] -> y [D, inner] float32; the slots' states advanced."""
        return self.ops.mamba2_decode_(xbc, raw_dt, conv_state, ssm_state, slots, self.conv_weight, self.conv_bias,
                                       self.dt_bias, self.A_log, self.D, self.groups, *self.dt_limit)

    def _group_norm(self, y: torch.Tensor) -> torch.Tensor:
        """RMSNorm per group (the heads that share B and C) of y * silu(z) [T, inner], before its weight."""
        if self.shared_group is None:
            return F.rms_norm(y.unflatten(-1, (self.groups, -1)), (self.inner // self.groups,), eps=self.eps).flatten(1)
        group, groups, width = self.shared_group
        squares = y.new_zeros(y.shape[0], groups)  # a column per group of the whole model: ranks add theirs
        squares[:, group] = y.square().sum(-1)
        self.all_reduce(squares)
        return y * torch.rsqrt(squares[:, group:group + 1] / width + self.eps)

    def _activate(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [n, channels] -> x [n, heads, head_dim], and B, C [n, heads, state_size]."""
        if self.conv_bias is not None:
            conv_out = conv_out + self.conv_bias.float()
        x, B, C = F.silu(conv_out).split_with_sizes(
            [self.inner, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
        per_group = self.heads // self.groups
        B = B.unflatten(-1, (self.groups, self.state_size)).repeat_interleave(per_group, dim=1)
        C = C.unflatten(-1, (self.groups, self.state_size)).repeat_interleave(per_group, dim=1)
        return x.unflatten(-1, (self.heads, self.head_dim)), B, C

    def _step(self, conv_out: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, ssm_state: torch.Tensor,
              slots: torch.Tensor) -> torch.Tensor:
        """One token of each decoding sequence: the recurrence once, batched over sequences."""
        x, B, C = self._activate(conv_out)
        state = ssm_state[slots] * torch.exp(dt * A)[..., None, None]  # [D, heads, head_dim, state_size]
        state += (dt[..., None] * x)[..., None] * B[:, :, None, :]
        ssm_state[slots] = state
        return (state @ C[..., None]).squeeze(-1) + self.D.float()[:, None] * x

    def _scan(self, conv_out: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, ssm_state: torch.Tensor,
              slot: int) -> torch.Tensor:
        """One sequence's prompt chunk [L] from the state in its slot (SSD, Q tokens at a time)."""
        x, B, C = self._activate(conv_out)
        state = ssm_state[slot]  # [heads, head_dim, state_size]
        y = torch.empty_like(x)
        for start in range(0, x.shape[0], self.chunk_size):
            end = min(start + self.chunk_size, x.shape[0])
            xs, dts, Bs, Cs = x[start:end], dt[start:end], B[start:end], C[start:end]
            decay = torch.cumsum(dts * A, dim=0)  # [q, heads]: log of the decay from the chunk's start to t
            # decay from position u to t (t >= u) inside the chunk: exp(decay[t] - decay[u])
            between = decay[:, None, :] - decay[None, :, :]  # [t, u, heads]
            causal = torch.ones(end - start, end - start, dtype=torch.bool, device=x.device).tril()
            weights = torch.einsum("thn,uhn->htu", Cs, Bs) * torch.exp(
                between.masked_fill(~causal[..., None], float("-inf"))).permute(2, 0, 1)
            xdt = xs * dts[..., None]  # [q, heads, head_dim]
            ys = torch.einsum("htu,uhp->thp", weights, xdt)
            ys += torch.einsum("thn,hpn->thp", Cs, state) * torch.exp(decay)[..., None]  # the carried state
            y[start:end] = ys
            to_end = torch.exp(decay[-1][None] - decay)  # [q, heads]: decay from u to the chunk's end
            state = state * torch.exp(decay[-1])[:, None, None] + torch.einsum(
                "uhp,uhn->hpn", xdt * to_end[..., None], Bs)
        ssm_state[slot] = state
        return y + self.D.float()[:, None] * x
