// What every transformer family's model holds and does the same way (GPT-2, the Llama
// family): the engine it runs on, its options and groups, the activation plan, the two BLAS
// contexts (the blocks' and the vocabulary head's), the gradients tests capture; create()
// (the shapes checked, the groups registered, the schedule declared), allocate() (the plan
// for the engine's device) and the activations' lifetime; the vocabulary head and the losses
// read from it. A family derives its model from TransformerModel<Model, Options, Groups>,
// gives create() its recipe (ModelRecipe) and writes only its blocks, its buffers and its
// passes.
#pragma once

#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/engine.h"
#include "examples/lm/causal_lm.h"
#include "examples/lm/model_memory.h"
#include "examples/lm/pinned_block_inputs.h"
#include "examples/lm/transformer_layout.h"
#include "examples/lm/vocab_chunks.h"
#include "kernels/blas_context.h"

namespace strata::lm {

// Registers `specs` with `engine` in order; each must get the id of its place (the model's
// groups are registered first). Errors start with `family` ("GPT model").
Status register_model_groups(Engine& engine, std::span<const GroupSpec> specs, std::string_view family);

// The activation memory every family's buffers hold: one device arena its layout carves
// and, under kPinnedHost, the pinned block inputs. A family's buffers derive from it.
struct ActivationArena {
  virtual ~ActivationArena() = default;  // the model owns a family's buffers through this base

  DeviceBuffer arena;
  PinnedBlockInputs pinned;  // kPinnedHost

  void* at(size_t offset) const { return static_cast<char*>(arena.data()) + offset; }
};

// What create() needs of a family besides its model's constructor.
template <class Options>
struct ModelRecipe {
  std::string_view family;                       // starts the registration's errors ("GPT model")
  Options (*resolve)(const Options& options);   // the defaults the model fills in (a sequence length, ...)
  // The activation plan; its errors name a bad shape, so create() checks the shapes with it.
  StatusOr<TransformerActivationPlan> (*plan)(const Options& options, DeviceKind device);
  std::vector<GroupSpec> (*group_specs)(const Options& options, const VocabChunks& chunks);
  // The schedule the model declares; empty: the engine records it on the first step.
  std::vector<int> (*declared_schedule)(const Options& options, const VocabChunks& chunks);
};

// Model: the family's model class, which befriends this base and gives it
// `static const ModelRecipe<Options> kRecipe`, a constructor (Engine&, const Options&, const
// TransformerActivationPlan&) and `Status allocate_buffers()`. Options: its model options
// (ModelRunOptions and capture_gradients); Groups: its group ids.
template <class Model, class Options, class Groups>
class TransformerModel : public CausalLm {
 public:
  TransformerModel(const TransformerModel&) = delete;
  TransformerModel& operator=(const TransformerModel&) = delete;

  // Registers the groups with `engine` (first: ids from 0), declares the family's schedule
  // when it declares one, and that no gradient waits between uses of its group (each is
  // filled and handed over in one use), so the engine plans only its two overlapping
  // gradient slots; before engine.start(). The shapes are checked now (allocate() plans for
  // the engine's device).
  static StatusOr<std::unique_ptr<Model>> create(Engine& engine, const Options& options) {
    const ModelRecipe<Options>& recipe = Model::kRecipe;
    const Options resolved = recipe.resolve(options);
    STRATA_ASSIGN_OR_RETURN(const TransformerActivationPlan plan, recipe.plan(resolved, DeviceKind::kCpu));
    std::unique_ptr<Model> model(new Model(engine, resolved, plan));
    STRATA_RETURN_IF_ERROR(register_model_groups(engine, recipe.group_specs(resolved, plan.chunks), recipe.family));
    if (const std::vector<int> schedule = recipe.declared_schedule(resolved, plan.chunks); !schedule.empty()) {
      STRATA_RETURN_IF_ERROR(engine.declare_schedule(schedule));
    }
    STRATA_RETURN_IF_ERROR(engine.declare_held_gradients(0));
    return model;
  }

  ~TransformerModel() override {
    // The buffers must not be freed while the streams still use them; an error here was
    // already reported by the call that enqueued the work (or is the engine's to report).
    if (activations_) (void)activations_->pinned.synchronize();
    if (activations_ && !activations_->arena.empty()) (void)engine_.compute_stream().synchronize();
  }

  // After engine.start(): plans for the engine's device and allocates the activations and
  // what the family uploads once (Model::allocate_buffers).
  Status allocate() final {
    if (activations_) return FailedPreconditionError(std::string(class_name_) + "::allocate() called twice");
    STRATA_ASSIGN_OR_RETURN(plan_, Model::kRecipe.plan(options_, engine_.device().kind()));
    return static_cast<Model&>(*this).allocate_buffers();
  }

  const Options& options() const { return options_; }
  const TransformerActivationPlan& activation_plan() const { return plan_; }
  const Groups& groups() const { return groups_; }
  DType compute_dtype() const { return plan_.compute_dtype; }
  // options.capture_gradients: the last captured full gradient (numel floats) per group id.
  const std::map<int, std::vector<float>>& captured_gradients() const { return captured_; }

  // The losses of a queued micro-batch come from the vocabulary head, in every family.
  StatusOr<MicroBatchLosses> collect(const QueuedMicroBatch& queued) override {
    if (!vocab_) return FailedPreconditionError(std::string(class_name_) + "::collect() before allocate()");
    return vocab_->collect(queued);
  }

 protected:
  // `class_name`: the family's model class, for messages ("GptModel").
  TransformerModel(Engine& engine, const Options& options, const TransformerActivationPlan& plan, const Groups& groups,
                   std::string_view class_name)
      : engine_(engine), options_(options), plan_(plan), groups_(groups), class_name_(class_name) {}

  // allocate_buffers' last step, once all has succeeded: the model keeps `buffers` (freed
  // once the streams are done with them) and the vocabulary head; returns the buffers.
  template <class Buffers>
  Buffers* keep_buffers(std::unique_ptr<Buffers> buffers, std::unique_ptr<VocabHead> vocab) {
    Buffers* kept = buffers.get();
    vocab_ = std::move(vocab);
    activations_ = std::move(buffers);
    return kept;
  }

  // allocate()'s steps that follow the family's layout in every family: both BLAS
  // contexts, `buffers`' arena of layout.total bytes and, under kPinnedHost, its pinned
  // block inputs. `family` names them ("GPT" -> "GPT activations").
  Status allocate_activations(const TransformerLayout& layout, std::string_view family, ActivationArena& buffers) {
    Device& device = engine_.device();
    STRATA_ASSIGN_OR_RETURN(ModelBlas blas, create_model_blas(device));
    blas_ = std::move(blas.blocks);
    head_blas_ = std::move(blas.head);
    STRATA_ASSIGN_OR_RETURN(buffers.arena, device.allocate(layout.total, std::string(family) + " activations"));
    if (options_.checkpointing == ActivationCheckpointing::kPinnedHost) {
      STRATA_ASSIGN_OR_RETURN(buffers.pinned,
                              PinnedBlockInputs::create(device, layout.pinned_slots, layout.pinned_slot_bytes, family));
    }
    return {};
  }

  // The vocabulary chunks' gradients, last in a backward: chunk k (group chunk_group(k))
  // gets its embedding rows' gradient from `dresid` (d loss / d x_0) and, when the head is
  // tied to the embedding, the head's from `head_input` (the final norm's output; null when
  // untied); then its gradient is captured and handed to the engine.
  template <class ChunkGroup>
  Status vocab_chunks_backward(int64_t chunks, const ChunkGroup& chunk_group, const void* head_input, const void* dresid) {
    for (int64_t k = 0; k < chunks; ++k) {
      const int g = chunk_group(k);
      STRATA_ASSIGN_OR_RETURN(GroupView grads, engine_.gradient_buffer(g));
      float* dweight = static_cast<float*>(grads.tensors[0]);
      if (head_input != nullptr) {
        STRATA_ASSIGN_OR_RETURN(GroupView view, engine_.gather(g));
        STRATA_RETURN_IF_ERROR(vocab_->head_backward_chunk(k, view, head_input, dweight, nullptr));
        STRATA_RETURN_IF_ERROR(engine_.release(g));
      }
      STRATA_RETURN_IF_ERROR(vocab_->embed_backward(k, dresid, dweight));
      STRATA_RETURN_IF_ERROR(capture(g, grads));
      STRATA_RETURN_IF_ERROR(engine_.grads_ready(g));
    }
    return {};
  }

  // Copies the group's full gradient to the host when options.capture_gradients asks.
  Status capture(int group, const GroupView& grads) {
    if (!options_.capture_gradients) return {};
    return copy_gradient_to_host(engine_, group, grads, captured_[group]);
  }

  Engine& engine_;
  Options options_;
  TransformerActivationPlan plan_;
  Groups groups_;
  std::unique_ptr<kernels::BlasContext> blas_;       // the blocks: strata.matmul_precision
  std::unique_ptr<kernels::BlasContext> head_blas_;  // the vocabulary head: IEEE fp32 (ModelBlas)
  std::map<int, std::vector<float>> captured_;
  // Set by keep_buffers once the family's allocate_buffers() has succeeded.
  std::unique_ptr<VocabHead> vocab_;
  std::unique_ptr<ActivationArena> activations_;  // the family's buffers
  std::string_view class_name_;
};

// The two Architecture entries every transformer family answers the same way: the plan and
// the model, each from the family's model options for the run (model_options). Model:
// the family's TransformerModel with a static create(Engine&, const Options&); plan: its
// plan function (options, device) -> TransformerActivationPlan.
// The Architecture answers that every transformer family reads straight off its config:
// its sizes and what its forward honours (the accessors of the same names).
struct TransformerDims {
  int64_t vocab_size = 0;
  int64_t context_length = 0;  // the longest sequence it takes
  int64_t hidden_size = 0;     // the width of a block's input
  int64_t layers = 0;
  bool takes_position_ids = false;        // TokenBatch::positions honoured
  bool evaluates_while_training = false;  // one forward also measures an evaluation batch
};

template <class Model, class Options, StatusOr<TransformerActivationPlan> (*plan)(const Options&, DeviceKind)>
class TransformerArchitecture : public Architecture {
 public:
  int64_t vocab_size() const final { return dims_.vocab_size; }
  int64_t context_length() const final { return dims_.context_length; }
  int64_t hidden_size() const final { return dims_.hidden_size; }
  int64_t layers() const final { return dims_.layers; }
  bool takes_position_ids() const final { return dims_.takes_position_ids; }
  bool evaluates_while_training() const final { return dims_.evaluates_while_training; }

  StatusOr<ActivationPlan> plan_activations(const ModelRunOptions& options, DeviceKind device) const override {
    STRATA_ASSIGN_OR_RETURN(const Options model, model_options(options));
    STRATA_ASSIGN_OR_RETURN(const TransformerActivationPlan planned, plan(model, device));
    return planned.summary();
  }
  StatusOr<std::unique_ptr<CausalLm>> create(Engine& engine, const ModelRunOptions& options) const override {
    STRATA_ASSIGN_OR_RETURN(const Options model, model_options(options));
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Model> created, Model::create(engine, model));
    return std::unique_ptr<CausalLm>(std::move(created));
  }

 protected:
  explicit TransformerArchitecture(const TransformerDims& dims) : dims_(dims) {}
  // The family's model options for a run (its config, the run's fields).
  virtual StatusOr<Options> model_options(const ModelRunOptions& options) const = 0;

 private:
  TransformerDims dims_;
};

}  // namespace strata::lm
