"""Gemma 3's vision side: SigLIP's vision encoder and Gemma 3's projector (a square image's patches -> rows of the
language model's embeddings).

SigLIP: a ViT over 14x14 patches of an image resized to a fixed square (896 pixels: 64x64 patches), a learned
position per patch, LayerNorms and a GELU-tanh MLP with biases, attention over the whole image, a final LayerNorm.
The projector averages each 4x4 of patches into one token (256 an image), RMS-norms it (Gemma's 1 + w) and projects
it to the language model's width. Patches arrive in the preprocessor's order, each 4x4 consecutive, so the pooling
is a mean over runs of 16 and the tokens come out row by row; each patch's learned position is read at its row and
column. The modules carry HF's names under `visual.` (`vision_tower.*`, the published checkpoints'
`vision_tower.vision_model.*` read as that; `multi_modal_projector.*`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ridge.models.vision import ACTIVATIONS, patch_coordinates
from ridge.multimodal.vision_config import VisionConfig


class SiglipAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(cfg.width, cfg.width) for _ in range(4))

    def forward(self, x: torch.Tensor, segments: list[int]) -> torch.Tensor:
        """x [N, width]; each of `segments` (an image's patches) attends within itself."""
        q, k, v = (proj(x).unflatten(-1, (self.num_heads, -1)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = torch.cat([F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs)))[0]
                         .transpose(0, 1)
                         for qs, ks, vs in zip(q.split(segments), k.split(segments), v.split(segments), strict=True)])
        return self.out_proj(out.flatten(1))


class SiglipMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act = ACTIVATIONS[cfg.activation]
        self.fc1 = nn.Linear(cfg.width, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.width, eps=cfg.norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.width, eps=cfg.norm_eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: torch.Tensor, segments: list[int]) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), segments)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.in_channels, cfg.width, cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.position_embeddings, cfg.width)


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipLayer(cfg) for _ in range(cfg.depth))


class SiglipVisionModel(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.width, eps=cfg.norm_eps)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [N, patch_values] of images with grids (1, rows, columns) -> [N, width]."""
        embedding = self.embeddings.patch_embedding
        # a convolution whose stride is its kernel over one patch each: a matmul (HF's name and layout kept)
        x = F.linear(patches.to(embedding.weight.dtype), embedding.weight.flatten(1), embedding.bias)
        side = self.cfg.longest_edge // self.cfg.patch_size
        at = torch.cat([patch_coordinates(grid, self.cfg.merge_size, x.device) for grid in grids])
        x = x + self.embeddings.position_embedding(at[:, 0] * side + at[:, 1])
        segments = [frames * rows * columns for frames, rows, columns in grids]
        for layer in self.encoder.layers:
            x = layer(x, segments)
        return self.post_layernorm(x)


class MultiModalProjector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.pool = cfg.merge_size**2
        self.eps = cfg.projector_norm_eps
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.zeros(cfg.width))  # Gemma's: the norm multiplies by 1 + w
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(cfg.width, cfg.output_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, width], each pooled unit's patches consecutive -> [N / pool, output_size]."""
        pooled = x.unflatten(0, (-1, self.pool)).mean(1)
        scale = 1 + self.mm_soft_emb_norm.weight.float()  # Gemma's norm multiplies by 1 + w
        normed = F.rms_norm(pooled.float(), (pooled.shape[-1],), eps=self.eps) * scale
        return (normed.to(x.dtype) @ self.mm_input_projection_weight).to(x.dtype)


class SiglipVision(nn.Module):
    """The encoder and the projector, called as VisionTower is (models/vision.py): patches [N, patch_values] of
    images with grids (1, rows, columns) -> [N / merge_size^2, 1, output_size], each image's tokens row by row."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = SiglipVisionModel(cfg)
        self.multi_modal_projector = MultiModalProjector(cfg)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(patches, grids)).unsqueeze(1)
