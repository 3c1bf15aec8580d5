"""A vision tower's shape, read from an HF config (the tower itself: models/vision.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

VISION_ACTIVATIONS = ("quick_gelu", "silu", "gelu", "gelu_pytorch_tanh")


def _activation(name: str, field: str, source: str) -> str:
    if name not in VISION_ACTIVATIONS:
        raise ValueError(f"{source}: {field}: {name!r} is not supported ({', '.join(VISION_ACTIVATIONS)})")
    return name


@dataclass(frozen=True)
class VisionConfig:
    """A vision tower's shape: HF's vision_config of Qwen2-VL (LayerNorms, a plain MLP, every block over the whole
    image), Qwen2.5-VL (RMSNorms, a gated MLP, windows) or Qwen3-VL (Qwen2-VL's blocks over 16-pixel patches, a
    learned position table, DeepStack's mergers)."""

    depth: int
    width: int
    num_heads: int
    intermediate_size: int
    output_size: int  # the language model's hidden size: each merged token's width
    activation: str
    gated_mlp: bool
    rms_norm: bool
    window_size: int | None = None  # pixels a side of a window; None: every block attends to the whole image
    full_attention_blocks: tuple[int, ...] = ()
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0
    patch_bias: bool = False  # the patch embedding's (Qwen3-VL's)
    # a learned table of this many positions (a square grid), resampled to each image's grid of patches and added to
    # the patches' embeddings (Qwen3-VL's); 0: none
    position_embeddings: int = 0
    # DeepStack (Qwen3-VL's): after each of these blocks a merger of its own makes rows that the language model adds
    # to the image tokens' hidden states after its first, second, ... layer
    deepstack_blocks: tuple[int, ...] = ()
    # "qwen" (models/vision.py), "pixtral" (Mistral 3's: models/pixtral.py: Pixtral's blocks without biases, a
    # rotary of its own frequency split, and Mistral 3's projector, which merges after a norm and projects twice) or
    # "siglip" (Gemma 3's: models/siglip.py: SigLIP over a fixed square image, its patches pooled merge_size x
    # merge_size into tokens)
    family: str = "qwen"
    norm_eps: float = 1e-6
    projector_norm_eps: float = 1e-6
    projector_activation: str = "gelu"
    projector_bias: bool = False
    # Pixtral's: the largest side an image is resized to; SigLIP's: the side of the square every image is resized to
    # (each its config's image_size)
    longest_edge: int = 1024
    # Gemma 3's: an image's tokens attend to each other both ways in the language model (the rest causally), between
    # a start and an end token of their own (its chat template writes the start token where an image goes)
    bidirectional: bool = False
    start_token_id: int | None = None
    end_token_id: int | None = None

    @classmethod
    def from_gemma3(cls, outer: dict[str, Any], source: str) -> VisionConfig:
        """Gemma 3's (Gemma3ForConditionalGeneration's) vision_config (SigLIP's) and its projector's pooling."""
        vision, text = outer["vision_config"], outer.get("text_config") or {}
        side = vision.get("image_size", 224) // vision.get("patch_size", 14)  # patches a side
        tokens_side = math.isqrt(outer.get("mm_tokens_per_image", 256))
        if tokens_side**2 != outer.get("mm_tokens_per_image", 256) or side % tokens_side:
            raise ValueError(f"{source}: mm_tokens_per_image: {outer.get('mm_tokens_per_image')} is not a square "
                             f"that divides the {side}x{side} patches")
        activation = _activation(vision.get("hidden_act", "gelu_pytorch_tanh"), "vision_config.hidden_act", source)
        eps = float(vision.get("layer_norm_eps", 1e-6))
        return cls(
            depth=vision["num_hidden_layers"], width=vision["hidden_size"], num_heads=vision["num_attention_heads"],
            intermediate_size=vision["intermediate_size"], output_size=text["hidden_size"], activation=activation,
            gated_mlp=False, rms_norm=False, patch_size=vision.get("patch_size", 14), temporal_patch_size=1,
            merge_size=side // tokens_side, in_channels=vision.get("num_channels", 3), family="siglip",
            norm_eps=eps, projector_norm_eps=eps, position_embeddings=side * side,
            longest_edge=vision.get("image_size", 224), bidirectional=True,
            start_token_id=int(outer.get("boi_token_index", 255999)),
            end_token_id=int(outer.get("eoi_token_index", 256000)))

    @classmethod
    def from_pixtral(cls, outer: dict[str, Any], source: str) -> VisionConfig:
        """Mistral 3's (Mistral3ForConditionalGeneration's) vision_config (Pixtral's) and its projector's settings."""
        vision, text = outer["vision_config"], outer.get("text_config") or {}
        layer = outer.get("vision_feature_layer", -1)
        if layer != -1:
            raise ValueError(f"{source}: vision_feature_layer: {layer!r} is not supported (-1: the last block's "
                             "output)")
        activation = _activation(vision.get("hidden_act", "silu"), "vision_config.hidden_act", source)
        projector = _activation(outer.get("projector_hidden_act", "gelu"), "projector_hidden_act", source)
        rope = vision.get("rope_parameters") or {}
        return cls(
            depth=vision["num_hidden_layers"], width=vision["hidden_size"], num_heads=vision["num_attention_heads"],
            intermediate_size=vision["intermediate_size"], output_size=text["hidden_size"], activation=activation,
            gated_mlp=True, rms_norm=True, patch_size=vision.get("patch_size", 16), temporal_patch_size=1,
            merge_size=outer.get("spatial_merge_size", 2), in_channels=vision.get("num_channels", 3),
            rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))), family="pixtral",
            norm_eps=1e-5, projector_norm_eps=float(text.get("rms_norm_eps", 1e-5)), projector_activation=projector,
            projector_bias=bool(outer.get("multimodal_projector_bias", False)),
            longest_edge=int(vision.get("image_size", 1024)))

    @classmethod
    def from_hf(cls, vision: dict[str, Any], kind: str, source: str) -> VisionConfig:
        """kind: the model's HF model_type (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe)."""
        windowed, qwen3 = kind == "qwen2_5_vl", kind.startswith("qwen3_vl")
        later = windowed or qwen3  # the tower's width as hidden_size, the output's beside it (Qwen2-VL's: embed_dim)
        width = vision.get("embed_dim") if not later else vision["hidden_size"]
        if width is None:
            raise ValueError(f"{source}: vision_config: no embed_dim (a Qwen2-VL vision tower's width)")
        activation = _activation(vision.get("hidden_act", "gelu_pytorch_tanh" if qwen3 else "quick_gelu"),
                                 "vision_config.hidden_act", source)
        rope = vision.get("rope_parameters") or {}
        deepstack = tuple(vision.get("deepstack_visual_indexes") or ()) if qwen3 else ()
        if any(not 0 <= block < vision["depth"] for block in deepstack):
            raise ValueError(f"{source}: vision_config.deepstack_visual_indexes: {list(deepstack)} are not all blocks "
                             f"of a tower of {vision['depth']} (depth)")
        return cls(
            depth=vision["depth"], width=width, num_heads=vision["num_heads"],
            intermediate_size=(vision["intermediate_size"] if later
                               else int(width * vision.get("mlp_ratio", 4))),
            output_size=vision["out_hidden_size"] if later else vision["hidden_size"],
            activation=activation, gated_mlp=windowed, rms_norm=windowed,
            window_size=vision.get("window_size") if windowed else None,
            full_attention_blocks=tuple(vision.get("fullatt_block_indexes") or ()),
            patch_size=vision.get("patch_size", 16 if qwen3 else 14),
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            merge_size=vision.get("spatial_merge_size", 2), in_channels=vision.get("in_channels", 3),
            rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))),
            patch_bias=qwen3, position_embeddings=int(vision.get("num_position_embeddings") or 0) if qwen3 else 0,
            deepstack_blocks=deepstack)

    @property
    def patch_values(self) -> int:
        """The numbers of one flattened patch: channels x frames x pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2
