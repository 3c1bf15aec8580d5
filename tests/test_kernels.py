"""ridge's C++ CPU kernels against the torch ops they replace."""

import pytest
import torch
import torch.nn.functional as F

from ridge.attention import AttentionMetadata, PagedBackend

pytestmark = pytest.mark.threaded  # the kernels split their work across threads: on every core


def test_cache_write_and_gather_round_trip(ops):
    """Tokens written at their slots (by the kernel and by the torch path) come back as plain rows."""
    torch.manual_seed(0)
    kv_heads, d, blocks, bs, tokens = 2, 64, 8, 16, 40
    slots = torch.randperm(blocks * bs)[:tokens]
    k, v = torch.randn(tokens, kv_heads, d), torch.randn(tokens, kv_heads, d)
    for kernel in (ops, None):
        backend = PagedBackend(1, kv_heads, d, blocks, bs, torch.float32, "cpu")
        backend.ops = kernel
        backend.write(0, k, v, slots)
        k_rows, v_rows = backend.gather(0, torch.arange(blocks))  # [H, blocks * bs, d]
        assert torch.equal(k_rows[:, slots].transpose(0, 1), k)
        assert torch.equal(v_rows[:, slots].transpose(0, 1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("kv_heads", "group", "d"), [(2, 3, 64), (2, 7, 64), (1, 6, 128), (4, 1, 64)])
def test_paged_decode_matches_gathered_sdpa(ops, dtype, kv_heads, group, d):
    """Lengths cover partial blocks, exact blocks and several partitions (merged by max): of 256 tokens, and of
    1,024 for the longest row (decode_tasks.h)."""
    torch.manual_seed(0)
    blocks, bs = 300, 16
    backend = PagedBackend(1, kv_heads, d, blocks, bs, dtype, "cpu")
    backend.k_cache[0].normal_()
    backend.v_cache[0].normal_(std=2.0)
    lens = torch.tensor([1, 15, 16, 17, 100, 257, 700, 4500])
    batch = len(lens)
    width = int((lens.max() + bs - 1) // bs)
    tables = torch.stack([torch.randperm(blocks)[:width] for _ in range(batch)])
    q = torch.randn(batch, kv_heads * group, d, dtype=dtype) * 2
    meta = AttentionMetadata(torch.zeros(batch, dtype=torch.long), batch, tables, lens, [])
    exact = PagedBackend(1, kv_heads, d, blocks, bs, torch.float32, "cpu")  # the same values, float32 math
    exact.k_cache[0].copy_(backend.k_cache[0])
    exact.v_cache[0].copy_(backend.v_cache[0])
    exact.prepare(meta)
    expected = exact.attend(0, q.float(), None, None, meta)  # no kernel attached: gathered SDPA
    got, lse = ops.paged_decode(q, backend.k_cache[0], backend.v_cache[0], tables, lens, backend.scale)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got.float() - expected.float()).abs().max().item() < tol
    keys, _ = exact.gather(0, tables)  # [H, B, L, d]
    scores = torch.einsum("bhgd,hbld->bhgl", q.float().view(batch, kv_heads, group, d), keys) * exact.scale
    scores = scores.masked_fill(torch.arange(keys.shape[2]) >= lens[:, None, None, None], float("-inf"))
    expected_lse = torch.logsumexp(scores, dim=-1).reshape(batch, kv_heads * group)
    assert (lse - expected_lse).abs().max().item() < (1e-4 if dtype == torch.float32 else 5e-2)


def test_step_mixing_decodes_and_chunks_matches_gathered_sdpa(ops):
    """One bf16 step with 3 decodes, two short chunks that continue a cached context (a verification's
    drafts, a prefix hit's tail: read in place in the decodes' kernel call), a long continuation chunk
    (masked SDPA) and a fresh prompt (causal SDPA); every row as the kernel-free float32 path computes it."""
    from ridge.attention.backend import PrefillChunk

    torch.manual_seed(1)
    kv_heads, group, d, blocks, bs = 2, 3, 64, 64, 16
    backend = PagedBackend(1, kv_heads, d, blocks, bs, torch.bfloat16, "cpu")
    backend.ops = ops
    backend.k_cache[0].normal_()
    backend.v_cache[0].normal_()
    exact = PagedBackend(1, kv_heads, d, blocks, bs, torch.float32, "cpu")
    exact.k_cache[0].copy_(backend.k_cache[0])
    exact.v_cache[0].copy_(backend.v_cache[0])
    order = torch.randperm(blocks)

    def table(tokens: int, first: int) -> torch.Tensor:
        return order[first:first + (tokens + bs - 1) // bs]

    decode_lens = torch.tensor([5, 40, 33])
    decode_tables = torch.stack([torch.nn.functional.pad(table(n, 3 * i), (0, 3 - len(table(n, 3 * i))))
                                 for i, n in enumerate(decode_lens.tolist())])
    chunks = [PrefillChunk(3, 5, 37, table(37, 10)), PrefillChunk(8, 2, 17, table(17, 14)),
              PrefillChunk(10, 70, 90, table(90, 20)), PrefillChunk(80, 6, 6, table(6, 30))]
    tokens = 86
    q = torch.randn(tokens, kv_heads * group, d).bfloat16()
    k, v = torch.randn(tokens, kv_heads, d).bfloat16(), torch.randn(tokens, kv_heads, d).bfloat16()
    got_meta = AttentionMetadata(torch.zeros(tokens, dtype=torch.long), 3, decode_tables, decode_lens, chunks)
    backend.prepare(got_meta)
    assert got_meta.kernel_rows is not None and len(got_meta.kernel_rows.context_lens) == 3 + 5 + 2
    got = backend.attend(0, q, k, v, got_meta)
    meta = AttentionMetadata(torch.zeros(tokens, dtype=torch.long), 3, decode_tables, decode_lens, chunks)
    exact.prepare(meta)
    expected = exact.attend(0, q.float(), k.float(), v.float(), meta)
    assert (got.float() - expected).abs().max().item() < 3e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_torch(ops, dtype):
    x, residual = torch.randn(5, 576, dtype=dtype), torch.randn(5, 576, dtype=dtype)
    weight = torch.randn(576, dtype=dtype)
    expected_residual = residual + x
    expected = F.rms_norm(expected_residual.float(), (576,), None, 1e-5).to(dtype) * weight
    got = ops.add_rms_norm_(residual, x, weight, 1e-5)
    assert torch.equal(residual, expected_residual)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got.float() - expected.float()).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(ops, dtype):
    """Gates far below zero included, where e^-gate overflows (the kernels build with -ffast-math, which assumes it
    never does: unclamped, such a gate gives NaN in float32)."""
    gate_up = torch.randn(4, 2 * 96, dtype=dtype)
    gate_up[:, :8] = torch.tensor([-200.0, -93.0, -89.0, -88.5, -87.0, 89.0, 200.0, 1e4], dtype=dtype)
    gate, up = gate_up.split(96, dim=-1)
    expected = F.silu(gate) * up
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (ops.silu_mul(gate_up).float() - expected.float()).abs().max().item() < tol


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 32])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (75, 1536), (7, 13), (33, 577)])
def test_dense_linear_matches_float64(ops, rows, n, k):
    """float32 rows through the few-row kernel: odd channel counts and K not a multiple of the vector width."""
    torch.manual_seed(rows)
    x, w, bias = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    expected = x.double() @ w.double().T
    # float32 sums of k products of unit normals: rounding grows with sqrt(k)
    tol = 1e-6 * k
    assert (ops.dense_linear(x, w).double() - expected).abs().max().item() < tol
    assert (ops.dense_linear(x, w, bias).double() - (expected + bias.double())).abs().max().item() < tol


@pytest.mark.parametrize("rows", [1, 3, 5, 32])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (33, 577)])
def test_dense_linear_widens_bf16_as_it_reads(ops, rows, n, k):
    """bf16 rows and weights through the few-row kernel: float32 sums of the widened values, rounded to bf16
    once, so within half a bf16 step of the exact product (plus float32's own rounding)."""
    torch.manual_seed(rows)
    x, w, bias = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    expected = x.double() @ w.double().T + bias.double()
    got = ops.dense_linear(x, w, bias)
    assert got.dtype == torch.bfloat16
    half_step = expected.abs() * 2**-8
    assert ((got.double() - expected).abs() <= half_step + 1e-5 * k).all()


def test_bf16_few_rows_linear_is_its_nn_linear_at_every_row_count(ops):
    """A bf16 FewRowsLinear, as the CPUs oneDNN cannot pack bf16 on use it: few rows on the kernel, a prompt's on
    slices of the weight widened to float32 (more channels than a slice), both bf16 roundings of the float32 sum."""
    from ridge.linear import FewRowsLinear
    from ridge.linear.dense import WIDENED_CHANNELS
    from ridge.linear.rows import FEW_ROWS

    torch.manual_seed(0)
    plain = torch.nn.Linear(96, WIDENED_CHANNELS + 40).bfloat16()
    fast = FewRowsLinear.wrap(plain.weight, plain.bias, ops)
    with torch.inference_mode():
        for shape in [(2, 96), (FEW_ROWS + 1, 96), (2, 50, 96)]:
            x = torch.randn(shape).bfloat16()
            exact = x.double() @ plain.weight.double().T + plain.bias.double()
            got = fast(x)
            assert got.dtype == torch.bfloat16 and got.shape == exact.shape
            assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()


def test_few_rows_linear_is_its_nn_linear(ops):
    from ridge.linear import FewRowsLinear
    from ridge.linear.rows import FEW_ROWS

    torch.manual_seed(0)
    plain = torch.nn.Linear(96, 40)
    fast = FewRowsLinear.wrap(plain.weight, plain.bias, ops)
    assert fast.weight is plain.weight and isinstance(fast, torch.nn.Linear)
    with torch.inference_mode():
        for shape in [(1, 96), (3, 5, 96), (FEW_ROWS + 1, 96)]:  # the last through torch's matmul
            x = torch.randn(shape)
            assert torch.allclose(fast(x), plain(x), atol=1e-5)
