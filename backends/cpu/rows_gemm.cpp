// rows_linear: y[M, N] = x[M, K] @ W[N, K]^T for the few rows of a decode step, float32 x and
// output, W a bfloat16 checkpoint's exact values in blocks of 32 outputs ([ceil(N/32), K, 32]):
// for each k, 16 dwords whose low halves are outputs 0..15 and high halves outputs 16..31, so a
// shift and a mask widen them to float32 (no shuffles).
//
// Each weight vector is loaded and widened once and multiplied into up to 8 rows, so a 4-row
// verification reads its weights once, as a 1-row step does. Every output sums over k in order,
// whatever the row count: a row's result does not depend on the rows beside it.
//
// Built at run time by rows_gemm.py (AVX-512F); compiled steps call it through the C shims below,
// direct calls from AOTInductor's generated code (config aot_inductor.custom_ops_to_c_shims).
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

namespace {

constexpr int BLOCK = 32;     // outputs per weight block: two zmm of float32
constexpr int MAX_ROWS = 8;   // rows sharing one pass over the weights
constexpr int64_t GRAIN = 16; // weight blocks per thread chunk (an lm_head has hundreds)

// Row-major operands: row m of x at x + m * ldx (k_dim floats), of y at y + m * ldy (n floats).
struct Operands {
  const float* x;
  int64_t ldx;
  float* y;
  int64_t ldy;

  Operands from(int64_t m) const { return {x + m * ldx, ldx, y + m * ldy, ldy}; }
};

// M rows x CB weight blocks: 2 * M * CB accumulators; per block and k one load, a shift and a mask.
template <int M, int CB>
void tile(const Operands& o, int64_t k_dim, const uint16_t* w, int64_t n, int64_t col0) {
  __m512 acc[M][2 * CB];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < 2 * CB; ++c) acc[m][c] = _mm512_setzero_ps();
  const int64_t block_stride = k_dim * BLOCK;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < k_dim; ++k) {
    __m512 wv[2 * CB];
    for (int c = 0; c < CB; ++c) {
      const __m512i pairs = _mm512_loadu_si512(w + c * block_stride + k * BLOCK);
      wv[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      wv[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
    }
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_set1_ps(o.x[m * o.ldx + k]);
      for (int c = 0; c < 2 * CB; ++c) acc[m][c] = _mm512_fmadd_ps(xv, wv[c], acc[m][c]);
    }
  }
  for (int c = 0; c < 2 * CB; ++c) {
    const int64_t col = col0 + c * 16, left = n - col;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(o.y + m * o.ldy + col, mask, acc[m][c]);
  }
}

// Blocks [b, b1) for M rows, CB blocks at a time, then the rest in halves.
template <int M, int CB>
void blocks_by(const Operands& o, int64_t k_dim, const uint16_t* w, int64_t n, int64_t b, int64_t b1) {
  for (; b + CB <= b1; b += CB) tile<M, CB>(o, k_dim, w + b * k_dim * BLOCK, n, b * BLOCK);
  if constexpr (CB > 1) blocks_by<M, CB / 2>(o, k_dim, w, n, b, b1);
}

// Fewer rows take more blocks at once, so that enough independent accumulators (8 or more)
// hide the FMA latency; 8 rows keep 16 accumulators and 2 weight vectors in registers.
template <int M>
void blocks(const Operands& o, int64_t k_dim, const uint16_t* w, int64_t n, int64_t b0, int64_t b1) {
  blocks_by<M, (M == 1 ? 4 : (M <= 3 ? 2 : 1))>(o, k_dim, w, n, b0, b1);
}

using BlocksFn = void (*)(const Operands&, int64_t, const uint16_t*, int64_t, int64_t, int64_t);
constexpr BlocksFn BLOCKS[MAX_ROWS] = {blocks<1>, blocks<2>, blocks<3>, blocks<4>,
                                       blocks<5>, blocks<6>, blocks<7>, blocks<8>};

// y[M, n] = x[M, k_dim] @ W.T for any M, MAX_ROWS rows per pass over the weight's blocks [b0, b1).
void rows(const Operands& o, int64_t count, int64_t k_dim, const uint16_t* w, int64_t n, int64_t b0, int64_t b1) {
  for (int64_t m0 = 0; m0 < count; m0 += MAX_ROWS) {
    const int64_t m = std::min<int64_t>(MAX_ROWS, count - m0);
    BLOCKS[m - 1](o.from(m0), k_dim, w, n, b0, b1);
  }
}

inline int64_t num_blocks(int64_t n) { return (n + BLOCK - 1) / BLOCK; }

// h[i] = silu(gu[i]) * gu[inter + i], silu(g) = g / (1 + exp(-g)) with ATen's vectorized exp.
void silu_and_mul(const float* gu, float* h, int64_t inter) {
  using Vec = at::vec::Vectorized<float>;
  int64_t i = 0;
  for (; i + Vec::size() <= inter; i += Vec::size()) {
    const Vec g = Vec::loadu(gu + i);
    (g / (Vec(1.0f) + g.neg().exp()) * Vec::loadu(gu + inter + i)).store(h + i);
  }
  if (i < inter) {
    const int64_t left = inter - i;
    const Vec g = Vec::loadu(gu + i, left);
    (g / (Vec(1.0f) + g.neg().exp()) * Vec::loadu(gu + inter + i, left)).store(h + i, left);
  }
}

}  // namespace

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& blocked, int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && blocked.scalar_type() == at::kBFloat16,
              "rows_linear: float32 x and bfloat16 blocked weight, got ", x.scalar_type(), " and ",
              blocked.scalar_type());
  // A contiguous input (every call from a package) is read in place: no tensor is made for it.
  const at::Tensor x2 = x.is_contiguous() ? at::Tensor() : x.contiguous();
  const at::Tensor& xc = x.is_contiguous() ? x : x2;
  const at::Tensor w = blocked.is_contiguous() ? blocked : blocked.contiguous();
  const int64_t k_dim = x.size(-1), m_all = k_dim ? x.numel() / k_dim : 0, nblocks = w.size(0);
  TORCH_CHECK(w.dim() == 3 && w.size(1) == k_dim && w.size(2) == BLOCK && nblocks == num_blocks(n),
              "rows_linear: blocked weight ", w.sizes(), " does not hold ", n, " outputs of ", k_dim, " inputs");
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options());
  if (m_all == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  float* yp = y.data_ptr<float>();
  const Operands o{xp, k_dim, yp, n};
  at::parallel_for(0, nblocks, GRAIN, [&](int64_t b0, int64_t b1) { rows(o, m_all, k_dim, wp, n, b0, b1); });
  return y;
}

// DeepSeekMoE's routed experts for a few tokens: out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t]))
// * up_e(x[t])), e = ids[t, j]. Each expert chosen by some token runs once on all its tokens
// (MAX_ROWS at a time), so its weights are read once; experts run in ascending id and each
// weighted output is added to its token's sum in that order (transformers' order). An id
// outside [0, E) (another rank's expert) adds nothing.
at::Tensor rows_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                        const at::Tensor& w13, const at::Tensor& w2, int64_t inter) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weights.scalar_type() == at::kFloat && ids.scalar_type() == at::kLong &&
                  w13.scalar_type() == at::kBFloat16 && w2.scalar_type() == at::kBFloat16,
              "rows_experts: float32 x and weights, int64 ids, bfloat16 blocked expert weights");
  const int64_t tokens = x.size(0), hidden = x.size(1), k = ids.size(1), experts = w13.size(0);
  TORCH_CHECK(ids.size(0) == tokens && weights.sizes() == ids.sizes(), "rows_experts: ids ", ids.sizes(),
              " and weights ", weights.sizes(), " do not match ", tokens, " tokens");
  TORCH_CHECK(w13.dim() == 4 && w13.size(1) == num_blocks(2 * inter) && w13.size(2) == hidden &&
                  w2.dim() == 4 && w2.size(0) == experts && w2.size(1) == num_blocks(hidden) && w2.size(2) == inter,
              "rows_experts: blocked weights ", w13.sizes(), " / ", w2.sizes(), " do not hold ", experts,
              " experts of ", hidden, " -> ", inter);
  const at::Tensor xc = x.contiguous(), idc = ids.contiguous(), wc = weights.contiguous();
  const at::Tensor g = w13.contiguous(), d = w2.contiguous();
  at::Tensor out = at::zeros({tokens, hidden}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int64_t* idp = idc.data_ptr<int64_t>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto* gp = reinterpret_cast<const uint16_t*>(g.data_ptr());
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const int64_t g_stride = g.stride(0), d_stride = d.stride(0);
  std::vector<int64_t> tok;
  std::vector<float> scale;
  std::vector<float> xs(MAX_ROWS * hidden), gu(MAX_ROWS * 2 * inter), h(MAX_ROWS * inter), y(MAX_ROWS * hidden);
  for (int64_t e = 0; e < experts; ++e) {
    tok.clear();
    scale.clear();
    for (int64_t p = 0; p < tokens * k; ++p)
      if (idp[p] == e) {
        tok.push_back(p / k);
        scale.push_back(wp[p]);
      }
    for (size_t r0 = 0; r0 < tok.size(); r0 += MAX_ROWS) {
      const int64_t m = std::min<int64_t>(MAX_ROWS, tok.size() - r0);
      for (int64_t r = 0; r < m; ++r) std::copy_n(xp + tok[r0 + r] * hidden, hidden, xs.data() + r * hidden);
      rows({xs.data(), hidden, gu.data(), 2 * inter}, m, hidden, gp + e * g_stride, 2 * inter, 0, num_blocks(2 * inter));
      for (int64_t r = 0; r < m; ++r) silu_and_mul(gu.data() + r * 2 * inter, h.data() + r * inter, inter);
      rows({h.data(), inter, y.data(), hidden}, m, inter, dp + e * d_stride, hidden, 0, num_blocks(hidden));
      for (int64_t r = 0; r < m; ++r) {
        float* o = op + tok[r0 + r] * hidden;
        const float s = scale[r0 + r];
        for (int64_t c = 0; c < hidden; ++c) o[c] += y[r * hidden + c] * s;
      }
    }
  }
  return out;
}

// Per-head products (MLA's absorbed W_UK and W_UV): y[t, h] = x[t, h] @ W_h.T, x [T, H, K] with
// its last dim contiguous (any row and head strides), blocked [H, ceil(N/32), K, 32] -> [T, H, N].
at::Tensor rows_heads(const at::Tensor& x, const at::Tensor& blocked, int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && blocked.scalar_type() == at::kBFloat16,
              "rows_heads: float32 x and bfloat16 blocked weight, got ", x.scalar_type(), " and ", blocked.scalar_type());
  const at::Tensor xc = x.stride(-1) == 1 ? x : x.contiguous();
  const at::Tensor w = blocked.is_contiguous() ? blocked : blocked.contiguous();
  TORCH_CHECK(xc.dim() == 3 && w.dim() == 4 && w.size(0) == xc.size(1) && w.size(1) == num_blocks(n) &&
                  w.size(2) == xc.size(2) && w.size(3) == BLOCK,
              "rows_heads: blocked weight ", w.sizes(), " does not hold ", n, " outputs of x ", xc.sizes(), " per head");
  const int64_t tokens = xc.size(0), heads = xc.size(1), k_dim = xc.size(2);
  at::Tensor y = at::empty({tokens, heads, n}, x.options());
  const float* xp = xc.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  float* yp = y.data_ptr<float>();
  for (int64_t h = 0; h < heads; ++h) {
    const Operands o{xp + h * xc.stride(1), xc.stride(0), yp + h * n, heads * n};
    rows(o, tokens, k_dim, wp + h * w.stride(0), n, 0, num_blocks(n));
  }
  return y;
}

TORCH_LIBRARY(mindspec, m) {
  m.def("rows_linear(Tensor x, Tensor blocked, int n) -> Tensor");
  m.def("rows_experts(Tensor x, Tensor ids, Tensor weights, Tensor w13, Tensor w2, int inter) -> Tensor");
  m.def("rows_heads(Tensor x, Tensor blocked, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(mindspec, CPU, m) {
  m.impl("rows_linear", rows_linear);
  m.impl("rows_experts", rows_experts);
  m.impl("rows_heads", rows_heads);
}

extern "C" AOTITorchError aoti_torch_cpu_rows_linear(AtenTensorHandle x, AtenTensorHandle blocked, int64_t n,
                                                     AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor y = rows_linear(*torch::aot_inductor::tensor_handle_to_tensor_pointer(x),
                               *torch::aot_inductor::tensor_handle_to_tensor_pointer(blocked), n);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(y));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_rows_experts(AtenTensorHandle x, AtenTensorHandle ids, AtenTensorHandle weights,
                                                      AtenTensorHandle w13, AtenTensorHandle w2, int64_t inter,
                                                      AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor out = rows_experts(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(ids),
                                  *tensor_handle_to_tensor_pointer(weights), *tensor_handle_to_tensor_pointer(w13),
                                  *tensor_handle_to_tensor_pointer(w2), inter);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_rows_heads(AtenTensorHandle x, AtenTensorHandle blocked, int64_t n,
                                                    AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor y = rows_heads(*torch::aot_inductor::tensor_handle_to_tensor_pointer(x),
                              *torch::aot_inductor::tensor_handle_to_tensor_pointer(blocked), n);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(y));
  });
}
