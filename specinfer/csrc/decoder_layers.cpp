// The decoder layers of a step for the CPU's batch-invariant formats (bfloat16, int8) in
// one call: the same operators, in the same order, on the same tensors as the runtime's
// Python loop (LlamaRuntime._layers), so the same bits, without a Python frame and a
// dozen view and reshape operators around each of them (~1,700 operators a step in
// Python, ~14 a layer here). It runs only where every part is native: the norms and
// attention of this library, and linears that are this library's int8 or bfloat16 AMX
// kernels or oneDNN's packed bfloat16 kernel.
//
// Each layer i has four linears, qkv, o, gate_up, down, at index 4 i + j of the lists:
//   weights[l]  the int8 AMX tiles (kind 1), oneDNN's packed weight (kind 2) or the
//               bfloat16 AMX tiles (kind 3)
//   scales[l]   int8: the per-output scale; biases[l]: None or [out]
//   outs[l]     output width; rows[l]: rows a oneDNN call takes at most (0: all)
// norms[2 i], norms[2 i + 1]: the layer's RMSNorm weights (float32), epsilon eps.
// A batch is one or more parts, each laid out as LlamaRuntime._rows lays it out (cos, sin,
// write_slot, write_pos, slots, key_len, its B and Q, packed: the real queries' flat
// indices or None); masks[p * layers + i]: part p's mask at layer i. hidden is
// [B, Q, H] (one part, unpacked) or [N, H] (the parts' real queries in order).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <string_view>
#include <vector>

at::Tensor amx_linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale,
                      int64_t N, bool float_out);
at::Tensor bf16_amx_linear(const at::Tensor& x_in, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias_in, int64_t N, bool float_out);
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up_in);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& a_in, const at::Tensor& b_in,
                                                const at::Tensor& weight_in, double eps);
at::Tensor attention(const at::Tensor& heads_in, const at::Tensor& cos_in,
                     const at::Tensor& sin_in, at::Tensor cache_k, at::Tensor cache_v,
                     const at::Tensor& write_slot_in, const at::Tensor& write_pos_in,
                     const at::Tensor& slots_in, int64_t key_len,
                     const c10::optional<at::Tensor>& visible_in, int64_t hq);

namespace {

using OptionalTensors = c10::List<std::optional<at::Tensor>>;
constexpr int64_t kInt8Amx = 1, kPackedOneDnn = 2, kBf16Amx = 3;

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
}

struct Linears {
  const std::vector<at::Tensor>& weights;
  const OptionalTensors& scales;
  const OptionalTensors& biases;
  const std::vector<int64_t>& kinds;
  const std::vector<int64_t>& outs;
  const std::vector<int64_t>& rows;

  // x [..., in] -> [..., out], as specinfer.linears.Linear calls its kernel.
  at::Tensor operator()(int64_t l, const at::Tensor& x) const {
    const int64_t in = x.size(-1), n = x.numel() / in;
    const auto flat = x.reshape({n, in});
    const std::optional<at::Tensor> bias = biases.get(l);
    at::Tensor y;
    if (kinds[l] == kInt8Amx) {
      RECORD_FUNCTION("specinfer::int8_amx_linear", c10::ArrayRef<c10::IValue>{});
      y = amx_linear(flat, weights[l], *scales.get(l), outs[l], false);
      if (bias.has_value()) y = y + *bias;
    } else if (kinds[l] == kBf16Amx) {
      RECORD_FUNCTION("specinfer::bf16_amx_linear", c10::ArrayRef<c10::IValue>{});
      y = bf16_amx_linear(flat, weights[l], bias, outs[l], false);
    } else if (rows[l] == 0 || n <= rows[l]) {
      y = onednn_linear(flat, weights[l], bias);
    } else {  // at most rows[l] rows a call (specinfer.linears.bfloat16_plan)
      std::vector<at::Tensor> pieces;
      for (const auto& piece : flat.split(rows[l])) pieces.push_back(onednn_linear(piece, weights[l], bias));
      y = at::cat(pieces);
    }
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = y.size(-1);
    return y.view(shape);
  }
};

// Named for the profiler (bench.step_profile), as the operators are when Python calls them.
at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("specinfer::rms_norm", c10::ArrayRef<c10::IValue>{});
  return rms_norm(x, weight, eps);
}

// (hidden + delta, its norm): torch's bfloat16 add and the norm above, in one call.
std::tuple<at::Tensor, at::Tensor> add_norm(const at::Tensor& hidden, const at::Tensor& delta,
                                            const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("specinfer::add_rms_norm", c10::ArrayRef<c10::IValue>{});
  return add_rms_norm(hidden, delta, weight, eps);
}

}  // namespace

at::Tensor decoder_layers(at::Tensor hidden, const std::vector<at::Tensor>& weights,
                          const OptionalTensors& scales, const OptionalTensors& biases,
                          const std::vector<int64_t>& kinds, const std::vector<int64_t>& outs,
                          const std::vector<int64_t>& rows, const std::vector<at::Tensor>& norms,
                          double eps, const std::vector<at::Tensor>& cos,
                          const std::vector<at::Tensor>& sin,
                          const std::vector<at::Tensor>& write_slot,
                          const std::vector<at::Tensor>& write_pos,
                          const std::vector<at::Tensor>& slots,
                          const std::vector<int64_t>& key_lens,
                          const std::vector<int64_t>& part_b, const std::vector<int64_t>& part_q,
                          const OptionalTensors& packed, const OptionalTensors& masks,
                          at::Tensor cache_k, at::Tensor cache_v, int64_t hq, int64_t head_dim) {
  const int64_t layers = int64_t(norms.size()) / 2, parts = int64_t(cos.size());
  TORCH_CHECK(int64_t(weights.size()) == 4 * layers && int64_t(scales.size()) == 4 * layers &&
                  int64_t(biases.size()) == 4 * layers && int64_t(kinds.size()) == 4 * layers &&
                  int64_t(outs.size()) == 4 * layers && int64_t(rows.size()) == 4 * layers,
              "four linears a layer");
  TORCH_CHECK(parts >= 1 && int64_t(sin.size()) == parts && int64_t(write_slot.size()) == parts &&
                  int64_t(write_pos.size()) == parts && int64_t(slots.size()) == parts &&
                  int64_t(key_lens.size()) == parts && int64_t(part_b.size()) == parts &&
                  int64_t(part_q.size()) == parts && int64_t(packed.size()) == parts &&
                  int64_t(masks.size()) == parts * layers,
              "every part's tables");
  TORCH_CHECK(cache_k.size(0) == layers && cache_v.size(0) == layers, "a cache per layer");
  for (int64_t l = 0; l < 4 * layers; ++l)
    TORCH_CHECK(kinds[l] == kInt8Amx ? scales.get(l).has_value()
                                     : kinds[l] == kPackedOneDnn || kinds[l] == kBf16Amx,
                "linear ", l, ": kind 1 (int8 AMX, with its scale), 2 (oneDNN) or 3 (bf16 AMX)");
  const Linears linear{weights, scales, biases, kinds, outs, rows};
  // Each part's queries in hidden (one part: all of them).
  std::vector<int64_t> bounds{0};
  for (int64_t p = 0; p < parts; ++p) {
    const auto& real = packed.get(p);
    bounds.push_back(bounds.back() + (real.has_value() ? real->size(0) : part_b[p] * part_q[p]));
  }
  if (layers == 0) return hidden;
  at::Tensor normed = norm(hidden, norms[0], eps);
  for (int64_t i = 0; i < layers; ++i) {
    const auto heads = linear(4 * i, normed);
    std::vector<at::Tensor> outs_of_parts;
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t b = part_b[p], q = part_q[p];
      at::Tensor part = parts == 1 ? heads : heads.slice(0, bounds[p], bounds[p + 1]);
      const auto& real = packed.get(p);
      if (real.has_value())  // padding's q, k and v are zero
        part = at::zeros({b * q, part.size(-1)}, part.options()).index_copy_(0, *real, part);
      RECORD_FUNCTION("specinfer::attention", c10::ArrayRef<c10::IValue>{});
      auto out = attention(part.view({b, q, -1, head_dim}), cos[p], sin[p], cache_k[i],
                           cache_v[i], write_slot[p], write_pos[p], slots[p], key_lens[p],
                           masks.get(p * layers + i), hq);
      if (real.has_value()) {
        out = out.reshape({b * q, -1}).index_select(0, *real);
      } else if (hidden.dim() == 2) {
        out = out.reshape({b * q, -1});
      }
      outs_of_parts.push_back(out);
    }
    const auto attended = parts == 1 ? outs_of_parts[0] : at::cat(outs_of_parts);
    std::tie(hidden, normed) =
        add_norm(hidden, linear(4 * i + 1, attended), norms[2 * i + 1], eps);
    const auto gate_up = linear(4 * i + 2, normed);
    at::Tensor gated;
    {
      RECORD_FUNCTION("specinfer::silu_mul", c10::ArrayRef<c10::IValue>{});
      gated = silu_mul(gate_up);
    }
    const auto delta = linear(4 * i + 3, gated);
    if (i + 1 < layers) {
      std::tie(hidden, normed) = add_norm(hidden, delta, norms[2 * i + 2], eps);
    } else {
      hidden = hidden + delta;
    }
  }
  return hidden;
}

TORCH_LIBRARY_FRAGMENT(specinfer, m) {
  m.def("decoder_layers(Tensor hidden, Tensor[] weights, Tensor?[] scales, Tensor?[] biases, "
        "int[] kinds, int[] outs, int[] rows, Tensor[] norms, float eps, Tensor[] cos, "
        "Tensor[] sin, Tensor[] write_slot, Tensor[] write_pos, Tensor[] slots, "
        "int[] key_lens, int[] part_b, int[] part_q, Tensor?[] packed, Tensor?[] masks, "
        "Tensor(a!) cache_k, Tensor(b!) cache_v, int hq, int head_dim) -> Tensor",
        &decoder_layers);
}
