// How fast one core streams the exact pass's keys, by the order the dot products load them.
//
//   g++ -O3 -mavx2 -mfma bench/cpu_read_order.cpp -o /tmp/cpu_read_order && taskset -c 1 /tmp/cpu_read_order
//
// A 256 MB float32 key array (rows of d = 128, huge pages asked for), one query, q · k_i for every row,
// three rounds of each loop in turn:
//   interleaved  four rows at a time, chunk outer and rows inner: loads jump 512 B back and forth
//                within each 2 KiB (the fused CPU kernel's exact pass before commit d6fc643)
//   in order     the same four rows one after the other, two accumulators each (the kernel now)
//   in order + prefetch N  the same with a software prefetch N bytes ahead of each row
// Prints GB/s of keys. Not part of the test suite: a measurement that backs retopk_cpu.cpp's loop order.

#include <immintrin.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {
constexpr long kD = 128;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

__attribute__((noinline)) void interleaved(const float* q, const float* k, long n, float* out) {
  for (long j = 0; j < n; j += 4) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float* r = k + j * kD;
    for (long c = 0; c < kD; c += 8) {
      const __m256 x = _mm256_loadu_ps(q + c);
      a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(r + c), a0);
      a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(r + kD + c), a1);
      a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(r + 2 * kD + c), a2);
      a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(r + 3 * kD + c), a3);
    }
    const __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    out[j / 4 % 1024] = s[0];
  }
}

template <int kAhead>
__attribute__((noinline)) void in_order(const float* q, const float* k, long n, float* out) {
  for (long j = 0; j < n; j += 4) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      const float* r = k + (j + i) * kD;
      if (kAhead)
        for (int b = 0; b < kD * 4; b += 64) _mm_prefetch(reinterpret_cast<const char*>(r) + kAhead + b, _MM_HINT_T0);
      __m256 a = _mm256_setzero_ps(), b = a;
      for (long c = 0; c < kD; c += 16) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(r + c), a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8), _mm256_loadu_ps(r + c + 8), b);
      }
      acc = _mm256_add_ps(acc, _mm256_add_ps(a, b));
    }
    out[j / 4 % 1024] = acc[0];
  }
}
}  // namespace

int main() {
  const long rows = 512 * 1024;  // x 512 B = 256 MB, far beyond the caches
  const size_t bytes = rows * kD * sizeof(float);
  float* k = static_cast<float*>(aligned_alloc(2 << 20, bytes));
  madvise(k, bytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < bytes / sizeof(float); ++i) k[i] = static_cast<float>(i % 1000) * 1e-3f;
  float q[kD], out[1024];
  for (long i = 0; i < kD; ++i) q[i] = 1e-3f * static_cast<float>(i);
  struct Loop { const char* name; void (*f)(const float*, const float*, long, float*); };
  const Loop loops[] = {{"interleaved", interleaved}, {"in order", in_order<0>},
                        {"in order + prefetch 1024", in_order<1024>}, {"in order + prefetch 4096", in_order<4096>}};
  for (int round = 0; round < 3; ++round)
    for (const Loop& l : loops) {
      const double t = now();
      l.f(q, k, rows, out);
      std::printf("round %d  %-26s %6.2f GB/s  (%g)\n", round, l.name, bytes / (now() - t) / 1e9, out[7]);
    }
  free(k);
}
