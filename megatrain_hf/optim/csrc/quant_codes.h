// The code search of the compressed moments (8-bit / 4-bit), included by host_adamw.cpp inside its
// namespace (it uses from_bits).

#include <cmath>
#include <cstdint>
#include <cstring>

// A code is the count of midpoints <= x (sorted midpoints; a NaN x gets 0). The count is found from
// a table indexed by the top 16 bits of x (sign, exponent, 7 mantissa bits): the floats sharing
// them form one interval, and the table holds the count at its lowest value (0 for the intervals of
// infinities and NaNs), a lower bound of every count in it. Counting up from there with the
// midpoints themselves (mid[n - 1] is a NaN sentinel, never <= x) gives the exact count: at most one
// midpoint falls inside an interval of the 8-bit and 4-bit maps, so the loop after the first step
// is almost never entered.
// levels: the 8-bit map's midpoints as the vector path's binary search reads them (quant_avx512.h):
// step s = 128, 64, ..., 1 tests mid[c + s - 1] for c a multiple of 2s, candidate i = c / 2s at
// levels[16 * kLevel[s] + i] (16 floats per register; 1, 1, 1, 1, 1, 2, 4, 8 registers by step).
// floor: the lowest code a positive value takes (1 for v's 8-bit map, whose code 0 is the value 0:
// a positive v never expands to 0; else 0). map: the values, for the toward-zero rounding of m.
struct CodeTable {
  uint8_t start[1 << 16];
  float mid[256];
  float map[256];
  int floor;
  alignas(64) float levels[19 * 16];
};

constexpr int kLevelBase[8] = {0, 1, 2, 3, 4, 5, 7, 11};  // register of step 128 >> k

void build_levels(const float* mid, CodeTable& t) {
  std::memset(t.levels, 0, sizeof t.levels);
  for (int k = 0; k < 8; ++k) {
    const int s = 128 >> k;
    for (int i = 0; i < 128 / s; ++i) t.levels[16 * kLevelBase[k] + i] = mid[2 * s * i + s - 1];
  }
}

void build_table(const float* map, const float* mid, int n_codes, int floor, CodeTable& t) {
  std::memset(t.start, 0, sizeof t.start);
  for (int i = 0; i < n_codes; ++i) t.map[i] = map[i];
  t.floor = floor;
  for (int i = 0; i + 1 < n_codes; ++i) t.mid[i] = mid[i];
  t.mid[n_codes - 1] = std::nanf("");
  if (n_codes == 256) build_levels(mid, t);
  int c = 0;  // positive intervals (exponent < 255), lowest value key << 16, increasing with the key
  for (uint32_t key = 0; key < 0x7F80u; ++key) {
    const float lo = from_bits(key << 16);
    while (c + 1 < n_codes && mid[c] <= lo) ++c;
    t.start[key] = static_cast<uint8_t>(c);
  }
  c = 0;  // negative ones: lowest value (key << 16) | 0xFFFF, increasing as the key decreases
  for (uint32_t key = 0xFF7Fu; key >= 0x8000u; --key) {
    const float lo = from_bits((key << 16) | 0xFFFFu);
    while (c + 1 < n_codes && mid[c] <= lo) ++c;
    t.start[key] = static_cast<uint8_t>(c);
  }
}

inline int find_code(const CodeTable& t, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  int code = t.start[bits >> 16];
  code += t.mid[code] <= x;
  while (t.mid[code] <= x) ++code;
  return code;
}

// The code of value x (normed: x / absmax, or 0) by the encode rules: the nearest map value's, at
// least t.floor where x > 0.
inline int encode_code(const CodeTable& t, float x, float normed) {
  const int code = find_code(t, normed);
  return (code < t.floor && x > 0.0f) ? t.floor : code;
}

// m of an element without a gradient: the nearest map value not larger in magnitude than normed
// (the nearest one, or one code back toward zero; map values are sorted, 0 among them).
inline int toward_zero(const CodeTable& t, int code, float normed) {
  const float value = t.map[code];
  if (!(std::fabs(value) > std::fabs(normed))) return code;
  return value > 0.0f ? code - 1 : code + 1;
}
