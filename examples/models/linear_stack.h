// A synthetic model for the engine's tests and `strata-bench step`: a stack of square
// linear layers with GELU between them, framed by a tied input/output projection.
//
//   h0     = x . E                      E: [features, width]    (group 0, "embed")
//   h_l    = gelu(h_{l-1} . W_l + b_l)  W_l: [width, width]     (group l, "layer.l")
//   logits = h_L . E^T                  the output layer is E again (tied)
//   loss   = mean cross-entropy(logits, labels)
//
// Group 0 is gathered four times per micro-batch (input projection, output layer, and
// both again in backward), so the engine's "a group used more than once, its gradients
// adding up until its last use" path is always exercised. The data is a deterministic
// teacher task: x ~ N(0, 1) keyed by (seed, step, micro-batch, global row), label =
// argmax(x . T) for a fixed sparse T, so every world size sees the same global batch.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "engine/core/device.h"
#include "engine/engine.h"
#include "examples/lm/model_flops.h"
#include "kernels/blas_context.h"

namespace strata::models {

// What a step computes. kNone runs the engine's whole protocol (every gather, release,
// gradient buffer and grads_ready of a real step, in the same order) and no kernels: the
// host stages (NVMe, copies, gradient landing, CPU Adam) at the pace a device that
// computes in no time would leave them, which the CPU device's own compute otherwise hides
// by sharing the cores and the memory bus with them. Gradients stay zero; Adam's work does
// not depend on their values.
enum class StackCompute : uint8_t { kKernels, kNone };

struct LinearStackConfig {
  int features = 32;        // input features = classes
  int width = 64;
  int layers = 3;           // hidden square layers
  int global_rows = 16;     // rows per micro-batch over all ranks
  uint64_t data_seed = 7;
  StackCompute compute = StackCompute::kKernels;
};

// The micro-batch rows [row_begin, row_begin + rows) of step `step`, micro-batch `micro`.
void make_batch(const LinearStackConfig& config, int64_t step, int micro, int row_begin, int rows, float* x, int32_t* labels);

// The groups the model registers, in order (group 0 = embed, then layer.1 ... layer.L).
std::vector<GroupSpec> linear_stack_groups(const LinearStackConfig& config);
// One micro-batch's group uses: forward then backward.
std::vector<int> linear_stack_schedule(const LinearStackConfig& config);
// Its model FLOPs per row (no attention): the input projection (whose input is the data,
// so no input gradient), the hidden layers and the tied output layer.
lm::FlopShape linear_stack_flop_shape(const LinearStackConfig& config);
// Device bytes the model allocates for `local_rows` rows (activations, scratch).
size_t linear_stack_activation_bytes(const LinearStackConfig& config, int local_rows, DType param_dtype);

class LinearStackModel {
 public:
  // Registers the groups with `engine` (before engine.start()); `declare_schedule` false
  // lets the engine record it on the first step.
  static StatusOr<std::unique_ptr<LinearStackModel>> create(Engine& engine, const LinearStackConfig& config, int rank,
                                                            int world_size, bool declare_schedule);
  // Waits for the kernels still queued on the engine's compute stream (a step that failed
  // part-way leaves some) before the activations they use are freed. Destroy the model
  // before the engine.
  ~LinearStackModel();
  LinearStackModel(const LinearStackModel&) = delete;
  LinearStackModel& operator=(const LinearStackModel&) = delete;

  // After engine.start(): allocates activations on the engine's device.
  Status allocate();
  // One step: micro_batches micro-batches forward and backward, then engine.step().
  // Returns this rank's mean loss over its rows and micro-batches.
  StatusOr<StepReport> train_step(int64_t step, int micro_batches, double learning_rate);

 private:
  LinearStackModel(Engine& engine, const LinearStackConfig& config, int rank)
      : engine_(engine), config_(config), rank_(rank) {}
  Status forward_backward(int64_t step, int micro, int micro_batches, double* loss);
  struct Step;  // one micro-batch's sizes and shapes
  Status forward(const Step& s, int micro, int micro_batches);  // after forward_backward's input copies
  Status backward(const Step& s);
  Status launch(const std::function<Status()>& work) const;  // runs `work` when the stack computes
  float* activations(int layer);      // h_ of `layer` (0: the embedding's output)
  float* pre_activations(int layer);  // pre_ of `layer` (1..layers)
  // The gathered group as fp32 (a cast into scratch when parameters are 16-bit).
  StatusOr<const float*> as_fp32(const GroupView& view, size_t elements, DeviceBuffer& scratch);

  Engine& engine_;
  LinearStackConfig config_;
  int rank_;
  int local_rows_ = 0;
  std::unique_ptr<kernels::BlasContext> blas_;
  DeviceBuffer x_, labels_, h_, pre_, logits_, losses_, mean_loss_, grad_a_, grad_b_;
  DeviceBuffer scratch_embed_, scratch_layer_;
  std::vector<float> host_x_;
  std::vector<int32_t> host_labels_;
  std::vector<float> micro_losses_;
};

}  // namespace strata::models
