"""Every row count at which a linear layer changes kernel, in one table.

A layer's kernel may depend on how many rows (tokens) a call multiplies: decode steps bring a few,
prompts hundreds. Each threshold is a measured crossover (docs/notes/kernel-choices.md has the figures);
the decode stack (kernels/decode_stack.py) serves only row counts below every change that would make the
Python path call another kernel than it does.
"""

# float32 dense layers on ridge's few-row kernel up to this many rows; torch's sgemm past it
FEW_ROWS = 32
# float32 int8 / int4 layers on torch's kernels (ridge's not built): past this many rows, the dequantized weight
FLOAT32_KERNEL_MAX_ROWS = 16
# bfloat16 int8 / int4 layers: ridge's tiled kernels from this many rows (torch's kernels below)
TILED_MIN_ROWS = 16
# int8 activations on the AVX2 integer kernel up to this many rows; past it the exact grouped kernel, as llama.cpp
# hands large batches to float BLAS
INT8_ACTIVATIONS_MAX_ROWS = 32
# bf16-dot layers: prompts of this many rows go through tiles of the weight dequantized to bf16 (oneDNN's matmul);
# decode batches (max_num_seqs 128) stay below it, on the exact kernel
BF16_DOT_TILED_MIN_ROWS = 512
