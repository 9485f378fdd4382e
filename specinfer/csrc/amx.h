// What the AMX kernels share: the tile configuration (palette 1) and the target attribute.
#pragma once

#include <cstdint>

#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,amx-bf16")))

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
