// The float32 multiply-add rate one core sustains with AVX-512, the compute floor of the block products with
// float32 activations (decoder_ops.cpp): every weight meets every row of x in one FMA lane, so M rows of a
// step cost at least M x (the step's multiply-adds) / this rate, however the weights are widened.
//
//   g++ -O3 bench/fma_floor.cpp -o /tmp/fma_floor && /tmp/fma_floor
//
// Times on the thread's CPU clock (CLOCK_THREAD_CPUTIME_ID), which a loaded machine's other work inflates
// less than wall time, the best of five rounds of:
//   registers   16 independent accumulators, both operands in registers: the FMA units' peak
//   x from L1   the block loops' inner pattern: 16 accumulators (8 rows x 2), two weight registers, each FMA
//               with its own 64-byte load of x from an L1-resident (8, 576) buffer
//   x shared    4 rows x 2 weight rows: 16 accumulators, four weight registers, each load of x feeding two FMAs
//               (what a loop over two weight rows at once would do)
// and prints G multiply-adds/s and what a decode step's products (``--macs`` per row, bench.block_products'
// step_macs for SmolLM2-135M: 134,479,872) would cost at 1 and 8 rows at that rate.
// Not part of the test suite: a measurement that bounds what batching can gain (docs/bench/history.md).

#include <immintrin.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {
double cpu_now() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

__attribute__((target("avx512f"), noinline)) float registers(long n) {
  __m512 a[16], w0 = _mm512_set1_ps(1.0000001f), w1 = _mm512_set1_ps(0.9999999f);
  for (int k = 0; k < 16; ++k) a[k] = _mm512_set1_ps(static_cast<float>(k));
  for (long i = 0; i < n; ++i) {
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) a[k] = _mm512_fmadd_ps(k & 1 ? w1 : w0, a[k], w0);
  }
  __m512 s = a[0];
  for (int k = 1; k < 16; ++k) s = _mm512_add_ps(s, a[k]);
  return _mm512_reduce_add_ps(s);
}

// 8 rows of x (576 floats each), blocks of 32 in turn: per block 16 FMAs, 16 loads of x
__attribute__((target("avx512f"), noinline)) float x_from_l1(const float* x, long n) {
  __m512 a[8][2];
  for (int r = 0; r < 8; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  const __m512 w0 = _mm512_set1_ps(0.5f), w1 = _mm512_set1_ps(0.25f);
  for (long i = 0; i < n; ++i)
    for (int b = 0; b < 18; ++b)
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) {
        const float* xr = x + r * 576 + 32 * b;
        a[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), a[r][0]);
        a[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), a[r][1]);
      }
  __m512 s = _mm512_setzero_ps();
  for (int r = 0; r < 8; ++r) s = _mm512_add_ps(s, _mm512_add_ps(a[r][0], a[r][1]));
  return _mm512_reduce_add_ps(s);
}

// 4 rows of x, two weight rows at once: per block 16 FMAs, 8 loads of x (each feeds both weight rows)
__attribute__((target("avx512f"), noinline)) float x_shared(const float* x, long n) {
  __m512 a[4][2][2];
  for (int r = 0; r < 4; ++r)
    for (int o = 0; o < 2; ++o) a[r][o][0] = a[r][o][1] = _mm512_setzero_ps();
  const __m512 w[2][2] = {{_mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f)}, {_mm512_set1_ps(0.125f), _mm512_set1_ps(2.f)}};
  for (long i = 0; i < n; ++i)
    for (int b = 0; b < 18; ++b)
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        __m512 x0 = _mm512_loadu_ps(x + r * 576 + 32 * b), x1 = _mm512_loadu_ps(x + r * 576 + 32 * b + 16);
        __asm__("" : "+v"(x0), "+v"(x1));  // one load each, not folded into both FMAs
#pragma GCC unroll 2
        for (int o = 0; o < 2; ++o) {
          a[r][o][0] = _mm512_fmadd_ps(w[o][0], x0, a[r][o][0]);
          a[r][o][1] = _mm512_fmadd_ps(w[o][1], x1, a[r][o][1]);
        }
      }
  __m512 s = _mm512_setzero_ps();
  for (int r = 0; r < 4; ++r)
    for (int o = 0; o < 2; ++o) s = _mm512_add_ps(s, _mm512_add_ps(a[r][o][0], a[r][o][1]));
  return _mm512_reduce_add_ps(s);
}
}  // namespace

int main(int argc, char** argv) {
  double macs = 134479872;
  for (int i = 1; i + 1 < argc; ++i)
    if (!std::strcmp(argv[i], "--macs")) macs = std::atof(argv[i + 1]);
  static float x[8 * 576];
  for (int i = 0; i < 8 * 576; ++i) x[i] = 1e-3f * (i % 97);
  const long n_reg = 20000000, n_l1 = 200000;
  double best_reg = 1e9, best_l1 = 1e9, best_shared = 1e9;
  volatile float sink = 0;
  for (int round = 0; round < 5; ++round) {
    double t = cpu_now();
    sink = sink + registers(n_reg);
    best_reg = std::min(best_reg, cpu_now() - t);
    t = cpu_now();
    sink = sink + x_from_l1(x, n_l1);
    best_l1 = std::min(best_l1, cpu_now() - t);
    t = cpu_now();
    sink = sink + x_shared(x, n_l1);
    best_shared = std::min(best_shared, cpu_now() - t);
  }
  const double reg = 16.0 * 16 * n_reg / best_reg, l1 = 18.0 * 16 * 16 * n_l1 / best_l1;
  std::printf("registers:  %.1f G multiply-adds/s; a step's products at 1 row >= %.2f ms, 8 rows >= %.2f ms\n",
              reg / 1e9, 1e3 * macs / reg, 8e3 * macs / reg);
  std::printf("x from L1:  %.1f G multiply-adds/s; a step's products at 1 row >= %.2f ms, 8 rows >= %.2f ms\n",
              l1 / 1e9, 1e3 * macs / l1, 8e3 * macs / l1);
  const double shared = 18.0 * 16 * 16 * n_l1 / best_shared;
  std::printf("x shared:   %.1f G multiply-adds/s; a step's products at 1 row >= %.2f ms, 8 rows >= %.2f ms\n",
              shared / 1e9, 1e3 * macs / shared, 8e3 * macs / shared);
  return 0;
}
