"""Rotary scaling: how a model stretches its rotary embedding past the context it was trained on.

Each kind changes the rotary's inverse frequencies, and YaRN also the rotation's magnitude (its attention
factor, which scales q.k by its square). The kinds HF transformers calls linear (every frequency divided by
the factor), llama3 (Llama 3.1: low frequencies divided, high ones kept, a smooth ramp between) and yarn
(YaRN: the same idea by counted rotations, plus the attention factor) are computed here as HF computes them, and
so is "longrope" (Phi-3 / Phi-4: a divisor per frequency, one set for contexts up to the original and another
beyond it, and an attention factor). HF switches a sequence to the long set once it grows past the original
context, recomputing its cache; ridge, as vLLM and llama.cpp, picks one set for the whole run by the context it
serves (`use_long_factor`: the long set where that passes the original), so a token's rotation never depends on
how long its sequence grows. "dynamic" (NTK scaling that changes with the sequence's length) is refused by name.

GGUF files say the same in `<arch>.rope.scaling.*` keys; for llama3 the converter stores the divisors
themselves, one per frequency, as the `rope_freqs.weight` tensor (kept here as `frequency_divisors`).

Beside the rotary, some models also sharpen attention past the original context: Ministral 3's and Mistral 4's
`llama_4_scaling_beta` (in the same dict) multiplies each query by a factor of its position
(`AttentionTemperature`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

SUPPORTED = ("linear", "llama3", "yarn", "longrope")
# the keys read below, and those HF keeps in the same dict that are read elsewhere (or change nothing here)
_KNOWN_KEYS = {"rope_type", "type", "factor", "original_max_position_embeddings", "low_freq_factor",
               "high_freq_factor", "beta_fast", "beta_slow", "truncate", "attention_factor", "mscale",
               "mscale_all_dim", "frequency_divisors", "rope_theta", "partial_rotary_factor", "short_factor",
               "long_factor", "llama_4_scaling_beta", "temperature_length", "max_position_embeddings"}


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # one of SUPPORTED
    factor: float
    original_max_positions: int = 0  # the pretraining context (llama3, yarn, longrope)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0  # yarn: the correction range, in rotations over the original context
    beta_slow: float = 1.0
    truncate: bool = True
    # yarn, longrope: None derives it from factor (and yarn's mscale / mscale_all_dim)
    attention_factor: float | None = None
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    frequency_divisors: tuple[float, ...] = ()  # GGUF's rope_freqs: the divisors themselves, one per frequency
    short_factor: tuple[float, ...] = ()  # longrope: each frequency's divisor up to the original context
    long_factor: tuple[float, ...] = ()  # and past it
    use_long_factor: bool = False  # longrope: the served context passes the original (set by served_context)

    def __post_init__(self) -> None:
        if self.kind not in SUPPORTED:
            raise ValueError(f"rope_scaling: rope_type {self.kind!r} is not supported ({', '.join(SUPPORTED)}; "
                             "dynamic NTK is not)")
        if not self.factor > 0:
            raise ValueError(f"rope_scaling: factor must be positive, got {self.factor}")
        if self.kind == "llama3" and not self.frequency_divisors and not (
                self.original_max_positions > 0 and self.high_freq_factor > self.low_freq_factor):
            raise ValueError("rope_scaling: llama3 needs original_max_position_embeddings and "
                             "high_freq_factor > low_freq_factor")
        if self.kind in ("yarn", "longrope") and self.original_max_positions <= 0:
            raise ValueError(f"rope_scaling: {self.kind} needs original_max_position_embeddings")
        if self.kind == "longrope" and not (self.short_factor and len(self.short_factor) == len(self.long_factor)):
            raise ValueError(f"rope_scaling: longrope needs short_factor and long_factor of one length (got "
                             f"{len(self.short_factor)} and {len(self.long_factor)})")

    @classmethod
    def from_hf(cls, params: dict, max_positions: int) -> RopeScaling | None:
        """From an HF config's rope_scaling / rope_parameters dict (or models/spec.py's reading of a GGUF
        header, in the same keys), None for plain rotary. HF's defaults: the
        original context is max_position_embeddings where not given; YaRN's factor, where absent, is the ratio
        of the two (DeepSeek-V3's configs)."""
        kind = params.get("rope_type", params.get("type", "default"))
        if kind in ("default", None):
            return None
        if unknown := sorted(set(params) - _KNOWN_KEYS):
            raise ValueError(f"rope_scaling: {', '.join(unknown)} not supported")
        original = int(params.get("original_max_position_embeddings") or max_positions)
        factor = params.get("factor")
        if factor is None and kind in ("yarn", "longrope"):
            factor = max_positions / original
        if factor is None:
            raise ValueError(f"rope_scaling: {kind} needs a factor")
        return cls(kind=str(kind), factor=float(factor), original_max_positions=original,
                   low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                   beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                   truncate=bool(params.get("truncate", True)), attention_factor=params.get("attention_factor"),
                   mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
                   frequency_divisors=tuple(params.get("frequency_divisors") or ()),
                   short_factor=tuple(map(float, params.get("short_factor") or ())),
                   long_factor=tuple(map(float, params.get("long_factor") or ())),
                   use_long_factor=max_positions > original)

    def served_context(self, positions: int) -> RopeScaling:
        """This scaling for a run that serves `positions` positions: longrope's long set where they pass the
        original context (what vLLM picks from its max_model_len), the short set otherwise."""
        if self.kind != "longrope":
            return self
        return dataclasses.replace(self, use_long_factor=positions > self.original_max_positions)

    def inverse_frequencies(self, dim: int, theta: float) -> torch.Tensor:
        """The scaled inverse frequencies of a rotary over `dim` dims (dim / 2 of them), float32."""
        plain = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.frequency_divisors:
            if len(self.frequency_divisors) != dim // 2:
                raise ValueError(f"rope_freqs: {len(self.frequency_divisors)} divisors for a rotary of {dim // 2} "
                                 "frequencies")
            return plain / torch.tensor(self.frequency_divisors, dtype=torch.float32)
        if self.kind == "linear":
            return plain / self.factor
        if self.kind == "llama3":
            return self._llama3(plain)
        if self.kind == "longrope":
            factors = self.long_factor if self.use_long_factor else self.short_factor
            if len(factors) != dim // 2:
                raise ValueError(f"rope_scaling: longrope's {len(factors)} factors for a rotary of {dim // 2} "
                                 "frequencies")
            return plain / torch.tensor(factors, dtype=torch.float32)
        return self._yarn(dim, theta)

    def _llama3(self, plain: torch.Tensor) -> torch.Tensor:
        original = self.original_max_positions
        wavelength = 2 * math.pi / plain
        long_waves = wavelength > original / self.low_freq_factor  # divided by the factor
        short_waves = wavelength < original / self.high_freq_factor  # kept
        smooth = (original / wavelength - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        between = (1 - smooth) * plain / self.factor + smooth * plain
        return torch.where(long_waves, plain / self.factor, torch.where(short_waves, plain, between))

    def _yarn(self, dim: int, theta: float) -> torch.Tensor:
        def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
            return dim * math.log(self.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        powers = theta ** (torch.arange(0, dim, 2).float() / dim)
        kept = 1 - ramp  # the share of each frequency left as trained (extrapolated) rather than divided
        return (1.0 / (self.factor * powers)) * (1 - kept) + (1.0 / powers) * kept

    def rotation_magnitude(self) -> float:
        """What the rotary multiplies q and k's rotated dims by (YaRN's and LongRoPE's attention factor; 1
        otherwise)."""
        if self.kind not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.kind == "longrope":  # the same factor for either set (HF's, vLLM's, llama.cpp's converter's)
            if self.factor <= 1:
                return 1.0
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_positions))
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor)

    def latent_softmax_factor(self) -> float:
        """DeepSeek's attention multiplies its softmax scale by mscale(factor, mscale_all_dim)^2 under a scaled
        rotary (HF's DeepSeek-V2/V3 attention, not a general rule: used for MLA models only)."""
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def context_limit(self, max_positions: int) -> int:
        """The positions a model with this scaling serves: YaRN's stretched original context where a config
        leaves max_position_embeddings at the original (Qwen2.5's advice), else max_position_embeddings."""
        if self.kind == "yarn":
            return max(max_positions, int(self.factor * self.original_max_positions))
        return max_positions


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class AttentionTemperature:
    """Queries at long positions sharpened, so that attention stays as peaked over a context many times the one a
    model was trained on (Llama 4's temperature tuning on its layers without rotary, which Ministral 3 and Mistral 4
    took up for every layer): each query is multiplied by 1 + scale * ln(1 + floor((position + offset) / length)),
    exactly 1 within the first `length` positions (less the offset). llama.cpp's GGUF keys:
    `<arch>.attention.temperature_scale` and `.temperature_length`."""

    scale: float
    length: int
    offset: float = 0.0
    nope_layers_only: bool = False  # Llama 4's: on the layers without rotary alone

    def __post_init__(self) -> None:
        if self.length <= 0:
            raise ValueError(f"llama_4_scaling_beta: the temperature's period (original_max_position_embeddings) must "
                             f"be positive, got {self.length}")

    @classmethod
    def from_hf(cls, params: dict | None) -> AttentionTemperature | None:
        """From an HF config's rope_parameters (Ministral 3's, Mistral 4's): None where it has no
        llama_4_scaling_beta; the period is the original context (or a GGUF header's temperature_length)."""
        if not params or not params.get("llama_4_scaling_beta"):
            return None
        period = params.get("temperature_length") or params.get("original_max_position_embeddings")
        if not period:
            raise ValueError("rope_scaling: llama_4_scaling_beta needs original_max_position_embeddings (the "
                             "temperature's period)")
        return cls(scale=float(params["llama_4_scaling_beta"]), length=int(period))

    def query_scales(self, positions: torch.Tensor) -> torch.Tensor:
        """Each position's query multiplier, float32 (made on the positions' device: no host sync, so a CUDA
        graph captures it)."""
        steps = torch.floor((positions.float() + self.offset) / self.length)
        return 1.0 + self.scale * torch.log1p(steps)
