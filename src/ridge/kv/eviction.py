"""KV eviction: which cached tokens a sequence lets go of, so that its cache stops growing with its length.

sink-window (StreamingLLM, Xiao et al., 2023): a sequence keeps its first tokens, the "attention sinks" that
softmax heads lean on whatever the text, and its most recent ones, `budget` tokens in all; the blocks between go
back to the pool as it grows. Eviction is by whole blocks: the sinks are the first ceil(sink_tokens / block_size)
blocks, and the block dropped is always the oldest one after them, so a sequence's cached tokens are positions
[0, sinks) and [sinks + evicted, num_computed): one offset (`num_evicted`) maps a position to its cache index,
and the attention kernels see a plain contiguous sequence, none of them changed (engine/runner.py maps).

Positions: each key keeps the rotary position it was written at and each query uses its true position, so the
distances the model sees are the true ones, as in the rest of the text. The paper re-numbers positions within
the cache instead (keys cached before their rotation), which lets a model run past its trained context; ridge
keeps the model's context limit (max_model_len) as without eviction.

Outputs change by design: an evicting engine answers differently from a plain one once a sequence passes its
budget, and a prompt's KV depends on how it was chunked (a chunk attends to itself whole before eviction).
"""

from __future__ import annotations

from dataclasses import dataclass

EVICTION_POLICIES = ("none", "sink-window")


@dataclass(frozen=True)
class SinkWindow:
    sink_blocks: int
    budget: int  # tokens a sequence keeps cached between steps, the sinks' whole blocks included
    block_size: int

    @classmethod
    def from_config(cls, sink_tokens: int, budget: int, block_size: int) -> SinkWindow:
        """ValueError naming the field unless the budget holds the sinks' blocks and a window of two blocks
        (the partial block being written, and one whole one to drop)."""
        if sink_tokens < 1:
            raise ValueError(f"kv_sink_tokens: must be at least 1, got {sink_tokens}")
        sink_blocks = -(-sink_tokens // block_size)
        least = (sink_blocks + 2) * block_size
        if budget < least:
            raise ValueError(f"kv_budget: must be at least the sinks' {sink_blocks * block_size} tokens (whole blocks "
                             f"of {block_size}) plus a window of two blocks, {least} tokens; got {budget}")
        return cls(sink_blocks, budget, block_size)

    def blocks_to_evict(self, cached_tokens: int) -> int:
        """Blocks after the sinks to drop so that at most `budget` tokens stay cached. Those are whole blocks
        before the one being written: after dropping, more than budget - block_size >= the sinks + one block
        remain."""
        return max(0, -(-(cached_tokens - self.budget) // self.block_size))
