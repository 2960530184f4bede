// Driver of tests/core/test_key_select.py: retopk_core/cpu/key_select.h against the standard library it stands in
// for. On random (score, position) entries (normal scores, many ties, ±0 and ±inf, structured runs) of 1 to
// 3000 entries: key order = Better's order; key_score / key_pos give the entry back (-0 as +0); and
// nth_element_keys leaves the keys in the permutation std::nth_element leaves the pairs in, at every nth, under
// each comparison the kernel cuts by: Better (KeyGreater: the exact pass) and the scores alone (ScoreGreater:
// the reuse path, GreaterScore on the pairs, equal scores included), and top_keys_by_score keeps the same k.
// Where no two scores are equal the two comparisons leave the same permutation. With libstdc++ also past the depth
// limit (heap select): introselect_keys with a depth of 0 to 3 against std::__introselect with the same. A NaN
// score has no key (top_keys_by_score answers false). Prints "<t> score cuts with tied scores" then "<cases>
// cases, <n> differ"; exit 1 when any differs.
#include "key_select.h"

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

using Scored = std::pair<float, int64_t>;
struct Better {  // retopk_cpu.cpp's
  bool operator()(const Scored& a, const Scored& b) const {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  }
};

struct GreaterScore {  // retopk_cpu.cpp's
  bool operator()(const Scored& a, const Scored& b) const { return a.first > b.first; }
};

// std::nth_element (or, at depth >= 0, std::__introselect with that depth) of the pairs under comp, and
// nth_element_keys (introselect_keys) of their keys under gt: whether the keys give back the pairs' permutation.
template <typename Comp, typename Gt>
bool same_cut(const std::vector<Scored>& a, int k, int depth, Comp comp, Gt gt, std::vector<uint64_t>& keys,
              std::vector<int32_t>& up, std::vector<int32_t>& down) {
  using namespace retopk_select;
  const int n = static_cast<int>(a.size());
  std::vector<Scored> ref = a;
  keys.resize(n);
  for (int i = 0; i < n; ++i) keys[i] = better_key(a[i].first, a[i].second);
#if defined(__GLIBCXX__)
  if (depth >= 0) {
    std::__introselect(ref.begin(), ref.begin() + (k - 1), ref.end(), depth, __gnu_cxx::__ops::__iter_comp_iter(comp));
    introselect_keys(keys.data(), keys.data() + (k - 1), keys.data() + n, depth, up.data(), down.data(), gt);
  } else
#endif
  {
    (void)depth;
    std::nth_element(ref.begin(), ref.begin() + (k - 1), ref.end(), comp);
    nth_element_keys(keys.data(), keys.data() + (k - 1), keys.data() + n, up.data(), down.data(), gt);
  }
  bool ok = true;
  for (int i = 0; i < n; ++i) ok &= key_pos(keys[i]) == ref[i].second && key_score(keys[i]) == ref[i].first;
  return ok;
}

const float kSpecial[] = {-0.f, 0.f, -0.f, 0.f, INFINITY, -INFINITY, -1e30f, 1.f};  // ties of ±0, infinities

int main() {
  using namespace retopk_select;
  std::mt19937_64 rng(1);
  long cases = 0, bad = 0;
  std::vector<int32_t> up(4096), down(4096);
  long tied_cuts = 0;
  for (int t = 0; t < 20000; ++t) {
    const int n = 1 + static_cast<int>(rng() % (t < 10000 ? 64 : 3000)), k = 1 + static_cast<int>(rng() % n);
    const int mode = static_cast<int>(rng() % 4);
    std::vector<int64_t> pos(n);
    for (int i = 0; i < n; ++i) pos[i] = static_cast<int64_t>(i) * 3 + static_cast<int64_t>(rng() % 3);
    pos[0] = t % 2 ? 0 : 0xFFFFFFFFLL;  // the key's position range, both ends
    std::shuffle(pos.begin(), pos.end(), rng);
    std::vector<Scored> a(n);
    for (int i = 0; i < n; ++i) {
      float s;
      if (mode == 0) s = std::normal_distribution<float>()(rng);
      else if (mode == 1) s = static_cast<float>(rng() % 5) - 2.f;
      else if (mode == 2) s = kSpecial[rng() % (sizeof kSpecial / sizeof kSpecial[0])];
      else s = static_cast<float>(i % 7) + (i % 2 ? -1.f : 1.f) * static_cast<float>(i);
      a[i] = {s, pos[i]};
    }
    std::vector<uint64_t> keys(n);
    for (int i = 0; i < n; ++i) keys[i] = better_key(a[i].first, a[i].second);
    ++cases;
    bool ok = true;
    for (int i = 0; i + 1 < n; ++i)
      ok &= (keys[i] > keys[i + 1]) == Better{}(a[i], a[i + 1]) && (keys[i + 1] > keys[i]) == Better{}(a[i + 1], a[i]);
    for (int i = 0; i < n; ++i) ok &= key_pos(keys[i]) == a[i].second && key_score(keys[i]) == a[i].first;
    const int depth = t % 3 == 0 ? static_cast<int>(rng() % 4) : -1;
    ok &= same_cut(a, k, depth, Better{}, KeyGreater{}, keys, up, down);
    const std::vector<uint64_t> by_better = keys;
    ok &= same_cut(a, k, depth, GreaterScore{}, ScoreGreater{}, keys, up, down);
    std::vector<float> sorted(n);
    for (int i = 0; i < n; ++i) sorted[i] = a[i].first;
    std::sort(sorted.begin(), sorted.end());
    const bool tied = std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end();  // -0 == +0: a tie
    tied_cuts += tied;
    if (!tied) ok &= keys == by_better;  // distinct scores: one permutation under either comparison
    if (k < n) {  // the reuse path's entry: the k kept, in the pairs' order under the scores alone
      std::vector<float> sc(n);
      for (int i = 0; i < n; ++i) sc[i] = a[i].first;
      std::vector<uint64_t> top(n);
      ok &= top_keys_by_score(sc.data(), pos.data(), n, k, top.data(), up.data(), down.data());
      if (depth < 0)
        for (int i = 0; i < k; ++i) ok &= top[i] == keys[i];
      sc[rng() % n] = NAN;  // no key: the caller cuts the pairs
      ok &= !top_keys_by_score(sc.data(), pos.data(), n, k, top.data(), up.data(), down.data());
    }
    if (!ok) {
      if (bad < 5) std::printf("differs: case %d n %d k %d mode %d depth %d\n", t, n, k, mode, depth);
      ++bad;
    }
  }
  std::printf("%ld score cuts with tied scores\n", tied_cuts);
  std::printf("%ld cases, %ld differ\n", cases, bad);
  return bad != 0;
}
