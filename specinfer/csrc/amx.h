// What the AMX kernels share (int8_linear.cpp, bf16_linear.cpp): the tile configuration and
// the pass that streams up to three 16-column weight blocks against one tile of x's rows.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "vector_math.h"

#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,amx-bf16")))
#define AMX_AVX512_TARGET \
  __attribute__((target("amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl")))

namespace amx {

constexpr int64_t kTile = 16;          // rows of a tile; columns of a weight block
constexpr int64_t kTileBytes = 1024;   // a weight tile: 16 rows of 64 bytes
constexpr int64_t kBlocks = 3;         // weight blocks a pass runs side by side

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The layout of accumulate: tmm0-2 (the sums) and tmm3 (x's rows) with just `rows` rows (a
// tile load costs about a cycle per row here), tmm4-6 (weight tiles) with 16; loaded only
// when `rows` changes (`configured`: the rows last configured, -1 at first).
AMX_TARGET inline void configure(int64_t rows, int64_t& configured) {
  if (rows == configured) return;
  TileConfig config;
  for (int t = 0; t < 7; ++t) {
    config.rows[t] = t >= 4 ? kTile : rows;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
  configured = rows;
}

// tmm sum += tmm x . tmm w (GCC's tile intrinsics paste their register numbers into the
// assembly text, so they must be literals: a macro, not a template)
#define AMX_PRODUCT(sum, x, w)                       \
  do {                                               \
    if constexpr (kBf16) _tile_dpbf16ps(sum, x, w);  \
    else _tile_dpbssd(sum, x, w);                    \
  } while (0)

// tmm0..nb-1 = x's tile (64 bytes of k a tile, rows `stride` bytes apart) times weight
// blocks block, block + block_bytes, ... (k_tiles tiles each), k tile after tile: int8
// digits by TDPBSSD (int32 sums) or bfloat16 by TDPBF16PS (float32 sums). `streaming`:
// the weights come from memory (the first row tile): prefetch two tiles ahead (+10%).
template <bool kBf16>
AMX_TARGET inline void accumulate(const char* x, int64_t stride, const char* block,
                                  int64_t block_bytes, int64_t nb, int64_t k_tiles,
                                  bool streaming) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t k = 0; k < k_tiles; ++k) {
    if (streaming) {
      for (int64_t j = 0; j < nb; ++j) {
        const char* ahead = block + j * block_bytes + (k + 2) * kTileBytes;
        for (int line = 0; line < kTileBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      }
    }
    _tile_loadd(3, x + k * 64, stride);
    _tile_loadd(4, block + k * kTileBytes, 64);
    AMX_PRODUCT(0, 3, 4);
    if (nb > 1) {
      _tile_loadd(5, block + block_bytes + k * kTileBytes, 64);
      AMX_PRODUCT(1, 3, 5);
    }
    if (nb > 2) {
      _tile_loadd(6, block + 2 * block_bytes + k * kTileBytes, 64);
      AMX_PRODUCT(2, 3, 6);
    }
  }
}

}  // namespace amx
