"""ridge's Triton kernels compiled for a Hopper GPU (sm_90) on this machine, which has none: every launch the CUDA
path makes, at the shapes of the models it serves, must compile, fit the multiprocessor's shared memory, spill no
registers, and compile once per configuration rather than once per step shape (tests/triton_cross_compile.py does
the compiling, in a process of its own: the rest of the suite runs Triton's interpreter, which compiles nothing).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is a test dependency: `make test` installs it")

HARNESS = Path(__file__).with_name("triton_cross_compile.py")

# compiles per kernel over the harness's sweep of step shapes that the kernels' constexprs ask for, and no more
EXPECTED_SPECIALIZATIONS = {
    "_decode_split_kernel": 1,
    "_latent_split_kernel": 1,
    "_prefill_kernel": 1,
    "_cache_write_kernel": 1,
    "_merge_splits_kernel": 2,  # one per head dim (128, 512)
    "_gemv_kernel": 4,  # ROWS, the rows' power of two (1 .. 8)
    "_matmul_kernel": 3,  # BLOCK_M (16, 32, 64)
}


@pytest.fixture(scope="module")
def compiled() -> dict:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"ptxas in Triton's wheel runs on x86-64 hosts, not {platform.machine()}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(HARNESS)], capture_output=True, text=True, env=env, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_every_kernel_compiles_for_hopper(compiled):
    failed = {name: case["error"] for name, case in compiled["cases"].items() if "error" in case}
    assert not failed, "\n\n".join(f"{name}: {error}" for name, error in failed.items())
    names = {k["kernel"] for case in compiled["cases"].values() for k in case["kernels"]}
    assert names >= set(EXPECTED_SPECIALIZATIONS) | {"_gate_up_kernel", "_down_kernel", "_write_rows_kernel",
                                                     "_add_rms_norm_kernel", "_rotary_kernel", "_silu_mul_kernel"}


def test_compiled_kernels_fit_the_multiprocessor(compiled):
    """Shared memory within what a block may have on sm_90; no register spilled to local memory (each such kernel
    would read its spills from memory in its inner loop)."""
    for name, case in compiled["cases"].items():
        for kernel in case["kernels"]:
            assert kernel["shared"] <= compiled["shared_memory_limit"], (name, kernel)
            assert kernel["local"] == 0, (name, kernel)
            assert kernel["registers"] <= 255, (name, kernel)


def test_a_new_step_shape_compiles_nothing_new(compiled):
    """Over decode steps of 1 to 64 rows and contexts up to 4,000 tokens, chunks continuing as many contexts and
    matmuls of 1 to 64 rows, each kernel compiles only the variants its constexprs name."""
    got = compiled["specializations"]
    assert set(got) == set(EXPECTED_SPECIALIZATIONS), got
    for kernel, most in EXPECTED_SPECIALIZATIONS.items():
        assert 1 <= got[kernel] <= most, (kernel, got[kernel], most)
