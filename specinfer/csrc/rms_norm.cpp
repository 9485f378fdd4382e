// RMSNorm for the CPU's batch-invariant formats (bfloat16 activations): one call instead of
// torch's decomposition into ~8 operators (49 us a call at one row here), and, for the
// decoder loop, the residual sum before it in the same call. Each row on its own, in
// float32, in one fixed order: the squares summed in 16 lanes (element k in lane k % 16,
// the tail's in the first lanes), the lanes in a fixed tree, then
// y = bf16(x * (1 / sqrt(mean + eps)) * w), each product rounded in float32 (compiled with
// -ffp-contract=off). The residual sum h = bf16(float(a) + float(b)) is torch's bfloat16
// add. The order is in the source, not the vector width: the AVX-512 loop and the
// portable one give the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "vector_math.h"

namespace {

using at::BFloat16;
constexpr int kLanes = 16;

float fold(float* lanes) {
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
}

// Row x (and, where a is given, first x = bf16(a + b) into x) normalised into y.
void norm_row(const BFloat16* a, const BFloat16* b, BFloat16* x, const float* w, int64_t n,
              float eps, BFloat16* y) {
  if (a != nullptr)
    for (int64_t k = 0; k < n; ++k) x[k] = BFloat16(float(a[k]) + float(b[k]));
  float lanes[kLanes] = {};
  for (int64_t k = 0; k < n; ++k) {
    const float v = float(x[k]);
    lanes[k % kLanes] += v * v;
  }
  const float inv = 1.0f / std::sqrt(fold(lanes) / float(n) + eps);
  for (int64_t k = 0; k < n; ++k) y[k] = BFloat16(float(x[k]) * inv * w[k]);
}

AVX512_TARGET void norm_row_avx512(const BFloat16* a, const BFloat16* b, BFloat16* x,
                                        const float* w, int64_t n, float eps, BFloat16* y) {
  using vector_math::lanes;
  using vector_math::store16;
  using vector_math::widen16;
  if (a != nullptr)
    for (int64_t k = 0; k < n; k += kLanes)
      store16(_mm512_add_ps(widen16(a + k, lanes(n - k)), widen16(b + k, lanes(n - k))),
              lanes(n - k), x + k);
  __m512 sums = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += kLanes) {
    const __m512 v = widen16(x + k, lanes(n - k));
    sums = _mm512_mask_add_ps(sums, lanes(n - k), sums, _mm512_mul_ps(v, v));
  }
  alignas(64) float folded[kLanes];
  _mm512_store_ps(folded, sums);
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(fold(folded) / float(n) + eps));
  for (int64_t k = 0; k < n; k += kLanes) {
    const __mmask16 live = lanes(n - k);
    store16(_mm512_mul_ps(_mm512_mul_ps(widen16(x + k, live), inv),
                          _mm512_maskz_loadu_ps(live, w + k)),
            live, y + k);
  }
}

// y = rms_norm(x) row by row; where a is given, x = a + b first.
void norm_rows(const BFloat16* a, const BFloat16* b, BFloat16* x, const float* w, int64_t rows,
               int64_t n, float eps, BFloat16* y) {
  const bool avx512 = vector_math::use_avx512();
  // A tree's 16 rows take a few us: on one thread (a parallel region costs more than that).
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const BFloat16* ar = a == nullptr ? nullptr : a + r * n;
      const BFloat16* br = b == nullptr ? nullptr : b + r * n;
      if (avx512) {
        norm_row_avx512(ar, br, x + r * n, w, n, eps, y + r * n);
      } else {
        norm_row(ar, br, x + r * n, w, n, eps, y + r * n);
      }
    }
  });
}

at::Tensor checked_weight(const at::Tensor& weight, int64_t n) {
  TORCH_CHECK(weight.numel() == n && weight.scalar_type() == at::kFloat,
              "weight: [hidden] float32");
  return weight.contiguous();
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && x_in.dim() >= 1, "x: bfloat16");
  auto x = x_in.contiguous();
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  const auto weight = checked_weight(weight_in, n);
  auto y = at::empty_like(x);
  norm_rows(nullptr, nullptr, x.data_ptr<BFloat16>(), weight.data_ptr<float>(), rows, n,
            float(eps), y.data_ptr<BFloat16>());
  return y;
}

// (a + b, rms_norm(a + b)): the decoder loop's residual sum and the norm after it.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& a_in, const at::Tensor& b_in,
                                                const at::Tensor& weight_in, double eps) {
  TORCH_CHECK(a_in.scalar_type() == at::kBFloat16 && b_in.scalar_type() == at::kBFloat16 &&
                  a_in.sizes() == b_in.sizes() && a_in.dim() >= 1,
              "a, b: bfloat16 of one shape");
  const auto a = a_in.contiguous(), b = b_in.contiguous();
  const int64_t n = a.size(-1), rows = n == 0 ? 0 : a.numel() / n;
  const auto weight = checked_weight(weight_in, n);
  auto sum = at::empty_like(a), y = at::empty_like(a);
  norm_rows(a.data_ptr<BFloat16>(), b.data_ptr<BFloat16>(), sum.data_ptr<BFloat16>(),
            weight.data_ptr<float>(), rows, n, float(eps), y.data_ptr<BFloat16>());
  return {sum, y};
}

TORCH_LIBRARY_FRAGMENT(specinfer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor a, Tensor b, Tensor weight, float eps) -> (Tensor, Tensor)",
        &add_rms_norm);
}
