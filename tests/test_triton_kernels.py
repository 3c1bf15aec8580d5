"""The CUDA path's Triton kernels against torch references: paged decode attention, the cache write, the
quantized matmul, and the CUDA backend as a whole against the reference backend.

Without a GPU they run under Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET), which
executes the same kernel code with numpy; on a GPU machine the same tests run the compiled kernels.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is a test dependency: `make test` installs it")

import triton  # noqa: E402  (after the skip: a test dependency)
import triton.language as tl  # noqa: E402

from ridge.attention import CudaBackend, CudaQuantizedKVBackend, QuantizedKVBackend, ReferenceBackend  # noqa: E402
from ridge.attention.backend import AttentionMetadata, PrefillChunk  # noqa: E402
from ridge.kv.formats import kv_format  # noqa: E402
from ridge.kv.layout import Window  # noqa: E402
from ridge.quant.methods import quantize_weight  # noqa: E402
from ridge.quant.rtn import QuantizedWeight, dequantize, quantize_int8  # noqa: E402
from ridge.triton_kernels import paged_attention, quant_matmul, quant_tuning  # noqa: E402
from ridge.triton_kernels.paged_attention import CODES, _codes  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="module")
def _interpreter_scalars():
    """Triton 3.6's interpreter turns a loop bound into an int with int() of a one-element array, which numpy
    2.4 refuses; item() is what it means."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch
    yield
    interpreter._patch_lang_tensor = original


def reference_decode(q, k_cache, v_cache, tables, lens, scale, starts):
    """One query per row over its context, in float32, straight from the formula."""
    _, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(lens[b])
        blocks = tables[b, : -(-n // block_size)]
        k = k_cache[blocks].reshape(-1, kv_heads, d)[:n].float().repeat_interleave(heads // kv_heads, 1)
        v = v_cache[blocks].reshape(-1, kv_heads, d)[:n].float().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale
        if starts is not None:
            scores[:, : int(starts[b])] = float("-inf")
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,window,splits",
    [(8, 2, 64, 16, None, 1), (8, 2, 64, 16, None, 4), (6, 2, 40, 8, None, 3), (4, 4, 32, 16, 20, 2),
     (12, 4, 64, 16, 70, 5), (5, 1, 16, 16, None, 20)],
    ids=["gqa4", "gqa4-split", "odd-dim", "mha-window", "window-split", "mqa-more-splits-than-tiles"],
)  # 20 splits: more than a 200-token row's tiles, and more than the merge reads at once (MERGED_SPLITS)
def test_paged_decode_matches_reference(dtype, heads, kv_heads, head_dim, block_size, window, splits):
    torch.manual_seed(0)
    num_blocks, width = 48, 14
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor([1, 37, 150, 64, 200][: 4 if block_size * width < 200 else 5], device=DEVICE)
    lens = lens.clamp(max=block_size * width)
    tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in lens]).to(DEVICE)
    q = torch.randn(len(lens), heads, head_dim, dtype=dtype, device=DEVICE)
    starts = None if window is None else (lens - window).clamp(min=0)
    scale = head_dim**-0.5
    out = paged_attention.paged_decode(q, k_cache, v_cache, tables, lens, scale, starts, splits)
    ref = reference_decode(q, k_cache, v_cache, tables, lens, scale, starts)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref.float()).abs().max().item() < tol


def test_paged_decode_reads_only_the_window():
    """Keys before a row's window start are never read: NaN there leaves the output finite and unchanged."""
    torch.manual_seed(1)
    k_cache = torch.randn(16, 16, 2, 32, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(16, device=DEVICE).view(2, 8)
    lens, starts = torch.tensor([100, 128], device=DEVICE), torch.tensor([64, 96], device=DEVICE)
    q = torch.randn(2, 4, 32, device=DEVICE)
    clean = paged_attention.paged_decode(q, k_cache, v_cache, tables, lens, 0.2, starts, 3)
    k_cache[0:4], v_cache[0:4] = float("nan"), float("nan")  # row 0's blocks 0-3: keys 0-63
    k_cache[8:14], v_cache[8:14] = float("nan"), float("nan")  # row 1's blocks 0-5: keys 0-95
    poisoned = paged_attention.paged_decode(q, k_cache, v_cache, tables, lens, 0.2, starts, 3)
    assert torch.equal(clean, poisoned)


def reference_latent_decode(q, cache, tables, lens, scale, value_dim, starts):
    """Latent attention's decode from the formula: each row's context rows, scored whole, their latents summed."""
    out = q.new_empty(*q.shape[:2], value_dim)
    for b in range(q.shape[0]):
        n = int(lens[b])
        rows = cache[tables[b, : -(-n // cache.shape[1])]].flatten(0, 1)[:n].float()
        scores = torch.einsum("hd,ld->hl", q[b].float(), rows) * scale
        if starts is not None:
            scores[:, : int(starts[b])] = float("-inf")
        out[b] = (scores.softmax(-1) @ rows[:, :value_dim]).to(q.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,value_dim,rope_dim,block_size,window,splits",
    [(16, 64, 16, 16, None, 1), (20, 40, 8, 8, None, 3), (5, 32, 16, 16, 30, 2), (16, 128, 64, 16, 70, 20)],
    ids=["one-group", "two-groups-odd-dims", "few-heads-window", "deepseek-rope-more-splits-than-tiles"],
)
def test_latent_decode_matches_reference(dtype, heads, value_dim, rope_dim, block_size, window, splits):
    from ridge.triton_kernels import latent_attention

    torch.manual_seed(2)
    num_blocks, width = 40, 14
    cache = torch.randn(num_blocks, block_size, value_dim + rope_dim, dtype=dtype, device=DEVICE)
    lens = torch.tensor([1, 37, 150, 64, 200], device=DEVICE).clamp(max=block_size * width)
    tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in lens]).to(DEVICE)
    q = torch.randn(len(lens), heads, value_dim + rope_dim, dtype=dtype, device=DEVICE)
    starts = None if window is None else (lens - window).clamp(min=0)
    scale = 0.7 * (value_dim + rope_dim) ** -0.5
    out = latent_attention.latent_decode(q, cache, tables, lens, scale, value_dim, starts, splits)
    ref = reference_latent_decode(q, cache, tables, lens, scale, value_dim, starts)
    assert out.shape == ref.shape
    assert _close(out, ref), (out.float() - ref.float()).abs().max().item()


def test_latent_backend_decodes_through_triton_as_through_torch():
    """LatentBackend's decode on CUDA's path (the Triton kernels, forced here on CPU tensors) and on torch's padded
    gather: the same outputs for a step of decodes, with a window; its write skips a negative slot."""
    from ridge.attention import LatentBackend
    from ridge.triton_kernels import latent_attention

    torch.manual_seed(3)
    triton_backend, torch_backend = (LatentBackend(1, 1, 48, 30, 8, torch.float32, DEVICE, value_dim=32)
                                     for _ in range(2))
    triton_backend.__dict__.update(triton=latent_attention, multiprocessors=8)
    torch_backend.__dict__["triton"] = None
    rows, slots = torch.randn(240, 1, 48, device=DEVICE), torch.randperm(240, device=DEVICE)
    for backend in (triton_backend, torch_backend):
        backend.write(0, rows, rows, slots)
    tables = torch.stack([torch.randperm(30)[:12] for _ in range(3)]).to(DEVICE)
    q = torch.randn(3, 6, 48, device=DEVICE)
    padded = torch.cat([slots[:2], torch.tensor([-1], device=DEVICE)])  # a CUDA graph's padding row: no write
    before = triton_backend.k_cache[0].clone()
    triton_backend.write(0, rows[:3] + 1, rows[:3] + 1, padded)
    written = triton_backend.k_cache[0].view(-1, 48)
    assert torch.equal(written[slots[:2]], rows[:2, 0] + 1)
    written[slots[:2]] = before.view(-1, 48)[slots[:2]]
    assert torch.equal(triton_backend.k_cache[0], before)  # nothing else moved
    for window in (None, Window(20), Window(20, chunked=True)):
        outs = []
        for backend in (triton_backend, torch_backend):
            meta = AttentionMetadata(slot_mapping=slots[:3], num_decodes=3, decode_block_tables=tables,
                                     decode_context_lens=torch.tensor([5, 61, 96], device=DEVICE), window=window,
                                     prefills=[])
            backend.prepare(meta)
            outs.append(backend.attend(0, q, q, q, meta))
        assert outs[0].shape == (3, 6, 32)
        assert _close(*outs)


@triton.jit
def _widen_kernel(codes_ptr, out_ptr, ROWS: tl.constexpr, ROW_BYTES: tl.constexpr, VALUES: tl.constexpr,
                  FORMAT: tl.constexpr):
    r = tl.arange(0, ROWS)
    d = tl.arange(0, VALUES)
    x = _codes(codes_ptr, r * ROW_BYTES, d, (r < ROWS)[:, None] & (d < VALUES)[None, :], FORMAT)
    tl.store(out_ptr + r[:, None] * VALUES + d[None, :], x)


@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_the_kernels_widen_every_code_as_the_format_decodes_it(name):
    """All 256 bytes (fp8's two NaNs aside: the write clamps to +-448), fp8's subnormals included, widened in
    registers as kv/formats.py decodes them."""
    fmt = kv_format(name)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if name == "fp8":
        codes[[0x7F, 0xFF]] = 0
    codes = codes.view(16, 16).to(DEVICE)
    values = 16 * 8 // fmt.bits
    out = torch.empty(16, values, dtype=torch.float32, device=DEVICE)
    _widen_kernel[(1,)](codes, out, ROWS=16, ROW_BYTES=16, VALUES=values, FORMAT=CODES[name])
    assert torch.equal(out, fmt.decode(codes))


def test_cache_write_places_rows_and_skips_padding():
    torch.manual_seed(2)
    k_cache = torch.zeros(6, 8, 2, 16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(5, 3 * 2 * 16, device=DEVICE)  # k and v as views into a fused projection's output
    k, v = qkv[:, 32:64].view(5, 2, 16), qkv[:, 64:].view(5, 2, 16)
    slots = torch.tensor([3, 17, -1, 40, 47], device=DEVICE)
    paged_attention.cache_write(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], k[i]) and torch.equal(flat_v[slot], v[i])
    assert int(flat_k.abs().sum(dim=(1, 2)).gt(0).sum()) == 4  # the padding row was written nowhere


def test_cache_write_reaches_a_layer_viewing_part_of_its_slots_rows():
    """A layer whose heads are narrower than its slot's (Gemma 4's: attention/backend.py) caches a view of part of
    the slot's rows, its blocks a row apart: each token lands in its block's part, and the rest of the row stays."""
    torch.manual_seed(3)
    rows = torch.zeros(6, 8 * 4 * 16, device=DEVICE)  # 6 blocks of 8 tokens, slots 4 heads of 16 wide
    k_cache = rows[:, 8 * 32:8 * 64].view(6, 8, 2, 16)  # the layer's: 2 heads, the row's second half
    v_cache = torch.zeros(6, 8 * 4 * 16, device=DEVICE)[:, 8 * 32:8 * 64].view(6, 8, 2, 16)
    k, v = torch.randn(3, 2, 16, device=DEVICE), torch.randn(3, 2, 16, device=DEVICE)
    slots = torch.tensor([3, 17, 46], device=DEVICE)
    paged_attention.cache_write(k, v, k_cache, v_cache, slots)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // 8, slot % 8], k[i]) and torch.equal(v_cache[slot // 8, slot % 8], v[i])
    assert rows[:, :8 * 32].abs().sum() == 0 and int(rows.abs().gt(0).sum()) == 3 * 32


def _packed(qw: QuantizedWeight) -> tuple[torch.Tensor, int]:
    if qw.qweight.dtype == torch.float8_e4m3fn:
        return qw.qweight.view(torch.uint8), quant_matmul.FP8
    if qw.levels is not None:
        return quant_matmul.pack_nibbles(qw.qweight), quant_matmul.E2M1
    if qw.bits == 4:
        return quant_matmul.pack_nibbles(qw.qweight.to(torch.uint8)), quant_matmul.NIBBLES
    return qw.qweight, quant_matmul.BYTES


def _grouped_int8(w: torch.Tensor, group: int, with_minimum: bool) -> QuantizedWeight:
    """GGUF-like codes: a byte per weight, a scale (and minimum) per group of columns."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    if with_minimum:
        lo, hi = g.amin(-1), g.amax(-1)
        scales = (hi - lo).clamp(min=1e-6) / 255
        codes = ((g - lo[..., None]) / scales[..., None]).round().clamp(0, 255).to(torch.uint8)
        return QuantizedWeight(codes.view(n, k), scales, lo, 8, group)
    scales = g.abs().amax(-1) / 127
    codes = (g / scales[..., None]).round().clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(codes.view(n, k), scales, None, 8, group)


def _quantized(fmt: str, n: int, k: int) -> QuantizedWeight:
    w = torch.randn(n, k, device=DEVICE)
    if fmt == "int8":
        qw = quantize_int8(w)
    elif fmt.startswith("int4"):
        qw = quantize_weight(w, "int4", int(fmt.removeprefix("int4-g")), None)
    elif fmt == "fp8":
        qw = quantize_weight(w, "fp8", 32, None)
    elif fmt == "mxfp4":  # gguf's rounding, on the CPU; its scales powers of two, float16 numbers already
        qw = quantize_weight(w.cpu(), "mxfp4", 32, None)
        return dataclasses.replace(qw, qweight=qw.qweight.to(DEVICE), scales=qw.scales.to(DEVICE),
                                   levels=qw.levels.to(DEVICE))
    else:
        qw = _grouped_int8(w, 32, with_minimum=fmt == "u8-groups-minimum")
    if not qw.group_size:  # per channel: the CUDA layer holds float32 scales
        return qw
    # per group: held as the CUDA layer holds them, float16 scales and minimums
    return QuantizedWeight(qw.qweight, qw.scales.half().float(),
                           None if qw.minimums is None else qw.minimums.half().float(), qw.bits, qw.group_size)


def _packed_weight(qw: QuantizedWeight) -> quant_matmul.PackedWeight:
    codes, kind = _packed(qw)
    held = torch.float16 if qw.group_size else torch.float32
    return quant_matmul.PackedWeight(codes.contiguous(), kind, qw.scales.to(held),
                                     None if qw.minimums is None else qw.minimums.to(held), qw.group_size or 0,
                                     qw.shape[0])


FORMATS = ["int8", "int4-g32", "int4-g128", "fp8", "q8-groups", "u8-groups-minimum", "mxfp4"]


def test_e2m1_codes_are_mxfp4_s_levels():
    """The Triton kernels' e2m1 codes, widened by their bits, and their table for torch's path: quant/mxfp4.py's."""
    from ridge.quant import mxfp4

    assert tuple(mxfp4.LEVELS.tolist()) == quant_matmul.E2M1_DOUBLED
    codes = torch.arange(16, dtype=torch.uint8, device=DEVICE).repeat(8, 4)  # [8, 64]: every code in each half
    weight = quant_matmul.PackedWeight(quant_matmul.pack_nibbles(codes), quant_matmul.E2M1,
                                       torch.ones(8, 2, dtype=torch.float16, device=DEVICE), None, 32, 8)
    eye = torch.eye(64, device=DEVICE)
    through_kernel = quant_matmul.quant_matmul(eye, weight, quant_matmul.DEFAULT, multiprocessors=4).T
    assert torch.equal(through_kernel.cpu(), mxfp4.LEVELS[codes.long().cpu()].float())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 40])  # the GEMV (one row, several), the tiled matmul
def test_quant_matmul_matches_dequantized(fmt, rows):
    torch.manual_seed(3)
    qw = _quantized(fmt, 72, 1024)  # n not a multiple of the tile; k long enough to split at few rows
    x = torch.randn(rows, 1024, device=DEVICE)
    weight = _packed_weight(qw)
    config = quant_tuning.TUNER.config(x, weight, multiprocessors=8)
    out = quant_matmul.quant_matmul(x, weight, config, multiprocessors=8)
    ref = x @ dequantize(qw).T
    assert (out - ref).abs().max().item() < 1e-4 * ref.abs().max().item()


@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "fp8", "u8-groups-minimum", "mxfp4"])
def test_every_tuning_candidate_matches_dequantized(fmt):
    """Whichever configuration the GPU's measurement picks computes the same product: each candidate at the rows
    it is a candidate for, on a shape whose K does not fill its last tile (the masked path) and one that does."""
    torch.manual_seed(4)
    for k in (1024 + 256, 2048):
        qw = _quantized(fmt, 40, k)
        weight = _packed_weight(qw)
        for rows, candidates in ((1, quant_tuning.ONE_ROW), (3, quant_tuning.FEW_ROWS), (20, quant_tuning.MANY_ROWS)):
            x = torch.randn(rows, k, device=DEVICE)
            ref = x @ dequantize(qw).T
            for config in candidates:
                if weight.group_size and config.tile < weight.group_size:
                    continue
                out = quant_matmul.quant_matmul(x, weight, config, multiprocessors=4)
                assert (out - ref).abs().max().item() < 1e-4 * ref.abs().max().item(), (config, rows, k)


def _backends(dtype: torch.dtype):
    args = (2, 2, 32, 40, 8, dtype, DEVICE)  # layers, kv heads, head_dim, blocks, block size
    cuda = CudaBackend(*args)
    if DEVICE == "cpu":
        cuda.__dict__["multiprocessors"] = 8  # what torch.cuda would tell on a GPU
    return cuda, ReferenceBackend(*args)


def _quantized_backends(name: str):
    """The CUDA backend over a quantized cache, and the CPU one it keeps its storage from (torch's write and
    dequantize-then-SDPA attention), as _backends' pair."""
    args = (2, 2, 32, 40, 8, torch.float32, DEVICE)
    cuda, ref = (cls(*args, kv_format=kv_format(name)) for cls in (CudaQuantizedKVBackend, QuantizedKVBackend))
    if DEVICE == "cpu":
        cuda.__dict__["multiprocessors"] = 8
    # keys stored less a center (quantized_kv.py): the kernels read them as they are, as attention allows
    centers = {layer: torch.randn(2, 32, generator=torch.Generator().manual_seed(layer)) for layer in range(2)}
    for backend in (cuda, ref):
        backend.set_key_centers(centers)
    return cuda, ref


@pytest.mark.parametrize(("window", "cache", "sinks"), [
    *[(window, cache, False) for window in (None, Window(12)) for cache in ("auto", "fp8", "int8", "int4")],
    (Window(12, chunked=True), "auto", False), (Window(12, chunked=True), "int8", False),
    (None, "auto", True), (Window(12), "auto", True), (Window(12), "int8", True)])
def test_cuda_backend_matches_reference(window, cache, sinks):
    """A step of two decodes and two prefill chunks (a fresh prompt through SDPA, and one continuing a cached
    context through the Triton prefill kernel), through both backends, layer by layer; the caches hold the same
    tokens afterwards. A quantized cache: against the CPU backend over the same format, which attends to what
    the cache holds, dequantized (the Triton kernels widen its codes as they read them). sinks: gpt-oss's logit per
    head in every softmax's denominator (the decode kernel's merge, the prefill kernel's normalisation, the fresh
    prompt's scores made in torch)."""
    torch.manual_seed(4)
    cuda, ref = _backends(torch.float32) if cache == "auto" else _quantized_backends(cache)
    history = {0: 21, 1: 9, 3: 30}  # sequences with cached tokens: seq -> tokens before this step (3: 67 after)
    tables = {s: torch.randperm(40)[i * 10:(i + 1) * 10].to(DEVICE) for i, s in enumerate((0, 1, 2, 3))}
    chunks = {2: 11, 3: 37}  # prefills: seq -> chunk length (seq 3's over two programs of the prefill kernel)
    for backend in (cuda, ref):  # the cached history, written the same way into both
        torch.manual_seed(5)
        for seq, n in history.items():
            slots = tables[seq][torch.arange(n) // 8] * 8 + torch.arange(n).to(DEVICE) % 8
            for layer in range(2):
                backend.write(layer, torch.randn(n, 2, 32, device=DEVICE), torch.randn(n, 2, 32, device=DEVICE),
                              slots)
    decodes = [0, 1]
    positions = [history[0], history[1]] + list(range(chunks[2])) + list(range(history[3], history[3] + chunks[3]))
    owners = decodes + [2] * chunks[2] + [3] * chunks[3]
    slots = torch.stack([tables[s][p // 8] * 8 + p % 8 for s, p in zip(owners, positions, strict=True)])
    width = 10
    meta_args = dict(
        slot_mapping=slots, num_decodes=2,
        decode_block_tables=torch.stack([tables[0], tables[1]])[:, :width],
        decode_context_lens=torch.tensor([history[0] + 1, history[1] + 1], device=DEVICE),
        window=window,
    )
    prefills = [PrefillChunk(2, chunks[2], chunks[2], tables[2][:2]),
                PrefillChunk(2 + chunks[2], chunks[3], history[3] + chunks[3], tables[3][:9])]
    q = torch.randn(len(owners), 4, 32, device=DEVICE)
    k, v = torch.randn(len(owners), 2, 32, device=DEVICE), torch.randn(len(owners), 2, 32, device=DEVICE)
    extra = (torch.randn(4, device=DEVICE) * 2,) if sinks else ()
    outs = []
    for backend in (cuda, ref):
        meta = AttentionMetadata(**meta_args, prefills=prefills)
        backend.prepare(meta)
        outs.append([backend.forward(layer, q, k, v, [meta], *extra) for layer in range(2)])
    for ours, expected in zip(*outs, strict=True):
        assert (ours - expected).abs().max().item() < 1e-5, (ours - expected).abs().max().item()
    for seq in (0, 1, 2, 3):
        for layer in range(2):
            got, want = cuda.gather(layer, tables[seq]), ref.gather(layer, tables[seq])
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """float32: to rounding noise; bfloat16: within two units in the last place of each value (the interpreter
    truncates to bfloat16 where a GPU rounds)."""
    diff = (got.float() - expected.float()).abs()
    if got.dtype == torch.float32:
        return diff.max().item() < 1e-5 * max(1.0, expected.abs().max().item())
    return bool((diff <= 2**-6 * expected.float().abs() + 1e-3).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_elementwise_kernels_match_torch(dtype):
    from ridge.models.layers import RotaryEmbedding, apply_rotary_
    from ridge.triton_kernels import fused

    torch.manual_seed(6)
    residual, x = torch.randn(5, 96, dtype=dtype, device=DEVICE), torch.randn(5, 96, dtype=dtype, device=DEVICE)
    weight = torch.randn(96, device=DEVICE).to(dtype)
    expected_residual = residual + x
    expected = torch.nn.functional.rms_norm(expected_residual, (96,), weight, 1e-6)
    out = fused.add_rms_norm_(residual, x, weight, 1e-6)
    assert _close(residual, expected_residual) and _close(out, expected)

    rotary = RotaryEmbedding(40, 10000.0, 64).to(DEVICE)
    qkv = torch.randn(6, 7, 40, dtype=dtype, device=DEVICE)  # 5 rotated heads of 7
    positions = torch.tensor([0, 3, 17, 63, 5, 9], device=DEVICE)
    expected = qkv.clone()
    apply_rotary_(expected[:, :5], rotary.freqs[positions].unsqueeze(1))
    fused.rotary_(qkv, positions, torch.view_as_real(rotary.freqs), 5)
    assert _close(qkv, expected)

    gate_up = torch.randn(3, 2 * 1100, dtype=dtype, device=DEVICE)  # wider than one program's block
    gate, up = gate_up.split(1100, dim=-1)
    assert _close(fused.silu_mul(gate_up), (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 8, 2), (5, 8, 3), (40, 6, 2)],
                         ids=["decode", "few-tokens", "chunk-past-a-block"])
def test_fused_experts_match_one_matmul_per_expert(dtype, tokens, num_experts, top_k):
    """The Triton grouped matmuls over the device-sorted choices equal each chosen expert run on its tokens and
    weighted, summed per token; the block layout holds every choice once, each block one expert's."""
    from ridge.triton_kernels import moe

    torch.manual_seed(7)
    hidden, width = 72, 40  # neither a multiple of the kernels' tiles
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * width, hidden, device=DEVICE) * hidden**-0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, width, device=DEVICE) * width**-0.5).to(dtype)
    experts = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, top_k, device=DEVICE)
    choices, block_experts = moe.expert_blocks(experts, num_experts)
    placed = choices[choices >= 0]
    assert sorted(placed.tolist()) == list(range(tokens * top_k))
    for block, expert in enumerate(block_experts.tolist()):
        rows = choices[block * moe.BLOCK_M:(block + 1) * moe.BLOCK_M]
        rows = rows[rows >= 0]
        assert (expert < 0) == (len(rows) == 0)
        assert all(int(experts.flatten()[c]) == expert for c in rows)
    out = moe.FusedExperts(gate_up, down, top_k)(x, experts, weights)
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for slot in range(top_k):
            e = int(experts[t, slot])
            gate, up = (gate_up[e].float() @ x[t].float()).split(width)
            expected[t] += weights[t, slot].cpu() * (down[e].float() @ (F.silu(gate) * up)).cpu()
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert (out.float().cpu() - expected).abs().max().item() < tol * max(1.0, expected.abs().max().item())


def test_an_moe_block_through_the_fused_experts_equals_its_own_path():
    """A Qwen3-MoE-shaped block (one with a gated shared expert, gpt-oss's: biases on the experts and the router,
    the clamped SwiGLU at a limit the activations reach, Llama 4's: experts reading their tokens times the
    scores, and GELU-tanh-gated experts, Gemma 4's) forced onto the fused experts, on CPU tensors: the same output
    as its one-matmul-per-expert path; quantized experts are refused with the reason."""
    from ridge.config import ModelConfig
    from ridge.models.moe import MoEBlock
    from ridge.triton_kernels import moe

    torch.manual_seed(8)
    gpt_oss = dict(architecture="gpt_oss", expert_bias=True, router_logit_bias=True, hidden_act="swiglu_oai",
                   swiglu_limit=0.5)
    llama4 = dict(architecture="llama4", router_scoring="sigmoid", router_scales_input=True, norm_topk_prob=False,
                  shared_expert_gate=False)
    for shared, variant in ((0, {}), (48, {}), (0, gpt_oss), (32, llama4), (0, {"hidden_act": "gelu_tanh"})):
        qwen = {"architecture": "qwen3_moe", "norm_topk_prob": True, "shared_expert_gate": bool(shared)}
        cfg = ModelConfig(**{**qwen, **variant}, vocab_size=64, hidden_size=64,
                          intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=shared)
        block = MoEBlock(cfg).to(DEVICE)
        for p in block.parameters():
            torch.nn.init.normal_(p, 0.0, 0.2)
        x = torch.randn(6, 64, device=DEVICE)
        with torch.inference_mode():
            expected = block(x)
            block.fused, why = moe.stack_experts(block.experts, block.top_k, block.scales_input)
            assert why == "" and block.experts[3].gate_up.weight.data_ptr() == block.fused.gate_up[3].data_ptr()
            got = block(x)
        assert (got - expected).abs().max().item() < 1e-4 * max(1.0, expected.abs().max().item())
    block.experts[0].down = torch.nn.Identity()
    assert moe.stack_experts(block.experts, 2) == (None, "experts as Identity layers (quantized)")
