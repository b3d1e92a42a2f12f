// The token embedding and the LM head over vocabulary chunks, for every model family
// (GPT-2's tied wte, the Llama family's embed_tokens and lm_head).
//
// The vocabulary table is split into groups of whole rows, so no gather slot, gradient
// buffer or scratch is vocabulary-sized: chunk k holds rows [k*R, k*R + rows(k)) of the
// table, R keeping a chunk within a byte budget of fp32. The table is padded inside the
// model to a multiple of kVocabRowMultiple rows (GPT-2's 50257 -> 50304; a vocabulary
// already a multiple, as Llama 3's 128256, gets none); the padding rows sit at the end of
// the last chunk. They are zero-initialized (TensorInit::rows), never read by a kernel
// (no token or target reaches them, and the head's products cover a chunk's real rows
// only, so their logits never enter a log-sum-exp), so they never get a gradient and
// stay zero under AdamW (no weight decay on the table); Hugging Face loads fill and
// exports write the real rows only (HfTensorSlice::mapped_elements).
//
// The embedding: chunk k is copied into a slot with one zero row appended, and
// embedding_forward reads it with each token mapped to its row in the chunk or, for a
// token of another chunk, to the zero row; the chunks' outputs add up exactly (one of
// them is the token's row, the others zeros). The backward writes through the same
// mapping into an fp32 scratch whose extra row collects the other chunks' tokens, and
// adds the chunk's rows into its gradient.
//
// The head: only one chunk of the weight is gathered at a time, so the full-vocabulary
// cross-entropy is assembled from per-chunk pieces with the existing kernels, exactly up
// to fp32 rounding:
//   pass 1  per chunk k and row block: logits = x . W_k^T; cross_entropy_forward gives each
//           row's chunk log-sum-exp lse_k and, in the chunk holding its target, lse_k - logit.
//           Then the rows' [E] vector of lse_k (transposed by a product with an identity)
//           goes through cross_entropy_forward once more, with the target's chunk as the
//           target: its lse is the full log-sum-exp LSE, its loss LSE - lse_k(target).
//           The row's loss is the sum of the two pieces.
//   pass 2  per chunk: logits again, cross_entropy_backward with LSE, so dlogits are the
//           full softmax's; rows whose target is in another chunk are given column 0 as a
//           stand-in target, and the -grad_scale it put there is taken back by one
//           rank-1 product (matmul_backward with a [rows, 1] coefficient) on dx and dW_k.
// A tied table runs pass 2 twice (the input gradient on the way down, the weight gradient
// with the embedding's backward), so the head costs five vocabulary-sized GEMMs (four
// untied) instead of three; an online-softmax cross-entropy kernel would remove the
// recomputation.
//
// A VocabHead computes; the model gathers and releases the chunk groups, hands it their
// views, and calls grads_ready. It can stage several passes at once (GPT-2 measures an
// evaluation batch in its training forward): pass p has its own token inputs and losses.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "engine/engine.h"
#include "examples/lm/causal_lm.h"
#include "examples/lm/host_staging.h"
#include "kernels/blas_context.h"

namespace strata::lm {

// fp32 bytes a vocabulary chunk may hold by default.
inline constexpr size_t kDefaultVocabChunkBytes = size_t{64} << 20;
// The table's rows are padded inside the model to a multiple of this.
inline constexpr int64_t kVocabRowMultiple = 128;

// How a vocabulary of `vocab` tokens is split into chunks of whole rows.
struct VocabChunks {
  int64_t vocab = 0;           // tokens (the checkpoint's rows)
  int64_t padded_vocab = 0;    // rows the model holds: vocab rounded up to kVocabRowMultiple
  int64_t rows_per_chunk = 0;  // every chunk but the last (which also holds the padding)
  int64_t count = 0;

  int64_t first_row(int64_t chunk) const { return chunk * rows_per_chunk; }
  // Rows chunk `chunk`'s group holds, padding included.
  int64_t rows(int64_t chunk) const { return chunk + 1 == count ? padded_vocab - first_row(chunk) : rows_per_chunk; }
  // Its rows that are tokens.
  int64_t real_rows(int64_t chunk) const { return std::min(rows(chunk), vocab - first_row(chunk)); }
  int64_t max_rows() const { return count == 0 ? 0 : std::max(rows_per_chunk, rows(count - 1)); }
  int64_t chunk_of(int64_t token) const { return std::min(token / rows_per_chunk, count - 1); }
};
// Chunks of as many rows as fit `chunk_bytes` of fp32 `hidden`-wide rows (at least one,
// whatever the budget: models check their chunk-size option); a multiple of
// kVocabRowMultiple when that many fit, so every chunk is one; the real rows decide the
// count, so no chunk is all padding.
VocabChunks make_vocab_chunks(int64_t vocab, int64_t hidden, size_t chunk_bytes);

// Chunk k's table tensor: [rows(k), hidden], `init` for its real rows, zeros past them,
// no weight decay.
TensorSpec vocab_chunk_tensor(const VocabChunks& chunks, int64_t chunk, std::string name, int64_t hidden, TensorInit init);
// "<prefix>.<chunk>" -> chunk, or -1.
int64_t vocab_chunk_of_group(std::string_view group, std::string_view prefix);

struct VocabHeadShape {
  int64_t hidden = 0;
  VocabChunks chunks;
  std::vector<int64_t> pass_rows;  // token rows each pass holds at most (pass 0: training)
  int64_t head_rows = 0;           // token rows per head block; 0 = as many as keep the logits under 32 MiB
  DType param_dtype = DType::kFloat32;
  DType compute_dtype = DType::kFloat32;
};

struct VocabHeadPlan {
  size_t bytes = 0;       // the device memory VocabHead::create takes (its own sub-buffers)
  size_t slot_bytes = 0;  // the least a matrix slot it shares with the model must hold
  int64_t head_rows = 0;
  std::vector<std::pair<std::string, size_t>> lines;  // what `bytes` hold, for the log
};
StatusOr<VocabHeadPlan> plan_vocab_head(const VocabHeadShape& shape);

class VocabHead {
 public:
  // `memory`: plan.bytes of device memory for the head alone; `slot`: at least
  // plan.slot_bytes, which the model may use between the head's calls (one chunk in the
  // compute dtype with a zero row: the embedding's table, or a cast head weight).
  static StatusOr<std::unique_ptr<VocabHead>> create(Engine& engine, kernels::BlasContext& blas, const VocabHeadShape& shape, void* memory,
                                                     void* slot);
  ~VocabHead();
  VocabHead(const VocabHead&) = delete;
  VocabHead& operator=(const VocabHead&) = delete;

  const VocabChunks& chunks() const { return shape_.chunks; }
  int64_t head_rows() const { return plan_.head_rows; }

  // Checks `batch` (tokens in the vocabulary, targets -1 or in it) and stages pass `pass`:
  // its `batch.sequences` x `seq_len` rows, the gradient scale (training), and each row's
  // token and target per chunk. `family` names the model in errors. Returns the targets
  // that carry a loss.
  StatusOr<int64_t> stage(int pass, const TokenBatch& batch, int64_t seq_len, float grad_scale, const std::string& family);

  // x0 (pass rows x hidden, compute dtype) gets chunk k's rows (k = 0 writes, later chunks
  // add through `scratch`, as large as x0). `view`: the gathered chunk group.
  Status embed_chunk(int pass, int64_t chunk, const GroupView& view, void* x0, void* scratch);
  // Training pass 0: dweight (chunk k's fp32 gradient) += the embedding's share from dx0.
  Status embed_backward(int64_t chunk, const void* dx0, float* dweight);
  // Pass 1 of chunk k over pass `pass`'s rows of x (the final norm's output).
  Status head_loss_chunk(int pass, int64_t chunk, const GroupView& view, const void* x);
  // After every chunk's pass 1: each row's full log-sum-exp and loss.
  Status head_combine(int pass);
  // Pass 2 of chunk k for training pass 0: dx (+)= (chunk 0 writes) and/or dweight +=.
  Status head_backward_chunk(int64_t chunk, const GroupView& view, const void* x, float* dweight, void* dx);
  // After head_combine(pass): enqueues the copy of pass `pass`'s row losses to the host
  // behind the compute and returns at once (the device is not drained).
  StatusOr<LossTicket> queue_loss(int pass);
  // A queued micro-batch's loss sums (targets -1 excluded), each pass's taken once: waits
  // for their copies only.
  StatusOr<MicroBatchLosses> collect(const QueuedMicroBatch& queued);

 private:
  struct Pass;
  VocabHead(Engine& engine, kernels::BlasContext& blas, const VocabHeadShape& shape, const VocabHeadPlan& plan);
  // Chunk k's real rows in the compute dtype: the gathered tensor, or cast into the slot.
  StatusOr<const void*> weight_of(int64_t chunk, const GroupView& view);
  void* at(size_t offset) const { return static_cast<char*>(memory_) + offset; }

  Engine& engine_;
  kernels::BlasContext& blas_;
  VocabHeadShape shape_;
  VocabHeadPlan plan_;
  void* memory_ = nullptr;
  void* slot_ = nullptr;
  size_t logits_ = 0, dlogits_ = 0, lse_matrix_ = 0, identity_ = 0, grad_scratch_ = 0;
  std::vector<Pass> passes_;
  LossReadback losses_;
};

}  // namespace strata::lm
