"""The CUDA path's Triton kernels: paged decode attention, the weight-only quantized matmul, and fused
element-wise ops. A leaf package (torch and triton only), imported lazily by the layers that use them, so that
ridge imports where Triton is absent; the test suite runs them under Triton's interpreter on the CPU."""
