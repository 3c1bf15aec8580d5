"""Compiles every Triton kernel ridge launches on CUDA for a GPU this machine does not have (Hopper, sm_90), and
reports what each compiled to. Run as a script, in a process without TRITON_INTERPRET (test_triton_compile.py).

The test suite checks the kernels' arithmetic under Triton's interpreter, which never compiles them: a kernel can
pass there and fail to compile on the GPU (the interpreter executes numpy, and takes, e.g., a function returning two
types), or compile to something the GPU refuses (more shared memory than a multiprocessor holds) or runs slowly
(registers spilled to local memory, a new specialization compiled on a step of new shape: a second's stall). Triton's
compiler and ptxas run on the CPU (ptxas ships in Triton's wheel), so this builds each kernel as the GPU would:
the launches are ridge's own (its backends and wrappers, with CPU tensors of realistic shapes), compiled and not
run (JITFunction.run with warmup, under a driver that names the target), their outputs left unwritten.

Prints one JSON object: per case, the kernels it compiled (name, warps, shared memory, registers, local memory),
and per kernel, the specializations a sweep of decode steps compiled.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") != "1", "cross-compiling needs Triton's compiler, not its interpreter"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200: the GPUs lent to this project
SHARED_MEMORY_LIMIT = 232_448  # bytes a block may ask for on sm_90 (227 KiB)
MULTIPROCESSORS = 132  # an H100 SXM's: what the backends would read from torch.cuda


@dataclass
class Compiled:
    kernel: str
    warps: int
    shared: int  # bytes of shared memory the launch asks for
    registers: int  # per thread
    local: int  # bytes of local memory per thread: registers spilled


class _TargetDriver:
    """What JITFunction.run asks of the active driver, for a device that is not here."""

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def _resources(cubin: bytes, name: str) -> tuple[int, int]:
    """(registers, local bytes) of the function `name` in a cubin, as cuobjdump reports them."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                                check=True).stdout
    found = re.search(rf"Function {name}:\s*REG:(\d+) STACK:\d+ SHARED:\d+ LOCAL:(\d+)", report)
    assert found, f"no resource usage for {name} in:\n{report}"
    return int(found.group(1)), int(found.group(2))


@contextmanager
def compiling() -> Iterator[list[tuple[str, object]]]:
    """Within: every Triton launch compiles for TARGET and runs nothing; yields the (kernel name, compiled kernel)
    of each launch, in order (a specialization already compiled appears again, the same object)."""
    launches: list[tuple[str, object]] = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        launches.append((self.fn.__name__, kernel))
        return kernel

    previous = driver._active  # None on a machine without a GPU, whose default driver cannot be made
    driver.set_active(_TargetDriver())
    JITFunction.run = compile_only
    try:
        yield launches
    finally:
        JITFunction.run = run
        driver._active = previous


def _report(launches: list[tuple[str, object]]) -> list[Compiled]:
    seen, out = set(), []
    for name, kernel in launches:
        if id(kernel) in seen:
            continue
        seen.add(id(kernel))
        registers, local = _resources(kernel.asm["cubin"], name)
        out.append(Compiled(name, kernel.metadata.num_warps, kernel.metadata.shared, registers, local))
    return out


# ---- the cases: ridge's launches at the shapes of the models it serves ----

def _attention_step(backend, heads: int, window: int | None) -> None:
    """One step of three decodes (short, mid, long context), a fresh prompt and a chunk that continues a cached
    context of 300 tokens, through a CUDA backend's write and attention, two layers."""
    from ridge.attention.backend import AttentionMetadata, PrefillChunk
    from ridge.kv.layout import Window

    bs, kv_heads, d = backend.block_size, backend.num_kv_heads, backend.head_dim
    tables = torch.arange(4 * 32, dtype=torch.int32).view(4, 32)
    lens = [17, 200, 511]
    chunks = [PrefillChunk(3, 40, 40, tables[3, :3].long()), PrefillChunk(43, 70, 370, tables[2, :24].long())]
    tokens = 3 + 40 + 70
    meta = AttentionMetadata(slot_mapping=torch.arange(tokens), num_decodes=3,
                             decode_block_tables=tables[:3, : -(-max(lens) // bs)],
                             decode_context_lens=torch.tensor(lens, dtype=torch.int32),
                             window=window and Window(window), prefills=chunks)
    backend.prepare(meta)
    dtype = backend.dtype
    q = torch.zeros(tokens, heads, d, dtype=dtype)
    k, v = torch.zeros(tokens, kv_heads, d, dtype=dtype), torch.zeros(tokens, kv_heads, d, dtype=dtype)
    for layer in range(2):
        backend.forward(layer, q, k, v, [meta])


def _cuda_backend(kv_heads: int, head_dim: int, dtype: torch.dtype, cache: str = "auto"):
    from ridge.attention import CudaBackend, CudaQuantizedKVBackend
    from ridge.kv.formats import kv_format

    args = (2, kv_heads, head_dim, 256, 16, dtype, "cpu")
    backend = (CudaBackend(*args) if cache == "auto"
               else CudaQuantizedKVBackend(*args, kv_format=kv_format(cache), num_tail_slots=4))
    backend.__dict__["multiprocessors"] = MULTIPROCESSORS
    return backend


def attention(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, window: int | None = None,
              cache: str = "auto") -> Callable[[], None]:
    return lambda: _attention_step(_cuda_backend(kv_heads, head_dim, dtype, cache), heads, window)


def latent(heads: int, dtype: torch.dtype, window: int | None = None) -> Callable[[], None]:
    """DeepSeek's latent rows (512 latent values and a 64-wide rotary key) written and decoded."""

    def run() -> None:
        from ridge.attention import LatentBackend
        from ridge.attention.backend import AttentionMetadata
        from ridge.kv.layout import Window
        from ridge.triton_kernels import latent_attention

        backend = LatentBackend(1, 1, 576, 256, 16, dtype, "cpu", value_dim=512)
        backend.__dict__.update(triton=latent_attention, multiprocessors=MULTIPROCESSORS)
        rows = torch.zeros(3, 1, 576, dtype=dtype)
        backend.write(0, rows, rows, torch.tensor([5, -1, 700]))
        tables = torch.arange(96, dtype=torch.int32).view(3, 32)
        meta = AttentionMetadata(slot_mapping=torch.arange(3), num_decodes=3, decode_block_tables=tables,
                                 decode_context_lens=torch.tensor([17, 200, 511], dtype=torch.int32),
                                 window=window and Window(window), prefills=[])
        backend.prepare(meta)
        q = torch.zeros(3, heads, 576, dtype=dtype)
        backend.attend(0, q, q, q, meta)

    return run


def experts(hidden: int, width: int, top_k: int, dtype: torch.dtype) -> Callable[[], None]:
    """A mixture's fused experts (8 of them: the kernels' code does not depend on how many) at 1, 37 and 512
    tokens."""

    def run() -> None:
        from ridge.triton_kernels.moe import FusedExperts

        fused = FusedExperts(torch.zeros(8, 2 * width, hidden, dtype=dtype), torch.zeros(8, hidden, width, dtype=dtype),
                             top_k)
        for tokens in (1, 37, 512):
            choices = torch.arange(tokens * top_k).view(tokens, top_k) % 8
            fused(torch.zeros(tokens, hidden, dtype=dtype), choices, torch.full((tokens, top_k), 1 / top_k))

    return run


def quantized_matmuls(fmt: str, dtype: torch.dtype) -> Callable[[], None]:
    """Every tuning candidate of the quantized matmul at the rows it is a candidate for, on a Llama-3-8B row width
    (4096 inputs; 256 output channels: their number is not in the code)."""

    def run() -> None:
        from ridge.triton_kernels import quant_matmul, quant_tuning

        kind, group, codes_dtype, minimums = {
            "int8": (quant_matmul.BYTES, 0, torch.int8, False),
            "fp8": (quant_matmul.FP8, 0, torch.uint8, False),
            "int4-g32": (quant_matmul.NIBBLES, 32, torch.uint8, True),
            "int4-g128": (quant_matmul.NIBBLES, 128, torch.uint8, True),
        }[fmt]
        n, k = 256, 4096
        columns = k // 2 if kind == quant_matmul.NIBBLES else k
        scales = torch.ones(n, k // group, dtype=torch.float16) if group else torch.ones(n, dtype=torch.float32)
        weight = quant_matmul.PackedWeight(torch.zeros(n, columns, dtype=codes_dtype), kind, scales,
                                           scales.clone() if minimums else None, group, n)
        for rows, candidates in ((1, quant_tuning.ONE_ROW), (4, quant_tuning.FEW_ROWS),
                                 (256, quant_tuning.MANY_ROWS)):
            for config in candidates:
                if config.dense or (group and config.tile < group):
                    continue
                for native in ((False, True) if kind == quant_matmul.FP8 else (False,)):
                    config = type(config)(**{**asdict(config), "native_fp8": native})
                    quant_matmul.quant_matmul(torch.zeros(rows, k, dtype=dtype), weight, config, MULTIPROCESSORS)

    return run


def elementwise(dtype: torch.dtype) -> Callable[[], None]:
    """The fused residual-add + RMSNorm, rotary and SiLU * up at Llama-3-8B's widths."""

    def run() -> None:
        from ridge.triton_kernels import fused

        fused.add_rms_norm_(torch.zeros(5, 4096, dtype=dtype), torch.zeros(5, 4096, dtype=dtype),
                            torch.ones(4096, dtype=dtype), 1e-5)
        fused.rotary_(torch.zeros(5, 48, 128, dtype=dtype), torch.arange(5), torch.zeros(64, 64, 2), 40)
        fused.silu_mul(torch.zeros(5, 2 * 14336, dtype=dtype))

    return run


BF16, F32 = torch.bfloat16, torch.float32
CASES: dict[str, Callable[[], None]] = {
    "attention llama-3-8b bf16": attention(32, 8, 128, BF16),
    "attention llama-3-8b float32": attention(32, 8, 128, F32),
    "attention llama-3-8b bf16 window": attention(32, 8, 128, BF16, window=100),
    "attention smollm2 bf16 (group 3, head_dim 64)": attention(9, 3, 64, BF16),
    "attention qwen2.5-0.5b bf16 (group 7)": attention(14, 2, 64, BF16),
    "attention gemma-3 bf16 (head_dim 256)": attention(8, 4, 256, BF16),
    **{f"attention llama-3-8b bf16 {cache} cache": attention(32, 8, 128, BF16, cache=cache)
       for cache in ("fp8", "int8", "int4")},
    "latent deepseek-v3 bf16 (128 heads)": latent(128, BF16),
    "latent deepseek-v2-lite bf16 window": latent(16, BF16, window=100),
    "latent deepseek-v2-lite float32": latent(16, F32),
    "experts qwen3-30b-a3b bf16": experts(2048, 768, 8, BF16),
    "experts deepseek-v3 bf16": experts(7168, 2048, 8, BF16),
    "experts qwen3-30b-a3b float32": experts(2048, 768, 8, F32),
    **{f"quantized matmul {fmt} bf16": quantized_matmuls(fmt, BF16) for fmt in ("int8", "fp8", "int4-g32",
                                                                                "int4-g128")},
    "quantized matmul int8 float32": quantized_matmuls("int8", F32),
    "elementwise bf16": elementwise(BF16),
    "elementwise float32": elementwise(F32),
}


def _sweep_steps() -> None:
    """Steps of every shape serving meets, Llama-3-8B's heads in bf16: eager decode steps of 1 to 64 rows, their
    contexts from 1 to 4,000 tokens and their tables as wide as the widest row's (as the scheduler builds them);
    chunks continuing contexts of as many lengths; DeepSeek's latent decode likewise; an int8 matmul at 1 to 64
    rows, in the configurations the tuner falls back to."""
    from ridge.attention import LatentBackend
    from ridge.attention.backend import AttentionMetadata, PrefillChunk
    from ridge.triton_kernels import latent_attention, quant_matmul

    backend = _cuda_backend(8, 128, BF16)
    latent_backend = LatentBackend(1, 1, 576, 256, 16, BF16, "cpu", value_dim=512)
    latent_backend.__dict__.update(triton=latent_attention, multiprocessors=MULTIPROCESSORS)
    weight = quant_matmul.PackedWeight(torch.zeros(256, 4096, dtype=torch.int8), quant_matmul.BYTES,
                                       torch.ones(256), None, 0, 256)
    for batch in range(1, 65):
        longest = 1 + (batch * 997) % 4000
        lens = torch.linspace(1, longest, batch).round().to(torch.int32)
        tables = torch.zeros(batch, -(-longest // backend.block_size), dtype=torch.int32)
        length = 1 + (batch * 37) % 300
        chunk = PrefillChunk(batch, length, longest + length, torch.zeros(-(-(longest + length) // 16),
                                                                         dtype=torch.long))
        for prefills in ([], [chunk]):
            meta = AttentionMetadata(slot_mapping=torch.arange(batch + length * len(prefills)), num_decodes=batch,
                                     decode_block_tables=tables, decode_context_lens=lens, window=None,
                                     prefills=prefills)
            backend.prepare(meta)
            tokens = meta.slot_mapping.shape[0]
            backend.forward(0, torch.zeros(tokens, 32, 128, dtype=BF16), torch.zeros(tokens, 8, 128, dtype=BF16),
                            torch.zeros(tokens, 8, 128, dtype=BF16), [meta])
        meta = AttentionMetadata(slot_mapping=torch.arange(batch), num_decodes=batch, decode_block_tables=tables,
                                 decode_context_lens=lens, window=None, prefills=[])
        latent_backend.prepare(meta)
        q = torch.zeros(batch, 16, 576, dtype=BF16)
        latent_backend.attend(0, q, q, q, meta)
        config = quant_matmul.DEFAULT if batch <= quant_matmul.GEMV_MAX_ROWS else quant_matmul.LARGE
        quant_matmul.quant_matmul(torch.zeros(batch, 4096, dtype=BF16), weight, config, MULTIPROCESSORS)


def specializations() -> dict[str, int]:
    """How many times each kernel compiled over _sweep_steps: each beyond the ones its constexprs ask for is a
    compile the GPU stalls on in the middle of serving."""
    with compiling() as launches:
        _sweep_steps()
    variants: dict[str, set[int]] = defaultdict(set)
    for name, kernel in launches:
        variants[name].add(id(kernel))
    return {name: len(kernels) for name, kernels in variants.items()}


def main() -> None:
    only = sys.argv[1:]
    cases = {}
    for name, case in CASES.items():
        if only and not any(word in name for word in only):
            continue
        with compiling() as launches:
            try:
                case()
            except Exception as error:  # reported by case, so that one failure does not hide the others
                cases[name] = {"error": f"{type(error).__name__}: {error}"[-4000:]}
                continue
        cases[name] = {"kernels": [asdict(c) for c in _report(launches)]}
    result = {"target": f"sm_{TARGET.arch}", "triton": triton.__version__, "shared_memory_limit": SHARED_MEMORY_LIMIT,
              "cases": cases}
    if not only:
        result["specializations"] = specializations()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
