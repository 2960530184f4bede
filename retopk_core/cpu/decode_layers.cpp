// A whole decode step's layers in one call: the decoder's fused path (every matmul in GGUF blocks) around an
// attention core with a fused CPU step. For each layer l, with x (B, D) the float32 residual stream:
//
//   qkv = attn_in(x, ...)                                  (B, (H + 2 H_kv) d): RMSNorm, QKV product, RoPE
//   store_kv(k_pools[l], v_pools[l], rows, k, v)           the step's keys and values into the paged pool
//   a   = attention_l(q)                                   (B, H, d) -> (B, H d)
//   x   = mlp_out(x, a, ...)                               the o product, residual, MLP and residual
//
// where attention_l is ReTopK's sparse step (``decode``, on layer l's FIFO state), ``dense_decode`` (Full
// attention, Exact Top-K), or ReTopK's plain dense-floor step: ``dense_decode`` and step[slots[l]] += 1 on
// layer l's step counter (``ReTopK._dense_step`` for rows more than C steps below the floor). These are the
// calls runtime/decoder/llama.py's layer_step and runtime/attention.py's attend make for such a step, on the
// same tensors in the same order, so the result is that loop's bit for bit; what goes is the Python between
// them (a few hundred interpreter operations a layer).
//
// Per layer, ``weights`` holds 14 tensors: attn_norm, qkv (qs, scales, bias), o (qs, scales, bias), mlp_norm,
// gate_up (qs, scales, bias), down (qs, scales, bias); a bias is an empty tensor when there is none. ``bits``
// holds the four products' formats (4 or 8); ``activations`` (float32 or int8, decoder_ops.cpp) applies to all
// of them. ReTopK's state is 8 tensors per layer (queries, support, fill, ptr, step, tau, period, phase) and its
// slots one row per layer of ``slots`` (layers, B).

#include <torch/extension.h>

#include "library_ops.h"

#include <chrono>
#include <cmath>
#include <string>
#include <vector>

namespace {

constexpr int64_t kWeightsPerLayer = 14, kBitsPerLayer = 4, kStatePerLayer = 8;
enum Kind : int64_t { kReTopK = 0, kDense = 1, kDenseFloor = 2 };

c10::optional<at::Tensor> bias_of(const at::Tensor& t) {
  return t.numel() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

}  // namespace

// Returns [x (B, D), attention seconds (a float64 scalar), then for ReTopK per layer path, max_sim, n_scored].
std::vector<at::Tensor> decode_layers(const at::Tensor& x_in, const std::vector<at::Tensor>& weights,
                                      const std::vector<int64_t>& bits, double eps, const at::Tensor& cos,
                                      const at::Tensor& sin, int64_t H, int64_t H_kv, int64_t d,
                                      std::vector<at::Tensor> k_pools, std::vector<at::Tensor> v_pools,
                                      const at::Tensor& rows, const at::Tensor& block_table, const at::Tensor& lengths,
                                      int64_t kind, const std::vector<at::Tensor>& state, const at::Tensor& slots,
                                      std::vector<int64_t> ints, const std::string& retrieval,
                                      const std::string& gqa_policy, std::vector<double> floats,
                                      std::vector<int64_t> path_codes, std::vector<double> calibration,
                                      std::vector<double> guard, int64_t isa, int64_t activations) {
  const int64_t layers = static_cast<int64_t>(k_pools.size());
  TORCH_CHECK_VALUE(layers > 0 && static_cast<int64_t>(v_pools.size()) == layers &&
                        static_cast<int64_t>(weights.size()) == kWeightsPerLayer * layers &&
                        static_cast<int64_t>(bits.size()) == kBitsPerLayer * layers,
                    "decode_layers: ", layers, " layers need as many pools, ", kWeightsPerLayer, " weights and ",
                    kBitsPerLayer, " bits each");
  TORCH_CHECK_VALUE(kind == kDense || kind == kReTopK || kind == kDenseFloor, "decode_layers: unknown attention kind ",
                    kind);
  TORCH_CHECK_VALUE(kind != kDenseFloor ||
                        (static_cast<int64_t>(state.size()) == layers && slots.dim() == 2 && slots.size(0) == layers &&
                         slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                         slots.size(1) == x_in.size(0)),
                    "decode_layers: the dense floor needs each layer's step counter and a row of slots per layer");
  TORCH_CHECK_VALUE(kind != kReTopK || (static_cast<int64_t>(state.size()) == kStatePerLayer * layers &&
                                       slots.dim() == 2 && slots.size(0) == layers && ints.size() == 4 &&
                                       floats.size() == 1),
                    "decode_layers: ReTopK needs ", kStatePerLayer, " state tensors and a row of slots per layer, "
                    "4 integer and 1 float parameters");
  TORCH_CHECK_VALUE(kind == kReTopK || (ints.size() == 2), "decode_layers: dense attention needs (top_k, exact)");
  for (int64_t l = 0; kind == kDenseFloor && l < layers; ++l) {
    const at::Tensor& step = state[l];
    TORCH_CHECK_VALUE(step.scalar_type() == at::kLong && step.dim() == 1 && step.is_contiguous(),
                      "decode_layers: layer ", l, "'s step counter must be a contiguous int64 vector");
    const int64_t* slot = slots.data_ptr<int64_t>() + l * slots.size(1);
    for (int64_t b = 0; b < slots.size(1); ++b)
      TORCH_CHECK_VALUE(slot[b] >= 0 && slot[b] < step.size(0), "decode_layers: slot ", slot[b], " out of range");
  }
  const int64_t B = x_in.size(0), width = (H + 2 * H_kv) * d;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));  // what the Python layer passes: 1.0 / math.sqrt(d)
  std::vector<at::Tensor> result{at::Tensor(), at::Tensor()};
  double attention_s = 0.0;
  at::Tensor x = x_in;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + kWeightsPerLayer * l;
    const int64_t* b = bits.data() + kBitsPerLayer * l;
    at::Tensor qkv = attn_in(x, w[0], eps, w[1], w[2], b[0], bias_of(w[3]), cos, sin, H + H_kv, d, isa,
                             activations);
    TORCH_CHECK_VALUE(qkv.size(1) == width, "decode_layers: the QKV product of layer ", l, " has ", qkv.size(1),
                      " outputs, expected ", width);
    at::Tensor heads = qkv.view({B, 1, H + 2 * H_kv, d}).transpose(1, 2);  // (B, H + 2 H_kv, 1, d)
    store_kv(k_pools[l], v_pools[l], rows, heads.narrow(1, H, H_kv), heads.narrow(1, H + H_kv, H_kv));
    const at::Tensor q = heads.narrow(1, 0, H).select(2, 0);  // (B, H, d)
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor out;
    if (kind == kReTopK) {
      const at::Tensor* s = state.data() + kStatePerLayer * l;
      std::vector<at::Tensor> r = decode(q, k_pools[l], v_pools[l], block_table, lengths, s[0], s[1], s[2], s[3],
                                         s[4], slots[l], s[5], s[6], s[7], ints[0], ints[1], ints[2], ints[3],
                                         retrieval, gqa_policy, floats[0], scale, path_codes, calibration, guard);
      out = r[0];
      result.push_back(r[1]);  // path
      result.push_back(r[2]);  // max_sim
      result.push_back(r[3]);  // n_scored
    } else {
      out = dense_decode(q, k_pools[l], v_pools[l], block_table, lengths, scale, ints[0], ints[1] != 0)[0];
      if (kind == kDenseFloor) {  // the rows' steps count on the floor too (t_dec drives the refresh schedule)
        int64_t* step = state[l].data_ptr<int64_t>();
        const int64_t* slot = slots.data_ptr<int64_t>() + l * slots.size(1);
        for (int64_t b = 0; b < B; ++b) ++step[slot[b]];
      }
    }
    attention_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    x = mlp_out(x, out.view({B, H * d}), w[4], w[5], b[1], bias_of(w[6]), w[7], eps, w[8], w[9], b[2], bias_of(w[10]),
                w[11], w[12], b[3], bias_of(w[13]), isa, activations);
  }
  result[0] = x;
  result[1] = at::scalar_tensor(attention_s, at::TensorOptions().dtype(at::kDouble));
  return result;
}
