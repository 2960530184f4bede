// The decoder's CPU ops beside the attention kernels: products with block-quantized weights as GGUF
// stores them (blocks of 32 along the input), RMSNorm, RoPE, and the write of a step's keys and values
// into the paged KV pool. Everything is float32 but the weights and the pool. Each replaces several
// small torch ops of a decode step with one call.
//
//   block_matmul(x (M, in), qs, scales, bits, bias?, residual?, isa, activations) -> y (M, out) = x W^T (+ bias)
//     (+ residual)
//     bits 4 (Q4_1): qs uint8 (out, in / 2), scales f16 (out, in / 32, 2) = (d, m) per block b, and
//       W[o, 32 b + j] = d q + m, q = low nibble of qs[o, 16 b + j] (j < 16) or the high nibble of
//       qs[o, 16 b + j - 16] (j >= 16). GGUF's Q4_0 (w = d (q - 8)) is the same with m = -8 d.
//     bits 8 (Q8_0): qs int8 (out, in), scales f16 (out, in / 32), W[o, i] = d[o, i / 32] qs[o, i].
//   Each weight is widened exactly (d q is exact in float32, + m is the one rounding of a fused
//   multiply-add) and x stays float32, so y is the dequantized float32 model's product up to the order
//   of its sums. One task per range of output rows (at::parallel_for); each weight block is widened once
//   for up to rows_per_pass rows of x (kRows; kWideRows for the float32 loops of AVX2 and AVX-512 where x's rows
//   fit L1), which is what makes a batch cheaper than its rows one by one.
//   With ``activations`` kInt8 (llama.cpp's Q8_0 / Q8_1 activations), x is quantized first, per row and
//   block of 32 (quantize_activations):
//     dx = max_j |x_j| / 127, qx_j = nearbyint(x_j * (1 / dx)) in -127..127 (round half to even; 0 where
//     dx = 0), sx = dx * sum_j qx_j, all float32 ops as written (torch's float32 ops compute the same),
//   and each block's integer dot is exact (u8 x s8 pairs summed in int16 without saturation, then int32):
//     Q4_1: y[o] = sum_b (d_b dx_b) sum_j q_bj qx_bj + m_b sx_b,   Q8_0: y[o] = sum_b (d_b dx_b) sum_j q_bj qx_bj
//   so the loops of every level differ only in the float rounding of that sum over blocks. AVX2 does it with
//   maddubs (u8 nibbles x s8 activations; Q8_0 as |w| x sign(qx, w)), AVX-512 without VNNI too; AVX-512 VNNI
//   with dpbusd, in the AVX2 loop's float order, so its results equal AVX2's bit for bit.
//
//   With ``activations`` kBf16x2 (on CPUs with AMX-BF16: amx_available()), each x is split into two bf16 limbs,
//   hi = bf16(x) (round to nearest even) and lo = bf16(x - hi), so |x - hi - lo| <= 2^-17 |x|, and each block's
//   product runs on AMX tiles (products of bf16 exact: q in 0..15 or -127..127 is exact in bf16; sums in float32):
//     Q4_1: y[o] = sum_b d_b (sum_j q_bj hi_bj + sum_j q_bj lo_bj) + m_b sx_b,   sx_b = sum_j x_bj in float32
//     Q8_0: y[o] = sum_b d_b (sum_j q_bj hi_bj + sum_j q_bj lo_bj)
//   so |y - y_exact| <= about 2^-17 sum_j |W_oj x_j| plus float32's rounding of the sums. qs is then
//   pack_units's units (scales are not read), out must be a multiple of 16, and a row's outputs are the same bit
//   for bit alone or in any batch.
//
//   With ``activations`` kInt16 (every CPU), x is quantized per row r and block b of 32 (quantize_block16):
//     a = max_j |x_j|; where a < 32767 FLT_MIN (s would not be a normal float) q = 0, s = 0; else
//     s = a / 32767, q_j = nearbyint(x_j * (32767 / a)) (round half to even; |q_j| <= 32767), and
//     sq = s * float(sum_j q_j) (the integer sum is exact in float32), all float32 ops as written,
//   then per output o each block's dot with the weight's integers is exact in int32 (|isum| <= 32 * 32767 * 127):
//     isum_b = sum_j qw_bj q_bj   (qw: Q4_1's nibbles 0..15, Q8_0's int8)
//     acc = 0; for b in order: acc = fma(float(isum_b), d_b * s_b, acc); then, Q4_1 only, acc = fma(m_b, sq_b, acc)
//     y[o] = acc (+ bias) (+ residual)
//   with d, m the unit's float16 scales widened. The block dots being exact integers, every level (plain C++,
//   AVX2's madd, AVX-512 VNNI's dpwssd) computes exactly these float operations: the bits do not depend on the SIMD
//   level, the pass width, the batch or the threads. Each x is kept to half a step, 2^-16 a per element
//   (|y - y_float32| <= about sum_b (s_b / 2) sum_j |W_oj|); qs is pack_units's units, out a multiple of 16
//   (as bf16x2).
//   pack_units(qs, scales) -> units of the weight's format (qs's dtype says which), viewed (out, ...) so that their
//   first dim counts outputs as qs's does, with the same bytes per weight as qs and scales. Unit (g, b) holds
//   outputs 16 g..16 g + 15 and block b, laid out as one tdpbf16ps reads B: pair row k (k < 16) holds, for each
//   of the 16 outputs n, (q[n][2 k], q[n][2 k + 1]) as bf16 (q[n][k]: the q of W[16 g + n, 32 b + k]); the same
//   pairs as int16 are what dpwssd takes (int16 activations), so both modes read the one layout.
//   Q4_1, qs uint8 -> units uint8 (out, in / 32 * 20): (out / 16, in / 32) units of 320, the unit's 64-byte chunk
//     c (c < 4) holding pair rows 4c..4c+3, its byte 2i + s (i < 32, s < 2) = q[i / 2][2 r + i % 2] |
//     q[i / 2][2 (r + 1) + i % 2] << 4 with r = 4c + 2s (q: nibbles); bytes 256..287 the 16 outputs' d,
//     288..319 their m (float16, as stored).
//   Q8_0, qs int8 -> units int8 (out, in / 32 * 34): (out / 16, in / 32) units of 544, byte 32 k + 2 n + s =
//     q[n][2 k + s] (k < 16, n < 16, s < 2: B's pair rows as int8), then bytes 512..543 the 16 outputs' d
//     (float16, as stored).
//   quantize_activations(x (M, in), isa) -> qx (M, in) int8, xs (M, in / 32, 2) = (dx, sx): the int8 path's x.
//   rms_norm(x (M, D), w (D,), eps) -> x / sqrt(mean(x^2) + eps) * w, rows in parallel only when large.
//   rope_(x (N, heads, d) strided, cos, sin (N, d)): in place, x <- x cos + rotate_half(x) sin with
//     rotate_half(x) = (-x[d/2:], x[:d/2]) (transformers' convention).
//   store_rows(pool (R, d), rows (B, H_kv, T), src (B, H_kv, T, d) strided): pool[rows[b, g, t]] <- src[b, g, t]
//     in the pool's dtype (round to nearest even for bfloat16 / float16, as torch's casts; float16 saturates at
//     ±65504 where the cast gives ±inf).
//   store_kv(k_pool, v_pool, rows, k, v): store_rows of a step's keys and of its values, in one parallel loop.
//
// The two halves of a decode layer around its attention, one call each (the decoder's fused path; the
// same ops in the same order as calling them one by one, so its results equal that path's):
//   attn_in(x (M, D), w_attn, eps, qkv blocks, cos, sin (M, d), rot_heads, d)
//     -> qkv (M, out) = rms_norm(x) W_qkv^T (+ b), its first rot_heads heads of d values rotated by RoPE
//   mlp_out(x (M, D), a (M, H d), o blocks, w_mlp, eps, gate_up blocks, down blocks)
//     -> x1 + swiglu(rms_norm(x1) W_gu^T) W_down^T, x1 = x + a W_o^T, swiglu([g, u]) = g / (1 + e^-g) * u
//   swiglu(gu (M, 2F)) -> (M, F), the same product alone.
//   packed_linear_rows(x (M, in), W packed by oneDNN) -> x W^T, one oneDNN call per thread on its share of the rows.
//   causal_attention_segments_(out, q, k, v, offsets, lengths, scale): each segment's causal SDPA on its own thread.
//   attn_in_to, mlp_out_to: the same into a given output (the whole step's buffers, decode_layers.cpp).
//
// The loops exist for AVX-512 (with VNNI for int8 and int16 activations), AVX2 (both with FMA and F16C) and plain
// C++, chosen per call by ``isa``: 0 plain, 1 AVX2, 2 AVX-512 F/BW/VL/DQ, 3 the same with AVX-512 VNNI; best_isa()
// unless a caller asks for a lower one, as the tests do to cover every path on one machine. The bf16x2 products
// use AMX whatever ``isa`` (amx_available() implies AVX-512); their functions carry their own target attributes,
// so the library builds without -mamx flags and runs where AMX is missing (bf16x2 is then refused).
// Every product of attn_in, mlp_out (and decode_layers) takes the one ``activations`` setting its call gets.

#include <torch/extension.h>

#include "library_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RETOPK_X86 1
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define TARGET_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))
#endif
#if defined(RETOPK_X86) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define RETOPK_AMX 1
#endif

namespace {

enum Activations : int64_t { kFloat32 = 0, kInt8 = 1, kBf16x2 = 2, kInt16 = 3 };
// Rows of x per pass over a weight row: kRows, or kWideRows for the float32 loops, whose accumulators for that
// many rows fit AVX-512's 32 registers, and AVX2's 16 in passes over half blocks (rows_per_pass). Each row's sums
// run in the same order whatever the batch (its own accumulators, blocks in file order), so a request's tokens do
// not depend on what it is batched with, nor on the pass width.
constexpr int64_t kRows = 4;
constexpr int64_t kWideRows = 8;
constexpr int64_t kAhead = 16;  // weight rows prefetched ahead of the one being multiplied
constexpr int64_t kTile = 16;   // weight rows whose products with one pass's rows of x run together (block_matmul_to)
constexpr int64_t kPassBytes = 24 << 10;  // float32 x a pass may read per weight row: most of a 32 KiB L1
constexpr int64_t kUnit4 = 320;  // bytes of a Q4_1 unit (pack_units): 256 of nibbles, then 16 d and 16 m as float16
constexpr int64_t kUnit8 = 544;  // bytes of a Q8_0 unit (pack_units): 512 of int8 q, then 16 d as float16

// acc[r] = W[o] · x[r] for r < MR, with W[o] given by its blocks (nb blocks of 32).
using DotFn = void (*)(const uint8_t* qs, const uint16_t* sc, int64_t nb, const float* x, int64_t ldx, float* acc);
// The same from x quantized: qx rows of ldx int8 values, xs rows of lds floats holding (dx, sx) per block.
using QDotFn = void (*)(const uint8_t* qs, const uint16_t* sc, int64_t nb, const int8_t* qx, const float* xs,
                        int64_t ldx, int64_t lds, float* acc);
// Below this max |x| a block's dx = max |x| / 127 would not be a normal float (and 1 / dx not finite): such a
// block quantizes to zeros with dx = 0.
constexpr float kMinAmax = 127.f * 1.17549435e-38f;  // 127 FLT_MIN

float half_to_float(uint16_t h) {
  c10::Half v;
  v.x = h;
  return static_cast<float>(v);
}

template <int MR>
void q4_dot_scalar(const uint8_t* qs, const uint16_t* sc, int64_t nb, const float* x, int64_t ldx, float* acc) {
  float a[MR] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const float d = half_to_float(sc[2 * b]), m = half_to_float(sc[2 * b + 1]);
    for (int j = 0; j < 16; ++j) {
      const uint8_t byte = qs[16 * b + j];
      const float lo = std::fma(d, static_cast<float>(byte & 15), m), hi = std::fma(d, static_cast<float>(byte >> 4), m);
      for (int r = 0; r < MR; ++r) a[r] += lo * x[r * ldx + 32 * b + j] + hi * x[r * ldx + 32 * b + 16 + j];
    }
  }
  for (int r = 0; r < MR; ++r) acc[r] = a[r];
}

template <int MR>
void q8_dot_scalar(const uint8_t* qs, const uint16_t* sc, int64_t nb, const float* x, int64_t ldx, float* acc) {
  const int8_t* q = reinterpret_cast<const int8_t*>(qs);
  float a[MR] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const float d = half_to_float(sc[b]);
    for (int j = 0; j < 32; ++j) {
      const float w = d * static_cast<float>(q[32 * b + j]);
      for (int r = 0; r < MR; ++r) a[r] += w * x[r * ldx + 32 * b + j];
    }
  }
  for (int r = 0; r < MR; ++r) acc[r] = a[r];
}

// One block of 32 values of x -> q (32 int8), ds = (dx, sx): the header's rounding, plain C++ (the reference).
void quantize_block_scalar(const float* x, int8_t* q, float* ds) {
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float dx = amax >= kMinAmax ? amax / 127.f : 0.f, id = dx > 0.f ? 1.f / dx : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < 32; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(x[j] * id));
    sum += q[j];
  }
  ds[0] = dx;
  ds[1] = dx * static_cast<float>(sum);
}

template <int MR>
void q4_q8_dot_scalar(const uint8_t* qs, const uint16_t* sc, int64_t nb, const int8_t* qx, const float* xs,
                      int64_t ldx, int64_t lds, float* acc) {
  float a[MR] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const float d = half_to_float(sc[2 * b]), m = half_to_float(sc[2 * b + 1]);
    for (int r = 0; r < MR; ++r) {
      const int8_t* y = qx + r * ldx + 32 * b;
      int32_t isum = 0;
      for (int j = 0; j < 16; ++j) isum += (qs[16 * b + j] & 15) * y[j] + (qs[16 * b + j] >> 4) * y[16 + j];
      const float* ds = xs + r * lds + 2 * b;
      a[r] += d * ds[0] * static_cast<float>(isum) + m * ds[1];
    }
  }
  for (int r = 0; r < MR; ++r) acc[r] = a[r];
}

template <int MR>
void q8_q8_dot_scalar(const uint8_t* qs, const uint16_t* sc, int64_t nb, const int8_t* qx, const float* xs,
                      int64_t ldx, int64_t lds, float* acc) {
  const int8_t* q = reinterpret_cast<const int8_t*>(qs);
  float a[MR] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const float d = half_to_float(sc[b]);
    for (int r = 0; r < MR; ++r) {
      const int8_t* y = qx + r * ldx + 32 * b;
      int32_t isum = 0;
      for (int j = 0; j < 32; ++j) isum += q[32 * b + j] * y[j];
      a[r] += d * xs[r * lds + 2 * b] * static_cast<float>(isum);
    }
  }
  for (int r = 0; r < MR; ++r) acc[r] = a[r];
}

// Room for n values of T that the caller fills entirely (split_limbs, quantize_rows16): kept on this thread and
// reused while n is at most kKeptScratch (a decode step's products: no allocation and no zero fill each), else a new
// array held by `own`.
constexpr int64_t kKeptScratch = 1 << 18;
template <typename T>
T* limb_scratch(int64_t n, std::unique_ptr<T[]>& own) {
  thread_local std::unique_ptr<T[]> kept;
  thread_local int64_t size = 0;
  if (n > kKeptScratch) {
    own.reset(new T[n]);
    return own.get();
  }
  if (n > size) {
    kept.reset(new T[n]);
    size = n;
  }
  return kept.get();
}

#ifdef RETOPK_X86
constexpr int64_t kScaleChunk = 64;  // blocks whose float16 scales are widened together, into L1

TARGET_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[0..n) = float(h[0..n)): widening the scales eight at a time, so that each block's loop reads them
// with broadcast loads instead of converting two halves one by one.
TARGET_AVX2 inline void widen_halves(const uint16_t* h, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < n; ++i) out[i] = _cvtsh_ss(h[i]);
}

template <int MR>
TARGET_AVX2 void q4_dot_avx2(const uint8_t* qs, const uint16_t* sc, int64_t nb, const float* x, int64_t ldx,
                             float* acc) {
  __m256 a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi32(15);
  float s[2 * kScaleChunk];
  for (int64_t c0 = 0; c0 < nb; c0 += kScaleChunk) {
    const int64_t nc = std::min(kScaleChunk, nb - c0);
    widen_halves(sc + 2 * c0, 2 * nc, s);
    for (int64_t i = 0; i < nc; ++i) {
      const int64_t b = c0 + i;
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * b));
      const __m256i v0 = _mm256_cvtepu8_epi32(bytes), v1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
      const __m256 d = _mm256_broadcast_ss(s + 2 * i), m = _mm256_broadcast_ss(s + 2 * i + 1);
      const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, low)), d, m);  // elements 0..7
      const __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, low)), d, m);  // 8..15
      const __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), d, m);   // 16..23
      const __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), d, m);   // 24..31
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + r * ldx + 32 * b;
        a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a0[r]);
        a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a1[r]);
        a0[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), a0[r]);
        a1[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a1[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) acc[r] = hsum256(_mm256_add_ps(a0[r], a1[r]));
}

template <int MR>
TARGET_AVX2 void q8_dot_avx2(const uint8_t* qs, const uint16_t* sc, int64_t nb, const float* x, int64_t ldx,
                             float* acc) {
  __m256 a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  float s[kScaleChunk];
  for (int64_t c0 = 0; c0 < nb; c0 += kScaleChunk) {
    const int64_t nc = std::min(kScaleChunk, nb - c0);
    widen_halves(sc + c0, nc, s);
    for (int64_t i = 0; i < nc; ++i) {
      const int64_t b = c0 + i;
      const __m256 d = _mm256_broadcast_ss(s + i);
      __m256 w[4];
      for (int j = 0; j < 4; ++j) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 32 * b + 8 * j));
        w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
      }
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + r * ldx + 32 * b;
        a0[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), a0[r]);
        a1[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), a1[r]);
        a0[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), a0[r]);
        a1[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), a1[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) acc[r] = hsum256(_mm256_add_ps(a0[r], a1[r]));
}

// q4_dot_avx2's and q8_dot_avx2's sums for 5..8 rows, whose two accumulators a row would need more than AVX2's
// 16 registers beside the four widened quarters of a block. There, a0 takes every block's elements 0..7 then
// 16..23, and a1 its elements 8..15 then 24..31: two chains that meet only at the end. So each chunk of blocks
// takes two passes, the first half of every block's bytes (Q4_1: bytes 0..7, whose low and high nibbles are
// elements 0..7 and 16..23; Q8_0: elements 0..7 and 16..23 themselves) into every row's a0, then the second half
// into every row's a1, MR + 5 registers live in each; every accumulator sees the same products in the same order
// as there, and the end sums them as there: the results equal the 1..4-row loops' bit for bit, while each block
// is widened once for all MR rows instead of once per kRows.
template <int MR>
TARGET_AVX2 __attribute__((always_inline)) inline void q4_half_pass_avx2(const uint8_t* qs, const float* s, int64_t c0,
                                                                        int64_t nc, int64_t half, const float* x,
                                                                        int64_t ldx, __m256* acc) {
  __m256 a[MR];
  for (int r = 0; r < MR; ++r) a[r] = acc[r];
  const __m256i low = _mm256_set1_epi32(15);
  for (int64_t i = 0; i < nc; ++i) {
    const int64_t b = c0 + i;
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 16 * b + 8 * half)));
    const __m256 d = _mm256_broadcast_ss(s + 2 * i), m = _mm256_broadcast_ss(s + 2 * i + 1);
    const __m256 wl = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), d, m);  // 8 half .. 8 half + 7
    const __m256 wh = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d, m);   // 16 + the same
    for (int r = 0; r < MR; ++r) {
      const float* xr = x + r * ldx + 32 * b + 8 * half;
      a[r] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xr), a[r]);
      a[r] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xr + 16), a[r]);
    }
  }
  for (int r = 0; r < MR; ++r) acc[r] = a[r];
}

template <int MR>
TARGET_AVX2 void q4_dot_avx2_wide(const uint8_t* qs, const uint16_t* sc, int64_t nb, const float* x, int64_t ldx,
                                  float* acc) {
  __m256 a0[MR], a1[MR];  // q4_dot_avx2's a0 and a1
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  float s[2 * kScaleChunk];
  for (int64_t c0 = 0; c0 < nb; c0 += kScaleChunk) {
    const int64_t nc = std::min(kScaleChunk, nb - c0);
    widen_halves(sc + 2 * c0, 2 * nc, s);
    q4_half_pass_avx2<MR>(qs, s, c0, nc, 0, x, ldx, a0);
    q4_half_pass_avx2<MR>(qs, s, c0, nc, 1, x, ldx, a1);
  }
  for (int r = 0; r < MR; ++r) acc[r] = hsum256(_mm256_add_ps(a0[r], a1[r]));
}

template <int MR>
TARGET_AVX2 __attribute__((always_inline)) inline void q8_half_pass_avx2(const uint8_t* qs, const float* s, int64_t c0,
                                                                        int64_t nc, int64_t half, const float* x,
                                                                        int64_t ldx, __m256* acc) {
  __m256 a[MR];
  for (int r = 0; r < MR; ++r) a[r] = acc[r];
  for (int64_t i = 0; i < nc; ++i) {
    const int64_t b = c0 + i;
    const __m256 d = _mm256_broadcast_ss(s + i);
    const uint8_t* q = qs + 32 * b + 8 * half;
    const __m256 wl = _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)))), d);
    const __m256 wh = _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16)))), d);
    for (int r = 0; r < MR; ++r) {
      const float* xr = x + r * ldx + 32 * b + 8 * half;
      a[r] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xr), a[r]);
      a[r] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xr + 16), a[r]);
    }
  }
  for (int r = 0; r < MR; ++r) acc[r] = a[r];
}

template <int MR>
TARGET_AVX2 void q8_dot_avx2_wide(const uint8_t* qs, const uint16_t* sc, int64_t nb, const float* x, int64_t ldx,
                                  float* acc) {
  __m256 a0[MR], a1[MR];  // q8_dot_avx2's a0 and a1
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  float s[kScaleChunk];
  for (int64_t c0 = 0; c0 < nb; c0 += kScaleChunk) {
    const int64_t nc = std::min(kScaleChunk, nb - c0);
    widen_halves(sc + c0, nc, s);
    q8_half_pass_avx2<MR>(qs, s, c0, nc, 0, x, ldx, a0);
    q8_half_pass_avx2<MR>(qs, s, c0, nc, 1, x, ldx, a1);
  }
  for (int r = 0; r < MR; ++r) acc[r] = hsum256(_mm256_add_ps(a0[r], a1[r]));
}

// A block of 32 floats of x into v[0..3] -> max_j |x_j| (the quantizers' first step).
TARGET_AVX2 inline float load_block_amax(const float* x, __m256* v) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(x + 8 * k);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[k]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
}

// The sum of a block's 32 int32 values i[0..3] (exact for the quantizers' values).
TARGET_AVX2 inline int32_t sum_block_epi32(const __m256i* i) {
  const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// quantize_block_scalar with AVX2: the same float operations (a max, one division, one reciprocal, products
// rounded half to even), so the same bytes and scales.
TARGET_AVX2 void quantize_block_avx2(const float* x, int8_t* q, float* ds) {
  __m256 v[4];
  const float amax = load_block_amax(x, v);
  const float dx = amax >= kMinAmax ? amax / 127.f : 0.f, id = dx > 0.f ? 1.f / dx : 0.f;
  const __m256 vid = _mm256_set1_ps(id);
  __m256i i[4];
  for (int k = 0; k < 4; ++k)
    i[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // packs work per 128-bit lane: the permute puts the four groups of 8 back in order
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  ds[0] = dx;
  ds[1] = dx * static_cast<float>(sum_block_epi32(i));
}

// One Q4_1 block against MR rows of quantized x: the nibbles as 32 unsigned bytes (low nibbles are elements
// 0..15, high 16..31), maddubs against each row's signed bytes (pairs summed in int16: at most 2 * 15 * 127),
// madd with ones to int32, one float FMA per row. The minimum's term is a scalar per row.
template <int MR>
TARGET_AVX2 __attribute__((always_inline)) inline void q4_q8_block_avx2(const uint8_t* qs, float d, float m,
                                                                       const int8_t* qx, const float* xs,
                                                                       int64_t ldx, int64_t lds, __m256* a,
                                                                       float* mins) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(15));
  for (int r = 0; r < MR; ++r) {
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * ldx));
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, y), _mm256_set1_epi16(1));
    a[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xs[r * lds]), _mm256_cvtepi32_ps(p), a[r]);
    mins[r] = std::fma(m, xs[r * lds + 1], mins[r]);  // one rounding, as q4_q8_dot_avx512 repeats it
  }
}

// One Q8_0 block against MR rows: maddubs needs one unsigned operand, so |w| x sign(qx, w) (llama.cpp's
// trick; |-128| reads as the unsigned 128, and pairs stay within int16: 2 * 128 * 127).
template <int MR>
TARGET_AVX2 __attribute__((always_inline)) inline void q8_q8_block_avx2(const uint8_t* qs, float d, const int8_t* qx,
                                                                       const float* xs, int64_t ldx, int64_t lds,
                                                                       __m256* a) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  const __m256i aw = _mm256_sign_epi8(w, w);
  for (int r = 0; r < MR; ++r) {
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * ldx));
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(y, w)), _mm256_set1_epi16(1));
    a[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xs[r * lds]), _mm256_cvtepi32_ps(p), a[r]);
  }
}

// Blocks alternate between two sets of accumulators, to hide the FMA latency of a single row.
template <int MR>
TARGET_AVX2 void q4_q8_dot_avx2(const uint8_t* qs, const uint16_t* sc, int64_t nb, const int8_t* qx, const float* xs,
                                int64_t ldx, int64_t lds, float* acc) {
  __m256 a0[MR], a1[MR];
  float m0[MR] = {}, m1[MR] = {};
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  float s[2 * kScaleChunk];
  for (int64_t c0 = 0; c0 < nb; c0 += kScaleChunk) {
    const int64_t nc = std::min(kScaleChunk, nb - c0);
    widen_halves(sc + 2 * c0, 2 * nc, s);
    int64_t i = 0;
    for (; i + 2 <= nc; i += 2) {
      const int64_t b = c0 + i;
      q4_q8_block_avx2<MR>(qs + 16 * b, s[2 * i], s[2 * i + 1], qx + 32 * b, xs + 2 * b, ldx, lds, a0, m0);
      q4_q8_block_avx2<MR>(qs + 16 * b + 16, s[2 * i + 2], s[2 * i + 3], qx + 32 * b + 32, xs + 2 * b + 2, ldx, lds,
                           a1, m1);
    }
    if (i < nc)
      q4_q8_block_avx2<MR>(qs + 16 * (c0 + i), s[2 * i], s[2 * i + 1], qx + 32 * (c0 + i), xs + 2 * (c0 + i), ldx,
                           lds, a0, m0);
  }
  for (int r = 0; r < MR; ++r) acc[r] = hsum256(_mm256_add_ps(a0[r], a1[r])) + (m0[r] + m1[r]);
}

template <int MR>
TARGET_AVX2 void q8_q8_dot_avx2(const uint8_t* qs, const uint16_t* sc, int64_t nb, const int8_t* qx, const float* xs,
                                int64_t ldx, int64_t lds, float* acc) {
  __m256 a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  float s[kScaleChunk];
  for (int64_t c0 = 0; c0 < nb; c0 += kScaleChunk) {
    const int64_t nc = std::min(kScaleChunk, nb - c0);
    widen_halves(sc + c0, nc, s);
    int64_t i = 0;
    for (; i + 2 <= nc; i += 2) {
      const int64_t b = c0 + i;
      q8_q8_block_avx2<MR>(qs + 32 * b, s[i], qx + 32 * b, xs + 2 * b, ldx, lds, a0);
      q8_q8_block_avx2<MR>(qs + 32 * b + 32, s[i + 1], qx + 32 * b + 32, xs + 2 * b + 2, ldx, lds, a1);
    }
    if (i < nc) q8_q8_block_avx2<MR>(qs + 32 * (c0 + i), s[i], qx + 32 * (c0 + i), xs + 2 * (c0 + i), ldx, lds, a0);
  }
  for (int r = 0; r < MR; ++r) acc[r] = hsum256(_mm256_add_ps(a0[r], a1[r]));
}

// A block's 16 values d j + m (j = 0..15) fill one register; each nibble picks its weight from it with a
// permute, which reads the low 4 bits of each lane: fewer instructions than widening every nibble. Two
// blocks go per iteration into separate accumulators, to hide the FMA latency of a single row.
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
        const __m512 w0 = _mm512_permutexvar_ps(v, table);                        // elements 0..15: low nibbles
        const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);  // 16..31: high nibbles
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

// q4_dot_avx512's sums for 5..8 rows, whose four accumulators a row would need more than 32 registers: its
// even blocks feed a[r][0..1] and its odd blocks a[r][2..3] (block b goes to u = b % 2: chunks start at
// multiples of kScaleChunk, which is even), two chains that never meet until the end. So the even blocks of every
// chunk go first into every row's two even accumulators, whose sum a[r][0] + a[r][1] (the end's first add) then
// waits in one register, and the odd blocks follow into two fresh ones: every accumulator sees the same blocks in
// the same order as there, and the end sums them as there: the results equal q4_dot_avx512's bit for bit (and so
// its one-row loop's), while each block is widened once for all MR rows instead of once per kRows. At most
// 3 MR + 6 registers are live, so no accumulator leaves its register (two passes per chunk, which held the even
// and odd sets across each other, spilled them to the stack on every call).
template <int MR>
TARGET_AVX512 void q4_dot_avx512_wide(const uint8_t* qs, const uint16_t* sc, int64_t nb, const float* x, int64_t ldx,
                                      float* acc) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 even[MR];  // q4_dot_avx512's a[r][0] + a[r][1]
  float s[2 * kScaleChunk];
#pragma GCC unroll 2
  for (int p = 0; p < 2; ++p) {  // p = 0: the even blocks, 1: the odd blocks
    __m512 a[MR][2];  // q4_dot_avx512's a[r][2 p], a[r][2 p + 1]
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

template <int MR>
TARGET_AVX512 void q8_dot_avx512(const uint8_t* qs, const uint16_t* sc, int64_t nb, const float* x, int64_t ldx,
                                 float* acc) {
  __m512 a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  float s[kScaleChunk];
  for (int64_t c0 = 0; c0 < nb; c0 += kScaleChunk) {
    const int64_t nc = std::min(kScaleChunk, nb - c0);
    widen_halves(sc + c0, nc, s);
    for (int64_t i = 0; i < nc; ++i) {
      const int64_t b = c0 + i;
      const __m512 d = _mm512_set1_ps(s[i]);
      const __m128i* q = reinterpret_cast<const __m128i*>(qs + 32 * b);
      const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d);
      const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d);
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + r * ldx + 32 * b;
        a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), a0[r]);
        a1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), a1[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}

// The int8 loops with AVX-512 VNNI: dpbusd sums four u8 x s8 products into each int32 lane (no int16 step), the
// same four elements per lane as maddubs + madd, so each block's eight int32 lanes equal the AVX2 loop's. Two
// blocks share a 512-bit register, the even one in the low 256 bits and the odd one in the high: each half then
// takes exactly the float operations of q4_q8_dot_avx2's a0 and a1 (the scales d dx, the products d dx p, the
// FMAs, blocks in the same order), the minimum's terms as its m0 and m1 (lanes 1 and 3 of `mins`), and the
// final sums are its own. So the result equals the AVX2 loop's bit for bit: a session's tokens do not depend on
// whether its replica has VNNI. (Its one accumulator per row is a latency chain for a single row; splitting it
// would change the order and, measured, gains little: docs/bench/history.md, 2026-12-06.)

// d dx for the even block in lanes 0..7 and for the odd one in lanes 8..15, from ds (d dx, _, d dx, _).
TARGET_AVX512_VNNI inline __m512 pair_scales(__m128 ds) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
                               _mm512_castps128_ps512(ds));
}

// 4, 2 or 1 float16 scales as floats in the low lanes, zeros above: a Q4_1 pair's (d, m, d, m), a lone Q4_1
// block's (d, m) or a Q8_0 pair's (d, d), a lone Q8_0 block's d. Exact conversions, the values widen_halves gives
// the AVX2 loop; converted where they are used, which spares a one-row product widen_halves' pass and stores.
TARGET_AVX512_VNNI inline __m128 halves4(const uint16_t* h) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h)));
}
TARGET_AVX512_VNNI inline __m128 halves2(const uint16_t* h) {
  uint32_t v;
  std::memcpy(&v, h, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(v)));
}
TARGET_AVX512_VNNI inline __m128 halves1(const uint16_t* h) { return _mm_cvtph_ps(_mm_cvtsi32_si128(*h)); }

// Two floats into lanes 0 and 1, zeros above (a lone block's (dx, sx)).
TARGET_AVX512_VNNI inline __m128 load_pair(const float* p) {
  return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
}

// acc[r] from a[r] (a0 | a1) and mins[r] (lanes 1, 3: m0, m1): q4_q8_dot_avx2's last line.
TARGET_AVX512_VNNI inline float finish_pair(__m512 a, __m128 mins) {
  const float total = hsum256(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)));
  return total + (_mm_cvtss_f32(_mm_movehdup_ps(mins)) + _mm_cvtss_f32(_mm_permute_ps(mins, 3)));
}

template <int MR>
TARGET_AVX512_VNNI void q4_q8_dot_avx512(const uint8_t* qs, const uint16_t* sc, int64_t nb, const int8_t* qx,
                                         const float* xs, int64_t ldx, int64_t lds, float* acc) {
  __m512 a[MR];
  __m128 mins[MR];
  for (int r = 0; r < MR; ++r) {
    a[r] = _mm512_setzero_ps();
    mins[r] = _mm_setzero_ps();
  }
  const __m512i low = _mm512_set1_epi8(15);
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    // [q_b | q_b+1] -> 128-bit lanes q_b, q_b >> 4, q_b+1, q_b+1 >> 4, masked to nibbles: elements 0..31 of
    // block b, then of block b + 1, the order of the activations' bytes
    const __m512i two = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 16 * b)));
    const __m512i dup = _mm512_shuffle_i64x2(two, two, _MM_SHUFFLE(1, 1, 0, 0));
    const __m512i w = _mm512_and_si512(_mm512_mask_srli_epi16(dup, 0xFF00FF00u, dup, 4), low);
    const __m128 dm = halves4(sc + 2 * b);  // (d, m) of both blocks
    for (int r = 0; r < MR; ++r) {
      const __m512i y = _mm512_loadu_si512(qx + r * ldx + 32 * b);
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, y);
      const __m128 ds = _mm_loadu_ps(xs + r * lds + 2 * b);  // (dx, sx) of both blocks
      a[r] = _mm512_fmadd_ps(pair_scales(_mm_mul_ps(dm, ds)), _mm512_cvtepi32_ps(p), a[r]);
      mins[r] = _mm_fmadd_ps(dm, ds, mins[r]);  // lanes 1, 3: m sx into m0, m1 (lanes 0, 2 unused)
    }
  }
  if (b < nb) {  // a last, even block alone: the low half only, as q4_q8_dot_avx2 puts it into a0
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * b));
    const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(15));
    const __m128 dm = halves2(sc + 2 * b);
    for (int r = 0; r < MR; ++r) {
      const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * ldx + 32 * b));
      const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, y);
      const __m128 ds = load_pair(xs + r * lds + 2 * b);
      a[r] = _mm512_mask3_fmadd_ps(pair_scales(_mm_mul_ps(dm, ds)), _mm512_cvtepi32_ps(_mm512_zextsi256_si512(p)),
                                   a[r], 0x00FF);
      mins[r] = _mm_fmadd_ps(dm, ds, mins[r]);  // lane 1 only: lanes 2, 3 add 0 x 0
    }
  }
  for (int r = 0; r < MR; ++r) acc[r] = finish_pair(a[r], mins[r]);
}

// Q8_0: dpbusd needs one unsigned operand, so |w| x sign(qx, w) as in q8_q8_block_avx2 (AVX-512 has no byte
// sign instruction: qx is negated where w < 0, which is the same where w != 0; where w = 0, |w| = 0 anyway).
template <int MR>
TARGET_AVX512_VNNI void q8_q8_dot_avx512(const uint8_t* qs, const uint16_t* sc, int64_t nb, const int8_t* qx,
                                         const float* xs, int64_t ldx, int64_t lds, float* acc) {
  __m512 a[MR];
  for (int r = 0; r < MR; ++r) a[r] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    const __m512i w = _mm512_loadu_si512(qs + 32 * b);  // blocks b and b + 1
    const __m512i aw = _mm512_abs_epi8(w);  // |-128| reads as the unsigned 128
    const __mmask64 neg = _mm512_movepi8_mask(w);
    const __m128 d = halves2(sc + b);
    const __m128 dd = _mm_unpacklo_ps(d, d);  // (d_b, d_b, d_b+1, d_b+1)
    for (int r = 0; r < MR; ++r) {
      const __m512i y = _mm512_loadu_si512(qx + r * ldx + 32 * b);
      const __m512i sy = _mm512_mask_sub_epi8(y, neg, _mm512_setzero_si512(), y);
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sy);
      const __m128 ds = _mm_mul_ps(dd, _mm_loadu_ps(xs + r * lds + 2 * b));  // lanes 0, 2: d dx of each block
      a[r] = _mm512_fmadd_ps(pair_scales(ds), _mm512_cvtepi32_ps(p), a[r]);
    }
  }
  if (b < nb) {  // a last, even block alone: into the low half
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * b));
    const __m256i aw = _mm256_sign_epi8(w, w);
    const __m128 d = halves1(sc + b);
    for (int r = 0; r < MR; ++r) {
      const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * ldx + 32 * b));
      const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, _mm256_sign_epi8(y, w));
      const __m128 ds = _mm_mul_ps(d, _mm_set_ss(xs[r * lds + 2 * b]));
      a[r] = _mm512_mask3_fmadd_ps(pair_scales(ds), _mm512_cvtepi32_ps(_mm512_zextsi256_si512(p)), a[r], 0x00FF);
    }
  }
  for (int r = 0; r < MR; ++r)
    acc[r] = hsum256(_mm256_add_ps(_mm512_castps512_ps256(a[r]), _mm512_extractf32x8_ps(a[r], 1)));
}

// ---- bf16x2 activations on AMX (activations kBf16x2): the header's units (pack_units) ----
// Each unit holds one block (32 inputs) of 16 outputs in the order one tdpbf16ps reads them (pack_units). A pass
// takes up to kAmxRows rows of x, each as its two limbs: A (2 mr, 32 bf16) has row r = hi(x_r) and row mr + r =
// lo(x_r) over the block's 32 inputs; B (16 pair rows, 16 outputs x 2 bf16) is widened from the unit's q on
// every use (the q are exact in bf16); C (2 mr, 16) = A . B in float32; then per row, in AVX-512,
//   acc[r] = fma(d, C[mr + r] + C[r], acc[r]);  acc[r] = fma(m, sx_r, acc[r]) for Q4_1 (sx_r: the block's sum
//   of x_r; Q8_0 has no m)
// Every row's C row depends on its own A rows alone, and the rest is per row: a row's outputs are the same bit
// for bit whatever its batch. Tiles: 0, 1 B; 2, 3 A; 4, 5 C (two blocks in turn, so that the next block's B
// need not wait for this one's product).
constexpr int64_t kUnitChunk = 6;    // blocks whose B are built, multiplied, then combined together (phases)
constexpr int64_t kAheadUnits = 16;  // units prefetched ahead of the one being widened
constexpr int64_t kAmxRows = 8;      // rows of x a pass: their two limbs fill A's 16 tile rows

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

TARGET_AMX void configure_tiles(int64_t a_rows) {
  TileConfig cfg{};
  cfg.palette = 1;
  const int64_t rows[6] = {16, 16, a_rows, a_rows, a_rows, a_rows};
  for (int t = 0; t < 6; ++t) cfg.colsb[t] = 64, cfg.rows[t] = static_cast<uint8_t>(rows[t]);
  // not gcc 12's _tile_loadconfig, whose asm says it reads 8 bytes: the compiler dropped the other stores
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

TARGET_AMX void release_tiles() { _tile_release(); }

// mr rows of x (rows of `in`) -> xl (nb, 2 mr, 32) bf16: row l mr + r of block b holds limb l of x_r's 32 inputs
// (hi = bf16(x) rounded to nearest even, lo = bf16(x - hi), x - hi exact in float32); sx (mr, nb): the blocks'
// sums of x in float32.
TARGET_AMX void split_limbs(const float* x, int64_t mr, int64_t in, uint16_t* xl, float* sx) {
  const int64_t nb = in / 32;
  for (int64_t r = 0; r < mr; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      __m512 v[2] = {_mm512_loadu_ps(x + r * in + 32 * b), _mm512_loadu_ps(x + r * in + 32 * b + 16)};
      sx[r * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
      for (int64_t l = 0; l < 2; ++l) {
        uint16_t* row = xl + (b * 2 * mr + l * mr + r) * 32;
        for (int h = 0; h < 2; ++h) {
          const __m256i bf = (__m256i)_mm512_cvtneps_pbh(v[h]);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16 * h), bf);
          v[h] = _mm512_sub_ps(v[h], _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf), 16)));
        }
      }
    }
}

// B's 16 pair rows (64 bytes each) into bbuf from a Q4_1 unit's nibbles (16-bit lane i of its 64-byte chunk c
// shifted right by 0, 4, 8, 12: pair rows 4c..4c+3's word i in the low 4 bits); table[e] = bf16(e & 15).
TARGET_AMX inline void build_b4(const uint8_t* unit, uint16_t* bbuf, __m512i table) {
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(unit + 64 * c);
    uint16_t* rows = bbuf + 4 * c * 32;
    _mm512_store_si512(rows, _mm512_permutexvar_epi16(v, table));
    _mm512_store_si512(rows + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table));
    _mm512_store_si512(rows + 64, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), table));
    _mm512_store_si512(rows + 96, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), table));
  }
}

// The same from a Q8_0 unit's int8 q: each pair row's 32 bytes sign-extended to int32, converted to float and
// to bf16 (all exact for |q| <= 127: vcvtne2ps2bf16's b operand fills the low 16 bf16, a the high 16).
TARGET_AMX inline void build_b8(const uint8_t* unit, uint16_t* bbuf) {
  const __m128i* q = reinterpret_cast<const __m128i*>(unit);  // 2 x 16 bytes a pair row
  for (int k = 0; k < 16; ++k) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 2 * k)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 2 * k + 1)));
    _mm512_store_si512(bbuf + 32 * k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// C = A . B on tiles TC, TA, TB (literals: the intrinsics paste them into their assembly). gcc 12's tileloadd and
// tilestored do not tell the compiler that they read or write memory: a barrier before keeps B's stores before
// the load (and the callers put one before C is read).
#define RETOPK_AMX_PRODUCT(TB, TA, TC, B_ROWS, A_ROWS, C_OUT) \
  __asm__ volatile("" ::: "memory");                          \
  _tile_loadd(TB, B_ROWS, 64);                                \
  _tile_loadd(TA, A_ROWS, 64);                                \
  _tile_zero(TC);                                             \
  _tile_dpbf16ps(TC, TA, TB);                                 \
  _tile_stored(TC, C_OUT, 64);

// y rows [0, MR) (ldy apart), outputs of groups [g0, g1) = units' x W^T (+ bias) (+ residual), from xl / sx of
// split_limbs; tiles configured for 2 MR rows of A. BITS 4: Q4_1 units, 8: Q8_0 units.
template <int BITS, int MR>
TARGET_AMX void amx_groups(const uint8_t* units, int64_t nb, int64_t g0, int64_t g1, const uint16_t* xl,
                           const float* sx, const float* bias, const float* residual, float* y, int64_t ldy) {
  constexpr int64_t LM = 2 * MR;
  alignas(64) uint16_t bbuf[kUnitChunk * 512];  // (kUnitChunk, 16, 32) bf16
  alignas(64) float cbuf[kUnitChunk * 256];     // (kUnitChunk, <= 16, 16)
  alignas(64) uint16_t tab[32];
  for (int e = 0; e < 32; ++e) tab[e] = c10::BFloat16(static_cast<float>(e & 15)).x;  // exact
  const __m512i table = _mm512_load_si512(tab);
  for (int64_t g = g0; g < g1; ++g) {
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    constexpr int64_t kUnit = BITS == 4 ? kUnit4 : kUnit8;
    const uint8_t* gu = units + g * nb * kUnit;
    for (int64_t b0 = 0; b0 < nb; b0 += kUnitChunk) {
      const int64_t nc = std::min(kUnitChunk, nb - b0);
      for (int64_t i = 0; i < nc; ++i) {
        const uint8_t* unit = gu + (b0 + i) * kUnit;
        for (int64_t k = 0; k < kUnit; k += 64) __builtin_prefetch(unit + kAheadUnits * kUnit + k, 0, 3);
        if constexpr (BITS == 4)
          build_b4(unit, bbuf + i * 512, table);
        else
          build_b8(unit, bbuf + i * 512);
      }
      int64_t i = 0;
      for (; i + 2 <= nc; i += 2) {
        const uint16_t* a0 = xl + (b0 + i) * LM * 32;
        RETOPK_AMX_PRODUCT(0, 2, 4, bbuf + i * 512, a0, cbuf + i * 256)
        RETOPK_AMX_PRODUCT(1, 3, 5, bbuf + (i + 1) * 512, a0 + LM * 32, cbuf + (i + 1) * 256)
      }
      if (i < nc) {
        RETOPK_AMX_PRODUCT(0, 2, 4, bbuf + i * 512, xl + (b0 + i) * LM * 32, cbuf + i * 256)
      }
      __asm__ volatile("" ::: "memory");  // C's tile stores before its loads
      for (int64_t k = 0; k < nc; ++k) {
        const uint8_t* unit = gu + (b0 + k) * kUnit;
        const uint8_t* dp = unit + (BITS == 4 ? 256 : 512);  // the 16 outputs' d
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dp)));
        const float* c = cbuf + k * 256;
        for (int r = 0; r < MR; ++r) {
          const __m512 t = _mm512_add_ps(_mm512_load_ps(c + (MR + r) * 16), _mm512_load_ps(c + r * 16));
          acc[r] = _mm512_fmadd_ps(d, t, acc[r]);
        }
        if constexpr (BITS == 4) {
          const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 288)));
          for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * nb + b0 + k]), acc[r]);
        }
      }
    }
    for (int r = 0; r < MR; ++r) {  // block_matmul's order: the product, + bias, + residual
      __m512 v = acc[r];
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * g));
      if (residual) v = _mm512_add_ps(v, _mm512_loadu_ps(residual + r * ldy + 16 * g));
      _mm512_storeu_ps(y + r * ldy + 16 * g, v);
    }
  }
}
#undef RETOPK_AMX_PRODUCT

using AmxFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const uint16_t*, const float*, const float*,
                       const float*, float*, int64_t);

template <int BITS>
AmxFn amx_fn(int64_t mr) {
  switch (mr) {
    case 1: return amx_groups<BITS, 1>;
    case 2: return amx_groups<BITS, 2>;
    case 3: return amx_groups<BITS, 3>;
    case 4: return amx_groups<BITS, 4>;
    case 5: return amx_groups<BITS, 5>;
    case 6: return amx_groups<BITS, 6>;
    case 7: return amx_groups<BITS, 7>;
    default: return amx_groups<BITS, 8>;
  }
}

// y (M, out) = x (M, in) W^T (+ bias) (+ residual) from pack_units's units, rows in passes of kAmxRows. x's limbs
// are split once for every task; one task per range of groups of 16 outputs, which loads the tile
// configuration for each pass and releases the tiles at its end (the configuration is per thread). A pass over
// more than kAmxRows rows reads the task's units again (from L2 for a decode step's shapes).
void amx_matmul(const float* x, int64_t M, int64_t in, const uint8_t* units, int64_t bits, int64_t out,
                const float* bias, const float* residual, float* y) {
  const int64_t nb = in / 32;
  std::unique_ptr<uint16_t[]> xl_own;
  std::unique_ptr<float[]> sx_own;
  uint16_t* xl = limb_scratch(2 * M * in, xl_own);  // per pass of rows r0..: (nb, 2 mr, 32) at 2 r0 in
  float* sx = limb_scratch(M * nb, sx_own);
  for (int64_t r0 = 0; r0 < M; r0 += kAmxRows)
    split_limbs(x + r0 * in, std::min(kAmxRows, M - r0), in, xl + 2 * r0 * in, sx + r0 * nb);
  at::parallel_for(0, out / 16, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t r0 = 0; r0 < M; r0 += kAmxRows) {
      const int64_t mr = std::min(kAmxRows, M - r0);
      configure_tiles(2 * mr);
      (bits == 4 ? amx_fn<4>(mr) : amx_fn<8>(mr))(units, nb, g0, g1, xl + 2 * r0 * in, sx + r0 * nb, bias,
                 residual ? residual + r0 * out : nullptr, y + r0 * out, out);
    }
    release_tiles();
  });
}
#endif

// ---- int16 activations (activations kInt16): exact integer block dots over the header's units (pack_units) ----
// x per row and block of 32 as int16 with one scale (quantize_block16), then each unit's 16 outputs' integer
// dots with the weight's q (Q4_1 nibbles, Q8_0 int8) in int32, exact, and one float combine per (row, unit):
//   acc = fma(float(isum), d s, acc);  acc = fma(m, sq, acc) for Q4_1
// with blocks in file order. The integer dots do not depend on the order of their products, so every level (the
// plain loop, AVX2's madd and AVX-512 VNNI's dpwssd) and every pass width gives the same bits.
constexpr float kMaxInt16 = 32767.f;
// Below this max |x| a block's s = max |x| / 32767 would not be a normal float (and 32767 / max |x| not finite):
// such a block quantizes to zeros with s = 0.
constexpr float kMinAmax16 = 32767.f * 1.17549435e-38f;  // 32767 FLT_MIN
constexpr int64_t kInt16Rows = 8;  // rows of x a pass of the VNNI loop (its integer and float accumulators: 16 zmm)
constexpr int64_t kInt16Avx2Rows = 4;  // the same for AVX2, whose 16 registers hold four rows' (half a unit)
using aliased_i32 = int32_t __attribute__((may_alias));  // two int16 of x read as one dpwssd / madd broadcast

// One block of 32 values of x -> q (32 int16), ss = (s, sq): the header's rounding, plain C++ (the reference).
void quantize_block16_scalar(const float* x, int16_t* q, float* ss) {
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const bool zero = !(amax >= kMinAmax16);
  const float inv = zero ? 0.f : kMaxInt16 / amax;
  int32_t sum = 0;
  for (int j = 0; j < 32; ++j) {
    q[j] = static_cast<int16_t>(std::nearbyint(x[j] * inv));
    sum += q[j];
  }
  ss[0] = zero ? 0.f : amax / kMaxInt16;
  ss[1] = ss[0] * static_cast<float>(sum);
}

#ifdef RETOPK_X86
// quantize_block16_scalar with AVX2: the same float operations (a max, two divisions, products rounded half to even
// by cvtps under the default rounding mode), so the same values and scales.
TARGET_AVX2 void quantize_block16_avx2(const float* x, int16_t* q, float* ss) {
  __m256 v[4];
  const float amax = load_block_amax(x, v);
  const bool zero = !(amax >= kMinAmax16);
  const __m256 inv = _mm256_set1_ps(zero ? 0.f : kMaxInt16 / amax);
  __m256i i[4];
  for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));
  // packs work per 128-bit lane: the permute puts the two groups of 8 of each half back in order
  for (int h = 0; h < 2; ++h)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * h),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(i[2 * h], i[2 * h + 1]), _MM_SHUFFLE(3, 1, 2, 0)));
  ss[0] = zero ? 0.f : amax / kMaxInt16;
  ss[1] = ss[0] * static_cast<float>(sum_block_epi32(i));
}
#endif

// x (M, in) -> q (M, in) int16 and ss (M, in / 32, 2) = (s, sq) per block, as the header states.
void quantize_rows16(const float* x, int64_t M, int64_t in, int16_t* q, float* ss, int64_t isa) {
  const int64_t blocks = M * (in / 32);
#ifdef RETOPK_X86
  if (isa >= kAvx2) {
    for (int64_t k = 0; k < blocks; ++k) quantize_block16_avx2(x + 32 * k, q + 32 * k, ss + 2 * k);
    return;
  }
#endif
  for (int64_t k = 0; k < blocks; ++k) quantize_block16_scalar(x + 32 * k, q + 32 * k, ss + 2 * k);
}

// The arguments of one int16 loop: units of `nb` blocks, x quantized (q rows of `in` int16, ss rows of nb (s, sq)),
// the optional bias (out,) and residual (rows of ldy), y rows of ldy.
struct Int16Args {
  const uint8_t* units;
  int64_t nb, in;
  const int16_t* q;
  const float* ss;
  const float* bias;
  const float* residual;
  float* y;
  int64_t ldy;
};

// y[r, 16 g + n] for r < mr from acc[r][n]: + bias, + residual (block_matmul's order).
inline void finish16(const Int16Args& a, int64_t g, int64_t r, const float* acc, int64_t n0, int64_t count) {
  for (int64_t n = n0; n < n0 + count; ++n) {
    const int64_t o = 16 * g + n;
    float v = acc[n - n0];
    if (a.bias) v += a.bias[o];
    if (a.residual) v += a.residual[r * a.ldy + o];
    a.y[r * a.ldy + o] = v;
  }
}

// Group g's outputs for rows [0, mr) of a, plain C++: the units' q read back by the header's layout.
template <int BITS>
void int16_group_scalar(const Int16Args& a, int64_t g, int64_t mr) {
  constexpr int64_t kUnit = BITS == 4 ? kUnit4 : kUnit8;
  for (int64_t r = 0; r < mr; ++r) {
    float acc[16] = {};
    for (int64_t b = 0; b < a.nb; ++b) {
      const uint8_t* unit = a.units + (g * a.nb + b) * kUnit;
      const int16_t* xq = a.q + r * a.in + 32 * b;
      const float* ss = a.ss + (r * a.nb + b) * 2;
      const uint16_t* scales = reinterpret_cast<const uint16_t*>(unit + (BITS == 4 ? 256 : 512));
      for (int64_t n = 0; n < 16; ++n) {
        int32_t isum = 0;
        for (int64_t k = 0; k < 32; ++k) {  // q[n][k]: pair row k / 2, word 2 n + k % 2
          const int64_t p = k / 2, word = 2 * n + k % 2;
          int32_t w;
          if constexpr (BITS == 4)
            w = ((unit[64 * (p / 4) + 2 * word] | unit[64 * (p / 4) + 2 * word + 1] << 8) >> (4 * (p % 4))) & 15;
          else
            w = static_cast<int8_t>(unit[32 * p + word]);
          isum += w * xq[k];
        }
        const float ds = half_to_float(scales[n]) * ss[0];
        acc[n] = std::fma(static_cast<float>(isum), ds, acc[n]);
        if constexpr (BITS == 4) acc[n] = std::fma(half_to_float(scales[16 + n]), ss[1], acc[n]);
      }
    }
    finish16(a, g, r, acc, 0, 16);
  }
}

#ifdef RETOPK_X86
// Group g's outputs for MR rows with AVX2 (AVX-512 without VNNI too): each half of the unit (outputs 8 h .. 8 h + 7,
// the 32 bytes at 32 h of each 64-byte Q4_1 chunk, or of each Q8_0 pair row's 32) in turn, so that a row's integer
// and float accumulators fit beside B; madd sums each lane's pair of int16 products into int32 (exact: at most
// 2 * 32767 * 128), add_epi32 the pair rows.
template <int BITS, int MR>
TARGET_AVX2 void int16_group_avx2(const Int16Args& a, int64_t g) {
  constexpr int64_t kUnit = BITS == 4 ? kUnit4 : kUnit8;
  const __m256i low = _mm256_set1_epi16(15);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.nb; ++b) {
      const uint8_t* unit = a.units + (g * a.nb + b) * kUnit;
      __m256i isum[MR];
      for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
      const aliased_i32* xp[MR];
      for (int r = 0; r < MR; ++r) xp[r] = reinterpret_cast<const aliased_i32*>(a.q + r * a.in + 32 * b);
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p) {
        __m256i w;
        if constexpr (BITS == 4) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 64 * (p / 4) + 32 * h));
          w = _mm256_and_si256(_mm256_srli_epi16(v, 4 * (p % 4)), low);
        } else {
          w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 32 * p + 16 * h)));
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r)
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(w, _mm256_set1_epi32(xp[r][p])));
      }
      const uint16_t* scales = reinterpret_cast<const uint16_t*>(unit + (BITS == 4 ? 256 : 512));
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 8 * h)));
      for (int r = 0; r < MR; ++r) {
        const float* ss = a.ss + (r * a.nb + b) * 2;
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(ss[0])), acc[r]);
        if constexpr (BITS == 4) {
          const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16 + 8 * h)));
          acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(ss[1]), acc[r]);
        }
      }
    }
    alignas(32) float out[8];
    for (int r = 0; r < MR; ++r) {
      _mm256_store_ps(out, acc[r]);
      finish16(a, g, r, out, 8 * h, 8);
    }
  }
}

// Group g's outputs for MR rows with AVX-512 VNNI: per unit and pair row p, B_p in one register (Q4_1: the 64-byte
// chunk p / 4 shifted right by 4 (p % 4), masked to nibbles; Q8_0: pair row p's 32 int8 widened), and for each row
// isum += dpwssd(B_p, x's pair p broadcast): lane n gains q[n][2 p] x[2 p] + q[n][2 p + 1] x[2 p + 1]. With one or
// two rows the 16 dpwssd of a unit would be one dependency chain a row: they go round NA integer accumulators,
// summed at the unit's end (exact, so the bits stay).
// acc += dpwssd(w, *x broadcast): the broadcast embedded in the instruction ({1to16}), which gcc does not fold
TARGET_AVX512_VNNI __attribute__((always_inline)) inline void dpwssd_bcast(__m512i& acc, __m512i w,
                                                                           const aliased_i32* x) {
  __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
}

template <int BITS, int MR>
TARGET_AVX512_VNNI void int16_group_vnni(const Int16Args& a, int64_t g) {
  constexpr int NA = MR == 1 ? 4 : MR == 2 ? 2 : 1;  // integer accumulators a row
  constexpr int64_t kUnit = BITS == 4 ? kUnit4 : kUnit8;
  const __m512i low = _mm512_set1_epi16(15);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* gu = a.units + g * a.nb * kUnit;
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* unit = gu + b * kUnit;
    for (int64_t k = 0; k < kUnit; k += 64) __builtin_prefetch(unit + kAheadUnits * kUnit + k, 0, 3);
    __m512i isum[MR][NA];
    for (int r = 0; r < MR; ++r)
      for (int i = 0; i < NA; ++i) isum[r][i] = _mm512_setzero_si512();
    const aliased_i32* xp[MR];
    for (int r = 0; r < MR; ++r) xp[r] = reinterpret_cast<const aliased_i32*>(a.q + r * a.in + 32 * b);
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) {
      __m512i w;
      if constexpr (BITS == 4) {
        const __m512i v = _mm512_loadu_si512(unit + 64 * (p / 4));
        w = p % 4 == 3 ? _mm512_srli_epi16(v, 12) : _mm512_and_si512(_mm512_srli_epi16(v, 4 * (p % 4)), low);
      } else {
        w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 32 * p)));
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
        dpwssd_bcast(isum[r][p % NA], w, xp[r] + p);
    }
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(unit + (BITS == 4 ? 256 : 512));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m512i t = isum[r][0];
      for (int i = 1; i < NA; ++i) t = _mm512_add_epi32(t, isum[r][i]);
      const float* ss = a.ss + (r * a.nb + b) * 2;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(d, _mm512_set1_ps(ss[0])), acc[r]);
      if constexpr (BITS == 4) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 16)));
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(ss[1]), acc[r]);
      }
    }
  }
  alignas(64) float out[16];
  for (int r = 0; r < MR; ++r) {
    _mm512_store_ps(out, acc[r]);
    finish16(a, g, r, out, 0, 16);
  }
}
#endif

using Int16Fn = void (*)(const Int16Args&, int64_t);

template <int BITS>
Int16Fn int16_fn(int64_t isa, int64_t mr) {
#ifdef RETOPK_X86
  if (isa >= kAvx512Vnni) {
    switch (mr) {
      case 1: return int16_group_vnni<BITS, 1>;
      case 2: return int16_group_vnni<BITS, 2>;
      case 3: return int16_group_vnni<BITS, 3>;
      case 4: return int16_group_vnni<BITS, 4>;
      case 5: return int16_group_vnni<BITS, 5>;
      case 6: return int16_group_vnni<BITS, 6>;
      case 7: return int16_group_vnni<BITS, 7>;
      default: return int16_group_vnni<BITS, 8>;
    }
  }
  if (isa >= kAvx2) {
    switch (mr) {
      case 1: return int16_group_avx2<BITS, 1>;
      case 2: return int16_group_avx2<BITS, 2>;
      case 3: return int16_group_avx2<BITS, 3>;
      default: return int16_group_avx2<BITS, 4>;
    }
  }
#endif
  return nullptr;  // the plain loop takes any mr (int16_matmul)
}

// y (M, out) = x (M, in) W^T (+ bias) (+ residual) from pack_units's units with int16 activations: x quantized once
// for every task; one task per range of groups of 16 outputs, each group's rows in passes (kInt16Rows with VNNI,
// kInt16Avx2Rows with AVX2) one after another while its units stay in L1.
void int16_matmul(const float* x, int64_t M, int64_t in, const uint8_t* units, int64_t bits, int64_t out,
                  const float* bias, const float* residual, float* y, int64_t isa) {
  const int64_t nb = in / 32;
  std::unique_ptr<int16_t[]> q_own;
  std::unique_ptr<float[]> ss_own;
  int16_t* q = limb_scratch(M * in, q_own);
  float* ss = limb_scratch(2 * M * nb, ss_own);
  quantize_rows16(x, M, in, q, ss, isa);
  // the plain loop's one pass takes every row (at least one, so that M % rows is defined when M is 0)
  const int64_t rows = isa >= kAvx512Vnni ? kInt16Rows : isa >= kAvx2 ? kInt16Avx2Rows : std::max<int64_t>(M, 1);
  // the loops of a full pass (min(rows, M) rows) and of a shorter last one (M % rows, where not 0), picked once
  auto pick = [&](int64_t mr) { return bits == 4 ? int16_fn<4>(isa, mr) : int16_fn<8>(isa, mr); };
  const Int16Fn full = pick(std::min(rows, M)), tail = M % rows ? pick(M % rows) : full;
  at::parallel_for(0, out / 16, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t r0 = 0; r0 < M; r0 += rows) {
        const int64_t mr = std::min(rows, M - r0);
        const Int16Args a{units, nb, in, q + r0 * in, ss + 2 * r0 * nb, bias,
                          residual ? residual + r0 * out : nullptr, y + r0 * out, out};
        const Int16Fn fn = mr == rows ? full : tail;
        if (fn)
          fn(a, g);
        else if (bits == 4)
          int16_group_scalar<4>(a, g, mr);
        else
          int16_group_scalar<8>(a, g, mr);
      }
  });
}

// fn<mr> for 1 <= mr <= kRows
#define RETOPK_PICK(fn)                                                                              \
  switch (mr) {                                                                                      \
    case 1: return fn<1>;                                                                            \
    case 2: return fn<2>;                                                                            \
    case 3: return fn<3>;                                                                            \
    default: return fn<4>;                                                                           \
  }
// fn<mr> for 1 <= mr <= kWideRows, wide<mr> from 5 rows on
#define RETOPK_PICK_WIDE(fn, wide)                                                                   \
  switch (mr) {                                                                                      \
    case 1: return fn<1>;                                                                            \
    case 2: return fn<2>;                                                                            \
    case 3: return fn<3>;                                                                            \
    case 4: return fn<4>;                                                                            \
    case 5: return wide<5>;                                                                          \
    case 6: return wide<6>;                                                                          \
    case 7: return wide<7>;                                                                          \
    default: return wide<8>;                                                                         \
  }

// Rows of x the loops of `isa` take per pass over a weight row of `in` inputs: kWideRows for the float32 loops
// (AVX-512's registers hold eight rows' accumulators; AVX2's 16 hold four, so from five rows on its wide loops take
// each block in two passes of half a block, q4_dot_avx2_wide: docs/bench/history.md, 2026-12-07, helper h53) while
// that many rows of x fit kPassBytes, else kRows: a wider x, such as the down product's, would leave L1 on every
// weight row, and four rows a pass, each block widened twice, measured faster there at both levels (history.md,
// 2026-12-07, helper h58). The int8 loops take kRows (AVX-512 VNNI's, measured at eight rows a pass, were slower
// than at four: docs/bench/history.md, 2026-12-06, helper h39).
int64_t rows_per_pass(int64_t isa, int64_t activations, int64_t in) {
#ifdef RETOPK_X86
  if (isa >= kAvx2 && activations == kFloat32) return kWideRows * in * 4 <= kPassBytes ? kWideRows : kRows;
#endif
  return kRows;
}

// The loop for `bits` on `isa` taking mr rows of x at once (1 <= mr <= kWideRows).
DotFn dot_fn(int64_t isa, int64_t bits, int64_t mr) {
#ifdef RETOPK_X86
  if (isa >= kAvx512) {
    if (bits == 4) RETOPK_PICK_WIDE(q4_dot_avx512, q4_dot_avx512_wide)
    else RETOPK_PICK_WIDE(q8_dot_avx512, q8_dot_avx512)
  }
  if (isa == kAvx2) {
    if (bits == 4) RETOPK_PICK_WIDE(q4_dot_avx2, q4_dot_avx2_wide)
    else RETOPK_PICK_WIDE(q8_dot_avx2, q8_dot_avx2_wide)
  }
#endif
  if (bits == 4) RETOPK_PICK(q4_dot_scalar) else RETOPK_PICK(q8_dot_scalar)
}

// The loop for `bits` against quantized x (1 <= mr <= kRows): AVX-512 without VNNI keeps AVX2's (its results are
// the same).
QDotFn qdot_fn(int64_t isa, int64_t bits, int64_t mr) {
#ifdef RETOPK_X86
  if (isa >= kAvx512Vnni) {
    if (bits == 4) RETOPK_PICK(q4_q8_dot_avx512) else RETOPK_PICK(q8_q8_dot_avx512)
  }
  if (isa >= kAvx2) {
    if (bits == 4) RETOPK_PICK(q4_q8_dot_avx2) else RETOPK_PICK(q8_q8_dot_avx2)
  }
#endif
  if (bits == 4) RETOPK_PICK(q4_q8_dot_scalar) else RETOPK_PICK(q8_q8_dot_scalar)
#undef RETOPK_PICK
#undef RETOPK_PICK_WIDE
}

// x (M, in) -> qx (M, in) int8 and xs (M, in / 32, 2) = (dx, sx) per block, as the header states.
void quantize_rows(const float* x, int64_t M, int64_t in, int8_t* qx, float* xs, int64_t isa) {
  const int64_t blocks = M * (in / 32);
#ifdef RETOPK_X86
  if (isa >= kAvx2) {
    for (int64_t k = 0; k < blocks; ++k) quantize_block_avx2(x + 32 * k, qx + 32 * k, xs + 2 * k);
    return;
  }
#endif
  for (int64_t k = 0; k < blocks; ++k) quantize_block_scalar(x + 32 * k, qx + 32 * k, xs + 2 * k);
}

#define CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)

void check_f32_matrix(const at::Tensor& t, const char* name, int64_t rows, int64_t cols) {
  CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2,
              name, " must be a contiguous 2-D float32 CPU tensor");
  CHECK_VALUE((rows < 0 || t.size(0) == rows) && t.size(1) == cols, name, " has shape ", t.sizes(), ", expected (",
              rows, ", ", cols, ")");
}

}  // namespace

namespace {
int64_t detect_isa() {
#ifdef RETOPK_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    const bool f16c = (c >> 29) & 1;
    if (f16c && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      return __builtin_cpu_supports("avx512vnni") ? kAvx512Vnni : kAvx512;
    if (f16c) return kAvx2;
  }
#endif
  return kScalar;
}
}  // namespace

// Detected once: cpuid traps to the hypervisor on a VM, and every block_matmul checks its isa against this.
int64_t best_isa() {
  static const int64_t isa = detect_isa();
  return isa;
}

namespace {
std::atomic<int64_t> held_isa{-1};  // set_isa_level's level; -1 until it is called: best_isa()
}  // namespace

int64_t isa_level() {
  const int64_t level = held_isa.load(std::memory_order_relaxed);
  return level < 0 ? best_isa() : level;
}

void set_isa_level(int64_t level) {
  CHECK_VALUE(level >= kScalar && level <= best_isa(), "isa level ", level, " is not available on this CPU (best ",
              best_isa(), ")");
  held_isa.store(level, std::memory_order_relaxed);
}

namespace {
// AMX-TILE and AMX-BF16 (cpuid 7.0 edx bits 24, 22) with AVX-512 BF16 (7.1 eax bit 5) and AVX-512 F/BW/VL/DQ,
// the tile state enabled by the OS (XCR0 bits 17, 18), and Linux's permission for this process to use it
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): Linux hands out the tile state only on request).
bool detect_amx() {
#ifdef RETOPK_AMX
  if (best_isa() < kAvx512) return false;
  unsigned a, b, c, d;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0), "c"(0));
  if (a < 7) return false;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  const bool tile = (d >> 24) & 1, amx_bf16 = (d >> 22) & 1;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(1));
  const bool avx512_bf16 = (a >> 5) & 1;
  if (!tile || !amx_bf16 || !avx512_bf16) return false;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
  if (!((c >> 27) & 1)) return false;  // OSXSAVE: xgetbv is there
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (((lo >> 17) & 3) != 3) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
}  // namespace

bool amx_available() {
  static const bool ok = detect_amx();  // once: the permission is the process's
  return ok;
}

namespace {
// Q8_0's units: qs int8 (out, in), sc (out, in / 32) float16 -> up, (out / 16, in / 32) units of kUnit8.
void fill_units_q8(const int8_t* q, const uint16_t* sc, int64_t out, int64_t in, int8_t* up) {
  const int64_t nb = in / 32;
  at::parallel_for(0, out / 16, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        int8_t* u = up + (g * nb + b) * kUnit8;
        for (int64_t k = 0; k < 16; ++k)
          for (int64_t n = 0; n < 16; ++n)
            for (int64_t s = 0; s < 2; ++s) u[32 * k + 2 * n + s] = q[(16 * g + n) * in + 32 * b + 2 * k + s];
        uint16_t* us = reinterpret_cast<uint16_t*>(u + 512);
        for (int64_t n = 0; n < 16; ++n) us[n] = sc[(16 * g + n) * nb + b];
      }
  });
}

// Q4_1's units: qs uint8 (out, in / 2) nibbles, sc (out, in / 32, 2) float16 -> up, units of kUnit4.
void fill_units_q4(const uint8_t* q, const uint16_t* sc, int64_t out, int64_t in, uint8_t* up) {
  const int64_t nb = in / 32;
  auto nibble = [&](int64_t o, int64_t b, int64_t k) {  // q of W[o, 32 b + k]
    const uint8_t byte = q[o * (in / 2) + 16 * b + (k & 15)];
    return k < 16 ? byte & 15 : byte >> 4;
  };
  at::parallel_for(0, out / 16, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* u = up + (g * nb + b) * kUnit4;
        for (int64_t c = 0; c < 4; ++c)
          for (int64_t i = 0; i < 32; ++i)
            for (int64_t s = 0; s < 2; ++s) {
              const int64_t row = 4 * c + 2 * s, o = 16 * g + i / 2;
              u[64 * c + 2 * i + s] =
                  static_cast<uint8_t>(nibble(o, b, 2 * row + i % 2) | nibble(o, b, 2 * (row + 1) + i % 2) << 4);
            }
        uint16_t* us = reinterpret_cast<uint16_t*>(u + 256);
        for (int64_t n = 0; n < 16; ++n) {
          us[n] = sc[((16 * g + n) * nb + b) * 2];
          us[16 + n] = sc[((16 * g + n) * nb + b) * 2 + 1];
        }
      }
  });
}
}  // namespace

at::Tensor pack_units(const at::Tensor& qs, const at::Tensor& scales) {
  CHECK_VALUE(qs.device().is_cpu() && qs.is_contiguous() && qs.dim() == 2 &&
                  (qs.scalar_type() == at::kByte || qs.scalar_type() == at::kChar),
              "qs must be a contiguous (out, in / 2) uint8 (Q4_1) or (out, in) int8 (Q8_0) CPU tensor, got ",
              qs.sizes(), " ", qs.scalar_type());
  const bool q8 = qs.scalar_type() == at::kChar;
  const int64_t out = qs.size(0), in = q8 ? qs.size(1) : 2 * qs.size(1), nb = in / 32;
  const int64_t per_block = q8 ? 1 : 2;  // float16 scales a block: d, or (d, m)
  CHECK_VALUE(in % 32 == 0, "in features must be a multiple of 32, got ", in);
  CHECK_VALUE(out % 16 == 0, "bf16x2 and int16 need out features a multiple of 16 (units of 16 outputs), got ", out);
  CHECK_VALUE(scales.device().is_cpu() && scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.numel() == out * nb * per_block,
              "scales must be contiguous float16 with ", out * nb * per_block, " elements");
  at::Tensor units = at::empty({out, nb * (q8 ? kUnit8 : kUnit4) / 16}, qs.options());
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  if (q8)
    fill_units_q8(qs.data_ptr<int8_t>(), sc, out, in, units.data_ptr<int8_t>());
  else
    fill_units_q4(qs.data_ptr<uint8_t>(), sc, out, in, units.data_ptr<uint8_t>());
  return units;
}

namespace {
// y (M, out) <- x W^T (+ bias) (+ residual): block_matmul into a given output.
void block_matmul_to(at::Tensor& y, const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, int64_t bits,
                     const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual, int64_t isa,
                     int64_t activations) {
  CHECK_VALUE(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  CHECK_VALUE(isa >= kScalar && isa <= best_isa(), "isa ", isa, " is not available on this CPU (best ", best_isa(), ")");
  CHECK_VALUE(activations >= kFloat32 && activations <= kInt16,
              "activations must be 0 (float32), 1 (int8), 2 (bf16x2) or 3 (int16), got ", activations);
  CHECK_VALUE(x.dim() == 2, "x must be (M, in)");
  const int64_t M = x.size(0), in = x.size(1), out = qs.size(0), nb = in / 32;
  check_f32_matrix(x, "x", -1, in);
  CHECK_VALUE(in % 32 == 0, "in features must be a multiple of 32, got ", in);
  if (bias) CHECK_VALUE(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out,
                        "bias must be a contiguous float32 (out,) tensor");
  if (residual) check_f32_matrix(*residual, "residual", M, out);
  check_f32_matrix(y, "y", M, out);
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const float* rp = residual ? residual->data_ptr<float>() : nullptr;
  if (activations == kBf16x2 || activations == kInt16) {  // qs holds pack_units's units; scales are not read
    const char* name = activations == kBf16x2 ? "bf16x2" : "int16";
    if (activations == kBf16x2)
      CHECK_VALUE(amx_available(), "activations bf16x2 needs AMX-BF16 (with Linux's permission for the tiles), "
                  "which this CPU or process does not have");
    const int64_t unit_cols = nb * (bits == 4 ? kUnit4 : kUnit8) / 16;
    CHECK_VALUE(qs.device().is_cpu() && qs.is_contiguous() && qs.dim() == 2 &&
                    qs.scalar_type() == (bits == 4 ? at::kByte : at::kChar) && out % 16 == 0 &&
                    qs.size(1) == unit_cols,
                "with activations ", name, ", qs must be pack_units's units: a contiguous (out, ", unit_cols, ") ",
                bits == 4 ? "uint8" : "int8", " CPU tensor with out a multiple of 16, got ", qs.sizes(), " ",
                qs.scalar_type());
    const uint8_t* units = static_cast<const uint8_t*>(qs.data_ptr());
    if (activations == kInt16) {
      int16_matmul(x.data_ptr<float>(), M, in, units, bits, out, bp, rp, y.data_ptr<float>(), isa);
      return;
    }
#ifdef RETOPK_X86
    amx_matmul(x.data_ptr<float>(), M, in, units, bits, out, bp, rp, y.data_ptr<float>());
#endif
    return;
  }
  CHECK_VALUE(qs.device().is_cpu() && qs.is_contiguous() && qs.dim() == 2 &&
                  qs.scalar_type() == (bits == 4 ? at::kByte : at::kChar) && qs.size(1) == in * bits / 8,
              "qs must be a contiguous (out, ", in * bits / 8, ") ", bits == 4 ? "uint8" : "int8", " CPU tensor, got ",
              qs.sizes(), " ", qs.scalar_type());
  CHECK_VALUE(scales.device().is_cpu() && scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.numel() == out * nb * (bits == 4 ? 2 : 1),
              "scales must be contiguous float16 with ", out * nb * (bits == 4 ? 2 : 1), " elements");
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = static_cast<const uint8_t*>(qs.data_ptr());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = in * bits / 8, row_scales = nb * (bits == 4 ? 2 : 1);
  const int64_t chunk = rows_per_pass(isa, activations, in);
  const DotFn full = dot_fn(isa, bits, std::min(chunk, M)), tail = dot_fn(isa, bits, std::max<int64_t>(1, M % chunk));
  const QDotFn qfull = qdot_fn(isa, bits, std::min(chunk, M)), qtail = qdot_fn(isa, bits, std::max<int64_t>(1, M % chunk));
  const bool int8 = activations == kInt8;
  std::vector<int8_t> qx(int8 ? M * in : 0);  // x quantized once for every output row
  std::vector<float> xs(int8 ? 2 * M * nb : 0);
  if (int8) quantize_rows(xp, M, in, qx.data(), xs.data(), isa);
  // the rows ahead on their way from memory while row o is multiplied
  auto prefetch_ahead = [&](int64_t o, int64_t end) {
    if (o + kAhead >= end) return;
    const char* q = reinterpret_cast<const char*>(qp + (o + kAhead) * row_bytes);
    for (int64_t k = 0; k < row_bytes; k += 64) __builtin_prefetch(q + k, 0, 3);
    const char* sc = reinterpret_cast<const char*>(sp + (o + kAhead) * row_scales);
    for (int64_t k = 0; k < 2 * row_scales; k += 64) __builtin_prefetch(sc + k, 0, 3);
  };
  // y[r0 + r, o] for r < mr from acc[r]: + bias, + residual, in that order
  auto finish = [&](int64_t o, int64_t r0, int64_t mr, const float* acc) {
    for (int64_t r = 0; r < mr; ++r) {
      float v = acc[r];
      if (bp) v += bp[o];
      if (rp) v += rp[(r0 + r) * out + o];
      yp[(r0 + r) * out + o] = v;
    }
  };
  if (int8) {
    at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
      float acc[kWideRows];
      for (int64_t o = begin; o < end; ++o) {
        prefetch_ahead(o, end);
        for (int64_t r0 = 0; r0 < M; r0 += chunk) {  // every pass over the row after the first reads it from L1
          const int64_t mr = std::min(chunk, M - r0);
          (mr == chunk || M < chunk ? qfull : qtail)(qp + o * row_bytes, sp + o * row_scales, nb, qx.data() + r0 * in,
                                                     xs.data() + r0 * 2 * nb, in, 2 * nb, acc);
          finish(o, r0, mr, acc);
        }
      }
    });
    return;
  }
  // float32 x: weight rows in tiles of kTile, each tile's rows multiplied by one pass of x's rows after another, so
  // that a pass's x stays in L1 across the tile (and the tile's weights, read from memory in the first pass, stay
  // there for the next). Every (o, r) is still its own loop's sum. (The int8 loops above, whose x is a quarter of
  // the bytes, measured slower in tiles: docs/bench/history.md, 2026-12-07, helper h58.)
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    float acc[kWideRows];
    for (int64_t o0 = begin; o0 < end; o0 += kTile) {
      const int64_t o1 = std::min(end, o0 + kTile);
      for (int64_t r0 = 0; r0 < M; r0 += chunk) {
        const int64_t mr = std::min(chunk, M - r0);
        const DotFn fn = mr == chunk || M < chunk ? full : tail;
        for (int64_t o = o0; o < o1; ++o) {
          if (r0 == 0) prefetch_ahead(o, end);
          fn(qp + o * row_bytes, sp + o * row_scales, nb, xp + r0 * in, in, acc);
          finish(o, r0, mr, acc);
        }
      }
    }
  });
}

// y (M, D) <- rms_norm(x): rms_norm into a given output.
void rms_norm_to(at::Tensor& y, const at::Tensor& x, const at::Tensor& w, double eps) {
  CHECK_VALUE(x.dim() == 2, "x must be (M, D)");
  const int64_t M = x.size(0), D = x.size(1);
  check_f32_matrix(x, "x", M, D);
  check_f32_matrix(y, "y", M, D);
  CHECK_VALUE(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == D, "w must be float32 (", D, ",)");
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // a prefill chunk's rows in parallel; a decode step's few rows cost less than waking a thread
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 16) / D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* r = xp + i * D;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < D; ++j) ss += r[j] * r[j];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
      float* o = yp + i * D;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) o[j] = r[j] * inv * wp[j];
    }
  });
}

// The intermediates of attn_in and mlp_out that never leave them, by role.
enum Temp { kNormed = 0, kResidual1, kGateUp, kHidden, kTemps };
constexpr int64_t kTempRows = 64;  // decode batches; a prefill chunk's few large allocations cost nothing next to it

// An (M, N) float32 buffer for intermediate `role`, reused from call to call on this thread when M is small. A
// decode step's layers would otherwise allocate and free a few small aligned buffers each (posix_memalign,
// which glibc serves through its slow path, under the interpreter lock's serial part of the step).
at::Tensor temp(Temp role, int64_t M, int64_t N) {
  if (M > kTempRows) return at::empty({M, N}, at::TensorOptions().dtype(at::kFloat));
  thread_local at::Tensor buffers[kTemps];
  at::Tensor& b = buffers[role];
  if (!b.defined() || b.numel() < M * N) b = at::empty({kTempRows * N}, at::TensorOptions().dtype(at::kFloat));
  return b.narrow(0, 0, M * N).view({M, N});
}
}  // namespace

at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, int64_t bits,
                        const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                        int64_t isa, int64_t activations) {
  CHECK_VALUE(x.dim() == 2, "x must be (M, in)");
  at::Tensor y = at::empty({x.size(0), qs.size(0)}, x.options());
  block_matmul_to(y, x, qs, scales, bits, bias, residual, isa, activations);
  return y;
}

std::vector<at::Tensor> quantize_activations(const at::Tensor& x, int64_t isa) {
  CHECK_VALUE(isa >= kScalar && isa <= best_isa(), "isa ", isa, " is not available on this CPU (best ", best_isa(), ")");
  CHECK_VALUE(x.dim() == 2, "x must be (M, in)");
  check_f32_matrix(x, "x", -1, x.size(1));
  CHECK_VALUE(x.size(1) % 32 == 0, "in features must be a multiple of 32, got ", x.size(1));
  at::Tensor qx = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor xs = at::empty({x.size(0), x.size(1) / 32, 2}, x.options());
  quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), qx.data_ptr<int8_t>(), xs.data_ptr<float>(), isa);
  return {qx, xs};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  CHECK_VALUE(x.dim() == 2, "x must be (M, D)");
  at::Tensor y = at::empty_like(x);
  rms_norm_to(y, x, w, eps);
  return y;
}

void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1,
              "x must be a float32 (N, heads, d) CPU tensor with unit stride along d");
  const int64_t N = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  CHECK_VALUE(d % 2 == 0, "d must be even, got ", d);
  for (const at::Tensor* t : {&cos, &sin})
    CHECK_VALUE(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == d, "cos and sin must be contiguous float32 (", N, ", ", d, ")");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, N * heads, std::max<int64_t>(1, (1 << 15) / d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / heads;
      float* r = xp + n * s0 + (i % heads) * s1;
      const float* c = cp + n * d;
      const float* s = sp + n * d;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float a = r[j], b = r[j + half];
        r[j] = a * c[j] - b * s[j];
        r[j + half] = b * c[j + half] + a * s[j + half];
      }
    }
  });
}

namespace {
// Values stored per task at least: the keys and values of a decode step's few rows split across the team,
// a single row's (H_kv heads of d, twice) stay on one thread.
constexpr int64_t kStoreGrain = 1 << 10;

// One destination of store_rows: the (R, d) pool's base and dtype, and its float32 source (B, H_kv, T, d).
struct RowStore {
  void* pool;
  at::ScalarType dtype;
  int64_t d;
  const float* src;
  int64_t stride[4];  // src's
};

// x in a pool's T, rounded to nearest even as torch's cast; a float16 pool saturates: beyond its largest finite value
// (65504) the cast would store ±inf, and a key or value of ±inf makes the attention's scores and outputs inf or NaN.
// NaN stays NaN. The same as the torch path's store (runtime/kv_pool.py, to_pool_dtype).
constexpr float kHalfMax = 65504.f;
template <typename T>
inline T to_pool(float x) {
  return static_cast<T>(x);
}
template <>
inline c10::Half to_pool(float x) {
  return c10::Half(std::clamp(x, -kHalfMax, kHalfMax));
}

template <typename T>
void store_row(const RowStore& s, int64_t row, int64_t b, int64_t g, int64_t t) {
  const int64_t d = s.d;
  T* dst = static_cast<T*>(s.pool) + row * d;
  const float* from = s.src + b * s.stride[0] + g * s.stride[1] + t * s.stride[2];
  for (int64_t j = 0; j < d; ++j) dst[j] = to_pool<T>(from[j * s.stride[3]]);
}

// The header's checks of store_rows' arguments -> its RowStore.
RowStore row_store(at::Tensor& pool, const at::Tensor& rows, const at::Tensor& src) {
  CHECK_VALUE(pool.device().is_cpu() && pool.is_contiguous() && pool.dim() == 2, "pool must be a contiguous (R, d) CPU tensor");
  const int64_t R = pool.size(0), d = pool.size(1);
  CHECK_VALUE(src.scalar_type() == at::kFloat && src.dim() == 4 && src.size(3) == d, "src must be float32 (B, H_kv, T, ", d, ")");
  CHECK_VALUE(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 3 &&
                  rows.sizes() == src.sizes().slice(0, 3), "rows must be contiguous int64 ", src.sizes().slice(0, 3));
  const at::ScalarType dt = pool.scalar_type();
  CHECK_VALUE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "pool must be float32, bfloat16 or float16, got ", dt);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i) CHECK_VALUE(rp[i] >= 0 && rp[i] < R, "rows holds ", rp[i], ", outside the pool's ", R);
  return {pool.data_ptr(), dt, d, src.data_ptr<float>(), {src.stride(0), src.stride(1), src.stride(2), src.stride(3)}};
}
}  // namespace

// k_pool[rows] <- k and v_pool[rows] <- v: every (pool, row) one item of a single parallel loop (each row's values
// are converted alone, so the split changes no bit).
void store_kv(at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& rows, const at::Tensor& k, const at::Tensor& v) {
  for (at::Tensor* pool : {&k_pool, &v_pool})
    CHECK_VALUE(pool->device().is_cpu() && pool->is_contiguous() && pool->dim() >= 2,
                "k_pool and v_pool must be contiguous CPU tensors whose last dim is the head dim");
  at::Tensor kf = k_pool.view({-1, k_pool.size(-1)}), vf = v_pool.view({-1, v_pool.size(-1)});
  const RowStore stores[2] = {row_store(kf, rows, k), row_store(vf, rows, v)};
  const int64_t n = rows.numel(), G = rows.size(1), Tn = rows.size(2);
  const int64_t* rp = rows.data_ptr<int64_t>();
  at::parallel_for(0, 2 * n, std::max<int64_t>(1, kStoreGrain / kf.size(1)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const RowStore& s = stores[i / n];
      const int64_t f = i % n, b = f / (G * Tn), g = f / Tn % G, t = f % Tn;
      switch (s.dtype) {
        case at::kFloat: store_row<float>(s, rp[f], b, g, t); break;
        case at::kBFloat16: store_row<c10::BFloat16>(s, rp[f], b, g, t); break;
        default: store_row<c10::Half>(s, rp[f], b, g, t);
      }
    }
  });
}

namespace {
// Outputs of swiglu per task at least: one row of a decode step (F = 1536: an exp each) stays on its thread,
// where waking another would cost about what it saves; a batch of rows is split.
constexpr int64_t kSwigluGrain = 1 << 12;

// y (M, F) <- swiglu(gu): swiglu into a given output.
void swiglu_to(at::Tensor& y, const at::Tensor& gu) {
  CHECK_VALUE(gu.dim() == 2 && gu.size(1) % 2 == 0, "gu must be (M, 2F)");
  const int64_t M = gu.size(0), F = gu.size(1) / 2;
  check_f32_matrix(gu, "gu", M, 2 * F);
  check_f32_matrix(y, "y", M, F);
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // over the M F outputs, not the rows: a decode step's few rows split across the team by columns too (each
  // output's arithmetic is its own, so the split changes no bit)
  at::parallel_for(0, M * F, kSwigluGrain, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end;) {
      const int64_t i = k / F, j0 = k % F, j1 = std::min(F, j0 + end - k);
      const float* g = gp + i * 2 * F;
      const float* u = g + F;
      float* o = yp + i * F;
      for (int64_t j = j0; j < j1; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
      k += j1 - j0;
    }
  });
}
}  // namespace

at::Tensor swiglu(const at::Tensor& gu) {
  CHECK_VALUE(gu.dim() == 2 && gu.size(1) % 2 == 0, "gu must be (M, 2F)");
  at::Tensor y = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  swiglu_to(y, gu);
  return y;
}

// out (1, N, H, d) <- for each segment i, rows a = offsets[i] .. a + lengths[i] - 1 of the token axis: causal attention
// of those rows of q (1, H, N, d) over the same rows of k, v (1, H_kv, N, d) alone (torch's
// scaled_dot_product_attention with GQA and ``scale``), written at out's rows a ..; the segments spread over the team,
// one SDPA call per segment on its thread (inside the team's region torch's kernel runs on that thread, and each
// (head, query block) of its result is computed alone, so the thread changes no bit).
void causal_attention_segments_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::vector<int64_t>& offsets, const std::vector<int64_t>& lengths,
                                double scale) {
  CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1 && k.sizes() == v.sizes() &&
                  k.size(0) == 1 && k.size(2) == q.size(2) && k.size(3) == q.size(3) && q.size(1) % k.size(1) == 0,
              "q must be (1, H, N, d) and k, v (1, H_kv, N, d) with H a multiple of H_kv, got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  const int64_t N = q.size(2);
  CHECK_VALUE(out.dim() == 4 && out.size(0) == 1 && out.size(1) == N && out.size(2) == q.size(1) &&
                  out.size(3) == q.size(3) && out.scalar_type() == q.scalar_type(),
              "out must be (1, N, H, d) in q's dtype, got ", out.sizes());
  CHECK_VALUE(offsets.size() == lengths.size(), "offsets and lengths must be as long");
  for (size_t i = 0; i < offsets.size(); ++i)
    CHECK_VALUE(offsets[i] >= 0 && lengths[i] > 0 && offsets[i] + lengths[i] <= N, "segment ", i, " (", offsets[i],
                ", ", lengths[i], ") is outside the ", N, " rows");
  const bool gqa = q.size(1) != k.size(1);
  at::parallel_for(0, static_cast<int64_t>(offsets.size()), 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode inference;  // the team's threads do not inherit the caller's mode
    for (int64_t i = begin; i < end; ++i) {
      const int64_t a = offsets[i], T = lengths[i];
      const at::Tensor o = at::scaled_dot_product_attention(q.narrow(2, a, T), k.narrow(2, a, T), v.narrow(2, a, T),
                                                            c10::nullopt, 0.0, true, scale, gqa);  // (1, H, T, d)
      out.narrow(1, a, T).copy_(o.transpose(1, 2));
    }
  });
}

// y (M, out) = x (M, in) W^T for W held in oneDNN's packed layout (torch's mkldnn::_reorder_linear_weight): the rows
// of x cut into one part per thread of the team (part p: rows M p / P .. M (p + 1) / P - 1), each part one call of
// torch's mkldnn::_linear_pointwise on its thread. Inside the team's region oneDNN runs each call on its own
// thread, so the team always splits the product, which oneDNN's own threading does not for some shapes (a
// prefill's o and down products, whose one call ran on one thread). Each part's rows are that call's result.
at::Tensor packed_linear_rows(const at::Tensor& x, const at::Tensor& w) {
  CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && w.is_mkldnn() && w.dim() == 2 &&
                  x.size(1) == w.size(1) && x.scalar_type() == w.scalar_type(),
              "x must be a contiguous (M, in) CPU tensor and w a packed (out, in) weight of x's dtype, got x ",
              x.sizes(), " ", x.scalar_type(), " and w ", w.sizes(), " ", w.scalar_type());
  using Scalars = c10::List<c10::optional<at::Scalar>>;
  using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, c10::string_view,
                            Scalars, c10::optional<c10::string_view>);
  static const auto linear =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<Linear>();
  const int64_t M = x.size(0), parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), M));
  at::Tensor y = at::empty({M, w.size(0)}, x.options());
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode inference;  // the team's threads do not inherit the caller's mode: no version counters
    for (int64_t p = begin; p < end; ++p) {
      const int64_t a = M * p / parts, b = M * (p + 1) / parts;
      // (b - a, out): oneDNN on this thread alone inside the team's region
      const at::Tensor part = linear.call(x.narrow(0, a, b - a), w, c10::nullopt, "none", Scalars(), "");
      y.narrow(0, a, b - a).copy_(part);
    }
  });
  return y;
}

void attn_in_to(at::Tensor& y, const at::Tensor& x, const at::Tensor& w_attn, double eps, const at::Tensor& qs,
                const at::Tensor& scales, int64_t bits, const c10::optional<at::Tensor>& bias, const at::Tensor& cos,
                const at::Tensor& sin, int64_t rot_heads, int64_t d, int64_t isa, int64_t activations) {
  CHECK_VALUE(d > 0 && rot_heads >= 0 && qs.size(0) % d == 0 && rot_heads * d <= qs.size(0),
              "rot_heads (", rot_heads, ") heads of d (", d, ") values must fit in the ", qs.size(0), " outputs");
  CHECK_VALUE(x.dim() == 2, "x must be (M, D)");
  at::Tensor normed = temp(kNormed, x.size(0), x.size(1));
  rms_norm_to(normed, x, w_attn, eps);
  block_matmul_to(y, normed, qs, scales, bits, bias, c10::nullopt, isa, activations);  // (M, out)
  at::Tensor heads = y.view({y.size(0), qs.size(0) / d, d}).narrow(1, 0, rot_heads);
  rope_(heads, cos, sin);
}

at::Tensor attn_in(const at::Tensor& x, const at::Tensor& w_attn, double eps, const at::Tensor& qs,
                   const at::Tensor& scales, int64_t bits, const c10::optional<at::Tensor>& bias, const at::Tensor& cos,
                   const at::Tensor& sin, int64_t rot_heads, int64_t d, int64_t isa, int64_t activations) {
  CHECK_VALUE(x.dim() == 2, "x must be (M, D)");
  at::Tensor y = at::empty({x.size(0), qs.size(0)}, x.options());
  attn_in_to(y, x, w_attn, eps, qs, scales, bits, bias, cos, sin, rot_heads, d, isa, activations);
  return y;
}

void mlp_out_to(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& o_qs,
                const at::Tensor& o_scales, int64_t o_bits, const c10::optional<at::Tensor>& o_bias,
                const at::Tensor& w_mlp, double eps, const at::Tensor& gu_qs, const at::Tensor& gu_scales,
                int64_t gu_bits, const c10::optional<at::Tensor>& gu_bias, const at::Tensor& dn_qs,
                const at::Tensor& dn_scales, int64_t dn_bits, const c10::optional<at::Tensor>& dn_bias, int64_t isa,
                int64_t activations) {
  CHECK_VALUE(x.dim() == 2 && a.dim() == 2 && a.size(0) == x.size(0), "x must be (M, D) and a (M, H d)");
  check_f32_matrix(x, "x", -1, x.size(1));
  check_f32_matrix(a, "a", x.size(0), a.size(1));
  const int64_t M = x.size(0), D = x.size(1), F2 = gu_qs.size(0);
  at::Tensor x1 = temp(kResidual1, M, D), normed = temp(kNormed, M, D), gu = temp(kGateUp, M, F2),
             hidden = temp(kHidden, M, F2 / 2);
  block_matmul_to(x1, a, o_qs, o_scales, o_bits, o_bias, x, isa, activations);  // (M, D): x + a W_o^T
  rms_norm_to(normed, x1, w_mlp, eps);
  block_matmul_to(gu, normed, gu_qs, gu_scales, gu_bits, gu_bias, c10::nullopt, isa, activations);  // (M, 2F)
  swiglu_to(hidden, gu);
  block_matmul_to(y, hidden, dn_qs, dn_scales, dn_bits, dn_bias, x1, isa, activations);  // (M, D)
}

at::Tensor mlp_out(const at::Tensor& x, const at::Tensor& a, const at::Tensor& o_qs, const at::Tensor& o_scales,
                   int64_t o_bits, const c10::optional<at::Tensor>& o_bias, const at::Tensor& w_mlp, double eps,
                   const at::Tensor& gu_qs, const at::Tensor& gu_scales, int64_t gu_bits,
                   const c10::optional<at::Tensor>& gu_bias, const at::Tensor& dn_qs, const at::Tensor& dn_scales,
                   int64_t dn_bits, const c10::optional<at::Tensor>& dn_bias, int64_t isa, int64_t activations) {
  CHECK_VALUE(x.dim() == 2, "x must be (M, D)");
  at::Tensor y = at::empty({x.size(0), dn_qs.size(0)}, x.options());
  mlp_out_to(y, x, a, o_qs, o_scales, o_bits, o_bias, w_mlp, eps, gu_qs, gu_scales, gu_bits, gu_bias, dn_qs, dn_scales,
             dn_bits, dn_bias, isa, activations);
  return y;
}
