"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision tower: image patches -> rows of the language model's embeddings.

A ViT over 14x14 patches (Qwen3-VL's: 16x16; two frames deep: an image is its frame twice) with a 2D rotary over each
patch's row and column, bidirectional attention within each image (Qwen2.5-VL: within windows of 112 pixels, but for
a few full-attention blocks), and a merger that joins each 2x2 of patches into one token of the language model.
Qwen3-VL adds a learned position table resampled to each image's grid, and DeepStack: mergers after a few middle
blocks whose rows the language model adds to the image tokens' hidden states after its first layers. The modules
carry HF's names (Qwen3-VL's few renamed ones: tensor_names.HF_VISION_NAMES), so `visual.*` tensors load by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ridge.models.layers import LayerNorm, RMSNorm
from ridge.multimodal.vision_config import VisionConfig

ACTIVATIONS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "silu": F.silu, "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, segments: list[int]) -> torch.Tensor:
        """x [N, width]; each of `segments` (lengths, in order) attends within itself, bidirectionally."""
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(1)  # [N, heads, head_dim] each
        q, k = rotate_pairs(q, rotations), rotate_pairs(k, rotations)
        # [1, heads, tokens, head_dim]: the CPU's flash kernel takes four dimensions (three fall to the math path)
        out = torch.cat([F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs)))[0]
                         .transpose(0, 1)
                         for qs, ks, vs in zip(q.split(segments), k.split(segments), v.split(segments), strict=True)])
        return self.proj(out.flatten(1))


def rotate_pairs(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim] turned by rotations (complex [N, head_dim / 2]) in rotate-half pairs, in float32 as
    HF turns the tower's q and k."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].float(), x[..., half:].float()) * rotations.unsqueeze(1)
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act = ACTIVATIONS[cfg.activation]
        self.gated = cfg.gated_mlp
        if cfg.gated_mlp:  # Qwen2.5-VL's, biased
            self.gate_proj = nn.Linear(cfg.width, cfg.intermediate_size)
            self.up_proj = nn.Linear(cfg.width, cfg.intermediate_size)
            self.down_proj = nn.Linear(cfg.intermediate_size, cfg.width)
        else:
            self.fc1 = nn.Linear(cfg.width, cfg.intermediate_size)
            self.fc2 = nn.Linear(cfg.intermediate_size, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


def _norm(cfg: VisionConfig, width: int) -> nn.Module:
    return RMSNorm(width, 1e-6) if cfg.rms_norm else LayerNorm(width, 1e-6, bias=True)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(cfg, cfg.width), _norm(cfg, cfg.width)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, segments: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotations, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each run of merge_size^2 neighbouring patches (the preprocessor lays them out consecutively) -> one token.
    norm_joined: the norm over the joined patches rather than over each (DeepStack's mergers)."""

    def __init__(self, cfg: VisionConfig, norm_joined: bool = False) -> None:
        super().__init__()
        self.joined = cfg.width * cfg.merge_size**2
        self.norm_joined = norm_joined
        self.ln_q = _norm(cfg, self.joined if norm_joined else cfg.width)
        self.mlp = nn.Sequential(nn.Linear(self.joined, self.joined), nn.GELU(),
                                 nn.Linear(self.joined, cfg.output_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_joined:
            return self.mlp(self.ln_q(x.view(-1, self.joined)))
        return self.mlp(self.ln_q(x).view(-1, self.joined))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        # a convolution whose stride is its kernel over one patch each: a matmul (HF's name and layout kept)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.width, kernel, stride=kernel, bias=cfg.patch_bias)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return F.linear(patches.to(self.proj.weight.dtype), self.proj.weight.flatten(1), self.proj.bias)


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.position_embeddings, cfg.width) if cfg.position_embeddings else None
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(cfg, norm_joined=True) for _ in cfg.deepstack_blocks)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [N, patch_values] of images with grids (frames, rows, columns of patches), in order, as
        preprocess_image lays them out -> [N / merge_size^2, 1 + len(deepstack_blocks), output_size]: each image's
        tokens in order, each token's rows the language model's input embedding, then what DeepStack adds to its
        hidden state after the language model's first, second, ... layer."""
        cfg = self.cfg
        x = self.patch_embed(patches)
        coordinates = torch.cat([patch_coordinates(grid, cfg.merge_size, x.device) for grid in grids])  # [N, 2]
        if self.pos_embed is not None:
            x = x + self._learned_positions(grids, coordinates).to(x.dtype)
        rotations = self._rotations(coordinates)
        whole = [rows * columns for frames, rows, columns in grids for _ in range(frames)]
        order = None
        if cfg.window_size is not None:  # Qwen2.5-VL: patches regrouped window by window (each merge unit whole)
            order, windows = self._windows(grids)
            unit = cfg.merge_size**2
            x = x.unflatten(0, (-1, unit))[order].flatten(0, 1)
            rotations = rotations.unflatten(0, (-1, unit))[order].flatten(0, 1)
        deepstack = []
        for i, block in enumerate(self.blocks):
            windowed = cfg.window_size is not None and i not in cfg.full_attention_blocks
            x = block(x, rotations, windows if windowed else whole)
            if i in cfg.deepstack_blocks:
                deepstack.append(self.deepstack_merger_list[cfg.deepstack_blocks.index(i)](x))
        merged = torch.stack([self.merger(x), *deepstack], dim=1)
        return merged if order is None else merged[torch.argsort(order)]

    def _learned_positions(self, grids: list[tuple[int, int, int]], coordinates: torch.Tensor) -> torch.Tensor:
        """Each patch's row of the learned position table [N, width] (float32): the square table resampled
        bilinearly (corners aligned) to its image's grid, read at the patch's row and column."""
        side = math.isqrt(self.cfg.position_embeddings)
        table = self.pos_embed.weight.float().T.reshape(1, -1, side, side)
        rows, first = [], 0
        for frames, height, width in grids:
            resampled = F.interpolate(table, size=(height, width), mode="bilinear", align_corners=True)[0]
            at = coordinates[first:first + frames * height * width]
            rows.append(resampled[:, at[:, 0], at[:, 1]].T)
            first += len(at)
        return torch.cat(rows)

    def _rotations(self, coordinates: torch.Tensor) -> torch.Tensor:
        """Each patch's turn (complex [N, head_dim / 2]) from its (row, column) [N, 2]: its row's frequencies, then
        its column's, from one table of head_dim / 4 frequencies."""
        cfg = self.cfg
        head_dim = cfg.width // cfg.num_heads
        spatial = head_dim // 2
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32,
                                                         device=coordinates.device) / spatial)
        angles = (coordinates.unsqueeze(-1).float() * inv_freq).flatten(1)  # [N, 2 * len(inv_freq)]
        return torch.polar(torch.ones_like(angles), angles)

    def _windows(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL's windows: the merge units (merged tokens) of each frame cut into squares of window_size
        pixels from its top left; the units in window order, and each window's length in patches."""
        cfg = self.cfg
        side = cfg.window_size // cfg.merge_size // cfg.patch_size  # a window's side in merge units
        order, lengths, first = [], [], 0
        for frames, rows, columns in grids:
            units_h, units_w = rows // cfg.merge_size, columns // cfg.merge_size
            index = torch.arange(frames * units_h * units_w).view(frames, units_h, units_w)
            for frame in index:
                for top in range(0, units_h, side):
                    for left in range(0, units_w, side):
                        window = frame[top:top + side, left:left + side].flatten()
                        order.append(window + first)
                        lengths.append(len(window) * cfg.merge_size**2)
            first += frames * units_h * units_w
        return torch.cat(order), lengths


def patch_coordinates(grid: tuple[int, int, int], merge: int, device: torch.device) -> torch.Tensor:
    """(row, column) of each patch [frames * rows * columns, 2], in the preprocessor's order: merge units row by row,
    the merge x merge patches of each unit row by row."""
    frames, rows, columns = grid
    r = torch.arange(rows, device=device).view(rows // merge, merge, 1, 1).expand(-1, -1, columns // merge, merge)
    c = torch.arange(columns, device=device).view(1, 1, columns // merge, merge).expand(rows // merge, merge, -1, -1)
    coordinates = torch.stack([r.transpose(1, 2).flatten(), c.transpose(1, 2).flatten()], dim=-1)
    return coordinates.repeat(frames, 1)


@dataclass
class ImageStep:
    """A step's image tokens: the rows of the step that are image tokens, the tower's output for them [rows,
    levels, hidden] (what the language model reads there in place of the placeholder's row, then DeepStack's
    additions after its first layers), and every row's three M-RoPE positions [3, T] (None: a model whose image
    tokens turn at their index, Mistral 3's)."""

    rows: torch.Tensor
    embeddings: torch.Tensor
    rope_positions: torch.Tensor | None
