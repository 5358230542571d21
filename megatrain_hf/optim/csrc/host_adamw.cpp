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

// Branch-free so that the compiler vectorises it: multiplying by an exact 1.0f (no clipping, no
// weight decay) or -1.0f (maximize) gives the same bits as skipping the multiply.
template <bool kStage>
void update_range(const Tensor& t, int64_t begin, int64_t end, float scale) {
  float* __restrict p = t.param;
  const float* __restrict g_in = t.grad;
  float* __restrict m = t.exp_avg;
  float* __restrict v = t.exp_avg_sq;
  uint16_t* __restrict s = t.stage;
  const bool small_lerp = std::fabs(t.lerp) < 0.5f;
  const float coeff = small_lerp ? t.lerp : t.lerp - 1.0f;
  const float decay = t.decay, beta2 = t.beta2, sq_coef = t.sq_coef, bc2_sqrt = t.bc2_sqrt, eps = t.eps;
  const float neg_step_size = t.neg_step_size;
  for (int64_t i = begin; i < end; ++i) {
    const float g = g_in[i] * scale;  // clip_grad_norm_'s multiply (and maximize's sign)
    const float param = p[i] * decay;
    const float mo = m[i];
    const float mi = std::fma(coeff, g - mo, small_lerp ? mo : g);  // exp_avg.lerp_(grad, 1 - beta1)
    const float vi = std::fma(sq_coef * g, g, v[i] * beta2);  // as torch's build contracts it
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    const float out = param + neg_step_size * mi / denom;
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

}  // namespace

extern "C" {

// Update `n` tensors with up to `threads` threads. The concatenated element space is cut into
// chunks of kChunk elements that the threads take in turn from a shared counter, so a thread that
// shares its core with the training thread (or the driver's) does less, instead of holding every
// other thread up at the end as a static split would. Elements are independent: how the work is
// cut does not change any result. Returns 0, or -1 if a thread could not be started (the threads
// that did start, and the calling one, then do all the chunks).
int megatrain_adamw(int64_t n, float** params, const float** grads, float** exp_avgs, float** exp_avg_sqs,
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
  const int workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, chunks)));
  std::atomic<int64_t> next{0};
  auto run = [&]() {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      const int64_t lo = c * kChunk, hi = std::min(total, lo + kChunk);
      // the first tensor that ends after lo
      int64_t k = std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin() - 1;
      for (; k < n && starts[k] < hi; ++k) {
        const int64_t a = std::max(lo, starts[k]), b = std::min(hi, starts[k + 1]);
        if (a < b) update(ts[k], a - starts[k], b - starts[k], clip, maximize != 0);
      }
    }
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

}  // extern "C"
