// Whether AMX's bf16 tiles can take the decode step's Q4_1 block products off the float32 FMA bound of
// decoder_ops.cpp's loops (issue 28) while staying near float32 accuracy: a measurement, no product code.
//
//   g++ -O3 -mavx512f -mavx512bw -mavx512bf16 -mf16c -mfma -mamx-tile -mamx-bf16 bench/amx_products.cpp -o /tmp/amx_products
//   /tmp/amx_products [--copies 10] [--rounds 7]
//
// Weights: random Q4_1 (block_matmul's layout: qs (out, in / 2) nibbles, scales (out, in / 32, 2) f16 (d, m),
// W[o, 32 b + j] = d q + m) at SmolLM2-135M's shapes, per layer qkv 960x576, o 576x576, gate_up 3072x576,
// down 576x1536, 30 layers of distinct matrices: a "step" is those 120 products (the Q8_0 LM head is left out).
// x: M rows (M = 1, 4, 8) of float32, normal(0, 1) with four outliers of magnitude 20-60 per row, the same x
// for every product of one input width.
//   A    decoder_ops.cpp's float32 AVX-512 loops (copies of q4_dot_avx512 for M <= 4, q4_dot_avx512_wide for
//        M > 4, and block_matmul's loop over output rows with its prefetch), one thread.
//   B    AMX bf16 with x = hi + lo, hi = bf16(x), lo = bf16(x - hi) (x to about 16 bits; the nibbles 0..15 are
//        exact in bf16). Per block b of 32 inputs and group of 16 output rows, one tdpbf16ps:
//          C (2M, 16) = A_b (2M limb rows, 32 bf16) . B_b (16 pair rows, 16 outputs x 2 bf16)
//          y[r][n] += d_b[n] (C[r][n] + C[M + r][n]) + m_b[n] sum_j x_r[32 b + j]   (AVX-512, after tilestored)
//        B_b is widened from the nibbles on every use; the weights are repacked once at load (not timed) into
//        tiles' order, 320 bytes per (group, block), the same bytes per weight as Q4_1 (repack_amx).
//   C    the same with three limbs (hi, mid, lo; x to about 24 bits), A = 3M rows in tiles of at most 16.
// Prints, per way and M, the max over outputs of |y - y64| / sum_j |W_j x_j| against a float64 product of the
// dequantized weights (A's figure is float32's own rounding, the yardstick) and whether row 0's outputs at M = 4
// and 8 are bit for bit its outputs alone (a request's tokens independent of its batch), with, for scale, the
// same figure for int8 activations (llama.cpp's, which flip greedy tokens: issue 28), then the step's CPU time
// (CLOCK_THREAD_CPUTIME_ID, median of the rounds, the ways taking turns within each round) for two working
// sets: one copy of the weights (66 MB) stepped over repeatedly (as a server steps over its model), part of
// which may stay in the L3 the VM reports (480 MiB), and --copies distinct copies in turn (more than that L3 by
// default), with a read of the Q4_1 bytes alone (64-byte loads) as the weight-read floor. Weights in huge pages.
// Not part of the test suite (docs/bench/history.md).

#include <immintrin.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace {
double cpu_now() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

// 64-byte aligned, never freed (the program's arrays live until it exits); from 2 MB on in huge pages where the
// kernel has them, as the project's weights are (retopk_core/hugepages.py), so that the TLB does not bound the reads
template <class T>
T* alloc64(size_t n) {
  const size_t bytes = (n * sizeof(T) + 63) / 64 * 64, huge = size_t{2} << 20;
  void* p = std::aligned_alloc(bytes >= huge ? huge : 64, bytes >= huge ? (bytes + huge - 1) / huge * huge : bytes);
  if (!p) {
    std::fprintf(stderr, "out of memory\n");
    std::exit(1);
  }
  if (bytes >= huge) madvise(p, (bytes + huge - 1) / huge * huge, MADV_HUGEPAGE);
  return static_cast<T*>(p);
}

// ---- way A: a copy of decoder_ops.cpp's float32 AVX-512 loops, for measurement only ----
constexpr int64_t kAhead = 16;
constexpr int64_t kScaleChunk = 64;

TARGET_AVX2 inline void widen_halves(const uint16_t* h, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < n; ++i) out[i] = _cvtsh_ss(h[i]);
}

// copy of decoder_ops.cpp's q4_dot_avx512
template <int MR>
TARGET_AVX512 void q4_dot_avx512(const uint8_t* qs, const uint16_t* sc, int64_t nb, const float* x, int64_t ldx,
                                 float* acc) {
  constexpr int U = 2;
  __m512 a[MR][2 * U];
  for (int r = 0; r < MR; ++r)
    for (int k = 0; k < 2 * U; ++k) a[r][k] = _mm512_setzero_ps();
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  float s[2 * kScaleChunk];
  for (int64_t c0 = 0; c0 < nb; c0 += kScaleChunk) {
    const int64_t nc = std::min(kScaleChunk, nb - c0);
    widen_halves(sc + 2 * c0, 2 * nc, s);
    for (int64_t i = 0; i < nc; i += U) {
      for (int u = 0; u < U && i + u < nc; ++u) {
        const int64_t b = c0 + i + u;
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * b)));
        const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(s[2 * (i + u)]), _mm512_set1_ps(s[2 * (i + u) + 1]));
        const __m512 w0 = _mm512_permutexvar_ps(v, table);
        const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
        for (int r = 0; r < MR; ++r) {
          const float* xr = x + r * ldx + 32 * b;
          a[r][2 * u] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), a[r][2 * u]);
          a[r][2 * u + 1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), a[r][2 * u + 1]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    __m512 t = a[r][0];
    for (int k = 1; k < 2 * U; ++k) t = _mm512_add_ps(t, a[r][k]);
    acc[r] = _mm512_reduce_add_ps(t);
  }
}

// copy of decoder_ops.cpp's q4_dot_avx512_wide (since session 28's h58: the even blocks, then the odd ones, so that
// no accumulator spills; the same bits as the two parity passes it replaced)
template <int MR>
TARGET_AVX512 void q4_dot_avx512_wide(const uint8_t* qs, const uint16_t* sc, int64_t nb, const float* x, int64_t ldx,
                                      float* acc) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 even[MR];
  float s[2 * kScaleChunk];
#pragma GCC unroll 2
  for (int p = 0; p < 2; ++p) {
    __m512 a[MR][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < nb; c0 += kScaleChunk) {
      const int64_t nc = std::min(kScaleChunk, nb - c0);
      widen_halves(sc + 2 * c0, 2 * nc, s);
      for (int64_t i = p; i < nc; i += 2) {
        const int64_t b = c0 + i;
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * b)));
        const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(s[2 * i]), _mm512_set1_ps(s[2 * i + 1]));
        const __m512 w0 = _mm512_permutexvar_ps(v, table);
        const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const float* xr = x + r * ldx + 32 * b;
          a[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), a[r][0]);
          a[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), a[r][1]);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      if (p == 0)
        even[r] = _mm512_add_ps(a[r][0], a[r][1]);
      else
        acc[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(even[r], a[r][0]), a[r][1]));
    }
  }
}

using DotFn = void (*)(const uint8_t*, const uint16_t*, int64_t, const float*, int64_t, float*);

DotFn dot_fn(int mr) {  // decoder_ops.cpp's RETOPK_PICK_WIDE(q4_dot_avx512, q4_dot_avx512_wide)
  switch (mr) {
    case 1: return q4_dot_avx512<1>;
    case 2: return q4_dot_avx512<2>;
    case 3: return q4_dot_avx512<3>;
    case 4: return q4_dot_avx512<4>;
    case 5: return q4_dot_avx512_wide<5>;
    case 6: return q4_dot_avx512_wide<6>;
    case 7: return q4_dot_avx512_wide<7>;
    default: return q4_dot_avx512_wide<8>;
  }
}

struct Q4 {  // one matrix in block_matmul's layout
  int out, in;
  uint8_t* qs;   // (out, in / 2)
  uint16_t* sc;  // (out, in / 32, 2): f16 (d, m)
};

// y (M, out) = x (M, in) W^T: block_matmul's loop over output rows on one thread (M <= 8: one pass a row)
void product_a(const Q4& w, const float* x, int M, float* y) {
  const int64_t nb = w.in / 32, row_bytes = w.in / 2, row_scales = 2 * nb;
  const DotFn fn = dot_fn(M);
  float acc[8];
  for (int64_t o = 0; o < w.out; ++o) {
    if (o + kAhead < w.out) {
      const char* q = reinterpret_cast<const char*>(w.qs + (o + kAhead) * row_bytes);
      for (int64_t k = 0; k < row_bytes; k += 64) __builtin_prefetch(q + k, 0, 3);
      const char* sc = reinterpret_cast<const char*>(w.sc + (o + kAhead) * row_scales);
      for (int64_t k = 0; k < 2 * row_scales; k += 64) __builtin_prefetch(sc + k, 0, 3);
    }
    fn(w.qs + o * row_bytes, w.sc + o * row_scales, nb, x, w.in, acc);
    for (int r = 0; r < M; ++r) y[r * w.out + o] = acc[r];
  }
}

// ---- ways B and C: AMX bf16 tiles ----
constexpr int kUnit = 320;  // bytes per (group of 16 outputs, block): 256 of nibbles, 16 d and 16 m as f16
constexpr int kAheadUnits = 16;  // units prefetched ahead of the one being multiplied
constexpr int kChunk = 6;  // blocks a phase of product_amx takes (even; divides 18 and 48)

struct Amx {  // one matrix repacked for the tiles
  int out, in;
  uint8_t* units;  // (out / 16, in / 32, kUnit)
};

// The load-time repack (its cost is not timed). B_b's pair row kk (kk < 16) holds, for each output n < 16 of
// the group, (q[n][2 kk], q[n][2 kk + 1]) as bf16: its word i is q[n = i / 2][k = 2 kk + i % 2]. The unit's
// 64-byte chunk c (c < 4) holds pair rows 4c..4c+3: byte 2i + s (i < 32, s < 2) has row 4c + 2s's word i in its
// low nibble and row 4c + 2s + 1's in its high nibble, so that the 16-bit lane i of the chunk shifted right by
// 0, 4, 8, 12 has that row's q in its low 4 bits, which one vpermw turns into bf16 (build_b).
Amx repack_amx(const Q4& w) {
  const int nb = w.in / 32, groups = w.out / 16;
  Amx a{w.out, w.in, alloc64<uint8_t>(static_cast<size_t>(groups) * nb * kUnit)};
  auto q = [&](int o, int b, int k) {  // the nibble of W[o, 32 b + k]
    const uint8_t byte = w.qs[static_cast<size_t>(o) * (w.in / 2) + 16 * b + (k & 15)];
    return k < 16 ? byte & 15 : byte >> 4;
  };
  for (int g = 0; g < groups; ++g)
    for (int b = 0; b < nb; ++b) {
      uint8_t* u = a.units + (static_cast<size_t>(g) * nb + b) * kUnit;
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 32; ++i)
          for (int s = 0; s < 2; ++s) {
            const int row = 4 * c + 2 * s, n = 16 * g + i / 2;
            u[64 * c + 2 * i + s] = static_cast<uint8_t>(q(n, b, 2 * row + i % 2) | q(n, b, 2 * (row + 1) + i % 2) << 4);
          }
      uint16_t* sc = reinterpret_cast<uint16_t*>(u + 256);
      for (int n = 0; n < 16; ++n) {
        const size_t at = (static_cast<size_t>(16 * g + n) * nb + b) * 2;
        sc[n] = w.sc[at];
        sc[16 + n] = w.sc[at + 1];
      }
    }
  return a;
}

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles: 0, 1 B (two blocks in turn, so that the next block's B need not wait for this one's product);
// 2, 3 A and 4, 5 C, for the two blocks when L M <= 16, else for the two row chunks of one block.
void configure_tiles(int LM) {
  TileConfig cfg{};
  cfg.palette = 1;
  const bool split = LM > 16;
  const int rows0 = std::min(LM, 16), rows1 = split ? LM - 16 : LM;
  const int rows[6] = {16, 16, rows0, rows1, rows0, rows1};
  for (int t = 0; t < 6; ++t) cfg.colsb[t] = 64, cfg.rows[t] = static_cast<uint8_t>(rows[t]);
  // not gcc 12's _tile_loadconfig, whose asm says it reads 8 bytes: the compiler may drop the config's other
  // stores (decoder_ops.cpp's configure_tiles met it as a SIGSEGV at ldtilecfg)
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

// The 32 bf16 of x's limbs a block's product reads, per row: xl (nb, L M, 32) with row l M + r holding limb l
// of x[r], and sx (M, nb) the blocks' sums of x (for the m term).
template <int L, int M>
void split_limbs(const float* x, int in, uint16_t* xl, float* sx) {
  const int nb = in / 32;
  for (int r = 0; r < M; ++r)
    for (int b = 0; b < nb; ++b) {
      __m512 v[2] = {_mm512_loadu_ps(x + r * in + 32 * b), _mm512_loadu_ps(x + r * in + 32 * b + 16)};
      sx[r * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
      for (int l = 0; l < L; ++l) {
        uint16_t* row = xl + (static_cast<size_t>(b) * L * M + l * M + r) * 32;
        for (int h = 0; h < 2; ++h) {
          const __m256i bf = (__m256i)_mm512_cvtneps_pbh(v[h]);  // round to nearest even
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16 * h), bf);
          v[h] = _mm512_sub_ps(v[h], _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf), 16)));  // exact
        }
      }
    }
}

// B_b's 16 pair rows (64 bytes each) into bbuf, from a unit's nibbles: table[e] = bf16(e & 15).
inline void build_b(const uint8_t* unit, uint16_t* bbuf, __m512i table) {
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(unit + 64 * c);
    uint16_t* rows = bbuf + 4 * c * 32;
    _mm512_store_si512(rows, _mm512_permutexvar_epi16(v, table));
    _mm512_store_si512(rows + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table));
    _mm512_store_si512(rows + 64, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), table));
    _mm512_store_si512(rows + 96, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), table));
  }
}

// acc[r] (16 outputs) += d (limb sums of C, lowest first) + m sx[r]: C's rows l M + r in cbuf
template <int L, int M>
inline void combine(const uint8_t* unit, const float* cbuf, const float* sx, int nb, int b, __m512* acc) {
  const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(unit + 256)));
  const __m512 m = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(unit + 288)));
  for (int r = 0; r < M; ++r) {
    __m512 t = _mm512_load_ps(cbuf + ((L - 1) * M + r) * 16);
    for (int l = L - 2; l >= 0; --l) t = _mm512_add_ps(t, _mm512_load_ps(cbuf + (l * M + r) * 16));
    acc[r] = _mm512_fmadd_ps(d, t, acc[r]);
    acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * nb + b]), acc[r]);
  }
}

struct Scratch {
  uint16_t* xl;   // (48, 24, 32) bf16: the largest in / 32 times L M
  float* sx;      // (8, 48)
  uint16_t* bbuf; // (kChunk, 16, 32) bf16
  float* cbuf;    // (kChunk, 32, 16)
  __m512i table;
};

// C = A . B on tiles TC, TA, TB from B_ROWS and A_ROWS (64 bytes a row), C's rows to C_OUT (tile numbers must be
// literals: the intrinsics paste them into their assembly). gcc 12's tileloadd does not tell the compiler that it
// reads memory, so a barrier first keeps the stores of B and A's rows before it.
#define AMX_PRODUCT(TB, TA, TC, B_ROWS, A_ROWS, C_OUT) \
  __asm__ volatile("" ::: "memory");                    \
  _tile_loadd(TB, B_ROWS, 64);                          \
  _tile_loadd(TA, A_ROWS, 64);                          \
  _tile_zero(TC);                                       \
  _tile_dpbf16ps(TC, TA, TB);                           \
  _tile_stored(TC, C_OUT, 64);

// y (M, out) = x (M, in) W^T with L limbs of x (L M rows of A; tiles configured by configure_tiles(L M)).
// A chunk of kChunk blocks at a time goes through three phases: its B tiles built, its products, its C combined,
// so that a tile load does not wait on stores just made, nor C's vector loads on the tile store just made (the
// likely reason why the three per block, in this program's first version, were slower).
template <int L, int M>
void product_amx(const Amx& w, const float* x, float* y, Scratch& s) {
  constexpr int LM = L * M;
  const int nb = w.in / 32, groups = w.out / 16;
  split_limbs<L, M>(x, w.in, s.xl, s.sx);
  for (int g = 0; g < groups; ++g) {
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t* units = w.units + static_cast<size_t>(g) * nb * kUnit;
    for (int b0 = 0; b0 < nb; b0 += kChunk) {  // kChunk divides nb at every shape here
      for (int i = 0; i < kChunk; ++i) {
        const uint8_t* unit = units + (b0 + i) * kUnit;
        for (int k = 0; k < kUnit; k += 64) __builtin_prefetch(unit + kAheadUnits * kUnit + k, 0, 3);
        build_b(unit, s.bbuf + i * 512, s.table);
      }
      for (int i = 0; i < kChunk; i += 2) {  // two blocks on separate tiles when L M <= 16
        const uint16_t* a0 = s.xl + static_cast<size_t>(b0 + i) * LM * 32;
        const uint16_t* a1 = a0 + LM * 32;
        const uint16_t *bb0 = s.bbuf + i * 512, *bb1 = bb0 + 512;
        float *c0 = s.cbuf + i * 512, *c1 = c0 + 512;
        if constexpr (LM > 16) {
          AMX_PRODUCT(0, 2, 4, bb0, a0, c0)
          _tile_loadd(3, a0 + 16 * 32, 64);
          _tile_zero(5);
          _tile_dpbf16ps(5, 3, 0);
          _tile_stored(5, c0 + 16 * 16, 64);
          AMX_PRODUCT(0, 2, 4, bb1, a1, c1)
          _tile_loadd(3, a1 + 16 * 32, 64);
          _tile_zero(5);
          _tile_dpbf16ps(5, 3, 0);
          _tile_stored(5, c1 + 16 * 16, 64);
        } else {
          AMX_PRODUCT(0, 2, 4, bb0, a0, c0)
          AMX_PRODUCT(1, 3, 5, bb1, a1, c1)
        }
      }
      for (int i = 0; i < kChunk; ++i) combine<L, M>(units + (b0 + i) * kUnit, s.cbuf + i * 512, s.sx, nb, b0 + i, acc);
    }
    for (int r = 0; r < M; ++r) _mm512_storeu_ps(y + r * w.out + 16 * g, acc[r]);
  }
}

using AmxFn = void (*)(const Amx&, const float*, float*, Scratch&);

template <int L>
AmxFn amx_fn(int M) {
  switch (M) {
    case 1: return product_amx<L, 1>;
    case 2: return product_amx<L, 2>;
    case 3: return product_amx<L, 3>;
    case 4: return product_amx<L, 4>;
    case 5: return product_amx<L, 5>;
    case 6: return product_amx<L, 6>;
    case 7: return product_amx<L, 7>;
    default: return product_amx<L, 8>;
  }
}

// ---- the weight-read floor: every byte of a step's Q4_1 arrays through 64-byte loads ----
__attribute__((noinline)) uint64_t read_all(const uint8_t* p, size_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 256 <= n; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
  }
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
  uint64_t t = 0;
  for (uint64_t v : lanes) t ^= v;
  for (; i < n; ++i) t ^= p[i];
  return t;
}

// ---- the model's step ----
constexpr int kLayers = 30, kMats = 4;
constexpr int kShape[kMats][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};  // (out, in)
constexpr int kMaxRows = 8;
constexpr int kWarm = 3;  // untimed steps before each timed one-copy batch

struct Copy {
  std::vector<Q4> q4;    // kLayers * kMats, layer-major
  std::vector<Amx> amx;
};

uint16_t to_half(float v) { return _cvtss_sh(v, 0); }

std::vector<Q4> random_step(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  std::vector<Q4> step;
  for (int l = 0; l < kLayers; ++l)
    for (int k = 0; k < kMats; ++k) {
      const int out = kShape[k][0], in = kShape[k][1], nb = in / 32;
      Q4 w{out, in, alloc64<uint8_t>(static_cast<size_t>(out) * in / 2), alloc64<uint16_t>(static_cast<size_t>(out) * nb * 2)};
      for (size_t i = 0; i < static_cast<size_t>(out) * in / 2; i += 8) {
        const uint64_t v = rng();
        std::memcpy(w.qs + i, &v, 8);
      }
      for (size_t i = 0; i < static_cast<size_t>(out) * nb; ++i) {  // d ~ 0.01-0.03, m near -8 d (a block's min)
        const float d = 0.01f + 0.02f * unit(rng);
        w.sc[2 * i] = to_half(d);
        w.sc[2 * i + 1] = to_half(-d * (7.f + unit(rng)));
      }
      step.push_back(w);
    }
  return step;
}

Q4 clone(const Q4& w) {
  const size_t nq = static_cast<size_t>(w.out) * w.in / 2, ns = static_cast<size_t>(w.out) * (w.in / 32) * 2;
  Q4 c{w.out, w.in, alloc64<uint8_t>(nq), alloc64<uint16_t>(ns)};
  std::memcpy(c.qs, w.qs, nq);
  std::memcpy(c.sc, w.sc, 2 * ns);
  return c;
}

Amx clone(const Amx& w) {
  const size_t n = static_cast<size_t>(w.out / 16) * (w.in / 32) * kUnit;
  Amx c{w.out, w.in, alloc64<uint8_t>(n)};
  std::memcpy(c.units, w.units, n);
  return c;
}

// x (kMaxRows, in): normal(0, 1) with four outliers of magnitude 20-60 a row (LLM hidden states' few large channels)
std::vector<float> random_x(int in, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  std::vector<float> x(static_cast<size_t>(kMaxRows) * in);
  for (float& v : x) v = normal(rng);
  for (int r = 0; r < kMaxRows; ++r)
    for (int k = 0; k < 4; ++k)
      x[r * in + static_cast<int>(unit(rng) * in) % in] = (unit(rng) < 0.5f ? -1.f : 1.f) * (20.f + 40.f * unit(rng));
  return x;
}

struct QuantX {  // x (kMaxRows, in) as int8 activations: q (kMaxRows, in), dx and sx (kMaxRows, in / 32)
  std::vector<int> q;
  std::vector<float> dx, sx;
};

QuantX quantize_x(const float* x, int in) {
  const int nb = in / 32;
  QuantX out{std::vector<int>(static_cast<size_t>(kMaxRows) * in), std::vector<float>(kMaxRows * nb),
             std::vector<float>(kMaxRows * nb)};
  for (int r = 0; r < kMaxRows; ++r)
    for (int b = 0; b < nb; ++b) {
      const float* v = x + r * in + 32 * b;
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float dx = amax >= 127.f * 1.17549435e-38f ? amax / 127.f : 0.f, id = dx > 0.f ? 1.f / dx : 0.f;
      int sum = 0;
      for (int j = 0; j < 32; ++j) sum += out.q[r * in + 32 * b + j] = static_cast<int>(std::nearbyint(v[j] * id));
      out.dx[r * nb + b] = dx;
      out.sx[r * nb + b] = dx * static_cast<float>(sum);
    }
  return out;
}

enum Way { kA = 0, kB = 1, kC = 2, kWays = 3 };
const char* kWayName[kWays] = {"A float32 AVX-512", "B AMX bf16 hi+lo", "C AMX bf16 3 limbs"};

struct Runner {
  const float* x576;
  const float* x1536;
  Scratch scratch;
  std::vector<float*> y;  // per matrix (kMaxRows, out)

  // one step's 120 products of `copy` by `way` at M rows
  void step(const Copy& copy, Way way, int M) {
    const AmxFn fb = amx_fn<2>(M), fc = amx_fn<3>(M);
    if (way != kA) configure_tiles((way == kB ? 2 : 3) * M);
    for (size_t i = 0; i < copy.q4.size(); ++i) {
      const float* x = copy.q4[i].in == 576 ? x576 : x1536;
      if (way == kA) product_a(copy.q4[i], x, M, y[i]);
      else (way == kB ? fb : fc)(copy.amx[i], x, y[i], scratch);
    }
    if (way != kA) _tile_release();
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
}  // namespace

int main(int argc, char** argv) {
  int copies = 10, rounds = 7;
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--copies")) copies = std::max(1, std::atoi(argv[i + 1]));
    if (!std::strcmp(argv[i], "--rounds")) rounds = std::max(1, std::atoi(argv[i + 1]));
  }
  // Linux hands out the tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::perror("arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)");
    return 1;
  }
  const int Ms[3] = {1, 4, 8};

  std::vector<Copy> sets(copies);
  sets[0].q4 = random_step(1);
  for (const Q4& w : sets[0].q4) sets[0].amx.push_back(repack_amx(w));
  for (int c = 1; c < copies; ++c)
    for (size_t i = 0; i < sets[0].q4.size(); ++i) {
      sets[c].q4.push_back(clone(sets[0].q4[i]));
      sets[c].amx.push_back(clone(sets[0].amx[i]));
    }
  size_t step_bytes = 0;
  for (const Q4& w : sets[0].q4) step_bytes += static_cast<size_t>(w.out) * w.in / 2 + static_cast<size_t>(w.out) * (w.in / 32) * 4;

  const std::vector<float> x576 = random_x(576, 2), x1536 = random_x(1536, 3);
  Runner run{x576.data(), x1536.data(), {}, {}};
  run.scratch.xl = alloc64<uint16_t>(48 * 24 * 32);
  run.scratch.sx = alloc64<float>(8 * 48);
  run.scratch.bbuf = alloc64<uint16_t>(kChunk * 16 * 32);
  run.scratch.cbuf = alloc64<float>(kChunk * 32 * 16);
  alignas(64) uint16_t table[32];
  for (int e = 0; e < 32; ++e) {
    const float v = static_cast<float>(e & 15);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    table[e] = static_cast<uint16_t>(bits >> 16);  // exact: e & 15 has at most 4 significant bits
  }
  run.scratch.table = _mm512_load_si512(table);
  for (const Q4& w : sets[0].q4) run.y.push_back(alloc64<float>(static_cast<size_t>(kMaxRows) * w.out));

  // float64 reference of copy 0 at all kMaxRows rows, sum_j |W_j x_j| per output, and for scale (not timed) the
  // product with int8 activations as decoder_ops.cpp's header defines them (llama.cpp's: per row and block of 32,
  // dx = max |x| / 127, qx = nearbyint(x / dx), sx = dx sum qx in float32; y = sum_b d dx sum_j q qx + m sx), its
  // sums in float64 so that only the quantization of x shows
  const QuantX qx576 = quantize_x(x576.data(), 576), qx1536 = quantize_x(x1536.data(), 1536);
  std::vector<std::vector<double>> y64, den, y_int8;
  std::vector<double> wrow;
  std::vector<int> qrow;
  for (const Q4& w : sets[0].q4) {
    const float* x = w.in == 576 ? x576.data() : x1536.data();
    const QuantX& qx = w.in == 576 ? qx576 : qx1536;
    const int nb = w.in / 32;
    std::vector<double> ref(static_cast<size_t>(kMaxRows) * w.out), abs_sum(ref.size()), i8(ref.size());
    std::vector<double> d(nb), m(nb);
    wrow.resize(w.in);
    qrow.resize(w.in);
    for (int o = 0; o < w.out; ++o) {
      for (int b = 0; b < nb; ++b) {
        d[b] = _cvtsh_ss(w.sc[(static_cast<size_t>(o) * nb + b) * 2]);
        m[b] = _cvtsh_ss(w.sc[(static_cast<size_t>(o) * nb + b) * 2 + 1]);
        for (int j = 0; j < 32; ++j) {
          const uint8_t byte = w.qs[static_cast<size_t>(o) * (w.in / 2) + 16 * b + (j & 15)];
          qrow[32 * b + j] = j < 16 ? byte & 15 : byte >> 4;
          wrow[32 * b + j] = d[b] * qrow[32 * b + j] + m[b];
        }
      }
      for (int r = 0; r < kMaxRows; ++r) {
        double s = 0, a = 0, s8 = 0;
        for (int i = 0; i < w.in; ++i) {
          const double p = wrow[i] * x[r * w.in + i];
          s += p;
          a += std::fabs(p);
        }
        for (int b = 0; b < nb; ++b) {
          int64_t isum = 0;
          for (int j = 0; j < 32; ++j) isum += qrow[32 * b + j] * qx.q[r * w.in + 32 * b + j];
          s8 += d[b] * qx.dx[r * nb + b] * static_cast<double>(isum) + m[b] * qx.sx[r * nb + b];
        }
        ref[r * w.out + o] = s;
        abs_sum[r * w.out + o] = a;
        i8[r * w.out + o] = s8;
      }
    }
    y64.push_back(std::move(ref));
    den.push_back(std::move(abs_sum));
    y_int8.push_back(std::move(i8));
  }
  // max over the outputs of M rows of |y - y64| / sum_j |W_j x_j|
  auto worst_error = [&](int M, auto value) {
    double worst = 0;
    for (size_t i = 0; i < sets[0].q4.size(); ++i)
      for (int r = 0; r < M; ++r)
        for (int o = 0; o < sets[0].q4[i].out; ++o) {
          const size_t at = static_cast<size_t>(r) * sets[0].q4[i].out + o;
          worst = std::max(worst, std::fabs(value(i, at) - y64[i][at]) / den[i][at]);
        }
    return worst;
  };

  std::printf("accuracy: max over a step's outputs of |y - y64| / sum_j |W_j x_j| (y64: float64, dequantized W)\n");
  std::printf("%-22s", "way");
  for (int M : Ms) std::printf("  M=%d               ", M);
  std::printf("row 0 as alone\n");
  for (int way = 0; way < kWays; ++way) {
    std::printf("%-22s", kWayName[way]);
    std::vector<std::vector<float>> alone;  // row 0's outputs at M = 1, per matrix
    bool same = true;                       // row 0's outputs bit for bit the same at every M
    for (int M : Ms) {
      run.step(sets[0], static_cast<Way>(way), M);
      for (size_t i = 0; i < sets[0].q4.size(); ++i) {
        const int out = sets[0].q4[i].out;
        if (M == 1) alone.emplace_back(run.y[i], run.y[i] + out);
        else same = same && !std::memcmp(alone[i].data(), run.y[i], 4 * out);
      }
      const double worst = worst_error(M, [&](size_t i, size_t at) { return static_cast<double>(run.y[i][at]); });
      std::printf("  %.2e (2^%.1f)", worst, std::log2(worst));
    }
    std::printf("  %s\n", same ? "bit for bit" : "differs");
  }
  std::printf("%-22s", "int8 x, for scale");
  for (int M : Ms) {
    const double worst = worst_error(M, [&](size_t i, size_t at) { return y_int8[i][at]; });
    std::printf("  %.2e (2^%.1f)", worst, std::log2(worst));
  }
  std::printf("  (not timed)\n");

  // times[set][M][way] over rounds; set 1: each copy once; set 0: one copy `copies` times after kWarm untimed
  // steps, the read on copy 2, A and B on copy 0 (each its own layout), C on copy 1: no timed steps read the data
  // that the steps just before them read (the second of two ways on the same bytes found more of them in the L3)
  std::vector<double> t[2][3][kWays], t_read[2];
  volatile uint64_t sink = 0;
  auto read_step = [&](const Copy& copy) {
    for (const Q4& w : copy.q4) {
      sink = sink + read_all(w.qs, static_cast<size_t>(w.out) * w.in / 2);
      sink = sink + read_all(reinterpret_cast<const uint8_t*>(w.sc), static_cast<size_t>(w.out) * (w.in / 32) * 4);
    }
  };
  for (int round = 0; round < rounds; ++round)
    for (int set = 0; set < 2; ++set) {
      const Copy& read_copy = sets[std::min(2, copies - 1)];
      if (set == 0)
        for (int k = 0; k < kWarm; ++k) read_step(read_copy);
      double t0 = cpu_now();
      for (int c = 0; c < copies; ++c) read_step(set ? sets[c] : read_copy);
      t_read[set].push_back((cpu_now() - t0) / copies);
      for (int mi = 0; mi < 3; ++mi)
        for (int way = 0; way < kWays; ++way) {
          const Copy& own = sets[way == kC ? std::min(1, copies - 1) : 0];
          if (set == 0)
            for (int k = 0; k < kWarm; ++k) run.step(own, static_cast<Way>(way), Ms[mi]);
          t0 = cpu_now();
          for (int c = 0; c < copies; ++c) run.step(set ? sets[c] : own, static_cast<Way>(way), Ms[mi]);
          t[set][mi][way].push_back((cpu_now() - t0) / copies);
        }
    }

  const char* set_name[2] = {"one copy of the weights stepped over repeatedly", "distinct copies in turn"};
  for (int set = 0; set < 2; ++set) {
    std::printf("\nstep's products (120 matrices, %.1f MB of Q4_1), %s (%d x %.1f MB); CPU ms, median of %d rounds\n",
                step_bytes / 1e6, set_name[set], set ? copies : 1, step_bytes / 1e6, rounds);
    std::printf("read the Q4_1 bytes alone: %.2f ms (%.1f GB/s)\n", 1e3 * median(t_read[set]),
                step_bytes / median(t_read[set]) / 1e9);
    std::printf("%-22s %4s %9s %13s %10s %14s %16s\n", "way", "M", "ms", "rounds' range", "vs A", "M rows / 1 row",
                "M rows / (M x 1)");
    for (int way = 0; way < kWays; ++way)
      for (int mi = 0; mi < 3; ++mi) {
        const std::vector<double>& v = t[set][mi][way];
        const double ms = 1e3 * median(v), one = 1e3 * median(t[set][0][way]);
        const double a = 1e3 * median(t[set][mi][kA]);
        std::printf("%-22s %4d %9.2f %6.2f-%-6.2f %9.2fx %13.2fx %15.2fx\n", kWayName[way], Ms[mi], ms,
                    1e3 * *std::min_element(v.begin(), v.end()), 1e3 * *std::max_element(v.begin(), v.end()), a / ms,
                    ms / one, ms / (Ms[mi] * one));
      }
  }
  return 0;
}
