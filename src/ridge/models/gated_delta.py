"""Gated DeltaNet: the linear-attention mixer of Qwen3.5 and Qwen3-Next (Yang et al., "Gated Delta Networks").

Each value head h keeps a matrix state S (value dims x key dims) that a token first decays, then corrects toward
its value by the delta rule, then reads with its query:
    S_t = a_t S_{t-1}                      a_t = exp(-exp(A_log_h) * softplus(alpha_t + dt_bias_h)) in (0, 1)
    S_t += beta_t (v_t - S_t k_t) k_t^T    beta_t = sigmoid(b_t): how far S_t k_t moves to v_t
    y_t = S_t q_t
with q and k L2-normed per head (q also scaled by key_dim ** -0.5), and q, k, v from the token through a short
causal convolution (silu after it), as Mamba-2's x, B and C: a sequence's past is that convolution's last inputs and
S, a fixed-size state kept in the KV manager's slots (kv/state_cache.py) in float32 in Mamba-2's layout ([heads,
head_dim, state_size]: S above, value rows and key columns), with query / key heads shared by groups of value heads
as Mamba-2's B and C are. The output is RMS-normed per head, gated by silu(z) and projected out.

A decode token runs the recurrence once. A prompt chunk runs it C tokens at a time in the WY form: inside a chunk
the delta rule's corrections are one triangular solve (T u = beta v, T unit lower triangular, from beta k_i . k_j and
the decays between positions), the outputs an attention-like masked matmul plus the carried state's read, and
only the state crosses chunks, so the engine's prefill chunks continue from the state in the slot exactly.
Written in torch: the work is matmuls and a triangular solve per chunk, and no library ridge may depend on has it
for the CPU (flash-linear-attention's kernels are Triton, for GPUs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ridge.config import ModelConfig
from ridge.kv.state_cache import StateStep

# the WY form's chunk: the triangular solve grows as its square, the state crosses chunks once per chunk
CHUNK = 64


class GatedDeltaMixer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.heads, self.value_dim, self.key_dim = cfg.ssm_num_heads, cfg.ssm_head_dim, cfg.ssm_state_size
        self.groups, self.eps = cfg.ssm_groups, cfg.rms_norm_eps
        self.tiled = cfg.ssm_heads_tiled  # which query / key head a value head reads (ModelConfig's)
        self.inner, self.channels = cfg.ssm_inner_size, cfg.ssm_conv_channels
        # one projection to the convolution's input (q, k, v), the gate z, beta's logit b and the decay's alpha
        self.in_proj = nn.Linear(cfg.hidden_size, self.channels + self.inner + 2 * self.heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.channels, cfg.ssm_conv_kernel))  # depthwise taps
        self.conv_bias = nn.Parameter(torch.empty(self.channels)) if cfg.ssm_conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.norm_weight = nn.Parameter(torch.empty(self.value_dim))  # the per-head RMSNorm's, before the gate
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=False)

    def shard(self, local: ModelConfig) -> None:
        """Become this rank's part (its weights already cut: cluster/shards.py): `local`'s value heads and groups."""
        self.heads, self.groups = local.ssm_num_heads, local.ssm_groups
        self.inner, self.channels = local.ssm_inner_size, local.ssm_conv_channels

    def forward(self, x: torch.Tensor, step: StateStep) -> torch.Tensor:
        """x: [T, hidden] of the step's sequences (decodes first) -> [T, hidden]; their slots' states advanced."""
        qkv, z, b, alpha = self.in_proj(x).split_with_sizes([self.channels, self.inner, self.heads, self.heads], -1)
        conv_state, state = step.cache.conv[self.layer_index], step.cache.ssm[self.layer_index]
        beta = torch.sigmoid(b.float())
        decay = -torch.exp(self.A_log.float()) * F.softplus(alpha.float() + self.dt_bias.float())  # log a_t
        taps = self.conv_weight.float()
        y = torch.empty(x.shape[0], self.heads, self.value_dim, dtype=torch.float32, device=x.device)
        decodes = slice(0, step.num_decodes)
        if step.num_decodes:
            slots = step.slots[decodes]
            window = torch.cat([conv_state[slots], qkv[decodes, :, None].float()], dim=-1)  # [D, channels, taps]
            conv_state[slots] = window[:, :, 1:]
            q, k, v = self._activate((window * taps).sum(-1))
            y[decodes] = self._step(q, k, v, decay[decodes], beta[decodes], state, slots)
        for seq, (start, length) in enumerate(step.chunks, start=step.num_decodes):
            rows, slot = slice(start, start + length), int(step.slots[seq])
            window = torch.cat([conv_state[slot], qkv[rows].float().T], dim=-1)  # [channels, taps - 1 + length]
            conv_state[slot] = window[:, window.shape[1] - conv_state.shape[2]:]
            conv_out = F.conv1d(window[None], taps[:, None], groups=self.channels)[0].T
            y[rows] = self._scan(*self._activate(conv_out), decay[rows], beta[rows], state, slot)
        normed = F.rms_norm(y, (self.value_dim,), eps=self.eps).to(x.dtype) * self.norm_weight
        gated = normed * F.silu(z.float()).view(-1, self.heads, self.value_dim)  # float32: as HF's gated norm
        return self.out_proj(gated.flatten(1).to(x.dtype))

    def _activate(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [n, channels] -> q, k [n, heads, key_dim] (each value head its group's, normed,
        q scaled) and v [n, heads, value_dim]."""
        if self.conv_bias is not None:
            conv_out = conv_out + self.conv_bias.float()
        width = self.groups * self.key_dim
        q, k, v = F.silu(conv_out).split_with_sizes([width, width, self.inner], dim=-1)
        per_group = self.heads // self.groups

        def heads(t: torch.Tensor) -> torch.Tensor:  # L2 norm as flash-linear-attention's: x / sqrt(|x|^2 + eps)
            t = t.unflatten(-1, (self.groups, self.key_dim))
            t = t * torch.rsqrt(t.square().sum(-1, keepdim=True) + 1e-6)
            return t.repeat(1, per_group, 1) if self.tiled else t.repeat_interleave(per_group, dim=1)

        return heads(q) * self.key_dim**-0.5, heads(k), v.unflatten(-1, (self.heads, self.value_dim))

    @staticmethod
    def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
              states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token of each decoding sequence, batched: the recurrence once."""
        state = states[slots] * torch.exp(decay)[..., None, None]  # [D, heads, value_dim, key_dim]
        correction = beta[..., None] * (v - (state @ k[..., None]).squeeze(-1))
        state += correction[..., None] * k[:, :, None, :]
        states[slots] = state
        return (state @ q[..., None]).squeeze(-1)

    @staticmethod
    def _scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
              states: torch.Tensor, slot: int) -> torch.Tensor:
        """One sequence's prompt chunk [L] from the state in its slot, CHUNK tokens at a time (the WY form).

        Per head, in a chunk of C tokens with G_t the decay's log summed from the chunk's start to t and S the
        state carried in: position t's correction u_t = beta_t (v_t - S_t-1 k_t), where S_t-1 is S decayed by
        exp(G_t-1) plus the chunk's earlier corrections u_j k_j^T decayed from j on. Written out, that is the
        lower unitriangular system  u_t + sum_{j<t} beta_t exp(G_t - G_j) (k_t . k_j) u_j = beta_t (v_t -
        exp(G_t) S k_t), one solve for the chunk; then y_t = exp(G_t) S q_t + sum_{j<=t} exp(G_t - G_j) (q_t . k_j)
        u_j, and S leaves as exp(G_C) S + sum_j exp(G_C - G_j) u_j k_j^T."""
        state = states[slot]  # [heads, value_dim, key_dim]
        y = torch.empty_like(v)
        # heads first: [heads, L, dim]
        q, k, v, decay, beta = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), decay.T, beta.T
        for start in range(0, v.shape[1], CHUNK):
            end = min(start + CHUNK, v.shape[1])
            qs, ks, vs, bs = q[:, start:end], k[:, start:end], v[:, start:end], beta[:, start:end, None]
            logs = torch.cumsum(decay[:, start:end], dim=1)  # [heads, C]: G_t
            causal = torch.ones(end - start, end - start, dtype=torch.bool, device=v.device).tril()
            between = torch.exp((logs[:, :, None] - logs[:, None, :]).masked_fill(~causal, float("-inf")))
            system = (bs * (ks @ ks.transpose(1, 2)) * between).tril(-1)  # the strictly lower part
            system.diagonal(dim1=1, dim2=2).fill_(1.0)
            carried = torch.exp(logs)[..., None]  # [heads, C, 1]: S's decay up to t
            rhs = bs * (vs - carried * (ks @ state.transpose(1, 2)))
            u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [heads, C, value_dim]
            y[start:end] = (carried * (qs @ state.transpose(1, 2)) + ((qs @ ks.transpose(1, 2)) * between) @ u
                            ).transpose(0, 1)
            to_end = torch.exp(logs[:, -1:] - logs)[..., None]  # [heads, C, 1]: decay from j to the chunk's end
            state = state * torch.exp(logs[:, -1])[:, None, None] + (u * to_end).transpose(1, 2) @ ks
        states[slot] = state
        return y
