#include "examples/models/linear_stack.h"

#include <functional>

#include <algorithm>
#include <cmath>
#include <string>

#include "engine/counter_rng.h"
#include "kernels/cast.h"
#include "kernels/transformer_ops.h"

namespace strata::models {
namespace {

size_t round_buffer(size_t bytes) { return (bytes + 4095) / 4096 * 4096; }

}  // namespace

void make_batch(const LinearStackConfig& config, int64_t step, int micro, int row_begin, int rows, float* x, int32_t* labels) {
  const int features = config.features;
  // Stream ids keep steps and micro-batches apart; elements are keyed by global row.
  const uint64_t stream = (static_cast<uint64_t>(step) << 20) ^ static_cast<uint64_t>(micro);
  for (int r = 0; r < rows; ++r) {
    const uint64_t row = static_cast<uint64_t>(row_begin + r);
    float* xr = x + static_cast<size_t>(r) * features;
    for (int f = 0; f < features; ++f) xr[f] = counter_normal(config.data_seed, stream, row * features + f);
    // The teacher, a fixed sparse linear map (cheap for wide models): label = argmax over
    // classes c of x[c] + x[(3c + 1) mod F] / 2.
    int best = 0;
    float best_score = -1e30f;
    for (int c = 0; c < features; ++c) {
      const float score = xr[c] + 0.5f * xr[(3 * c + 1) % features];
      if (score > best_score) {
        best_score = score;
        best = c;
      }
    }
    labels[r] = best;
  }
}

std::vector<GroupSpec> linear_stack_groups(const LinearStackConfig& config) {
  std::vector<GroupSpec> groups;
  const auto features = static_cast<int64_t>(config.features);
  const auto width = static_cast<int64_t>(config.width);
  groups.push_back({"embed", {{"weight", {features, width}, TensorInit::normal(1.0f / std::sqrt(float(features))), true}}});
  for (int l = 1; l <= config.layers; ++l) {
    groups.push_back({"layer." + std::to_string(l),
                      {{"weight", {width, width}, TensorInit::normal(1.0f / std::sqrt(float(width))), true},
                       {"bias", {width}, TensorInit::zeros(), false}}});
  }
  return groups;
}

std::vector<int> linear_stack_schedule(const LinearStackConfig& config) {
  std::vector<int> uses;
  for (int l = 0; l <= config.layers; ++l) uses.push_back(l);  // embed, layers
  uses.push_back(0);                                           // output layer (tied)
  uses.push_back(0);                                           // its backward
  for (int l = config.layers; l >= 1; --l) uses.push_back(l);  // layers backward
  uses.push_back(0);                                           // embed backward
  return uses;
}

lm::FlopShape linear_stack_flop_shape(const LinearStackConfig& config) {
  const int64_t f = config.features, w = config.width;
  lm::FlopShape shape;
  shape.data_input_weights = f * w;  // x . E
  shape.matmul_weights = shape.data_input_weights + config.layers * w * w + w * f;  // x . E, h . W_l, h_L . E^T
  return shape;
}

size_t linear_stack_activation_bytes(const LinearStackConfig& config, int local_rows, DType param_dtype) {
  const size_t rows = static_cast<size_t>(local_rows);
  const size_t f = static_cast<size_t>(config.features), w = static_cast<size_t>(config.width);
  const size_t l = static_cast<size_t>(config.layers);
  size_t bytes = 0;
  bytes += round_buffer(rows * f * 4);            // x
  bytes += round_buffer(rows * 4);                // labels
  bytes += round_buffer((l + 1) * rows * w * 4);  // h
  bytes += round_buffer(std::max<size_t>(l, 1) * rows * w * 4);  // pre-activations
  bytes += round_buffer(rows * f * 4);            // logits / dlogits
  bytes += round_buffer(rows * 4) + 4096;         // losses, mean loss
  bytes += 2 * round_buffer(rows * w * 4);        // activation gradients
  if (param_dtype != DType::kFloat32) {
    bytes += round_buffer(f * w * 4 + 4096);      // fp32 copies of gathered parameters
    bytes += round_buffer(w * w * 4 + w * 4 + 4096);
  }
  return bytes;
}

LinearStackModel::~LinearStackModel() {
  // The stream's error (if any) was the failed step's, already returned to its caller.
  if (!x_.empty()) (void)engine_.compute_stream().synchronize();
}

StatusOr<std::unique_ptr<LinearStackModel>> LinearStackModel::create(Engine& engine, const LinearStackConfig& config, int rank,
                                                                      int world_size, bool declare_schedule) {
  if (config.features < 2 || config.width < 1 || config.layers < 1)
    return InvalidArgumentError("linear stack: features >= 2, width >= 1 and layers >= 1 are needed");
  if (config.global_rows % world_size != 0)
    return InvalidArgumentError("linear stack: " + std::to_string(config.global_rows) + " rows per micro-batch do not split over " +
                                std::to_string(world_size) + " ranks");
  std::unique_ptr<LinearStackModel> model(new LinearStackModel(engine, config, rank));
  model->local_rows_ = config.global_rows / world_size;
  for (const auto& spec : linear_stack_groups(config)) {
    STRATA_ASSIGN_OR_RETURN(int id, engine.register_group(spec));
    (void)id;
  }
  if (declare_schedule) STRATA_RETURN_IF_ERROR(engine.declare_schedule(linear_stack_schedule(config)));
  return model;
}

Status LinearStackModel::allocate() {
  Device& device = engine_.device();
  const size_t rows = static_cast<size_t>(local_rows_);
  const size_t f = static_cast<size_t>(config_.features), w = static_cast<size_t>(config_.width);
  const size_t l = static_cast<size_t>(config_.layers);
  // BlasOptions' defaults: the 32 MiB cuBLAS workspace NVIDIA advises for Hopper.
  STRATA_ASSIGN_OR_RETURN(kernels::BlasContext blas, kernels::BlasContext::create(device, kernels::BlasOptions{}));
  blas_ = std::make_unique<kernels::BlasContext>(std::move(blas));
  STRATA_ASSIGN_OR_RETURN(x_, device.allocate(rows * f * 4, "linear stack inputs"));
  STRATA_ASSIGN_OR_RETURN(labels_, device.allocate(rows * 4, "linear stack labels"));
  STRATA_ASSIGN_OR_RETURN(h_, device.allocate((l + 1) * rows * w * 4, "linear stack activations"));
  STRATA_ASSIGN_OR_RETURN(pre_, device.allocate(l * rows * w * 4, "linear stack pre-activations"));
  STRATA_ASSIGN_OR_RETURN(logits_, device.allocate(rows * f * 4, "linear stack logits"));
  STRATA_ASSIGN_OR_RETURN(losses_, device.allocate(rows * 4, "linear stack losses"));
  STRATA_ASSIGN_OR_RETURN(mean_loss_, device.allocate(4, "linear stack mean loss"));
  STRATA_ASSIGN_OR_RETURN(grad_a_, device.allocate(rows * w * 4, "linear stack activation gradients"));
  STRATA_ASSIGN_OR_RETURN(grad_b_, device.allocate(rows * w * 4, "linear stack activation gradients"));
  if (engine_.layout(0).tensors.empty()) return InternalError("linear stack: group 0 has no tensors");
  const DType dtype = DType::kFloat32;
  (void)dtype;
  return {};
}

StatusOr<const float*> LinearStackModel::as_fp32(const GroupView& view, size_t elements, DeviceBuffer& scratch) {
  // Without compute nothing reads the parameters: no cast either.
  if (view.dtype == DType::kFloat32 || config_.compute == StackCompute::kNone) return static_cast<const float*>(view.flat);
  if (scratch.empty()) {
    STRATA_ASSIGN_OR_RETURN(scratch, engine_.device().allocate(std::max(elements, engine_.layout(1).numel) * 4, "fp32 parameter copy"));
  }
  if (scratch.size() < elements * 4) return InternalError("linear stack: fp32 scratch too small");
  STRATA_RETURN_IF_ERROR(kernels::cast(engine_.compute_stream(), view.flat, view.dtype, scratch.data(), DType::kFloat32, elements));
  return scratch.as<const float>();
}

namespace {

// The three matmul shapes of the stack for `rows` rows.
struct StackShapes {
  kernels::MatmulShape embed;  // features -> width
  kernels::MatmulShape layer;  // width -> width
  kernels::MatmulShape head;   // width -> features, the tied embedding transposed
};

StackShapes stack_shapes(size_t rows, size_t f, size_t w) {
  return StackShapes{.embed = {rows, f, w, kernels::WeightLayout::kInOut},
                     .layer = {rows, w, w, kernels::WeightLayout::kInOut},
                     .head = {rows, w, f, kernels::WeightLayout::kOutIn}};
}

}  // namespace

// What forward() and backward() of one micro-batch share: this rank's sizes and the shapes.
struct LinearStackModel::Step {
  Stream& stream;
  size_t rows;  // this rank's rows of the micro-batch
  size_t f, w;  // features, width
  int layers;
  StackShapes shapes;
  size_t embed_numel;  // group 0's elements
};

// The device work of a step; with StackCompute::kNone only the engine's protocol runs.
Status LinearStackModel::launch(const std::function<Status()>& work) const {
  return config_.compute == StackCompute::kKernels ? work() : Status();
}

float* LinearStackModel::activations(int layer) {
  return h_.as<float>() + static_cast<size_t>(layer) * static_cast<size_t>(local_rows_) * static_cast<size_t>(config_.width);
}

float* LinearStackModel::pre_activations(int layer) {
  return pre_.as<float>() +
         static_cast<size_t>(layer - 1) * static_cast<size_t>(local_rows_) * static_cast<size_t>(config_.width);
}

Status LinearStackModel::forward_backward(int64_t step, int micro, int micro_batches, double* loss) {
  Stream& stream = engine_.compute_stream();
  Device& device = engine_.device();
  const size_t rows = static_cast<size_t>(local_rows_);
  const size_t f = static_cast<size_t>(config_.features);
  // Host inputs: this rank's rows of the global micro-batch. The buffers stay untouched
  // until the step's end (the copies read them asynchronously).
  float* hx = host_x_.data() + static_cast<size_t>(micro) * rows * f;
  int32_t* hl = host_labels_.data() + static_cast<size_t>(micro) * rows;
  make_batch(config_, step, micro, rank_ * local_rows_, local_rows_, hx, hl);
  STRATA_RETURN_IF_ERROR(launch([&] { return device.copy_async(x_.data(), hx, rows * f * 4, CopyKind::kHostToDevice, stream); }));
  STRATA_RETURN_IF_ERROR(launch([&] { return device.copy_async(labels_.data(), hl, rows * 4, CopyKind::kHostToDevice, stream); }));
  const size_t w = static_cast<size_t>(config_.width);
  const Step s{.stream = stream, .rows = rows, .f = f, .w = w, .layers = config_.layers,
               .shapes = stack_shapes(rows, f, w), .embed_numel = engine_.layout(0).numel};
  if (Status status = forward(s, micro, micro_batches); !status.ok()) return status;
  if (Status status = backward(s); !status.ok()) return status;
  (void)loss;
  return {};
}

// Embedding, the layers, the tied head and the fused loss of one micro-batch; the mean
// loss is copied into micro_losses_[micro].
Status LinearStackModel::forward(const Step& s, int micro, int micro_batches) {
  Stream& stream = s.stream;
  Device& device = engine_.device();
  const size_t rows = s.rows, f = s.f, w = s.w;
  const int layers = s.layers;
  const StackShapes& shapes = s.shapes;
  const size_t embed_numel = s.embed_numel;
  STRATA_ASSIGN_OR_RETURN(GroupView embed, engine_.gather(0));
  STRATA_ASSIGN_OR_RETURN(const float* e, as_fp32(embed, embed_numel, scratch_embed_));
  STRATA_RETURN_IF_ERROR(launch([&] { return kernels::matmul_forward(stream, *blas_, shapes.embed, DType::kFloat32, x_.data(), e, nullptr, activations(0)); }));
  STRATA_RETURN_IF_ERROR(engine_.release(0));
  for (int l = 1; l <= layers; ++l) {
    STRATA_ASSIGN_OR_RETURN(GroupView layer, engine_.gather(l));
    STRATA_ASSIGN_OR_RETURN(const float* p, as_fp32(layer, engine_.layout(l).numel, scratch_layer_));
    const float* weight = p;
    const float* bias = p + engine_.layout(l).tensors[1].offset;
    STRATA_RETURN_IF_ERROR(launch([&] { return kernels::matmul_forward(stream, *blas_, shapes.layer, DType::kFloat32, activations(l - 1), weight, bias, pre_activations(l)); }));
    STRATA_RETURN_IF_ERROR(launch([&] { return kernels::gelu_forward(stream, DType::kFloat32, pre_activations(l), activations(l), rows * w); }));
    STRATA_RETURN_IF_ERROR(engine_.release(l));
  }
  STRATA_ASSIGN_OR_RETURN(embed, engine_.gather(0));
  STRATA_ASSIGN_OR_RETURN(e, as_fp32(embed, embed_numel, scratch_embed_));
  STRATA_RETURN_IF_ERROR(launch([&] { return kernels::matmul_forward(stream, *blas_, shapes.head, DType::kFloat32, activations(layers), e, nullptr, logits_.data()); }));
  STRATA_RETURN_IF_ERROR(engine_.release(0));
  // The objective is the mean over all rows of all ranks and micro-batches, times the
  // loss scale: each rank's rows contribute 1 / (global rows x micro-batches).
  const float grad_scale = engine_.loss_scale() / static_cast<float>(config_.global_rows * micro_batches);
  const kernels::CrossEntropyShape ce{rows, f, -1};
  STRATA_RETURN_IF_ERROR(launch([&] { return kernels::cross_entropy_fused(stream, ce, DType::kFloat32, logits_.data(), labels_.as<int32_t>(), grad_scale,
                                                      losses_.as<float>(), mean_loss_.as<float>(), logits_.data()); }));
  float* loss_out = &micro_losses_[static_cast<size_t>(micro)];
  STRATA_RETURN_IF_ERROR(launch([&] { return device.copy_async(loss_out, mean_loss_.data(), 4, CopyKind::kDeviceToHost, stream); }));
  return {};
}

// The head, the layers (each layer's gradients handed to the engine as they are done)
// and the embedding, back from the loss gradient forward() left in logits_.
Status LinearStackModel::backward(const Step& s) {
  Stream& stream = s.stream;
  const size_t rows = s.rows, w = s.w;
  const int layers = s.layers;
  const StackShapes& shapes = s.shapes;
  const size_t embed_numel = s.embed_numel;
  const kernels::GradOptions accumulate_params{kernels::GradWrite::kOverwrite, kernels::GradWrite::kAccumulate};
  STRATA_ASSIGN_OR_RETURN(GroupView embed, engine_.gather(0));
  STRATA_ASSIGN_OR_RETURN(const float* e, as_fp32(embed, embed_numel, scratch_embed_));
  STRATA_ASSIGN_OR_RETURN(GroupView d_embed, engine_.gradient_buffer(0));
  STRATA_RETURN_IF_ERROR(launch([&] { return kernels::matmul_backward(stream, *blas_, shapes.head, DType::kFloat32, logits_.data(), activations(layers), e,
                                                  grad_a_.data(), static_cast<float*>(d_embed.tensors[0]), nullptr, accumulate_params); }));
  STRATA_RETURN_IF_ERROR(engine_.release(0));
  void* dh = grad_a_.data();
  void* dh_next = grad_b_.data();
  for (int l = layers; l >= 1; --l) {
    STRATA_ASSIGN_OR_RETURN(GroupView layer, engine_.gather(l));
    STRATA_ASSIGN_OR_RETURN(const float* p, as_fp32(layer, engine_.layout(l).numel, scratch_layer_));
    STRATA_ASSIGN_OR_RETURN(GroupView d_layer, engine_.gradient_buffer(l));
    STRATA_RETURN_IF_ERROR(launch([&] { return kernels::gelu_backward(stream, DType::kFloat32, dh, pre_activations(l), dh, rows * w, kernels::GradWrite::kOverwrite); }));
    STRATA_RETURN_IF_ERROR(launch([&] { return kernels::matmul_backward(stream, *blas_, shapes.layer, DType::kFloat32, dh, activations(l - 1), p, dh_next,
                                                    static_cast<float*>(d_layer.tensors[0]), static_cast<float*>(d_layer.tensors[1]),
                                                    accumulate_params); }));
    STRATA_RETURN_IF_ERROR(engine_.release(l));
    STRATA_RETURN_IF_ERROR(engine_.grads_ready(l));
    std::swap(dh, dh_next);
  }
  STRATA_ASSIGN_OR_RETURN(embed, engine_.gather(0));
  STRATA_ASSIGN_OR_RETURN(e, as_fp32(embed, embed_numel, scratch_embed_));
  STRATA_RETURN_IF_ERROR(launch([&] { return kernels::matmul_backward(stream, *blas_, shapes.embed, DType::kFloat32, dh, x_.data(), e, nullptr,
                                                  static_cast<float*>(d_embed.tensors[0]), nullptr, accumulate_params); }));
  STRATA_RETURN_IF_ERROR(engine_.release(0));
  STRATA_RETURN_IF_ERROR(engine_.grads_ready(0));
  return {};
}

StatusOr<StepReport> LinearStackModel::train_step(int64_t step, int micro_batches, double learning_rate) {
  const size_t rows = static_cast<size_t>(local_rows_);
  host_x_.resize(static_cast<size_t>(micro_batches) * rows * static_cast<size_t>(config_.features));
  host_labels_.resize(static_cast<size_t>(micro_batches) * rows);
  micro_losses_.assign(static_cast<size_t>(micro_batches), 0.0f);
  STRATA_RETURN_IF_ERROR(engine_.begin_step(learning_rate));
  for (int micro = 0; micro < micro_batches; ++micro) {
    if (micro > 0) STRATA_RETURN_IF_ERROR(engine_.begin_micro_batch());
    double ignored = 0.0;
    STRATA_RETURN_IF_ERROR(forward_backward(step, micro, micro_batches, &ignored));
  }
  // The losses were copied in stream order; wait for them (and for the host inputs to
  // have been read) before the next step reuses the buffers.
  STRATA_RETURN_IF_ERROR(engine_.compute_stream().synchronize());
  double loss = 0.0;
  for (float l : micro_losses_) loss += l;
  loss /= micro_batches;
  return engine_.step(loss);
}

}  // namespace strata::models
