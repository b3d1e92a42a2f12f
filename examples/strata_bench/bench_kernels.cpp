// strata-bench kernels: each transformer op, forward and backward, at the shapes of
// GPT-2 XL (T = 1024, C = 1600, 25 heads of 64, MLP 6400, V = 50257) and Llama-3.2-1B
// (T = 1024, C = 2048, 32 / 8 heads of 64, MLP 8192, V = 128256), plus attention with
// head_dim 128 (32 / 8 heads). Prints each op's median time, its achieved TFLOPS (GEMMs,
// attention) or GB/s (everything memory-bound) and, on a GPU, the fraction of the H200's
// peak: 989 TFLOPS dense bf16 (67 TFLOPS for exact fp32, which has no tensor cores) and
// 4.8 TB/s HBM3e. GPU times come from CUDA events around each run.
//
// --device cpu runs the CPU twins (fp32 only) at every dimension but head_dim divided
// by --scale (default 16 there: full shapes would take minutes), so the subcommand is
// exercised where no GPU is; those figures are for the twins, not a peak.
//
// Work counted: a GEMM 2 m n k FLOPs forward, 4 m n k backward (dx and dweight);
// causal attention the unmasked half of its products, 2 T^2 head_dim heads forward
// and 2.5 times that backward (FlashAttention's convention, so figures compare with
// its papers); memory-bound ops the bytes they must read and write once. Adam and the
// gradient cast (fp32 to the transfer dtype) run over 12 C^2 elements, one layer's weights.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#if defined(STRATA_HAVE_CUDA)
#include <cuda_runtime.h>

#include "engine/core/cuda_check.h"
#endif

#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "examples/profile/kernel_ops.h"
#include "examples/strata_bench/bench.h"
#include "kernels/adam.h"
#include "kernels/blas_context.h"
#include "kernels/cast.h"
#include "kernels/gqa_attention.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "kernels/transformer_ops.h"

namespace strata::bench {

const char* const kKernelsUsage =
    "usage: strata-bench kernels [--device cuda|cpu] [--dtype bf16|fp32] [--scale S] [--repetitions R] [--json]\n"
    "  --device D       cuda (default): the CUDA kernels against the H200's peak; cpu: their CPU twins (fp32)\n"
    "  --dtype T        bf16 (default on cuda) or fp32 (the only one on cpu)\n"
    "  --scale S        every dimension but head_dim divided by S, 1-1024 (default 1 on cuda, 16 on cpu)\n"
    "  --repetitions R  timed runs per op; the median is reported (default 20 on cuda, 3 on cpu)\n"
    "  --json           print one JSON object as the last line of stdout";

namespace {

struct ModelShape {
  const char* name;
  size_t seq_len;
  size_t channels;
  size_t heads;
  size_t kv_heads;
  size_t head_dim;
  size_t mlp;
  size_t vocab;
  enum class Family : uint8_t { kGpt2, kLlama, kAttentionOnly } family;
};

// Every dimension but head_dim divided by `scale` (at least 1; kv_heads kept a divisor).
ModelShape scaled(ModelShape shape, size_t scale) {
  auto divide = [scale](size_t value) { return std::max<size_t>(1, value / scale); };
  shape.seq_len = divide(shape.seq_len);
  shape.channels = divide(shape.channels);
  shape.heads = divide(shape.heads);
  shape.kv_heads = divide(shape.kv_heads);
  while (shape.heads % shape.kv_heads != 0) --shape.kv_heads;
  shape.mlp = divide(shape.mlp);
  shape.vocab = divide(shape.vocab);
  return shape;
}

enum class Work : uint8_t { kFlops, kBytes };

// Times enqueued work: CUDA events on a GPU stream, the wall clock around a
// synchronize on the CPU device.
class Timer {
 public:
  explicit Timer(Stream& stream) : stream_(stream) {}
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  ~Timer() {
#if defined(STRATA_HAVE_CUDA)
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (stop_ != nullptr) cudaEventDestroy(stop_);
#endif
  }

  // The median of `repetitions` timed runs after one untimed warm-up run.
  StatusOr<double> median_seconds(const std::function<Status()>& run, int repetitions) {
    STRATA_RETURN_IF_ERROR(run());
    STRATA_RETURN_IF_ERROR(stream_.synchronize());
    std::vector<double> seconds;
    for (int i = 0; i < repetitions; ++i) {
      STRATA_ASSIGN_OR_RETURN(const double s, time_one(run));
      seconds.push_back(s);
    }
    std::sort(seconds.begin(), seconds.end());
    return seconds[seconds.size() / 2];
  }

 private:
  StatusOr<double> time_one(const std::function<Status()>& run) {
#if defined(STRATA_HAVE_CUDA)
    if (stream_.native_handle() != nullptr) {
      auto cuda_stream = static_cast<cudaStream_t>(stream_.native_handle());
      if (start_ == nullptr) {
        STRATA_RETURN_IF_CUDA_ERROR(cudaEventCreate(&start_));
        STRATA_RETURN_IF_CUDA_ERROR(cudaEventCreate(&stop_));
      }
      STRATA_RETURN_IF_CUDA_ERROR(cudaEventRecord(start_, cuda_stream));
      STRATA_RETURN_IF_ERROR(run());
      STRATA_RETURN_IF_CUDA_ERROR(cudaEventRecord(stop_, cuda_stream));
      STRATA_RETURN_IF_ERROR(stream_.synchronize());
      float milliseconds = 0;
      STRATA_RETURN_IF_CUDA_ERROR(cudaEventElapsedTime(&milliseconds, start_, stop_));
      return milliseconds * 1e-3;
    }
#endif
    const auto begin = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(run());
    STRATA_RETURN_IF_ERROR(stream_.synchronize());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  }

  Stream& stream_;
#if defined(STRATA_HAVE_CUDA)
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
#endif
};

// The device, stream, BLAS context and timer every op shares, and buffers filled with
// small pseudo-random values (so no op meets NaN or infinity).
class Bench {
 public:
  Bench(std::unique_ptr<Device> device, std::unique_ptr<Stream> stream, kernels::BlasContext blas, DType dtype,
        int repetitions)
      : device_(std::move(device)), stream_(std::move(stream)), blas_(std::move(blas)), dtype_(dtype),
        repetitions_(repetitions), timer_(*stream_) {}

  Device& device() { return *device_; }
  Stream& stream() { return *stream_; }
  kernels::BlasContext& blas() { return blas_; }
  DType dtype() const { return dtype_; }

  StatusOr<DeviceBuffer> filled(size_t count, DType type, float scale = 1.0f) {
    STRATA_ASSIGN_OR_RETURN(DeviceBuffer buffer, device_->allocate(std::max<size_t>(count, 1) * dtype_size(type), "bench"));
    std::vector<uint8_t> host(buffer.size());
    uint32_t state = 12345;
    for (size_t i = 0; i < count; ++i) {
      state = state * 1664525u + 1013904223u;
      const float value = (static_cast<float>(state >> 8) / 16777216.0f - 0.5f) * scale;
      store_from_float(host.data(), type, i, value);
    }
    STRATA_RETURN_IF_ERROR(device_->copy_async(buffer.data(), host.data(), host.size(), CopyKind::kHostToDevice, *stream_));
    STRATA_RETURN_IF_ERROR(stream_->synchronize());  // the host bytes die here
    return buffer;
  }
  StatusOr<DeviceBuffer> filled(size_t count) { return filled(count, dtype_); }
  StatusOr<DeviceBuffer> zeros(size_t bytes) {
    STRATA_ASSIGN_OR_RETURN(DeviceBuffer buffer, device_->allocate(std::max<size_t>(bytes, 1), "bench"));
    STRATA_RETURN_IF_ERROR(device_->memset_async(buffer.data(), 0, buffer.size(), *stream_));
    return buffer;
  }

  Status measure(const ModelShape& model, const std::string& op, const std::string& shape, Work work, double amount,
                 const std::function<Status()>& run) {
    STRATA_ASSIGN_OR_RETURN(const double seconds, timer_.median_seconds(run, repetitions_));
    results_.push_back({model.name, op, shape, seconds, work == Work::kFlops, amount});
    return {};
  }
  const std::vector<KernelTiming>& results() const { return results_; }

 private:
  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
  kernels::BlasContext blas_;
  DType dtype_;
  int repetitions_;
  Timer timer_;
  std::vector<KernelTiming> results_;
};

std::string dims(std::initializer_list<size_t> values) {
  std::string out;
  for (size_t v : values) {
    if (!out.empty()) out += 'x';
    out += std::to_string(v);
  }
  return out;
}

Status bench_matmul(Bench& b, const ModelShape& m, const char* what, kernels::MatmulShape shape, bool bias) {
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer x, b.filled(shape.rows * shape.in_features));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer w, b.filled(shape.in_features * shape.out_features, b.dtype(), 0.05f));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer bias_buffer, b.filled(bias ? shape.out_features : 0));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer y, b.zeros(shape.rows * shape.out_features * dtype_size(b.dtype())));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer dx, b.zeros(shape.rows * shape.in_features * dtype_size(b.dtype())));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer dw, b.zeros(shape.in_features * shape.out_features * sizeof(float)));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer db, b.zeros(shape.out_features * sizeof(float)));
  const void* bias_data = bias ? bias_buffer.data() : nullptr;
  const double flops = 2.0 * double(shape.rows) * double(shape.in_features) * double(shape.out_features);
  const std::string text = dims({shape.rows, shape.in_features, shape.out_features}) + (bias ? " +bias" : "");
  STRATA_RETURN_IF_ERROR(b.measure(m, std::string("matmul fwd ") + what, text, Work::kFlops, flops, [&] {
    return kernels::matmul_forward(b.stream(), b.blas(), shape, b.dtype(), x.data(), w.data(), bias_data, y.data());
  }));
  return b.measure(m, std::string("matmul bwd ") + what, text, Work::kFlops, 2 * flops, [&] {
    return kernels::matmul_backward(b.stream(), b.blas(), shape, b.dtype(), y.data(), x.data(), w.data(), dx.data(),
                                    dw.as<float>(), bias ? db.as<float>() : nullptr, kernels::GradOptions{});
  });
}

Status bench_attention(Bench& b, const ModelShape& m) {
  const kernels::GqaAttentionShape shape{
      .batch = 1, .seq_len = m.seq_len, .heads = m.heads, .kv_heads = m.kv_heads, .head_dim = m.head_dim};
  const size_t q_count = m.seq_len * m.heads * m.head_dim;
  const size_t kv_count = m.seq_len * m.kv_heads * m.head_dim;
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer q, b.filled(q_count));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer k, b.filled(kv_count));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer v, b.filled(kv_count));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer out, b.zeros(q_count * dtype_size(b.dtype())));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer dq, b.zeros(q_count * dtype_size(b.dtype())));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer dk, b.zeros(kv_count * dtype_size(b.dtype())));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer dv, b.zeros(kv_count * dtype_size(b.dtype())));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer lse, b.zeros(m.seq_len * m.heads * sizeof(float)));
  const size_t workspace_bytes = kernels::gqa_attention_workspace_bytes(shape, b.dtype(), b.device().kind());
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer workspace, b.zeros(workspace_bytes));
  const double flops = 2.0 * double(m.seq_len) * double(m.seq_len) * double(m.head_dim) * double(m.heads);
  const std::string text = std::string("T") + std::to_string(m.seq_len) + " " + std::to_string(m.heads) + "/" +
                           std::to_string(m.kv_heads) + " heads x " + std::to_string(m.head_dim);
  STRATA_RETURN_IF_ERROR(b.measure(m, "attention fwd", text, Work::kFlops, flops, [&] {
    return kernels::gqa_attention_forward(b.stream(), b.blas(), shape, b.dtype(), q.data(), k.data(), v.data(), out.data(),
                                          lse.as<float>(), workspace.data(), workspace_bytes);
  }));
  return b.measure(m, "attention bwd", text, Work::kFlops, 2.5 * flops, [&] {
    return kernels::gqa_attention_backward(b.stream(), b.blas(), shape, b.dtype(), out.data(), q.data(), k.data(),
                                           v.data(), lse.as<float>(), dq.data(), dk.data(), dv.data(), workspace.data(),
                                           workspace_bytes, kernels::GradWrite::kOverwrite);
  });
}

// The bytes a memory-bound op is counted as moving: its element accesses (the profile's
// table, which the cost model prices with) times the elements and their size.
double op_bytes(std::string_view op, size_t count, double element) {
  return profile::memory_op_accesses(op).value_or(0.0) * double(count) * element;
}

Status bench_norm(Bench& b, const ModelShape& m) {
  const size_t rows = m.seq_len;
  const size_t count = rows * m.channels;
  const double element = double(dtype_size(b.dtype()));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer x, b.filled(count, b.dtype(), 4.0f));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer gamma, b.filled(m.channels));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer beta, b.filled(m.channels));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer y, b.zeros(count * dtype_size(b.dtype())));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer dx, b.zeros(count * dtype_size(b.dtype())));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer stats, b.zeros(2 * rows * sizeof(float)));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer dparams, b.zeros(2 * m.channels * sizeof(float)));
  float* mean = stats.as<float>();
  float* rstd = stats.as<float>() + rows;
  const std::string text = dims({rows, m.channels});
  const bool gpt2 = m.family == ModelShape::Family::kGpt2;
  const double forward_bytes = op_bytes(gpt2 ? "layernorm fwd" : "rmsnorm fwd", count, element);
  const double backward_bytes = op_bytes(gpt2 ? "layernorm bwd" : "rmsnorm bwd", count, element);
  if (gpt2) {
    const kernels::LayerNormShape shape{.rows = rows, .channels = m.channels};
    STRATA_RETURN_IF_ERROR(b.measure(m, "layernorm fwd", text, Work::kBytes, forward_bytes, [&] {
      return kernels::layernorm_forward(b.stream(), shape, b.dtype(), x.data(), gamma.data(), beta.data(), y.data(), mean,
                                        rstd);
    }));
    return b.measure(m, "layernorm bwd", text, Work::kBytes, backward_bytes, [&] {
      return kernels::layernorm_backward(b.stream(), shape, b.dtype(), y.data(), x.data(), gamma.data(), mean, rstd,
                                         dx.data(), dparams.as<float>(), dparams.as<float>() + m.channels,
                                         kernels::GradOptions{});
    });
  }
  const kernels::RmsNormShape shape{.rows = rows, .channels = m.channels};
  STRATA_RETURN_IF_ERROR(b.measure(m, "rmsnorm fwd", text, Work::kBytes, forward_bytes, [&] {
    return kernels::rmsnorm_forward(b.stream(), shape, b.dtype(), x.data(), gamma.data(), y.data(), rstd);
  }));
  return b.measure(m, "rmsnorm bwd", text, Work::kBytes, backward_bytes, [&] {
    return kernels::rmsnorm_backward(b.stream(), shape, b.dtype(), y.data(), x.data(), gamma.data(), rstd, dx.data(),
                                     dparams.as<float>(), kernels::GradOptions{});
  });
}

Status bench_activation(Bench& b, const ModelShape& m) {
  const size_t count = m.seq_len * m.mlp;
  const double element = double(dtype_size(b.dtype()));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer a, b.filled(count, b.dtype(), 4.0f));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer c, b.filled(count));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer out, b.zeros(count * dtype_size(b.dtype())));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer da, b.zeros(count * dtype_size(b.dtype())));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer dc, b.zeros(count * dtype_size(b.dtype())));
  const std::string text = dims({m.seq_len, m.mlp});
  const auto overwrite = kernels::GradWrite::kOverwrite;
  if (m.family == ModelShape::Family::kGpt2) {
    STRATA_RETURN_IF_ERROR(b.measure(m, "gelu fwd", text, Work::kBytes, op_bytes("gelu fwd", count, element), [&] {
      return kernels::gelu_forward(b.stream(), b.dtype(), a.data(), out.data(), count);
    }));
    return b.measure(m, "gelu bwd", text, Work::kBytes, op_bytes("gelu bwd", count, element), [&] {
      return kernels::gelu_backward(b.stream(), b.dtype(), c.data(), a.data(), da.data(), count, overwrite);
    });
  }
  STRATA_RETURN_IF_ERROR(b.measure(m, "swiglu fwd", text, Work::kBytes, op_bytes("swiglu fwd", count, element), [&] {
    return kernels::swiglu_forward(b.stream(), b.dtype(), a.data(), c.data(), out.data(), count);
  }));
  return b.measure(m, "swiglu bwd", text, Work::kBytes, op_bytes("swiglu bwd", count, element), [&] {
    return kernels::swiglu_backward(b.stream(), b.dtype(), out.data(), a.data(), c.data(), da.data(), dc.data(), count,
                                    overwrite);
  });
}

Status bench_rope(Bench& b, const ModelShape& m) {
  const kernels::RopeShape shape{.rows = m.seq_len, .heads = m.heads, .head_dim = m.head_dim};
  const size_t count = m.seq_len * m.heads * m.head_dim;
  STRATA_ASSIGN_OR_RETURN(const std::vector<float> frequencies,
                          kernels::rope_inverse_frequencies(m.head_dim, 500000.0, kernels::RopeScaling{}));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer inv_freq, b.zeros(frequencies.size() * sizeof(float)));
  std::vector<int32_t> positions(m.seq_len);
  for (size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<int32_t>(i);
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer d_positions, b.zeros(positions.size() * sizeof(int32_t)));
  STRATA_RETURN_IF_ERROR(b.device().copy_async(inv_freq.data(), frequencies.data(), frequencies.size() * sizeof(float),
                                               CopyKind::kHostToDevice, b.stream()));
  STRATA_RETURN_IF_ERROR(b.device().copy_async(d_positions.data(), positions.data(), positions.size() * sizeof(int32_t),
                                               CopyKind::kHostToDevice, b.stream()));
  STRATA_RETURN_IF_ERROR(b.stream().synchronize());
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer x, b.filled(count));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer y, b.zeros(count * dtype_size(b.dtype())));
  const double element = double(dtype_size(b.dtype()));
  const std::string text = dims({m.seq_len, m.heads, m.head_dim});
  STRATA_RETURN_IF_ERROR(b.measure(m, "rope fwd", text, Work::kBytes, op_bytes("rope fwd", count, element), [&] {
    return kernels::rope_forward(b.stream(), shape, b.dtype(), d_positions.as<int32_t>(), inv_freq.as<float>(), x.data(),
                                 y.data());
  }));
  return b.measure(m, "rope bwd", text, Work::kBytes, op_bytes("rope bwd", count, element), [&] {
    return kernels::rope_backward(b.stream(), shape, b.dtype(), d_positions.as<int32_t>(), inv_freq.as<float>(), y.data(),
                                  x.data(), kernels::GradWrite::kOverwrite);
  });
}

Status bench_cross_entropy(Bench& b, const ModelShape& m) {
  const kernels::CrossEntropyShape shape{.rows = m.seq_len, .vocab_size = m.vocab};
  const size_t count = m.seq_len * m.vocab;
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer logits, b.filled(count, b.dtype(), 8.0f));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer dlogits, b.zeros(count * dtype_size(b.dtype())));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer targets, b.zeros(m.seq_len * sizeof(int32_t)));  // token 0 everywhere
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer stats, b.zeros((2 * m.seq_len + 1) * sizeof(float)));
  float* losses = stats.as<float>();
  float* lse = losses + m.seq_len;
  float* mean = lse + m.seq_len;
  const double element = double(dtype_size(b.dtype()));
  const std::string text = dims({m.seq_len, m.vocab});
  STRATA_RETURN_IF_ERROR(b.measure(m, "cross-entropy fwd", text, Work::kBytes, op_bytes("cross-entropy fwd", count, element), [&] {
    return kernels::cross_entropy_forward(b.stream(), shape, b.dtype(), logits.data(), targets.as<int32_t>(), losses, lse,
                                          mean);
  }));
  return b.measure(m, "cross-entropy bwd", text, Work::kBytes, op_bytes("cross-entropy bwd", count, element), [&] {
    return kernels::cross_entropy_backward(b.stream(), shape, b.dtype(), logits.data(), targets.as<int32_t>(), lse,
                                           1.0f / float(m.seq_len), dlogits.data(), kernels::GradWrite::kOverwrite);
  });
}

// One transformer layer's parameters (12 C^2: attention 4 C^2, MLP 8 C^2) through one
// Adam step: fp32 master and moments, gradient and parameter copy in the run's dtype.
Status bench_adam(Bench& b, const ModelShape& m) {
  const size_t count = 12 * m.channels * m.channels;
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer grad, b.filled(count));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer master, b.filled(count, DType::kFloat32));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer moments, b.zeros(2 * count * sizeof(float)));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer param, b.zeros(count * dtype_size(b.dtype())));
  const kernels::AdamBuffers buffers{.grad = grad.data(),
                                     .grad_type = b.dtype(),
                                     .master = master.as<float>(),
                                     .exp_avg = moments.as<float>(),
                                     .exp_avg_sq = moments.as<float>() + count,
                                     .moment_type = DType::kFloat32,
                                     .param = param.data(),
                                     .param_type = b.dtype(),
                                     .count = count};
  STRATA_ASSIGN_OR_RETURN(const kernels::AdamStepScalars scalars, kernels::adam_step_scalars(kernels::AdamHyperparams{}, 1));
  const double bytes = double(count) * double(kernels::adam_bytes_per_element(buffers));
  return b.measure(m, "adam step", std::to_string(count) + " params", Work::kBytes, bytes,
                   [&] { return kernels::adam_step(b.stream(), buffers, scalars); });
}

// The cast every gradient takes before its transfer (fp32 -> the transfer dtype), over the
// gradient count of bench_adam; bf16 transfers unless the bench runs in fp32.
Status bench_gradient_cast(Bench& b, const ModelShape& m) {
  const size_t count = 12 * m.channels * m.channels;
  const DType to = b.dtype() == DType::kFloat32 ? DType::kBFloat16 : b.dtype();
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer grad, b.filled(count, DType::kFloat32));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer wire, b.zeros(count * dtype_size(to)));
  const double bytes = double(count) * double(4 + dtype_size(to));
  return b.measure(m, "grad cast to " + std::string(dtype_name(to)), std::to_string(count) + " elements",
                   Work::kBytes, bytes, [&] { return kernels::cast(b.stream(), grad.data(), DType::kFloat32, wire.data(), to, count); });
}

Status bench_model(Bench& b, const ModelShape& m) {
  if (m.family != ModelShape::Family::kAttentionOnly) {
    const bool gpt2 = m.family == ModelShape::Family::kGpt2;
    using kernels::WeightLayout;
    STRATA_RETURN_IF_ERROR(bench_matmul(b, m, gpt2 ? "c_fc" : "up_proj",
                                        {m.seq_len, m.channels, m.mlp, gpt2 ? WeightLayout::kInOut : WeightLayout::kOutIn},
                                        gpt2));
    STRATA_RETURN_IF_ERROR(
        bench_matmul(b, m, "lm_head", {m.seq_len, m.channels, m.vocab, WeightLayout::kOutIn}, false));
  }
  STRATA_RETURN_IF_ERROR(bench_attention(b, m));
  if (m.family == ModelShape::Family::kAttentionOnly) return {};
  STRATA_RETURN_IF_ERROR(bench_norm(b, m));
  STRATA_RETURN_IF_ERROR(bench_activation(b, m));
  if (m.family == ModelShape::Family::kLlama) STRATA_RETURN_IF_ERROR(bench_rope(b, m));
  STRATA_RETURN_IF_ERROR(bench_cross_entropy(b, m));
  STRATA_RETURN_IF_ERROR(bench_gradient_cast(b, m));
  return bench_adam(b, m);
}

void print_results(const std::vector<KernelTiming>& results, DType dtype, bool on_gpu, size_t scale, bool json) {
  const double peak_flops = h200_dense_peak_flops(dtype == DType::kBFloat16 ? MatmulPrecision::kBf16 : MatmulPrecision::kFp32);
  std::printf("%-13s %-20s %-26s %10s %16s %8s\n", "model", "op", "shape", "ms", "achieved", "of peak");
  std::string out = "{\"subcommand\": \"kernels\", \"device\": \"" + std::string(on_gpu ? "cuda" : "cpu") +
                    "\", \"dtype\": \"" + std::string(dtype_name(dtype)) + "\", \"scale\": " + std::to_string(scale) +
                    ", \"results\": [";
  for (size_t i = 0; i < results.size(); ++i) {
    const KernelTiming& r = results[i];
    const bool flops = r.flops;
    const double rate = r.amount / r.seconds;
    const double fraction = rate / (flops ? peak_flops : kH200PeakBytesPerSecond);
    const std::string achieved = flops ? std::to_string(rate / 1e12).substr(0, 7) + " TFLOPS"
                                       : std::to_string(rate / 1e9).substr(0, 7) + " GB/s";
    const std::string of_peak = on_gpu ? std::to_string(100 * fraction).substr(0, 5) + "%" : "-";
    std::printf("%-13s %-20s %-26s %10.3f %16s %8s\n", r.model.c_str(), r.op.c_str(), r.shape.c_str(), r.seconds * 1e3,
                achieved.c_str(), of_peak.c_str());
    out += std::string(i ? ", " : "") + "{\"model\": \"" + r.model + "\", \"op\": \"" + r.op + "\", \"shape\": \"" +
           r.shape + "\", \"ms\": " + std::to_string(r.seconds * 1e3) + ", \"" + (flops ? "tflops" : "gbps") +
           "\": " + std::to_string(flops ? rate / 1e12 : rate / 1e9) +
           (on_gpu ? std::string(", \"fraction_of_peak\": ") + std::to_string(fraction) : std::string()) + "}";
  }
  if (json) std::printf("%s]}\n", out.c_str());
}

}  // namespace

StatusOr<KernelTimings> measure_kernel_timings(const KernelMeasurement& measurement) {
  const DType dtype = measurement.dtype;
  const size_t scale = measurement.scale;
  const int repetitions = measurement.repetitions;
  const bool on_gpu = measurement.device == DeviceKind::kCuda;
  if (!on_gpu && dtype != DType::kFloat32) return InvalidArgumentError("the CPU device runs the kernels in fp32 only (the CPU twins)");
  if (scale < 1 || repetitions < 1) return InvalidArgumentError("a kernel measurement needs scale >= 1 and repetitions >= 1");
  std::unique_ptr<Device> device;
  if (on_gpu) {
    STRATA_ASSIGN_OR_RETURN(device, create_cuda_device({}));
  } else {
    STRATA_ASSIGN_OR_RETURN(device, create_cpu_device({.budget_bytes = size_t{16} << 30}));
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device->create_stream("bench kernels"));
  STRATA_ASSIGN_OR_RETURN(kernels::BlasContext blas, kernels::BlasContext::create(*device));
  const std::string description = device->description();
  Bench bench(std::move(device), std::move(stream), std::move(blas), dtype, repetitions);

  using Family = ModelShape::Family;
  const ModelShape models[] = {
      {"GPT-2 XL", 1024, 1600, 25, 25, 64, 6400, 50257, Family::kGpt2},
      {"Llama-3.2-1B", 1024, 2048, 32, 8, 64, 8192, 128256, Family::kLlama},
      {"head_dim 128", 1024, 4096, 32, 8, 128, 0, 0, Family::kAttentionOnly},
  };
  std::printf("kernels on %s, %s, median of %d, %s\n", description.c_str(), std::string(dtype_name(dtype)).c_str(),
              repetitions,
              scale == 1 ? "full model shapes"
                         : (std::string("every dimension but head_dim divided by ") + std::to_string(scale)).c_str());
  for (const ModelShape& model : models) {
    STRATA_RETURN_IF_ERROR(bench_model(bench, scaled(model, scale)).with_context(std::string("model ") + model.name));
  }
  return KernelTimings{.description = description, .results = bench.results()};
}

// A training step uses each weight once per phase, so the host's products pack it into
// their panels from memory, not from cache, which the ops above (one weight, timed again and
// again) leave out. GPT-2 small's MLP product at 128 rows (the fewest the trainer runs) on
// one weight over and over (warm) and on copies enough to spill any last-level cache, 256
// MiB (cold), alternately; the cold pass's extra seconds per weight byte give the rate.
// Extra time under 1% of the warm pass reads as 1%: the streaming hides behind the FLOPs.
StatusOr<double> measure_weight_streaming(int repetitions) {
  if (repetitions < 1) return InvalidArgumentError("a weight-streaming measurement needs repetitions >= 1");
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, create_cpu_device({.budget_bytes = size_t{1} << 30}));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device->create_stream("bench weights"));
  STRATA_ASSIGN_OR_RETURN(kernels::BlasContext blas, kernels::BlasContext::create(*device));
  Bench b(std::move(device), std::move(stream), std::move(blas), DType::kFloat32, 1);
  const kernels::MatmulShape shape{128, 768, 3072, kernels::WeightLayout::kInOut};
  const size_t weight_bytes = shape.in_features * shape.out_features * sizeof(float);
  const size_t copies = ((size_t{256} << 20) + weight_bytes - 1) / weight_bytes;
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer x, b.filled(shape.rows * shape.in_features));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer y, b.zeros(shape.rows * shape.out_features * sizeof(float)));
  std::vector<DeviceBuffer> weights;
  for (size_t i = 0; i < copies; ++i) {
    STRATA_ASSIGN_OR_RETURN(DeviceBuffer w, b.filled(shape.in_features * shape.out_features, DType::kFloat32, 0.05f));
    weights.push_back(std::move(w));
  }
  auto pass = [&](bool cold) -> StatusOr<double> {
    const auto begin = std::chrono::steady_clock::now();
    for (size_t i = 0; i < copies; ++i) {
      const void* w = weights[cold ? i : 0].data();
      STRATA_RETURN_IF_ERROR(kernels::matmul_forward(b.stream(), b.blas(), shape, DType::kFloat32, x.data(), w, nullptr, y.data()));
    }
    STRATA_RETURN_IF_ERROR(b.stream().synchronize());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  };
  STRATA_RETURN_IF_ERROR(pass(true).status());  // touches every copy once
  std::vector<double> extra;
  for (int i = 0; i < repetitions; ++i) {
    STRATA_ASSIGN_OR_RETURN(const double warm, pass(false));
    STRATA_ASSIGN_OR_RETURN(const double cold, pass(true));
    extra.push_back(std::max(cold - warm, 0.01 * warm));
  }
  std::sort(extra.begin(), extra.end());
  return double(copies * weight_bytes) / extra[extra.size() / 2];
}

namespace {

Status measure_kernels(int argc, char** argv) {
  STRATA_ASSIGN_OR_RETURN(Args args, Args::parse(argc, argv, {"device", "dtype", "scale", "repetitions"}, {"json"}));
  const std::string device_name = args.get("device", "cuda");
  if (device_name != "cuda" && device_name != "cpu") {
    return InvalidArgumentError("--device must be cuda or cpu, got '" + device_name + "'");
  }
  const bool on_gpu = device_name == "cuda";
  const std::string dtype_text = args.get("dtype", on_gpu ? "bf16" : "fp32");
  DType dtype = DType::kFloat32;
  if (dtype_text == "bf16") {
    dtype = DType::kBFloat16;
  } else if (dtype_text != "fp32") {
    return InvalidArgumentError("--dtype must be fp32 or bf16, got '" + dtype_text + "'");
  }
  if (!on_gpu && dtype != DType::kFloat32) return InvalidArgumentError("--device cpu runs fp32 only (the CPU twins)");
  STRATA_ASSIGN_OR_RETURN(const size_t scale, args.get_integer<size_t>("scale", on_gpu ? 1 : 16, 1, 1024));
  STRATA_ASSIGN_OR_RETURN(const int repetitions, args.get_integer<int>("repetitions", on_gpu ? 20 : 3, 1, 10000));

  STRATA_ASSIGN_OR_RETURN(const KernelTimings timings,
                          measure_kernel_timings({.device = on_gpu ? DeviceKind::kCuda : DeviceKind::kCpu, .dtype = dtype,
                                                  .scale = scale, .repetitions = repetitions}));
  print_results(timings.results, dtype, on_gpu, scale, args.flag("json"));
  return {};
}

}  // namespace

int run_kernels(int argc, char** argv) {
  const Status status = measure_kernels(argc, argv);
  return status.ok() ? 0 : report_failure("kernels", status);
}

}  // namespace strata::bench
