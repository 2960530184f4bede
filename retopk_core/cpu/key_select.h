// The exact pass's Top-K cuts (retopk_cpu.cpp: keep_best) on 64-bit keys: std::nth_element under Better, the same
// permutation, without the comparator's unpredictable branches on (score, position) pairs.
//
// Why the same permutation matters: the order the cuts leave the kept entries in is the order attend sums their
// softmax weights and value rows in, so another order changes the output's bits. The kept *set* would be the
// same under any selection algorithm; the order is libstdc++'s __introselect's, reproduced here step by step
// (median of three, Hoare partition, heap select past the depth limit). With another standard library the
// keys go through its own std::nth_element, which orders them as it orders the pairs.
//
// Key: key(a) > key(b) exactly when Better(a, b) (higher score, then lower position), for scores that are not NaN
// and positions below 2^32: the score's bits made monotone above the position's complement.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <utility>

namespace retopk_select {

#define RETOPK_SELECT_INLINE inline __attribute__((always_inline))

// (score, position) -> key. -0 counts as +0 (Better ties them); NaN has no key (Better leaves it unordered).
RETOPK_SELECT_INLINE uint64_t better_key(float score, int64_t pos) {
  score += 0.f;  // -0 -> +0
  uint32_t u;
  std::memcpy(&u, &score, sizeof u);
  u = (u & 0x80000000u) != 0 ? ~u : u | 0x80000000u;  // negatives reversed, below the rest
  return static_cast<uint64_t>(u) << 32 | (0xFFFFFFFFu - static_cast<uint32_t>(pos));
}
RETOPK_SELECT_INLINE float key_score(uint64_t key) {  // the score (+0 for -0)
  uint32_t u = static_cast<uint32_t>(key >> 32);
  u = (u & 0x80000000u) != 0 ? u & 0x7FFFFFFFu : ~u;
  float s;
  std::memcpy(&s, &u, sizeof s);
  return s;
}
RETOPK_SELECT_INLINE int64_t key_pos(uint64_t key) { return 0xFFFFFFFFu - static_cast<uint32_t>(key); }

#if defined(__GLIBCXX__)
// libstdc++'s __unguarded_partition(lo, hi, pivot) under greater, for distinct keys: its left scan stops at each
// key below the pivot, its right scan at each key above it, and it swaps the k-th stop from the left with the
// k-th from the right until they cross. With distinct keys that is: nb keys lie above the pivot, the k-th key
// below it among lo[0 .. nb) (left to right) trades places with the k-th key above it among lo[nb .. n) (right
// to left), and the cut is lo + nb. The two index lists are written without branches (each index goes to both,
// one count advances). up, down: scratch of hi - lo entries each.
RETOPK_SELECT_INLINE uint64_t* partition_keys(uint64_t* lo, uint64_t* hi, uint64_t pivot, int32_t* up, int32_t* down) {
  const int32_t n = static_cast<int32_t>(hi - lo);
  int32_t nu = 0, nd = 0;
  for (int32_t i = 0; i < n; ++i) {
    const bool above = lo[i] > pivot;
    up[nu] = i;
    down[nd] = i;
    nu += above;
    nd += !above;
  }
  for (int32_t k = 0; k < nd && down[k] < nu; ++k) std::swap(lo[down[k]], lo[up[nu - 1 - k]]);
  return lo + nu;
}

// libstdc++'s __move_median_to_first(result, a, b, c) under greater.
RETOPK_SELECT_INLINE void median_to_first(uint64_t* result, uint64_t* a, uint64_t* b, uint64_t* c) {
  if (*a > *b) {
    if (*b > *c) std::swap(*result, *b);
    else if (*a > *c) std::swap(*result, *c);
    else std::swap(*result, *a);
  } else if (*a > *c) std::swap(*result, *a);
  else if (*b > *c) std::swap(*result, *c);
  else std::swap(*result, *b);
}

// libstdc++'s __heap_select(first, middle, last) under greater through the public heap functions: its
// __pop_heap(first, middle, i) (*first to *i, the old *i sifted into the heap) is pop_heap over
// [first, middle + 1) with *i parked at *middle.
inline void heap_select_keys(uint64_t* first, uint64_t* middle, uint64_t* last) {
  const std::greater<uint64_t> gt;
  std::make_heap(first, middle, gt);
  for (uint64_t* i = middle; i < last; ++i)
    if (*i > *first) {
      std::swap(*middle, *i);
      std::pop_heap(first, middle + 1, gt);
      std::swap(*middle, *i);
    }
}

// libstdc++'s __introselect(first, nth, last, depth, greater): while more than 3 keys remain, a median-of-three
// partition (or, at depth 0, a heap select), then an insertion sort of the rest (any sort: distinct keys have one
// sorted order).
inline void introselect_keys(uint64_t* first, uint64_t* nth, uint64_t* last, int64_t depth, int32_t* up,
                             int32_t* down) {
  while (last - first > 3) {
    if (depth == 0) {
      heap_select_keys(first, nth + 1, last);
      std::swap(*first, *nth);
      return;
    }
    --depth;
    median_to_first(first, first + 1, first + (last - first) / 2, last - 1);
    uint64_t* cut = partition_keys(first + 1, last, *first, up, down);
    if (cut <= nth) first = cut;
    else last = cut;
  }
  std::sort(first, last, std::greater<uint64_t>());
}
#endif

// std::nth_element(first, nth, last, std::greater<uint64_t>()) for distinct keys: the same permutation.
// up, down: scratch of last - first entries each (unused but for libstdc++).
inline void nth_element_keys(uint64_t* first, uint64_t* nth, uint64_t* last, int32_t* up, int32_t* down) {
#if defined(__GLIBCXX__)
  if (first == last || nth == last) return;
  const int64_t lg = 63 - __builtin_clzll(static_cast<unsigned long long>(last - first));  // std::__lg
  introselect_keys(first, nth, last, 2 * lg, up, down);
#else
  (void)up;
  (void)down;
  std::nth_element(first, nth, last, std::greater<uint64_t>());
#endif
}

#undef RETOPK_SELECT_INLINE

}  // namespace retopk_select
