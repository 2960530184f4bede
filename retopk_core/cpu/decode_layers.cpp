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
// ``DecodeLayers`` takes what stays the same from step to step once (decoder_ops.LayerPlan): per layer the 14
// weight tensors attn_norm, qkv (qs, scales, bias), o (qs, scales, bias), mlp_norm, gate_up (qs, scales, bias),
// down (qs, scales, bias) (a bias is an empty tensor when there is none), the four products' ``bits`` (4 or 8),
// the k/v pools, the attention's kind, state and constants; ``activations`` (float32, int8, bf16x2 or int16,
// decoder_ops.cpp) applies to every product; with bf16x2 and int16 every product's qs is pack_units's units. A step
// (``run``) passes only its own tensors: x, RoPE's cos / sin, the pool rows of its tokens, the block table, the
// lengths and the state slots (layers, B). ReTopK's state is 8 tensors per layer (queries, support, fill, ptr,
// step, tau, period, phase).
//
// The pools and the state are held weakly: they are reallocated when they grow or shrink (kv_pool.py,
// MethodGroup), and a prepared step must neither keep the old memory alive nor run on it (a step whose pool
// or state is gone raises ValueError; the caller prepares the layers again whenever they change).
// Each step's intermediates (the QKV rows, the residual stream between layers) are buffers of the object,
// reused while B stays the same; the result is a new tensor.

#include <torch/extension.h>

#include "library_ops.h"

#include <chrono>
#include <cmath>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr int64_t kWeightsPerLayer = 14, kBitsPerLayer = 4, kStatePerLayer = 8;
enum Kind : int64_t { kReTopK = 0, kDense = 1, kDenseFloor = 2 };
using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

c10::optional<at::Tensor> bias_of(const at::Tensor& t) {
  return t.numel() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

std::vector<WeakTensor> weakly(const std::vector<at::Tensor>& tensors) {
  std::vector<WeakTensor> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) out.emplace_back(t.getIntrusivePtr());
  return out;
}

at::Tensor lock(const WeakTensor& w, const char* what, int64_t layer) {
  c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> p = w.lock();
  TORCH_CHECK_VALUE(p.defined(), "decode_layers: layer ", layer, "'s ", what, " was reallocated since the layers "
                    "were prepared");
  return at::Tensor(std::move(p));
}

class DecodeLayers {
 public:
  DecodeLayers(std::vector<at::Tensor> weights, std::vector<int64_t> bits, double eps, int64_t H, int64_t H_kv,
               int64_t d, const std::vector<at::Tensor>& k_pools, const std::vector<at::Tensor>& v_pools, int64_t kind,
               const std::vector<at::Tensor>& state, std::vector<int64_t> ints, std::string retrieval,
               std::string gqa_policy, std::vector<double> floats, std::vector<int64_t> path_codes,
               std::vector<double> calibration, std::vector<double> guard, int64_t isa, int64_t activations)
      : weights_(std::move(weights)), bits_(std::move(bits)), eps_(eps), H_(H), H_kv_(H_kv), d_(d),
        layers_(static_cast<int64_t>(k_pools.size())), k_pools_(weakly(k_pools)), v_pools_(weakly(v_pools)),
        kind_(kind), state_(weakly(state)), ints_(std::move(ints)), retrieval_(std::move(retrieval)),
        gqa_policy_(std::move(gqa_policy)), floats_(std::move(floats)), path_codes_(std::move(path_codes)),
        calibration_(std::move(calibration)), guard_(std::move(guard)), isa_(isa), activations_(activations) {
    const int64_t layers = layers_;
    TORCH_CHECK_VALUE(layers > 0 && static_cast<int64_t>(v_pools.size()) == layers &&
                          static_cast<int64_t>(weights_.size()) == kWeightsPerLayer * layers &&
                          static_cast<int64_t>(bits_.size()) == kBitsPerLayer * layers,
                      "decode_layers: ", layers, " layers need as many pools, ", kWeightsPerLayer, " weights and ",
                      kBitsPerLayer, " bits each");
    TORCH_CHECK_VALUE(kind == kDense || kind == kReTopK || kind == kDenseFloor,
                      "decode_layers: unknown attention kind ", kind);
    TORCH_CHECK_VALUE(kind != kDenseFloor || static_cast<int64_t>(state.size()) == layers,
                      "decode_layers: the dense floor needs each layer's step counter");
    TORCH_CHECK_VALUE(kind != kReTopK || (static_cast<int64_t>(state.size()) == kStatePerLayer * layers &&
                                         ints_.size() == 5 && floats_.size() == 1),
                      "decode_layers: ReTopK needs ", kStatePerLayer, " state tensors per layer, 5 integer and 1 "
                      "float parameters");
    TORCH_CHECK_VALUE(kind == kReTopK || ints_.size() == 2, "decode_layers: dense attention needs (top_k, exact)");
    for (int64_t l = 0; kind == kDenseFloor && l < layers; ++l) {
      const at::Tensor& step = state[l];
      TORCH_CHECK_VALUE(step.scalar_type() == at::kLong && step.dim() == 1 && step.is_contiguous(),
                        "decode_layers: layer ", l, "'s step counter must be a contiguous int64 vector");
    }
    const int64_t width = (H + 2 * H_kv) * d;
    for (int64_t l = 0; l < layers; ++l)
      TORCH_CHECK_VALUE(weights_[kWeightsPerLayer * l + 1].size(0) == width, "decode_layers: the QKV product of "
                        "layer ", l, " has ", weights_[kWeightsPerLayer * l + 1].size(0), " outputs, expected ", width);
  }

  // Returns [x (B, D), attention seconds (a float64 scalar), then with ``with_stats`` for ReTopK per layer path,
  // max_sim, n_scored].
  std::vector<at::Tensor> run(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& rows, const at::Tensor& block_table, const at::Tensor& lengths,
                              const at::Tensor& slots, bool with_stats) {
    std::lock_guard<std::mutex> guard(mutex_);  // the buffers are the object's: one step at a time
    TORCH_CHECK_VALUE(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2 &&
                          x_in.is_contiguous(), "decode_layers: x must be a contiguous float32 (B, D) CPU tensor");
    const int64_t B = x_in.size(0), H = H_, H_kv = H_kv_, d = d_, layers = layers_;
    TORCH_CHECK_VALUE(kind_ == kDense || (slots.dim() == 2 && slots.size(0) == layers &&
                                         slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                                         slots.size(1) == B),
                      "decode_layers: the method's state needs a contiguous int64 row of slots (B,) per layer");
    std::vector<at::Tensor> state;  // this step's strong references (the dense floor's range check needs them)
    state.reserve(state_.size());
    for (size_t i = 0; i < state_.size(); ++i)
      state.push_back(lock(state_[i], "method state", static_cast<int64_t>(i) / (kind_ == kReTopK ? kStatePerLayer : 1)));
    for (int64_t l = 0; kind_ == kDenseFloor && l < layers; ++l) {
      const int64_t* slot = slots.data_ptr<int64_t>() + l * B;
      for (int64_t b = 0; b < B; ++b)
        TORCH_CHECK_VALUE(slot[b] >= 0 && slot[b] < state[l].size(0), "decode_layers: slot ", slot[b],
                          " out of range");
    }
    buffers(B, x_in.size(1));
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));  // what the Python layer passes: 1.0 / math.sqrt(d)
    std::vector<at::Tensor> result{at::Tensor(), at::Tensor()};
    double attention_s = 0.0;
    at::Tensor x = x_in;
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor* w = weights_.data() + kWeightsPerLayer * l;
      const int64_t* b = bits_.data() + kBitsPerLayer * l;
      attn_in_to(qkv_, x, w[0], eps_, w[1], w[2], b[0], bias_of(w[3]), cos, sin, H + H_kv, d, isa_, activations_);
      at::Tensor k_pool = lock(k_pools_[l], "key pool", l), v_pool = lock(v_pools_[l], "value pool", l);
      store_kv(k_pool, v_pool, rows, k_, v_);
      const auto t0 = std::chrono::steady_clock::now();
      at::Tensor out;
      if (kind_ == kReTopK) {
        const at::Tensor* s = state.data() + kStatePerLayer * l;
        std::vector<at::Tensor> r = decode(q_, k_pool, v_pool, block_table, lengths, s[0], s[1], s[2], s[3], s[4],
                                           slots[l], s[5], s[6], s[7], ints_[0], ints_[1], ints_[2], ints_[3],
                                           ints_[4] != 0, retrieval_, gqa_policy_, floats_[0], scale, path_codes_,
                                           calibration_, guard_);
        out = r[0];
        if (with_stats) {
          result.push_back(r[1]);  // path
          result.push_back(r[2]);  // max_sim
          result.push_back(r[3]);  // n_scored
        }
      } else {
        out = dense_decode(q_, k_pool, v_pool, block_table, lengths, scale, ints_[0], ints_[1] != 0)[0];
        if (kind_ == kDenseFloor) {  // the rows' steps count on the floor too (t_dec drives the refresh schedule)
          int64_t* step = state[l].data_ptr<int64_t>();
          const int64_t* slot = slots.data_ptr<int64_t>() + l * B;
          for (int64_t i = 0; i < B; ++i) ++step[slot[i]];
        }
      }
      attention_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      // layers alternate between the two buffers; the last writes a new tensor, the caller's to keep
      at::Tensor y = l + 1 == layers ? at::empty_like(x_in) : residual_[l % 2];
      mlp_out_to(y, x, out.view({B, H * d}), w[4], w[5], b[1], bias_of(w[6]), w[7], eps_, w[8], w[9], b[2],
                 bias_of(w[10]), w[11], w[12], b[3], bias_of(w[13]), isa_, activations_);
      x = y;
    }
    result[0] = x;
    result[1] = at::scalar_tensor(attention_s, at::TensorOptions().dtype(at::kDouble));
    return result;
  }

 private:
  // The step's intermediates for B rows of D: the QKV rows with their q / k / v views, and the residual stream.
  void buffers(int64_t B, int64_t D) {
    if (B == rows_ && D == width_) return;
    const int64_t H = H_, H_kv = H_kv_, d = d_;
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    qkv_ = at::empty({B, (H + 2 * H_kv) * d}, f32);
    at::Tensor heads = qkv_.view({B, 1, H + 2 * H_kv, d}).transpose(1, 2);  // (B, H + 2 H_kv, 1, d)
    q_ = heads.narrow(1, 0, H).select(2, 0);                                 // (B, H, d)
    k_ = heads.narrow(1, H, H_kv);                                           // (B, H_kv, 1, d)
    v_ = heads.narrow(1, H + H_kv, H_kv);
    residual_[0] = at::empty({B, D}, f32);
    residual_[1] = at::empty({B, D}, f32);
    rows_ = B;
    width_ = D;
  }

  const std::vector<at::Tensor> weights_;
  const std::vector<int64_t> bits_;
  const double eps_;
  const int64_t H_, H_kv_, d_, layers_;
  const std::vector<WeakTensor> k_pools_, v_pools_;
  const int64_t kind_;
  const std::vector<WeakTensor> state_;
  const std::vector<int64_t> ints_;
  const std::string retrieval_, gqa_policy_;
  const std::vector<double> floats_;
  const std::vector<int64_t> path_codes_;
  const std::vector<double> calibration_, guard_;
  const int64_t isa_, activations_;
  std::mutex mutex_;
  int64_t rows_ = -1, width_ = -1;
  at::Tensor qkv_, q_, k_, v_, residual_[2];
};

}  // namespace

void bind_decode_layers(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<DecodeLayers>(m, "DecodeLayers",
                           "every layer of a decode step (attn_in, store_kv, attention, mlp_out), prepared once")
      .def(py::init<std::vector<at::Tensor>, std::vector<int64_t>, double, int64_t, int64_t, int64_t,
                    const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, int64_t,
                    const std::vector<at::Tensor>&, std::vector<int64_t>, std::string, std::string,
                    std::vector<double>, std::vector<int64_t>, std::vector<double>, std::vector<double>, int64_t,
                    int64_t>())
      // a whole step touches no Python object: the GIL is released so the server's other threads (the event loop
      // streaming tokens, the grammar masks filled during the forward) run meanwhile, as between per-layer calls
      .def("run", &DecodeLayers::run, "one decode step's layers", py::call_guard<py::gil_scoped_release>());
}
