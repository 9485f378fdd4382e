// One layer's attention for the CPU's batch-invariant formats (bfloat16, int8) in one call,
// in float32, with every (query, head) row computed on its own by loops whose order is in
// the source: a row's bits depend on its query and on the keys and values it sees, in
// order, and on nothing else (not on the rows beside it, the batch's shape, the positions
// its keys sit at, the thread count or the vector width). So a tree node's row equals the
// row plain decoding computes for the same token: its visible keys are the same keys in the
// same order (its ancestors', written by this call at tree indices instead of consecutive
// positions). torch's kernels give no such promise, which is why the runtime's torch path
// runs attention in float64.
//
// Per row: scores s_r = dot(q, k_r) / sqrt(D) over the visible keys r = 0..n-1 (each dot
// summed in 16 lanes by element, the lanes in a fixed tree), e_r = exp(s_r - max s) by the
// exp below, the sum of e_r in 16 lanes by r, out = (sum_r e_r v_r) / sum e, the even and
// the odd r accumulated in order in two sums (fused multiply-adds), added at the end.
// Compiled with -ffp-contract=off: every other product and sum rounds on its own, and the
// fused ones are explicit (std::fma in the portable loops, exact where the CPU has no FMA),
// so every x86-64 CPU gives the same bits.
//
//   heads     [B, Q, Hq + 2 Hkv, D]  the q | k | v projections (bfloat16 or float32)
//   cos, sin  [B, Q, 1, D] float32   rotary tables; sin with its first half negated
//   cache_k/v [slots, context, Hkv, D] float32, this layer's
//   write_slot, write_pos [B, Q] int64: where each query's key and value go
//   slots     [B] int64: the cache slot each batch row reads
//   visible   None (every key < key_len) or [B, Q, key_len] bool
// returns     [B, Q, Hq * D] in heads' dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "vector_math.h"

namespace {

using vector_math::exp16;
using vector_math::exp_nonpositive;
using vector_math::widen16;

constexpr int kLanes = 16;

// ---- the arithmetic, in portable loops: what every path must give, bit for bit ----------

inline float fold(float* lanes) {  // the 16 lanes' sum, in a fixed tree
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
}

// Lane l sums a[i] * b[i] over i = l, l + 16, ... in order (the first product, then fused
// multiply-adds, each rounded once); then the lanes are folded.
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {};
  for (int l = 0; l < kLanes && l < n; ++l) lanes[l] = a[l] * b[l];
  for (int64_t k = kLanes; k < n; ++k) lanes[k % kLanes] = std::fma(a[k], b[k], lanes[k % kLanes]);
  return fold(lanes);
}

struct Rows {
  const float* qk;      // [B * Q, Hq + Hkv, D]
  const float* keys;    // the cache: [slots, context, Hkv, D]
  const float* values;
  const int64_t* slots;
  const bool* visible;  // [B, Q, key_len] or null
  int64_t Q, hq, hkv, D, context, key_len;
  float scale;
};

// One head's row: scores into e (then their exponentials), the values' weighted sum into o.
void attend_head(const float* q, const float* keys, const float* values, int64_t stride,
                 const int64_t* seen, int64_t n, int64_t D, float scale, float* e, float* o) {
  float top = -INFINITY;
  for (int64_t r = 0; r < n; ++r) {
    e[r] = dot(q, keys + seen[r] * stride, D) * scale;
    top = std::max(top, e[r]);
  }
  float lanes[kLanes] = {};
  for (int64_t r = 0; r < n; ++r) {
    e[r] = exp_nonpositive(e[r] - top);
    lanes[r % kLanes] += e[r];
  }
  const float total = fold(lanes);
  std::vector<float> odd(D, 0.0f);  // the even ranks' sum in o, the odd ranks' here
  std::fill(o, o + D, 0.0f);
  for (int64_t r = 0; r < n; ++r) {
    float* sum = r % 2 ? odd.data() : o;
    for (int64_t d = 0; d < D; ++d) sum[d] = std::fma(e[r], values[seen[r] * stride + d], sum[d]);
  }
  for (int64_t d = 0; d < D; ++d) o[d] = (o[d] + odd[d]) / total;
}

// ---- the same arithmetic on AVX-512 (D a multiple of 16) ---------------------------------


// 16 keys' lane vectors folded at once: the fold's pairs added (lane l + lane l + 8, then
// + 4, + 2, + 1) while the vectors are transposed, so key j's sum lands in lane j.
AVX512_TARGET inline __m512 fold16(__m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // per key: lanes 0-7 + 8-15 (two keys a vector)
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // lanes 0-3 + 4-7 (four keys, one per 128 bits)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // lanes 0-1 + 2-3 (two keys in each 128 bits)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88),
                                    _mm512_shuffle_ps(c[0], c[1], 0xDD));
  return sums;  // lane 4p + s: key 4s + p (find_fold_order)
}

alignas(64) int32_t fold_order[kLanes];  // key j's sum is in lane fold_order[j]

// CHUNKS = D / 16, fixed at compile time so that q and the sums stay in registers.
template <int CHUNKS>
AVX512_TARGET void attend_head_avx512(const float* q, const float* keys, const float* values,
                               int64_t stride, const int64_t* seen, int64_t n, float scale,
                               float* e, float* o) {
  const __m512i order = _mm512_load_si512(fold_order);
  __m512 query[CHUNKS];
  for (int c = 0; c < CHUNKS; ++c) query[c] = _mm512_loadu_ps(q + c * kLanes);
  __m512 top = _mm512_set1_ps(-INFINITY);
  __m512 v[kLanes];
  for (int64_t r0 = 0; r0 < n; r0 += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, n - r0);
    for (int64_t j = 0; j < kLanes; ++j) {
      if (j >= m) {
        v[j] = _mm512_setzero_ps();
        continue;
      }
      const float* k = keys + seen[r0 + j] * stride;
      __m512 acc = _mm512_mul_ps(query[0], _mm512_loadu_ps(k));
      for (int c = 1; c < CHUNKS; ++c)
        acc = _mm512_fmadd_ps(query[c], _mm512_loadu_ps(k + c * kLanes), acc);
      v[j] = acc;
    }
    const __m512 s = _mm512_mul_ps(_mm512_permutexvar_ps(order, fold16(v)),
                                   _mm512_set1_ps(scale));
    const __mmask16 live = m == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << m) - 1);
    _mm512_mask_storeu_ps(e + r0, live, s);
    top = _mm512_mask_max_ps(top, live, top, s);
  }
  const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));  // max: order-free
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t r0 = 0; r0 < n; r0 += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, n - r0);
    const __mmask16 live = m == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << m) - 1);
    const __m512 x = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, e + r0), most));
    _mm512_mask_storeu_ps(e + r0, live, x);
    lanes = _mm512_mask_add_ps(lanes, live, lanes, x);
  }
  alignas(64) float folded[kLanes];
  _mm512_store_ps(folded, lanes);
  const __m512 total = _mm512_set1_ps(fold(folded));
  // Even and odd ranks in two sums: two chains of additions the core overlaps.
  __m512 even[CHUNKS], odd[CHUNKS];
  for (int c = 0; c < CHUNKS; ++c) even[c] = odd[c] = _mm512_setzero_ps();
  int64_t r = 0;
  for (; r + 1 < n; r += 2) {
    const __m512 w0 = _mm512_set1_ps(e[r]), w1 = _mm512_set1_ps(e[r + 1]);
    const float* v0 = values + seen[r] * stride;
    const float* v1 = values + seen[r + 1] * stride;
    for (int c = 0; c < CHUNKS; ++c) {
      even[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v0 + c * kLanes), even[c]);
      odd[c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(v1 + c * kLanes), odd[c]);
    }
  }
  if (r < n) {
    const __m512 w0 = _mm512_set1_ps(e[r]);
    const float* v0 = values + seen[r] * stride;
    for (int c = 0; c < CHUNKS; ++c)
      even[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v0 + c * kLanes), even[c]);
  }
  for (int c = 0; c < CHUNKS; ++c)
    _mm512_storeu_ps(o + c * kLanes, _mm512_div_ps(_mm512_add_ps(even[c], odd[c]), total));
}

using HeadKernel = void (*)(const float*, const float*, const float*, int64_t, const int64_t*,
                            int64_t, float, float*, float*);

// Which lane fold16 leaves each key's sum in, found by folding keys 0..15 as 1024 j in
// lane 0 (the shuffles only move values, so the same permutation holds for any input).
AVX512_TARGET void find_fold_order() {
  __m512 v[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    alignas(64) float x[kLanes] = {};
    x[0] = 1024.0f * j;
    v[j] = _mm512_load_ps(x);
  }
  alignas(64) float lane_of[kLanes];
  _mm512_store_ps(lane_of, fold16(v));
  for (int l = 0; l < kLanes; ++l) fold_order[int(lane_of[l] / 1024.0f)] = l;
}

// The AVX-512 kernel for head size D where the CPU has it (and D is one it is built for).
HeadKernel avx512_kernel(int64_t D) {
  if (!vector_math::use_avx512()) return nullptr;
  static const bool ordered = (find_fold_order(), true);
  (void)ordered;
  switch (D) {
    case 32: return attend_head_avx512<2>;
    case 64: return attend_head_avx512<4>;
    case 96: return attend_head_avx512<6>;
    case 128: return attend_head_avx512<8>;
    default: return nullptr;
  }
}

// Query row `row` (= b * Q + j), query head h (of kv head h / (hq / hkv)), into out[D].
void attend_row(const Rows& a, int64_t row, int64_t h, int64_t* seen, float* e, float* out) {
  const int64_t b = row / a.Q, g = h / (a.hq / a.hkv), D = a.D, stride = a.hkv * D;
  int64_t n = 0;
  if (a.visible == nullptr) {
    for (int64_t k = 0; k < a.key_len; ++k) seen[n++] = k;
  } else {
    const bool* vis = a.visible + row * a.key_len;
    for (int64_t k = 0; k < a.key_len; ++k)
      if (vis[k]) seen[n++] = k;
  }
  if (n == 0) {  // padding that sees nothing: zeros, never read
    std::fill(out, out + D, 0.0f);
    return;
  }
  const float* keys = a.keys + a.slots[b] * a.context * stride + g * D;
  const float* values = a.values + a.slots[b] * a.context * stride + g * D;
  const float* q = a.qk + (row * (a.hq + a.hkv) + h) * D;
  if (const HeadKernel avx512 = avx512_kernel(D)) {
    avx512(q, keys, values, stride, seen, n, a.scale, e, out);
  } else {
    attend_head(q, keys, values, stride, seen, n, D, a.scale, e, out);
  }
}

// One head's rotary: y = x * cos + roll(x, D / 2) * sin (sin's first half negated), each
// product and the sum rounded on its own, 16 lanes at a time (D / 2 a multiple of 16).
template <typename T>
AVX512_TARGET void rotate_avx512(const T* x, const float* c, const float* s, int64_t half, float* y) {
  for (int64_t j = 0; j < half; j += kLanes) {
    const __m512 lo = widen16(x + j), hi = widen16(x + half + j);
    _mm512_storeu_ps(y + j, _mm512_add_ps(_mm512_mul_ps(lo, _mm512_loadu_ps(c + j)),
                                          _mm512_mul_ps(hi, _mm512_loadu_ps(s + j))));
    _mm512_storeu_ps(y + half + j,
                     _mm512_add_ps(_mm512_mul_ps(hi, _mm512_loadu_ps(c + half + j)),
                                   _mm512_mul_ps(lo, _mm512_loadu_ps(s + half + j))));
  }
}

// qk[row, h] = rotary(q | k heads) in float32; the keys and values into the cache. Rows
// split between threads (each row's arithmetic is the same wherever it runs).
template <typename T>
void rotate_and_write(const T* heads, int64_t rows, int64_t hq, int64_t hkv, int64_t D,
                      const float* cos, const float* sin, float* qk, float* ck, float* cv,
                      int64_t slot_stride, const int64_t* write_slot, const int64_t* write_pos) {
  const int64_t width = hq + 2 * hkv, half = D / 2;
  const bool avx512 = half % kLanes == 0 && vector_math::use_avx512();
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = heads + r * width * D;
      const float* c = cos + r * D;
      const float* s = sin + r * D;
      float* out = qk + r * (hq + hkv) * D;
      for (int64_t h = 0; h < hq + hkv; ++h) {
        const T* x = row + h * D;
        float* y = out + h * D;
        if (avx512) {
          rotate_avx512(x, c, s, half, y);
          continue;
        }
        for (int64_t j = 0; j < half; ++j)  // x * cos + roll(x, D / 2) * signed sin
          y[j] = float(x[j]) * c[j] + float(x[j + half]) * s[j];
        for (int64_t j = half; j < D; ++j) y[j] = float(x[j]) * c[j] + float(x[j - half]) * s[j];
      }
      const int64_t at = write_slot[r] * slot_stride + write_pos[r] * hkv * D;
      std::memcpy(ck + at, out + hq * D, hkv * D * sizeof(float));
      for (int64_t j = 0; j < hkv * D; ++j) cv[at + j] = float(row[(hq + hkv) * D + j]);
    }
  });
}

AVX512_TARGET void to_bfloat16_avx512(const float* x, int64_t n, at::BFloat16* y) {
  for (int64_t j = 0; j < n; j += kLanes)  // rounded as at::BFloat16 rounds
    vector_math::store16(widen16(x + j, vector_math::lanes(n - j)), vector_math::lanes(n - j), y + j);
}

}  // namespace

// Tests: every native operator's portable loops, even where AVX-512 runs.
void portable_loops(bool on) { vector_math::portable_only = on; }

at::Tensor attention(const at::Tensor& heads_in, const at::Tensor& cos_in,
                     const at::Tensor& sin_in, at::Tensor cache_k, at::Tensor cache_v,
                     const at::Tensor& write_slot_in, const at::Tensor& write_pos_in,
                     const at::Tensor& slots_in, int64_t key_len,
                     const c10::optional<at::Tensor>& visible_in, int64_t hq) {
  TORCH_CHECK(heads_in.dim() == 4, "heads: [B, Q, heads, D]");
  TORCH_CHECK(cache_k.scalar_type() == at::kFloat && cache_k.is_contiguous() &&
                  cache_v.is_contiguous() && cache_v.sizes() == cache_k.sizes(),
              "cache: contiguous float32 [slots, context, Hkv, D]");
  const auto heads = heads_in.contiguous();
  const int64_t B = heads.size(0), Q = heads.size(1), D = heads.size(3);
  const int64_t hkv = cache_k.size(2);
  TORCH_CHECK(heads.size(2) == hq + 2 * hkv && cache_k.size(3) == D && hq % hkv == 0 &&
                  D % 2 == 0 && key_len <= cache_k.size(1),
              "heads, the cache and key_len disagree");
  const auto cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const auto write_slot = write_slot_in.contiguous(), write_pos = write_pos_in.contiguous();
  const auto slots = slots_in.contiguous();
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.numel() == B * Q * D && sin.numel() == B * Q * D,
              "cos, sin: [B, Q, 1, D] float32");
  TORCH_CHECK(write_slot.scalar_type() == at::kLong && write_pos.scalar_type() == at::kLong &&
                  write_slot.numel() == B * Q && write_pos.numel() == B * Q &&
                  slots.scalar_type() == at::kLong && slots.numel() == B,
              "write_slot, write_pos: [B, Q], slots: [B], int64");
  at::Tensor visible;
  if (visible_in.has_value()) {
    visible = visible_in->contiguous();
    TORCH_CHECK(visible.scalar_type() == at::kBool && visible.numel() == B * Q * key_len,
                "visible: [B, Q, key_len] bool");
  }
  auto qk = at::empty({B, Q, hq + hkv, D}, heads.options().dtype(at::kFloat));
  const int64_t slot_stride = cache_k.size(1) * hkv * D;
  AT_DISPATCH_SWITCH(heads.scalar_type(), "attention",
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        rotate_and_write(heads.data_ptr<scalar_t>(), B * Q, hq, hkv, D, cos.data_ptr<float>(),
                         sin.data_ptr<float>(), qk.data_ptr<float>(),
                         cache_k.data_ptr<float>(), cache_v.data_ptr<float>(), slot_stride,
                         write_slot.data_ptr<int64_t>(), write_pos.data_ptr<int64_t>());
      })
      AT_DISPATCH_CASE(at::kFloat, [&] {
        rotate_and_write(heads.data_ptr<scalar_t>(), B * Q, hq, hkv, D, cos.data_ptr<float>(),
                         sin.data_ptr<float>(), qk.data_ptr<float>(),
                         cache_k.data_ptr<float>(), cache_v.data_ptr<float>(), slot_stride,
                         write_slot.data_ptr<int64_t>(), write_pos.data_ptr<int64_t>());
      }));
  const Rows rows{qk.data_ptr<float>(), cache_k.data_ptr<float>(), cache_v.data_ptr<float>(),
                  slots.data_ptr<int64_t>(),
                  visible.defined() ? visible.data_ptr<bool>() : nullptr,
                  Q, hq, hkv, D, cache_k.size(1), key_len, 1.0f / std::sqrt(float(D))};
  auto out = at::empty({B, Q, hq * D}, heads.options());
  const bool bf16 = heads.scalar_type() == at::kBFloat16, avx512 = vector_math::use_avx512();
  char* op = static_cast<char*>(out.data_ptr());
  // Items are (query row, head); a thread takes whole items, so its split changes no bits.
  // Even a plain step's few heads are worth two threads (16 -> 9 us a layer here).
  const int64_t items = B * Q * hq, work = std::max<int64_t>(1, key_len * D);
  at::parallel_for(0, items, std::max<int64_t>(1, (1 << 12) / work), [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> seen(key_len);
    std::vector<float> e(key_len), head_out(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = i / hq, h = i % hq, at = row * hq * D + h * D;
      if (!bf16) {
        attend_row(rows, row, h, seen.data(), e.data(), reinterpret_cast<float*>(op) + at);
        continue;
      }
      attend_row(rows, row, h, seen.data(), e.data(), head_out.data());
      auto* o = reinterpret_cast<at::BFloat16*>(op) + at;
      if (avx512) {
        to_bfloat16_avx512(head_out.data(), D, o);
      } else {
        for (int64_t j = 0; j < D; ++j) o[j] = at::BFloat16(head_out[j]);
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(specinfer, m) {
  m.def("portable_loops(bool on) -> ()", &portable_loops);
  m.def("attention(Tensor heads, Tensor cos, Tensor sin, Tensor(a!) cache_k, "
        "Tensor(b!) cache_v, Tensor write_slot, Tensor write_pos, Tensor slots, int key_len, "
        "Tensor? visible, int hq) -> Tensor", &attention);
}
