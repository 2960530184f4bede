// ReTopK's decode step for a whole batch in one call on the CPU: the fused twin of the torch reference
// ReTopK._sparse_step (retopk_core/methods/retopk.py), built by retopk_core/cpu/build.py and called
// through retopk_core/cpu/launch.py.
//
// One task per (sequence b, KV group g), G = H / H_kv query heads h each (at::parallel_for over tasks):
//   q̄_h   = q_h / max(||q_h||, 1e-12)                                  (float32)
//   ρ_hc  = q̄_h · q̄_c for the fill valid FIFO entries c, ρ_max = max_c ρ_hc (-inf when empty)  eq. 6, 7
//   path_h: REFRESH when T_r > 0, t_dec > 0, (t_dec + φ_g) % T_h == 0 (φ_g = phase[h], the group's refresh
//           phase, 0 unless refresh_stagger; T_h = state.period[slot, h] under refresh_guard, else T_r), or when
//           t_dec < 0 (refresh_first: the prefill set t_dec = -N); else
//           FALLBACK when ρ_max < tau_h; else REUSE
//           (eq. 13; tau_h = state.tau[slot, h]), then the GQA policy over the group's heads (as gqa_paths):
//             head     unchanged
//             promote  read_g = any_h path_h == FALLBACK
//             group    read_g = mean_h ρ_max < mean_h tau_h or min_h ρ_max < tau_min
//           a read group's heads take FALLBACK (own ρ_max < tau_h) or PROMOTED, an unread one's REUSE;
//           REFRESH heads stay.
//   REUSE:  R_h = TopR_c ρ_hc (retrieval "recent": the R newest entries), A_h = Unique(∪_{c∈R_h} Ŝ_c ∪
//           {L-W..L-1}) (eq. 8, 9; recall_successors: also {p + 1 : p ∈ Ŝ_c, p + 1 <= L - 1}),
//           e_i = (q_h * scale) · k_i for i ∈ A_h (eq. 10), Ŝ = TopK_{A_h} e (eq. 11)
//   others: e_i for every i < L (the group's keys read once for all its exact heads), Ŝ = TopK e (eq. 1)
//   o_h    = Σ_{i∈Ŝ} softmax(e_Ŝ)_i v_i (eq. 12); FIFO row ptr of (slot, h) <- (q̄_h, Ŝ -1 padded)
//   tau_calibration r* > 0, on the exact heads with a non-empty FIFO (calibrate_tau in retopk.py): the
//           recall reuse would have had, r = |Ŝ ∩ A_h| / |Ŝ| (mass_recall: r = Σ_{i∈Ŝ∩A_h} softmax(e_Ŝ)_i, the
//           exact support's weight reuse keeps), moves tau_h when |ρ_max - tau_h| < band:
//           tau_h <- min(max(tau_h + rate (r* - r), lo), max(tau_h, hi))   (a tau raised past hi by tau_guard
//           is its own ceiling)
//   refresh_guard r_g > 0, on the REFRESH heads with ρ_max >= tau_h (before this step's calibration; guard_period
//           in retopk.py): the same would-be recall r halves T_h (to lo_T at least) when r < r_g, doubles it (to
//           T_r at most) when r >= r_g + margin (guard_fresh)
//   tau_guard r_t > 0, on every exact head with ρ_max >= tau_h (before this step's calibration: it would have
//           reused; guard_tau in retopk_policy.py), after calibration: when r < r_t,
//           tau_h <- max(tau_h, min(ρ_max + margin_t, 1))
// Then, per sequence: ptr <- (ptr + 1) % C, fill <- min(fill + 1, C), step <- step + 1.
// Keys and values are read through the block table: position i of (b, g) is row
// (block_table[b, i / P] * H_kv + g) * P + i % P of the pool viewed as (N_blocks * H_kv * P, d).
// Scores accumulate in float32; Ŝ is returned in no particular order; n_scored = |A_h| or L.

#include <torch/extension.h>

#include "key_select.h"
#include "library_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __SSE__
#include <xmmintrin.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Recall counts up to this pick their entries by one pass over the FIFO's similarities (insertion into a
// sorted handful); larger ones by nth_element, which a decode step's profile showed costing more at R = 4.
constexpr int64_t kScanRecall = 16;
constexpr int64_t kTile = 64;  // key rows per tile of the exact pass (64 x d=128 floats = 32 KiB, L1)

// Hot loops are compiled twice, for x86-64-v3 (AVX2 + FMA + F16C) and the baseline, and picked at load
// time by the CPU's features (GCC function multiversioning), so one binary runs on any x86-64 machine.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RETOPK_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define RETOPK_CLONES
#endif
// Helpers of the cloned loops are forced inline so that each clone compiles them for its own target.
#define RETOPK_INLINE inline __attribute__((always_inline))

RETOPK_INLINE float to_float(float x) { return x; }
RETOPK_INLINE float to_float(c10::BFloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
RETOPK_INLINE float to_float(c10::Half x) { return static_cast<float>(x); }

// IEEE half -> float32, exact, for a half's bits h (uint16_t or a vector of them, widened to U: uint32_t or a vector
// of as many): c10's conversion without F16C (fp16_ieee_to_fp32_value, so static_cast<float>'s bits), written with
// no branch or call so that the vector loads and the loops that take it (widen) vectorize it. With w = h << 16 and
// 2w (the sign shifted out): a normal, infinite or NaN half is ((2w >> 4) + (0xE0 << 23)) · 2^-112 (its exponent
// rebiased by 0xE0 so that 0x1F lands on 0xFF, then scaled down by the 112 too many); a zero or subnormal
// (2w < 2^27), mantissa m, is m · 2^-24 = float((2w >> 17) | (126 << 23)) - 0.5, i.e. (0.5 + m · 2^-24) - 0.5.
template <typename U, typename F>
RETOPK_INLINE F half_bits_to_float(U h) {
  const U w = h << 16, two_w = w + w;
  const U normal = std::bit_cast<U>(std::bit_cast<F>((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f);
  const U small = std::bit_cast<U>(std::bit_cast<F>((two_w >> 17) | (126u << 23)) - 0.5f);
  const U is_small = U{} - (((two_w >> 27) - 1u) >> 31);  // all ones where 2w < 2^27 (no branch: see above)
  return std::bit_cast<F>((w & 0x80000000u) | (small & is_small) | (normal & ~is_small));
}
// to_float for the loops that `omp simd` vectorizes (weighted_sum, the dot products' reductions): a float16 value
// through half_bits_to_float, which vectorizes where c10's conversion stays scalar, so a float16 row's dot product
// takes the lane-wise partial sums of a bfloat16 one (the same element size, so the same vectorization factor).
template <typename T>
RETOPK_INLINE float widen(T x) {
  return to_float(x);
}
RETOPK_INLINE float widen(c10::Half x) { return half_bits_to_float<uint32_t, float>(x.x); }

// Gathered rows sit at random positions, so no hardware prefetcher sees them coming and each row's
// cache lines wait out a full memory latency; asking for the rows a few iterations ahead keeps several
// in flight. A standalone test here (512 random rows of a 512 MB pool) halved the weighted sum's time
// with 4-8 rows ahead and shortened the dot products' by about a fifth at d = 64.
constexpr int64_t kGatherAhead = 8;  // rows ahead in weighted_sum
constexpr int64_t kDotAhead = 12;    // rows ahead in dot_gather (which already has four rows in flight)
template <typename T>
RETOPK_INLINE void prefetch_row(const T* r, int64_t n) {
  const char* p = reinterpret_cast<const char*>(r);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b, 0, 3);
}
// The same for a row about to be written: a step's FIFO entry and output rows, last touched a whole step ago,
// whose stores otherwise each wait for their line at the step's end.
template <typename T>
RETOPK_INLINE void prefetch_row_for_write(T* r, int64_t n) {
  char* p = reinterpret_cast<char*>(r);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b, 1, 3);
}

// The dense passes (range_scores, range_values, exact's tiles) read runs of consecutive rows, the rest of a
// block each, one run after the other through the block table. The hardware prefetchers follow a forward
// stream only within a 4 KiB page and not into the next block, so one stream per thread waited on memory
// at long contexts; the passes ask for the bytes kStreamAhead in front of the row they read, and past a
// run's end for the next run's first bytes (the block table names it). Prefetches change no result.
constexpr int64_t kStreamAhead = 2048;  // bytes; 512 to 4096 measured (docs/bench/history.md, issue 28)

// Prefetch of bytes [from, to) of a run of `bytes` bytes at `run`, continued into the run at `next` (null:
// none) past its end.
RETOPK_INLINE void prefetch_stream(const void* run, int64_t bytes, const void* next, int64_t from, int64_t to) {
  for (int64_t o = from; o < to; o += 64) {
    if (o < bytes) __builtin_prefetch(static_cast<const char*>(run) + o, 0, 3);
    else if (next != nullptr) __builtin_prefetch(static_cast<const char*>(next) + (o - bytes), 0, 3);
  }
}

// out[0..4) = q · r0 .. q · r3 (d elements each), four independent accumulators, each summed lane-wise (`omp simd`).
template <typename T>
RETOPK_INLINE void dot4(const float* q, const T* r0, const T* r1, const T* r2, const T* r3, int64_t d, float* out) {
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t i = 0; i < d; ++i) {
    a0 += q[i] * widen(r0[i]);
    a1 += q[i] * widen(r1[i]);
    a2 += q[i] * widen(r2[i]);
    a3 += q[i] * widen(r3[i]);
  }
  out[0] = a0;
  out[1] = a1;
  out[2] = a2;
  out[3] = a3;
}

// q · r (d elements), summed lane-wise.
template <typename T>
RETOPK_INLINE float dot1(const float* q, const T* r, int64_t d) {
  float a = 0.f;
#pragma omp simd reduction(+ : a)
  for (int64_t i = 0; i < d; ++i) a += q[i] * widen(r[i]);
  return a;
}

// out[j] = q · rows[off[j] .. off[j] + d), four rows at a time for independent accumulators.
template <typename T>
RETOPK_CLONES void dot_gather(const float* q, const T* pool, const int64_t* off, int64_t n, int64_t d, float* out) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int64_t a = j + kDotAhead; a < std::min(j + kDotAhead + 4, n); ++a) prefetch_row(pool + off[a], d);
    dot4(q, pool + off[j], pool + off[j + 1], pool + off[j + 2], pool + off[j + 3], d, out + j);
  }
  for (; j < n; ++j) out[j] = dot1(q, pool + off[j], d);
}

// out[j] = q · rows[j] for n consecutive rows of d elements; ahead > 0: each step asks for the bytes `ahead` in
// front of the rows it reads (prefetch_stream), the first `ahead` bytes before it starts (prefetches change no sum).
template <typename T>
RETOPK_CLONES void dot_block(const float* q, const T* rows, int64_t n, int64_t d, float* out, int64_t ahead = 0) {
  const int64_t rb = d * static_cast<int64_t>(sizeof(T)), bytes = n * rb;  // a row's bytes, the run's
  if (ahead > 0) prefetch_stream(rows, bytes, nullptr, 0, ahead);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    if (ahead > 0) prefetch_stream(rows, bytes, nullptr, j * rb + ahead, (j + 4) * rb + ahead);
    const T* r0 = rows + j * d;
    dot4(q, r0, r0 + d, r0 + 2 * d, r0 + 3 * d, d, out + j);
  }
  for (; j < n; ++j) out[j] = dot1(q, rows + j * d, d);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RETOPK_F16C 1
// dot_gather, dot_block and weighted_sum over float16 rows with F16C's vcvtph2ps (one instruction per 8 values,
// exact: half_bits_to_float's values), for the CPUs whose RETOPK_CLONES run their x86-64-v3 clone (AVX2, FMA and
// F16C): compiled for that target, not cloned, and called only there (f16c_gathers), so the baseline clone needs no
// F16C. GCC does not vectorize a scalar float16 conversion, so the dot products widen 4 rows at a time into float32
// ones and sum those in dot4 / dot1's loops: a float32 row's lanes (8 in the x86-64-v3 clone; a 16-bit row's loop
// takes 16, its element size setting the vectorization factor), so on these CPUs a float16 pool's scores are those
// of a float32 pool of the same values, bit for bit, and the baseline clone's those of a bfloat16 pool.
// weighted_sum_f16c's acc[i] + w x (one FMA per element) is weighted_sum's in any vector width.
constexpr int64_t kWidenMax = 256;  // head dims up to which the dot products widen into a stack buffer (4 KiB)

__attribute__((target("arch=x86-64-v3"))) inline void widen_f16c(const c10::Half* r, int64_t d, float* out) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + i))));
  for (; i < d; ++i) out[i] = _cvtsh_ss(r[i].x);
}

// dot_gather over float16 rows, d <= kWidenMax.
__attribute__((target("arch=x86-64-v3"))) void dot_gather_f16c(const float* q, const c10::Half* pool,
                                                              const int64_t* off, int64_t n, int64_t d, float* out) {
  float wide[4 * kWidenMax];  // (4, d)
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int64_t a = j + kDotAhead; a < std::min(j + kDotAhead + 4, n); ++a) prefetch_row(pool + off[a], d);
    for (int k = 0; k < 4; ++k) widen_f16c(pool + off[j + k], d, wide + k * d);
    dot4(q, wide, wide + d, wide + 2 * d, wide + 3 * d, d, out + j);
  }
  for (; j < n; ++j) {
    widen_f16c(pool + off[j], d, wide);
    out[j] = dot1(q, wide, d);
  }
}

// dot_block over float16 rows, d <= kWidenMax.
__attribute__((target("arch=x86-64-v3"))) void dot_block_f16c(const float* q, const c10::Half* rows, int64_t n,
                                                             int64_t d, float* out, int64_t ahead) {
  float wide[4 * kWidenMax];  // (4, d)
  const int64_t rb = d * static_cast<int64_t>(sizeof(c10::Half)), bytes = n * rb;
  if (ahead > 0) prefetch_stream(rows, bytes, nullptr, 0, ahead);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    if (ahead > 0) prefetch_stream(rows, bytes, nullptr, j * rb + ahead, (j + 4) * rb + ahead);
    widen_f16c(rows + j * d, 4 * d, wide);
    dot4(q, wide, wide + d, wide + 2 * d, wide + 3 * d, d, out + j);
  }
  for (; j < n; ++j) {
    widen_f16c(rows + j * d, d, wide);
    out[j] = dot1(q, wide, d);
  }
}

// weighted_sum over float16 rows.
__attribute__((target("arch=x86-64-v3"))) void weighted_sum_f16c(const float* w, const c10::Half* pool,
                                                                const int64_t* off, int64_t n, int64_t dv, float* acc) {
  for (int64_t j = 0; j < n; ++j) {
    if (j + kGatherAhead < n) prefetch_row(pool + off[j + kGatherAhead], dv);
    const c10::Half* r = pool + off[j];
    const __m256 wj = _mm256_set1_ps(w[j]);
    int64_t i = 0;
    for (; i + 8 <= dv; i += 8) {
      const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + i)));
      _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(wj, x, _mm256_loadu_ps(acc + i)));
    }
    for (; i < dv; ++i) acc[i] = std::fma(w[j], _cvtsh_ss(r[i].x), acc[i]);
  }
}

// A float16 value read by F16C: c10::Half's bits in a type of its own, so that the key and value passes' loops
// load it with vcvtph2ps (load8) in dot_heads_narrow_f16c and weighted_rows_f16c (x86-64-v3 functions, as the
// gathers' F16C versions) and with half_bits_to_float in the clones; the same values, the same sums.
struct HalfF16C {
  uint16_t x;
};
static_assert(sizeof(HalfF16C) == sizeof(c10::Half));
RETOPK_INLINE float to_float(HalfF16C h) { return half_bits_to_float<uint32_t, float>(h.x); }
#endif

// Whether the float16 gathers take their F16C versions: the CPU has x86-64-v3, as RETOPK_CLONES' resolver asks.
bool f16c_gathers() {
#ifdef RETOPK_F16C
  static const bool v3 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v3") != 0;
  }();
  return v3;
#else
  return false;
#endif
}

// dot_gather / dot_block on this CPU's loops (f16c_gathers for float16 rows).
template <typename T>
void gather_scores(const float* q, const T* pool, const int64_t* off, int64_t n, int64_t d, float* out) {
#ifdef RETOPK_F16C
  if constexpr (std::is_same_v<T, c10::Half>)
    if (d <= kWidenMax && f16c_gathers()) return dot_gather_f16c(q, pool, off, n, d, out);
#endif
  dot_gather(q, pool, off, n, d, out);
}
template <typename T>
void block_scores(const float* q, const T* rows, int64_t n, int64_t d, float* out, int64_t ahead = 0) {
#ifdef RETOPK_F16C
  if constexpr (std::is_same_v<T, c10::Half>)
    if (d <= kWidenMax && f16c_gathers()) return dot_block_f16c(q, rows, n, d, out, ahead);
#endif
  dot_block(q, rows, n, d, out, ahead);
}
#ifdef RETOPK_F16C
// block_scores over HalfF16C rows (dot_heads_passes' d % 8 != 0 rows): c10::Half's, the same bits.
inline void block_scores(const float* q, const HalfF16C* rows, int64_t n, int64_t d, float* out, int64_t ahead = 0) {
  block_scores(q, reinterpret_cast<const c10::Half*>(rows), n, d, out, ahead);
}
#endif

// GCC vector extensions: 8 floats, lowered to AVX2 in the x86-64-v3 clones and to SSE pairs otherwise.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

RETOPK_INLINE v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
RETOPK_INLINE v8f load8(const c10::BFloat16* p) {  // bf16 -> float32 is a 16-bit left shift
  v8h h;
  std::memcpy(&h, p, sizeof h);
  v8u u = __builtin_convertvector(h, v8u) << 16;
  v8f v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
RETOPK_INLINE v8f load8(const c10::Half* p) {
  v8h h;
  std::memcpy(&h, p, sizeof h);
  return half_bits_to_float<v8u, v8f>(__builtin_convertvector(h, v8u));
}
#ifdef RETOPK_F16C
__attribute__((target("arch=x86-64-v3"))) inline v8f load8(const HalfF16C* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

typedef float v4f __attribute__((vector_size(16)));

// sum4's first level: the pairwise lane sums of a and b, interleaved (a0+a2, a1+a3, b0+b2, b1+b3, a4+a6, ...).
RETOPK_INLINE v8f sum4_pairs(v8f a, v8f b) {
  return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
}
// The rest of sum4 from its first level: x = sum4_pairs(a, b), y = sum4_pairs(c, d).
RETOPK_INLINE void sum4_finish(v8f x, v8f y, float* out) {
  v8f z = __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
  v4f s = __builtin_shufflevector(z, z, 0, 1, 2, 3) + __builtin_shufflevector(z, z, 4, 5, 6, 7);
  std::memcpy(out, &s, sizeof s);
}
// The four lane sums of a, b, c, d: (Σa, Σb, Σc, Σd).
RETOPK_INLINE void sum4(v8f a, v8f b, v8f c, v8f d, float* out) { sum4_finish(sum4_pairs(a, b), sum4_pairs(c, d), out); }

// out[e * ostride + j] = q_e · rows[j] for NH query rows (d floats each, d % 8 == 0) and m consecutive
// key rows: each key vector is loaded once for the NH heads. Rows are read in memory order, one after
// the other, so the pass is a single forward stream: interleaving four rows (c outer, rows inner) sent
// the loads 512 B back and forth and held one core at ~7.7 GB/s against ~12 GB/s for the same bytes
// read in order (a standalone AVX2 test on the AMD VM, before the passes prefetched; dot_heads_v16, the
// AVX-512 loop, interleaves 2-4 rows with prefetch, measured on the Intel VM only). Two accumulators per
// head and row halve the FMA chains.
template <typename T, int NH>
RETOPK_INLINE void dot_heads_v(const float* q, const T* rows, int64_t m, int64_t d, float* out, int64_t ostride,
                               const T* next, int64_t ahead) {
  const int64_t rb = d * static_cast<int64_t>(sizeof(T)), bytes = m * rb;  // a row's bytes, the run's
  int64_t j = 0;
  for (; j + 4 <= m; j += 4) {
    if (ahead > 0) prefetch_stream(rows, bytes, next, j * rb + ahead, (j + 4) * rb + ahead);
    v8f acc[NH][4];
    for (int i = 0; i < 4; ++i) {
      const T* r = rows + (j + i) * d;
      v8f a[NH] = {}, b[NH] = {};
      int64_t c = 0;
      for (; c + 16 <= d; c += 16) {
        const v8f k0 = load8(r + c), k1 = load8(r + c + 8);
        for (int e = 0; e < NH; ++e) {
          a[e] += load8(q + e * d + c) * k0;
          b[e] += load8(q + e * d + c + 8) * k1;
        }
      }
      if (c < d) {  // d % 16 == 8
        const v8f k0 = load8(r + c);
        for (int e = 0; e < NH; ++e) a[e] += load8(q + e * d + c) * k0;
      }
      for (int e = 0; e < NH; ++e) acc[e][i] = a[e] + b[e];
    }
    for (int e = 0; e < NH; ++e) sum4(acc[e][0], acc[e][1], acc[e][2], acc[e][3], out + e * ostride + j);
  }
  for (; j < m; ++j) {
    if (ahead > 0) prefetch_stream(rows, bytes, next, j * rb + ahead, (j + 1) * rb + ahead);
    v8f acc[NH] = {};
    const T* r = rows + j * d;
    for (int64_t c = 0; c < d; c += 8) {
      const v8f k = load8(r + c);
      for (int e = 0; e < NH; ++e) acc[e] += load8(q + e * d + c) * k;
    }
    for (int e = 0; e < NH; ++e) {
      float t[4];
      sum4(acc[e], v8f{}, v8f{}, v8f{}, t);
      out[e * ostride + j] = t[0];
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RETOPK_WIDE 1
// dot_heads_v with 16 lanes: two 8-column chunks side by side, accumulator a in lanes 0-7 and b in lanes 8-15,
// so each (head, row) sum is the same lane arithmetic in the same order and the bits are dot_heads_v's. For
// the x86-64-v4 (AVX-512) version only: one register per 16 columns halves the FMAs and the loads, and its 32
// registers hold R = 2 (NH 3, 2) or 4 (NH 1) rows' accumulators, so each query vector is loaded once for R
// rows. (An x86-64-v3 build of this loop splits every 16-lane vector through memory: several times slower.)
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

RETOPK_INLINE v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
RETOPK_INLINE v16f load16(const c10::BFloat16* p) {
  v16h h;
  std::memcpy(&h, p, sizeof h);
  v16u u = __builtin_convertvector(h, v16u) << 16;
  v16f v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
// F16C's vcvtph2ps (exact, one instruction), which x86-64-v4 has: the target of every loop that takes load16.
__attribute__((target("arch=x86-64-v4"))) inline v16f load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename T, int NH, int R>
RETOPK_INLINE void dot_heads_v16(const float* q, const T* rows, int64_t m, int64_t d, float* out, int64_t ostride,
                                 const T* next, int64_t ahead) {
  static_assert(R == 2 || R == 4, "pairs of rows (sum4_pairs) within sum4's groups of 4");
  const int64_t rb = d * static_cast<int64_t>(sizeof(T)), bytes = m * rb;  // a row's bytes, the run's
  int64_t j = 0;
  for (; j + 4 <= m; j += 4) {
    v8f half[NH][2];  // per head, sum4's first level of rows (j, j + 1) and of rows (j + 2, j + 3)
    for (int i0 = 0; i0 < 4; i0 += R) {
      if (ahead > 0) prefetch_stream(rows, bytes, next, (j + i0) * rb + ahead, (j + i0 + R) * rb + ahead);
      const T* r = rows + (j + i0) * d;
      v16f ab[NH][R] = {};  // lanes 0-7: a, lanes 8-15: b
      int64_t c = 0;
      for (; c + 16 <= d; c += 16) {
        v16f k[R];
        for (int i = 0; i < R; ++i) k[i] = load16(r + i * d + c);
        for (int e = 0; e < NH; ++e) {
          const v16f qe = load16(q + e * d + c);
          for (int i = 0; i < R; ++i) ab[e][i] += qe * k[i];
        }
      }
      v8f a[NH][R];
      for (int e = 0; e < NH; ++e)
        for (int i = 0; i < R; ++i) a[e][i] = __builtin_shufflevector(ab[e][i], ab[e][i], 0, 1, 2, 3, 4, 5, 6, 7);
      if (c < d) {  // d % 16 == 8: a last chunk into a
        v8f k0[R];
        for (int i = 0; i < R; ++i) k0[i] = load8(r + i * d + c);
        for (int e = 0; e < NH; ++e) {
          const v8f q0 = load8(q + e * d + c);
          for (int i = 0; i < R; ++i) a[e][i] += q0 * k0[i];
        }
      }
      v8f s[NH][R];  // a + b
      for (int e = 0; e < NH; ++e)
        for (int i = 0; i < R; ++i) s[e][i] = a[e][i] + __builtin_shufflevector(ab[e][i], ab[e][i], 8, 9, 10, 11, 12, 13, 14, 15);
      for (int e = 0; e < NH; ++e)
        for (int i = 0; i < R; i += 2) half[e][(i0 + i) / 2] = sum4_pairs(s[e][i], s[e][i + 1]);
    }
    for (int e = 0; e < NH; ++e) sum4_finish(half[e][0], half[e][1], out + e * ostride + j);
  }
  dot_heads_v<T, NH>(q, rows + j * d, m - j, d, out + j, ostride, next, ahead);  // the last m % 4 rows
}
#endif

// out[e * ostride + j] = q_e · rows[j] for nq query rows and m consecutive key rows of d elements, up to 3
// heads a pass (dot_heads_v16 where Wide, else dot_heads_v); the first pass over the rows prefetches as it
// goes (prefetch_stream; `next`: the run read after this one).
template <typename T, bool Wide>
RETOPK_INLINE void dot_heads_passes(const float* q, int64_t nq, const T* rows, int64_t m, int64_t d, float* out,
                                    int64_t ostride, const T* next) {
  for (int64_t e = 0; e < nq;) {
    const int64_t n = std::min<int64_t>(3, nq - e), ahead = e == 0 ? kStreamAhead : 0;
    if (d % 8 != 0) {
      block_scores(q + e * d, rows, m, d, out + e * ostride);
      e += 1;
      continue;
    }
#ifdef RETOPK_WIDE
    if constexpr (Wide) {
      if (n == 3) dot_heads_v16<T, 3, 2>(q + e * d, rows, m, d, out + e * ostride, ostride, next, ahead);
      else if (n == 2) dot_heads_v16<T, 2, 2>(q + e * d, rows, m, d, out + e * ostride, ostride, next, ahead);
      else dot_heads_v16<T, 1, 4>(q + e * d, rows, m, d, out + e * ostride, ostride, next, ahead);
      e += n;
      continue;
    }
#endif
    if (n == 3) dot_heads_v<T, 3>(q + e * d, rows, m, d, out + e * ostride, ostride, next, ahead);
    else if (n == 2) dot_heads_v<T, 2>(q + e * d, rows, m, d, out + e * ostride, ostride, next, ahead);
    else dot_heads_v<T, 1>(q + e * d, rows, m, d, out + e * ostride, ostride, next, ahead);
    e += n;
  }
}

template <typename T>
RETOPK_CLONES void dot_heads_narrow(const float* q, int64_t nq, const T* rows, int64_t m, int64_t d, float* out,
                                    int64_t ostride, const T* next) {
  dot_heads_passes<T, false>(q, nq, rows, m, d, out, ostride, next);
}

#ifdef RETOPK_WIDE
template <typename T>
__attribute__((target("arch=x86-64-v4"))) void dot_heads_wide(const float* q, int64_t nq, const T* rows, int64_t m,
                                                              int64_t d, float* out, int64_t ostride, const T* next) {
  dot_heads_passes<T, true>(q, nq, rows, m, d, out, ostride, next);
}
#endif

#ifdef RETOPK_F16C
// dot_heads_narrow over float16 rows read by F16C (HalfF16C's load8), for x86-64-v3 CPUs below
// wide_key_scoring's level: the x86-64-v3 clone's values in its lanes and order, so its bits.
__attribute__((target("arch=x86-64-v3"))) void dot_heads_narrow_f16c(const float* q, int64_t nq,
                                                                    const c10::Half* rows, int64_t m, int64_t d,
                                                                    float* out, int64_t ostride,
                                                                    const c10::Half* next) {
  dot_heads_passes<HalfF16C, false>(q, nq, reinterpret_cast<const HalfF16C*>(rows), m, d, out, ostride,
                                    reinterpret_cast<const HalfF16C*>(next));
}
#endif

// Whether dot_heads takes its AVX-512 loops: the CPU has x86-64-v4 and the library's level (isa_level(), which
// RETOPK_CPU_ISA lowers: launch.py) is AVX-512 or above. Else the x86-64-v3 or baseline clone (one more level
// than RETOPK_CLONES, for these loops alone: the same bits either way; how a test compares the two).
bool wide_key_scoring() {
#ifdef RETOPK_WIDE
  static const bool v4 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v4") != 0;
  }();
  return v4 && isa_level() >= kAvx512;
#else
  return false;
#endif
}

// dot_heads_passes on this CPU's loops (wide_key_scoring, then f16c_gathers for float16 rows).
template <typename T>
void dot_heads(const float* q, int64_t nq, const T* rows, int64_t m, int64_t d, float* out, int64_t ostride,
               const T* next) {
#ifdef RETOPK_WIDE
  if (wide_key_scoring()) return dot_heads_wide(q, nq, rows, m, d, out, ostride, next);
#endif
#ifdef RETOPK_F16C
  if constexpr (std::is_same_v<T, c10::Half>)
    if (f16c_gathers()) return dot_heads_narrow_f16c(q, nq, rows, m, d, out, ostride, next);
#endif
  dot_heads_narrow(q, nq, rows, m, d, out, ostride, next);
}

// acc[0..dv) += Σ_j w[j] * rows[off[j] .. off[j] + dv)
template <typename T>
RETOPK_CLONES void weighted_sum(const float* w, const T* pool, const int64_t* off, int64_t n, int64_t dv, float* acc) {
  for (int64_t j = 0; j < n; ++j) {
    if (j + kGatherAhead < n) prefetch_row(pool + off[j + kGatherAhead], dv);
    const T* r = pool + off[j];
    const float wj = w[j];
#pragma omp simd
    for (int64_t i = 0; i < dv; ++i) acc[i] += wj * widen(r[i]);
  }
}

// weighted_sum on this CPU's loops (f16c_gathers for float16 rows).
template <typename T>
void gather_values(const float* w, const T* pool, const int64_t* off, int64_t n, int64_t dv, float* acc) {
#ifdef RETOPK_F16C
  if constexpr (std::is_same_v<T, c10::Half>)
    if (f16c_gathers()) return weighted_sum_f16c(w, pool, off, n, dv, acc);
#endif
  weighted_sum(w, pool, off, n, dv, acc);
}

void read_row(const at::Tensor& t, const void* p, int64_t stride, int64_t d, float* out) {
  switch (t.scalar_type()) {
    case at::kFloat: for (int64_t i = 0; i < d; ++i) out[i] = static_cast<const float*>(p)[i * stride]; break;
    case at::kBFloat16:
      for (int64_t i = 0; i < d; ++i) out[i] = to_float(static_cast<const c10::BFloat16*>(p)[i * stride]);
      break;
    default:
      for (int64_t i = 0; i < d; ++i) out[i] = to_float(static_cast<const c10::Half*>(p)[i * stride]);
  }
}

void write_row(at::ScalarType dt, const float* x, int64_t d, void* p) {
  switch (dt) {
    case at::kFloat: std::memcpy(p, x, d * sizeof(float)); break;
    case at::kBFloat16:
      for (int64_t i = 0; i < d; ++i) static_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(x[i]);
      break;
    default:
      for (int64_t i = 0; i < d; ++i) static_cast<c10::Half*>(p)[i] = c10::Half(x[i]);
  }
}

struct Codes {
  int8_t reuse, fallback, refresh, promoted;
};

struct Params {
  int64_t B, H, H_kv, G, d, dv, C, K, R, W, P, P_shift, T_r, bt_stride;  // P_shift = log2 P, or -1
  float tau_min, scale;
  float cal_target, cal_rate, cal_band, cal_lo, cal_hi;  // tau_calibration (target 0 = off)
  float guard_target, guard_fresh;  // refresh_guard (target 0 = off); recall >= guard_fresh lengthens T_h
  int64_t guard_lo;                                      // its shortest refresh period
  bool recent;
  int64_t policy;  // 0 head, 1 promote, 2 group
  int64_t split;   // run_group's tasks per (sequence, KV group): G (one head each) or 1 (decode: task_split)
  bool successors;  // recall_successors: A_t also holds p + 1 of every recalled support position p
  Codes code;
  bool mass = false;  // mass_recall: the would-be recall weighs each position of Ŝ by its softmax weight
  float raise_target = 0.f, raise_margin = 0.f;  // tau_guard (target 0 = off) and how far above ρ_max it raises
};

using Scored = std::pair<float, int64_t>;  // (score, position)

// Per-thread scratch, grown on demand and reused across calls (no page faults on the steady state).
struct Scratch {
  std::vector<uint64_t> seen;  // candidate bitmap over positions, all zero between uses
  std::vector<int64_t> rec, cand, off;
  std::vector<float> scores, qe, w, acc, bars;
  std::vector<Scored> top;
  std::vector<std::vector<Scored>> heaps;
  // run_group's own, per task: unit and scaled queries (G, d), FIFO similarities (G, C), their maxima (G,),
  // paths and refresh flags (G,), the heads taking an exact pass and their Top-K.
  std::vector<float> qn, qsc, sims, ms;
  std::vector<int8_t> path;
  std::vector<char> refresh;
  std::vector<int64_t> exact_heads;
  std::vector<std::vector<Scored>> tops;
  // The Top-K cuts': the exact pass's running buffers (heads x 2K keys) and their fill, keep_best's keys, and
  // nth_element_keys's index lists.
  std::vector<uint64_t> keys, cut_keys;
  std::vector<int64_t> kept;
  std::vector<int32_t> up, down;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

struct GreaterScore {  // the recall's and the reuse cut's comparison: a functor, so the sorts and heaps inline it
  bool operator()(const Scored& a, const Scored& b) const { return a.first > b.first; }
};
constexpr GreaterScore greater_score{};

struct Better {  // higher score first, the lower position among equal scores (as a heap that never
  bool operator()(const Scored& a, const Scored& b) const {  // replaces on a tie would keep)
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  }
};

// A key's (score, position) pair (key_select.h; a -0 score comes back as +0).
RETOPK_INLINE Scored scored(uint64_t key) { return {retopk_select::key_score(key), retopk_select::key_pos(key)}; }

// A running Top-K's cut (topk_rows; the exact pass's admit_tile does the same on keys): `buf` collects the
// scores above the K-th best kept so far and, whenever it reaches 2k, is cut back to its k best; returns their
// worst score, the new entry bar. O(1) amortised per entry whatever the order of the scores (a k-heap pays
// O(log k) per replacement, and rising scores, as recency can give, would replace on most of the L rows). Also
// dense's one cut of all L. Through Better's keys (key_select.h): std::nth_element's permutation, so the same
// order as on the pairs; a -0 score comes back as +0 (no exp(x - m) downstream changes: x - m is the same for
// ±0, and exp(±0) = 1). Where an entry has no key (a NaN score, a position past 2^32), on the pairs.
float keep_best(std::vector<Scored>& buf, int64_t k) {
  const int64_t n = static_cast<int64_t>(buf.size());
  Scratch& s = scratch();
  s.cut_keys.resize(n);
  s.up.resize(n);
  s.down.resize(n);
  uint64_t* keys = s.cut_keys.data();
  if (!retopk_select::fill_keys(n, [&](int64_t i) { return buf[i].first; }, [&](int64_t i) { return buf[i].second; },
                                keys)) {
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), Better{});
  } else {
    retopk_select::nth_element_keys(keys, keys + (k - 1), keys + n, s.up.data(), s.down.data());
    for (int64_t i = 0; i < k; ++i) buf[i] = scored(keys[i]);
  }
  buf.resize(k);
  return buf[k - 1].first;
}

// The reuse path's rerank (eq. 11): the k best of the n candidates (score[i], pos[i]) into `top`, all n in their
// order when n <= k. Tie rule: std::nth_element under the scores alone (GreaterScore), equal scores where
// libstdc++'s partition leaves them, not the exact pass's lower position first: exactly equal scores do occur among
// a step's candidates (float32 dot products, a few hundred candidates a head), and Better's rule changed the
// embedded model's decode within 20 steps. On keys (key_select.h: top_keys_by_score), the same permutation, ties
// included; a -0 score comes back as +0 (keep_best: no weight changes). Where a score is NaN, on the pairs.
void keep_topk(const float* score, const int64_t* pos, int64_t n, int64_t k, std::vector<Scored>& top) {
  top.clear();
  if (n > k) {
    Scratch& s = scratch();
    s.cut_keys.resize(n);
    s.up.resize(n);
    s.down.resize(n);
    uint64_t* keys = s.cut_keys.data();
    if (retopk_select::top_keys_by_score(score, pos, n, k, keys, s.up.data(), s.down.data())) {
      for (int64_t i = 0; i < k; ++i) top.push_back(scored(keys[i]));
      return;
    }
  }
  for (int64_t i = 0; i < n; ++i) top.emplace_back(score[i], pos[i]);
  if (n > k) {
    std::nth_element(top.begin(), top.begin() + (k - 1), top.end(), greater_score);
    top.resize(k);
  }
}

// Whether any of the 16 lanes of (a, b) is set.
RETOPK_INLINE bool any_lane(v8i a, v8i b) {
  uint64_t w[4];
  const v8i m = a | b;
  std::memcpy(w, &m, sizeof w);
  return (w[0] | w[1] | w[2] | w[3]) != 0;
}

// One head's tile in the exact pass (keep_best's running cut on keys): the score sc[i] of position first + i
// enters buf (size entries) when above kth, and a full buf (2k keys) is cut to its k best (nth_element_keys),
// kth becoming the k-th's score; returns kth. A run of 16 scores none above kth is passed over after one
// vector compare; where the run cannot fill buf (no cut, so one kth for all 16), each key is written at the end
// and the size moves past it when it enters (no branch on a score: which of 16 enter is a coin toss to a branch
// predictor); else one by one against the kth of their turn. Either way, the scalar loop's entries and cuts.
RETOPK_CLONES float admit_tile(const float* sc, int64_t rows, int64_t first, float kth, uint64_t* buf, int64_t& size,
                               int64_t k, int32_t* up, int32_t* down) {
  int64_t n = size;  // in a register: buf's stores may alias `size`
  auto admit = [&](int64_t i) {
    if (sc[i] > kth) {  // rare past the first blocks (about K ln(L / K) for scores in random order)
      buf[n++] = retopk_select::better_key(sc[i], first + i);
      if (n == 2 * k) {
        retopk_select::nth_element_keys(buf, buf + (k - 1), buf + n, up, down);
        n = k;
        kth = retopk_select::key_score(buf[k - 1]);
      }
    }
  };
  int64_t i = 0;
  for (; i + 16 <= rows; i += 16) {
    const v8f bar = v8f{} + kth;
    if (!any_lane(load8(sc + i) > bar, load8(sc + i + 8) > bar)) continue;
    if (n + 16 < 2 * k) {
      for (int64_t j = i; j < i + 16; ++j) {
        buf[n] = retopk_select::better_key(sc[j], first + j);
        n += sc[j] > kth;
      }
    } else {
      for (int64_t j = i; j < i + 16; ++j) admit(j);
    }
  }
  for (; i < rows; ++i) admit(i);
  size = n;
  return kth;
}

RETOPK_INLINE void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }

// exp(x) on 8 lanes for x <= 0 (a softmax's scores minus their max): 2^t with t = x log2(e) = n + f,
// n = round(t), |f| <= 1/2, 2^f = e^(f ln 2) by its Taylor series to degree 7 (relative error below
// 2e-8 for |f ln 2| <= 0.35), 2^n put into the exponent bits. Lanes below -87 (2^n would underflow) give 0.
RETOPK_INLINE v8f exp8(v8f x) {
  const v8i tiny = x < -87.f;
  const v8f t = x * 1.44269504088896341f;
  const v8i n = __builtin_convertvector(t + (t < 0.f ? -0.5f : 0.5f) * 1.f, v8i);  // round half away from 0
  const v8f f = (t - __builtin_convertvector(n, v8f)) * 0.69314718055994531f;  // f ln 2, |.| <= 0.347
  v8f p = f * (1.f / 5040) + 1.f / 720;
  p = p * f + 1.f / 120;
  p = p * f + 1.f / 24;
  p = p * f + 1.f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  v8i bits = (n + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof scale);
  v8f r = p * scale;
  v8i out;
  std::memcpy(&out, &r, sizeof out);
  out &= ~tiny;
  std::memcpy(&r, &out, sizeof r);
  return r;
}

// w[0..n) <- softmax(w): exp(w_i - max) / Σ.
// w[i] <- exp(w[i] - m) for i < n -> their sum (the unnormalized softmax of a row whose maximum is m).
RETOPK_CLONES float exp_shift_inplace(float* w, int64_t n, float m) {
  float sum = 0.f;
  int64_t i = 0;
  v8f acc{};
  for (; i + 8 <= n; i += 8) {
    const v8f e = exp8(load8(w + i) - m);
    store8(w + i, e);
    acc += e;
  }
  for (int l = 0; l < 8; ++l) sum += acc[l];
  for (; i < n; ++i) {
    w[i] = std::exp(w[i] - m);
    sum += w[i];
  }
  return sum;
}

// max_i w[i] (-inf for n = 0; NaNs skipped). Each lane keeps m < x ? x : m, std::max's rule, over four
// independent vectors, so the maximum is the scalar loop's in any order: a maximum is exact, and the only
// order-dependent part, the sign of a zero maximum, changes no exp(w - m) (x - 0 and x - (-0) differ only
// for x = -0, and exp(±0) = 1). The scalar loop's single dependent chain held a core on the dense passes.
RETOPK_CLONES float row_max(const float* w, int64_t n) {
  v8f m0 = v8f{} + kNegInf, m1 = m0, m2 = m0, m3 = m0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const v8f x0 = load8(w + i), x1 = load8(w + i + 8), x2 = load8(w + i + 16), x3 = load8(w + i + 24);
    m0 = m0 < x0 ? x0 : m0;
    m1 = m1 < x1 ? x1 : m1;
    m2 = m2 < x2 ? x2 : m2;
    m3 = m3 < x3 ? x3 : m3;
  }
  m0 = m0 < m1 ? m1 : m0;
  m2 = m2 < m3 ? m3 : m2;
  m0 = m0 < m2 ? m2 : m0;
  float m = kNegInf;
  for (int l = 0; l < 8; ++l) m = std::max(m, m0[l]);
  for (; i < n; ++i) m = std::max(m, w[i]);
  return m;
}

RETOPK_CLONES void softmax_inplace(float* w, int64_t n) {
  const float inv = 1.f / exp_shift_inplace(w, n, row_max(w, n));
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) w[k] *= inv;
}

// acc[e * dv + c] += Σ_j w[e * wstride + j] * rows[j * dv + c] for NH heads (NH <= 3) and m consecutive
// value rows, each element's sum in row order (the same bits as one load-add-store per row and head). The
// accumulators stay in registers over kValueRows rows at a time: kValueVecs vectors of 8 columns per head
// (NH * kValueVecs <= 12 of AVX2's 16 registers) per pass over the group, whose later passes read L1.
// A pass's 32 columns come from load_cols32, in acc's column order for T (split_order<T>: see load16_split).
constexpr int64_t kValueRows = 32;  // rows per group (4 KiB of bfloat16 rows at dv = 64)
constexpr int kValueVecs = 4;       // vectors of 8 columns per head in one pass

// Columns c .. c + 15 of a bfloat16 row as float32 from one 32-byte load: 32-bit lane i holds columns c + 2i
// (its low half) and c + 2i + 1 (its high half), so a shift gives the 8 even columns and a mask the 8 odd
// ones, where widening 8 columns in their order takes a 16-byte load and three shuffles (two half-width
// zero-extends and an insert, AVX2 code) for every vector the value pass multiplies.
RETOPK_INLINE void load16_split(const c10::BFloat16* p, v8f& even, v8f& odd) {
  v8u u;
  std::memcpy(&u, p, sizeof u);
  const v8u e = u << 16, o = u & 0xFFFF0000u;
  std::memcpy(&even, &e, sizeof even);
  std::memcpy(&odd, &o, sizeof odd);
}

// Whether a pool of T has the value pass hold acc's 32-column passes in split order: each 16 columns as
// their 8 even ones, then their 8 odd ones (load16_split's lanes).
template <typename T>
constexpr bool split_order = std::is_same_v<T, c10::BFloat16>;

// Columns c .. c + 31 of a row into x[0..4), 8 each, in acc's order: as stored, or split (load16_split).
static_assert(kValueVecs == 4, "load_cols32 fills a pass's kValueVecs vectors");
template <typename T>
RETOPK_INLINE void load_cols32(const T* r, v8f* x) {
  for (int k = 0; k < 4; ++k) x[k] = load8(r + 8 * k);
}
RETOPK_INLINE void load_cols32(const c10::BFloat16* r, v8f* x) {
  load16_split(r, x[0], x[1]);
  load16_split(r + 16, x[2], x[3]);
}

// acc's nh rows of dv columns between column order and split order (to_split false: back), over the
// columns the 32-column passes cover (dv / 32 * 32); exact copies, so no sum changes.
RETOPK_INLINE void reorder_columns(float* acc, int64_t nh, int64_t dv, bool to_split) {
  float t[16];
  for (int64_t e = 0; e < nh; ++e)
    for (int64_t c = 0; c < dv / 32 * 32; c += 16) {
      float* a = acc + e * dv + c;
      for (int i = 0; i < 8; ++i) {
        if (to_split) {
          t[i] = a[2 * i];
          t[8 + i] = a[2 * i + 1];
        } else {
          t[2 * i] = a[i];
          t[2 * i + 1] = a[8 + i];
        }
      }
      std::memcpy(a, t, sizeof t);
    }
}
template <typename T, int NH>
RETOPK_INLINE void weighted_rows_v(const float* w, int64_t wstride, const T* rows, int64_t m, int64_t dv, float* acc,
                                   const T* next, int64_t ahead) {
  const int64_t rb = dv * static_cast<int64_t>(sizeof(T)), bytes = m * rb, vec_end = dv / 8 * 8;
  for (int64_t j0 = 0; j0 < m; j0 += kValueRows) {
    const int64_t j1 = std::min(m, j0 + kValueRows);
    bool fetch = ahead > 0;  // the group's first pass prefetches, a row's bytes at each row, as the key pass does
    int64_t c = 0;
    for (; c + 8 * kValueVecs <= vec_end; c += 8 * kValueVecs, fetch = false) {
      v8f a[NH][kValueVecs];
      for (int e = 0; e < NH; ++e)
        for (int k = 0; k < kValueVecs; ++k) a[e][k] = load8(acc + e * dv + c + 8 * k);
      for (int64_t j = j0; j < j1; ++j) {
        if (fetch) prefetch_stream(rows, bytes, next, j * rb + ahead, (j + 1) * rb + ahead);
        const T* r = rows + j * dv + c;
        float we[NH];
        for (int e = 0; e < NH; ++e) we[e] = w[e * wstride + j];
        v8f x[kValueVecs];
        load_cols32(r, x);
        for (int k = 0; k < kValueVecs; ++k)
          for (int e = 0; e < NH; ++e) a[e][k] += we[e] * x[k];
      }
      for (int e = 0; e < NH; ++e)
        for (int k = 0; k < kValueVecs; ++k) store8(acc + e * dv + c + 8 * k, a[e][k]);
    }
    for (; c < vec_end; c += 8, fetch = false) {
      v8f a[NH];
      for (int e = 0; e < NH; ++e) a[e] = load8(acc + e * dv + c);
      for (int64_t j = j0; j < j1; ++j) {
        if (fetch) prefetch_stream(rows, bytes, next, j * rb + ahead, (j + 1) * rb + ahead);
        const v8f x = load8(rows + j * dv + c);
        for (int e = 0; e < NH; ++e) a[e] += w[e * wstride + j] * x;
      }
      for (int e = 0; e < NH; ++e) store8(acc + e * dv + c, a[e]);
    }
    for (int64_t j = j0; j < j1; ++j)  // dv % 8 columns
      for (int64_t cc = vec_end; cc < dv; ++cc)
        for (int e = 0; e < NH; ++e) acc[e * dv + cc] += w[e * wstride + j] * to_float(rows[j * dv + cc]);
  }
}

// acc[e * dv + c] += Σ_j w[e * wstride + j] * rows[j * dv + c] for nh heads and m consecutive value rows:
// each value row is loaded (and widened) once per three heads; the first pass prefetches as it goes
// (prefetch_stream; `next`: the run read after this one). acc is in column order before and after.
template <typename T>
RETOPK_INLINE void weighted_rows_heads(const float* w, int64_t wstride, int64_t nh, const T* rows, int64_t m,
                                       int64_t dv, float* acc, const T* next) {
  if (split_order<T>) reorder_columns(acc, nh, dv, true);
  for (int64_t e = 0; e < nh;) {
    const int64_t n = std::min<int64_t>(3, nh - e), ahead = e == 0 ? kStreamAhead : 0;
    if (n == 3) weighted_rows_v<T, 3>(w + e * wstride, wstride, rows, m, dv, acc + e * dv, next, ahead);
    else if (n == 2) weighted_rows_v<T, 2>(w + e * wstride, wstride, rows, m, dv, acc + e * dv, next, ahead);
    else weighted_rows_v<T, 1>(w + e * wstride, wstride, rows, m, dv, acc + e * dv, next, ahead);
    e += n;
  }
  if (split_order<T>) reorder_columns(acc, nh, dv, false);
}
template <typename T>
RETOPK_CLONES void weighted_rows(const float* w, int64_t wstride, int64_t nh, const T* rows, int64_t m, int64_t dv,
                                 float* acc, const T* next) {
  weighted_rows_heads(w, wstride, nh, rows, m, dv, acc, next);
}

#ifdef RETOPK_F16C
__attribute__((target("arch=x86-64-v3"))) void weighted_rows_f16c(const float* w, int64_t wstride, int64_t nh,
                                                                 const c10::Half* rows, int64_t m, int64_t dv,
                                                                 float* acc, const c10::Half* next) {
  weighted_rows_heads(w, wstride, nh, reinterpret_cast<const HalfF16C*>(rows), m, dv, acc,
                      reinterpret_cast<const HalfF16C*>(next));
}
#endif

// weighted_rows on this CPU's loops (f16c_gathers for float16 rows).
template <typename T>
void value_rows(const float* w, int64_t wstride, int64_t nh, const T* rows, int64_t m, int64_t dv, float* acc,
                const T* next) {
#ifdef RETOPK_F16C
  if constexpr (std::is_same_v<T, c10::Half>)
    if (f16c_gathers()) return weighted_rows_f16c(w, wstride, nh, rows, m, dv, acc, next);
#endif
  weighted_rows(w, wstride, nh, rows, m, dv, acc, next);
}

template <typename KV>
struct Task {
  const Params& p;
  const KV* k_pool;
  const KV* v_pool;
  const int64_t* bt;  // this sequence's block-table row
  int64_t b, g, L, slot;
  float* queries;    // (S, H, C, d)
  int64_t* support;  // (S, H, C, K)
  int64_t fill, ptr, t_dec;

  int64_t row(int64_t pos) const {  // pool row of (b, g, pos); shifts for the usual power-of-two block size
    if (p.P_shift >= 0) return ((bt[pos >> p.P_shift] * p.H_kv + g) << p.P_shift) + (pos & (p.P - 1));
    return (bt[pos / p.P] * p.H_kv + g) * p.P + pos % p.P;
  }
  int64_t key_off(int64_t pos) const { return row(pos) * p.d; }  // element offsets in k_pool / v_pool
  int64_t val_off(int64_t pos) const { return row(pos) * p.dv; }
  float* fifo_q(int64_t h, int64_t c) const { return queries + ((slot * p.H + h) * p.C + c) * p.d; }
  int64_t* fifo_s(int64_t h, int64_t c) const { return support + ((slot * p.H + h) * p.C + c) * p.K; }

  // Recall (eq. 7) and candidates (eq. 8, 9) into scratch().cand, each also marked in scratch().seen
  // until unmark() (which leaves the bitmap all-zero for the next use).
  void candidates(int64_t h, const float* sims) const {
    Scratch& s = scratch();
    std::vector<int64_t>& recalled = s.rec;
    recalled.clear();
    if (p.recent) {
      for (int64_t age = 1; age <= std::min(p.R, fill); ++age) recalled.push_back(((ptr - age) % p.C + p.C) % p.C);
    } else if (fill <= p.R) {
      for (int64_t c = 0; c < fill; ++c) recalled.push_back(c);
    } else if (p.R <= kScanRecall) {  // the R most similar in one pass, kept in order (R is a handful)
      Scored best[kScanRecall];
      int64_t n = 0;
      for (int64_t c = 0; c < fill; ++c) {
        const float v = sims[c];
        if (n == p.R && !(v > best[n - 1].first)) continue;
        int64_t i = n < p.R ? n++ : n - 1;
        for (; i > 0 && v > best[i - 1].first; --i) best[i] = best[i - 1];
        best[i] = {v, c};
      }
      for (int64_t r = 0; r < n; ++r) recalled.push_back(best[r].second);
    } else {
      std::vector<Scored>& by = s.top;
      by.clear();
      for (int64_t c = 0; c < fill; ++c) by.emplace_back(sims[c], c);
      std::nth_element(by.begin(), by.begin() + (p.R - 1), by.end(), greater_score);
      for (int64_t r = 0; r < p.R; ++r) recalled.push_back(by[r].second);
    }
    // The recalled support rows (K positions each, far apart in the FIFO) on their way from memory while
    // the window is marked.
    for (int64_t c : recalled) prefetch_row(fifo_s(h, c), p.K);
    const int64_t words = (L + 63) / 64;
    if (static_cast<int64_t>(s.seen.size()) < words) s.seen.resize(words, 0);
    uint64_t* seen = s.seen.data();
    const int64_t lo = std::max<int64_t>(0, L - p.W);
    std::vector<int64_t>& cand = s.cand;
    // room for every position offered: the window, the recalled supports and (recall_successors) their successors
    cand.resize(L - lo + static_cast<int64_t>(recalled.size()) * p.K * (p.successors ? 2 : 1));
    int64_t* out = cand.data();
    int64_t n = 0;
    for (int64_t pos = lo; pos < L; ++pos) out[n++] = pos;  // the window first: nothing to test
    for (int64_t w = lo >> 6; lo < L && w <= (L - 1) >> 6; ++w) {  // and its bits a word at a time
      const int64_t a = std::max(lo, w << 6), e = std::min(L, (w + 1) << 6);  // bits [a, e) of word w
      seen[w] |= (e - a == 64 ? ~uint64_t(0) : (uint64_t(1) << (e - a)) - 1) << (a & 63);
    }
    // Then each recalled support's positions, each new one once, in order. Whether a position was seen is
    // a coin toss to a branch predictor, so the test is arithmetic: every position is written at out[n],
    // and n moves past it only when it is new (-1 padding, and defensively a position past the history,
    // is never new and marks nothing).
    auto mark = [&](int64_t pos, bool valid) {
      const int64_t at = valid ? pos : 0;
      const uint64_t bit = static_cast<uint64_t>(valid) << (at & 63), word = seen[at >> 6];
      out[n] = pos;
      n += (word & bit) != bit ? 1 : 0;  // bit = 0 (invalid) never counts
      seen[at >> 6] = word | bit;
    };
    for (int64_t c : recalled) {
      const int64_t* sup = fifo_s(h, c);
      if (p.successors) {  // p and p + 1 (p + 1 <= L - 1, so p in [0, L - 2]; -1 padding has no successor)
        for (int64_t j = 0; j < p.K; ++j) {
          const int64_t pos = sup[j];
          const bool vp = static_cast<uint64_t>(pos) < static_cast<uint64_t>(L);
          const bool vq = static_cast<uint64_t>(pos) < static_cast<uint64_t>(L - 1);  // implies vp
          const int64_t at = vp ? pos : 0;
          if ((at & 63) == 63) {  // p + 1 in the next word
            mark(pos, vp);
            mark(pos + 1, vq);
            continue;
          }
          // Both bits of one word in one read and one write: mark(p) then mark(p + 1) would store the word and
          // read it straight back, a store-to-load wait per support position. p's bit is not p + 1's, so
          // testing both against the word before either is set gives the same answers.
          const uint64_t bp = static_cast<uint64_t>(vp) << (at & 63), bq = static_cast<uint64_t>(vq) << ((at & 63) + 1);
          const uint64_t word = seen[at >> 6];
          out[n] = pos;
          n += (word & bp) != bp ? 1 : 0;
          out[n] = pos + 1;
          n += (word & bq) != bq ? 1 : 0;
          seen[at >> 6] = word | bp | bq;
        }
      } else {
        for (int64_t j = 0; j < p.K; ++j) mark(sup[j], static_cast<uint64_t>(sup[j]) < static_cast<uint64_t>(L));
      }
    }
    cand.resize(n);
  }

  void unmark() const {
    Scratch& s = scratch();
    for (int64_t pos : s.cand) s.seen[pos >> 6] = 0;
  }

  // The reuse path: candidates, their exact scores (eq. 10), rerank (eq. 11) into `top`; returns M_t.
  int64_t reuse(int64_t h, const float* sims, const float* qs, std::vector<Scored>& top) const {
    Scratch& s = scratch();
    candidates(h, sims);
    unmark();
    const std::vector<int64_t>& cand = s.cand;
    const int64_t M = static_cast<int64_t>(cand.size());
    s.off.resize(M);
    s.scores.resize(M);
    for (int64_t j = 0; j < M; ++j) s.off[j] = key_off(cand[j]);
    gather_scores<KV>(qs, k_pool, s.off.data(), M, p.d, s.scores.data());
    keep_topk(s.scores.data(), cand.data(), M, p.K, top);
    return M;
  }

  // |top ∩ A_h| / |top|: the recall the reuse path would have had for this exact support; with mass_recall
  // Σ_{i ∈ top ∩ A_h} w_i / Σ_{i ∈ top} w_i, w_i = exp(e_i - max e) (the weights eq. 12 gives top).
  float would_be_recall(int64_t h, const float* sims, const std::vector<Scored>& top) const {
    if (top.empty()) return 1.f;
    Scratch& s = scratch();
    candidates(h, sims);
    float mx = kNegInf;
    if (p.mass)
      for (const Scored& t : top) mx = std::max(mx, t.first);
    float hits = 0.f, total = 0.f;
    for (const Scored& t : top) {
      const float w = p.mass ? std::exp(t.first - mx) : 1.f;
      total += w;
      if ((s.seen[t.second >> 6] >> (t.second & 63)) & 1) hits += w;
    }
    unmark();
    return hits / total;
  }

  // Exact Top-K over every position for the heads in `heads` (eq. 1): one pass over the group's keys.
  void exact(const std::vector<int64_t>& heads, const float* qs_all, std::vector<std::vector<Scored>>& tops) const {
    Scratch& s = scratch();
    const int64_t n = static_cast<int64_t>(heads.size());
    // Rows are scored in tiles of kTile keys, every head of the tile before the next, so each key row
    // comes from memory once per group; a tile (kTile * d floats) stays in L1/L2 while dot_heads makes
    // its ceil(n / 3) passes. (A block can hold a whole history: PagedKV.contiguous.)
    const int64_t tile = std::min<int64_t>(kTile, p.P);
    s.scores.resize(n * tile);
    s.qe.resize(n * p.d);
    std::vector<float>& kth_of = s.bars;  // per head: a score must beat it to enter (the K-th best kept)
    kth_of.assign(n, kNegInf);
    // per head: the running Top-K as Better's keys (key_select.h; positions < 2^32: check_kv), 2K of room
    s.keys.resize(n * 2 * p.K);
    s.kept.assign(n, 0);
    s.up.resize(2 * p.K);
    s.down.resize(2 * p.K);
    for (int64_t e = 0; e < n; ++e) std::memcpy(s.qe.data() + e * p.d, qs_all + heads[e] * p.d, p.d * sizeof(float));
    for (int64_t first = 0; first < L;) {  // tiles of up to `tile` rows, none straddling a block
      const int64_t rows = std::min({tile, L - first, p.P - first % p.P});
      const KV* keys = k_pool + key_off(first);
      const KV* next = first + rows < L ? k_pool + key_off(first + rows) : nullptr;
      dot_heads<KV>(s.qe.data(), n, keys, rows, p.d, s.scores.data(), tile, next);  // (n, rows) scores
      for (int64_t e = 0; e < n; ++e)
        kth_of[e] = admit_tile(s.scores.data() + e * tile, rows, first, kth_of[e], s.keys.data() + e * 2 * p.K,
                               s.kept[e], p.K, s.up.data(), s.down.data());
      first += rows;
    }
    for (int64_t e = 0; e < n; ++e) {  // the last cut, then the pairs in the keys' order
      uint64_t* buf = s.keys.data() + e * 2 * p.K;
      int64_t size = s.kept[e];
      if (size > p.K) {
        retopk_select::nth_element_keys(buf, buf + (p.K - 1), buf + size, s.up.data(), s.down.data());
        size = p.K;
      }
      tops[e].resize(size);
      for (int64_t j = 0; j < size; ++j) tops[e][j] = scored(buf[j]);
    }
  }

  // Softmax over the selected scores and the weighted sum of their values (eq. 12) -> acc (dv floats).
  void attend(const std::vector<Scored>& top, float* acc) const {
    Scratch& s = scratch();
    const int64_t n = static_cast<int64_t>(top.size());
    std::fill(acc, acc + p.dv, 0.f);
    if (n == 0) return;
    s.w.resize(n);
    s.off.resize(n);
    float m = kNegInf, sum = 0.f;
    for (const Scored& t : top) m = std::max(m, t.first);
    for (int64_t j = 0; j < n; ++j) {
      s.w[j] = std::exp(top[j].first - m);
      sum += s.w[j];
    }
    for (int64_t j = 0; j < n; ++j) {
      s.w[j] /= sum;
      s.off[j] = val_off(top[j].second);
    }
    gather_values<KV>(s.w.data(), v_pool, s.off.data(), n, p.dv, acc);
  }

  // Full attention of the group's G heads (queries qs, scale applied) over all L positions -> acc
  // (G, dv): scores block run by block run (each key row read once for the G heads), a softmax per
  // head, then one pass over the value rows in memory order, each row read once for the G heads.
  // Also each head's Top-K of the same scores (the dense floor's exact supports) in tops[e], ties to the
  // lower position as in exact(); Full attention alone is split_dense, over dense_part.
  void dense(const float* qs, float* acc, std::vector<std::vector<Scored>>& tops) const {
    float* scores = range_scores(qs, 0, L, L > 0 ? v_pool + val_off(0) : nullptr);
    for (int64_t e = 0; e < p.G; ++e) {
      float* w = scores + e * L;
      std::vector<Scored>& top = tops[e];
      top.clear();
      for (int64_t i = 0; i < L; ++i) top.emplace_back(w[i], i);
      if (L > p.K) keep_best(top, p.K);
      softmax_inplace(w, L);
    }
    range_values(scores, 0, L, acc);
  }

  // Positions lo..hi-1 of the G heads' dense attention, unnormalized (one part of a split-K step):
  // mx[e] = max_i s_ei, sum[e] = Σ_i exp(s_ei - mx[e]), acc[e] = Σ_i exp(s_ei - mx[e]) v_i.
  void dense_part(const float* qs, int64_t lo, int64_t hi, float* acc, float* mx, float* sum) const {
    float* scores = range_scores(qs, lo, hi, v_pool + val_off(lo));
    for (int64_t e = 0; e < p.G; ++e) {
      float* w = scores + e * (hi - lo);
      mx[e] = row_max(w, hi - lo);
      sum[e] = exp_shift_inplace(w, hi - lo, mx[e]);
    }
    range_values(scores, lo, hi, acc);
  }

  // The G heads' scores of positions lo..hi-1 in scratch().scores, (G, hi - lo): block run by block run,
  // each key row read once for the G heads; the last run prefetches into `then` (the value rows read next).
  float* range_scores(const float* qs, int64_t lo, int64_t hi, const KV* then) const {
    std::vector<float>& scores = scratch().scores;
    scores.resize(p.G * (hi - lo));
    for (int64_t first = lo; first < hi;) {  // runs of consecutive rows: the rest of a block
      const int64_t rows = std::min(hi - first, p.P - first % p.P);
      const KV* next = first + rows < hi ? k_pool + key_off(first + rows) : then;
      dot_heads<KV>(qs, p.G, k_pool + key_off(first), rows, p.d, scores.data() + (first - lo), hi - lo, next);
      first += rows;
    }
    return scores.data();
  }

  // acc (G, dv) = Σ_i w[e, i - lo] v_i over positions lo..hi-1, the value rows in memory order, each read once.
  void range_values(const float* w, int64_t lo, int64_t hi, float* acc) const {
    std::fill(acc, acc + p.G * p.dv, 0.f);
    for (int64_t first = lo; first < hi;) {
      const int64_t rows = std::min(hi - first, p.P - first % p.P);
      const KV* next = first + rows < hi ? v_pool + val_off(first + rows) : nullptr;
      value_rows<KV>(w + (first - lo), hi - lo, p.G, v_pool + val_off(first), rows, p.dv, acc, next);
      first += rows;
    }
  }
};

struct Outputs {
  at::Tensor out, path, max_sim, n_scored, selected;
};

template <typename KV>
void run_group(const Params& p, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
               const int64_t* bt, const int64_t* lengths, const int64_t* slots, at::Tensor& queries,
               at::Tensor& support, const int64_t* fill, const int64_t* ptr, const int64_t* step, float* tau,
               int64_t* period, const int64_t* phase, Outputs& o, int64_t task) {
  // A task is one (sequence, KV group), or one head of it (p.split = G, task_split). An exact pass reads the
  // group's keys once for the task's heads; a head's scores do not depend on which heads share the pass
  // (dot_heads), so the split does not change the result.
  const int64_t per_group = p.split, G = p.G / per_group;  // G: this task's heads
  const int64_t b = task / (p.H_kv * per_group), g = task / per_group % p.H_kv, h0 = g * p.G + task % per_group * G;
  const int64_t slot = slots[b];
  Task<KV> t{p, k_pool.data_ptr<KV>(), v_pool.data_ptr<KV>(), bt + b * p.bt_stride, b, g, lengths[b], slot,
             queries.data_ptr<float>(), support.data_ptr<int64_t>(), fill[slot], ptr[slot], step[slot]};
  for (int64_t j = 0; j < G; ++j) {  // the rows this task writes last, on their way while it works
    prefetch_row_for_write(t.fifo_s(h0 + j, t.ptr), p.K);
    prefetch_row_for_write(t.fifo_q(h0 + j, t.ptr), p.d);
    prefetch_row_for_write(o.selected.data_ptr<int64_t>() + (b * p.H + h0 + j) * p.K, p.K);
  }
  Scratch& s = scratch();
  s.qn.resize(G * p.d);
  s.qsc.resize(G * p.d);
  s.sims.resize(G * p.C);
  s.ms.resize(G);
  s.path.resize(G);
  s.refresh.resize(G);
  std::vector<float> &qn = s.qn, &qs = s.qsc, &sims = s.sims, &ms = s.ms;
  std::vector<int8_t>& path = s.path;
  std::vector<char>& refresh = s.refresh;  // one phase per group; under refresh_guard one period per head
  float* tau_h = tau + slot * p.H + h0;  // (G,) this group's thresholds in state.tau
  int64_t* period_h = period + slot * p.H + h0;  // (G,) this group's refresh periods in state.period
  const bool guard = p.guard_target > 0.f;
  bool any_refresh = false, all_refresh = true;
  for (int64_t j = 0; j < G; ++j) {
    const int64_t T_h = guard ? period_h[j] : p.T_r;
    // t_dec < 0: a turn's first refresh_first steps (the prefill set it to -N)
    refresh[j] = t.t_dec < 0 || (p.T_r > 0 && t.t_dec > 0 && (t.t_dec + phase[h0]) % T_h == 0);
    any_refresh |= refresh[j] != 0;
    all_refresh &= refresh[j] != 0;
  }
  const char* qbase = static_cast<const char*>(q.data_ptr());
  const int64_t qe = q.element_size();
  for (int64_t j = 0; j < G; ++j) {
    const int64_t h = h0 + j;
    float* x = qn.data() + j * p.d;
    read_row(q, qbase + (b * q.stride(0) + h * q.stride(1)) * qe, q.stride(2), p.d, x);
    double nrm = 0.0;
    for (int64_t i = 0; i < p.d; ++i) nrm += static_cast<double>(x[i]) * x[i];
    const float denom = std::max(static_cast<float>(std::sqrt(nrm)), 1e-12f);
    for (int64_t i = 0; i < p.d; ++i) {
      qs[j * p.d + i] = x[i] * p.scale;
      x[i] = x[i] / denom;
    }
    float* sj = sims.data() + j * p.C;
    dot_block<float>(x, t.fifo_q(h, 0), t.fill, p.d, sj, kStreamAhead);  // fill rows from memory: prefetched
    float mx = kNegInf;
    for (int64_t c = 0; c < t.fill; ++c) mx = std::max(mx, sj[c]);
    ms[j] = mx;
    path[j] = refresh[j] ? p.code.refresh : (mx < tau_h[j] ? p.code.fallback : p.code.reuse);
  }
  if (p.policy != 0 && !all_refresh) {
    bool read = false;
    if (p.policy == 1) {
      for (int64_t j = 0; j < G; ++j) read |= path[j] == p.code.fallback;
    } else {
      float sum = 0.f, tau_sum = 0.f, mn = std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < G; ++j) {
        sum += ms[j];
        tau_sum += tau_h[j];
        mn = std::min(mn, ms[j]);
      }
      read = sum / static_cast<float>(G) < tau_sum / static_cast<float>(G) || mn < p.tau_min;
    }
    for (int64_t j = 0; j < G; ++j)
      if (!refresh[j])
        path[j] = !read ? p.code.reuse : (path[j] == p.code.fallback ? p.code.fallback : p.code.promoted);
  }
  if (static_cast<int64_t>(s.heaps.size()) < G) s.heaps.resize(G);
  std::vector<int64_t>& exact_heads = s.exact_heads;
  exact_heads.clear();
  int32_t* n_scored = o.n_scored.data_ptr<int32_t>() + b * p.H + h0;
  for (int64_t j = 0; j < G; ++j) {
    if (path[j] == p.code.reuse) {
      n_scored[j] = static_cast<int32_t>(t.reuse(h0 + j, sims.data() + j * p.C, qs.data() + j * p.d, s.heaps[j]));
    } else {
      exact_heads.push_back(j);
      n_scored[j] = static_cast<int32_t>(t.L);
    }
  }
  if (!exact_heads.empty()) {
    std::vector<std::vector<Scored>>& tops = s.tops;
    if (tops.size() < exact_heads.size()) tops.resize(exact_heads.size());
    t.exact(exact_heads, qs.data(), tops);
    for (size_t e = 0; e < exact_heads.size(); ++e) s.heaps[exact_heads[e]].swap(tops[e]);
    // tau_calibration, refresh_guard and tau_guard, before this step's entry enters the FIFO
    for (int64_t j : exact_heads) {
      if (t.fill == 0) continue;
      const float th = tau_h[j];
      const bool would_reuse = ms[j] >= th;  // by the threshold this step decided with
      const bool cal = p.cal_target > 0.f && std::fabs(ms[j] - th) < p.cal_band;
      const bool stale_check = guard && path[j] == p.code.refresh && would_reuse;
      const bool raise = p.raise_target > 0.f && would_reuse;
      if (!cal && !stale_check && !raise) continue;
      const float r = t.would_be_recall(h0 + j, sims.data() + j * p.C, s.heaps[j]);
      if (cal) tau_h[j] = std::min(std::max(th + p.cal_rate * (p.cal_target - r), p.cal_lo), std::max(th, p.cal_hi));
      if (stale_check) {
        const int64_t T_h = period_h[j];
        if (r < p.guard_target) period_h[j] = std::max(T_h / 2, p.guard_lo);
        else if (r >= p.guard_fresh) period_h[j] = std::min(T_h * 2, p.T_r);
      }
      if (raise && r < p.raise_target) tau_h[j] = std::max(tau_h[j], std::min(ms[j] + p.raise_margin, 1.f));
    }
  }
  s.acc.resize(p.dv);
  const at::ScalarType out_dt = o.out.scalar_type();
  char* out_base = static_cast<char*>(o.out.data_ptr());
  int64_t* sel = o.selected.data_ptr<int64_t>();
  for (int64_t j = 0; j < G; ++j) {
    const int64_t h = h0 + j;
    const std::vector<Scored>& top = s.heaps[j];
    t.attend(top, s.acc.data());
    write_row(out_dt, s.acc.data(), p.dv, out_base + ((b * p.H + h) * p.dv) * o.out.element_size());
    int64_t* sel_row = sel + (b * p.H + h) * p.K;
    int64_t* fifo = t.fifo_s(h, t.ptr);
    const int64_t n = static_cast<int64_t>(top.size());
    for (int64_t k = 0; k < p.K; ++k) sel_row[k] = fifo[k] = k < n ? top[k].second : -1;
    std::memcpy(t.fifo_q(h, t.ptr), qn.data() + j * p.d, p.d * sizeof(float));
    o.path.data_ptr<int8_t>()[b * p.H + h] = path[j];
    o.max_sim.data_ptr<float>()[b * p.H + h] = ms[j];
  }
}

// run_group's tasks per (sequence, KV group) for `groups` = B * H_kv groups of G heads: 1 (the group's exact
// heads share one read of its keys) unless the heads decide alone (the "head" policy) and there are fewer
// than two groups a thread (one sequence of the embedded model: 3 groups on 2 threads would leave one
// thread idle for a third of the step), when each head is its own task and each exact head reads the keys.
int64_t task_split(int64_t policy, int64_t groups, int64_t G) {
  return policy == 0 && groups < 2 * at::get_num_threads() ? G : 1;
}

#define CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, "retopk_cpu: ", __VA_ARGS__)

void check_int64_vector(const at::Tensor& t, const char* name, int64_t n) {
  CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
  CHECK_VALUE(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  CHECK_VALUE(t.dim() == 1 && t.size(0) == n && t.is_contiguous(), name, " must be a contiguous (", n,
              ",) tensor, got shape ", t.sizes());
}

bool float_type(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// The checks every entry makes of q, the pools, the block table and the lengths (shapes, strides, dtypes,
// devices, and the block table's reach) -> their sizes.
struct KVShape {
  int64_t B, H, d, N, H_kv, P, dv, max_blocks, bt_stride;
};

KVShape check_kv(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& block_table,
                 const at::Tensor& lengths) {
  CHECK_VALUE(q.device().is_cpu(), "q must be on the CPU, got ", q.device());
  CHECK_VALUE(q.dim() == 3, "q must be (B, H, d), got shape ", q.sizes());
  CHECK_VALUE(float_type(q.scalar_type()), "q must be float32, bfloat16 or float16, got ", q.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), d = q.size(2);
  for (auto [t, name] : {std::pair{&k_pool, "k_pool"}, std::pair{&v_pool, "v_pool"}}) {
    CHECK_VALUE(t->device().is_cpu(), name, " must be on the CPU, got ", t->device());
    CHECK_VALUE(t->dim() == 4 && t->is_contiguous(), name, " must be a contiguous (N_blocks, H_kv, P, d) tensor");
  }
  CHECK_VALUE(float_type(k_pool.scalar_type()), "k_pool must be float32, bfloat16 or float16, got ",
              k_pool.scalar_type());
  CHECK_VALUE(v_pool.scalar_type() == k_pool.scalar_type(), "v_pool dtype ", v_pool.scalar_type(),
              " differs from k_pool's ", k_pool.scalar_type());
  const int64_t N = k_pool.size(0), H_kv = k_pool.size(1), P = k_pool.size(2), dv = v_pool.size(3);
  CHECK_VALUE(k_pool.size(3) == d, "k_pool head dim ", k_pool.size(3), " != q head dim ", d);
  CHECK_VALUE(v_pool.sizes().slice(0, 3) == k_pool.sizes().slice(0, 3), "v_pool shape ", v_pool.sizes(),
              " disagrees with k_pool's ", k_pool.sizes());
  CHECK_VALUE(H_kv > 0 && H % H_kv == 0, "num_heads (", H, ") must be a multiple of num_kv_heads (", H_kv, ")");
  CHECK_VALUE(block_table.device().is_cpu() && block_table.scalar_type() == at::kLong && block_table.dim() == 2 &&
                  block_table.size(0) == B && block_table.stride(1) == 1,
              "block_table must be a CPU int64 (B=", B, ", max_blocks) tensor with unit stride along blocks");
  check_int64_vector(lengths, "lengths", B);
  const int64_t max_blocks = block_table.size(1), bt_stride = block_table.stride(0);
  const int64_t* bt = block_table.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    CHECK_VALUE(len[b] >= 1 && len[b] <= max_blocks * P && len[b] <= (int64_t(1) << 32), "lengths[", b, "] = ", len[b],
                " outside [1, ", std::min(max_blocks * P, int64_t(1) << 32), "] (max_blocks x block size; positions < 2^32)");
    for (int64_t j = 0; j < (len[b] + P - 1) / P; ++j) {
      const int64_t blk = bt[b * bt_stride + j];
      CHECK_VALUE(blk >= 0 && blk < N, "block_table[", b, ", ", j, "] = ", blk, " outside the pool's ", N, " blocks");
    }
  }
  return {B, H, d, N, H_kv, P, dv, max_blocks, bt_stride};
}

}  // namespace

std::vector<at::Tensor> decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                               const at::Tensor& block_table, const at::Tensor& lengths, at::Tensor queries,
                               at::Tensor support, at::Tensor fill, at::Tensor ptr, at::Tensor step,
                               const at::Tensor& slots, at::Tensor tau, at::Tensor period, const at::Tensor& phase,
                               int64_t top_k,
                               int64_t recall, int64_t window,
                               int64_t refresh_every, bool successors, const std::string& retrieval,
                               const std::string& gqa_policy,
                               double group_tau_min, double scale, std::vector<int64_t> path_codes,
                               std::vector<double> calibration, std::vector<double> guard) {
  // ---- the launcher's checks: shapes, strides, dtypes, devices, and the block table's reach --------
  const auto [B, H, d, N, H_kv, P, dv, max_blocks, bt_stride] = check_kv(q, k_pool, v_pool, block_table, lengths);
  check_int64_vector(slots, "slots", B);
  CHECK_VALUE(queries.device().is_cpu() && queries.scalar_type() == at::kFloat && queries.dim() == 4 &&
                  queries.is_contiguous() && queries.size(1) == H && queries.size(3) == d,
              "state.queries must be a contiguous float32 (S, H=", H, ", C, d=", d, ") tensor, got ",
              queries.scalar_type(), " ", queries.sizes());
  const int64_t S = queries.size(0), C = queries.size(2);
  CHECK_VALUE(support.device().is_cpu() && support.scalar_type() == at::kLong && support.is_contiguous() &&
                  support.dim() == 4 && support.size(0) == S && support.size(1) == H && support.size(2) == C &&
                  support.size(3) == top_k,
              "state.support must be a contiguous int64 (S, H, C, K=", top_k, ") tensor, got ",
              support.scalar_type(), " ", support.sizes());
  check_int64_vector(fill, "state.fill", S);
  check_int64_vector(ptr, "state.ptr", S);
  check_int64_vector(step, "state.step", S);
  CHECK_VALUE(tau.device().is_cpu() && tau.scalar_type() == at::kFloat && tau.is_contiguous() && tau.dim() == 2 &&
                  tau.size(0) == S && tau.size(1) == H,
              "state.tau must be a contiguous float32 (S, H=", H, ") tensor, got ", tau.scalar_type(), " ",
              tau.sizes());
  CHECK_VALUE(period.device().is_cpu() && period.scalar_type() == at::kLong && period.is_contiguous() &&
                  period.dim() == 2 && period.size(0) == S && period.size(1) == H,
              "state.period must be a contiguous int64 (S, H=", H, ") tensor, got ", period.scalar_type(), " ",
              period.sizes());
  check_int64_vector(phase, "state.phase", H);
  const int64_t* ph = phase.data_ptr<int64_t>();
  for (int64_t h = 0; h < H; ++h)
    CHECK_VALUE(ph[h] >= 0 && ph[h] == ph[h - h % (H / H_kv)], "state.phase[", h, "] = ", ph[h],
                ": phases must be >= 0 and shared by the heads of a KV group");
  CHECK_VALUE(calibration.size() == 8, "calibration must be (target, rate, band, lo, hi, mass, tau_guard target, "
              "tau_guard margin), got ", calibration.size(), " values");
  CHECK_VALUE(calibration[6] >= 0.0 && calibration[6] <= 1.0 && calibration[7] >= 0.0 && calibration[7] <= 1.0,
              "tau_guard's target and margin must lie in [0, 1], got ", calibration[6], ", ", calibration[7]);
  CHECK_VALUE(guard.size() == 3, "guard must be (target, target + margin, lowest period)");
  const int64_t guard_lo = static_cast<int64_t>(guard[2]);
  CHECK_VALUE(guard[0] <= 0.0 || (refresh_every > 0 && guard_lo >= 1 && guard_lo <= refresh_every),
              "refresh_guard needs refresh_every > 0 and a lowest period in [1, refresh_every], got ", refresh_every,
              ", ", guard_lo);
  CHECK_VALUE(top_k > 0 && recall > 0 && recall <= C && window >= 0 && refresh_every >= 0,
              "top_k, recall (<= C), window, refresh_every out of range: ", top_k, ", ", recall, ", ", window, ", ",
              refresh_every);
  CHECK_VALUE(retrieval == "similarity" || retrieval == "recent", "retrieval must be 'similarity' or 'recent', got '",
              retrieval, "'");
  const int64_t policy = gqa_policy == "head" ? 0 : gqa_policy == "promote" ? 1 : gqa_policy == "group" ? 2 : -1;
  CHECK_VALUE(policy >= 0, "gqa_policy must be 'head', 'promote' or 'group', got '", gqa_policy, "'");
  CHECK_VALUE(path_codes.size() == 4, "path_codes must be (reuse, fallback, refresh, promoted)");
  const int64_t* bt = block_table.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t *fl = fill.data_ptr<int64_t>(), *pt = ptr.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    CHECK_VALUE(sl[b] >= 0 && sl[b] < S, "slots[", b, "] = ", sl[b], " outside the state's ", S, " slots");
    for (int64_t a = 0; a < b; ++a) CHECK_VALUE(sl[a] != sl[b], "slots[", a, "] and slots[", b, "] are both ", sl[b]);
    CHECK_VALUE(fl[sl[b]] >= 0 && fl[sl[b]] <= C && pt[sl[b]] >= 0 && pt[sl[b]] < C, "state.fill / state.ptr of slot ",
                sl[b], " outside [0, C=", C, "]");
    if (guard[0] > 0.0)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t T_h = period.data_ptr<int64_t>()[sl[b] * H + h];
        CHECK_VALUE(T_h >= guard_lo && T_h <= refresh_every, "state.period[", sl[b], ", ", h, "] = ", T_h,
                    " outside [", guard_lo, ", ", refresh_every, "]");
      }
  }

  const int64_t P_shift = (P & (P - 1)) == 0 ? __builtin_ctzll(static_cast<unsigned long long>(P)) : -1;
  Params p{B, H, H_kv, H / H_kv, d, dv, C, top_k, recall, window, P, P_shift, refresh_every, bt_stride,
           static_cast<float>(group_tau_min), static_cast<float>(scale),
           static_cast<float>(calibration[0]), static_cast<float>(calibration[1]), static_cast<float>(calibration[2]),
           static_cast<float>(calibration[3]), static_cast<float>(calibration[4]),
           static_cast<float>(guard[0]), static_cast<float>(guard[1]), guard_lo,
           retrieval == "recent", policy, task_split(policy, B * H_kv, H / H_kv), successors,
           Codes{static_cast<int8_t>(path_codes[0]), static_cast<int8_t>(path_codes[1]),
                 static_cast<int8_t>(path_codes[2]), static_cast<int8_t>(path_codes[3])},
           calibration[5] != 0.0, static_cast<float>(calibration[6]), static_cast<float>(calibration[7])};
  auto i8 = at::TensorOptions().dtype(at::kChar);
  Outputs o{at::empty({B, H, dv}, q.options().memory_format(at::MemoryFormat::Contiguous)),
            at::empty({B, H}, i8), at::empty({B, H}, at::TensorOptions().dtype(at::kFloat)),
            at::empty({B, H}, at::TensorOptions().dtype(at::kInt)),
            at::empty({B, H, top_k}, at::TensorOptions().dtype(at::kLong))};
  const int64_t* st = step.data_ptr<int64_t>();
  float* tw = tau.data_ptr<float>();
  int64_t* pdw = period.data_ptr<int64_t>();
  // run_group's tasks, handed out one at a time as threads come free: a head on the exact path (a fallback
  // or a refresh) costs several reusing heads, so fixed shares of the tasks would leave a thread waiting.
  // A task's result does not depend on the thread that runs it.
  const int64_t tasks = B * H_kv * p.split;
  std::atomic<int64_t> next{0};
  auto body = [&](int64_t, int64_t) {
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      switch (k_pool.scalar_type()) {
        case at::kFloat:
          run_group<float>(p, q, k_pool, v_pool, bt, len, sl, queries, support, fl, pt, st, tw, pdw, ph, o, task);
          break;
        case at::kBFloat16:
          run_group<c10::BFloat16>(p, q, k_pool, v_pool, bt, len, sl, queries, support, fl, pt, st, tw, pdw, ph, o,
                                   task);
          break;
        default:
          run_group<c10::Half>(p, q, k_pool, v_pool, bt, len, sl, queries, support, fl, pt, st, tw, pdw, ph, o,
                               task);
      }
    }
  };
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, body);  // one body per thread
  int64_t *fw = fill.data_ptr<int64_t>(), *pw = ptr.data_ptr<int64_t>(), *sw = step.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s = sl[b];
    pw[s] = (pw[s] + 1) % C;
    fw[s] = std::min(fw[s] + 1, C);
    sw[s] += 1;
  }
  return {o.out, o.path, o.max_sim, o.n_scored, o.selected};
}

namespace {

// q[b, h0 .. h0 + G - 1] * scale as float32, (G, d): the queries of one (sequence, KV group).
std::vector<float> scaled_queries(const Params& p, const at::Tensor& q, int64_t b, int64_t h0) {
  std::vector<float> qs(p.G * p.d);
  const char* base = static_cast<const char*>(q.data_ptr());
  for (int64_t j = 0; j < p.G; ++j) {
    float* x = qs.data() + j * p.d;
    read_row(q, base + (b * q.stride(0) + (h0 + j) * q.stride(1)) * q.element_size(), q.stride(2), p.d, x);
    for (int64_t i = 0; i < p.d; ++i) x[i] *= p.scale;
  }
  return qs;
}

// Full attention split along the keys (flash-decoding): each (sequence, KV group) in parts of kDensePart
// positions, one task each, so that a few groups keep every thread busy; then per head
//   out = Σ_p e^(m_p - M) acc_p / Σ_p e^(m_p - M) sum_p,  M = max_p m_p  (dense_part's m, sum, acc).
// The parts depend on L alone, never on the batch, so a row's output does not depend on its batch.
constexpr int64_t kDensePart = 512;

void split_dense(const Params& p, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                 const int64_t* bt, const int64_t* len, at::Tensor& out) {
  const int64_t B = p.B, H_kv = p.H_kv, G = p.G, dv = p.dv;
  std::vector<int64_t> parts(B), first(B + 1, 0);  // parts per (sequence, group); tasks of sequence b from first[b]
  for (int64_t b = 0; b < B; ++b) {
    parts[b] = (len[b] + kDensePart - 1) / kDensePart;
    first[b + 1] = first[b] + H_kv * parts[b];
  }
  const int64_t tasks = first[B];
  std::vector<float> acc(tasks * G * dv), mx(tasks * G), sum(tasks * G);
  auto run = [&](auto kv_type, int64_t task) {
    using KV = decltype(kv_type);
    const int64_t b = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
    const int64_t g = (task - first[b]) / parts[b], part = (task - first[b]) % parts[b], h0 = g * G;
    Task<KV> t{p, k_pool.data_ptr<KV>(), v_pool.data_ptr<KV>(), bt + b * p.bt_stride, b, g, len[b], 0,
               nullptr, nullptr, 0, 0, 0};
    const std::vector<float> qs = scaled_queries(p, q, b, h0);
    const int64_t lo = part * kDensePart, hi = std::min(len[b], lo + kDensePart);
    t.dense_part(qs.data(), lo, hi, acc.data() + task * G * dv, mx.data() + task * G, sum.data() + task * G);
  };
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      switch (k_pool.scalar_type()) {
        case at::kFloat: run(float{}, task); break;
        case at::kBFloat16: run(c10::BFloat16{}, task); break;
        default: run(c10::Half{}, task);
      }
    }
  });
  char* obase = static_cast<char*>(out.data_ptr());
  std::vector<float> o(dv);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < H_kv; ++g)
      for (int64_t j = 0; j < G; ++j) {
        const int64_t t0 = first[b] + g * parts[b];
        float M = kNegInf, den = 0.f;
        for (int64_t k = 0; k < parts[b]; ++k) M = std::max(M, mx[(t0 + k) * G + j]);
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t k = 0; k < parts[b]; ++k) {
          const float w = std::exp(mx[(t0 + k) * G + j] - M);
          den += w * sum[(t0 + k) * G + j];
          const float* a = acc.data() + ((t0 + k) * G + j) * dv;
          for (int64_t c = 0; c < dv; ++c) o[c] += w * a[c];
        }
        for (int64_t c = 0; c < dv; ++c) o[c] /= den;
        write_row(out.scalar_type(), o.data(), dv, obase + (b * p.H + g * G + j) * dv * out.element_size());
      }
}

}  // namespace

// Full attention (top_k = 0), full attention plus each head's exact Top-K of the same scores (top_k > 0,
// exact = false: the dense floor's steps that push a FIFO entry), or Exact Top-K attention (top_k > 0,
// exact = true: softmax over the K best scores only, eq. 1 and 12) for q (B, H, d) over the paged
// keys and values, one task per (sequence, KV group), or with top_k = 0 per part of kDensePart keys of one
// (split_dense). Returns out (B, H, dv) in q's dtype and, with top_k > 0, selected (B, H, top_k) int64
// (-1 padded when L < top_k, in no particular order).
std::vector<at::Tensor> dense_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                     const at::Tensor& block_table, const at::Tensor& lengths, double scale,
                                     int64_t top_k, bool exact) {
  const auto [B, H, d, N, H_kv, P, dv, max_blocks, bt_stride] = check_kv(q, k_pool, v_pool, block_table, lengths);
  CHECK_VALUE(top_k >= 0 && (top_k > 0 || !exact), "top_k must be >= 0 (> 0 with exact), got ", top_k);
  const int64_t P_shift = (P & (P - 1)) == 0 ? __builtin_ctzll(static_cast<unsigned long long>(P)) : -1;
  Params p{B, H, H_kv, H / H_kv, d, dv, 0, top_k, 0, 0, P, P_shift, 0, bt_stride, 0.f, static_cast<float>(scale),
           0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 1, false, 0, 1, false, Codes{}};
  at::Tensor out = at::empty({B, H, dv}, q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor selected = at::full({B, top_k > 0 ? H : 0, top_k}, -1, at::TensorOptions().dtype(at::kLong));
  const int64_t* bt = block_table.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  char* obase = static_cast<char*>(out.data_ptr());
  auto run = [&](auto kv_type, int64_t task) {
    using KV = decltype(kv_type);
    const int64_t b = task / H_kv, g = task % H_kv, G = p.G, h0 = g * G;
    Task<KV> t{p, k_pool.data_ptr<KV>(), v_pool.data_ptr<KV>(), bt + b * bt_stride, b, g, len[b], 0,
               nullptr, nullptr, 0, 0, 0};
    const std::vector<float> qs = scaled_queries(p, q, b, h0);
    std::vector<float> acc(G * dv);
    std::vector<std::vector<Scored>> tops(G);
    if (exact) {
      std::vector<int64_t> heads(G);
      for (int64_t j = 0; j < G; ++j) heads[j] = j;
      t.exact(heads, qs.data(), tops);
      for (int64_t j = 0; j < G; ++j) t.attend(tops[j], acc.data() + j * dv);
    } else {
      t.dense(qs.data(), acc.data(), tops);
    }
    for (int64_t j = 0; j < G; ++j) {
      const int64_t h = h0 + j;
      write_row(out.scalar_type(), acc.data() + j * dv, dv, obase + (b * H + h) * dv * out.element_size());
      if (top_k > 0) {
        int64_t* sel = selected.data_ptr<int64_t>() + (b * H + h) * top_k;
        for (size_t k = 0; k < tops[j].size(); ++k) sel[k] = tops[j][k].second;
      }
    }
  };
  if (top_k == 0) {
    split_dense(p, q, k_pool, v_pool, bt, len, out);
    return {out, selected};
  }
  at::parallel_for(0, B * H_kv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      switch (k_pool.scalar_type()) {
        case at::kFloat: run(float{}, task); break;
        case at::kBFloat16: run(c10::BFloat16{}, task); break;
        default: run(c10::Half{}, task);
      }
    }
  });
  return {out, selected};
}

// The largest of x[0..15] (NaN lanes may be dropped: a NaN is never selected anyway).
inline float block_max16(const float* x) {
#ifdef __SSE__
  __m128 m = _mm_max_ps(_mm_max_ps(_mm_loadu_ps(x), _mm_loadu_ps(x + 4)),
                        _mm_max_ps(_mm_loadu_ps(x + 8), _mm_loadu_ps(x + 12)));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
#else
  float m = x[0];
  for (int j = 1; j < 16; ++j) m = x[j] > m ? x[j] : m;
  return m;
#endif
}

// ReTopK's prefill seeding (ReTopK.prefill, retopk.py): the positions of each row's k largest scores, the
// best first, the lower position first among equal scores (Better), -1 where a row of fewer than k finite
// scores must take a -inf; NaN is never selected. scores (N, L) float32, unit column stride -> (N, k)
// int64. Per row: the maxima of its blocks of 16; the k-th largest of them is a bar no entry of the Top-k
// is below (the k largest maxima are k distinct entries), so one pass admits only the entries >= bar,
// skipping every block whose maximum is below it, and keep_best's running cut raises the bar as they come.
// Where torch.topk partially sorts every row, this reads each score once and sorts a few per row.
at::Tensor topk_rows(const at::Tensor& scores, int64_t k) {
  CHECK_VALUE(scores.device().is_cpu() && scores.scalar_type() == at::kFloat && scores.dim() == 2 &&
                  (scores.size(1) <= 1 || scores.stride(1) == 1),
              "scores must be a float32 (N, L) CPU tensor with unit column stride");
  CHECK_VALUE(k > 0, "k must be positive, got ", k);
  const int64_t N = scores.size(0), L = scores.size(1), stride = scores.stride(0), nb = L / 16;
  at::Tensor out = at::full({N, k}, -1, at::TensorOptions().dtype(at::kLong));
  const float* base = scores.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    std::vector<Scored> buf;
    buf.reserve(2 * k);
    std::vector<float> maxima(nb), kth(nb);
    for (int64_t r = lo; r < hi; ++r) {
      const float* row = base + r * stride;
      for (int64_t b = 0; b < nb; ++b) maxima[b] = block_max16(row + 16 * b);
      float bar = -INFINITY;  // entries >= bar enter until the first cut, entries > bar after it
      if (nb >= k) {
        kth = maxima;
        std::nth_element(kth.begin(), kth.begin() + (k - 1), kth.end(), std::greater<float>());
        bar = kth[k - 1];
      }
      bool cut = false;
      buf.clear();
      auto admit = [&](int64_t i) {
        const float v = row[i];
        if (cut ? v > bar : v >= bar) {
          buf.emplace_back(v, i);
          if (static_cast<int64_t>(buf.size()) == 2 * k) {
            bar = keep_best(buf, k);
            cut = true;
          }
        }
      };
      for (int64_t b = 0; b < nb; ++b)
        if (cut ? maxima[b] > bar : maxima[b] >= bar)
          for (int64_t i = 16 * b; i < 16 * b + 16; ++i) admit(i);
      for (int64_t i = 16 * nb; i < L; ++i) admit(i);
      if (static_cast<int64_t>(buf.size()) > k) keep_best(buf, k);
      std::sort(buf.begin(), buf.end(), Better{});
      for (size_t j = 0; j < buf.size(); ++j) o[r * k + j] = buf[j].first == -INFINITY ? -1 : buf[j].second;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ReTopK's fused CPU decode step and the decoder's CPU ops (see retopk_core/cpu/launch.py)";
  m.def("decode", &decode, "One ReTopK decode step for every (sequence, head) of a batch; updates the FIFO state");
  m.def("dense_decode", &dense_decode, "Full attention (with the exact Top-K of its scores) or Exact Top-K attention");
  m.def("best_isa", &best_isa, "The widest SIMD level of this CPU the linear ops use: 0 plain, 1 AVX2, 2 AVX-512, 3 AVX-512 VNNI");
  m.def("isa_level", &isa_level, "The SIMD level this process runs at: best_isa() unless set_isa_level lowered it");
  m.def("set_isa_level", &set_isa_level, "Set the process's SIMD level (0 .. best_isa(); launch.extension() does, once)");
  m.def("wide_key_scoring", &wide_key_scoring, "Whether the attention's key scoring takes its AVX-512 loops");
  m.def("f16c_gathers", &f16c_gathers, "Whether the float16 KV rows are widened by F16C (x86-64-v3), summed as float32 rows");
  m.def("amx_available", &amx_available, "Whether bf16x2 activations can run: AMX-BF16 and the tile state granted");
  m.def("pack_units", &pack_units, "Q4_1 or Q8_0 blocks (qs, scales) -> the units bf16x2 and int16 block products take in place of qs");
  m.def("block_matmul", &block_matmul, "x W^T (+ bias) (+ residual) with W in GGUF blocks of 32 (Q4_1 or Q8_0)");
  m.def("quantize_activations", &quantize_activations, "x per row and block of 32 -> int8 values and (dx, sx) per block");
  m.def("rms_norm", &rms_norm, "x / sqrt(mean(x^2) + eps) * w over the rows of x");
  m.def("rope_", &rope_, "RoPE in place on x (N, heads, d): x cos + rotate_half(x) sin");
  m.def("topk_rows", &topk_rows, "The positions of each row's k largest scores, best first (ReTopK's prefill seeding)");
  m.def("store_kv", &store_kv, "store_rows of a step's keys and of its values");
  m.def("swiglu", &swiglu, "g / (1 + exp(-g)) * u for gu = [g, u]");
  m.def("packed_linear_rows", &packed_linear_rows, "x W^T, W packed by oneDNN: one oneDNN call per thread on its rows");
  m.def("causal_attention_segments_", &causal_attention_segments_,
        "Each segment's causal SDPA over its own rows, into out (1, N, H, d), one segment per thread");
  m.def("attn_in", &attn_in, "rms_norm, the QKV product and RoPE of a decode layer in one call");
  m.def("mlp_out", &mlp_out, "the o product, residual, rms_norm, gate-up, swiglu, down and residual in one call");
  bind_decode_layers(m);  // decode_layers.cpp
}
