// Float32 arithmetic the native operators share, each in two forms that give the same bits:
// portable scalar code and AVX-512 (16 lanes). Built with -ffp-contract=off, so every
// product and sum rounds on its own unless a fused multiply-add is written out.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))

namespace vector_math {

// Tests: every operator's portable loops even where AVX-512 runs (torch.ops.specinfer.
// portable_loops), to compare the two forms bit for bit.
inline bool portable_only = false;

// Whether the AVX-512 forms run: the CPU has them and no test asked for the portable ones.
inline bool use_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return has && !portable_only;
}

// e^x for x <= 0 (Cephes' expf: x = n ln2 + r, a degree-7 polynomial in r, times 2^n),
// within ~1 ulp; below -87 it gives e^-87 (~1e-38).
constexpr float kLog2e = 1.44269504088896341f, kRound = 12582912.0f;  // 1.5 * 2^23
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExp[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                           4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = (x * kLog2e + kRound) - kRound;  // round(x / ln2), ties to even
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kExp[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExp[i];
  p = p * (r * r) + r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

AVX512_TARGET inline __m512 exp16(__m512 x) {  // exp_nonpositive, lane by lane
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_sub_ps(
      _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _mm512_set1_ps(kRound)),
      _mm512_set1_ps(kRound));
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(kLn2Hi)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(kLn2Lo)));
  __m512 p = _mm512_set1_ps(kExp[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(kExp[i]));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r),
                    _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// x[0..15] (the `live` lanes; the rest 0) as float32; bfloat16 widens exactly.
AVX512_TARGET inline __m512 widen16(const float* x, __mmask16 live = 0xFFFF) {
  return _mm512_maskz_loadu_ps(live, x);
}
AVX512_TARGET inline __m512 widen16(const at::BFloat16* x, __mmask16 live = 0xFFFF) {
  const __m256i bits = _mm256_maskz_loadu_epi16(live, x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The `live` lanes of v into out[0..15]: float32, or bfloat16 rounded as at::BFloat16
// rounds (to nearest even; NaN to 0x7FC0).
AVX512_TARGET inline void store16(__m512 v, __mmask16 live, float* out) {
  _mm512_mask_storeu_ps(out, live, v);
}
AVX512_TARGET inline void store16(__m512 v, __mmask16 live, at::BFloat16* out) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(
      _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
      _mm512_set1_epi32(0x7FFF));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                  _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(out, live, _mm512_cvtepi32_epi16(rounded));
}

inline __mmask16 lanes(int64_t n) {  // the first min(n, 16) lanes
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

}  // namespace vector_math
