// CPU kernels behind XLA FFI custom calls (built and registered by cpu.py).
//
// 1. XlaserveGemmF32 / XlaserveGemmI8 / XlaserveGemmBF16: y[M, N] = x[M, K] @ w[layer] for
// float32, weight-only int8 (per-column scale) and bfloat16 weights; x is float32 (bfloat16 for
// bfloat16 weights, which use a pair layout of their own: see micro_pairs), y float32.
// Why: at decode M (rows in the batch) is 1..64 while the weights are megabytes, so the matmul
// is a stream over the weights. XLA:CPU's dot repacks the weight operand on every call and
// reached 10-20 GB/s at these shapes. Here the weights were packed once, at load, into
// 64-column panels [L, P, K, 64] (one panel = one contiguous stream), each panel is read once
// per K chunk while up to 6 rows x 64 columns of accumulators stay in registers, and the stacked
// [L, ...] weight comes whole with a layer index, so a layer scan passes its loop-invariant
// weights without XLA materialising a per-layer slice. Panels are claimed from an atomic counter
// by the calling thread and by tasks on XLA's own intra-op pool (parallel_for).
// Whether this beats XLA's dot depends on the host: jax_engine/kernels/choose.py times both.
// Build note: load16 / store16 must stay plain vector accesses (see there); with memcpy, an
// Intel-tuned build (-march=native on Ice Lake) kept the accumulators on the stack and ran 3-4.5x
// slower (reproduced on Zen 4 with -march=icelake-server: M=16 2.45 vs 0.55 ms, M=512 75 vs 23 ms
// for 768 x 2048). AVX2-only builds still spill: v16 is two ymm there and 6 x 4 accumulators need
// 48 of the 16 registers (a 2-3 row tile would fit; not done, choose.py keeps XLA there if slower).
//
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
#include <algorithm>
#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdlib>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)   // x86 only: CPUID and the tile-state request
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlaserve_cpu {

// Helper threads of our own for parallel_for's small calls (see kOwnRows), one fewer than XLA's
// intra-op pool has (one worker per core with the calling thread). After a task each waits
// kHelperSpin (yielding its core) before it sleeps, so the next call of a program (a layer's
// next matrix, a few microseconds of XLA work later) finds it awake. Why: XLA's pool threads
// park between tasks, and a helper scheduled there started tens of microseconds into a call
// that lasts 50-250 us at decode sizes, while the caller did the work alone. Only one call at a
// time holds the helpers; a call made while another program's call holds them uses XLA's pool.
struct HelperTask {
  virtual ~HelperTask() = default;
  virtual void work() = 0;
};

class Helpers {
 public:
  static constexpr std::chrono::microseconds kHelperSpin{50};

  // One set per process: both objects of the build (XLASERVE_PART) share it, since this is an
  // inline function with external linkage; its threads live as long as the process.
  static Helpers& get(int64_t n) {
    static Helpers* h = new Helpers(n);
    return *h;
  }
  // Hands `task` to the helpers; false when another call holds them.
  bool offer(std::shared_ptr<HelperTask> task) {
    bool idle = false;
    if (n_ == 0 || !busy_.compare_exchange_strong(idle, true)) return false;
    {
      std::lock_guard<std::mutex> g(slot_mu_);
      slot_ = std::move(task);
    }
    epoch_.fetch_add(1);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> g(sleep_mu_);
      wake_.notify_all();
    }
    return true;
  }
  void release() {
    {
      std::lock_guard<std::mutex> g(slot_mu_);
      slot_.reset();
    }
    busy_.store(false);
  }

 private:
  explicit Helpers(int64_t n) : n_(n) {
    for (int64_t i = 0; i < n; ++i) std::thread([this] { loop(); }).detach();
  }
  void loop() {
    uint64_t seen = epoch_.load();
    for (;;) {
      auto since = std::chrono::steady_clock::now();
      uint64_t e;
      for (int spins = 1; (e = epoch_.load(std::memory_order_acquire)) == seen; ++spins) {
        std::this_thread::yield();      // the core goes to any other runnable thread (XLA's pool)
        if (spins % 16 == 0 && std::chrono::steady_clock::now() - since > kHelperSpin) {
          std::unique_lock<std::mutex> lk(sleep_mu_);
          sleepers_.fetch_add(1);
          wake_.wait(lk, [&] { return epoch_.load() != seen; });
          sleepers_.fetch_sub(1);
          since = std::chrono::steady_clock::now();
        }
      }
      seen = e;
      std::shared_ptr<HelperTask> task;
      {
        std::lock_guard<std::mutex> g(slot_mu_);
        task = slot_;
      }
      if (task) task->work();
    }
  }

  const int64_t n_;
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> sleepers_{0};
  std::mutex slot_mu_, sleep_mu_;
  std::condition_variable wake_;
  std::shared_ptr<HelperTask> slot_;
};

}  // namespace xlaserve_cpu


namespace {

using Panels = ffi::Buffer<ffi::F32, 4>;   // [L, P, K, 64]
using PanelsI8 = ffi::Buffer<ffi::S8, 4>;
using Scales = ffi::Buffer<ffi::F32, 2>;   // [L, 64 P]
using PanelsBF16 = ffi::Buffer<ffi::BF16, 4>;
using Rank4 = ffi::Buffer<ffi::F32, 4>;
using I32x2 = ffi::Buffer<ffi::S32, 2>;
using I32x1 = ffi::Buffer<ffi::S32, 1>;
using I32x0 = ffi::Buffer<ffi::S32, 0>;
using Out4 = ffi::ResultBuffer<ffi::F32, 4>;

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));   // unaligned, aliases float
typedef int v16i __attribute__((vector_size(64)));

// Plain vector loads and stores, not memcpy: with Intel tuning (-march=native on Skylake-X / Ice
// Lake / Sapphire Rapids is prefer-vector-width=256) GCC 12 expands a 64-byte memcpy into two
// 32-byte moves through a stack temporary, which also pushed every accumulator of `micro` onto the
// stack (an FMA, a load and a store per update, latency-bound): that host ran the kernel 2.5-3x
// slower than XLA's dot at every M. These compile to one vmovups whatever the tuning.
inline v16 load16(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store16(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }

// loadu<V> / storeu<V>: unaligned moves of the float vector V (v16 here, v8 on AVX2-only builds)
// for code written once over both. Why not a cast to an unaligned typedef passed as a template
// argument: a template argument drops the typedef's aligned(4), so the cast compiled to aligned
// moves (vmovaps), which faulted on a 16-byte-aligned buffer (the AVX2 encoder attention's
// output rows); and not memcpy, which Intel tuning splits (above).
template <typename V>
inline V loadu(const float* p);
template <typename V>
inline void storeu(float* p, V v);
template <>
inline v16 loadu<v16>(const float* p) { return load16(p); }
template <>
inline void storeu<v16>(float* p, v16 v) { store16(p, v); }

// 16 weights as floats: float32 as stored; int8 widened (the per-column scale is applied once,
// after the K loop, so int8 costs a convert per weight and a quarter of the memory traffic)
inline v16 load_w(const float* p) { return load16(p); }
inline v16 load_w(const int8_t* p) {
#ifdef __AVX512F__
  return reinterpret_cast<v16>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  union { __m256 h[2]; v16 v; } u;
  u.h[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  u.h[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  return u.v;
#else
  v16 v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

constexpr int kTile = 64;   // columns per tile: 4 vectors of 16 floats
constexpr int kVec = kTile / 16;

// Asks for one weight row of Elems elements (a panel row: 64 columns, or one K pair's) into L2
// ahead of its use; nothing for a null row. Prefetch is a hint: an address past the panel is
// harmless. The line count is a compile-time constant on purpose: with a run-time bound the loop
// sat inside the micro-kernel's K loop and the prefetch gain was gone (float32 chain, M = 32:
// 39.5 ms against 33.0-33.6 with this form; M = 4 21.9 against 16.7).
template <int64_t Elems, typename W>
__attribute__((always_inline)) inline void prefetch_row(const W* row) {
  if (row == nullptr) return;
  constexpr int64_t kLines = Elems * int64_t(sizeof(W)) / 64;
  for (int64_t l = 0; l < kLines; ++l) __builtin_prefetch(row + l * int64_t(64 / sizeof(W)), 0, 2);
}

// A micro-kernel's prefetch at K step k (see micro): pf_step 0, the row of the panel's next chunk
// (the burst form); otherwise PfLines cache lines from pf + k pf_step (do_panel's spread form);
// nothing for a null pf.
template <int PfLines, typename W>
__attribute__((always_inline)) inline void prefetch_step(const W* pf, int64_t pf_step, int64_t k) {
  if (pf_step == 0) {
    prefetch_row<kTile>(pf ? pf + k * kTile : pf);
  } else if (pf != nullptr) {
    for (int l = 0; l < PfLines; ++l) __builtin_prefetch(pf + k * pf_step + l * int64_t(64 / sizeof(W)), 0, 2);
  }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
inline v8 load_w8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
template <>
inline v8 loadu<v8>(const float* p) { return load_w8(p); }
template <>
inline void storeu<v8>(float* p, v8 v) { *reinterpret_cast<v8u*>(p) = v; }
inline v8 load_w8(const int8_t* p) {
  return reinterpret_cast<v8>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
}

// micro() for 2..6 rows on AVX2 (16 ymm registers): the 64-column tile as 4 passes of 16 columns,
// MR x 2 accumulators + 2 weight vectors + a broadcast (<= 15 registers). The 64-column form
// needs MR x 8 accumulators, which GCC spilled to the stack (a load and a store beside each FMA).
// The chunk's later passes read it from L1 (kKcF32 rows fill at most 3/4 of it); the first
// pass issues the prefetches. 768 x 2048 x 12 layers, ms a layer, 2-vCPU Zen 3 (AVX2, no
// AVX-512), alternating builds, generic 64-column form -> these (with micro_pairs_avx2 and the
// AVX2 micro_a8; int8 at one row through these passes then, micro1_avx2 now): float32 M = 16
// 9.4-11.4 -> 0.69-0.72 (XLA's dot 0.87-1.03), M = 128 74-77 -> 2.5-3.3 (XLA 3.0-5.3); int8
// M = 1 1.2-1.6 -> 0.10, M = 16 8.8-9.2 -> 0.75-0.78, M = 128 63-70 -> 2.8-3.2; w8a8 M = 1
// 0.17-0.24 -> 0.09-0.10, M = 16 2.3-2.4 -> 0.46-0.55, M = 128 16.4-17.0 -> 3.0-3.4; bfloat16
// M = 16 5.0-6.3 -> 0.93-1.07, M = 128 40 -> 6.6-8.4. One row: micro1_avx2 (below).
template <int MR, typename W, int PfLines>
inline void micro_avx2(const float* const (&xr)[MR], const W* panel, float* y, int64_t ldy, int64_t m0,
                       int64_t kn, bool first, const W* pf, int64_t pf_step) {
  for (int q = 0; q < kVec; ++q) {
    v8 acc[MR][2];
    for (int m = 0; m < MR; ++m)
      for (int h = 0; h < 2; ++h)
        acc[m][h] = first ? v8{} : *reinterpret_cast<const v8u*>(y + (m0 + m) * ldy + 16 * q + 8 * h);
    for (int64_t k = 0; k < kn; ++k) {
      if (q == 0) prefetch_step<PfLines>(pf, pf_step, k);
      const W* row = panel + k * kTile + 16 * q;
      const v8 w0 = load_w8(row), w1 = load_w8(row + 8);
      for (int m = 0; m < MR; ++m) {
        const float xv = xr[m][k];
        acc[m][0] += w0 * xv;
        acc[m][1] += w1 * xv;
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int h = 0; h < 2; ++h) *reinterpret_cast<v8u*>(y + (m0 + m) * ldy + 16 * q + 8 * h) = acc[m][h];
  }
}

// micro() for one row on AVX2: the 64-column weight row as 8 ymm accumulators, one broadcast of
// x a K step (the batch-1 decode path). Float32: GCC lowers the generic loop's 64-byte vectors on
// an AVX2-only target through the stack (x's broadcast built by 16 scalar stores, accumulators
// shuffled through memory each step): it streamed the weights at ~7 GB/s where a plain read loop
// reaches ~14. Int8: micro_avx2's 16-column passes carry 2 accumulators each, so one row waited
// on the FMA latency (4 passes x ~5 cycles a 64-byte row). 768 x 2048, single thread, ms a layer,
// medians of 9, 2-vCPU Zen 3 with a test run on the other core: float32 (12 layers) generic
// 0.85-1.02 -> 0.45 (0.37-0.40 with the weights on 2 MiB pages); int8 (48 layers) passes
// 0.20-0.26 -> 0.15-0.17.
template <typename W, int PfLines>
inline void micro1_avx2(const float* x, const W* panel, float* y, int64_t kn, bool first, const W* pf,
                        int64_t pf_step) {
  __m256 acc[8];
  for (int v = 0; v < 8; ++v) acc[v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + 8 * v);
  for (int64_t k = 0; k < kn; ++k) {
    prefetch_step<PfLines>(pf, pf_step, k);
    const W* row = panel + k * kTile;
    const __m256 xv = _mm256_broadcast_ss(x + k);
    for (int v = 0; v < 8; ++v) acc[v] = _mm256_fmadd_ps(reinterpret_cast<__m256>(load_w8(row + 8 * v)), xv, acc[v]);
  }
  for (int v = 0; v < 8; ++v) _mm256_storeu_ps(y + 8 * v, acc[v]);
}
#endif

// y[m0:m0+MR, tile] (+)= x[m0:m0+MR, 0:kn] @ panel[0:kn, :] (the panel: 64 columns, row-major;
// x rows have stride K). `first` starts from zero instead of accumulating into y.
// pf (or null): what to prefetch into L2 as this chunk is read. pf_step 0: the same rows of the
// panel's next K chunk (row k's 64 weights at step k); otherwise PfLines cache lines from
// pf + k pf_step at step k (do_panel's spread form).
template <int MR, typename W = float, int PfLines = 2>
inline void micro(const float* x, const W* panel, float* y, int64_t K, int64_t ldy, int64_t m0,
                  int64_t kn, bool first, const W* pf = nullptr, int64_t pf_step = 0) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (MR >= 2) {
    const float* rows[MR];
    for (int m = 0; m < MR; ++m) rows[m] = x + (m0 + m) * K;
    micro_avx2<MR, W, PfLines>(rows, panel, y, ldy, m0, kn, first, pf, pf_step);
    return;
  } else {
    micro1_avx2<W, PfLines>(x + m0 * K, panel, y + m0 * ldy, kn, first, pf, pf_step);
    return;
  }
#endif
  v16 acc[MR][kVec];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVec; ++v) acc[m][v] = first ? v16{} : load16(y + (m0 + m) * ldy + 16 * v);
  const float* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = x + (m0 + m) * K;
  for (int64_t k = 0; k < kn; ++k) {
    const W* row = panel + k * kTile;
    prefetch_step<PfLines>(pf, pf_step, k);
    v16 wv[kVec];
    for (int v = 0; v < kVec; ++v) wv[v] = load_w(row + 16 * v);
    for (int m = 0; m < MR; ++m) {
      const float xv = xr[m][k];
      for (int v = 0; v < kVec; ++v) acc[m][v] += wv[v] * xv;
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVec; ++v) store16(y + (m0 + m) * ldy + 16 * v, acc[m][v]);
}

#ifdef __AVX512F__
// micro<6, float>, the large-M (prefill, encoder) hot loop, written out: 24 named accumulators
// and the prefetch form chosen outside the K loop. GCC 12 compiled the generic template's loop
// (accumulators in an array, the form tested per step) with two tests and branches per step and
// four of the accumulators through vfmadd132ps plus a register move each step, beside the 24 FMAs
// on the two vector ports. Single thread, [M, K] x one 64-column panel, GFLOP/s, medians of 8
// alternating runs, 2-vCPU AMX Xeon (peak 203): M=384 K=384 145 -> 164, M=96 K=1536 142 -> 151,
// M=60 K=128 158 -> 177. Whole 6-row blocks only: the same form for the blocks of 1-5 rows (decode
// sizes, memory-bound) measured slower than the generic loop ('small' float32 decode step, ms
// p50, same hour: batch 4 18.5 against 22-23, batch 1 16.0 against 16.6-17.3).
template <int Pf>
__attribute__((always_inline)) inline void micro6_loop(const float* const (&xr)[6], const float* panel, float* y,
                                                       int64_t ldy, int64_t m0, int64_t kn, bool first,
                                                       const float* pf, int64_t pf_step) {
#define XL_ACC(m) __m512 a##m##0, a##m##1, a##m##2, a##m##3;                                          \
  if (first) {                                                                                       \
    a##m##0 = a##m##1 = a##m##2 = a##m##3 = _mm512_setzero_ps();                                     \
  } else {                                                                                           \
    float* ym = y + (m0 + m) * ldy;                                                                  \
    a##m##0 = _mm512_loadu_ps(ym); a##m##1 = _mm512_loadu_ps(ym + 16);                               \
    a##m##2 = _mm512_loadu_ps(ym + 32); a##m##3 = _mm512_loadu_ps(ym + 48);                          \
  }
  XL_ACC(0) XL_ACC(1) XL_ACC(2) XL_ACC(3) XL_ACC(4) XL_ACC(5)
#undef XL_ACC
  const float *x0 = xr[0], *x1 = xr[1], *x2 = xr[2], *x3 = xr[3], *x4 = xr[4], *x5 = xr[5];
  for (int64_t k = 0; k < kn; ++k) {
    const float* row = panel + k * kTile;
    if constexpr (Pf == 1) prefetch_row<kTile>(pf + k * kTile);
    if constexpr (Pf == 2)
      for (int l = 0; l < 2; ++l) __builtin_prefetch(pf + k * pf_step + l * 16, 0, 2);
    const __m512 w0 = _mm512_loadu_ps(row), w1 = _mm512_loadu_ps(row + 16);
    const __m512 w2 = _mm512_loadu_ps(row + 32), w3 = _mm512_loadu_ps(row + 48);
#define XL_FMA(m) {                                                                                  \
    const __m512 b = _mm512_set1_ps(x##m[k]);                                                        \
    a##m##0 = _mm512_fmadd_ps(w0, b, a##m##0); a##m##1 = _mm512_fmadd_ps(w1, b, a##m##1);            \
    a##m##2 = _mm512_fmadd_ps(w2, b, a##m##2); a##m##3 = _mm512_fmadd_ps(w3, b, a##m##3); }
    XL_FMA(0) XL_FMA(1) XL_FMA(2) XL_FMA(3) XL_FMA(4) XL_FMA(5)
#undef XL_FMA
  }
#define XL_ST(m) {                                                                                   \
    float* ym = y + (m0 + m) * ldy;                                                                  \
    _mm512_storeu_ps(ym, a##m##0); _mm512_storeu_ps(ym + 16, a##m##1);                               \
    _mm512_storeu_ps(ym + 32, a##m##2); _mm512_storeu_ps(ym + 48, a##m##3); }
  XL_ST(0) XL_ST(1) XL_ST(2) XL_ST(3) XL_ST(4) XL_ST(5)
#undef XL_ST
}

template <>
inline void micro<6, float, 2>(const float* x, const float* panel, float* y, int64_t K, int64_t ldy, int64_t m0,
                               int64_t kn, bool first, const float* pf, int64_t pf_step) {
  const float* xr[6];
  for (int m = 0; m < 6; ++m) xr[m] = x + (m0 + m) * K;
  if (pf == nullptr) micro6_loop<0>(xr, panel, y, ldy, m0, kn, first, pf, pf_step);
  else if (pf_step == 0) micro6_loop<1>(xr, panel, y, ldy, m0, kn, first, pf, pf_step);
  else micro6_loop<2>(xr, panel, y, ldy, m0, kn, first, pf, pf_step);
}
#endif

constexpr int64_t kKc = 128;   // K rows per pass over the M blocks, int8 weights (widened into a float buffer)
// The same for float32 weights: the largest multiple of 32 whose panel chunk (64 columns of floats,
// 256 bytes a row) fills at most 3/4 of this core's L1 data cache (cpu.py passes its size), so the
// chunk stays in L1 beside the x rows while every block of rows reads it: 128 rows (32 KiB) with a
// 48 KiB L1, 96 (24 KiB) with 32 KiB. 'small' model, alternating builds: on a 2-vCPU Zen 4 (32 KiB
// L1) 128 spilled the chunk to L2 for every block of rows after the first: float32 decode at batch
// 16 484-507 -> 620-641 tok/s with 96 (64: 622-641), batch 1 65-83 -> 70-72, 16 x 128-token
// prefill level (1555-1618 ms; 64: 1612-1647); on a 2-vCPU AMX Xeon (48 KiB) 128 beat 96, 160, 192
// and 256. The int8 path keeps 128 everywhere: on that Zen 4 its batch-16 decode fell 460-492 ->
// 350-443 tok/s with 96 (64: 242-367).
#ifndef XLASERVE_L1D_BYTES
#define XLASERVE_L1D_BYTES 32768
#endif
constexpr int64_t kKcF32 = std::max<int64_t>(32, int64_t(XLASERVE_L1D_BYTES) * 3 / 4 / (kTile * 4) / 32 * 32);
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int64_t kInt8RegRows = 64;   // int8 rows widened in registers (do_panel), AVX2-only builds
#else
constexpr int64_t kInt8RegRows = 6;
#endif
constexpr int64_t kMc = 192;   // rows of x per work item when M is large (192 x 768 floats = 576 KiB, in L2)

// The float kernels' large-M row cap for K-float rows: as many rows as kMc rows of 768 floats
// (whole register tiles). Why it follows K: with a fixed 192 rows, the 'small' model's down
// projection (K = 2048: 1.5 MiB of x per item beside its 512 KiB panel) re-streamed x from L3
// for every panel; 12 layers, ms, 2-vCPU AMX Xeon: M = 256 31.8 -> 29.3, M = 512 59.9 -> 55.8
// (gate_up, K = 768, level; caps of 1 MiB or 384 KiB measured no better). The bfloat16 pair
// kernels keep kMc: their AMX tiles ran the down projection at M = 512 8.6 -> 11.6 ms with it.
inline int64_t float_row_cap(int64_t K) { return K <= 0 ? kMc : std::max<int64_t>(6, kMc * 768 / K / 6 * 6); }

// Rows per work item: `cap` when M is over twice that; otherwise all M rows, unless the matrix
// has too few panels to keep every thread busy (a [768 -> 320] qkv has 5: 3 + 2 on two threads),
// when the rows are split into whole register tiles so there are about 4 items per thread. A row chunk re-reads its panel
// (from L2: 96-192 KiB at K = 768), which costs far less than an idle core.
inline int64_t row_chunk(int64_t M, int64_t cap, int64_t P, int64_t threads) {
  if (M > 2 * cap) return cap;
  const int64_t want = (4 * threads + P - 1) / P;          // row chunks per panel for ~4 items per thread
  if (want <= 1 || M < 12) return M;
  const int64_t mc = ((M + want - 1) / want + 5) / 6 * 6;
  return std::max<int64_t>(6, mc);
}

// Calls f with a register tile's row count (1..6, from `rows`) as a compile-time constant
// (std::integral_constant): the one dispatch of both micro-kernel families.
template <typename F>
__attribute__((always_inline)) inline void with_rows(int64_t rows, F f) {
  switch (rows) {
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// The micro-kernel for 1..6 rows (the register tile's row count is a template parameter).
template <typename W>
inline void micro_rows(int64_t rows, const float* x, const W* panel, float* y, int64_t K, int64_t ldy, int64_t m0,
                       int64_t kn, bool first, const W* pf = nullptr, int64_t pf_step = 0) {
  with_rows(rows, [&](auto r) { micro<decltype(r)::value, W>(x, panel, y, K, ldy, m0, kn, first, pf, pf_step); });
}

// out[m, c] *= scale[c] for the M rows of one 64-column panel (int8 weights' per-column scale;
// nothing for a null scale).
inline void scale_columns(const float* scale, float* out, int64_t ldo, int64_t M) {
  if (scale == nullptr) return;
  for (int64_t m = 0; m < M; ++m)
    for (int v = 0; v < kVec; ++v) store16(out + m * ldo + 16 * v, load16(out + m * ldo + 16 * v) * load16(scale + 16 * v));
}

// One panel (64 output columns) for all M rows into out (row stride ldo).
// scale (64 floats, or null for float32 weights) multiplies each output column at the end.
template <typename W>
inline void do_panel(const float* x, const W* panel, const float* scale, float* out, int64_t ldo, int64_t M, int64_t K) {
  alignas(64) float buf[std::is_same_v<W, float> ? 1 : kKc * kTile];
  constexpr int64_t kc = std::is_same_v<W, float> ? kKcF32 : kKc;
  for (int64_t k0 = 0; k0 < K; k0 += kc) {
    const int64_t kn = std::min(kc, K - k0);
    const bool first = k0 == 0;
    const W* chunk = panel + k0 * kTile;
    // the panel's next K chunk, which the first block of rows prefetches (see below)
    // (past the last chunk: the next panel's first, contiguous in memory). One float32 row does
    // better on the hardware prefetcher alone (below); one int8 row does not: the 'small' int8
    // model's 12-layer chain of its four matrices and LM head at M = 1, ms p50, alternating
    // builds, 2-vCPU Zen 4: 2.74-3.23 -> 2.53-2.78.
    const W* next = M > 1 || !std::is_same_v<W, float> ? chunk + kn * kTile : nullptr;
    if constexpr (!std::is_same_v<W, float>) {
      // int8 widened in registers, no buffer round trip: one block of rows; on AVX2-only builds
      // every block up to kInt8RegRows (each block widens the chunk again, which costs less there
      // than the 32 KiB float buffer that fills a 32 KiB L1: 768 x 2048 x 12 layers, ms a layer,
      // 2-vCPU Zen 3, alternating builds: M = 8 0.42-0.57 -> 0.19-0.27, M = 16 0.61-0.72 ->
      // 0.35-0.47, M = 32 0.85-1.46 -> 0.66-1.03, M = 64 1.44-2.51 -> 1.30-1.68, M = 128 level)
      if (M <= kInt8RegRows) {
        for (int64_t m = 0; m < M; m += 6)
          micro_rows<W>(std::min<int64_t>(6, M - m), x + k0, chunk, out, K, ldo, m, kn, first, m == 0 ? next : nullptr);
        continue;
      }
    }
    // the micro-kernel reads float rows; int8 chunks are widened once into an L1
    // buffer and then shared by every block of rows (prefill has thousands)
    const float* p;
    if constexpr (std::is_same_v<W, float>) {
      p = chunk;
    } else {
      for (int64_t i = 0; i < kn * kTile; i += 16) store16(buf + i, load_w(chunk + i));
      p = buf;
    }
    // Float panels stream from memory at decode sizes, and the FMAs of 2+ rows kept the hardware
    // prefetcher from keeping up: the first block of rows prefetches the panel's next K chunk
    // into L2 while it reads this one (later blocks find this chunk in L1 / L2). A 12-layer chain
    // of the 'small' model's four matrices + its LM head, ms, 2-vCPU AMX Xeon, alternating
    // builds: M = 2 18.3 -> 16.7-17.1, 3 20.4-20.7 -> 17.1-17.7, 6 24.2 -> 18.0-18.3, 8 26.6 ->
    // 19.5-20.6, 16 30.7 -> 25.3-25.5, 32 41.4-41.9 -> 34.5-35.5, 64 58.8-59.1 -> 53.0-54.8.
    // Not at M = 1 for float32 (15.7 -> 16.2-16.7 with it: one row is bandwidth-bound and the
    // hardware prefetcher alone does better; level within noise on a Zen 4; int8: above), and
    // to L2, not L1 (M = 16: 28.0 into L1, 25.4 into L2).
    //
    // Spread (2 to 12 blocks of rows, M = 7..72): a burst of a whole chunk's prefetches from the
    // first block filled the core's miss queue while the FMAs waited behind it, so memory and
    // compute ran one after the other (chain time ~ M=1 time + hot compute time). Instead the
    // first min(blocks, 6) blocks each prefetch 2 lines per K step, interleaved (block i: lines
    // 2i, 2i + 1, 2i + 2 b, ...), a steady stream running 1-3 chunks ahead. Layers-only chain
    // (12 x the four matrices, 300 MB), ms p50, same host, alternating builds: M = 16 16.0 ->
    // 14.2-14.5, 32 22.6-22.9 -> 19.2-20.4, 64 36.7 -> 32.1; M = 8 level; M = 128 and 256
    // (compute-bound) kept the burst, spread there measured level to 6 % slower.
    const float* pf = nullptr;
    int64_t pf_step = 0;   // 0: the burst form (the next chunk's rows); else pf + k pf_step at step k
    const int64_t blocks = (M + 5) / 6;
    if constexpr (std::is_same_v<W, float>) {
      pf = next;
    } else if (next != nullptr && blocks >= 2 && blocks <= 12) {
      // int8 at decode sizes: the first block of rows prefetches the panel's next int8 chunk
      // (not the widened buffer every block reads) into L2, a line per K step (kn lines of 64
      // int8 weights). Without it the int8 stream waited on the hardware prefetcher alone:
      // 'small' int8 model, decode at batch 16, tok/s, alternating builds, 2-vCPU Zen 4:
      // 398-478 -> 590-621.
      pf = reinterpret_cast<const float*>(next);
      pf_step = 16;
    }
    if (std::is_same_v<W, float> && pf != nullptr && blocks >= 2 && blocks <= 12) {
      const int64_t spread = std::min<int64_t>(blocks, 6);
      for (int64_t m = 0, i = 0; m < M; m += 6, ++i)
        micro_rows<float>(std::min<int64_t>(6, M - m), x + k0, p, out, K, ldo, m, kn, first,
                          i < spread ? pf + 32 * i : nullptr, 32 * spread);
    } else {
      for (int64_t m = 0; m < M; m += 6)
        micro_rows<float>(std::min<int64_t>(6, M - m), x + k0, p, out, K, ldo, m, kn, first, m == 0 ? pf : nullptr,
                          pf_step);
    }
  }
  scale_columns(scale, out, ldo, M);
}

// Calls over at most this many rows (tokens) take their helpers from Helpers, larger ones from
// XLA's pool. Measured on a 2-vCPU AMX Xeon, same-run A/B against XLA's pool for every call: the
// 'small' model's float32 decode step at batch 1 16.3-16.8 -> 15.6-15.8 ms, at batch 16
// 28.5-29.1 -> 28.2-28.6 ms; but all-MiniLM-L6-v2 at 32 sentences (1,280-token programs) 257-262
// -> 236-239 sentences/s with our helpers for every call: XLA's own parallel fusions between the
// calls (LayerNorm, residuals) took twice as long with its pool threads parked meanwhile.
constexpr int64_t kOwnRows = 64;

// Runs fn(i) for i in [0, n) on the calling thread and helper threads (Helpers, or XLA's
// intra-op pool while another call holds those). Items are claimed from an atomic counter; the
// caller waits only for items already claimed, so a helper that starts late (or not at all)
// never blocks it. The caller works too, so one helper fewer than the pool's size: one worker
// per core. Why: with a helper per pool thread, a call made from a thread outside the pool
// (XLA's client thread runs a program's loop) put three busy threads on a 2-vCPU host, and the
// helpers started 75-155 us late on average. Scheduling one fewer (2-vCPU Zen 5, same-run A/B,
// ms): all-MiniLM-L6-v2's 24-token program 3.74-4.13 -> 3.27-3.74; one layer's 768 x 2048 GEMM
// at M = 1 0.067-0.075 -> 0.042-0.043, at M = 16 0.150-0.173 -> 0.135-0.143; 2048 rows level
// (14.5-17.3 either way).
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t per_claim, F fn, bool inline_only = false,
                  bool own_helpers = false) {
  struct Shared : xlaserve_cpu::HelperTask {
    F fn; int64_t n, per_claim;
    std::atomic<int64_t> next{0}, done{0};
    Shared(F f, int64_t n_, int64_t c) : fn(std::move(f)), n(n_), per_claim(c) {}
    void work() override {
      for (;;) {
        const int64_t i0 = next.fetch_add(per_claim, std::memory_order_relaxed);
        if (i0 >= n) return;
        const int64_t i1 = std::min(i0 + per_claim, n);
        for (int64_t i = i0; i < i1; ++i) fn(i);
        done.fetch_add(i1 - i0, std::memory_order_release);
      }
    }
  };
  if (n <= 0) return;
  if (inline_only) {   // too little work to pay for waking pool threads
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto sh = std::make_shared<Shared>(std::move(fn), n, std::max<int64_t>(per_claim, 1));
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t helpers = std::min<int64_t>(threads - 1, (n + sh->per_claim - 1) / sh->per_claim - 1);
  xlaserve_cpu::Helpers* own = own_helpers && helpers > 0 ? &xlaserve_cpu::Helpers::get(threads - 1) : nullptr;
  const bool held = own != nullptr && own->offer(sh);
  if (!held)
    for (int64_t i = 0; i < helpers; ++i) pool.Schedule([sh] { sh->work(); });
  sh->work();
  while (sh->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  if (held) own->release();
}

// y [M, N] = every (row chunk, panel) tile, each computed by tile(t, m0, rows, out, ldo) into
// out (row stride ldo) on the calling thread and XLA's pool. Large M (prefill): rows in chunks of
// `cap` (row_chunk) so a chunk of x stays in L2 while the panels stream past it; consecutive
// items share the row chunk. The ragged last panel is computed whole into a scratch tile and N - 64 t
// of its columns are kept.
template <typename Tile>
void for_each_panel(ffi::ThreadPool& pool, int64_t M, int64_t cap, int64_t P, int64_t N, float* yp, Tile tile) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t mc = row_chunk(M, cap, P, threads);
  const int64_t chunks = (M + mc - 1) / mc;
  parallel_for(pool, chunks * P, std::max<int64_t>(1, P / (4 * threads)), [=](int64_t item) {
    const int64_t t = item % P, m0 = (item / P) * mc, rows = std::min(mc, M - m0);
    float* yr = yp + m0 * N;
    const int64_t n0 = t * kTile;
    if (n0 + kTile <= N) { tile(t, m0, rows, yr + n0, N); return; }
    std::vector<float> scratch(rows * kTile);
    tile(t, m0, rows, scratch.data(), kTile);
    for (int64_t m = 0; m < rows; ++m)
      std::memcpy(yr + m * N + n0, scratch.data() + m * kTile, (N - n0) * sizeof(float));
  }, false, M <= kOwnRows);
}

// The rows of x to compute: all M, or with a two-element layer operand [layer, rows] the first
// `rows` (a ragged step's real tokens; the token bucket pads the rest), the rest of y zeroed so
// padding tokens stay finite (zeros) wherever they flow. Why: the guard's steps are one prompt
// plus the streams beside it, and the bucket's padding cost as much as real tokens ('small'
// model, a 128-token prompt beside 4 streams in the 160 bucket: 90.9 -> 80.3 ms a step).
inline int64_t live_rows(const ffi::Buffer<ffi::S32>& layer, int64_t M, float* y, int64_t N) {
  if (layer.element_count() < 2) return M;
  const int64_t r = std::min<int64_t>(std::max<int64_t>(layer.typed_data()[1], 0), M);
  if (r < M) std::memset(y + r * N, 0, (M - r) * N * sizeof(float));
  return r;
}

// x [M, K]; w [L, P, K, 64] (P panels of 64 columns, the last zero-padded); layer [] int32, or
// [2] int32 = [layer, rows] (live_rows); y [M, N] with 64 (P - 1) < N <= 64 P; int8 weights also
// take scale [L, 64 P] per column. epi(t, out, ldo, rows) runs on each finished tile (panel t)
// while it is in L1 (GemmBiasImpl's bias and GELU); the default does nothing.
struct NoEpilogue {
  void operator()(int64_t, float*, int64_t, int64_t) const {}
};

template <typename W, typename Epi = NoEpilogue>
ffi::Error gemm(ffi::ThreadPool& pool, const float* xp, const W* wp, const float* sp, int64_t M, int64_t K,
                int64_t L, int64_t P, int64_t N, int64_t li, float* yp, Epi epi = {}) {
  if (li < 0 || li >= L) return ffi::Error::InvalidArgument("xlaserve_gemm: layer index out of range");
  if (M == 0) return ffi::Error::Success();
  const W* wl = wp + li * P * K * kTile;
  const float* sl = sp ? sp + li * P * kTile : nullptr;
  for_each_panel(pool, M, float_row_cap(K), P, N, yp, [=](int64_t t, int64_t m0, int64_t rows, float* out, int64_t ldo) {
    do_panel(xp + m0 * K, wl + t * K * kTile, sl ? sl + t * kTile : nullptr, out, ldo, rows, K);
    epi(t, out, ldo, rows);
  });
  return ffi::Error::Success();
}

template <typename WBuf, typename Y>
ffi::Error check(const ffi::Buffer<ffi::F32>& x, const WBuf& w, Y& y,
                 int64_t& M, int64_t& K, int64_t& L, int64_t& P, int64_t& N) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || wd[3] != kTile)
    return ffi::Error::InvalidArgument("xlaserve_gemm: x must be [M, K], w [L, P, K, 64], y [M, N]");
  M = xd[0]; K = xd[1]; L = wd[0]; P = wd[1]; N = yd[1];
  if (wd[2] != K || yd[0] != M || N > P * kTile || N <= (P - 1) * kTile)
    return ffi::Error::InvalidArgument("xlaserve_gemm: operand shapes do not agree");
  return ffi::Error::Success();
}

ffi::Error GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Panels w,
                    ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  int64_t M, K, L, P, N;
  if (auto e = check(x, w, y, M, K, L, P, N); e.failure()) return e;
  M = live_rows(layer, M, y->typed_data(), N);
  return gemm<float>(pool, x.typed_data(), w.typed_data(), nullptr, M, K, L, P, N, layer.typed_data()[0],
                     y->typed_data());
}

// erf(x) in float32: the odd rational form x P(x^2) / Q(x^2) on x clamped to [-4, 4] (beyond,
// erf is +-1 in float32), degrees 13 / 8; max abs error 3.3e-7 on a dense grid over [-6, 6],
// as XLA:CPU's own erf measures there.
template <typename V>
inline V verf(V x) {
  x = x < -4.0f ? V{} - 4.0f : x;
  x = x > 4.0f ? V{} + 4.0f : x;
  const V x2 = x * x;
  V p = V{} - 2.72614225801306e-10f;
  p = p * x2 + 2.77068142495902e-08f;
  p = p * x2 - 2.10102402082508e-06f;
  p = p * x2 - 5.69250639462346e-05f;
  p = p * x2 - 7.34990630326855e-04f;
  p = p * x2 - 2.95459980854025e-03f;
  p = p * x2 - 1.60960333262415e-02f;
  V q = V{} - 1.45660718464996e-05f;
  q = q * x2 - 2.13374055278905e-04f;
  q = q * x2 - 1.68282697438203e-03f;
  q = q * x2 - 7.37332916720468e-03f;
  q = q * x2 - 1.42647390514189e-02f;
  return x * p / q;
}

// y = y + bias, then (kGelu) HF's exact (erf) GELU 0.5 v (1 + erf(v / sqrt 2)), over rows x cols
// of a tile (row stride ldo; cols <= 64). Run on each tile right after its GEMM, while it is in L1.
// On 8-lane vectors on AVX2-only builds: the 16-lane form's selects went through xmm halves and
// the stack there (all-MiniLM-L6-v2 at 32 sentences, 2-vCPU Zen 3: 7.3 % of the samples).
template <bool kGelu>
inline void bias_act(float* y, int64_t ldo, int64_t rows, const float* bias, int64_t cols) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  using V = v8;
#else
  using V = v16;
#endif
  constexpr int64_t W = sizeof(V) / sizeof(float);
  const int64_t whole = cols / W * W;
  for (int64_t m = 0; m < rows; ++m) {
    float* r = y + m * ldo;
    for (int64_t c = 0; c < whole; c += W) {
      const V v = loadu<V>(r + c) + loadu<V>(bias + c);
      if constexpr (kGelu) storeu<V>(r + c, 0.5f * v * (1.0f + verf<V>(v * 0.70710678118654752f)));
      else storeu<V>(r + c, v);
    }
    for (int64_t c = whole; c < cols; ++c) {
      const float v = r[c] + bias[c];
      r[c] = kGelu ? 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f)) : v;
    }
  }
}

// XlaserveGemmBiasF32 / XlaserveGemmBiasGeluF32: y = x @ w[layer] + bias, and gelu of it (float32
// panels, bias [N]): an encoder's projections with their bias, the FFN input one with its
// activation. Why: XLA ran each bias add (and the GELU) as a pass of its own over the output:
// all-MiniLM-L6-v2, 32 sentences, 7.2 of ~112 ms a batch for bias + GELU; 128 sentences, 13.1
// of ~430 ms for the qkv bias alone. Here each tile is finished while it is still in L1.
template <bool kGelu>
ffi::Error GemmBiasImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Panels w, ffi::Buffer<ffi::S32> layer,
                        ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> y) {
  int64_t M, K, L, P, N;
  if (auto e = check(x, w, y, M, K, L, P, N); e.failure()) return e;
  if (bias.element_count() != static_cast<size_t>(N))
    return ffi::Error::InvalidArgument("xlaserve_gemm_bias: bias does not match the output columns");
  M = live_rows(layer, M, y->typed_data(), N);
  const float* bp = bias.typed_data();
  return gemm<float>(pool, x.typed_data(), w.typed_data(), nullptr, M, K, L, P, N, layer.typed_data()[0],
                     y->typed_data(), [=](int64_t t, float* out, int64_t ldo, int64_t rows) {
    bias_act<kGelu>(out, ldo, rows, bp + t * kTile, std::min<int64_t>(kTile, N - t * kTile));
  });
}

ffi::Error GemmI8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, PanelsI8 w, Scales s,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  int64_t M, K, L, P, N;
  if (auto e = check(x, w, y, M, K, L, P, N); e.failure()) return e;
  if (s.dimensions()[0] != L || s.dimensions()[1] != P * kTile)
    return ffi::Error::InvalidArgument("xlaserve_gemm_i8: scale must be [L, 64 P]");
  M = live_rows(layer, M, y->typed_data(), N);
  return gemm<int8_t>(pool, x.typed_data(), reinterpret_cast<const int8_t*>(w.typed_data()), s.typed_data(),
                      M, K, L, P, N, layer.typed_data()[0], y->typed_data());
}

// bfloat16 weights, bfloat16 activations: K in pairs. The panels are [L, P, K/2, 128]: for each
// pair of contraction rows (2j, 2j+1) the 64 columns' weights interleaved (w[2j, c], w[2j+1, c]),
// so 16 columns of a pair are one 64-byte vector of 32-bit lanes, and x's pair (x[2j], x[2j+1]) is
// one 32-bit broadcast. Why: with AVX512_BF16 (Zen 4, Cooper Lake, Sapphire Rapids) one
// vdpbf16ps does lane += w_lo * x_lo + w_hi * x_hi, 32 multiply-adds per instruction against
// 16 for a float32 FMA, and needs no widening; without it the pair layout still widens in two
// integer ops per 32 weights (a shift for the low half, a mask for the high) instead of a zero
// extension and a shift per 16. Exact for bfloat16 inputs: every product of two bfloat16 values
// is exact in float32 and is accumulated in float32, as XLA's dot with a float32 result type
// (vdpbf16ps flushes denormal inputs, which no trained weight is). Measured on this host (Zen 4,
// 2 vCPU), 768 x 2048 per layer, ms, float-widening kernel -> pair kernel: see choose.py.
//
// Weight-only int8 in a bfloat16 model keeps the float32 model's plain int8 panels ([L, P, K, 64],
// per-column scale [L, 64 P] applied after the K loop): rows 2j and 2j + 1 of a panel are 128
// contiguous bytes, which the pair loop widens into the bfloat16 pair operand (an int8 value is
// exact in bfloat16: the converted float's upper half, a shift and a mask), in registers at decode
// sizes (<= 6 rows) and once per K chunk into an L1 buffer shared by every block of rows above.
// Why one layout: the int8 pair layout this replaces ([L, P, K/2, 128] int8, widened by two sign
// extensions, two converts and a pack) served only this loop, and its one-row loop was ~10 %
// slower than the float32 model's int8 loop over the same bytes. 'small' 12-layer chains (4
// matrices + LM head), bfloat16 + int8, ms p50, five alternating rounds, 2-vCPU Zen 4: M = 1 pair
// layout 2.81-3.07 (median 2.93) -> plain 2.66-3.05 (2.73); M = 4 3.52-4.38 -> 3.21-3.59; two
// rounds M = 16 21.8-22.5 -> 13.5-14.1, M = 128 81.5-82.7 -> 80.9-84.3. Routing
// one row to the float32 loop instead (x widened to float32) measured level (2.35-2.86, 2.77), so
// every row count takes the pair loop, and a row's result does not depend on the batch it is in.
typedef unsigned v16ui __attribute__((vector_size(64)));
typedef unsigned v16uiu __attribute__((vector_size(64), aligned(4), may_alias));

// 16 columns of two int8 weight rows (even, odd) as bfloat16 pairs (even in the low half): an int8
// value converted to float32 has a zero low half, so its bfloat16 is the float's upper 16 bits.
inline v16ui int8_pair_bits(v16 even, v16 odd) {
  return (reinterpret_cast<v16ui>(even) >> 16) | (reinterpret_cast<v16ui>(odd) & 0xFFFF0000u);
}

#ifdef __AVX512BF16__
// 16 columns' bfloat16 pairs of one K pair (columns 16 v .. 16 v + 15)
inline __m512bh pairs_bh(const uint32_t* row, int v) { return (__m512bh)_mm512_loadu_si512(row + 16 * v); }
// the same from plain int8 rows 2j (`row`) and 2j + 1 (the next 64 bytes)
inline __m512bh pairs_bh(const int8_t* row, int v) {
  return (__m512bh)int8_pair_bits(load_w(row + 16 * v), load_w(row + kTile + 16 * v));
}
#else
// The same 16 columns as two float vectors: even K row (lo) and odd K row (hi).
inline void pairs_f32(const uint32_t* row, int v, v16& lo, v16& hi) {
  const v16ui w = *reinterpret_cast<const v16uiu*>(row + 16 * v);
  lo = reinterpret_cast<v16>(w << 16);
  hi = reinterpret_cast<v16>(w & 0xFFFF0000u);
}
inline void pairs_f32(const int8_t* row, int v, v16& lo, v16& hi) {
  lo = load_w(row + 16 * v);
  hi = load_w(row + kTile + 16 * v);
}
#endif

// Elements of one K pair's 64 columns in the panel's own type: a bfloat16 pair panel's row
// (uint32_t pairs), or two plain int8 rows.
template <typename W> constexpr int64_t kPairRow = std::is_same_v<W, int8_t> ? 2 * kTile : kTile;

#if defined(__AVX2__) && !defined(__AVX512F__)
typedef unsigned v8ui __attribute__((vector_size(32), aligned(4), may_alias));
// 8 columns (8 c .. 8 c + 7) of one K pair as two float vectors (even K row lo, odd hi)
inline void pairs_f32x8(const uint32_t* row, int c, v8& lo, v8& hi) {
  const v8ui w = *reinterpret_cast<const v8ui*>(row + 8 * c);
  lo = reinterpret_cast<v8>(w << 16);
  hi = reinterpret_cast<v8>(w & 0xFFFF0000u);
}
inline void pairs_f32x8(const int8_t* row, int c, v8& lo, v8& hi) {
  lo = load_w8(row + 8 * c);
  hi = load_w8(row + kTile + 8 * c);
}

// micro_pairs for 2..6 rows on AVX2: 8 columns a pass (MR accumulators, 2 weight vectors and
// 2 broadcasts: <= 10 of the 16 ymm registers; all 64 columns at once spilled them, as in
// micro_avx2); the first pass prefetches.
template <int MR, typename W>
inline void micro_pairs_avx2(const uint32_t* const (&xr)[MR], const W* panel, float* y, int64_t ldy, int64_t m0,
                             int64_t kn2, bool first, const W* pf) {
  for (int c = 0; c < kTile / 8; ++c) {
    v8 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = first ? v8{} : *reinterpret_cast<const v8u*>(y + (m0 + m) * ldy + 8 * c);
    for (int64_t j = 0; j < kn2; ++j) {
      const W* row = panel + j * kPairRow<W>;
      if (c == 0) prefetch_row<kPairRow<W>>(pf ? pf + j * kPairRow<W> : pf);
      v8 lo, hi;
      pairs_f32x8(row, c, lo, hi);
      for (int m = 0; m < MR; ++m) {
        const uint32_t p = xr[m][j];
        const uint32_t lb = p << 16, hb = p & 0xFFFF0000u;
        float xl, xh;
        std::memcpy(&xl, &lb, 4);
        std::memcpy(&xh, &hb, 4);
        acc[m] += lo * xl + hi * xh;
      }
    }
    for (int m = 0; m < MR; ++m) *reinterpret_cast<v8u*>(y + (m0 + m) * ldy + 8 * c) = acc[m];
  }
}
#endif

template <int MR, typename W>
inline void micro_pairs(const uint32_t* x, int64_t K2, const W* panel, float* y, int64_t ldy, int64_t m0,
                        int64_t kn2, bool first, const W* pf = nullptr) {
  const uint32_t* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = x + (m0 + m) * K2;
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (MR >= 2) {
    micro_pairs_avx2<MR, W>(xr, panel, y, ldy, m0, kn2, first, pf);
    return;
  }
#endif
#ifdef __AVX512BF16__
  __m512 acc[MR][kVec];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVec; ++v)
      acc[m][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + (m0 + m) * ldy + 16 * v);
  for (int64_t j = 0; j < kn2; ++j) {
    const W* row = panel + j * kPairRow<W>;
    prefetch_row<kPairRow<W>>(pf ? pf + j * kPairRow<W> : pf);
    __m512bh wv[kVec];
    for (int v = 0; v < kVec; ++v) wv[v] = pairs_bh(row, v);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[m][j]));
      for (int v = 0; v < kVec; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], wv[v], xv);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVec; ++v) _mm512_storeu_ps(y + (m0 + m) * ldy + 16 * v, acc[m][v]);
#else
  v16 acc[MR][kVec];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVec; ++v) acc[m][v] = first ? v16{} : load16(y + (m0 + m) * ldy + 16 * v);
  for (int64_t j = 0; j < kn2; ++j) {
    const W* row = panel + j * kPairRow<W>;
    prefetch_row<kPairRow<W>>(pf ? pf + j * kPairRow<W> : pf);
    v16 lo[kVec], hi[kVec];
    for (int v = 0; v < kVec; ++v) pairs_f32(row, v, lo[v], hi[v]);
    for (int m = 0; m < MR; ++m) {
      const uint32_t p = xr[m][j];
      const uint32_t lb = p << 16, hb = p & 0xFFFF0000u;
      float xl, xh;
      std::memcpy(&xl, &lb, 4);
      std::memcpy(&xh, &hb, 4);
      for (int v = 0; v < kVec; ++v) acc[m][v] += lo[v] * xl + hi[v] * xh;
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVec; ++v) store16(y + (m0 + m) * ldy + 16 * v, acc[m][v]);
#endif
}

template <typename W>
inline void micro_pairs_rows(int64_t rows, const uint32_t* x, int64_t K2, const W* panel, float* y,
                             int64_t ldy, int64_t m0, int64_t kn2, bool first, const W* pf = nullptr) {
  with_rows(rows, [&](auto r) { micro_pairs<decltype(r)::value, W>(x, K2, panel, y, ldy, m0, kn2, first, pf); });
}

// AMX (Sapphire Rapids and later Xeons): one TDPBF16PS multiplies a 16 x 32 bfloat16 tile of x by
// a 32 x 16 tile of weights into 16 x 16 float32 sums, 16x the multiply-adds of one vdpbf16ps.
// The pair layout above is already the tile's "VNNI" form: row j of a panel holds, for each of
// its 64 columns, the weights of K rows 2j and 2j + 1 side by side, so a weight tile (16 K pairs
// x 16 columns) loads straight from the panel with a 256-byte row stride, and an x tile (16 rows
// x 32 K values) straight from x with a stride of one row. Used for bfloat16 weights at M >= 16
// with K a multiple of 32 (the tile's depth); remaining rows take the vdpbf16ps micro-kernel.
// Built only where -march=native enables AMX; used only when CPUID says so and Linux grants the
// tile state (arch_prctl ARCH_REQ_XCOMP_PERM); XLASERVE_AMX=0 turns it off (A/B runs).
// Why: on a 2-vCPU Xeon with AMX, transformers' bfloat16 prefill (oneDNN on AMX) took 250 ms for
// 16 x 128 tokens of the 'small' model against 770-1010 ms here on vdpbf16ps and XLA's dot.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
bool amx_usable() {
  static const bool ok = [] {
    const char* env = std::getenv("XLASERVE_AMX");
    if (env && env[0] == '0') return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1u) || !((d >> 22) & 1u)) return false;        // AMX-TILE, AMX-BF16
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Rows [0, M16) (a multiple of 16) of one panel: out[m, 0..63] = x[m, :] @ panel, K2 K pairs
// (a multiple of 16). Tiles 0-3: the 16 x 64 float32 sums; 4: x; 5 and 6: weights.
void amx_panel(const uint32_t* x, int64_t K2, const uint32_t* panel, float* out, int64_t ldo, int64_t M16) {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
  _tile_loadconfig(&cfg);
  const int64_t xs = K2 * 4, ws = kTile * 4, os = ldo * 4;
  for (int64_t m = 0; m < M16; m += 16) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const uint32_t* xr = x + m * K2;
    for (int64_t j = 0; j < K2; j += 16) {
      const uint32_t* wr = panel + j * kTile;
      _tile_loadd(4, xr + j, xs);
      _tile_loadd(5, wr, ws);
      _tile_loadd(6, wr + 16, ws);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, wr + 32, ws);
      _tile_loadd(6, wr + 48, ws);
      _tile_dpbf16ps(2, 4, 5);
      _tile_dpbf16ps(3, 4, 6);
    }
    float* o = out + m * ldo;
    _tile_stored(0, o, os);
    _tile_stored(1, o + 16, os);
    _tile_stored(2, o + 32, os);
    _tile_stored(3, o + 48, os);
  }
  _tile_release();
}
#else
bool amx_usable() { return false; }
void amx_panel(const uint32_t*, int64_t, const uint32_t*, float*, int64_t, int64_t) {}
#endif

constexpr int64_t kKc2 = 64;   // K pairs per pass: 64 x 64 columns x 4 bytes = 16 KiB of panel in L1
// Decode rows (2..6) prefetch the pair panel this many K pairs ahead into L2 (8 KiB of bfloat16),
// as the float kernel prefetches its next chunk (do_panel): the same 12-layer chain, M = 4, ms,
// alternating builds: bfloat16 14.4-14.5 -> 10.3-10.7, int8 in the float model (its panels take
// the next-chunk prefetch) 10.1-10.6 -> 4.8-6.4; M >= 16 level. One row prefetches too: the
// 'small' bfloat16 chain at M = 1 (as do_panel's) 6.0-6.5 -> 5.4-5.9 ms p50 in four alternating
// rounds.
constexpr int64_t kPfPairs = 32;

// K pairs [j0, j0 + kn2) of a plain int8 panel ([K, 64], K rows) as bfloat16 pairs, into dst
// [kn2, 64]: lane c of pair j = (w[2j, c], w[2j + 1, c]), the odd row zero past K (exact:
// int8_pair_bits).
inline void widen_plain(const int8_t* panel, int64_t K, int64_t j0, int64_t kn2, uint32_t* dst) {
  for (int64_t j = 0; j < kn2; ++j) {
    const int64_t k = 2 * (j0 + j);
    const int8_t* even = panel + k * kTile;
    const bool odd = k + 1 < K;
    for (int v = 0; v < kVec; ++v)
      *reinterpret_cast<v16uiu*>(dst + j * kTile + 16 * v) =
          int8_pair_bits(load_w(even + 16 * v), odd ? load_w(even + kTile + 16 * v) : v16{});
  }
}

// One panel (64 output columns) for all M rows of x in K pairs (K2 a row) into out (row stride
// ldo): a bfloat16 pair panel ([K2, 64] pairs; W = uint32_t) or a plain int8 one ([K, 64], K =
// 2 K2 or 2 K2 - 1; W = int8_t: each K chunk widened once into bfloat16 pairs in L1 and shared by
// every block of rows); scale (64 floats, int8; null for bfloat16) multiplies each output column
// at the end.
template <typename W>
inline void do_panel_pairs(const uint32_t* x, const W* panel, const float* scale, float* out, int64_t ldo,
                           int64_t M, int64_t K2, int64_t K) {
  constexpr bool kInt8 = std::is_same_v<W, int8_t>;
  if (M >= 16 && K2 % 16 == 0 && amx_usable()) {    // on AMX tiles (above); int8 widened first, whole
    const uint32_t* pw;
    if constexpr (kInt8) {
      thread_local std::vector<uint32_t> wide;
      wide.resize(K2 * kTile);
      widen_plain(panel, K, 0, K2, wide.data());
      pw = wide.data();
    } else {
      pw = panel;
    }
    const int64_t M16 = M / 16 * 16;
    amx_panel(x, K2, pw, out, ldo, M16);
    for (int64_t m = M16; m < M; m += 6)
      micro_pairs_rows<uint32_t>(std::min<int64_t>(6, M - m), x, K2, pw, out, ldo, m, K2, true);
    scale_columns(scale, out, ldo, M);
    return;
  }
  if (M <= 6 && (!kInt8 || K % 2 == 0)) {
    // decode: one pass over the panel, the accumulators never leave the registers (int8 widened
    // in them; an odd K, which would read a row past the panel, takes the buffered loop below)
    micro_pairs_rows<W>(M, x, K2, panel, out, ldo, 0, K2, true, panel + kPfPairs * kPairRow<W>);
  } else {
    alignas(64) uint32_t buf[kInt8 ? kKc2 * kTile : 1];
    for (int64_t k0 = 0; k0 < K2; k0 += kKc2) {
      const int64_t kn2 = std::min(kKc2, K2 - k0);
      const uint32_t* chunk;
      const uint32_t* pf = nullptr;
      if constexpr (kInt8) {
        widen_plain(panel, K, k0, kn2, buf);
        chunk = buf;
      } else {
        chunk = panel + k0 * kTile;
        pf = k0 + kKc2 < K2 ? chunk + kKc2 * kTile : nullptr;
      }
      for (int64_t m = 0; m < M; m += 6)
        micro_pairs_rows<uint32_t>(std::min<int64_t>(6, M - m), x + k0, K2, chunk, out, ldo, m, kn2, k0 == 0,
                         m == 0 ? pf : nullptr);
    }
  }
  scale_columns(scale, out, ldo, M);
}

// x [M, 2 K2] bfloat16 as K pairs; panels of `panel_elems` W elements each (L x P of them).
template <typename W>
ffi::Error gemm_pairs(ffi::ThreadPool& pool, const uint32_t* xp, int64_t M, int64_t K2, int64_t K, const W* wp,
                      int64_t L, int64_t P, int64_t panel_elems, const float* sp, int64_t li, float* yp, int64_t N) {
  if (li < 0 || li >= L) return ffi::Error::InvalidArgument("xlaserve_gemm pairs: layer index out of range");
  if (M == 0) return ffi::Error::Success();
  const W* wl = wp + li * P * panel_elems;
  const float* sl = sp ? sp + li * P * kTile : nullptr;
  for_each_panel(pool, M, kMc, P, N, yp, [=](int64_t t, int64_t m0, int64_t rows, float* out, int64_t ldo) {
    do_panel_pairs<W>(xp + m0 * K2, wl + t * panel_elems, sl ? sl + t * kTile : nullptr, out, ldo, rows, K2, K);
  });
  return ffi::Error::Success();
}

// x [M, 2 K2] and y [M, N] against P panels: the common shape checks of the bfloat16-input GEMMs.
ffi::Error check_pairs(const ffi::Buffer<ffi::BF16>& x, ffi::ResultBuffer<ffi::F32>& y, int64_t K2, int64_t P,
                       const char* what) {
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[1] != 2 * K2 || yd[0] != xd[0] || yd[1] > P * kTile ||
      yd[1] <= (P - 1) * kTile)
    return ffi::Error::InvalidArgument(std::string(what) + ": x must be [M, K] with K even (zero-padded), y [M, N] "
                                       "with N in the weight's last panel");
  return ffi::Error::Success();
}

ffi::Error GemmBF16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, PanelsBF16 w,
                        ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  if (wd[3] != 2 * kTile) return ffi::Error::InvalidArgument("xlaserve_gemm_bf16: w must be [L, P, K / 2, 128]");
  const int64_t K2 = wd[2], N = y->dimensions()[1];
  if (auto e = check_pairs(x, y, K2, wd[1], "xlaserve_gemm_bf16"); e.failure()) return e;
  const int64_t M = live_rows(layer, x.dimensions()[0], y->typed_data(), N);
  return gemm_pairs<uint32_t>(pool, reinterpret_cast<const uint32_t*>(x.typed_data()), M, K2, 2 * K2,
                              reinterpret_cast<const uint32_t*>(w.typed_data()), wd[0], wd[1], K2 * kTile, nullptr,
                              layer.typed_data()[0], y->typed_data(), N);
}

ffi::Error GemmI8BF16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, PanelsI8 w, Scales s,
                          ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  if (wd[3] != kTile) return ffi::Error::InvalidArgument("xlaserve_gemm_i8_bf16: w must be [L, P, K, 64]");
  if (s.dimensions()[0] != wd[0] || s.dimensions()[1] != wd[1] * kTile)
    return ffi::Error::InvalidArgument("xlaserve_gemm_i8_bf16: scale must be [L, 64 P]");
  const int64_t K = wd[2], K2 = (K + 1) / 2, N = y->dimensions()[1];
  if (auto e = check_pairs(x, y, K2, wd[1], "xlaserve_gemm_i8_bf16"); e.failure()) return e;
  const int64_t M = live_rows(layer, x.dimensions()[0], y->typed_data(), N);
  const int8_t* wp = reinterpret_cast<const int8_t*>(w.typed_data());
  const int64_t li = layer.typed_data()[0];
  return gemm_pairs<int8_t>(pool, reinterpret_cast<const uint32_t*>(x.typed_data()), M, K2, K, wp, wd[0], wd[1],
                            K * kTile, s.typed_data(), li, y->typed_data(), N);
}

// --quantize w8a8: int8 weights (per-column scale) times int8 activations (per-row scale,
// quantized here, dynamically, from the float32 x of each call), summed exactly in int32.
// Weights: quad panels [L, P, K4, 256] uint8: for each quad of contraction rows (4j .. 4j + 3)
// the 64 columns' four weights side by side, each stored as w + 128 (so lane c of the quad row
// is one 32-bit group, what vpdpbusd reads: unsigned bytes times signed bytes, four products
// summed into a 32-bit lane). x row m: amax = max |x[m, :]|, xq = round(x * 127 / amax) (nearest
// even) in [-127, 127], scale sx = amax / 127; then
//   y[m, c] = float(sum_k xq[m, k] (w[k, c] + 128) - 128 sum_k xq[m, k]) * sx[m] * s[c]
// where the bracket is sum_k xq w exactly, as XLA's int8 dot with an int32 result computes it
// (llama.py's linear: the same quantization, so both paths give the same numbers up to the
// order of the last two float multiplies, which both do left to right).
// Why: at batch 16 and above a float32-activation int8 step is compute-bound in float32 FMAs
// (16 multiply-adds an instruction; 'small' model, M = 16: ~121 GFLOP/s, the LM head 7.2 ms a
// step), while one vpdpbusd does 64 and llama.cpp's Q8_0 path quantizes its activations to 8
// bits the same way (per 32-value block; here per row, as vLLM's dynamic per-token W8A8).
// Measured on the 2-vCPU Zen 4 (AVX512-VNNI), chains of 12 layers of 768 x 2048, ms p50 of 3
// alternating rounds, float32-activation int8 loop -> this one: M = 16 3.93 -> 2.04, M = 64 13.7
// -> 8.3, M = 256 49.5 -> 26.7 (~300-360 GOP/s); at M = 1 both stream the weights (48 layers of
// 768 x 4096, 151 MB: 4.67 -> 4.66).
// Without AVX512-VNNI: an AVX2 loop (vpmaddwd on widened weights, micro_a8), else plain C++
// (correct, slow: choose.py then keeps XLA's dot).
using PanelsU8 = ffi::Buffer<ffi::U8, 4>;   // [L, P, K4, 256]

constexpr int64_t kQuad = 4 * kTile;   // bytes of one quad row of a panel
constexpr int64_t kKc4 = 64;           // quads per pass over the row blocks: 16 KiB of panel in L1

// Row m of x [M, K] float32 -> xq (K4 quads, zero-padded), sx[m], corr[m] = 128 sum_k xq.
inline void quantize_row(const float* x, int64_t K, int64_t K4, int8_t* xq, float* sx, int32_t* corr) {
  float amax = 0.f;
  int64_t k = 0;
#ifdef __AVX512F__
  __m512 m = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  amax = _mm512_reduce_max_ps(m);
#endif
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  k = 0;
#ifdef __AVX512F__
  const __m512 vi = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  __m512i vs = _mm512_setzero_si512();
  for (; k + 16 <= K; k += 16) {
    const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(x + k), vi), lo), hi);
    const __m512i q = _mm512_cvtps_epi32(v);          // MXCSR's default: round to nearest even
    vs = _mm512_add_epi32(vs, q);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + k), _mm512_cvtepi32_epi8(q));
  }
  sum = _mm512_reduce_add_epi32(vs);
#endif
  for (; k < K; ++k) {
    const int32_t q = static_cast<int32_t>(std::nearbyint(std::min(std::max(x[k] * inv, -127.f), 127.f)));
    xq[k] = static_cast<int8_t>(q);
    sum += q;
  }
  for (k = K; k < 4 * K4; ++k) xq[k] = 0;
  *sx = amax / 127.f;
  *corr = 128 * sum;
}

#if defined(__AVX2__) && !defined(__AVX512VNNI__)
// micro_a8 for one row (batch-1 decode) on AVX2 without VNNI: all 64 columns in 8 accumulators,
// one pass over the panel. The stored weight u (w + 128) turns back into w with an xor of the
// top bit; vpmaddubsw(|w|, x * sign(w)) is then exact (|w| <= 128, |x| <= 127: a pair sum at most
// 32,512 < 32,767) and vpmaddwd against ones folds each column's quad into one int32 lane; 128 x
// the chunk's sum of x makes it the sum over u, as every other path computes. Why: the pair loop
// below (8 passes of 8 columns over the chunk, the pair sums folded at the end) ran one row at
// half the int8 weight-only path's speed. 2-vCPU Zen 3, alternating builds: 768 x 2048 x 12
// layers at M = 1 0.084-0.105 -> 0.042-0.044 ms a layer; the 'small' w8a8 model's batch-1
// decode step 9.7-9.8 -> 6.1-6.9 ms p50.
inline void micro1_a8_avx2(const int8_t* x, const uint8_t* panel, int32_t* acc_buf, int64_t kn4, bool first,
                           const uint8_t* pf) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256i acc[8];
  for (int v = 0; v < 8; ++v) acc[v] = _mm256_setzero_si256();
  int32_t xsum = 0;
  for (int64_t j = 0; j < kn4; ++j) {
    prefetch_row<kQuad>(pf ? pf + j * kQuad : pf);
    int32_t q;
    std::memcpy(&q, x + 4 * j, 4);
    xsum += int32_t(x[4 * j]) + int32_t(x[4 * j + 1]) + int32_t(x[4 * j + 2]) + int32_t(x[4 * j + 3]);
    const __m256i xb = _mm256_set1_epi32(q);
    const uint8_t* row = panel + j * kQuad;
    for (int v = 0; v < 8; ++v) {
      const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * v)), flip);
      const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xb, w));
      acc[v] = _mm256_add_epi32(acc[v], _mm256_madd_epi16(p, ones));
    }
  }
  const __m256i c = _mm256_set1_epi32(128 * xsum);
  for (int v = 0; v < 8; ++v) {
    __m256i* a = reinterpret_cast<__m256i*>(acc_buf + 8 * v);
    __m256i sum = _mm256_add_epi32(acc[v], c);
    if (!first) sum = _mm256_add_epi32(sum, _mm256_loadu_si256(a));
    _mm256_storeu_si256(a, sum);
  }
}
#endif

// acc[0:MR, 0:64] (+)= xq rows (stride ldx bytes) over kn4 quads of one quad panel (int32).
template <int MR>
inline void micro_a8(const int8_t* x, int64_t ldx, const uint8_t* panel, int32_t* acc_buf, int64_t kn4, bool first,
                     const uint8_t* pf) {
#ifdef __AVX512VNNI__
  __m512i acc[MR][kVec];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVec; ++v)
      acc[m][v] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(acc_buf + m * kTile + 16 * v);
  for (int64_t j = 0; j < kn4; ++j) {
    const uint8_t* row = panel + j * kQuad;
    prefetch_row<kQuad>(pf ? pf + j * kQuad : pf);
    __m512i wv[kVec];
    for (int v = 0; v < kVec; ++v) wv[v] = _mm512_loadu_si512(row + 64 * v);
    for (int m = 0; m < MR; ++m) {
      int32_t q;
      std::memcpy(&q, x + m * ldx + 4 * j, 4);
      const __m512i xb = _mm512_set1_epi32(q);
      for (int v = 0; v < kVec; ++v) acc[m][v] = _mm512_dpbusd_epi32(acc[m][v], wv[v], xb);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVec; ++v) _mm512_storeu_si512(acc_buf + m * kTile + 16 * v, acc[m][v]);
#elif defined(__AVX2__)
  if constexpr (MR == 1) {
    micro1_a8_avx2(x, panel, acc_buf, kn4, first, pf);
    return;
  }
  // AVX2 without VNNI: the unsigned weights widened to int16 (vpmovzxbw) and multiplied against
  // the row's quad as int16 (vpmaddwd: two exact products a 32-bit lane; vpmaddubsw would saturate
  // its int16 pair sums, 255 x 127 x 2 > 32767). 8 columns at a time over the chunk: 2 accumulators
  // a row, 2 MR + 3 of the 16 ymm registers (all 64 columns at once spilled them for MR > 1);
  // the pair sums fold into column sums at the end. The row's quads are widened once per call.
  thread_local std::vector<int64_t> xw;
  xw.resize(MR * kn4);
  for (int m = 0; m < MR; ++m)
    for (int64_t j = 0; j < kn4; ++j) {
      uint64_t v = 0;
      for (int e = 0; e < 4; ++e) v |= uint64_t(uint16_t(int16_t(x[m * ldx + 4 * j + e]))) << (16 * e);
      xw[m * kn4 + j] = static_cast<int64_t>(v);
    }
  for (int g = 0; g < kTile / 8; ++g) {
    __m256i acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
    const uint8_t* col = panel + 32 * g;
    for (int64_t j = 0; j < kn4; ++j) {
      if (g == 0) prefetch_row<kQuad>(pf ? pf + j * kQuad : pf);
      const uint8_t* p = col + j * kQuad;
      const __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m256i w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
      for (int m = 0; m < MR; ++m) {
        const __m256i xb = _mm256_set1_epi64x(xw[m * kn4 + j]);
        acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(w0, xb));
        acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(w1, xb));
      }
    }
    for (int m = 0; m < MR; ++m) {
      // hadd: [c0 c1 c4 c5 | c2 c3 c6 c7]; the 64-bit permute puts the 8 columns in order
      __m256i sum = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[m][0], acc[m][1]), 0xD8);
      __m256i* a = reinterpret_cast<__m256i*>(acc_buf + m * kTile + 8 * g);
      if (!first) sum = _mm256_add_epi32(sum, _mm256_loadu_si256(a));
      _mm256_storeu_si256(a, sum);
    }
  }
#else
  (void)pf;
  for (int m = 0; m < MR; ++m) {
    int32_t* a = acc_buf + m * kTile;
    if (first) std::fill(a, a + kTile, 0);
    for (int64_t j = 0; j < kn4; ++j)
      for (int64_t c = 0; c < kTile; ++c)
        for (int e = 0; e < 4; ++e)
          a[c] += int32_t(panel[j * kQuad + 4 * c + e]) * int32_t(x[m * ldx + 4 * j + e]);
  }
#endif
}

// One quad panel (64 columns) for `rows` quantized rows into out (row stride ldo).
inline void do_panel_a8(const int8_t* xq, int64_t Kp, const float* sx, const int32_t* corr, const uint8_t* panel,
                        const float* scale, float* out, int64_t ldo, int64_t rows, int64_t K4) {
  thread_local std::vector<int32_t> acc;
  acc.resize(rows * kTile);
  // decode (one block of rows): one pass, the sums never leave the registers; more rows: K in
  // chunks that stay in L1 while every block of rows reads them
#ifdef __AVX512VNNI__
  const int64_t kc = rows <= 6 ? K4 : kKc4;
#else
  // the AVX2 loop for 2+ rows reads each chunk 8 times (8 columns a pass): keep it in L1; one row
  // (micro1_a8_avx2) reads it once
  const int64_t kc = rows == 1 ? K4 : kKc4;
#endif
  for (int64_t k0 = 0; k0 < K4; k0 += kc) {
    const int64_t kn4 = std::min(kc, K4 - k0);
    const uint8_t* chunk = panel + k0 * kQuad;
    const uint8_t* pf = rows <= 6 ? chunk + 16 * kQuad : nullptr;   // 4 KiB ahead while streaming
    for (int64_t m = 0; m < rows; m += 6)
      with_rows(std::min<int64_t>(6, rows - m), [&](auto r) {
        micro_a8<decltype(r)::value>(xq + m * Kp + 4 * k0, Kp, chunk, acc.data() + m * kTile, kn4, k0 == 0,
                                     m == 0 ? pf : nullptr);
      });
  }
  for (int64_t m = 0; m < rows; ++m) {
    const float s = sx[m];
    const int32_t c0 = corr[m];
    float* o = out + m * ldo;
    const int32_t* a = acc.data() + m * kTile;
    for (int64_t c = 0; c < kTile; ++c) o[c] = static_cast<float>(a[c] - c0) * s * scale[c];
  }
}

ffi::Error GemmI8A8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, PanelsU8 w, Scales s,
                        ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || wd[3] != kQuad)
    return ffi::Error::InvalidArgument("xlaserve_gemm_i8a8: x must be [M, K], w [L, P, K / 4, 256], y [M, N]");
  const int64_t K = xd[1], L = wd[0], P = wd[1], K4 = wd[2], N = yd[1];
  if ((K + 3) / 4 != K4 || yd[0] != xd[0] || N > P * kTile || N <= (P - 1) * kTile)
    return ffi::Error::InvalidArgument("xlaserve_gemm_i8a8: operand shapes do not agree");
  if (s.dimensions()[0] != L || s.dimensions()[1] != P * kTile)
    return ffi::Error::InvalidArgument("xlaserve_gemm_i8a8: scale must be [L, 64 P]");
  const int64_t M = live_rows(layer, xd[0], y->typed_data(), N);
  const int64_t li = layer.typed_data()[0];
  if (li < 0 || li >= L) return ffi::Error::InvalidArgument("xlaserve_gemm_i8a8: layer index out of range");
  if (M == 0) return ffi::Error::Success();
  const int64_t Kp = 4 * K4;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> sx;
  thread_local std::vector<int32_t> corr;
  xq.resize(M * Kp);
  sx.resize(M);
  corr.resize(M);
  const float* xp = x.typed_data();
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, K, K4, xq.data() + m * Kp, &sx[m], &corr[m]);
  const uint8_t* wl = w.typed_data() + li * P * K4 * kQuad;
  const float* sl = s.typed_data() + li * P * kTile;
  const int8_t* xqp = xq.data();
  const float* sxp = sx.data();
  const int32_t* cp = corr.data();
  for_each_panel(pool, M, kMc, P, N, y->typed_data(), [=](int64_t t, int64_t m0, int64_t rows, float* out, int64_t ldo) {
    do_panel_a8(xqp + m0 * Kp, Kp, sxp + m0, cp + m0, wl + t * K4 * kQuad, sl + t * kTile, out, ldo, rows, K4);
  });
  return ffi::Error::Success();
}

// 2. XlaserveDecodeAttentionF32: one query token per row against its own pages of the KV cache.
// Why: the pure-JAX attention gathers every row's whole page bucket into a new [B, S, KVH, D]
// array per layer and runs tiny batched dots over it; this reads only the row's valid keys, in
// place, once. Semantics equal jax_engine/attention/reference.py for Tq = 1: keys at positions
// s <= pos, s < kv_len and (window > 0) s > pos - window; a row with no valid key gives zeros.
// Consecutive tokens of one sequence (a prompt chunk, speculative guesses) run together
// (GroupAttention), each token still seeing exactly its own keys.

// Tree sum of the 16 lanes (4 shuffles + 4 adds instead of a 15-add chain).
inline float hsum(v16 v) {
  v += __builtin_shuffle(v, v16i{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, v16i{4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15});
  v += __builtin_shuffle(v, v16i{2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
  v += __builtin_shuffle(v, v16i{1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
  return v[0];
}

// Tree max of the 16 lanes.
inline float hmax(v16 v) {
  v16 w = __builtin_shuffle(v, v16i{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v = v > w ? v : w;
  w = __builtin_shuffle(v, v16i{4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15});
  v = v > w ? v : w;
  w = __builtin_shuffle(v, v16i{2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
  v = v > w ? v : w;
  w = __builtin_shuffle(v, v16i{1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
  v = v > w ? v : w;
  return v[0];
}

// exp on 16 lanes: 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 split in two constants),
// p the degree-7 Taylor polynomial of e^r on |r| <= ln(2)/2 (relative error ~1e-7). x is clamped
// to [-87, 88]: exp of a masked score (-1e30) gives ~1e-38 where expf gives 0.
// (V, VI: a float vector type and the int vector of its width; vexp is the 16-lane form.)
template <typename V, typename VI>
inline V vexp_t(V x) {
  x = x < -87.0f ? V{} - 87.0f : x;
  x = x > 88.0f ? V{} + 88.0f : x;
  const V t = x * 1.44269504088896341f;
  const VI ni = __builtin_convertvector(t + (t >= 0.0f ? V{} + 0.5f : V{} - 0.5f), VI);
  const V n = __builtin_convertvector(ni, V);
  const V r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  V p = V{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const VI bits = (ni + 127) << 23;                   // 2^n as a float's bit pattern
  return p * reinterpret_cast<V>(bits);
}
inline v16 vexp(v16 x) { return vexp_t<v16, v16i>(x); }

inline float dot(const float* a, const float* b, int64_t D) {
  v16 acc = v16{};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) acc += load16(a + d) * load16(b + d);
  float s = hsum(acc);
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(float* y, float a, const float* x, int64_t D) {
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) store16(y + d, load16(y + d) + load16(x + d) * a);
  for (; d < D; ++d) y[d] += a * x[d];
}

// Folds 16 vectors into one: lane k = the sum of part[k]'s 16 lanes. Four levels of pairwise
// permute-and-add (two-source shuffles), each halving the lanes a key occupies.
inline v16 fold_level(v16 a, v16 b, v16i lo, v16i hi) { return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi); }
inline v16 fold16(const v16* part) {
  const v16i lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const v16i hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const v16i lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const v16i hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const v16i lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const v16i hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const v16i lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const v16i hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  v16 c[8], e[4], g[2];
  for (int i = 0; i < 8; ++i) c[i] = fold_level(part[2 * i], part[2 * i + 1], lo8, hi8);
  for (int i = 0; i < 4; ++i) e[i] = fold_level(c[2 * i], c[2 * i + 1], lo4, hi4);
  for (int i = 0; i < 2; ++i) g[i] = fold_level(e[2 * i], e[2 * i + 1], lo2, hi2);
  return fold_level(g[0], g[1], lo1, hi1);
}

// A row of zeros standing in for an invalid or out-of-chunk key in score16 (head_dim <= kMaxD).
constexpr int64_t kMaxD = 512;
alignas(64) const float kZeroKey[kMaxD] = {};

// The 16 scores q . k[kk] (kk < 16; a null key scores 0) as one vector. The dimension loop is
// outside the key loop, so the 16 partial sums are independent chains and the FMAs pipeline;
// each key's terms are still added in dimension order, as before. Why: with the key loop
// outside, every key was one 4-deep dependent FMA chain (D = 64), ~16 cycles of latency per
// query head and key; two 128-token prompts ('small' model, 12 layers, 2-vCPU AMX Xeon)
// spent 24.5 core cycles per (query head, key) in attention.
inline v16 score16(const float* qr, const float* const* kp, int64_t D) {
  v16 part[16];
  for (int kk = 0; kk < 16; ++kk) part[kk] = v16{};
  for (int64_t d = 0; d < D; d += 16) {
    const v16 qv = load16(qr + d);
    for (int kk = 0; kk < 16; ++kk) part[kk] += qv * load16(kp[kk] + d);
  }
  return fold16(part);
}

// o[r, 0:W NV] = sum_j p[r, j] v_j for R query rows (row stride ldo; p rows of n scores) over the
// keys' value vectors at vb + slot * ldv; keys with slot < 0 are skipped. V: the float vector
// (W lanes): v16 on 16-lane builds; v8 on AVX2-only ones, where pv_nv keeps R x NV
// accumulators, NV loaded values and a broadcast within the 16 ymm registers.
template <typename V, int R, int NV>
inline void pv_rows(const float* p, int64_t n, const int64_t* slot_of, const float* vb, int64_t ldv, float* o,
                    int64_t ldo, int64_t cnt) {
  constexpr int64_t W = sizeof(V) / sizeof(float);
  V acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = V{};
  for (int64_t j = 0; j < cnt; ++j) {
    if (slot_of[j] < 0) continue;
    const float* vr = vb + slot_of[j] * ldv;
    V x[NV];
    for (int v = 0; v < NV; ++v) x[v] = loadu<V>(vr + W * v);
    for (int r = 0; r < R; ++r) {
      const float a = p[r * n + j];
      for (int v = 0; v < NV; ++v) acc[r][v] += x[v] * a;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) storeu<V>(o + r * ldo + W * v, acc[r][v]);
}

#if !(defined(__AVX2__) && !defined(__AVX512F__))
// pv_dispatch's R-row form: nv vectors of 16 columns in one pass of pv_rows.
template <int R>
inline void pv_nv(int nv, const float* p, int64_t n, const int64_t* slot_of, const float* vb, int64_t ldv, float* o,
                  int64_t ldo, int64_t cnt) {
  switch (nv) {
    case 1: pv_rows<v16, R, 1>(p, n, slot_of, vb, ldv, o, ldo, cnt); break;
    case 2: pv_rows<v16, R, 2>(p, n, slot_of, vb, ldv, o, ldo, cnt); break;
    case 3: pv_rows<v16, R, 3>(p, n, slot_of, vb, ldv, o, ldo, cnt); break;
    default: pv_rows<v16, R, 4>(p, n, slot_of, vb, ldv, o, ldo, cnt); break;
  }
}

// out[kk] = scale * (q . k[kk]) for a chunk of 16 keys (kp as score16's).
inline void score_chunk(const float* qr, const float* const* kp, int64_t D, float scale, float* out) {
  store16(out, score16(qr, kp, D) * scale);
}

// Softmax in place over the first n entries of a score row (max, exp, normalise).
inline void softmax_row(float* sr, int64_t n) {
  // the maximum 16 lanes at a time (a scalar max is one 4-cycle dependent chain per element)
  float mx = sr[0];
  int64_t j = 0;
  if (n >= 16) {
    v16 m = load16(sr);
    for (j = 16; j + 16 <= n; j += 16) {
      const v16 x = load16(sr + j);
      m = x > m ? x : m;
    }
    mx = hmax(m);
  }
  for (; j < n; ++j) mx = std::max(mx, sr[j]);
  float sum = 0.f;
  j = 0;
  for (; j + 16 <= n; j += 16) {
    const v16 e = vexp(load16(sr + j) - mx);
    store16(sr + j, e);
    sum += hsum(e);
  }
  for (; j < n; ++j) { sr[j] = std::exp(sr[j] - mx); sum += sr[j]; }
  const float inv = 1.f / sum;
  for (j = 0; j < n; ++j) sr[j] *= inv;
}
#else
// AVX2-only builds: the same three helpers on 8-lane vectors. GCC lowers the 16-lane forms above
// through the stack on such a target: score16's 16 accumulators are 32 ymm registers, fold16's
// two-source shuffles and hsum / hmax are permutes of 64-byte vectors, pv_rows' 4 x 4
// 16-lane accumulators 32 more (the compiled decode attention had ~7,500 of its ~12,700 instructions
// touching the stack). The decode kernel alone, 12 layers of 16 rows x 200 keys on scattered
// 16-slot pages (4 KV heads of 64, 3 query heads each; 79 MB of K and V), 2-vCPU Zen 3, ms a
// step: 18.7-21.7 -> 6.5-7.3 (one row: 1.29 -> 0.39); the 'small' float32 model's batch-16
// decode step (128-token prompts) 62-67 -> 47-54 ms p50. What is left is memory: with the
// scoring or the P V loop removed the other ran at ~8 GB/s on one core, its loads and prefetches
// the stalled instructions (a P V that walks the keys chunk by chunk instead of head by head, or
// no software prefetch, measured the same).
typedef int v8i __attribute__((vector_size(32)));

// lane k = the sum of p[k]'s 8 lanes (three rounds of pairwise horizontal adds, then the two
// 128-bit halves added)
inline __m256 fold8(const __m256 (&p)[8]) {
  const __m256 t0 = _mm256_hadd_ps(p[0], p[1]), t1 = _mm256_hadd_ps(p[2], p[3]);
  const __m256 t2 = _mm256_hadd_ps(p[4], p[5]), t3 = _mm256_hadd_ps(p[6], p[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The 8 scores q . k[kk] (kk < 8), the dimension loop outside the key loop as score16's: 8
// independent FMA chains, each key's weights read straight into its FMA.
inline __m256 score8(const float* qr, const float* const* kp, int64_t D) {
  __m256 part[8];
  for (int kk = 0; kk < 8; ++kk) part[kk] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(qr + d);
    for (int kk = 0; kk < 8; ++kk) part[kk] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[kk] + d), part[kk]);
  }
  return fold8(part);
}

inline void score_chunk(const float* qr, const float* const* kp, int64_t D, float scale, float* out) {
  const __m256 sc = _mm256_set1_ps(scale);
  _mm256_storeu_ps(out, _mm256_mul_ps(score8(qr, kp, D), sc));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(score8(qr, kp + 8, D), sc));
}

// pv_dispatch's R-row form on AVX2: nv vectors of 16 columns as passes of pv_rows on 8 lanes.
template <int R>
inline void pv_nv(int nv, const float* p, int64_t n, const int64_t* slot_of, const float* vb, int64_t ldv, float* o,
                  int64_t ldo, int64_t cnt) {
  constexpr int kStep = R <= 2 ? 4 : 2;                  // ymm columns a pass: 32 for 1-2 rows, 16 for 3-4
  for (int c = 0; c < 2 * nv; c += kStep) {
    if (2 * nv - c >= kStep)
      pv_rows<v8, R, kStep>(p, n, slot_of, vb + 8 * c, ldv, o + 8 * c, ldo, cnt);
    else
      pv_rows<v8, R, 2>(p, n, slot_of, vb + 8 * c, ldv, o + 8 * c, ldo, cnt);
  }
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// softmax_row on 8-lane vectors (vexp_t at 8 lanes; the sum kept in a vector until the end).
inline void softmax_row(float* sr, int64_t n) {
  float mx = sr[0];
  int64_t j = 0;
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(sr);
    for (j = 8; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sr + j));
    mx = hmax8(m);
  }
  for (; j < n; ++j) mx = std::max(mx, sr[j]);
  __m256 vsum = _mm256_setzero_ps();
  j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8 e = vexp_t<v8, v8i>(*reinterpret_cast<const v8u*>(sr + j) - mx);
    *reinterpret_cast<v8u*>(sr + j) = e;
    vsum = _mm256_add_ps(vsum, reinterpret_cast<__m256>(e));
  }
  float sum = hsum8(vsum);
  for (; j < n; ++j) { sr[j] = std::exp(sr[j] - mx); sum += sr[j]; }
  const float inv = 1.f / sum;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (j = 0; j + 8 <= n; j += 8) _mm256_storeu_ps(sr + j, _mm256_mul_ps(_mm256_loadu_ps(sr + j), vinv));
  for (; j < n; ++j) sr[j] *= inv;
}
#endif

// o[r] = sum over keys j < cnt of p[r * n + j] * v[j] for r rows (<= 4) and nv vectors of 16
// columns (<= 4); n is the row stride of p (cnt = n: every key).
inline void pv_dispatch(int r, int nv, const float* p, int64_t n, const int64_t* slot_of, const float* vb, int64_t ldv,
                        float* o, int64_t ldo, int64_t cnt) {
  switch (r) {
    case 1: pv_nv<1>(nv, p, n, slot_of, vb, ldv, o, ldo, cnt); break;
    case 2: pv_nv<2>(nv, p, n, slot_of, vb, ldv, o, ldo, cnt); break;
    case 3: pv_nv<3>(nv, p, n, slot_of, vb, ldv, o, ldo, cnt); break;
    default: pv_nv<4>(nv, p, n, slot_of, vb, ldv, o, ldo, cnt); break;
  }
}

// The largest run of consecutive tokens the grouped path takes together (see GroupAttention).
constexpr int64_t kGroup = 8;

// Attention for nq consecutive tokens b0.. of one sequence (a prompt chunk, or a decode row's
// guesses): the same page table, positions p0, p0 + 1, ..., each seeing keys up to its own
// position (kv_len = position + 1). Why grouped: token by token (the decode path) every token
// re-read its keys and values from L2 (2 KiB per key for 4 KV heads of 64); here a chunk of 16
// keys is read into L1 once and scored for every token of the group, and the values are summed
// per token over its own keys only. Same arithmetic per score and output as the decode path
// (score16, softmax_row, pv_rows), so the two agree to float rounding. Two 128-token prompts,
// 12 layers of the 'small' model, 2-vCPU AMX Xeon, ms: 10.0 token by token -> 8.8 grouped ->
// 7.2 with score16 -> 6.0 with softmax_row's vector maximum (16.8 core cycles per query head and
// key; the decode path's 32 rows x 192 keys went 6.7 -> 5.5 with the same two changes).
void GroupAttention(const float* qp, const float* kl, const float* vl, const int32_t* table_row, int64_t b0,
                    int64_t nq, int64_t p0, int64_t h0, int64_t h1, int64_t H, int64_t G, int64_t D,
                    int64_t page_size, int64_t slots, int64_t window, float scale, float* op) {
  const int64_t nh = h1 - h0;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0;
  const int64_t hi = p0 + nq;                           // keys [lo, hi): the last token's own included
  const int64_t n = hi - lo;
  for (int64_t t = 0; t < nq; ++t) {
    float* ob = op + ((b0 + t) * H + h0) * G * D;
    std::fill(ob, ob + nh * G * D, 0.f);
  }
  if (n <= 0) return;
  std::vector<int64_t> slot_of(n);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = lo + j;
    const int64_t slot = static_cast<int64_t>(table_row[p / page_size]) * page_size + p % page_size;
    slot_of[j] = (slot < 0 || slot >= slots) ? -1 : slot;
  }
  // token t sees keys [first(t), end(t)) of the n (relative to lo)
  auto first = [&](int64_t t) { return window > 0 ? std::max<int64_t>(0, p0 + t - window + 1) - lo : 0; };
  auto end = [&](int64_t t) { return p0 + t + 1 - lo; };
  const int64_t rows = nq * nh * G;                     // score rows [t][hh][g], n wide
  std::vector<float> s(rows * n);
  const int64_t lines = nh * D / 16;
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, n - j0);
    for (int64_t kk = 0; kk < 16; ++kk) {                // the next chunk's keys into L1, as the decode path
      const int64_t jn = j0 + 16 + kk;
      if (jn < n && slot_of[jn] >= 0) {
        const float* kr = kl + (slot_of[jn] * H + h0) * D;
        for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(kr + 16 * l, 0, 3);
      }
    }
    for (int64_t t = 0; t < nq; ++t) {
      const int64_t e = std::min<int64_t>(cnt, end(t) - j0);   // this token's keys in the chunk
      if (e <= 0) continue;
      const int64_t f = first(t);
      for (int64_t hh = 0; hh < nh; ++hh) {
        const float* kp[16];
        for (int64_t kk = 0; kk < 16; ++kk)
          kp[kk] = kk < e && slot_of[j0 + kk] >= 0 ? kl + (slot_of[j0 + kk] * H + h0 + hh) * D : kZeroKey;
        for (int64_t g = 0; g < G; ++g) {
          const float* qr = qp + (((b0 + t) * H + h0 + hh) * G + g) * D;
          float sums[16];
          score_chunk(qr, kp, D, scale, sums);
          float* sr = s.data() + ((t * nh + hh) * G + g) * n + j0;
          for (int64_t kk = 0; kk < e; ++kk)
            sr[kk] = (slot_of[j0 + kk] < 0 || j0 + kk < f) ? -1e30f : sums[kk];
        }
      }
    }
  }
  for (int64_t t = 0; t < nq; ++t)
    for (int64_t r = 0; r < nh * G; ++r) softmax_row(s.data() + (t * nh * G + r) * n, end(t));
  for (int64_t t = 0; t < nq; ++t) {
    float* ob = op + ((b0 + t) * H + h0) * G * D;
    for (int64_t hh = 0; hh < nh; ++hh)
      for (int64_t g0 = 0; g0 < G; g0 += 4)
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
          const int r = static_cast<int>(std::min<int64_t>(4, G - g0));
          const int nv = static_cast<int>(std::min<int64_t>(4, (D - d0) / 16));
          pv_dispatch(r, nv, s.data() + ((t * nh + hh) * G + g0) * n, n, slot_of.data(), vl + (h0 + hh) * D + d0,
                      H * D, ob + (hh * G + g0) * D + d0, D, end(t));
        }
  }
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, Rank4 q, Rank4 kc, Rank4 vc, I32x2 page_table, I32x1 kv_lens, I32x1 positions, I32x0 layer, int64_t page_size, int64_t window, float scale,
                               Out4 out) {
  // q, out [B, KVH, G, D]; kc, vc [L, slots, KVH, D]; page_table [B, P]
  const auto qd = q.dimensions();
  const auto cd = kc.dimensions();
  const int64_t B = qd[0], H = qd[1], G = qd[2], D = qd[3];
  const int64_t L = cd[0], slots = cd[1], P = page_table.dimensions()[1];
  if (cd[2] != H || cd[3] != D || vc.dimensions()[1] != slots || page_table.dimensions()[0] != B ||
      kv_lens.dimensions()[0] != B || positions.dimensions()[0] != B || page_size <= 0)
    return ffi::Error::InvalidArgument("xlaserve_decode_attention: operand shapes do not agree");
  const int64_t li = layer.typed_data()[0];
  if (li < 0 || li >= L) return ffi::Error::InvalidArgument("xlaserve_decode_attention: layer index out of range");
  const float* qp = q.typed_data();
  const float* kl = kc.typed_data() + li * slots * H * D;
  const float* vl = vc.typed_data() + li * slots * H * D;
  const int32_t* pt = page_table.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  const int32_t* pos = positions.typed_data();
  float* op = out->typed_data();
  const int64_t cap = P * page_size;
  // one item = one row's heads [h0, h1): a key slot's heads are contiguous (H * D floats), so an
  // item streams whole slots; rows are split over heads only when there are too few rows to share
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  int64_t keys = 0;
  for (int64_t b = 0; b < B; ++b) keys += std::max<int64_t>(0, std::min<int64_t>(lens[b], cap));
  // < 64 KiB of K (64 keys of 4 x 64 heads): one thread. One decode row at 192 keys (192 KiB of
  // K) split over the KV heads on two threads took 0.19-0.30 instead of 0.35-0.40 ms a step
  // (12 layers, 'small' int8 model, 2-vCPU Zen 4; the threshold was 512 KiB)
  const bool small = keys * H * D < (int64_t{1} << 14);
  // work groups: runs of up to kGroup consecutive tokens of one sequence (same page table,
  // consecutive positions, each seeing keys up to its own) go to GroupAttention; every other
  // token (a decode row's, a sliding-window row's) is a group of one on the path below
  std::vector<std::pair<int64_t, int64_t>> groups;      // (first token, tokens)
  groups.reserve(B);
  for (int64_t b = 0; b < B;) {
    int64_t nq = 1;
    auto chains = [&](int64_t c) { return lens[c] == pos[c] + 1 && lens[c] > 0 && lens[c] <= cap; };
    if (D % 16 == 0 && D <= kMaxD && chains(b))
      while (nq < kGroup && b + nq < B && pos[b + nq] == pos[b] + nq && chains(b + nq) &&
             std::memcmp(pt + b * P, pt + (b + nq) * P, P * sizeof(int32_t)) == 0)
        ++nq;
    groups.emplace_back(b, nq);
    b += nq;
  }
  const int64_t NG = static_cast<int64_t>(groups.size());
  const int64_t split = small ? 1 : std::min<int64_t>(H, std::max<int64_t>(1, (2 * threads + NG - 1) / NG));
  const int64_t hstep = (H + split - 1) / split;
  const auto* gp = groups.data();
  parallel_for(pool, NG * split, 1, [=](int64_t item) {
    const int64_t b = gp[item / split].first, nq = gp[item / split].second;
    const int64_t h0 = (item % split) * hstep, h1 = std::min(H, h0 + hstep);
    if (h0 >= h1) return;
    if (nq > 1) {
      GroupAttention(qp, kl, vl, pt + b * P, b, nq, pos[b], h0, h1, H, G, D, page_size, slots, window, scale, op);
      return;
    }
    const int64_t nh = h1 - h0;
    float* ob = op + (b * H + h0) * G * D;
    std::fill(ob, ob + nh * G * D, 0.f);
    const int64_t hi = std::min<int64_t>({static_cast<int64_t>(lens[b]), static_cast<int64_t>(pos[b]) + 1, cap});
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos[b] - window + 1) : 0;
    if (hi <= lo) return;
    const int64_t n = hi - lo, rows = nh * G;
    const float* qb = qp + (b * H + h0) * G * D;        // [nh, G, D]
    std::vector<float> s(rows * n);                     // scores [nh * G, n]
    std::vector<int64_t> slot_of(n);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t p = lo + j;
      const int64_t slot = static_cast<int64_t>(pt[b * P + p / page_size]) * page_size + p % page_size;
      slot_of[j] = (slot < 0 || slot >= slots) ? -1 : slot;   // -1 only with a corrupt page table
    }
    if (D % 16 == 0 && D <= kMaxD) {
      // 16 keys at a time: 16 dot products' partial vectors folded into one vector of 16 sums
      // (fold16: 15 adds and 30 permutes instead of 16 horizontal sums of 8 operations each)
      // While a chunk of 16 keys is scored, the next chunk's keys and this chunk's values are
      // prefetched (the values for the second pass, into L2): the slots sit on scattered pages, so
      // the hardware prefetcher restarts at every one. 12 layers of 32 rows x 192 keys (4 KV heads
      // of 64, float32; 151 MB of K and V): 7.7-8.3 -> 6.3-6.5 ms on the 2-vCPU AMX Xeon (a
      // 31.7 GB/s read rate puts the floor at 4.8 ms); a prefetch distance of 32 keys, or also
      // prefetching the first chunk, measured the same; spreading the prefetches over the
      // scoring loop, within noise. (5.5 ms since score16 and softmax_row.)
      const int64_t lines = nh * D / 16;               // 64-byte lines of one slot's heads
      for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t cnt = std::min<int64_t>(16, n - j0);
        for (int64_t kk = 0; kk < 16; ++kk) {
          const int64_t jn = j0 + 16 + kk;
          if (jn < n && slot_of[jn] >= 0) {
            const float* kr = kl + (slot_of[jn] * H + h0) * D;
            for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(kr + 16 * l, 0, 3);
          }
          if (kk < cnt && slot_of[j0 + kk] >= 0) {
            const float* vr = vl + (slot_of[j0 + kk] * H + h0) * D;
            for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(vr + 16 * l, 0, 2);
          }
        }
        for (int64_t hh = 0; hh < nh; ++hh) {
          const float* kp[16];
          for (int64_t kk = 0; kk < 16; ++kk)
            kp[kk] = kk < cnt && slot_of[j0 + kk] >= 0 ? kl + (slot_of[j0 + kk] * H + h0 + hh) * D : kZeroKey;
          for (int64_t g = 0; g < G; ++g) {
            const float* qr = qb + (hh * G + g) * D;
            float sums[16];
            score_chunk(qr, kp, D, scale, sums);
            float* sr = s.data() + (hh * G + g) * n + j0;
            for (int64_t kk = 0; kk < cnt; ++kk) sr[kk] = slot_of[j0 + kk] < 0 ? -1e30f : sums[kk];
          }
        }
      }
    } else {
      for (int64_t j = 0; j < n; ++j) {
        if (slot_of[j] < 0) { for (int64_t r = 0; r < rows; ++r) s[r * n + j] = -1e30f; continue; }
        const float* kr = kl + (slot_of[j] * H + h0) * D;  // [nh, D] contiguous
        for (int64_t hh = 0; hh < nh; ++hh)
          for (int64_t g = 0; g < G; ++g) s[(hh * G + g) * n + j] = dot(qb + (hh * G + g) * D, kr + hh * D, D) * scale;
      }
    }
    for (int64_t r = 0; r < rows; ++r) softmax_row(s.data() + r * n, n);
    if (D % 16 == 0) {
      // out rows in registers: up to 4 query heads of one KV head x 64 columns, every value
      // vector loaded once for them (the same per-element sums, in the same key order, as axpy)
      for (int64_t hh = 0; hh < nh; ++hh)
        for (int64_t g0 = 0; g0 < G; g0 += 4)
          for (int64_t d0 = 0; d0 < D; d0 += 64) {
            const int r = static_cast<int>(std::min<int64_t>(4, G - g0));
            const int nv = static_cast<int>(std::min<int64_t>(4, (D - d0) / 16));
            const float* p = s.data() + (hh * G + g0) * n;
            const float* vb = vl + (h0 + hh) * D + d0;
            float* o = ob + (hh * G + g0) * D + d0;
            pv_dispatch(r, nv, p, n, slot_of.data(), vb, H * D, o, D, n);
          }
    } else {
      for (int64_t j = 0; j < n; ++j) {
        if (slot_of[j] < 0) continue;
        const float* vr = vl + (slot_of[j] * H + h0) * D;
        for (int64_t hh = 0; hh < nh; ++hh)
          for (int64_t g = 0; g < G; ++g) axpy(ob + (hh * G + g) * D, s[(hh * G + g) * n + j], vr + hh * D, D);
      }
    }
  }, small, B <= kOwnRows);
  return ffi::Error::Success();
}

// 3. XlaserveBlasGemmF32: y[M, N] = x[M, K] @ w[layer] with w in XLA's own layout [L, K, N]
// (or [L, N, K] with trans_b, a tied LM head read from the [V, H] embedding),
// through a library sgemm (the OpenBLAS that numpy ships; cpu.py finds it and hands over the
// function pointer with XlaserveSetSgemm). Why: on some hosts XLA's dot reaches a third of a
// tuned BLAS at prefill-sized M (an Ice Lake host: 78 vs 227 GFLOP/s); on others (Zen 4 here) the
// two are level. choose.py times it beside the other paths and keeps it only where it wins. Like
// the panel kernel it takes the stacked weight whole with a layer index (no per-layer copy).
using SgemmLP64 = void (*)(int, int, int, int32_t, int32_t, int32_t, float, const float*, int32_t,
                           const float*, int32_t, float, float*, int32_t);
using SgemmILP64 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t,
                            const float*, int64_t, float, float*, int64_t);
std::atomic<void*> g_sgemm{nullptr};
std::atomic<int> g_sgemm_ilp64{0};

using Stacked = ffi::Buffer<ffi::F32, 3>;   // [L, K, N]

// The library sgemm over y's rows (or columns) in one part per thread, each part a single-threaded
// sgemm on our helpers or XLA's pool (the library's own pool is set to one thread by cpu.py), then
// (bias) y + bias and (kGelu) HF's exact GELU over the part while it is still in cache. Why not the
// library's threads: they spin after each call, competing with XLA's pool for the same cores, and
// all-MiniLM-L6-v2 at 32 sentences ran 110 against 134 sentences/s on the panel kernel with them
// (2-vCPU Zen 3, alternating rounds); with one part per thread on ours, 146 against 141.
template <bool kGelu>
ffi::Error blas_run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, Stacked& w, ffi::Buffer<ffi::S32>& layer,
                    int64_t trans_b, const float* bias, int64_t bias_n, ffi::ResultBuffer<ffi::F32>& y) {
  void* fn = g_sgemm.load(std::memory_order_acquire);
  if (fn == nullptr) return ffi::Error::Internal("xlaserve_blas_gemm: no sgemm registered");
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("xlaserve_blas_gemm: x must be [M, K], w [L, K, N] ([L, N, K]), y [M, N]");
  int64_t M = xd[0];
  const int64_t K = xd[1], L = wd[0], N = trans_b ? wd[1] : wd[2];
  if (wd[trans_b ? 2 : 1] != K || yd[0] != M || yd[1] != N)
    return ffi::Error::InvalidArgument("xlaserve_blas_gemm: operand shapes do not agree");
  if (bias != nullptr && bias_n != N)
    return ffi::Error::InvalidArgument("xlaserve_blas_gemm: bias does not match the output columns");
  const int64_t li = layer.typed_data()[0];
  if (li < 0 || li >= L) return ffi::Error::InvalidArgument("xlaserve_blas_gemm: layer index out of range");
  if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX)
    return ffi::Error::InvalidArgument("xlaserve_blas_gemm: dimension too large for a 32-bit BLAS");
  if (M == 0 || N == 0) return ffi::Error::Success();
  M = live_rows(layer, M, y->typed_data(), N);
  if (M == 0) return ffi::Error::Success();
  const float* wl = w.typed_data() + li * K * N;
  constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
  const int tb = trans_b ? kTrans : kNoTrans;
  const int64_t ldb = trans_b ? K : N;
  const bool ilp64 = g_sgemm_ilp64.load(std::memory_order_relaxed);
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  auto part = [&](int64_t m0, int64_t mr, int64_t n0, int64_t nc) {
    const float* b = trans_b ? wl + n0 * K : wl + n0;
    float* out = yp + m0 * N + n0;
    if (ilp64)
      reinterpret_cast<SgemmILP64>(fn)(kRowMajor, kNoTrans, tb, mr, nc, K, 1.f, xp + m0 * K, K, b, ldb, 0.f, out, N);
    else
      reinterpret_cast<SgemmLP64>(fn)(kRowMajor, kNoTrans, tb, int32_t(mr), int32_t(nc), int32_t(K), 1.f,
                                      xp + m0 * K, int32_t(K), b, int32_t(ldb), 0.f, out, int32_t(N));
    if (bias != nullptr) bias_act<kGelu>(out, N, mr, bias + n0, nc);
  };
  // rows split when each thread gets a few register tiles' worth, else columns (whole 16s)
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (M >= 32 * threads) {
    const int64_t mr = (M + threads - 1) / threads;
    parallel_for(pool, threads, 1, [&](int64_t i) {
      if (i * mr < M) part(i * mr, std::min(mr, M - i * mr), 0, N);
    }, false, M <= kOwnRows);
  } else {
    const int64_t nc = (N + threads * 16 - 1) / (threads * 16) * 16;
    parallel_for(pool, threads, 1, [&](int64_t i) {
      if (i * nc < N) part(0, M, i * nc, std::min(nc, N - i * nc));
    }, false, true);
  }
  return ffi::Error::Success();
}

ffi::Error BlasGemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Stacked w, ffi::Buffer<ffi::S32> layer,
                        int64_t trans_b, ffi::ResultBuffer<ffi::F32> y) {
  return blas_run<false>(pool, x, w, layer, trans_b, nullptr, 0, y);
}

// XlaserveBlasGemmBiasF32 / XlaserveBlasGemmBiasGeluF32: the same + bias [N] (and the GELU): an
// encoder's projections on the library path, finished as GemmBiasImpl finishes the kernel's.
template <bool kGelu>
ffi::Error BlasGemmBiasImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Stacked w, ffi::Buffer<ffi::S32> layer,
                            ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> y) {
  return blas_run<kGelu>(pool, x, w, layer, 0, bias.typed_data(), int64_t(bias.element_count()), y);
}

// 4. XlaserveEncoderAttentionF32: an encoder's bidirectional attention over a padded batch.
// qkv [B, S, 3 H D] is the fused projection's output as it comes (q, k, v, each [H, D]); mask
// [B, S] int32 (> 0: a real token); out [B, S, H D]. Query i of row b attends to the keys j with
// mask[b, j] > 0: out = softmax_j(q_i . k_j * scale) v_j, as models/bert.py's XLA path with its
// -inf-like bias. Padding queries (mask 0) get zeros: nothing reads them (padded keys are masked
// in every layer, and pooling / the classifier read real tokens only).
// Why: XLA:CPU runs the two batched [S, D] x [D, S] dots per (row, head) as tiny GEMMs plus
// transposes, softmax and mask passes over [B, H, S, S]; all-MiniLM-L6-v2 at 32 x 48 tokens
// spent ~30 of 155 ms there. Here one item is one (row, head): its valid keys are copied once,
// transposed ([D, n], so 16 keys' scores are one vector: no horizontal sums), its values [n, D]
// contiguous, and 4 query rows share every key and value load. D must be a multiple of 16 (the
// Python side keeps XLA's path otherwise).
using Rank3 = ffi::Buffer<ffi::F32, 3>;
using Rank2 = ffi::Buffer<ffi::F32, 2>;

// r[i] = row i of a 16 x 16 float block; on return r[d] = column d. Unpacks within 128-bit lanes,
// then a 4 x 4 transpose of the lanes: 64 shuffles instead of 256 scalar moves. With it and
// encoder_pv, all-MiniLM-L6-v2's attention over 32 packed sentences (1,178-1,275 tokens, 2-vCPU
// AMX Xeon) took 1.02 -> 0.82 ms a layer (the scalar transposition was ~17 % of the kernel's
// samples, the PV accumulators lived on the stack).
#ifdef __AVX512F__
inline void transpose16x16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[4 * i]), _mm512_castps_pd(t[4 * i + 2])));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[4 * i]), _mm512_castps_pd(t[4 * i + 2])));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[4 * i + 1]), _mm512_castps_pd(t[4 * i + 3])));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[4 * i + 1]), _mm512_castps_pd(t[4 * i + 3])));
  }
  for (int e = 0; e < 4; ++e) {     // u[4 i + e], lane L: rows 4i..4i+3, element 4 L + e
    const __m512 v0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x44), v1 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xEE);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x44), v3 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    r[4 + e] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    r[8 + e] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    r[12 + e] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}
#endif

// out rows (4, `ldo` apart) = p @ v over n keys: p the 4 rows' probabilities (`np` apart, scaled by
// inv at the end), v [n, D] contiguous, NV vectors of 16 columns from column d0. A template so the
// 4 x NV accumulators stay in registers (a run-time width kept them on the stack).
template <int NV>
inline void encoder_pv(const float* p, int64_t np, const float* v, int64_t n, int64_t D, int64_t d0,
                       const float inv[4], float* const orow[4], int64_t nr) {
  v16 acc[4][NV] = {};
  for (int64_t j = 0; j < n; ++j) {
    const float* vr = v + j * D + d0;
    v16 x[NV];
    for (int c = 0; c < NV; ++c) x[c] = load16(vr + 16 * c);
    for (int r = 0; r < 4; ++r) {
      const float w = p[r * np + j];
      for (int c = 0; c < NV; ++c) acc[r][c] += x[c] * w;
    }
  }
  for (int64_t r = 0; r < nr; ++r)
    for (int c = 0; c < NV; ++c) store16(orow[r] + d0 + 16 * c, acc[r][c] * inv[r]);
}

// Scores of 4 query rows against NB blocks of 16 keys (kt: the keys transposed, [D, np]; `left`
// keys from the first block on are real, the rest get -1e30): 4 x NB independent accumulators
// over the D loop instead of 4 per block. Measured level on all-MiniLM-L6-v2's ~37-token
// sentences (~1.0 ms a layer either way), where the loads, the transposition and the PV loop's
// spilled accumulators were what cost; kept for longer sequences, whose blocks are many.
template <int NB>
inline void encoder_scores(const float* kt, int64_t np, const float* const qr[4], int64_t D, int64_t left,
                           float scale, float* sc) {
  const v16 lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  v16 acc[4][NB] = {};
  for (int64_t d = 0; d < D; ++d) {
    v16 kv[NB];
    for (int b = 0; b < NB; ++b) kv[b] = load16(kt + d * np + 16 * b);
    for (int r = 0; r < 4; ++r) {
      const float q = qr[r][d];
      for (int b = 0; b < NB; ++b) acc[r][b] += kv[b] * q;
    }
  }
  for (int b = 0; b < NB; ++b) {
    const v16i live = lanes < static_cast<float>(left - 16 * b);   // keys past n: -1e30, exp 0 below
    for (int r = 0; r < 4; ++r) store16(sc + r * np + 16 * b, live ? acc[r][b] * scale : v16{} - 1e30f);
  }
}

// One (sequence, head) of an encoder's self-attention: the n tokens keys[0..n) of one sequence
// (indices into rows of `base`, `row` floats apart, q at +0, k at +HD, v at +2 HD, already offset
// to this head) attend to each other; out rows (`ldo` floats apart, offset to this head) of those
// tokens get the result.
#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2-only builds: the decode attention's 8-lane helpers (score_chunk, softmax_row,
// pv_dispatch), which read keys and values where they lie (no transposed copy). The 16-lane form
// below kept its 4 x NB score and 4 x NV output accumulators (up to 32 ymm registers each) on the
// stack there: all-MiniLM-L6-v2's packed 40-token program (one 37-token sentence), 2-vCPU Zen 3,
// spent 30 % of its samples in it.
void encoder_attend(const float* base, int64_t row, const int64_t* keys, int64_t n, int64_t D, int64_t HD,
                    float scale, float* ob, int64_t ldo) {
  if (n == 0) return;
  std::vector<float> sc(4 * n), tmp(4 * D);
  for (int64_t i0 = 0; i0 < n; i0 += 4) {
    const int64_t nr = std::min<int64_t>(4, n - i0);
    for (int64_t r = 0; r < nr; ++r) {
      const float* qr = base + keys[i0 + r] * row;
      float* sr = sc.data() + r * n;
      for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t e = std::min<int64_t>(16, n - j0);
        const float* kp[16];
        for (int64_t kk = 0; kk < 16; ++kk)      // past the last key: any real key, its score unused
          kp[kk] = base + keys[j0 + (kk < e ? kk : 0)] * row + HD;
        float sums[16];
        score_chunk(qr, kp, D, scale, sums);
        std::memcpy(sr + j0, sums, e * sizeof(float));
      }
      softmax_row(sr, n);
    }
    for (int64_t d0 = 0; d0 < D; d0 += 64)
      pv_dispatch(static_cast<int>(nr), static_cast<int>(std::min<int64_t>(4, (D - d0) / 16)), sc.data(), n, keys,
                  base + 2 * HD + d0, row, tmp.data() + d0, D, n);
    for (int64_t r = 0; r < nr; ++r) std::memcpy(ob + keys[i0 + r] * ldo, tmp.data() + r * D, D * sizeof(float));
  }
}
#else
void encoder_attend(const float* base, int64_t row, const int64_t* keys, int64_t n, int64_t D, int64_t HD,
                    float scale, float* ob, int64_t ldo) {
  if (n == 0) return;
  const int64_t np = (n + 15) / 16 * 16;
  const v16 lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  std::vector<float> kt(D * np, 0.f), vv(n * D), sc(4 * np);
  for (int64_t j = 0; j < n; ++j) std::memcpy(vv.data() + j * D, base + keys[j] * row + 2 * HD, D * sizeof(float));
  for (int64_t jb = 0; jb < n; jb += 16) {                     // keys transposed, 16 x 16 blocks
    const int64_t m = std::min<int64_t>(16, n - jb);
    for (int64_t c = 0; c < D; c += 16) {
#ifdef __AVX512F__
      __m512 blk[16];
      for (int64_t j = 0; j < 16; ++j)
        blk[j] = j < m ? _mm512_loadu_ps(base + keys[jb + j] * row + HD + c) : _mm512_setzero_ps();
      transpose16x16(blk);
      for (int64_t d = 0; d < 16; ++d) _mm512_storeu_ps(kt.data() + (c + d) * np + jb, blk[d]);
#else     // neither AVX-512 nor AVX2: element by element (kt starts zeroed, so keys past m stay 0)
      for (int64_t j = 0; j < m; ++j) {
        const float* kr = base + keys[jb + j] * row + HD + c;
        for (int64_t d = 0; d < 16; ++d) kt[(c + d) * np + jb + j] = kr[d];
      }
#endif
    }
  }
  for (int64_t i0 = 0; i0 < n; i0 += 4) {
    const int64_t nr = std::min<int64_t>(4, n - i0);
    const float* qr[4];
    float* orow[4];
    for (int64_t r = 0; r < 4; ++r) {
      const int64_t qi = keys[i0 + std::min(r, nr - 1)];      // short blocks repeat their last row
      qr[r] = base + qi * row;
      orow[r] = ob + qi * ldo;
    }
    for (int64_t jb = 0; jb < np; jb += 64) {                  // scores: 16 keys per vector, up to 64 at once
      switch (std::min<int64_t>(4, (np - jb) / 16)) {
        case 4: encoder_scores<4>(kt.data() + jb, np, qr, D, n - jb, scale, sc.data() + jb); break;
        case 3: encoder_scores<3>(kt.data() + jb, np, qr, D, n - jb, scale, sc.data() + jb); break;
        case 2: encoder_scores<2>(kt.data() + jb, np, qr, D, n - jb, scale, sc.data() + jb); break;
        default: encoder_scores<1>(kt.data() + jb, np, qr, D, n - jb, scale, sc.data() + jb); break;
      }
    }
    float inv[4];
    for (int r = 0; r < 4; ++r) {                              // softmax over the n valid keys, 16 at a time
      float* sr = sc.data() + r * np;
      v16 mx = load16(sr);
      for (int64_t jb = 16; jb < np; jb += 16) { const v16 x = load16(sr + jb); mx = x > mx ? x : mx; }
      const float m = hmax(mx);
      v16 sum = v16{};
      for (int64_t jb = 0; jb < np; jb += 16) {
        const v16 e = (lanes < static_cast<float>(n - jb)) ? vexp(load16(sr + jb) - m) : v16{};
        store16(sr + jb, e);
        sum += e;
      }
      inv[r] = 1.f / hsum(sum);
    }
    for (int64_t d0 = 0; d0 < D; d0 += 64) {                   // out = p @ v, 4 rows x up to 64 columns
      switch (std::min<int64_t>(4, (D - d0) / 16)) {
        case 4: encoder_pv<4>(sc.data(), np, vv.data(), n, D, d0, inv, orow, nr); break;
        case 3: encoder_pv<3>(sc.data(), np, vv.data(), n, D, d0, inv, orow, nr); break;
        case 2: encoder_pv<2>(sc.data(), np, vv.data(), n, D, d0, inv, orow, nr); break;
        default: encoder_pv<1>(sc.data(), np, vv.data(), n, D, d0, inv, orow, nr); break;
      }
    }
  }
}

#endif

ffi::Error EncoderAttentionImpl(ffi::ThreadPool pool, Rank3 qkv, I32x2 mask, int64_t heads, float scale,
                                ffi::ResultBuffer<ffi::F32, 3> out) {
  const auto qd = qkv.dimensions();
  const int64_t B = qd[0], S = qd[1], H = heads;
  if (H <= 0 || qd[2] % (3 * H) != 0 || (qd[2] / (3 * H)) % 16 != 0 || mask.dimensions()[0] != B ||
      mask.dimensions()[1] != S || out->dimensions()[0] != B || out->dimensions()[1] != S ||
      out->dimensions()[2] != qd[2] / 3)
    return ffi::Error::InvalidArgument("xlaserve_encoder_attention: operand shapes do not agree");
  const int64_t D = qd[2] / (3 * H), HD = H * D, row = 3 * HD;
  const float* qp = qkv.typed_data();
  const int32_t* mp = mask.typed_data();
  float* op = out->typed_data();
  const bool small = B * H * S * S * D < (int64_t{1} << 18);
  parallel_for(pool, B * H, 1, [=](int64_t item) {
    const int64_t b = item / H, h = item % H;
    const int32_t* mb = mp + b * S;
    float* ob = op + b * S * HD + h * D;
    std::vector<int64_t> keys;
    keys.reserve(S);
    for (int64_t j = 0; j < S; ++j)
      if (mb[j] > 0) keys.push_back(j);
      else std::fill(ob + j * HD, ob + j * HD + D, 0.f);
    encoder_attend(qp + b * S * row + h * D, row, keys.data(), static_cast<int64_t>(keys.size()), D, HD, scale, ob, HD);
  }, small, B * S <= kOwnRows);
  return ffi::Error::Success();
}

// 5. XlaserveEncoderAttentionVarlenF32: the same attention over packed sequences (TEI's layout):
// qkv [T, 3 H D] holds the sequences back to back, sequence s at tokens [starts[s], starts[s] +
// lens[s]) (lens 0: an unused slot); out [T, H D], zeros at tokens no sequence covers. Why: a
// padded batch computes every padding token through every matrix; packed, a program's tokens are
// the real ones up to its token bucket.
ffi::Error EncoderAttentionVarlenImpl(ffi::ThreadPool pool, Rank2 qkv, I32x1 starts, I32x1 lens, int64_t heads,
                                      float scale, ffi::ResultBuffer<ffi::F32, 2> out) {
  const auto qd = qkv.dimensions();
  const int64_t T = qd[0], H = heads, S = starts.dimensions()[0];
  if (H <= 0 || qd[1] % (3 * H) != 0 || (qd[1] / (3 * H)) % 16 != 0 || lens.dimensions()[0] != S ||
      out->dimensions()[0] != T || out->dimensions()[1] != qd[1] / 3)
    return ffi::Error::InvalidArgument("xlaserve_encoder_attention_varlen: operand shapes do not agree");
  const int64_t D = qd[1] / (3 * H), HD = H * D, row = 3 * HD;
  const int32_t* st = starts.typed_data();
  const int32_t* ln = lens.typed_data();
  int64_t covered = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (ln[s] < 0 || st[s] < 0 || int64_t{st[s]} + ln[s] > T)
      return ffi::Error::InvalidArgument("xlaserve_encoder_attention_varlen: a sequence lies outside the tokens");
    covered = std::max<int64_t>(covered, int64_t{st[s]} + ln[s]);
  }
  const float* qp = qkv.typed_data();
  float* op = out->typed_data();
  std::fill(op + covered * HD, op + T * HD, 0.f);
  // Only the sequences present are items: the engine sizes starts/lens to the token bucket (up to
  // one sequence per token), so a 32-sentence program of 1,280 tokens had 15,360 (slot, head)
  // items of which 384 held work; claiming the empty ones took as long as the attention
  // (all-MiniLM-L6-v2 per layer, 2-vCPU AMX Xeon: 2.25 -> 1.02 ms).
  int64_t work = 0, tokens = 0;
  std::vector<int64_t> live;
  for (int64_t s = 0; s < S; ++s) {
    work += int64_t{ln[s]} * ln[s];
    tokens += ln[s];
    if (ln[s] > 0) live.push_back(s);
  }
  const int64_t* lv = live.data();
  parallel_for(pool, static_cast<int64_t>(live.size()) * H, 1, [=](int64_t item) {
    const int64_t s = lv[item / H], h = item % H, n = ln[s];
    std::vector<int64_t> keys(n);
    for (int64_t j = 0; j < n; ++j) keys[j] = st[s] + j;
    encoder_attend(qp + h * D, row, keys.data(), n, D, HD, scale, op + h * D, HD);
  }, work * H * D < (int64_t{1} << 18), tokens <= kOwnRows);
  return ffi::Error::Success();
}

// 6. XlaserveGluBF16: a bfloat16 model's gated MLP activation, y = act(g) * u, from the gate_up
// projection's float32 kernel output gu [M, 2 I] (g = gu[:, :I], u = gu[:, I:]) to y [M, I]
// bfloat16, with the roundings torch makes on bfloat16 tensors: the projection's output rounded
// to bfloat16 (g, u), act computed in float32 and rounded once, the product rounded once
// (round to nearest even throughout). act 0: silu g / (1 + e^-g); 1: the tanh GELU
// 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))). Rows at or past `rows` are zeros (padding).
// Why a kernel: XLA:CPU compiled the same expression into a loop fusion whose bfloat16 converts
// its cost model counts as compute, so it split the 2,048 columns of one decode row into two
// tasks on its pool; the hand-off cost more than the work: 33 us a layer at batch 1 and ~100 us
// at batch 16 ('small' model, 2-vCPU Zen 4), 7-9 % of a bfloat16 decode step, against a few
// microseconds here on the calling thread.
typedef unsigned short v16us __attribute__((vector_size(32), aligned(2), may_alias));

inline v16 round_bf16(v16 f) {      // to the nearest bfloat16 (ties to even), as a float; NaN kept
  const v16ui b = reinterpret_cast<v16ui>(f);
  const v16ui r = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  return f != f ? f : reinterpret_cast<v16>(r);
}

template <int kAct>
inline v16 gate_act(v16 g) {
  if constexpr (kAct == 0) {
    return g / (1.0f + vexp(v16{} - g));
  } else {
    // 0.5 g (1 + tanh z) = g / (1 + e^(-2 z)): no cancellation where tanh z nears -1
    const v16 z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return g / (1.0f + vexp(-2.0f * z));
  }
}

// 16 columns: g, u -> the bfloat16 bits of round(round(act(round(g))) * round(u))
template <int kAct>
inline v16us glu16(v16 g, v16 u) {
  const v16 out = round_bf16(round_bf16(gate_act<kAct>(round_bf16(g))) * round_bf16(u));
  return __builtin_convertvector(reinterpret_cast<v16ui>(out) >> 16, v16us);
}

template <int kAct>
void glu_row(const float* gu, int64_t I, uint16_t* y) {
  int64_t i = 0;
  for (; i + 16 <= I; i += 16) *reinterpret_cast<v16us*>(y + i) = glu16<kAct>(load16(gu + i), load16(gu + I + i));
  if (i < I) {       // the last I % 16 columns through the same vector code, zero-padded
    const int64_t n = I - i;
    alignas(64) float g[16] = {}, u[16] = {};
    alignas(32) uint16_t out[16];
    std::memcpy(g, gu + i, n * sizeof(float));
    std::memcpy(u, gu + I + i, n * sizeof(float));
    *reinterpret_cast<v16us*>(out) = glu16<kAct>(load16(g), load16(u));
    std::memcpy(y + i, out, n * sizeof(uint16_t));
  }
}

ffi::Error GluBF16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> gu, I32x0 rows, int64_t act,
                       ffi::ResultBuffer<ffi::BF16> y) {
  const auto gd = gu.dimensions();
  const auto yd = y->dimensions();
  if (gd.size() != 2 || yd.size() != 2 || gd[0] != yd[0] || gd[1] != 2 * yd[1])
    return ffi::Error::InvalidArgument("xlaserve_glu: gu must be [M, 2 I] and y [M, I]");
  if (act != 0 && act != 1) return ffi::Error::InvalidArgument("xlaserve_glu: act must be 0 (silu) or 1 (gelu_tanh)");
  const int64_t M = gd[0], I = yd[1];
  const int64_t live = std::min<int64_t>(std::max<int64_t>(rows.typed_data()[0], 0), M);
  const float* gp = gu.typed_data();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y->typed_data());
  if (live < M) std::memset(yp + live * I, 0, (M - live) * I * sizeof(uint16_t));
  // a few microseconds a decode row: its own thread below 64K elements (prefill chunks: the pool)
  parallel_for(pool, live, std::max<int64_t>(1, 4096 / std::max<int64_t>(I, 1)), [=](int64_t m) {
    if (act == 0) glu_row<0>(gp + m * 2 * I, I, yp + m * I);
    else glu_row<1>(gp + m * 2 * I, I, yp + m * I);
  }, live * I < (int64_t{1} << 16));
  return ffi::Error::Success();
}

}  // namespace

// Built as two objects compiled at once (cpu.py, XLASERVE_PART 1 and 2) and linked into one
// library: on a 2-core host the single -O3 compile took 9.5 s of a cold start, the two parts
// 4.4 and 4.3 s side by side. Part 1: the GEMMs (and the sgemm hand-over, whose global the
// BLAS GEMM reads); part 2: the attention kernels. Undefined: both (one object).
#if !defined(XLASERVE_PART) || XLASERVE_PART == 1
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveGemmF32, GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<Panels>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// x, w, layer, bias -> y: the binding the bias GEMMs share (w: Panels for the kernel's, Stacked,
// XLA's own layout, for the library sgemm's)
template <typename Weights>
inline auto gemm_bias_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<Weights>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveGemmBiasF32, GemmBiasImpl<false>, gemm_bias_binding<Panels>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveGemmBiasGeluF32, GemmBiasImpl<true>, gemm_bias_binding<Panels>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveGemmI8, GemmI8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<PanelsI8>()
                                  .Arg<Scales>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveGemmI8BF16, GemmI8BF16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<PanelsI8>()
                                  .Arg<Scales>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveGemmI8A8, GemmI8A8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<PanelsU8>()
                                  .Arg<Scales>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveGemmBF16, GemmBF16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<PanelsBF16>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveBlasGemmF32, BlasGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<Stacked>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("trans_b")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveBlasGemmBiasF32, BlasGemmBiasImpl<false>, gemm_bias_binding<Stacked>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveBlasGemmBiasGeluF32, BlasGemmBiasImpl<true>, gemm_bias_binding<Stacked>());

// Whether bfloat16 GEMMs of 16 rows or more run on AMX tiles in this process (tests, logs).

extern "C" int XlaserveAmxActive() { return amx_usable() ? 1 : 0; }

// Whether the w8a8 GEMM runs on AVX512-VNNI here (else its plain C++ loop).
#ifdef __AVX512VNNI__
extern "C" int XlaserveVnniActive() { return 1; }
#else
extern "C" int XlaserveVnniActive() { return 0; }
#endif

// Hands over the library sgemm (cblas_sgemm's signature; ilp64 = 64-bit integer arguments).
extern "C" void XlaserveSetSgemm(void* fn, int ilp64) {
  g_sgemm_ilp64.store(ilp64, std::memory_order_relaxed);
  g_sgemm.store(fn, std::memory_order_release);
}
#endif  // part 1

#if !defined(XLASERVE_PART) || XLASERVE_PART == 2
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveDecodeAttentionF32, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rank4>()
                                  .Arg<Rank4>()
                                  .Arg<Rank4>()
                                  .Arg<I32x2>()
                                  .Arg<I32x1>()
                                  .Arg<I32x1>()
                                  .Arg<I32x0>()
                                  .Attr<int64_t>("page_size")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Ret<Rank4>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveEncoderAttentionF32, EncoderAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rank3>()
                                  .Arg<I32x2>()
                                  .Attr<int64_t>("heads")
                                  .Attr<float>("scale")
                                  .Ret<Rank3>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveEncoderAttentionVarlenF32, EncoderAttentionVarlenImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rank2>()
                                  .Arg<I32x1>()
                                  .Arg<I32x1>()
                                  .Attr<int64_t>("heads")
                                  .Attr<float>("scale")
                                  .Ret<Rank2>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveGluBF16, GluBF16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<I32x0>()
                                  .Attr<int64_t>("act")
                                  .Ret<ffi::Buffer<ffi::BF16>>());
#endif  // part 2
