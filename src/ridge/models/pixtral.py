"""Mistral 3's vision side: Pixtral's vision encoder and Mistral 3's projector (image patches -> rows of the
language model's embeddings).

Pixtral: a ViT over patches of 14 or 16 pixels (RMSNorms, a gated SiLU MLP, no biases), its patches normed once
before the blocks, a 2D rotary whose row and column take alternate frequencies of one table, and attention within
each image. The projector norms the patches, joins each 2x2 of them (one learned linear), and projects the result to
the language model's width through a GELU. Patches arrive in the preprocessor's order (each 2x2 consecutive), so
the join is a view; the merged tokens come out row by row, as the prompt's image tokens are laid out (row breaks
between the rows: multimodal/placement.py). The modules carry HF's names under `visual.` (`vision_tower.*`,
`multi_modal_projector.*`), so a checkpoint's tensors load by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ridge.models.layers import RMSNorm
from ridge.models.vision import ACTIVATIONS, patch_coordinates, rotate_pairs
from ridge.multimodal.vision_config import VisionConfig


class PixtralAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(cfg.width, cfg.width, bias=False)
                                                              for _ in range(4))

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, segments: list[int]) -> torch.Tensor:
        """x [N, width]; each of `segments` (an image's patches, in order) attends within itself."""
        q, k, v = (proj(x).unflatten(-1, (self.num_heads, -1)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rotate_pairs(q, rotations), rotate_pairs(k, rotations)
        out = torch.cat([F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs)))[0]
                         .transpose(0, 1)
                         for qs, ks, vs in zip(q.split(segments), k.split(segments), v.split(segments), strict=True)])
        return self.o_proj(out.flatten(1))


class PixtralMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act = ACTIVATIONS[cfg.activation]
        self.gate_proj = nn.Linear(cfg.width, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.width, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PixtralLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.width, cfg.norm_eps)
        self.attention = PixtralAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.width, cfg.norm_eps)
        self.feed_forward = PixtralMLP(cfg)

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, segments: list[int]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rotations, segments)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralLayer(cfg) for _ in range(cfg.depth))


class PixtralEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_conv = nn.Conv2d(cfg.in_channels, cfg.width, cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.ln_pre = RMSNorm(cfg.width, cfg.norm_eps)
        self.transformer = PixtralTransformer(cfg)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [N, patch_values] of images with grids (1, rows, columns) -> [N, width]."""
        # a convolution whose stride is its kernel over one patch each: a matmul (HF's name and layout kept)
        x = self.ln_pre(F.linear(patches.to(self.patch_conv.weight.dtype), self.patch_conv.weight.flatten(1)))
        coordinates = torch.cat([patch_coordinates(grid, self.cfg.merge_size, x.device) for grid in grids])
        rotations = self._rotations(coordinates)
        segments = [frames * rows * columns for frames, rows, columns in grids]
        for layer in self.transformer.layers:
            x = layer(x, rotations, segments)
        return x

    def _rotations(self, coordinates: torch.Tensor) -> torch.Tensor:
        """Each patch's turn (complex [N, head_dim / 2]) from its (row, column) [N, 2]: its row by the even
        frequencies of a head-wide table, then its column by the odd ones."""
        cfg = self.cfg
        head_dim = cfg.width // cfg.num_heads
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                                         device=coordinates.device) / head_dim)
        angles = torch.cat([coordinates[:, :1].float() * inv_freq[0::2], coordinates[:, 1:].float() * inv_freq[1::2]],
                           dim=-1)
        return torch.polar(torch.ones_like(angles), angles)


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merge_size = cfg.merge_size
        self.merging_layer = nn.Linear(cfg.width * cfg.merge_size**2, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, width], each merge x merge unit's patches consecutive -> [N / merge^2, width]. The joined vector
        runs channel by channel, each channel's patches row by row (HF's unfold)."""
        unit = self.merge_size**2
        return self.merging_layer(x.unflatten(0, (-1, unit)).transpose(1, 2).flatten(1))


class MultiModalProjector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.width, cfg.projector_norm_eps)
        self.patch_merger = PatchMerger(cfg)
        self.linear_1 = nn.Linear(cfg.width, cfg.output_size, bias=cfg.projector_bias)
        self.act = ACTIVATIONS[cfg.projector_activation]
        self.linear_2 = nn.Linear(cfg.output_size, cfg.output_size, bias=cfg.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.patch_merger(self.norm(x)))))


class PixtralVision(nn.Module):
    """The encoder and the projector, called as VisionTower is (models/vision.py): patches [N, patch_values] of
    images with grids (1, rows, columns) -> [N / merge_size^2, 1, output_size], each image's tokens row by row."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = PixtralEncoder(cfg)
        self.multi_modal_projector = MultiModalProjector(cfg)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(patches, grids)).unsqueeze(1)
