// One extension module for ridge's hand-written CPU kernels (see cpu_ops.py for why each exists).
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale);
torch::Tensor add_rms_norm_(torch::Tensor residual, torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over the paged KV cache");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x in place; return RMSNorm(residual)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a [.., 2F] gate|up tensor");
}
