// AVX-512 decode and encode of the compressed moments (8-bit / 4-bit codes), included by
// host_adamw.cpp inside its namespace after CodeTable (quant_codes.h). Every function handles the
// whole vectors of a block and returns how many elements it did; the caller's scalar loops do the
// rest. Results are the scalar code's bits: the same IEEE multiplies and divisions (no fused ops),
// a maximum that skips NaNs as std::max does, and exact code counts.

// (<immintrin.h> is included at the top of host_adamw.cpp, outside the namespace.)

// out[j] = map[c[j]] * s, the 256-entry map in 16 registers: 8 two-register permutes (the low 5 bits
// of the code) and a select by bits 5, 6 and 7 (faster than one 16-lane gather on the development
// machine's AMD EPYC: the whole 8-bit update 1.25x).
inline int64_t decode8_avx512(const float* map, const uint8_t* __restrict c, float s, float* __restrict out,
                              int64_t nb) {
  const __m512 vs = _mm512_set1_ps(s);
  __m512 m[16];
  for (int r = 0; r < 16; ++r) m[r] = _mm512_loadu_ps(map + 16 * r);
  int64_t j = 0;
  for (; j + 16 <= nb; j += 16) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j)));
    __m512 v[8];
    for (int q = 0; q < 8; ++q) v[q] = _mm512_permutex2var_ps(m[2 * q], idx, m[2 * q + 1]);
    const __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
    const __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
    for (int q = 0; q < 4; ++q) v[q] = _mm512_mask_blend_ps(b5, v[2 * q], v[2 * q + 1]);
    for (int q = 0; q < 2; ++q) v[q] = _mm512_mask_blend_ps(b6, v[2 * q], v[2 * q + 1]);
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_mask_blend_ps(b7, v[0], v[1]), vs));
  }
  return j;
}

// 4-bit: the 16-entry map is one register; 16 bytes hold 32 codes (element 2i in the low nibble of
// byte i), spread to one byte per code in element order, then looked up by a permute.
inline int64_t decode4_avx512(const float* map, const uint8_t* __restrict c, float s, float* __restrict out,
                              int64_t nb) {
  const __m512 vs = _mm512_set1_ps(s), table = _mm512_loadu_ps(map);
  const __m128i low = _mm_set1_epi8(0x0F);
  int64_t j = 0;
  for (; j + 32 <= nb; j += 32) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + (j >> 1)));
    const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    const __m512i i0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
    const __m512i i1 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi));
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_permutexvar_ps(i0, table), vs));
    _mm512_storeu_ps(out + j + 16, _mm512_mul_ps(_mm512_permutexvar_ps(i1, table), vs));
  }
  return j;
}

// The block's absmax over [0, nb): max of |x| skipping NaNs (_mm512_max_ps returns its second
// operand when either is a NaN, so the running maximum stays put), exact in any order.
inline float absmax_avx512(const float* __restrict x, int64_t nb) {
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= nb; j += 16) acc = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + j)), acc);
  float lane[16];
  _mm512_storeu_ps(lane, acc);
  float a = 0.0f;
  for (; j < nb; ++j) a = std::max(a, std::fabs(x[j]));
  for (int l = 0; l < 16; ++l) a = std::max(a, lane[l]);
  return a;
}

// x / a (or 0 where a == 0, as the scalar encode writes) of 16 elements.
inline __m512 normed_avx512(const float* x, float a) {
  return a > 0.0f ? _mm512_div_ps(_mm512_loadu_ps(x), _mm512_set1_ps(a)) : _mm512_setzero_ps();
}

// One step of the 8-bit binary search: code (a multiple of 2s) gains s where mid[code + s - 1] <= x.
template <int K>
inline __m512i search_step(const float* lv, __m512i code, __m512 x) {
  constexpr int s = 128 >> K;
  const __m512i i = _mm512_srli_epi32(code, 8 - K);  // the candidate: code / 2s
  const float* r = lv + 16 * kLevelBase[K];
  __m512 m;
  if constexpr (K == 0) {
    m = _mm512_set1_ps(r[0]);  // one candidate: mid[127]
  } else if constexpr (K < 5) {
    m = _mm512_permutexvar_ps(i, _mm512_load_ps(r));
  } else {
    __m512 part[4];  // permutex2var reads the low 5 bits of i; bits 5 and 6 pick the pair
    for (int q = 0; q < (1 << (K - 5)); ++q)
      part[q] = _mm512_permutex2var_ps(_mm512_load_ps(r + 32 * q), i, _mm512_load_ps(r + 32 * q + 16));
    if constexpr (K >= 6) {
      const __mmask16 b5 = _mm512_test_epi32_mask(i, _mm512_set1_epi32(32));
      for (int q = 0; q < (1 << (K - 6)); ++q) part[q] = _mm512_mask_blend_ps(b5, part[2 * q], part[2 * q + 1]);
    }
    if constexpr (K == 7) {
      const __mmask16 b6 = _mm512_test_epi32_mask(i, _mm512_set1_epi32(64));
      part[0] = _mm512_mask_blend_ps(b6, part[0], part[1]);
    }
    m = part[0];
  }
  return _mm512_mask_or_epi32(code, _mm512_cmp_ps_mask(m, x, _CMP_LE_OQ), code, _mm512_set1_epi32(s));
}

// 8-bit codes of V vectors of 16 normed values: a branch-free binary search over the 255 midpoints
// (8 steps, candidates from registers: t.levels), V independent searches in flight (each is a chain
// of 8 dependent steps; 4 in flight: 1.08x over 2 on the development machine). The count of
// midpoints <= x, as find_code's; a NaN x gets 0 (every compare is false).
template <int V>
inline void codes8_avx512(const float* lv, const __m512* x, __m512i* c) {
  for (int v = 0; v < V; ++v) c[v] = _mm512_setzero_si512();
#define MEGATRAIN_STEP(K) for (int v = 0; v < V; ++v) c[v] = search_step<K>(lv, c[v], x[v]);
  MEGATRAIN_STEP(0) MEGATRAIN_STEP(1) MEGATRAIN_STEP(2) MEGATRAIN_STEP(3)
  MEGATRAIN_STEP(4) MEGATRAIN_STEP(5) MEGATRAIN_STEP(6) MEGATRAIN_STEP(7)
#undef MEGATRAIN_STEP
}

// 4-bit codes of 16 normed values: a branch-free binary search over the 15 midpoints held in one
// register (the count of midpoints <= x, a NaN x gets 0: every compare is false).
inline __m512i codes4_avx512(__m512 mid, __m512 x) {
  __m512i code = _mm512_setzero_si512();
  for (int step = 8; step; step >>= 1) {
    const __m512i cand = _mm512_add_epi32(code, _mm512_set1_epi32(step));
    const __m512 m = _mm512_permutexvar_ps(_mm512_sub_epi32(cand, _mm512_set1_epi32(1)), mid);
    code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(m, x, _CMP_LE_OQ), cand);
  }
  return code;
}

// encode_code's floor on 16 codes: at least t.floor where x > 0 (v's 8-bit map: code 0 is 0).
inline __m512i floored_avx512(const CodeTable& t, __m512i code, const float* x) {
  if (t.floor == 0) return code;
  const __mmask16 positive = _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_setzero_ps(), _CMP_GT_OQ);
  return _mm512_mask_max_epi32(code, positive, code, _mm512_set1_epi32(t.floor));
}

// Whether any of g[0, 16) * gs is 0 (an element without a gradient: encode_block's toward-zero rule).
inline bool any_zero_avx512(const float* g, float gs) {
  const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(g), _mm512_set1_ps(gs));
  return _mm512_cmp_ps_mask(scaled, _mm512_setzero_ps(), _CMP_EQ_OQ) != 0;
}

// The codes of x[0, nb) / a into c (whole vectors only; returns the count done; x is left as it
// is), as encode_code: nearest, floored. 8-bit: 64, then 16 per step; 4-bit: 32 per step, packed two
// to a byte, element 2i in the low nibble.
inline int64_t encode_avx512(const CodeTable& t, int bits, const float* __restrict x, int64_t nb, float a,
                             uint8_t* __restrict c) {
  int64_t j = 0;
  if (bits == 8) {
    __m512 q[4];
    __m512i code[4];
    for (; j + 64 <= nb; j += 64) {  // four searches in flight
      for (int v = 0; v < 4; ++v) q[v] = normed_avx512(x + j + 16 * v, a);
      codes8_avx512<4>(t.levels, q, code);
      for (int v = 0; v < 4; ++v)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(c + j + 16 * v),
                         _mm512_cvtepi32_epi8(floored_avx512(t, code[v], x + j + 16 * v)));
    }
    for (; j + 16 <= nb; j += 16) {
      q[0] = normed_avx512(x + j, a);
      codes8_avx512<1>(t.levels, q, code);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c + j), _mm512_cvtepi32_epi8(floored_avx512(t, code[0], x + j)));
    }
    return j;
  }
  const __m512 mid = _mm512_loadu_ps(t.mid);
  const __m128i low = _mm_set1_epi16(0x0F), high = _mm_set1_epi16(0xF0);
  for (; j + 32 <= nb; j += 32) {
    const __m128i b0 = _mm512_cvtepi32_epi8(floored_avx512(t, codes4_avx512(mid, normed_avx512(x + j, a)), x + j));
    const __m128i b1 =
        _mm512_cvtepi32_epi8(floored_avx512(t, codes4_avx512(mid, normed_avx512(x + j + 16, a)), x + j + 16));
    // 16-bit word i of b0 holds codes 2i and 2i + 1 in its two bytes: fold them into one byte
    const __m128i w0 = _mm_or_si128(_mm_and_si128(b0, low), _mm_and_si128(_mm_srli_epi16(b0, 4), high));
    const __m128i w1 = _mm_or_si128(_mm_and_si128(b1, low), _mm_and_si128(_mm_srli_epi16(b1, 4), high));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + (j >> 1)), _mm_packus_epi16(w0, w1));
  }
  return j;
}
