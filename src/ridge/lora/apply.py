"""The adapters an engine serves, and their products added to a step's projections.

Each adapted projection gets a forward hook: its base output (whatever kernel and weight format made it) plus, for
each adapter in the step, that adapter's rows' x @ A.T @ B.T. The rows are grouped by adapter once a step
(AdapterStep), so a projection costs its base matmul and two thin matmuls per adapter in the step, whatever the
mix (punica's grouped form, on the CPU's matmuls). Hooks, not wrapper modules: the projections keep their types,
so the fused decode stack, which has no adapter path, still runs every step without one (the runner sends steps
with adapters down the layer-by-layer path).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from ridge.config import ModelConfig
from ridge.lora.adapter import Adapter, LoRAWeights, read_adapter
from ridge.lora.request import LoRARequest

log = logging.getLogger("ridge")

NO_ADAPTER = -1  # a row of the base model


@dataclass(frozen=True)
class AdapterStep:
    """Which adapter each row of a step runs with (NO_ADAPTER: none), grouped: (adapter, its rows, or None where
    they are all the step's rows)."""

    row_adapters: torch.Tensor  # [T] long
    groups: list[tuple[int, torch.Tensor | None]]
    # the rows whose logits are read, where the model goes on with those alone (Gemma 4's KV-shared layers)
    kept: AdapterStep | None = None

    @classmethod
    def of(cls, row_adapters: torch.Tensor, kept_rows: torch.Tensor | None = None) -> AdapterStep:
        kept = None if kept_rows is None else cls.of(row_adapters[kept_rows])
        groups: list[tuple[int, torch.Tensor | None]] = []
        for adapter in row_adapters.unique().tolist():
            if adapter == NO_ADAPTER:
                continue
            rows = (row_adapters == adapter).nonzero().squeeze(1)
            groups.append((adapter, None if len(rows) == len(row_adapters) else rows))
        return cls(row_adapters, groups, kept)

    def serving(self, rows: int) -> AdapterStep:
        """The step of a projection's `rows` input rows: all the step's, or the kept ones."""
        if rows == len(self.row_adapters) or self.kept is None:
            return self
        assert rows == len(self.kept.row_adapters), f"{rows} rows in a step of {len(self.row_adapters)}"
        return self.kept


class _Product:
    """One projection's hook: the adapters' products added to its output in the step that runs."""

    def __init__(self, owner: AdapterSet) -> None:
        self.owner = owner
        self.weights: dict[int, LoRAWeights] = {}  # by adapter index

    def __call__(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        step = self.owner.step
        if step is None:
            return
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        out = output.view(-1, output.shape[-1])  # the projection's fresh output, added to in place
        for adapter, rows in step.serving(len(x)).groups:
            pair = self.weights.get(adapter)
            if pair is None:  # this adapter leaves this projection alone
                continue
            rows_x = (x if rows is None else x[rows]).to(pair.a.dtype)
            delta = ((rows_x @ pair.a.T) @ pair.b.T).to(out.dtype)
            if rows is None:
                out += delta
            else:
                out.index_add_(0, rows, delta)


class AdapterSet:
    """The adapters loaded over one model, by index (a sequence's `adapter`); loaded once, kept while the engine
    runs (an adapter is a few MB: rank x (in + out) per projection)."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, dtype: torch.dtype, max_rank: int) -> None:
        self.model, self.cfg, self.dtype, self.max_rank = model, cfg, dtype, max_rank
        self.adapters: list[Adapter] = []
        self._by_name: dict[str, int] = {}
        self._products: dict[str, _Product] = {}  # by module path
        self.step: AdapterStep | None = None  # set for the forward pass of a step with adapters (run())

    def index(self, request: LoRARequest) -> int:
        """The adapter's index, loading it on first use; ValueError naming what does not fit (nothing is kept)."""
        known = self._by_name.get(request.lora_name)
        if known is not None:
            loaded = self.adapters[known].request
            if (loaded.lora_path, loaded.lora_int_id) != (request.lora_path, request.lora_int_id):
                raise ValueError(f"lora_name: {request.lora_name!r} already names the adapter at {loaded.lora_path} "
                                 f"(id {loaded.lora_int_id}); give this one another name")
            return known
        adapter = read_adapter(request, self.model, self.cfg, self.dtype, self.max_rank)
        index = len(self.adapters)
        for path, pair in adapter.modules.items():
            product = self._products.get(path)
            if product is None:
                product = self._products[path] = _Product(self)
                self.model.get_submodule(path).register_forward_hook(product)
            product.weights[index] = pair
        self.adapters.append(adapter)
        self._by_name[request.lora_name] = index
        log.info("ridge: LoRA adapter %r loaded from %s: rank %d over %d projections (%.1f MiB)", request.lora_name,
                 request.lora_path, adapter.rank, len(adapter.modules), adapter.nbytes / 2**20)
        return index

    def run_with(self, step: AdapterStep | None) -> None:
        """Set (or, with None, clear) the step the hooks add products for."""
        self.step = step
