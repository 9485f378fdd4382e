// One layer's attention for the CPU's batch-invariant formats (bfloat16, int8) in one call:
// the same arithmetic as the runtime's torch path (LlamaRuntime._attend), bit for bit, with
// rotary, the float64 conversion and the cache writes done in one loop and the scores,
// softmax and values by the same ATen operators on the same views, so ~30 operators a
// layer (and their Python) fewer. Compiled with -ffp-contract=off: every product and sum
// rounds as torch's elementwise operators do.
//
//   heads     [B, Q, Hq + 2 Hkv, D]  the q | k | v projections (bfloat16 or float32)
//   cos, sin  [B, Q, 1, D] float64   rotary tables; sin with its first half negated
//   cache_k/v [slots, context, Hkv, D] float64, this layer's
//   write_slot, write_pos [B, Q] int64: where each query's key and value go
//   slots     [B] int64: the cache slot each batch row reads
//   mask      None or [B * Hkv, G * Q, K] float64, additive
// returns     [B, Q, Hq * D] in heads' dtype.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

namespace {

// qk[b, i, h] = rotary(q | k heads), in float64; the keys and values into the cache.
template <typename T>
void rotate_and_write(const T* heads, int64_t rows, int64_t hq, int64_t hkv, int64_t D,
                      const double* cos, const double* sin, double* qk, double* ck, double* cv,
                      int64_t slot_stride, const int64_t* write_slot, const int64_t* write_pos) {
  const int64_t width = hq + 2 * hkv, half = D / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = heads + r * width * D;
    const double* c = cos + r * D;
    const double* s = sin + r * D;
    double* out = qk + r * (hq + hkv) * D;
    for (int64_t h = 0; h < hq + hkv; ++h) {
      const T* x = row + h * D;
      for (int64_t j = 0; j < D; ++j) {  // x * cos + roll(x, D / 2) * signed sin
        const double straight = double(x[j]) * c[j];
        const double rolled = double(x[(j + half) % D]) * s[j];
        out[h * D + j] = straight + rolled;
      }
    }
    const int64_t at = write_slot[r] * slot_stride + write_pos[r] * hkv * D;
    for (int64_t j = 0; j < hkv * D; ++j) {
      ck[at + j] = out[hq * D + j];
      cv[at + j] = double(row[(hq + hkv) * D + j]);
    }
  }
}

}  // namespace

at::Tensor attention(const at::Tensor& heads_in, const at::Tensor& cos_in,
                        const at::Tensor& sin_in, at::Tensor cache_k, at::Tensor cache_v,
                        const at::Tensor& write_slot_in, const at::Tensor& write_pos_in,
                        const at::Tensor& slots, int64_t key_len,
                        const c10::optional<at::Tensor>& mask, int64_t hq) {
  TORCH_CHECK(heads_in.dim() == 4, "heads: [B, Q, heads, D]");
  TORCH_CHECK(cache_k.scalar_type() == at::kDouble && cache_k.is_contiguous() &&
                  cache_v.is_contiguous() && cache_v.sizes() == cache_k.sizes(),
              "cache: contiguous float64 [slots, context, Hkv, D]");
  const auto heads = heads_in.contiguous();
  const int64_t B = heads.size(0), Q = heads.size(1), D = heads.size(3);
  const int64_t hkv = cache_k.size(2), G = hq / hkv;
  TORCH_CHECK(heads.size(2) == hq + 2 * hkv && cache_k.size(3) == D && hq % hkv == 0 &&
                  D % 2 == 0 && key_len <= cache_k.size(1),
              "heads, the cache and key_len disagree");
  // Laid out once per forward by the runtime (LlamaRuntime._rows): no copies here.
  const auto cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const auto write_slot = write_slot_in.contiguous(), write_pos = write_pos_in.contiguous();
  TORCH_CHECK(cos.scalar_type() == at::kDouble && sin.scalar_type() == at::kDouble &&
                  cos.numel() == B * Q * D && sin.numel() == B * Q * D,
              "cos, sin: [B, Q, 1, D] float64");
  TORCH_CHECK(write_slot.scalar_type() == at::kLong && write_pos.scalar_type() == at::kLong &&
                  write_slot.numel() == B * Q && write_pos.numel() == B * Q,
              "write_slot, write_pos: [B, Q] int64");
  auto qk = at::empty({B, Q, hq + hkv, D}, heads.options().dtype(at::kDouble));
  const int64_t slot_stride = cache_k.size(1) * hkv * D;
  AT_DISPATCH_SWITCH(heads.scalar_type(), "attention",
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        rotate_and_write(heads.data_ptr<scalar_t>(), B * Q, hq, hkv, D, cos.data_ptr<double>(),
                         sin.data_ptr<double>(), qk.data_ptr<double>(),
                         cache_k.data_ptr<double>(), cache_v.data_ptr<double>(), slot_stride,
                         write_slot.data_ptr<int64_t>(), write_pos.data_ptr<int64_t>());
      })
      AT_DISPATCH_CASE(at::kFloat, [&] {
        rotate_and_write(heads.data_ptr<scalar_t>(), B * Q, hq, hkv, D, cos.data_ptr<double>(),
                         sin.data_ptr<double>(), qk.data_ptr<double>(),
                         cache_k.data_ptr<double>(), cache_v.data_ptr<double>(), slot_stride,
                         write_slot.data_ptr<int64_t>(), write_pos.data_ptr<int64_t>());
      }));
  // From here the runtime's own operators on the same views (LlamaRuntime._attention).
  at::Tensor keys, values;
  if (B == 1) {  // a view, no copy
    const int64_t slot = slots.item<int64_t>();
    keys = cache_k.select(0, slot).narrow(0, 0, key_len).unsqueeze(0);
    values = cache_v.select(0, slot).narrow(0, 0, key_len).unsqueeze(0);
  } else {
    keys = cache_k.narrow(1, 0, key_len).index_select(0, slots);
    values = cache_v.narrow(1, 0, key_len).index_select(0, slots);
  }
  const auto q = qk.narrow(2, 0, hq).transpose(1, 2);
  const auto grouped = q.reshape({B * hkv, G * Q, D});
  const auto keys_t = keys.transpose(1, 2).reshape({B * hkv, key_len, D}).transpose(1, 2);
  const double scale = std::pow(double(D), -0.5);
  const auto scores = mask.has_value()
      ? at::baddbmm(*mask, grouped, keys_t, 1.0, scale)
      : at::bmm(grouped, keys_t).mul_(scale);
  const auto out = at::bmm(scores.softmax(-1),
                           values.transpose(1, 2).reshape({B * hkv, key_len, D}))
                       .view({B, hq, Q, D});
  return out.transpose(1, 2).reshape({B, Q, hq * D}).to(heads.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(specinfer, m) {
  m.def("attention(Tensor heads, Tensor cos, Tensor sin, Tensor(a!) cache_k, "
        "Tensor(b!) cache_v, Tensor write_slot, Tensor write_pos, Tensor slots, int key_len, "
        "Tensor? mask, int hq) -> Tensor", &attention);
}
