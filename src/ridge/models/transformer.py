"""The decoder-only transformer that every architecture ridge runs shares; they differ only in ModelConfig."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from ridge.attention.backend import AttentionBackend, StepMetadata
from ridge.config import ModelConfig
from ridge.kv.state_cache import StateStep
from ridge.models.gated_delta import GatedDeltaMixer
from ridge.models.layers import Attention, DecoderLayer, GatedMLP, RMSNorm, RopeStep, RotaryEmbedding, make_norm
from ridge.models.mamba import Mamba2Mixer
from ridge.models.mla import LatentAttention
from ridge.models.moe import MoEBlock
from ridge.models.short_conv import ShortConvMixer


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # an empty table, not nn.Embedding's normal_ draw: the weights are always loaded or drawn after, and on the
        # meta device (where the loader builds the model) that draw runs through torch's Python references, whose
        # first use imports torch._dynamo (docs/notes/server-hardening.md)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self._mixer(cfg, i), self._mlp(cfg, i), cfg.is_local(i), ssm=cfg.is_ssm_layer(i),
                         nope=i in cfg.nope_layers)
            for i in range(cfg.num_layers))
        self.norm = make_norm(cfg)
        if torch.get_default_device().type != "meta":  # on meta, the loader makes them with the weights
            self.make_rotary()
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.output_projection: nn.Module | None = None  # a faster kernel for the vocabulary projection

    @staticmethod
    def _mixer(cfg: ModelConfig, layer: int) -> nn.Module:
        if cfg.is_ssm_layer(layer):
            mixer = {"short_conv": ShortConvMixer, "gated_delta": GatedDeltaMixer}.get(cfg.state_mixer, Mamba2Mixer)
            return mixer(cfg, layer)
        return LatentAttention(cfg, layer) if cfg.is_mla else Attention(cfg, layer)

    @staticmethod
    def _mlp(cfg: ModelConfig, layer: int) -> nn.Module | None:
        if not cfg.has_mlp or layer in cfg.mlp_free_layers:
            return None
        return MoEBlock(cfg) if cfg.is_moe_layer(layer) else GatedMLP(cfg)

    def make_rotary(self) -> None:
        """The rotary tables (buffers, not weights: made when the weights replace the meta device's): one for
        global layers, and one for local layers where their base differs (Gemma 3). A temperature sharpens the
        queries of every attention layer (Ministral 3's), or of those without rotary (Llama 4's)."""
        cfg, temperature = self.cfg, self.cfg.attention_temperature
        turning = None if temperature is not None and temperature.nope_layers_only else temperature
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling,
                                      turning)
        self.rotary_local = (RotaryEmbedding(cfg.rotary_dim, cfg.rope_local_theta, cfg.max_position_embeddings,
                                             temperature=turning)
                             if cfg.rope_local_theta is not None else None)
        # NoPE layers' (SmolLM3's): a rotary of no dims, whose turn leaves q and k as they are
        self.rotary_none = (RotaryEmbedding(0, cfg.rope_theta, cfg.max_position_embeddings, temperature=temperature)
                            if cfg.nope_layers else None)

    def layer_rotary(self, layer: DecoderLayer) -> RotaryEmbedding:
        """The rotary a layer's attention turns q and k with: the model's, its local layers', or none (NoPE)."""
        if layer.nope and self.rotary_none is not None:
            return self.rotary_none
        return self.rotary_local if layer.local and self.rotary_local is not None else self.rotary

    def key_centers(self, positions: int) -> dict[int, torch.Tensor]:
        """Each attention layer's key center over positions 0..positions-1 (Attention.key_center), by layer index;
        layers whose keys have no bias are left out."""
        centers = {}
        for layer in self.layers:
            if not isinstance(layer.attn, Attention):  # latent attention: a quantized cache refuses it
                continue
            center = layer.attn.key_center(self.layer_rotary(layer), positions)
            if center is not None:
                centers[layer.attn.layer_index] = center
        return centers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.cfg.embedding_scale:  # sqrt(hidden) rounded to the activations' dtype, as Gemma was trained
            x = x * torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype)
        if self.cfg.embedding_multiplier != 1.0:
            x = x * self.cfg.embedding_multiplier
        return x

    def use_kernels(self, ops: ModuleType | None) -> None:
        """Route norms, rotary, the MLP activation, latent attention's per-head products and Mamba-2's decode
        recurrence through fused kernels (None: plain torch ops)."""
        for module in self.modules():
            if isinstance(module, RMSNorm | GatedMLP | RotaryEmbedding | LatentAttention | Mamba2Mixer):
                module.ops = ops

    def replace_linears(self, replace: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]) -> None:
        """Swap every plain nn.Linear of the decoder layers for replace(weight, bias), and give the model an
        output projection replace(output weight, None) if it has none (a tied table stays the embedding's)."""
        if self.output_projection is None:
            self.output_projection = replace(self.output_weight, None)
        # by path, one at a time: each old layer (and its weight, where replace copies it into a kernel's layout) is
        # dropped as its replacement is made, so that the model is never held twice
        paths = [(parent, name) for parent, module in self.layers.named_modules()
                 for name, child in module.named_children() if type(child) is nn.Linear]
        for parent, name in paths:
            module = self.layers.get_submodule(parent) if parent else self.layers
            child = getattr(module, name)
            setattr(module, name, replace(child.weight, child.bias))
            del child

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        meta: StepMetadata,
        logits_indices: torch.Tensor | None = None,
        states: StateStep | None = None,
    ) -> torch.Tensor:
        """Flat [T] tokens of every scheduled sequence -> float32 logits at `logits_indices` (all if None);
        states: the step's state slots, for a model with state-space layers.

        Only the positions that get sampled pay for the vocabulary projection, which for a small model
        is a large share of all weights.
        """
        return self.compute_logits(self.hidden_states(input_ids, positions, backend, meta, logits_indices, states))

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        meta: StepMetadata,
        indices: torch.Tensor | None = None,
        states: StateStep | None = None,
    ) -> torch.Tensor:
        """The final norm's output [len(indices) or T, hidden]: what compute_logits projects."""
        x = self.embed(input_ids)
        steps: dict[int, RopeStep] = {}  # each rotary's step, made once for all the layers that turn with it
        residual = None
        for layer in self.layers:
            rotary = self.layer_rotary(layer)
            rope = steps.get(id(rotary)) or steps.setdefault(id(rotary), rotary.step(positions))
            x, residual = layer(x, residual, rope, backend, meta, states)
        if indices is not None:
            x, residual = x[indices], residual[indices]
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm's output [T, hidden] -> float32 logits [T, vocab] (soft-capped: Gemma 2; divided by
        logits_scaling: Granite)."""
        if self.output_projection is not None:
            logits = self.output_projection(hidden).float()
        else:
            logits = torch.nn.functional.linear(hidden, self.output_weight).float()
        if self.cfg.logits_scaling != 1.0:
            logits = logits / self.cfg.logits_scaling
        if self.cfg.final_logit_softcap:
            cap = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
