// Weight-only int8 linears on AMX whose rows are batch-invariant by construction, because
// every sum is an integer sum, and whose weight is read once per call straight into AMX's
// tiles (no widening), however many rows come.
//
// Each row of x is fixed point: q = round(x / s) with s = max|x| / 8257536 (24 bits), split
// into three int8 digits, q = 65536 d2 + 256 d1 + d0 (each in [-128, 127]). For every digit
// TDPBSSD sums d * w in int32, exactly; then
//     y[m, n] = float((65536 S2 + 256 S1 + S0) * s[m] * scale[n])     (in double)
// so a row's result depends on nothing but its own values: not on the rows beside it, the
// thread count or the CPU. specinfer/int8.py computes the same numbers with torch._int_mm
// (its reference) and checks this kernel against it before using it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "amx.h"


namespace {

using amx::kBlocks;
using amx::kTile;
using amx::kTileBytes;
constexpr int64_t kTileK = 64;   // int8 k per tile row
constexpr int kDigits = 3;
constexpr float kFixedMax = 8257536.0f;  // 2^23 - 2^17: the top digit stays in [-128, 127]


// One row's 16 columns of a block from its three digits' int32 sums (d[0..15] digit 0,
// d[16..31] digit 1, d[32..47] digit 2): y = float((65536 S2 + 256 S1 + S0) * sx * sw[c]),
// in double, 8 lanes at a time. The whole is an exact integer below 2^53, so it is the
// same however it is summed; the two products and the conversions round as the scalar
// expression does (and as int8.reference does).
template <typename Out>
AVX512_TARGET inline void combine(const int32_t* d, float sx, const float* sw, __mmask16 cols,
                                  Out* out) {
  const __m512d row_scale = _mm512_set1_pd(double(sx));
  __m256 half[2];
  for (int h = 0; h < 2; ++h) {
    const __m512d s0 = _mm512_cvtepi32_pd(_mm256_loadu_si256((const __m256i*)(d + 8 * h)));
    const __m512d s1 = _mm512_cvtepi32_pd(_mm256_loadu_si256((const __m256i*)(d + 16 + 8 * h)));
    const __m512d s2 = _mm512_cvtepi32_pd(_mm256_loadu_si256((const __m256i*)(d + 32 + 8 * h)));
    const __m512d whole = _mm512_add_pd(
        _mm512_add_pd(_mm512_mul_pd(_mm512_set1_pd(65536.0), s2),
                      _mm512_mul_pd(_mm512_set1_pd(256.0), s1)), s0);
    const __mmask8 lanes = __mmask8(cols >> (8 * h));
    const __m512d col_scale = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(lanes, sw + 8 * h));
    half[h] = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_mul_pd(whole, row_scale), col_scale));
  }
  const __m512 v = _mm512_castpd_ps(_mm512_insertf64x4(
      _mm512_castps_pd(_mm512_castps256_ps512(half[0])), _mm256_castps_pd(half[1]), 1));
  vector_math::store16(v, cols, out);
}


// Weight blocks [b0, b1) on one thread. The digits are a matrix of R = 3 M rows (row 3 m + d:
// digit d of x's row m), so one tile holds the digits of up to 5 rows (a plain step's one
// row is a 3-row tile, one product for its three digits). For kBlocks blocks at a time and
// each 16-row tile of the digits: tmm0-2 the blocks' int32 sums, tmm3 the digits, tmm4-6
// the blocks' weight tiles; the digits' tile is loaded once for the three blocks (a tile
// load costs about a cycle per row here), and the three sums are independent chains.
// Integer sums are exact, so the grouping changes no bit.
template <typename Out>
AMX_AVX512_TARGET void amx_pass(const int8_t* digits, int64_t M, int64_t k_tiles,
                                const int8_t* packed, const float* sx, const float* sw,
                                int64_t N, Out* y, int64_t b0, int64_t b1, int32_t* sums) {
  const int64_t R = kDigits * M, width = k_tiles * kTileK, block_bytes = k_tiles * kTileBytes;
  int64_t configured = -1;
  for (int64_t g = b0; g < b1; g += kBlocks) {
    const int64_t nb = std::min<int64_t>(kBlocks, b1 - g);
    const char* block = reinterpret_cast<const char*>(packed + g * block_bytes);
    for (int64_t r0 = 0; r0 < R; r0 += kTile) {
      amx::configure(std::min<int64_t>(kTile, R - r0), configured);
      amx::accumulate<false>(reinterpret_cast<const char*>(digits + r0 * width), width, block,
                             block_bytes, nb, k_tiles, r0 == 0);
      // sums[j][r][col]: block j's digit-row r
      _tile_stored(0, sums + r0 * kTile, 64);
      if (nb > 1) _tile_stored(1, sums + (R + r0) * kTile, 64);
      if (nb > 2) _tile_stored(2, sums + (2 * R + r0) * kTile, 64);
    }
    for (int64_t j = 0; j < nb; ++j) {  // every row's 16 columns of block g + j
      const int64_t n0 = (g + j) * kTile;
      const __mmask16 cols = vector_math::lanes(N - n0);
      for (int64_t m = 0; m < M; ++m)
        combine(sums + (j * R + kDigits * m) * kTile, sx[m], sw + n0, cols, y + m * N + n0);
    }
  }
  _tile_release();
}

// Row m of x as fixed point: its scale sx[m], and its digit d at digits[3 m + d][k] (the
// buffer is zeroed beyond K). Every lane does what the reference does, in float32:
// q = round_half_even(x / s).
template <typename T>
AVX512_TARGET void to_digits(const T* x, int64_t M, int64_t K, int64_t width,
                             int8_t* digits, float* sx) {
  const __m512i half = _mm512_set1_epi32(128), byte = _mm512_set1_epi32(255);
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * K;
    __m512 most = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = vector_math::lanes(K - k);
      most = _mm512_max_ps(most, _mm512_abs_ps(vector_math::widen16(row + k, mask)));
    }
    const float top = _mm512_reduce_max_ps(most);
    const float s = top > 0.0f ? top / kFixedMax : 1.0f;
    sx[m] = s;
    const __m512 step = _mm512_set1_ps(s);
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = vector_math::lanes(K - k);
      __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(vector_math::widen16(row + k, mask), step));
      for (int i = 0; i < kDigits; ++i) {
        const __m512i d = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(q, half), byte), half);
        _mm_mask_storeu_epi8(digits + (kDigits * m + i) * width + k, mask,
                             _mm512_cvtepi32_epi8(d));
        q = _mm512_srai_epi32(_mm512_sub_epi32(q, d), 8);
      }
    }
  }
}

}  // namespace

// Linux gives a process AMX's tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA); false where the kernel or the CPU says no.
bool amx_enable() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

// x [M, K] bfloat16 or float32; packed [ceil(N/16), ceil(K/64), 16, 16, 4] int8: B tiles,
// row r holding k = 64t + 4r .. 64t + 4r + 3 of 16 columns; scale [N] float32.
// Returns [M, N] in x's dtype, or float32 (float_out: unrounded to bfloat16, e.g. logits).
at::Tensor amx_linear(const at::Tensor& x_in, const at::Tensor& packed,
                      const at::Tensor& scale, int64_t N, bool float_out) {
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x_in.dim() == 2 && (bf16 || x_in.scalar_type() == at::kFloat),
              "x: [rows, in] bfloat16 or float32");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kChar &&
                  packed.is_contiguous(), "packed: int8 B tiles");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N &&
                  scale.is_contiguous(), "scale: [out] float32");
  const auto x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), k_tiles = packed.size(1);
  TORCH_CHECK(K <= k_tiles * kTileK && packed.size(0) * kTile >= N, "x and packed disagree");
  const bool bf16_out = bf16 && !float_out;
  auto y = at::empty({M, N}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (M == 0) return y;
  const int64_t width = k_tiles * kTileK, R = kDigits * M;
  static thread_local std::vector<int8_t> digits;  // [M][3][width], zeros past K
  static thread_local std::vector<float> sx;
  digits.assign(R * width, 0);
  sx.resize(M);
  if (bf16) {
    to_digits(x.data_ptr<at::BFloat16>(), M, K, width, digits.data(), sx.data());
  } else {
    to_digits(x.data_ptr<float>(), M, K, width, digits.data(), sx.data());
  }
  const int8_t* dp = digits.data();
  const float* sxp = sx.data();
  const int8_t* pp = packed.data_ptr<int8_t>();
  const float* swp = scale.data_ptr<float>();
  at::parallel_for(0, packed.size(0), 2 * kBlocks, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> sums(kBlocks * R * kTile);  // the int32 sums of a pass's blocks
    if (bf16_out) {
      amx_pass(dp, M, k_tiles, pp, sxp, swp, N, y.data_ptr<at::BFloat16>(), b0, b1,
               sums.data());
    } else {
      amx_pass(dp, M, k_tiles, pp, sxp, swp, N, y.data_ptr<float>(), b0, b1, sums.data());
    }
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(specinfer, m) {
  m.def("amx_enable() -> bool", &amx_enable);
  m.def("int8_amx_linear(Tensor x, Tensor packed, Tensor scale, int n, bool float_out=False) "
        "-> Tensor", &amx_linear);
}
