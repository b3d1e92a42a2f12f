#include "examples/lm/vocab_chunks.h"

#include <cstring>

#include "examples/lm/model_memory.h"
#include "kernels/cast.h"
#include "kernels/transformer_ops.h"

namespace strata::lm {
namespace {

// The head's logits and their gradient, each [head rows, vocabulary chunk].
constexpr size_t kHeadLogitsTargetBytes = size_t{32} << 20;

// Offsets (bytes) of one pass's sub-buffers within the head's memory.
struct PassLayout {
  size_t embed_tokens = 0, chunk_targets = 0, head_targets = 0, stand_in_targets = 0, fix_coef = 0;
  size_t chunk_lse = 0, chunk_losses = 0, lse_full = 0, loss_lse = 0;
};

struct HeadLayout {
  size_t total = 0;
  int64_t head_rows = 0;
  std::vector<PassLayout> passes;
  size_t logits = 0, dlogits = 0, lse_matrix = 0, identity = 0, grad_scratch = 0;
  size_t inputs_bytes = 0, head_bytes = 0, scratch_bytes = 0;

  size_t add(size_t bytes, size_t* line) {
    const size_t offset = total;
    const size_t reserved = round_up(std::max<size_t>(bytes, 1), kSubBufferAlignment);
    total += reserved;
    *line += reserved;
    return offset;
  }
};

StatusOr<HeadLayout> head_layout(const VocabHeadShape& s) {
  if (s.hidden < 1 || s.chunks.count < 1 || s.pass_rows.empty())
    return InvalidArgumentError("vocabulary head: needs a width, chunks and at least one pass");
  if (s.head_rows < 0) return InvalidArgumentError("vocabulary head: head rows must be >= 0, got " + std::to_string(s.head_rows));
  const size_t cs = dtype_size(s.compute_dtype);
  const size_t H = static_cast<size_t>(s.hidden), E = static_cast<size_t>(s.chunks.count);
  const size_t VC = static_cast<size_t>(s.chunks.max_rows());
  const int64_t max_rows = std::max<int64_t>(1, *std::max_element(s.pass_rows.begin(), s.pass_rows.end()));
  HeadLayout d;
  int64_t head_rows = s.head_rows;
  if (head_rows == 0) head_rows = static_cast<int64_t>(std::max<size_t>(1, kHeadLogitsTargetBytes / (VC * cs)));
  d.head_rows = std::min<int64_t>(head_rows, max_rows);
  const size_t R = static_cast<size_t>(d.head_rows);
  for (int64_t pass_rows : s.pass_rows) {
    const size_t rows = static_cast<size_t>(std::max<int64_t>(pass_rows, 1));
    const size_t blocks = (rows + R - 1) / R;
    PassLayout p;
    p.embed_tokens = d.add(E * rows * 4, &d.inputs_bytes);
    p.chunk_targets = d.add(rows * 4, &d.inputs_bytes);
    p.head_targets = d.add(E * rows * 4, &d.inputs_bytes);
    p.stand_in_targets = d.add(E * rows * 4, &d.inputs_bytes);
    p.fix_coef = d.add(E * rows * cs, &d.inputs_bytes);
    p.chunk_lse = d.add(blocks * E * R * 4, &d.head_bytes);
    p.chunk_losses = d.add(E * rows * 4, &d.head_bytes);
    p.lse_full = d.add(rows * 4, &d.head_bytes);
    p.loss_lse = d.add(rows * 4, &d.head_bytes);
    d.passes.push_back(p);
  }
  d.logits = d.add(R * VC * cs, &d.head_bytes);
  d.dlogits = d.add(R * VC * cs, &d.head_bytes);
  d.lse_matrix = d.add(R * E * 4, &d.head_bytes);
  d.identity = d.add(R * R * 4, &d.head_bytes);
  d.grad_scratch = d.add((VC + 1) * H * 4, &d.scratch_bytes);
  return d;
}

}  // namespace

VocabChunks make_vocab_chunks(int64_t vocab, int64_t hidden, size_t chunk_bytes) {
  VocabChunks chunks;
  chunks.vocab = std::max<int64_t>(vocab, 1);
  chunks.padded_vocab = (chunks.vocab + kVocabRowMultiple - 1) / kVocabRowMultiple * kVocabRowMultiple;
  const int64_t row_bytes = std::max<int64_t>(hidden, 1) * 4;
  int64_t rows = std::clamp<int64_t>(static_cast<int64_t>(chunk_bytes / static_cast<size_t>(row_bytes)), 1, chunks.padded_vocab);
  if (rows >= kVocabRowMultiple) rows = rows / kVocabRowMultiple * kVocabRowMultiple;
  chunks.rows_per_chunk = rows;
  chunks.count = (chunks.vocab + rows - 1) / rows;
  return chunks;
}

TensorSpec vocab_chunk_tensor(const VocabChunks& chunks, int64_t chunk, std::string name, int64_t hidden, TensorInit init) {
  return TensorSpec{std::move(name), {chunks.rows(chunk), hidden}, init.with_rows(chunks.real_rows(chunk)), false};
}

int64_t vocab_chunk_of_group(std::string_view group, std::string_view prefix) {
  if (group.size() <= prefix.size() + 1 || group.substr(0, prefix.size()) != prefix || group[prefix.size()] != '.') return -1;
  int64_t value = 0;
  for (char ch : group.substr(prefix.size() + 1)) {
    if (ch < '0' || ch > '9') return -1;
    value = value * 10 + (ch - '0');
  }
  return value;
}

StatusOr<VocabHeadPlan> plan_vocab_head(const VocabHeadShape& shape) {
  STRATA_ASSIGN_OR_RETURN(HeadLayout d, head_layout(shape));
  VocabHeadPlan plan;
  plan.bytes = d.total;
  plan.head_rows = d.head_rows;
  plan.slot_bytes = static_cast<size_t>(shape.chunks.max_rows() + 1) * static_cast<size_t>(shape.hidden) * dtype_size(shape.compute_dtype);
  const std::string R = std::to_string(d.head_rows), VC = std::to_string(shape.chunks.max_rows()), E = std::to_string(shape.chunks.count);
  plan.lines = {{"per-chunk token ids and targets (" + E + " vocabulary chunks)", d.inputs_bytes},
                {"LM head (" + R + "-row blocks x " + VC + "-row vocabulary chunks)", d.head_bytes},
                {"an embedding chunk's fp32 gradient (+ a row for the other chunks' tokens)", d.scratch_bytes}};
  return plan;
}

// One pass's rows and its staging.
struct VocabHead::Pass {
  PassLayout layout;
  int64_t sequences = 0, seq_len = 0;
  size_t count = 0;     // token rows
  size_t capacity = 0;  // the most token rows it was planned for
  size_t blocks = 0;    // head row blocks
  float grad_scale = 0.0f;
  // Pinned staging of the inputs, copied from after stage() returns; the arrays below
  // point into it for the current fill.
  UploadStaging staging;
  int32_t *embed_tokens = nullptr, *chunk_targets = nullptr, *head_targets = nullptr, *stand_in_targets = nullptr;
  std::byte* fix_coef = nullptr;
};

namespace {

// The host image of a pass's uploaded inputs: the device's arrays in one pinned block.
struct StagingLayout {
  size_t embed_tokens = 0, chunk_targets = 0, head_targets = 0, stand_in_targets = 0, fix_coef = 0, total = 0;
};
StagingLayout staging_layout(size_t rows, size_t chunks, size_t compute_bytes) {
  StagingLayout s;
  auto add = [&](size_t bytes) {
    const size_t offset = s.total;
    s.total += round_up(bytes, 64);
    return offset;
  };
  s.embed_tokens = add(chunks * rows * 4);
  s.chunk_targets = add(rows * 4);
  s.head_targets = add(chunks * rows * 4);
  s.stand_in_targets = add(chunks * rows * 4);
  s.fix_coef = add(chunks * rows * compute_bytes);
  return s;
}

}  // namespace

VocabHead::VocabHead(Engine& engine, kernels::BlasContext& blas, const VocabHeadShape& shape, const VocabHeadPlan& plan)
    : engine_(engine), blas_(blas), shape_(shape), plan_(plan), losses_(engine.device()) {}

VocabHead::~VocabHead() = default;

StatusOr<std::unique_ptr<VocabHead>> VocabHead::create(Engine& engine, kernels::BlasContext& blas, const VocabHeadShape& shape, void* memory,
                                                       void* slot) {
  STRATA_ASSIGN_OR_RETURN(HeadLayout d, head_layout(shape));
  STRATA_ASSIGN_OR_RETURN(VocabHeadPlan plan, plan_vocab_head(shape));
  std::unique_ptr<VocabHead> head(new VocabHead(engine, blas, shape, plan));
  head->memory_ = memory;
  head->slot_ = slot;
  head->logits_ = d.logits;
  head->dlogits_ = d.dlogits;
  head->lse_matrix_ = d.lse_matrix;
  head->identity_ = d.identity;
  head->grad_scratch_ = d.grad_scratch;
  const size_t E = static_cast<size_t>(shape.chunks.count), R = static_cast<size_t>(d.head_rows);
  Device& device = engine.device();
  Stream& stream = engine.compute_stream();
  for (size_t p = 0; p < d.passes.size(); ++p) {
    Pass pass;
    pass.layout = d.passes[p];
    const size_t rows = static_cast<size_t>(std::max<int64_t>(shape.pass_rows[p], 1)), blocks = (rows + R - 1) / R;
    pass.capacity = rows;
    const StagingLayout host = staging_layout(rows, E, dtype_size(shape.compute_dtype));
    STRATA_ASSIGN_OR_RETURN(pass.staging, UploadStaging::create(device, host.total, "vocabulary head inputs, pass " + std::to_string(p)));
    // Zeros where a partial row block leaves the chunk_lse tail unwritten (the identity's zeros multiply it).
    STRATA_RETURN_IF_ERROR(device.memset_async(head->at(pass.layout.chunk_lse), 0, blocks * E * R * 4, stream));
    head->passes_.push_back(std::move(pass));
  }
  // The identity that transposes the chunks' log-sum-exps.
  std::vector<float> identity(R * R, 0.0f);
  for (size_t i = 0; i < R; ++i) identity[i * R + i] = 1.0f;
  STRATA_RETURN_IF_ERROR(device.copy_async(head->at(d.identity), identity.data(), identity.size() * 4, CopyKind::kHostToDevice, stream));
  STRATA_RETURN_IF_ERROR(stream.synchronize());
  return head;
}

StatusOr<int64_t> VocabHead::stage(int pass_index, const TokenBatch& batch, int64_t seq_len, float grad_scale, const std::string& family) {
  Pass& pass = passes_.at(static_cast<size_t>(pass_index));
  const VocabChunks& chunks = shape_.chunks;
  const size_t T = static_cast<size_t>(seq_len);
  const size_t n = static_cast<size_t>(batch.sequences) * T;
  const size_t E = static_cast<size_t>(chunks.count);
  const DType dt = shape_.compute_dtype;
  if (batch.inputs == nullptr || batch.targets == nullptr) return InvalidArgumentError(family + " model: a batch without inputs or targets");
  if (n > pass.capacity)
    return InvalidArgumentError(family + " model: a batch of " + std::to_string(n) + " token rows, the vocabulary head was planned for " +
                                std::to_string(pass.capacity));
  // The previous fill's copies have run (long ago, in a pipeline) before this one is written.
  STRATA_ASSIGN_OR_RETURN(std::byte* host, pass.staging.begin_fill());
  const StagingLayout h = staging_layout(n, E, dtype_size(dt));
  pass.embed_tokens = reinterpret_cast<int32_t*>(host + h.embed_tokens);
  pass.chunk_targets = reinterpret_cast<int32_t*>(host + h.chunk_targets);
  pass.head_targets = reinterpret_cast<int32_t*>(host + h.head_targets);
  pass.stand_in_targets = reinterpret_cast<int32_t*>(host + h.stand_in_targets);
  pass.fix_coef = host + h.fix_coef;
  pass.sequences = batch.sequences;
  pass.seq_len = seq_len;
  pass.count = n;
  pass.blocks = (n + static_cast<size_t>(plan_.head_rows) - 1) / static_cast<size_t>(plan_.head_rows);
  pass.grad_scale = grad_scale;
  int64_t counted = 0;
  for (size_t r = 0; r < n; ++r) {
    const int32_t token = batch.inputs[r], target = batch.targets[r];
    if (token < 0 || token >= chunks.vocab)
      return InvalidArgumentError(family + " model: token " + std::to_string(token) + " at sequence " + std::to_string(r / T) + ", position " +
                                  std::to_string(r % T) + " is outside the vocabulary [0, " + std::to_string(chunks.vocab) + ")");
    if (target < -1 || target >= chunks.vocab)
      return InvalidArgumentError(family + " model: target " + std::to_string(target) + " at sequence " + std::to_string(r / T) + ", position " +
                                  std::to_string(r % T) + " is neither -1 (no loss) nor in the vocabulary [0, " + std::to_string(chunks.vocab) + ")");
    counted += target != -1;
    const int64_t token_chunk = chunks.chunk_of(token), target_chunk = target < 0 ? -1 : chunks.chunk_of(target);
    pass.chunk_targets[r] = static_cast<int32_t>(target_chunk);
    for (size_t k = 0; k < E; ++k) {
      const int64_t first = chunks.first_row(static_cast<int64_t>(k));
      const size_t i = k * n + r;
      // A token of another chunk reads the zero row appended after this chunk's real rows.
      pass.embed_tokens[i] = static_cast<int32_t>(token_chunk == int64_t(k) ? token - first : chunks.real_rows(int64_t(k)));
      const bool here = target_chunk == int64_t(k);
      pass.head_targets[i] = here ? static_cast<int32_t>(target - first) : -1;
      pass.stand_in_targets[i] = target < 0 ? -1 : (here ? static_cast<int32_t>(target - first) : 0);
      store_from_float(pass.fix_coef, dt, i, target >= 0 && !here ? grad_scale : 0.0f);
    }
  }
  Device& device = engine_.device();
  Stream& stream = engine_.compute_stream();
  const PassLayout& d = pass.layout;
  auto up = [&](size_t offset, const void* host, size_t bytes) { return device.copy_async(at(offset), host, bytes, CopyKind::kHostToDevice, stream); };
  STRATA_RETURN_IF_ERROR(up(d.chunk_targets, pass.chunk_targets, n * 4));
  STRATA_RETURN_IF_ERROR(up(d.embed_tokens, pass.embed_tokens, E * n * 4));
  STRATA_RETURN_IF_ERROR(up(d.head_targets, pass.head_targets, E * n * 4));
  STRATA_RETURN_IF_ERROR(up(d.stand_in_targets, pass.stand_in_targets, E * n * 4));
  STRATA_RETURN_IF_ERROR(up(d.fix_coef, pass.fix_coef, E * n * dtype_size(dt)));
  STRATA_RETURN_IF_ERROR(pass.staging.end_fill(stream));
  return counted;
}

StatusOr<const void*> VocabHead::weight_of(int64_t chunk, const GroupView& view) {
  if (view.dtype != shape_.param_dtype)
    return FailedPreconditionError("vocabulary head: the engine gathers " + std::string(dtype_name(view.dtype)) +
                                   " parameters but the model was planned for " + std::string(dtype_name(shape_.param_dtype)));
  if (view.dtype == shape_.compute_dtype) return static_cast<const void*>(view.tensors[0]);
  const size_t numel = static_cast<size_t>(shape_.chunks.real_rows(chunk) * shape_.hidden);
  STRATA_RETURN_IF_ERROR(kernels::cast(engine_.compute_stream(), view.tensors[0], view.dtype, slot_, shape_.compute_dtype, numel));
  return static_cast<const void*>(slot_);
}

Status VocabHead::embed_chunk(int pass_index, int64_t chunk, const GroupView& view, void* x0, void* scratch) {
  const Pass& pass = passes_.at(static_cast<size_t>(pass_index));
  Stream& stream = engine_.compute_stream();
  Device& device = engine_.device();
  const DType dt = shape_.compute_dtype;
  const size_t cs = dtype_size(dt), H = static_cast<size_t>(shape_.hidden);
  const size_t real_rows = static_cast<size_t>(shape_.chunks.real_rows(chunk));
  // The chunk's real rows (cast when the parameters are in another dtype) and a zero row, in the slot.
  STRATA_ASSIGN_OR_RETURN(const void* weight, weight_of(chunk, view));
  if (weight != slot_)
    STRATA_RETURN_IF_ERROR(device.copy_async(slot_, weight, real_rows * H * cs, CopyKind::kDeviceToDevice, stream));
  STRATA_RETURN_IF_ERROR(device.memset_async(static_cast<char*>(slot_) + real_rows * H * cs, 0, H * cs, stream));
  const kernels::EmbeddingShape shape{static_cast<size_t>(pass.sequences), static_cast<size_t>(pass.seq_len), H, real_rows + 1, 0};
  void* out = chunk == 0 ? x0 : scratch;
  const int32_t* tokens = static_cast<const int32_t*>(at(pass.layout.embed_tokens)) + static_cast<size_t>(chunk) * pass.count;
  STRATA_RETURN_IF_ERROR(kernels::embedding_forward(stream, shape, dt, tokens, slot_, nullptr, out));
  if (chunk > 0) STRATA_RETURN_IF_ERROR(kernels::residual_forward(stream, dt, x0, out, x0, pass.count * H));
  return {};
}

Status VocabHead::embed_backward(int64_t chunk, const void* dx0, float* dweight) {
  const Pass& pass = passes_.at(0);
  Stream& stream = engine_.compute_stream();
  const size_t H = static_cast<size_t>(shape_.hidden);
  const size_t real_rows = static_cast<size_t>(shape_.chunks.real_rows(chunk));
  const kernels::EmbeddingShape shape{static_cast<size_t>(pass.sequences), static_cast<size_t>(pass.seq_len), H, real_rows + 1, 0};
  float* scratch = static_cast<float*>(at(grad_scratch_));
  const int32_t* tokens = static_cast<const int32_t*>(at(pass.layout.embed_tokens)) + static_cast<size_t>(chunk) * pass.count;
  STRATA_RETURN_IF_ERROR(
      kernels::embedding_backward(stream, shape, shape_.compute_dtype, tokens, dx0, scratch, nullptr, kernels::GradWrite::kOverwrite));
  // The padding rows' gradient is left as the engine zeroed it.
  return kernels::residual_forward(stream, DType::kFloat32, dweight, scratch, dweight, real_rows * H);
}

// Pass 1, one chunk: each row's log-sum-exp over the chunk's real rows (into chunk_lse,
// [block][chunk][row in block]) and, in the chunk holding its target, lse_k - logit.
Status VocabHead::head_loss_chunk(int pass_index, int64_t chunk, const GroupView& view, const void* x) {
  STRATA_ASSIGN_OR_RETURN(const void* weight, weight_of(chunk, view));
  const Pass& pass = passes_.at(static_cast<size_t>(pass_index));
  const PassLayout& d = pass.layout;
  Stream& stream = engine_.compute_stream();
  const DType dt = shape_.compute_dtype;
  const size_t cs = dtype_size(dt), H = static_cast<size_t>(shape_.hidden);
  const size_t V = static_cast<size_t>(shape_.chunks.real_rows(chunk));
  const size_t R = static_cast<size_t>(plan_.head_rows), E = static_cast<size_t>(shape_.chunks.count), k = static_cast<size_t>(chunk);
  for (size_t block = 0; block < pass.blocks; ++block) {
    const size_t r0 = block * R, n = std::min(R, pass.count - r0);
    const void* xs = static_cast<const char*>(x) + r0 * H * cs;
    STRATA_RETURN_IF_ERROR(kernels::matmul_forward(stream, blas_, {n, H, V, kernels::WeightLayout::kOutIn}, dt, xs, weight, nullptr, at(logits_)));
    STRATA_RETURN_IF_ERROR(kernels::cross_entropy_forward(stream, {n, V, -1}, dt, at(logits_),
                                                          static_cast<const int32_t*>(at(d.head_targets)) + k * pass.count + r0,
                                                          static_cast<float*>(at(d.chunk_losses)) + k * pass.count + r0,
                                                          static_cast<float*>(at(d.chunk_lse)) + (block * E + k) * R, nullptr));
  }
  return {};
}

// Per row block, the [E, rows] chunk log-sum-exps transposed to [rows, E] (identity .
// chunk_lse^T, exact), then a cross-entropy over the chunks with the target's chunk as
// target: lse_full = the full vocabulary's log-sum-exp, loss_lse = it minus the target
// chunk's.
Status VocabHead::head_combine(int pass_index) {
  const Pass& pass = passes_.at(static_cast<size_t>(pass_index));
  const PassLayout& d = pass.layout;
  Stream& stream = engine_.compute_stream();
  const size_t R = static_cast<size_t>(plan_.head_rows), E = static_cast<size_t>(shape_.chunks.count);
  for (size_t block = 0; block < pass.blocks; ++block) {
    const size_t r0 = block * R, n = std::min(R, pass.count - r0);
    STRATA_RETURN_IF_ERROR(kernels::matmul_forward(stream, blas_, {n, R, E, kernels::WeightLayout::kOutIn}, DType::kFloat32, at(identity_),
                                                   static_cast<const char*>(at(d.chunk_lse)) + block * E * R * 4, nullptr, at(lse_matrix_)));
    STRATA_RETURN_IF_ERROR(kernels::cross_entropy_forward(stream, {n, E, -1}, DType::kFloat32, at(lse_matrix_),
                                                          static_cast<const int32_t*>(at(d.chunk_targets)) + r0,
                                                          static_cast<float*>(at(d.loss_lse)) + r0, static_cast<float*>(at(d.lse_full)) + r0, nullptr));
  }
  return {};
}

// Pass 2, one chunk: dlogits = grad_scale (softmax - onehot) with the full log-sum-exp;
// dx (+)= dlogits . W_k and/or dW_k += dlogits^T . x over the chunk's real rows. A row
// whose target is in another chunk had the stand-in target 0 (its -grad_scale at column
// 0), taken back by the rank-1 product with fix_coef (grad_scale on those rows).
Status VocabHead::head_backward_chunk(int64_t chunk, const GroupView& view, const void* x, float* dweight, void* dx) {
  STRATA_ASSIGN_OR_RETURN(const void* weight, weight_of(chunk, view));
  const Pass& pass = passes_.at(0);
  const PassLayout& d = pass.layout;
  Stream& stream = engine_.compute_stream();
  const DType dt = shape_.compute_dtype;
  const size_t cs = dtype_size(dt), H = static_cast<size_t>(shape_.hidden);
  const size_t V = static_cast<size_t>(shape_.chunks.real_rows(chunk));
  const size_t R = static_cast<size_t>(plan_.head_rows), k = static_cast<size_t>(chunk);
  using kernels::GradWrite;
  for (size_t block = 0; block < pass.blocks; ++block) {
    const size_t r0 = block * R, n = std::min(R, pass.count - r0);
    const void* xs = static_cast<const char*>(x) + r0 * H * cs;
    void* dx_rows = dx == nullptr ? nullptr : static_cast<char*>(dx) + r0 * H * cs;
    const kernels::MatmulShape shape{n, H, V, kernels::WeightLayout::kOutIn};
    STRATA_RETURN_IF_ERROR(kernels::matmul_forward(stream, blas_, shape, dt, xs, weight, nullptr, at(logits_)));
    STRATA_RETURN_IF_ERROR(kernels::cross_entropy_backward(stream, {n, V, -1}, dt, at(logits_),
                                                           static_cast<const int32_t*>(at(d.stand_in_targets)) + k * pass.count + r0,
                                                           static_cast<const float*>(at(d.lse_full)) + r0, pass.grad_scale, at(dlogits_),
                                                           GradWrite::kOverwrite));
    const kernels::GradOptions write{chunk == 0 ? GradWrite::kOverwrite : GradWrite::kAccumulate, GradWrite::kAccumulate};
    STRATA_RETURN_IF_ERROR(kernels::matmul_backward(stream, blas_, shape, dt, at(dlogits_), xs, weight, dx_rows, dweight, nullptr, write));
    const void* coef = static_cast<const char*>(at(d.fix_coef)) + (k * pass.count + r0) * cs;
    STRATA_RETURN_IF_ERROR(kernels::matmul_backward(stream, blas_, {n, H, 1, kernels::WeightLayout::kOutIn}, dt, coef, xs, weight, dx_rows, dweight,
                                                    nullptr, {GradWrite::kAccumulate, GradWrite::kAccumulate}));
  }
  return {};
}

// Each row's loss is loss_lse (LSE minus its target chunk's lse) plus the target chunk's
// piece (that lse minus the target's logit); the other chunks' pieces are 0.
StatusOr<LossTicket> VocabHead::queue_loss(int pass_index) {
  const Pass& pass = passes_.at(static_cast<size_t>(pass_index));
  const PassLayout& d = pass.layout;
  const LossPieces pieces{static_cast<const float*>(at(d.loss_lse)), static_cast<const float*>(at(d.chunk_losses)), pass.count,
                          static_cast<size_t>(shape_.chunks.count), std::span<const int32_t>(pass.chunk_targets, pass.count)};
  return losses_.queue(engine_.compute_stream(), pieces);
}

StatusOr<MicroBatchLosses> VocabHead::collect(const QueuedMicroBatch& queued) {
  MicroBatchLosses losses;
  losses.train_tokens = queued.train_tokens;
  losses.eval_tokens = queued.eval_tokens;
  if (queued.train_loss.serial != 0) {
    STRATA_ASSIGN_OR_RETURN(losses.train_loss_sum, losses_.take(queued.train_loss));
  }
  if (queued.eval_loss.serial != 0) {
    STRATA_ASSIGN_OR_RETURN(losses.eval_loss_sum, losses_.take(queued.eval_loss));
  }
  return losses;
}

}  // namespace strata::lm
