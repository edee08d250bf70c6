// rows_linear: y[M, N] = x[M, K] @ W[N, K]^T for the few rows of a decode step, float32 x and
// output, W a bfloat16 checkpoint's exact values in blocks of 16 outputs ([ceil(N/16), K, 16]).
//
// Each weight vector is loaded and widened once and multiplied into up to 8 rows, so a 4-row
// verification reads its weights once, as a 1-row step does. Every output sums over k in order,
// whatever the row count: a row's result does not depend on the rows beside it.
//
// Built at run time by rows_gemm.py (AVX-512F); compiled steps call it through the C shim below,
// a direct call from AOTInductor's generated code (config aot_inductor.custom_ops_to_c_shims).
#include <immintrin.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

namespace {

constexpr int BLOCK = 16;     // outputs per weight block: one zmm of float32
constexpr int MAX_ROWS = 8;   // rows sharing one pass over the weights
constexpr int64_t GRAIN = 32; // weight blocks per thread chunk (an lm_head has hundreds)

inline __m512 widen(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// M rows x CB weight blocks: M * CB accumulators, one weight load per block and k.
template <int M, int CB>
void tile(const float* x, int64_t k_dim, const uint16_t* w, float* y, int64_t n, int64_t col0) {
  __m512 acc[M][CB];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < CB; ++c) acc[m][c] = _mm512_setzero_ps();
  const int64_t block_stride = k_dim * BLOCK;
  for (int64_t k = 0; k < k_dim; ++k) {
    __m512 wv[CB];
    for (int c = 0; c < CB; ++c) wv[c] = widen(w + c * block_stride + k * BLOCK);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * k_dim + k]);
      for (int c = 0; c < CB; ++c) acc[m][c] = _mm512_fmadd_ps(xv, wv[c], acc[m][c]);
    }
  }
  for (int c = 0; c < CB; ++c) {
    const int64_t col = col0 + c * BLOCK, left = n - col;
    const __mmask16 mask = left >= BLOCK ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * n + col, mask, acc[m][c]);
  }
}

// Blocks [b0, b1) for M rows. Fewer rows take more blocks at once, so that enough independent
// accumulators hide the FMA latency.
template <int M>
void blocks(const float* x, int64_t k_dim, const uint16_t* w, float* y, int64_t n, int64_t b0, int64_t b1) {
  constexpr int CB = M == 1 ? 8 : (M <= 3 ? 4 : 2);
  int64_t b = b0;
  for (; b + CB <= b1; b += CB) tile<M, CB>(x, k_dim, w + b * k_dim * BLOCK, y, n, b * BLOCK);
  for (; b < b1; ++b) tile<M, 1>(x, k_dim, w + b * k_dim * BLOCK, y, n, b * BLOCK);
}

using BlocksFn = void (*)(const float*, int64_t, const uint16_t*, float*, int64_t, int64_t, int64_t);
constexpr BlocksFn BLOCKS[MAX_ROWS] = {blocks<1>, blocks<2>, blocks<3>, blocks<4>,
                                       blocks<5>, blocks<6>, blocks<7>, blocks<8>};

}  // namespace

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& blocked, int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && blocked.scalar_type() == at::kBFloat16,
              "rows_linear: float32 x and bfloat16 blocked weight, got ", x.scalar_type(), " and ",
              blocked.scalar_type());
  const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
  const at::Tensor w = blocked.contiguous();
  const int64_t rows = x2.size(0), k_dim = x2.size(1), nblocks = w.size(0);
  TORCH_CHECK(w.dim() == 3 && w.size(1) == k_dim && w.size(2) == BLOCK && nblocks == (n + BLOCK - 1) / BLOCK,
              "rows_linear: blocked weight ", w.sizes(), " does not hold ", n, " outputs of ", k_dim, " inputs");
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options());
  const float* xp = x2.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, nblocks, GRAIN, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < rows; m0 += MAX_ROWS) {
      const int64_t m = std::min<int64_t>(MAX_ROWS, rows - m0);
      BLOCKS[m - 1](xp + m0 * k_dim, k_dim, wp, yp + m0 * n, n, b0, b1);
    }
  });
  return y;
}

TORCH_LIBRARY(mindspec, m) { m.def("rows_linear(Tensor x, Tensor blocked, int n) -> Tensor"); }

TORCH_LIBRARY_IMPL(mindspec, CPU, m) { m.impl("rows_linear", rows_linear); }

extern "C" AOTITorchError aoti_torch_cpu_rows_linear(AtenTensorHandle x, AtenTensorHandle blocked, int64_t n,
                                                     AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor y = rows_linear(*torch::aot_inductor::tensor_handle_to_tensor_pointer(x),
                               *torch::aot_inductor::tensor_handle_to_tensor_pointer(blocked), n);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(y));
  });
}
