"""Sliding-window and chunked attention end to end: the KV layout's groups, the manager dropping blocks behind the
window, the kernels reading only the window, and windowed models (Llama 4's chunked) against HF transformers and
under the runtime."""

import pytest
import torch

from conftest import random_prompts
from ridge.attention import AttentionMetadata, PagedBackend
from ridge.attention.backend import PrefillChunk
from ridge.engine.sequence import Sequence
from ridge.kv.layout import Window, kv_layout
from ridge.kv.manager import KVManager
from ridge.sampling_params import SamplingParams

VOCAB = 320
WINDOW = 64


def seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id=i, request_id=str(i), index=0, prompt_len=len(tokens), token_ids=list(tokens),
                    params=SamplingParams())


# ---- layout ----------------------------------------------------------------------------------------------
def test_gemma3_pattern_groups_into_equal_groups_over_shared_slots():
    windows = [None if (i + 1) % 6 == 0 else Window(512) for i in range(18)]
    layout = kv_layout(windows)
    assert layout.num_slots == 3
    assert [g.window for g in layout.groups] == [None] + [Window(512)] * 5
    assert layout.groups[0].layers == (5, 11, 17)
    slots, groups = layout.slot_of_layer(), layout.group_of_layer()
    # no two layers of one group share a slot, and a slot's layers are in different groups
    for slot in range(3):
        owners = [groups[layer] for layer in range(18) if slots[layer] == slot]
        assert len(owners) == len(set(owners)) == 6
    assert kv_layout([None] * 4).groups[0].layers == (0, 1, 2, 3) and kv_layout([None] * 4).num_slots == 4


# ---- the manager -----------------------------------------------------------------------------------------
def windowed_manager(num_blocks: int = 64, prefix: bool = False, chunked: bool = False) -> KVManager:
    # 2 full layers, 2 windowed (window 8 over blocks of 4): one group of each kind
    return KVManager(num_blocks, 4, prefix, kv_layout([None, Window(8, chunked), None, Window(8, chunked)]))


def test_window_group_drops_blocks_behind_the_window():
    kv = windowed_manager()
    free_at_start = kv.num_free
    s = seq(0, list(range(40)))
    assert kv.reserve(s, 40)
    assert kv.num_free == free_at_start - 20  # 10 blocks in each group while the prompt is computed
    kv.commit(s, 40)
    full, window = s.block_tables
    # the next query (position 40) sees keys 33..40: blocks 8 and 9 hold them; 0..7 went back
    assert kv.null_block not in full
    assert window[:8] == [kv.null_block] * 8 and kv.null_block not in window[8:]
    assert kv.num_free == free_at_start - 12
    kv.check_integrity([s])
    s.token_ids.append(40)
    assert kv.reserve(s, 41)
    kv.commit(s, 1)
    kv.check_integrity([s])
    kv.free(s)
    kv.check_idle()


def test_window_first_keys_and_masks_follow_their_definitions():
    """A sliding window of 8 sees a query's last 8 positions; a chunked one of 8 the query's own aligned chunk of 8
    (so the first query of each chunk sees itself alone): first_key on ints and tensors, and window_mask, against
    the definitions written out."""
    from ridge.attention.backend import window_mask

    positions = torch.arange(40)
    for window, first in ((Window(8), lambda p: max(0, p - 7)), (Window(8, chunked=True), lambda p: p - p % 8)):
        assert [window.first_key(p) for p in range(40)] == [first(p) for p in range(40)]
        assert window.first_key(positions).tolist() == [first(p) for p in range(40)]
        expected = torch.tensor([[first(p) <= j <= p for j in range(40)] for p in range(40)])
        assert torch.equal(window_mask(positions, positions, window), expected)
    assert Window(8, chunked=True).first_key(16) == 16 and Window(8).first_key(16) == 9


def test_chunked_window_group_drops_the_blocks_before_the_chunk():
    """A chunked window of 8 over blocks of 4: at 40 computed tokens the next query (40) starts a chunk and sees
    itself alone, so every earlier block goes back; at 45 it sees 40.. (block 10 on), and the 44th's block stays."""
    kv = windowed_manager(chunked=True)
    free_at_start = kv.num_free
    s = seq(0, list(range(40)))
    assert kv.reserve(s, 40)
    kv.commit(s, 40)
    full, chunked = s.block_tables
    assert chunked == [kv.null_block] * 10 and kv.null_block not in full
    assert kv.num_free == free_at_start - 10
    s.token_ids.extend(range(40, 46))
    assert kv.reserve(s, 46)
    kv.commit(s, 6)  # the next query, 46, sees 40..46: blocks 10 and 11
    assert s.block_tables[1][:10] == [kv.null_block] * 10 and kv.null_block not in s.block_tables[1][10:]
    kv.check_integrity([s])
    kv.free(s)
    kv.check_idle()


def test_integrity_check_sees_a_dropped_block_the_window_needs():
    kv = windowed_manager()
    s = seq(0, list(range(40)))
    kv.reserve(s, 40)
    kv.commit(s, 40)
    held = s.block_tables[1][9]
    s.block_tables[1][9] = kv.null_block
    with pytest.raises(AssertionError, match="window needs"):
        kv.check_integrity([s])
    s.block_tables[1][9] = held
    kv.free(s)
    kv.check_idle()


def test_prefix_hit_needs_the_window_blocks_and_skips_the_rest():
    kv = windowed_manager(prefix=True)
    first = seq(0, list(range(41)))
    kv.reserve(first, 41)
    kv.commit(first, 41)  # 10 full blocks registered in both groups; window blocks 0..7 dropped (parked)
    second = seq(1, list(range(41)) + [99])
    assert kv.cached_prefix_len(second) == 40
    kv.take_cached_prefix(second)
    full, window = second.block_tables
    assert full == first.block_tables[0][:10]
    # a query at position 40 sees keys 33..: only blocks 8 and 9 of the window group are taken
    assert window[:8] == [kv.null_block] * 8 and window[8:] == first.block_tables[1][8:10]
    kv.check_integrity([first, second])
    kv.free(second)
    # the window group's block 9 forgotten by the cache (as eviction would): a hit must end before it, at 9
    # blocks, whose window (keys 29..) starts in block 7, dropped by first but still cached (parked)
    forgotten = kv.cache._block_of.pop(kv._group_key(1, first.block_keys[9]))  # noqa: SLF001
    del kv.cache._key_of[forgotten]  # noqa: SLF001
    third = seq(2, list(range(41)))
    assert kv.cached_prefix_len(third) == 36
    kv.take_cached_prefix(third)
    cached = [kv.cache.block_of(kv._group_key(1, first.block_keys[i])) for i in (7, 8)]  # noqa: SLF001
    assert third.block_tables[1] == [kv.null_block] * 7 + cached and cached[1] == first.block_tables[1][8]
    kv.check_integrity([first, third])
    kv.free(first)
    kv.free(third)
    kv.check_idle()


def test_max_sequence_tokens_counts_every_group():
    plain = KVManager(64, 4)
    assert plain.max_sequence_tokens(16) == 256
    kv = windowed_manager(64)
    # 63 usable blocks; the window group holds at most ceil((8 + 16) / 4) + 1 = 7
    assert kv.max_sequence_tokens(16) == (63 - 7) * 4
    # sequences of at most 12 tokens: the window group holds at most ceil(12 / 4) + 1 = 4
    assert kv.max_sequence_tokens(16, max_len=12) == (63 - 4) * 4


# ---- kernels ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunked", [False, True], ids=["sliding", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rows_read_only_the_window(ops, dtype, chunked):
    """Decodes, a short continuation chunk (kernel rows) and long chunks (SDPA, from the cache and fresh), all
    windowed (sliding, or chunked: Llama 4's), against the kernel-free float32 path; blocks before every window
    hold NaN, so a read of one shows."""
    torch.manual_seed(3)
    kv_heads, group, d, blocks, bs, window = 2, 3, 64, 80, 16, 40
    backend = PagedBackend(1, kv_heads, d, blocks, bs, dtype, "cpu")
    backend.ops = ops
    backend.k_cache[0].normal_()
    backend.v_cache[0].normal_()
    exact = PagedBackend(1, kv_heads, d, blocks, bs, torch.float32, "cpu")
    exact.k_cache[0].copy_(backend.k_cache[0])
    exact.v_cache[0].copy_(backend.v_cache[0])
    poisoned = torch.arange(60, 80)  # the blocks tables name before their windows
    backend.k_cache[0][:, poisoned] = float("nan")
    backend.v_cache[0][:, poisoned] = float("nan")
    order = torch.randperm(60)

    def table(tokens: int, first: int) -> torch.Tensor:
        n = (tokens + bs - 1) // bs
        start = max(0, tokens - window - 70) // bs  # blocks well behind the window: poisoned
        return torch.cat([poisoned[:start], order[first:first + n - start]])

    decode_lens = torch.tensor([5, 100, 300])
    width = (300 + bs - 1) // bs
    decode_tables = torch.stack([torch.nn.functional.pad(table(n, 12 * i), (0, width - len(table(n, 12 * i))))
                                 for i, n in enumerate(decode_lens.tolist())])
    chunks = [PrefillChunk(3, 6, 150, table(150, 36)), PrefillChunk(9, 80, 200, table(200, 46)),
              PrefillChunk(89, 70, 70, table(70, 0))]
    tokens = 159
    q = torch.randn(tokens, kv_heads * group, d).to(dtype)
    k, v = torch.randn(tokens, kv_heads, d).to(dtype), torch.randn(tokens, kv_heads, d).to(dtype)
    outs = []
    for b, qq, kk, vv in ((backend, q, k, v), (exact, q.float(), k.float(), v.float())):
        meta = AttentionMetadata(torch.zeros(tokens, dtype=torch.long), 3, decode_tables, decode_lens, chunks,
                                 window=Window(window, chunked))
        b.prepare(meta)
        outs.append(b.attend(0, qq, kk, vv, meta))
    assert not outs[0].isnan().any()  # the exact copy holds numbers there: it checks the math, not the reads
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert (outs[0].float() - outs[1]).abs().max().item() < tol


# ---- windowed models against HF transformers -------------------------------------------------------------------
def hf_config(arch: str):
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1,
                  eos_token_id=2, sliding_window=WINDOW)
    if arch == "mistral":  # every layer windowed
        return MistralConfig(**common, num_hidden_layers=3, tie_word_embeddings=False)
    if arch == "gemma2":  # alternating, soft-capped logits, a query scale other than head_dim
        return Gemma2Config(**common, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24,
                            attn_logit_softcapping=20.0, final_logit_softcapping=10.0)
    if arch == "llama4":  # chunked windows on 3 of 4 layers, the fourth global without rotary (its queries tempered
        # every 32 positions), q / k L2-normed, a mixture on every second layer whose experts read scaled inputs
        from transformers import Llama4TextConfig

        common = {key: value for key, value in common.items() if key not in ("sliding_window", "intermediate_size")}
        return Llama4TextConfig(**common, num_hidden_layers=4, head_dim=16, intermediate_size=32,
                                intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                                interleave_moe_layer_step=2, attention_chunk_size=WINDOW, floor_scale=32,
                                attn_scale=0.5)
    # 5 local : 1 global, two rotary bases, QK norm
    return Gemma3TextConfig(**common, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=24)


@pytest.fixture(scope="module", params=["mistral", "gemma2", "gemma3", "llama4"])
def windowed(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from test_models_random import byte_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(request.param), dtype=torch.float32,
                                             attn_implementation="eager").eval()
    for name, weight in model.named_parameters():
        if name.endswith("norm.weight"):  # Gemma's norms multiply by 1 + w, initialised 0: make w matter
            torch.nn.init.normal_(weight, 1.0 if request.param in ("mistral", "llama4") else 0.0, 0.3)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None  # as ignore_eos: min_new_tokens would forbid EOS instead
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return request.param, path, model


@pytest.mark.parametrize("backend", ["paged", "reference"])
def test_windowed_logits_match_hf(windowed, make_llm_for_test, backend):
    arch, path, hf = windowed
    llm = make_llm_for_test(path, dtype="float32", attention_backend=backend)
    assert Window(WINDOW, chunked=arch == "llama4") in llm.engine.runner.windows
    for ids in random_prompts(3, VOCAB, 3 * WINDOW, 6 * WINDOW, seed=1):  # several windows long
        ours = llm.engine.prompt_logits(ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max().item() < 1e-4 * max(ref.abs().max().item(), 1.0), arch


@pytest.mark.threaded  # the kernels split their work across threads: on every core
def test_the_fused_decode_step_serves_windowed_models_to_the_bit(windowed, make_llm_for_test):
    """Decode steps in one C++ call, each layer over its KV group's window (and Gemma's sandwich norms, GeGLU, local
    rotary base), against every layer in Python (enforce_eager): the same tokens and log-probabilities to the last
    bit, prompts past the window. Gemma 2's soft-capped scores take the reference backend, which the step has no
    kernels for."""
    arch, path, _ = windowed
    stacked = make_llm_for_test(path, dtype="float32")
    eager = make_llm_for_test(path, dtype="float32", enforce_eager=True)
    if arch == "gemma2":
        assert stacked.engine.runner.decode_stack is None
        return
    assert stacked.engine.runner.decode_stack is not None and eager.engine.runner.decode_stack is None
    prompts = random_prompts(5, VOCAB, 2, 3 * WINDOW, seed=3)
    params = SamplingParams(temperature=0, max_tokens=WINDOW + 8, ignore_eos=True, logprobs=2)
    for a, b in zip(stacked.generate(prompts, params), eager.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_windowed_greedy_tokens_match_hf_under_the_runtime(windowed, make_llm_for_test):
    """The same tokens as HF alone, in a batch, chunked across the window edge, under a tiny pool (preempted),
    with prefix caching; blocks behind the window are back in the pool mid-generation."""
    arch, path, hf = windowed
    prompts = random_prompts(4, VOCAB, 2 * WINDOW, 5 * WINDOW, seed=2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = []
    for ids in prompts:
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
        expected.append(ref[0, len(ids):].tolist())
    cfg = make_llm_for_test(path, dtype="float32").engine.loaded.config
    longest = max(len(p) for p in prompts) + 40
    # blocks one sequence holds at most: all of a full group's, a window and a 16-token chunk of a windowed one's
    one = sum(-(-longest // 16) if g.window is None else -(-(g.window.size + 16) // 16) + 1
              for g in cfg.kv_layout().groups)
    engines = {
        "batch": {},
        "chunked": {"max_num_batched_tokens": 7},
        "tiny pool": {"kv_cache_memory": (1 + one * 3 // 2) * cfg.kv_bytes_per_block(torch.float32, 16),
                      "max_num_batched_tokens": 16},
        "prefix cache": {"enable_prefix_caching": True, "max_num_batched_tokens": 16},
    }
    for name, args in engines.items():
        llm = make_llm_for_test(path, dtype="float32", **args)
        batch = prompts + [p[:WINDOW + 3] + [7] * 20 for p in prompts] if name == "prefix cache" else prompts
        outs = llm.generate(batch, params)
        got = [o.outputs[0].token_ids for o in outs[:len(prompts)]]
        assert got == expected, f"{arch}, {name}"
        if name == "tiny pool":
            assert sum(o.metrics["num_preemptions"] for o in outs) > 0, f"{arch}: the pool was not tiny enough"
    llm = make_llm_for_test(path, dtype="float32")
    engine = llm.engine
    engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    for _ in range(30):
        engine.step()
    (running,) = engine.scheduler.running
    windowed_groups = [g for g, w in enumerate(engine.kv.windows) if w is not None]
    held = 0
    for g, table in enumerate(running.block_tables):
        live = engine.kv.first_live_block(g, running.num_computed)
        if g in windowed_groups:
            assert live > 2 and table[:live] == [engine.kv.null_block] * live
        held += len(table) - live
    assert engine.kv.num_free == engine.kv.num_blocks - 1 - held  # behind the windows, the blocks are free
    while engine.has_unfinished:
        engine.step()
