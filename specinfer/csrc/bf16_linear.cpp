// bfloat16 linears on AMX (TDPBF16PS) whose rows are batch-invariant: the hardware computes
// each output element from its row of x, its column of the weight and the k order alone, and
// this kernel's k order (tile after tile, 32 k a tile) does not change with the number of
// rows, so a row gets the same bits alone or with others (specinfer/bfloat16.py probes that
// before use). The weight streams from memory into the tiles once per call, and for up to 16
// rows a call costs about what one row does: oneDNN's kernels, which change their blocking
// with the row count, are what the bfloat16 format otherwise uses.
//
//   x      [M, K] bfloat16
//   packed [ceil(N/16), ceil(K/32), 16, 16, 2] bfloat16: B tiles, row p of tile (b, t)
//          holding the pairs k = 32t + 2p, 32t + 2p + 1 of the 16 columns of block b
//   bias   None or [N] float32, added in float32 before the output's rounding
// returns  [M, N] bfloat16, or float32 (float_out: the sums unrounded, e.g. for logits).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx.h"

namespace {

using amx::kBlocks;
using amx::kTile;
using amx::kTileBytes;
constexpr int64_t kTileK = 32;  // bfloat16 k per tile row

// Weight blocks [b0, b1) on one thread: for three blocks at a time and each 16-row tile of
// x, tmm0-2 the blocks' float32 sums, tmm3 x's rows, tmm4-6 the blocks' weight tiles.
template <typename Out>
AMX_AVX512_TARGET void bf16_pass(const at::BFloat16* x, int64_t M, int64_t stride,
                                 int64_t k_tiles, const at::BFloat16* packed, const float* bias,
                                 int64_t N, Out* y, int64_t b0, int64_t b1, float* sums) {
  const int64_t block_bytes = k_tiles * kTileBytes;
  const char* weights = reinterpret_cast<const char*>(packed);
  int64_t configured = -1;
  for (int64_t g = b0; g < b1; g += kBlocks) {
    const int64_t nb = std::min<int64_t>(kBlocks, b1 - g);
    const char* block = weights + g * block_bytes;
    for (int64_t r0 = 0; r0 < M; r0 += kTile) {
      const int64_t rows = std::min<int64_t>(kTile, M - r0);
      amx::configure(rows, configured);
      amx::accumulate<true>(reinterpret_cast<const char*>(x + r0 * stride), stride * 2, block,
                            block_bytes, nb, k_tiles, r0 == 0);
      _tile_stored(0, sums, 64);
      if (nb > 1) _tile_stored(1, sums + kTile * kTile, 64);
      if (nb > 2) _tile_stored(2, sums + 2 * kTile * kTile, 64);
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t n0 = (g + j) * kTile;
        const __mmask16 cols = vector_math::lanes(N - n0);
        const __m512 b = bias == nullptr ? _mm512_setzero_ps()
                                         : _mm512_maskz_loadu_ps(cols, bias + n0);
        for (int64_t r = 0; r < rows; ++r) {
          __m512 v = _mm512_loadu_ps(sums + (j * kTile + r) * kTile);
          if (bias != nullptr) v = _mm512_add_ps(v, b);  // float32, before the rounding
          vector_math::store16(v, cols, y + (r0 + r) * N + n0);
        }
      }
    }
  }
  _tile_release();
}

}  // namespace

at::Tensor bf16_amx_linear(const at::Tensor& x_in, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias_in, int64_t N,
                           bool float_out) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x: [rows, in] bfloat16");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.size(0) * kTile >= N,
              "packed: bfloat16 B tiles");
  const int64_t M = x_in.size(0), K = x_in.size(1), k_tiles = packed.size(1);
  TORCH_CHECK(K <= k_tiles * kTileK, "x and packed disagree");
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.numel() == N, "bias: [out]");
  }
  // x's rows as AMX reads them: contiguous, zero-padded to whole tiles of k
  const auto x = K == k_tiles * kTileK
      ? x_in.contiguous()
      : at::constant_pad_nd(x_in, {0, k_tiles * kTileK - K}).contiguous();
  auto y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* pp = packed.data_ptr<at::BFloat16>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int64_t stride = x.size(1);
  at::parallel_for(0, packed.size(0), 2 * kBlocks, [&](int64_t b0, int64_t b1) {
    std::vector<float> sums(kBlocks * kTile * kTile);
    if (float_out) {
      bf16_pass(xp, M, stride, k_tiles, pp, bp, N, y.data_ptr<float>(), b0, b1, sums.data());
    } else {
      bf16_pass(xp, M, stride, k_tiles, pp, bp, N, y.data_ptr<at::BFloat16>(), b0, b1,
                sums.data());
    }
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(specinfer, m) {
  m.def("bf16_amx_linear(Tensor x, Tensor packed, Tensor? bias, int n, bool float_out=False) "
        "-> Tensor",
        &bf16_amx_linear);
}
