// The entries of the fused CPU library that one of its sources calls in another (each defined once, in the
// source named above it); the Python bindings are in retopk_cpu.cpp.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

// retopk_cpu.cpp: ReTopK's decode step, and Full attention / Exact Top-K (cpu/launch.py states their math).
std::vector<at::Tensor> decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                               const at::Tensor& block_table, const at::Tensor& lengths, at::Tensor queries,
                               at::Tensor support, at::Tensor fill, at::Tensor ptr, at::Tensor step,
                               const at::Tensor& slots, at::Tensor tau, at::Tensor period, const at::Tensor& phase,
                               int64_t top_k, int64_t recall, int64_t window, int64_t refresh_every,
                               bool successors, const std::string& retrieval, const std::string& gqa_policy,
                               double group_tau_min, double scale, std::vector<int64_t> path_codes,
                               std::vector<double> calibration, std::vector<double> guard);
std::vector<at::Tensor> dense_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                     const at::Tensor& block_table, const at::Tensor& lengths, double scale,
                                     int64_t top_k, bool exact);

// decoder_ops.cpp: the decoder's ops.
// SIMD levels; each has every instruction set of the levels below it (AVX-512 VNNI needs AVX-512F).
enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3 };
int64_t best_isa();
// The process's level: best_isa() until set_isa_level (called once, by launch.extension() at load, with the level
// RETOPK_CPU_ISA asks for). The fused attention's key scoring reads it; the block products take theirs per call.
int64_t isa_level();
void set_isa_level(int64_t level);
bool amx_available();
at::Tensor pack_units(const at::Tensor& qs, const at::Tensor& scales);
at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, int64_t bits,
                        const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual, int64_t isa,
                        int64_t activations);
std::vector<at::Tensor> quantize_activations(const at::Tensor& x, int64_t isa);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
void store_kv(at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& rows, const at::Tensor& k, const at::Tensor& v);
at::Tensor swiglu(const at::Tensor& gu);
at::Tensor packed_linear_rows(const at::Tensor& x, const at::Tensor& w);
void causal_attention_segments_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::vector<int64_t>& offsets, const std::vector<int64_t>& lengths, double scale);
at::Tensor attn_in(const at::Tensor& x, const at::Tensor& w_attn, double eps, const at::Tensor& qs,
                   const at::Tensor& scales, int64_t bits, const c10::optional<at::Tensor>& bias, const at::Tensor& cos,
                   const at::Tensor& sin, int64_t rot_heads, int64_t d, int64_t isa, int64_t activations);
at::Tensor mlp_out(const at::Tensor& x, const at::Tensor& a, const at::Tensor& o_qs, const at::Tensor& o_scales,
                   int64_t o_bits, const c10::optional<at::Tensor>& o_bias, const at::Tensor& w_mlp, double eps,
                   const at::Tensor& gu_qs, const at::Tensor& gu_scales, int64_t gu_bits,
                   const c10::optional<at::Tensor>& gu_bias, const at::Tensor& dn_qs, const at::Tensor& dn_scales,
                   int64_t dn_bits, const c10::optional<at::Tensor>& dn_bias, int64_t isa, int64_t activations);
void attn_in_to(at::Tensor& y, const at::Tensor& x, const at::Tensor& w_attn, double eps, const at::Tensor& qs,
                const at::Tensor& scales, int64_t bits, const c10::optional<at::Tensor>& bias, const at::Tensor& cos,
                const at::Tensor& sin, int64_t rot_heads, int64_t d, int64_t isa, int64_t activations);
void mlp_out_to(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& o_qs,
                const at::Tensor& o_scales, int64_t o_bits, const c10::optional<at::Tensor>& o_bias,
                const at::Tensor& w_mlp, double eps, const at::Tensor& gu_qs, const at::Tensor& gu_scales,
                int64_t gu_bits, const c10::optional<at::Tensor>& gu_bias, const at::Tensor& dn_qs,
                const at::Tensor& dn_scales, int64_t dn_bits, const c10::optional<at::Tensor>& dn_bias, int64_t isa,
                int64_t activations);
// decode_layers.cpp: a whole decode step's layers, as the class DecodeLayers bound into the module here.
void bind_decode_layers(pybind11::module_& m);
