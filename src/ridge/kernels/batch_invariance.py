"""Batch invariance (--batch-invariant): each row of a step computed exactly as it would be alone.

Greedy decoding is deterministic only as far as the numbers are. A matmul's result for one row can change
with the rows beside it: BLAS picks another kernel (or blocking, or reduction order) for another row count.
A token computed in a batch of 40 then differs in its last bits from the same token alone, and once an argmax
flips the texts part. ridge's attention paths differ too: a whole prompt goes through SDPA, a continued
chunk through the decode kernel or a masked SDPA, a shared prefix once for many rows (cascade).

Batch invariant, ridge computes every row by one path whose reduction order is fixed per row:
- attention: every query row through the paged decode kernel, reading its own context in place; its
  partitions, sized by its own length (kernels/decode_tasks.h), start at position 0 whatever the batch
  (attention/paged.py);
- float32 linears: ridge's dense kernel (linear/dense.py) for every call, 32 rows at a time, where
  otherwise MKL's sgemm takes prompts and gives a row another result at every row count past one;
- bfloat16 linears on oneDNN, padded to two rows when called with one: oneDNN multiplies a single row on
  another path, and every count from two up agrees (linear/dense.py);
- the rest as it is. A probe at load (verify) checks all of these on this CPU, each distinct linear kernel, the
  norms and the output projection, and refuses by name what still differs (quantized layers, which change
  kernel with the row count) rather than serve outputs that are not invariant.

What it costs is measured by `ridge bench invariance` (docs/notes/bench-runtime.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from ridge.models.transformer import DecoderModel

# Row counts to compare with rows computed one at a time: each side of the kernels' thresholds (32 rows
# for the dense and integer kernels, 16 and 64 for the tiled ones) and an odd count past them.
PROBE_ROWS = (2, 3, 8, 16, 17, 31, 32, 33, 64, 65, 97)


def first_variant_batch(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> int | None:
    """The first row count in PROBE_ROWS at which fn's rows differ from those rows computed alone, or None.

    fn maps [rows, features] -> [rows, ...] row by row; x has at least max(PROBE_ROWS) rows."""
    alone = torch.cat([fn(x[i:i + 1]) for i in range(max(PROBE_ROWS))])
    for rows in PROBE_ROWS:
        if not torch.equal(fn(x[:rows]), alone[:rows]):
            return rows
    return None


def verify(model: DecoderModel, dtype: torch.dtype) -> None:
    """Raise ValueError naming the first part of `model` whose result for a row depends on the batch."""
    generator = torch.Generator().manual_seed(0)
    for name, fn, features in _row_functions(model):
        x = (torch.randn(max(PROBE_ROWS), features, generator=generator) * 0.5).to(dtype)
        rows = first_variant_batch(fn, x)
        if rows is not None:
            raise ValueError(
                f"batch_invariant: {name} gives a row another result in a batch of {rows} rows than alone on this "
                f"CPU ({dtype}), so outputs would not be batch invariant (quantized layers change kernel with the "
                "row count; float32 dense weights run on ridge's own kernel); or leave batch_invariant off")


def _row_functions(model: DecoderModel) -> Iterator[tuple[str, Callable[[torch.Tensor], torch.Tensor], int]]:
    """(name, row-wise function, input features) for each distinct linear kernel of the model, its norms and
    its output projection."""
    seen: set[tuple] = set()
    for i, layer in enumerate(model.layers):
        for part in ("attn.qkv", "attn.o_proj", "mlp.gate_up", "mlp.down"):
            module = layer.get_submodule(part)
            key = _kernel_key(module)
            if key not in seen:
                seen.add(key)
                yield f"layers.{i}.{part} ({type(module).__name__})", module, module.in_features
    norm = model.norm  # the layers' norms run the same kernels (OLMo-2's layers have no input norms)
    yield "the fused residual add and RMSNorm", lambda x: norm(x, torch.ones_like(x))[0], model.cfg.hidden_size
    yield "RMSNorm", norm, model.cfg.hidden_size
    yield "the output projection", model.compute_logits, model.cfg.hidden_size


def _kernel_key(module: nn.Module) -> tuple:
    """What decides a linear's kernel path: its type, kernel, shape and grouping (not its weights)."""
    return (type(module).__name__, getattr(module, "kernel", None), module.in_features, module.out_features,
            getattr(module, "group_size", None), getattr(module, "int8_activations", None))
