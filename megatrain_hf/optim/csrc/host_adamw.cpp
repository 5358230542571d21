// One pass of AdamW over a unit's host flats: clip scale, update, and the bf16 staging copy.
//
// torch's fused CPU AdamW plus the engine's two extra passes (the exact-clipping multiply over
// the gradients and the fp32 -> bf16 staging refresh) read and write ~42 bytes per parameter;
// this kernel does the same arithmetic in one pass: read p, g, m, v (16 B), write p, m, v and
// the bf16 copy (14 B). The update is memory bound on the host, so bytes are time.
//
// Arithmetic follows torch's vectorised fp32 path (aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
// ADAMW mode) operation for operation, with the hyper-parameters rounded to float where it rounds
// them: the lerp of exp_avg is one fused multiply-add, and so is the exp_avg_sq update (the
// compiler contracts torch's `v * beta2 + (1 - beta2) * g * g` into fma((1 - beta2) * g, g,
// v * beta2); measured: that form matches torch 2.13's AVX-512 kernel bit for bit, the unfused one
// differs on ~6% of elements). Everything else is separate IEEE ops (-ffp-contract=off). torch's
// scalar tail (the last few elements of each of its parallel chunks) can differ by one rounding.
//
// Plain C ABI (called through ctypes): no torch headers, so it compiles in about a second.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
#include <atomic>

// The compressed update's decode and encode in AVX-512 (quant_avx512.h), unless built with
// -DMEGATRAIN_SCALAR (the tests compare both builds bit for bit).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(MEGATRAIN_SCALAR)
#define MEGATRAIN_AVX512 1
#include <immintrin.h>
#else
#define MEGATRAIN_AVX512 0
#endif

namespace {

struct Tensor {
  float* param;
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  uint16_t* stage;  // bf16 copy of param, or nullptr
  int64_t size;
  // per tensor (the step count, hence the bias corrections, is per parameter)
  float decay;         // 1 - lr * weight_decay (1 when weight_decay == 0)
  float lerp;          // 1 - beta1
  float beta2;
  float sq_coef;       // 1 - beta2
  float bc2_sqrt;      // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size; // -lr / (1 - beta1^step)
};

inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // nan
  bits += 0x7fffu + ((bits >> 16) & 1u);                  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

struct Hyper {  // one tensor's constants, as update_range derives them
  float coeff, decay, beta2, sq_coef, bc2_sqrt, eps, neg_step_size;
  bool small_lerp;
  explicit Hyper(const Tensor& t)
      : coeff(std::fabs(t.lerp) < 0.5f ? t.lerp : t.lerp - 1.0f), decay(t.decay), beta2(t.beta2),
        sq_coef(t.sq_coef), bc2_sqrt(t.bc2_sqrt), eps(t.eps), neg_step_size(t.neg_step_size),
        small_lerp(std::fabs(t.lerp) < 0.5f) {}
};

// One element of AdamW: torch's fused ADAMW arithmetic (see the top of the file). Returns the new
// parameter; `mi` / `vi` receive the new moments.
inline float adamw_element(const Hyper& h, float g, float p, float mo, float vo, float& mi, float& vi) {
  const float param = p * h.decay;
  mi = std::fma(h.coeff, g - mo, h.small_lerp ? mo : g);  // exp_avg.lerp_(grad, 1 - beta1)
  vi = std::fma(h.sq_coef * g, g, vo * h.beta2);  // as torch's build contracts it
  const float denom = std::sqrt(vi) / h.bc2_sqrt + h.eps;
  return param + h.neg_step_size * mi / denom;
}

// Branch-free so that the compiler vectorises it: multiplying by an exact 1.0f (no clipping, no
// weight decay) or -1.0f (maximize) gives the same bits as skipping the multiply.
template <bool kStage>
void update_range(const Tensor& t, int64_t begin, int64_t end, float scale) {
  float* __restrict p = t.param;
  const float* __restrict g_in = t.grad;
  float* __restrict m = t.exp_avg;
  float* __restrict v = t.exp_avg_sq;
  uint16_t* __restrict s = t.stage;
  const Hyper h(t);
  for (int64_t i = begin; i < end; ++i) {
    const float g = g_in[i] * scale;  // clip_grad_norm_'s multiply (and maximize's sign)
    float mi, vi;
    const float out = adamw_element(h, g, p[i], m[i], v[i], mi, vi);
    m[i] = mi;
    v[i] = vi;
    p[i] = out;
    if constexpr (kStage) s[i] = to_bf16(out);
  }
}

void update(const Tensor& t, int64_t begin, int64_t end, float clip, bool maximize) {
  const float scale = maximize ? clip * -1.0f : clip;
  if (t.stage) {
    update_range<true>(t, begin, end, scale);
  } else {
    update_range<false>(t, begin, end, scale);
  }
}

// Run body(0 .. count-1) on up to `threads` threads taking items from a shared counter. Returns 0,
// or -1 if a thread could not be started (the others, and the calling thread, do all the items).
template <typename F>
int run_parallel(int64_t count, int threads, F&& body) {
  const int workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, count)));
  std::atomic<int64_t> next{0};
  auto run = [&]() {
    for (int64_t c = next.fetch_add(1); c < count; c = next.fetch_add(1)) body(c);
  };
  std::vector<std::thread> pool;
  int status = 0;
  for (int w = 1; w < workers; ++w) {
    try {
      pool.emplace_back(run);
    } catch (...) {
      status = -1;
      break;
    }
  }
  run();
  for (auto& th : pool) th.join();
  return status;
}

// ------------------------------------------------------------------ compressed moments
// bits 16: m / v are bf16 arrays (round to nearest even after the update). bits 8 / 4: blockwise
// codes (4-bit: element 2i in the low nibble of byte i) with one fp32 absmax per block of `block`
// elements from the tensor's start; a code expands to map[code] * absmax, and the new value gets
// the code of the nearest map value of value / absmax: the count of midpoints <= it.
struct Format {
  int bits;
  int64_t block;
  int n_codes;
  const float* map[2];
  const float* mid[2];
};

struct QTensor {
  Tensor t;            // param, grad, stage, size and the hyper-parameters (exp_avg* unused)
  void* codes[2];
  float* scales[2];
};

inline float from_bits(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

inline float bf16_to_float(uint16_t b) { return from_bits(static_cast<uint32_t>(b) << 16); }

#include "quant_codes.h"

#if MEGATRAIN_AVX512
#include "quant_avx512.h"
#endif

constexpr int64_t kMaxBlock = 4096;

// One block of moment values x into codes and its scale: absmax, x / absmax, codes (encode_code:
// the nearest map value's, at least t.floor for x > 0). The absmax skips NaNs and is exact in any
// order (max of a set), so it runs in lanes. With AVX-512 the whole vectors are done by
// encode_avx512 and the loops below finish the tail from j0. `g` (m only, else null): the block's
// gradients as the update used them (times `gs`); an element whose gradient is 0 takes the code of
// toward_zero instead, so that the m of a row absent from the batch shrinks every step.
void encode_block(const CodeTable& t, int bits, const float* __restrict x, int64_t nb, uint8_t* __restrict c,
                  float& scale, const float* __restrict g, float gs) {
  int64_t j = 0, j0 = 0;
  float xn[kMaxBlock];
#if MEGATRAIN_AVX512
  const float a = absmax_avx512(x, nb);
  j0 = encode_avx512(t, bits, x, nb, a, c);
#else
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (; j + 8 <= nb; j += 8)
    for (int l = 0; l < 8; ++l) lane[l] = std::max(lane[l], std::fabs(x[j + l]));
  float a = 0.0f;
  for (; j < nb; ++j) a = std::max(a, std::fabs(x[j]));
  for (int l = 0; l < 8; ++l) a = std::max(a, lane[l]);
#endif
  scale = a;
  if (a > 0.0f) {
    for (j = j0; j < nb; ++j) xn[j] = x[j] / a;
  } else {
    for (j = j0; j < nb; ++j) xn[j] = 0.0f;
  }
  if (bits == 8) {
    for (j = j0; j < nb; ++j) c[j] = static_cast<uint8_t>(encode_code(t, x[j], xn[j]));
  } else {
    for (j = j0; j + 1 < nb; j += 2)
      c[j >> 1] = static_cast<uint8_t>(encode_code(t, x[j], xn[j]) | (encode_code(t, x[j + 1], xn[j + 1]) << 4));
    if (j < nb) c[j >> 1] = static_cast<uint8_t>(encode_code(t, x[j], xn[j]));  // an odd tail: the high nibble stays 0
  }
  if (g == nullptr) return;
  for (j = 0; j < nb; ++j) {
#if MEGATRAIN_AVX512
    if ((j & 15) == 0 && j + 16 <= nb && !any_zero_avx512(g + j, gs)) {
      j += 15;  // no element without a gradient among these 16
      continue;
    }
#endif
    if (g[j] * gs != 0.0f) continue;
    const float normed = a > 0.0f ? x[j] / a : 0.0f;
    if (bits == 8) {
      c[j] = static_cast<uint8_t>(toward_zero(t, c[j], normed));
    } else {
      const int shift = (j & 1) * 4;
      const int code = toward_zero(t, (c[j >> 1] >> shift) & 0x0F, normed);
      c[j >> 1] = static_cast<uint8_t>((c[j >> 1] & ~(0x0F << shift)) | (code << shift));
    }
  }
}

// Elements [0, nb) of the block: decoded moments in m / v (in place: the new ones), AdamW over
// contiguous arrays so that the compiler vectorises it.
template <bool kStage>
void adamw_block(const Hyper& h, const float* __restrict g_in, float scale, float* __restrict p, float* __restrict m,
                 float* __restrict v, uint16_t* __restrict s, int64_t nb) {
  for (int64_t j = 0; j < nb; ++j) {
    float mi, vi;
    const float out = adamw_element(h, g_in[j] * scale, p[j], m[j], v[j], mi, vi);
    m[j] = mi;
    v[j] = vi;
    p[j] = out;
    if constexpr (kStage) s[j] = to_bf16(out);
  }
}

// Elements [begin, end) of one tensor; begin is a multiple of the block. Per block: decode both
// moments into fp32 arrays, AdamW, then encode (absmax, divide, codes).
void update_compressed(const QTensor& q, const Format& f, const CodeTable* tables, int64_t begin, int64_t end,
                       float scale) {
  const Tensor& t = q.t;
  const Hyper h(t);
  if (f.bits == 16) {
    uint16_t* __restrict m = static_cast<uint16_t*>(q.codes[0]);
    uint16_t* __restrict v = static_cast<uint16_t*>(q.codes[1]);
    for (int64_t i = begin; i < end; ++i) {
      float mi, vi;
      const float out = adamw_element(h, t.grad[i] * scale, t.param[i], bf16_to_float(m[i]), bf16_to_float(v[i]), mi, vi);
      m[i] = to_bf16(mi);
      v[i] = to_bf16(vi);
      t.param[i] = out;
      if (t.stage) t.stage[i] = to_bf16(out);
    }
    return;
  }
  float nm[kMaxBlock], nv[kMaxBlock];
  uint8_t* cm = static_cast<uint8_t*>(q.codes[0]);
  uint8_t* cv = static_cast<uint8_t*>(q.codes[1]);
  const float* map_m = f.map[0];
  const float* map_v = f.map[1];
  for (int64_t b0 = begin; b0 < end; b0 += f.block) {
    const int64_t nb = std::min(f.block, end - b0), blk = b0 / f.block;
    const float sm = q.scales[0][blk], sv = q.scales[1][blk];
    if (f.bits == 8) {
      const uint8_t* __restrict a = cm + b0;
      const uint8_t* __restrict b = cv + b0;
      int64_t j = 0;
#if MEGATRAIN_AVX512
      j = decode8_avx512(map_m, a, sm, nm, nb);
      decode8_avx512(map_v, b, sv, nv, nb);
#endif
      for (; j < nb; ++j) {
        nm[j] = map_m[a[j]] * sm;
        nv[j] = map_v[b[j]] * sv;
      }
    } else {
      const uint8_t* __restrict a = cm + (b0 >> 1);
      const uint8_t* __restrict b = cv + (b0 >> 1);
      int64_t j = 0;
#if MEGATRAIN_AVX512
      j = decode4_avx512(map_m, a, sm, nm, nb);
      decode4_avx512(map_v, b, sv, nv, nb);
#endif
      for (; j < nb; j += 2) {  // nm / nv have room for an odd block's extra element
        nm[j] = map_m[a[j >> 1] & 0x0F] * sm;
        nm[j + 1] = map_m[a[j >> 1] >> 4] * sm;
        nv[j] = map_v[b[j >> 1] & 0x0F] * sv;
        nv[j + 1] = map_v[b[j >> 1] >> 4] * sv;
      }
    }
    if (t.stage) {
      adamw_block<true>(h, t.grad + b0, scale, t.param + b0, nm, nv, t.stage + b0, nb);
    } else {
      adamw_block<false>(h, t.grad + b0, scale, t.param + b0, nm, nv, nullptr, nb);
    }
    const int64_t at = f.bits == 8 ? b0 : b0 >> 1;
    encode_block(tables[0], f.bits, nm, nb, cm + at, q.scales[0][blk], t.grad + b0, scale);
    encode_block(tables[1], f.bits, nv, nb, cv + at, q.scales[1][blk], nullptr, 0.0f);
  }
}

// bf16 gradients (MegaTrainConfig(grad_dtype="bf16")): a work item's range [a, b) of the gradient is
// widened to fp32 in the thread's scratch first (exact), and the update runs on a view of the
// tensor that starts at a. `a` is a multiple of the block for compressed moments.
inline const float* widen(const uint16_t* g16, int64_t a, int64_t b, std::vector<float>& scratch) {
  scratch.resize(static_cast<size_t>(b - a));
  for (int64_t i = a; i < b; ++i) scratch[i - a] = bf16_to_float(g16[i]);
  return scratch.data();
}

inline Tensor view_from(const Tensor& t, int64_t a, const float* grad) {
  Tensor v = t;
  v.param += a;
  v.grad = grad;
  if (v.exp_avg) v.exp_avg += a;
  if (v.exp_avg_sq) v.exp_avg_sq += a;
  if (v.stage) v.stage += a;
  v.size -= a;
  return v;
}

inline QTensor view_from(const QTensor& q, const Format& f, int64_t a, const float* grad) {
  QTensor v{view_from(q.t, a, grad), {q.codes[0], q.codes[1]}, {q.scales[0], q.scales[1]}};
  const int64_t code_bytes = f.bits == 16 ? 2 * a : f.bits == 8 ? a : a / 2;
  for (int k = 0; k < 2; ++k) {
    v.codes[k] = static_cast<uint8_t*>(q.codes[k]) + code_bytes;
    if (f.bits != 16) v.scales[k] = q.scales[k] + a / f.block;
  }
  return v;
}

}  // namespace

extern "C" {

// 1 if the compressed update's decode and encode run on AVX-512 (else the scalar loops only).
int megatrain_simd() {
#if MEGATRAIN_AVX512
  return 1;
#else
  return 0;
#endif
}

// Update `n` tensors with up to `threads` threads. The concatenated element space is cut into
// chunks of kChunk elements that the threads take in turn from a shared counter, so a thread that
// shares its core with the training thread (or the driver's) does less, instead of holding every
// other thread up at the end as a static split would. Elements are independent: how the work is
// cut does not change any result. Returns 0, or -1 if a thread could not be started (the threads
// that did start, and the calling one, then do all the chunks).
// grads16[k] (or null): tensor k's gradient is bf16 there (grads[k] is then unused).
int megatrain_adamw(int64_t n, float** params, const float** grads, const uint16_t** grads16, float** exp_avgs,
                    float** exp_avg_sqs,
                    uint16_t** stages, const int64_t* sizes, const float* decay, const float* lerp,
                    const float* beta2, const float* sq_coef, const float* bc2_sqrt, const float* eps,
                    const float* neg_step_size, float clip, int maximize, int threads) {
  std::vector<Tensor> ts(n);
  std::vector<int64_t> starts(n + 1, 0);  // where each tensor begins in the concatenated space
  for (int64_t k = 0; k < n; ++k) {
    ts[k] = Tensor{params[k], grads[k], exp_avgs[k], exp_avg_sqs[k], stages[k], sizes[k], decay[k],
                   lerp[k], beta2[k], sq_coef[k], bc2_sqrt[k], eps[k], neg_step_size[k]};
    starts[k + 1] = starts[k] + sizes[k];
  }
  const int64_t total = starts[n];
  if (total == 0) return 0;
  constexpr int64_t kChunk = 1 << 18;  // 1 MiB of each fp32 array: long streams, many chunks per thread
  const int64_t chunks = (total + kChunk - 1) / kChunk;
  return run_parallel(chunks, threads, [&](int64_t c) {
    thread_local std::vector<float> scratch;
    const int64_t lo = c * kChunk, hi = std::min(total, lo + kChunk);
    // the first tensor that ends after lo
    int64_t k = std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin() - 1;
    for (; k < n && starts[k] < hi; ++k) {
      const int64_t a = std::max(lo, starts[k]), b = std::min(hi, starts[k + 1]);
      if (a >= b) continue;
      if (grads16[k]) {
        const Tensor v = view_from(ts[k], a - starts[k], widen(grads16[k], a - starts[k], b - starts[k], scratch));
        update(v, 0, b - a, clip, maximize != 0);
      } else {
        update(ts[k], a - starts[k], b - starts[k], clip, maximize != 0);
      }
    }
  });
}

// The same update with compressed moments (see update_compressed): m_codes / v_codes point at each
// tensor's codes (bf16 arrays for bits 16), m_scales / v_scales at its block scales. Work items
// are chunks of whole blocks of one tensor. Returns as megatrain_adamw, or -2 for a bad format.
int megatrain_adamw_compressed(int64_t n, float** params, const float** grads, const uint16_t** grads16,
                               void** m_codes, float** m_scales,
                               void** v_codes, float** v_scales, uint16_t** stages, const int64_t* sizes,
                               const float* decay, const float* lerp, const float* beta2, const float* sq_coef,
                               const float* bc2_sqrt, const float* eps, const float* neg_step_size, int bits,
                               int64_t block, const float* m_map, const float* m_mid, const float* v_map,
                               const float* v_mid, float clip, int maximize, int threads) {
  if (bits != 16 && bits != 8 && bits != 4) return -2;
  if (bits != 16 && (block <= 0 || block > kMaxBlock || block % 2)) return -2;
  const Format f{bits, bits == 16 ? int64_t{1} << 18 : block, bits == 4 ? 16 : 256, {m_map, v_map}, {m_mid, v_mid}};
  std::vector<QTensor> qs(n);
  struct Item { int64_t k, begin, end; };
  std::vector<Item> items;
  const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 18) / f.block) * f.block;  // whole blocks
  for (int64_t k = 0; k < n; ++k) {
    qs[k] = QTensor{Tensor{params[k], grads[k], nullptr, nullptr, stages[k], sizes[k], decay[k], lerp[k], beta2[k],
                           sq_coef[k], bc2_sqrt[k], eps[k], neg_step_size[k]},
                    {m_codes[k], v_codes[k]}, {m_scales[k], v_scales[k]}};
    for (int64_t lo = 0; lo < sizes[k]; lo += chunk) items.push_back(Item{k, lo, std::min(sizes[k], lo + chunk)});
  }
  const float scale = maximize ? clip * -1.0f : clip;
  std::vector<CodeTable> tables(bits == 16 ? 0 : 2);
  for (size_t k = 0; k < tables.size(); ++k)  // v's floor: 1 where its map's code 0 is the value 0
    build_table(f.map[k], f.mid[k], f.n_codes, k == 1 && f.map[1][0] == 0.0f ? 1 : 0, tables[k]);
  return run_parallel(static_cast<int64_t>(items.size()), threads, [&](int64_t c) {
    thread_local std::vector<float> scratch;
    const Item& it = items[c];
    if (grads16[it.k]) {
      const float* g = widen(grads16[it.k], it.begin, it.end, scratch);
      update_compressed(view_from(qs[it.k], f, it.begin, g), f, tables.data(), 0, it.end - it.begin, scale);
    } else {
      update_compressed(qs[it.k], f, tables.data(), it.begin, it.end, scale);
    }
  });
}

}  // extern "C"
