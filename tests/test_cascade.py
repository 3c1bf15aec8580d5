"""Cascade attention: a prefix shared by many rows, attended once and merged, equals attending it per row."""

import pytest
import torch

from ridge.attention import AttentionMetadata, PagedBackend
from ridge.attention.backend import PrefillChunk
from ridge.attention.cascade import shared_prefix_attention, split_shared_prefixes
from ridge.kernels import cpu_ops

pytestmark = pytest.mark.threaded  # the kernels split their work across threads: on every core


def unfold(out: torch.Tensor, lse: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The folded results of shared_prefix_attention as [R, heads, d] and [R, heads]."""
    kv_heads, folded, d = out.shape
    group = heads // kv_heads
    rows = folded // group
    return (out.view(kv_heads, rows, group, d).transpose(0, 1).reshape(rows, heads, d),
            lse.view(kv_heads, rows, group).transpose(0, 1).reshape(rows, heads))


def test_split_groups_rows_by_their_common_leading_blocks():
    bs = 16
    shared = torch.arange(100, 120)  # 20 blocks
    rows = [torch.cat([shared, torch.tensor([200 + i, 300 + i])]) for i in range(8)]
    rows[3] = torch.cat([shared[:18], torch.tensor([400, 401, 402, 403])])  # diverges after 18 blocks
    rows.append(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]))
    tables = torch.stack(rows)
    lens = torch.full((9,), 21 * bs + 5)
    prefixes, suffix_tables, suffix_lens = split_shared_prefixes(tables, lens, bs, min_rows=8, min_tokens=256)
    assert len(prefixes) == 1
    assert prefixes[0].rows.tolist() == list(range(8))
    assert torch.equal(prefixes[0].block_ids, shared[:18])  # the group's common part only
    assert suffix_lens[:8].tolist() == [3 * bs + 5] * 8 and suffix_lens[8] == lens[8]
    assert torch.equal(suffix_tables[0, :4], torch.tensor([118, 119, 200, 300]))
    assert torch.equal(suffix_tables[8], tables[8])  # the lone row keeps its table
    assert torch.equal(tables[0, :2], shared[:2])  # the input is left as it was


def test_split_never_puts_a_rows_last_token_in_the_prefix():
    bs = 16
    tables = torch.arange(40).repeat(8, 1)  # eight rows, one table: the tokens of one chunk
    lens = torch.arange(32 * bs - 7, 32 * bs + 1)  # the last row ends exactly on block 32's end
    prefixes, _, suffix_lens = split_shared_prefixes(tables, lens, bs, min_rows=8, min_tokens=256)
    assert len(prefixes[0].block_ids) == (int(lens.min()) - 1) // bs == 31
    assert int(suffix_lens.min()) >= 1


def test_split_skips_small_groups_and_short_prefixes():
    bs = 16
    tables = torch.arange(30).repeat(8, 1)
    lens = torch.full((8,), 30 * bs)
    assert split_shared_prefixes(tables, lens, bs, min_rows=9, min_tokens=256)[0] == []
    assert split_shared_prefixes(tables, lens, bs, min_rows=8, min_tokens=30 * bs)[0] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parts_merged_by_lse_equal_attention_over_all_keys(dtype):
    """Attention over keys A (rows' own, as the kernel's out and lse) merged in place with attention over keys
    B (a shared part, folded) equals attention over A and B at once; the merged lse is the joint one."""
    ops = cpu_ops.load()
    assert ops is not None, "the C++ kernels failed to build"
    torch.manual_seed(0)
    rows, kv_heads, group, d = 5, 2, 3, 64
    heads = kv_heads * group
    q = torch.randn(rows, heads, d, dtype=dtype)
    k, v = torch.randn(kv_heads, 70, d, dtype=dtype), torch.randn(kv_heads, 70, d, dtype=dtype)
    own_out, own_lse = unfold(*shared_prefix_attention(q, k[:, :40], v[:, :40], 0.125), heads)
    out = torch.zeros(rows + 2, heads, d, dtype=dtype)  # two rows the part is not for
    lse = torch.zeros(rows + 2, heads)
    targets = torch.tensor([6, 0, 2, 3, 5])
    out[targets], lse[targets] = own_out, own_lse
    ops.merge_attention_(out, lse, targets, *shared_prefix_attention(q, k[:, 40:], v[:, 40:], 0.125))
    expected, expected_lse = unfold(*shared_prefix_attention(q.float(), k.float(), v.float(), 0.125), heads)
    scores = torch.einsum("rhgd,hld->rhgl", q.float().view(rows, kv_heads, group, d), k.float()) * 0.125
    torch.testing.assert_close(expected_lse, torch.logsumexp(scores, -1).reshape(rows, -1), rtol=0, atol=1e-4)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (out[targets].float() - expected).abs().max().item() < tol
    assert (lse[targets] - expected_lse).abs().max().item() < (1e-4 if dtype == torch.float32 else 5e-2)
    assert not out[[1, 4]].any() and not lse[[1, 4]].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_with_shared_prefix_matches_attention_per_row(dtype):
    """Ten decodes share a 21-block prefix, each with a suffix of its own; two decodes share nothing; a
    short chunk continues the shared prefix (in bf16 its rows read in place and join the group). With the
    cascade on, every row equals the same step with it off."""
    ops = cpu_ops.load()
    assert ops is not None, "the C++ kernels failed to build"
    torch.manual_seed(2)
    kv_heads, group, d, blocks, bs = 2, 3, 64, 128, 16
    backends = []
    for cascade_on in (True, False):
        backend = PagedBackend(1, kv_heads, d, blocks, bs, dtype, "cpu")
        backend.ops, backend.cascade = ops, cascade_on
        backends.append(backend)
    backends[1].k_cache[0].copy_(backends[0].k_cache[0].normal_())
    backends[1].v_cache[0].copy_(backends[0].v_cache[0].normal_())
    shared = torch.arange(21)
    decode_tables, decode_lens = [], []
    for i in range(10):
        decode_tables.append(torch.cat([shared, torch.tensor([30 + 2 * i, 31 + 2 * i])]))
        decode_lens.append(21 * bs + 3 + 3 * i)  # up to 2 blocks of their own
    for i in range(2):
        decode_tables.append(torch.arange(60 + 23 * i, 83 + 23 * i))
        decode_lens.append(22 * bs + 1)
    chunk = PrefillChunk(12, 6, 21 * bs + 6, torch.cat([shared, torch.tensor([110])]))
    tokens = 18
    q = torch.randn(tokens, kv_heads * group, d, dtype=dtype)
    k, v = torch.randn(tokens, kv_heads, d, dtype=dtype), torch.randn(tokens, kv_heads, d, dtype=dtype)
    outs = []
    for backend in backends:
        meta = AttentionMetadata(torch.zeros(tokens, dtype=torch.long), 12, torch.stack(decode_tables),
                                 torch.tensor(decode_lens), [chunk])
        backend.prepare(meta)
        outs.append(backend.attend(0, q, k, v, meta))
        if backend.cascade:
            chunk_rows = list(range(12, 18)) if dtype == torch.bfloat16 else []
            assert [p.rows.tolist() for p in meta.kernel_rows.shared_prefixes] == [list(range(10)) + chunk_rows]
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (outs[0].float() - outs[1].float()).abs().max().item() < tol
