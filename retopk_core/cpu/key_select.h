// The kernel's Top-K cuts (retopk_cpu.cpp: the exact pass's keep_best and admit_tile, the reuse path's keep_topk) on
// 64-bit keys: std::nth_element's permutation, without the comparator's unpredictable branches on (score, position)
// pairs.
//
// Why the same permutation matters: the order the cuts leave the kept entries in is the order attend sums their
// softmax weights and value rows in, so another order changes the output's bits. The kept *set* would be the
// same under any selection algorithm; the order is libstdc++'s __introselect's, reproduced here step by step
// (median of three, Hoare partition, heap select past the depth limit). With another standard library the
// keys go through its own std::nth_element, which orders them as it orders the pairs.
//
// Key: key(a) > key(b) exactly when Better(a, b) (higher score, then lower position), for scores that are not NaN
// and positions below 2^32: the score's bits made monotone above the position's complement. Two comparisons of
// keys, each a pair comparison's stand-in (same answer on every pair of entries, so the same permutation):
// - KeyGreater, the whole key: Better (the exact pass; no two entries tie);
// - ScoreGreater, the key's upper half: the scores alone (the reuse path's cut), ties where two scores are equal
//   (±0 included), which libstdc++'s partition treats its own way: its scans stop at entries equal to the pivot.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// kDistinct: no two entries compare equal (the partition then needs one comparison per entry).
struct KeyGreater {  // Better(a, b) on the keys' entries
  static constexpr bool kDistinct = true;
  bool operator()(uint64_t a, uint64_t b) const { return a > b; }
};
struct ScoreGreater {  // a.score > b.score on the keys' entries
  static constexpr bool kDistinct = false;
  bool operator()(uint64_t a, uint64_t b) const { return (a >> 32) > (b >> 32); }
};

#if defined(__GLIBCXX__)
// libstdc++'s __unguarded_partition(lo, hi, pivot) under gt: its left scan stops at each entry not above the
// pivot, its right scan at each entry not below it (an entry equal to the pivot stops both), and it swaps the
// k-th stop from the left with the k-th from the right while the left one lies before the right one. Until the
// scans cross they read entries no swap has touched, so the stops are those of the entries as given: the
// ascending lists lo_stop (not above) and hi_stop (not below), written in one pass without a branch (each index
// goes to both, each count advances by its test). After s swaps the left scan's next stop is lo_stop[s], or the
// last swap's right position (which now holds an entry not above) if that comes first; that is the cut. With no
// ties the cut is lo + (the count above the pivot). lo_stop, hi_stop: scratch of hi - lo entries each.
template <typename Gt>
RETOPK_SELECT_INLINE uint64_t* partition_keys(uint64_t* lo, uint64_t* hi, uint64_t pivot, int32_t* lo_stop,
                                              int32_t* hi_stop, Gt gt) {
  const int32_t n = static_cast<int32_t>(hi - lo);
  int32_t nl = 0, nh = 0;
  for (int32_t i = 0; i < n; ++i) {
    const bool above = gt(lo[i], pivot);
    lo_stop[nl] = i;
    hi_stop[nh] = i;
    nl += !above;
    nh += Gt::kDistinct ? above : !gt(pivot, lo[i]);  // the pivot's own entry lies outside [lo, hi)
  }
  int32_t s = 0;
  if constexpr (Gt::kDistinct) {  // the nh entries above the pivot end in [lo, lo + nh), the rest after
    for (; s < nl && lo_stop[s] < nh; ++s) std::swap(lo[lo_stop[s]], lo[hi_stop[nh - 1 - s]]);
    return lo + nh;
  }
  for (; s < nl && s < nh && lo_stop[s] < hi_stop[nh - 1 - s]; ++s) std::swap(lo[lo_stop[s]], lo[hi_stop[nh - 1 - s]]);
  const int32_t right = s > 0 ? hi_stop[nh - s] : n;  // the last swap's right position
  return lo + (s < nl ? std::min(lo_stop[s], right) : right);
}

// libstdc++'s __move_median_to_first(result, a, b, c) under gt.
template <typename Gt>
RETOPK_SELECT_INLINE void median_to_first(uint64_t* result, uint64_t* a, uint64_t* b, uint64_t* c, Gt gt) {
  if (gt(*a, *b)) {
    if (gt(*b, *c)) std::swap(*result, *b);
    else if (gt(*a, *c)) std::swap(*result, *c);
    else std::swap(*result, *a);
  } else if (gt(*a, *c)) std::swap(*result, *a);
  else if (gt(*b, *c)) std::swap(*result, *c);
  else std::swap(*result, *b);
}

// libstdc++'s __heap_select(first, middle, last) under gt through the public heap functions: its
// __pop_heap(first, middle, i) (*first to *i, the old *i sifted into the heap) is pop_heap over
// [first, middle + 1) with *i parked at *middle.
template <typename Gt>
inline void heap_select_keys(uint64_t* first, uint64_t* middle, uint64_t* last, Gt gt) {
  std::make_heap(first, middle, gt);
  for (uint64_t* i = middle; i < last; ++i)
    if (gt(*i, *first)) {
      std::swap(*middle, *i);
      std::pop_heap(first, middle + 1, gt);
      std::swap(*middle, *i);
    }
}

// libstdc++'s __introselect(first, nth, last, depth, gt): while more than 3 keys remain, a median-of-three
// partition (or, at depth 0, a heap select), then an insertion sort of the rest (std::sort of at most 3 entries
// is libstdc++'s __insertion_sort, so ties keep its order).
template <typename Gt = KeyGreater>
inline void introselect_keys(uint64_t* first, uint64_t* nth, uint64_t* last, int64_t depth, int32_t* lo_stop,
                             int32_t* hi_stop, Gt gt = {}) {
  while (last - first > 3) {
    if (depth == 0) {
      heap_select_keys(first, nth + 1, last, gt);
      std::swap(*first, *nth);
      return;
    }
    --depth;
    median_to_first(first, first + 1, first + (last - first) / 2, last - 1, gt);
    uint64_t* cut = partition_keys(first + 1, last, *first, lo_stop, hi_stop, gt);
    if (cut <= nth) first = cut;
    else last = cut;
  }
  std::sort(first, last, gt);
}
#endif

// std::nth_element(first, nth, last, gt): the same permutation, ties (ScoreGreater's) included.
// lo_stop, hi_stop: scratch of last - first entries each (unused but for libstdc++).
template <typename Gt = KeyGreater>
inline void nth_element_keys(uint64_t* first, uint64_t* nth, uint64_t* last, int32_t* lo_stop, int32_t* hi_stop,
                             Gt gt = {}) {
#if defined(__GLIBCXX__)
  if (first == last || nth == last) return;
  const int64_t lg = 63 - __builtin_clzll(static_cast<unsigned long long>(last - first));  // std::__lg
  introselect_keys(first, nth, last, 2 * lg, lo_stop, hi_stop, gt);
#else
  (void)lo_stop;
  (void)hi_stop;
  std::nth_element(first, nth, last, gt);
#endif
}

// Better's keys of n entries (score_at(i), pos_at(i)) into keys; false where an entry has none (a NaN score, a
// position outside [0, 2^32)): the caller then cuts the pairs.
template <typename ScoreAt, typename PosAt>
RETOPK_SELECT_INLINE bool fill_keys(int64_t n, ScoreAt score_at, PosAt pos_at, uint64_t* keys) {
  bool keyed = true;
  for (int64_t i = 0; i < n; ++i) {
    const float s = score_at(i);
    const int64_t pos = pos_at(i);
    keyed &= !std::isnan(s) && static_cast<uint64_t>(pos) <= 0xFFFFFFFFu;
    keys[i] = better_key(s, pos);
  }
  return keyed;
}

// The k best (0 < k < n) of n entries (score[i], pos[i]) by the scores alone: keys[0 .. k) in the order
// std::nth_element(.., nth = k - 1, ..) leaves the pairs in under a.score > b.score (ScoreGreater), ties
// included: not Better's lower position first, but where libstdc++'s partition leaves equal scores. False, keys
// not cut, where an entry has no key (fill_keys). keys, lo_stop, hi_stop: scratch of n entries.
inline bool top_keys_by_score(const float* score, const int64_t* pos, int64_t n, int64_t k, uint64_t* keys,
                              int32_t* lo_stop, int32_t* hi_stop) {
  if (!fill_keys(n, [&](int64_t i) { return score[i]; }, [&](int64_t i) { return pos[i]; }, keys)) return false;
  nth_element_keys(keys, keys + (k - 1), keys + n, lo_stop, hi_stop, ScoreGreater{});
  return true;
}

#undef RETOPK_SELECT_INLINE

}  // namespace retopk_select
