"""The decoder-only transformer that every architecture ridge runs shares; they differ only in ModelConfig."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from ridge.attention.backend import AttentionBackend, AttentionMetadata, StepMetadata
from ridge.config import ModelConfig
from ridge.kv.state_cache import StateStep
from ridge.models.gated_delta import GatedDeltaMixer
from ridge.models.layers import (
    Attention,
    ClassificationHead,
    DecoderLayer,
    GatedMLP,
    RMSNorm,
    RopeStep,
    RotaryEmbedding,
    make_norm,
)
from ridge.models.mamba import Mamba2Mixer
from ridge.models.mla import LatentAttention
from ridge.models.moe import MLPBesideExperts, MoEBlock
from ridge.models.pixtral import PixtralVision
from ridge.models.short_conv import ShortConvMixer
from ridge.models.siglip import SiglipVision
from ridge.models.vision import ImageStep, VisionTower


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
        # post-norms end each layer with a norm of its own: no final one
        self.norm = nn.Identity() if cfg.post_norms else make_norm(cfg)
        # an encoder's learned positions and token types, and the norm over the sum (BERT's)
        positions = cfg.max_position_embeddings + cfg.position_offset
        self.embed_positions = (nn.Embedding(positions, cfg.hidden_size,
                                             _weight=torch.empty(positions, cfg.hidden_size))
                                if cfg.learned_positions else None)
        self.embed_token_types = (nn.Embedding(cfg.type_vocab_size, cfg.hidden_size,
                                               _weight=torch.empty(cfg.type_vocab_size, cfg.hidden_size))
                                  if cfg.learned_positions and cfg.type_vocab_size else None)
        self.embed_norm = make_norm(cfg) if cfg.learned_positions else None
        self.classifier = ClassificationHead(cfg.hidden_size, cfg.num_labels) if cfg.num_labels else None
        # BERT's token types of a text pair ([CLS] a [SEP] b [SEP], its tokenizer's pair template): a token's type is
        # the number of separators before it in its sequence. The separator's id is the tokenizer's, set at load
        # (engine/loading.py) for a classifier with token types; None: every token type 0 (one text)
        self.segment_separator: int | None = None
        if torch.get_default_device().type != "meta":  # on meta, the loader makes them with the weights
            self.make_rotary()
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # per-layer embeddings (Gemma 4's E2B / E4B): each token's slice for every layer, from a table of its own and
        # a projection of its embedding
        width = cfg.num_layers * cfg.per_layer_input_size
        self.embed_per_layer = (nn.Embedding(cfg.vocab_size, width, _weight=torch.empty(cfg.vocab_size, width))
                                if width else None)
        self.per_layer_model_projection = nn.Linear(cfg.hidden_size, width, bias=False) if width else None
        self.per_layer_projection_norm = (RMSNorm(cfg.per_layer_input_size, cfg.rms_norm_eps) if width else None)
        self.output_projection: nn.Module | None = None  # a faster kernel for the vocabulary projection
        # a vision model's tower (Qwen-VL's: HF's name, its weights load by it; Mistral 3's and Gemma 3's under it)
        towers = {"pixtral": PixtralVision, "siglip": SiglipVision}
        self.visual = None if cfg.vision is None else towers.get(cfg.vision.family, VisionTower)(cfg.vision)

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
        if cfg.is_moe_layer(layer):
            return MLPBesideExperts(cfg) if cfg.moe_beside_mlp else MoEBlock(cfg)
        double_wide = cfg.double_wide_shared_mlp and cfg.kv_source(layer) != layer
        return GatedMLP(cfg, 2 * cfg.intermediate_size if double_wide else None, cfg.mlp_bias, cfg.gated_mlp)

    def make_rotary(self) -> None:
        """The rotary tables (buffers, not weights: made when the weights replace the meta device's): one for
        global layers, and one for local layers where their base differs (Gemma 3). A temperature sharpens the
        queries of every attention layer (Ministral 3's), or of those without rotary (Llama 4's)."""
        cfg, temperature = self.cfg, self.cfg.attention_temperature
        turning = None if temperature is not None and temperature.nope_layers_only else temperature
        self.rotary = RotaryEmbedding(cfg.global_rotary_dim, cfg.rope_theta, cfg.max_position_embeddings,
                                      cfg.rope_scaling, turning, turning_fraction=cfg.global_rotary_fraction,
                                      sections=cfg.mrope_section, interleaved_sections=cfg.mrope_interleaved)
        # the local layers' own where their base differs (Gemma 3), or their heads' width or turning share (Gemma 4)
        own = cfg.rope_local_theta is not None or cfg.global_head_dim or cfg.global_rotary_fraction != 1.0
        self.rotary_local = (RotaryEmbedding(cfg.rotary_dim, cfg.rope_local_theta or cfg.rope_theta,
                                             cfg.max_position_embeddings, temperature=turning) if own else None)
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
        images: ImageStep | None = None,
    ) -> torch.Tensor:
        """The final norm's output [len(indices) or T, hidden]: what compute_logits projects. images: the step's image
        tokens' embeddings (and DeepStack's additions) and M-RoPE positions, for a vision model's step with image
        tokens."""
        x = self.embed(input_ids)
        deepstack = 0
        if images is not None:
            x[images.rows] = images.embeddings[:, 0].to(x.dtype)
            positions = images.rope_positions if images.rope_positions is not None else positions
            deepstack = images.embeddings.shape[1] - 1
        if self.embed_positions is not None:
            x = self.encoder_embeddings(x, input_ids, positions)
        steps: dict[int, RopeStep] = {}  # each rotary's step, made once for all the layers that turn with it
        residual = None
        extras = {}
        if self.cfg.kv_shared_layers:
            extras["shared_kv"] = {}
        per_layer = self.per_layer_inputs(input_ids, x) if self.embed_per_layer is not None else None
        first_shared = self.cfg.num_layers - self.cfg.kv_shared_layers
        for i, layer in enumerate(self.layers):
            if i == first_shared and indices is not None and len(indices) < x.shape[0]:
                # the layers from here write no KV: only the rows whose logits are read go on, each a query over
                # its sequence's cache (a prompt's other tokens skip them: HF's generate does the same)
                x, residual = x[indices], None if residual is None else residual[indices]
                if not len(indices):  # a step of prompt chunks none of which ends its prompt: nothing is read
                    indices = None
                    break
                per_layer = None if per_layer is None else per_layer[indices]
                positions, steps, meta = positions[indices], {}, self._rows_step(indices, meta, backend)
                extras["shared_kv"] = {j: (k[indices], v[indices]) for j, (k, v) in extras["shared_kv"].items()}
                indices = None
            rotary = self.layer_rotary(layer)
            rope = steps.get(id(rotary)) or steps.setdefault(id(rotary), rotary.step(positions))
            if per_layer is not None:
                extras["per_layer_input"] = per_layer[:, i]
            x, residual = layer(x, residual, rope, backend, meta, states, **extras)
            if i < deepstack:  # the hidden state is x + residual (or x alone): one of them takes DeepStack's rows
                stream = x if residual is None else residual
                stream.index_add_(0, images.rows, images.embeddings[:, i + 1].to(stream.dtype))
        if indices is not None:
            x, residual = x[indices], None if residual is None else residual[indices]
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    @staticmethod
    def _rows_step(rows: torch.Tensor, meta: StepMetadata, backend: AttentionBackend) -> list[AttentionMetadata]:
        """The step of these rows alone, each a query over its sequence's cache (AttentionMetadata.rows_as_decodes),
        prepared by the backend."""
        step = [group.rows_as_decodes(rows) for group in meta]
        for group in step:
            backend.prepare(group)
        return step

    def encoder_embeddings(self, tokens: torch.Tensor, input_ids: torch.Tensor,
                           positions: torch.Tensor) -> torch.Tensor:
        """An encoder's input [T, hidden]: the tokens' rows plus their positions' and their token types' (type 0 for
        one text; a pair's second text type 1, see segment_separator), LayerNormed. Each sequence of the step is
        whole (its positions from 0)."""
        x = tokens + self.embed_positions(positions + self.cfg.position_offset)
        if self.embed_token_types is not None:
            if self.segment_separator is None:
                x = x + self.embed_token_types.weight[0]
            else:
                x = x + self.embed_token_types(self.token_types(input_ids, positions))
        return self.embed_norm(x)

    def token_types(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each token's type: the separators before it in its sequence, at most the last type."""
        separators = (input_ids == self.segment_separator).long()
        before = separators.cumsum(0) - separators  # separators before each token in the whole step
        starts = positions == 0
        sequence = starts.long().cumsum(0) - 1
        return (before - before[starts][sequence]).clamp(max=self.cfg.type_vocab_size - 1)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """Each token's per-layer inputs [T, layers, per_layer_input_size]: its rows of the per-layer table (scaled
        by the square root of their width) and the normed projection of its embeddings, averaged in the square."""
        width, layers = self.cfg.per_layer_input_size, self.cfg.num_layers
        table = self.embed_per_layer(input_ids) * torch.tensor(width**0.5, dtype=embeddings.dtype)
        projected = self.per_layer_model_projection(embeddings) * self.cfg.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.unflatten(-1, (layers, width)))
        return (projected + table.unflatten(-1, (layers, width))) * 2**-0.5

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
