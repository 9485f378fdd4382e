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

// Weight blocks [b0, b1) on one thread. The digits are a matrix of R = 3 M rows (row 3 m + d:
// digit d of x's row m), so one tile holds the digits of up to 5 rows (a plain step's one
// row is a 3-row tile, one product for its three digits). For kBlocks blocks at a time and
// each 16-row tile of the digits: tmm0-2 the blocks' int32 sums, tmm3 the digits, tmm4-6
// the blocks' weight tiles; the digits' tile is loaded once for the three blocks (a tile
// load costs about a cycle per row here), and the three sums are independent chains.
// Integer sums are exact, so the grouping changes no bit.
AMX_TARGET void amx_pass(const int8_t* digits, int64_t M, int64_t k_tiles, const int8_t* packed,
                         const float* sx, const float* sw, int64_t N, bool bf16, void* y,
                         int64_t b0, int64_t b1, int32_t* sums) {
  const int64_t R = kDigits * M, width = k_tiles * kTileK, block_bytes = k_tiles * kTileBytes;
  int64_t configured = -1;
  for (int64_t g = b0; g < b1; g += kBlocks) {
    const int64_t nb = std::min<int64_t>(kBlocks, b1 - g);
    for (int64_t r0 = 0; r0 < R; r0 += kTile) {
      const int64_t rows = std::min<int64_t>(kTile, R - r0);
      amx::configure(rows, configured);
      const char* block = reinterpret_cast<const char*>(packed + g * block_bytes);
      amx::accumulate<false>(reinterpret_cast<const char*>(digits + r0 * width), width, block,
                             block_bytes, nb, k_tiles, r0 == 0);
      // sums[j][r][col]: block j's digit-row r
      _tile_stored(0, sums + r0 * kTile, 64);
      if (nb > 1) _tile_stored(1, sums + (R + r0) * kTile, 64);
      if (nb > 2) _tile_stored(2, sums + (2 * R + r0) * kTile, 64);
    }
    for (int64_t j = 0; j < nb; ++j) {
      const int32_t* s = sums + j * R * kTile;
      const int64_t n0 = (g + j) * kTile, cols = std::min(kTile, N - n0);
      for (int64_t m = 0; m < M; ++m) {
        const int32_t* d0 = s + (kDigits * m) * kTile;
        for (int64_t c = 0; c < cols; ++c) {
          const double whole =
              65536.0 * d0[2 * kTile + c] + 256.0 * d0[kTile + c] + double(d0[c]);
          const float v = float(whole * double(sx[m]) * double(sw[n0 + c]));
          if (bf16) {
            static_cast<at::BFloat16*>(y)[m * N + n0 + c] = at::BFloat16(v);
          } else {
            static_cast<float*>(y)[m * N + n0 + c] = v;
          }
        }
      }
    }
  }
  _tile_release();
}

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))

AVX512_TARGET inline __m512 load16(const float* p, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, p);
}

AVX512_TARGET inline __m512 load16(const at::BFloat16* p, __mmask16 mask) {  // exact widening
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
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
      const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
      most = _mm512_max_ps(most, _mm512_abs_ps(load16(row + k, mask)));
    }
    const float top = _mm512_reduce_max_ps(most);
    const float s = top > 0.0f ? top / kFixedMax : 1.0f;
    sx[m] = s;
    const __m512 step = _mm512_set1_ps(s);
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
      __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(load16(row + k, mask), step));
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
at::Tensor amx_linear(const at::Tensor& x_in, const at::Tensor& packed,
                         const at::Tensor& scale, int64_t N) {
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
  auto y = at::empty({M, N}, x.options());
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
  void* yp = y.data_ptr();
  at::parallel_for(0, packed.size(0), 2 * kBlocks, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> sums(kBlocks * R * kTile);  // the int32 sums of a pass's blocks
    amx_pass(dp, M, k_tiles, pp, sxp, swp, N, bf16, yp, b0, b1, sums.data());
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(specinfer, m) {
  m.def("amx_enable() -> bool", &amx_enable);
  m.def("int8_amx_linear(Tensor x, Tensor packed, Tensor scale, int n) -> Tensor", &amx_linear);
}
