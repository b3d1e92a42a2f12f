// Training data for the GPT trainer, all of it usable offline:
//
//   - a deterministic synthetic language whose tokens are equally frequent on their own
//     but predictable in context, with a known entropy rate (the loss floor);
//   - a text file read as bytes (vocabulary 256);
//   - llm.c token files: a header of 256 little-endian int32 (magic 20240520, version 1,
//     token count, the rest zero) followed by the tokens as uint16 — how GPT-2-tokenized
//     datasets are commonly shipped (llm.c dev/data/data_common.py write_datafile); its
//     uint32 variant (magic 20240801, version 7) is read too. Opening one checks every
//     token against the vocabulary (the model's, for the trainer) with a vectorized scan
//     of the memory-mapped file, about 0.2 s per GiB (docs/benchmarks.md);
//   - Strata's fine-tuning token files, the same header with the next version of each
//     magic (20240520 version 2: uint16 tokens; 20240801 version 8: uint32 tokens): the
//     header also records the row length when the data is a set of fixed rows (padded or
//     packed examples of seq_len + 1 tokens), and after the tokens comes one byte of flags
//     per token (bit 0: the token is a loss target; bit 1: a document starts here, position
//     ids restart at 0). scripts/prepare-data writes them; docs/data.md has the layout byte
//     by byte.
//
// The synthetic language. A Markov chain of order 1 or 2 over V tokens: with random
// permutations sigma, tau, rho of the vocabulary and k distinct offsets d_0..d_{k-1}, the
// token after context (..., a, b) is one of
//     order 1:  sigma[(tau[b] + d_j) mod V]               j = 0..k-1, equally likely
//     order 2:  sigma[(tau[b] + rho[a] + d_j) mod V]
// For each j these maps are bijections, so every state (token, or pair of tokens) has
// exactly k successors and k predecessors, each with probability 1/k: the chain is
// doubly stochastic and its stationary distribution is uniform. Samples start in a
// uniformly drawn state, so every position of every sample is uniform over the
// vocabulary, and the entropy rate is exactly ln k nats per token — the floor a model's
// cross-entropy loss approaches. With order 2 even the previous token alone says nothing
// (the next token is uniform given it); only the pair does.
//
// Samples and batches. A sample is seq_len + 1 consecutive tokens, a pure function of
// (data seed, split, sample index): for files, a window at a position drawn from those
// numbers within the split's part of the file (train: the first 1 - eval_fraction of the
// tokens, eval: the rest); for the synthetic language, a fresh walk; for a fine-tuning
// file with rows, row (index mod rows in the split) of the split (train: the first
// 1 - eval_fraction of the rows, eval: the rest) in file order, whatever the seed — a
// fine-tuning set is a set of examples, not a stream to cut windows from.
// Targets are the next token where that token is a loss target, else -1 (ignored); files
// without flags make every token a target. Position ids count from 0 at the sample's first
// token and restart at 0 at every document start (padding after a document carries no
// start, so its positions continue the document's count: transformers' position ids for
// right padding, which is all scripts/prepare-data writes). A position id of 0 marks each
// document start, so a model can keep packed documents from attending to each other. Micro-batch b of
// the run holds global samples [b * global_batch, (b + 1) * global_batch); rank r of N
// takes rows [r * global_batch / N, (r + 1) * global_batch / N). So batches do not depend
// on the world size, and resuming needs only the position (micro-batches consumed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "examples/run_config/run_config.h"
#include "engine/core/status.h"
#include "optim/cpu_isa.h"

namespace strata::data {

// ---------------------------------------------------------------------------------------
// llm.c token files

inline constexpr int32_t kLlmcGpt2Magic = 20240520;    // version 1, uint16 tokens
inline constexpr int32_t kLlmcGpt2Version = 1;
inline constexpr int32_t kLlmcLlama3Magic = 20240801;  // version 7, uint32 tokens
inline constexpr int32_t kLlmcLlama3Version = 7;
inline constexpr size_t kLlmcHeaderInts = 256;
inline constexpr size_t kLlmcHeaderBytes = kLlmcHeaderInts * 4;
inline constexpr int64_t kGpt2VocabSize = 50257;
// Strata's fine-tuning versions of the two magics: a flags byte per token after the tokens.
inline constexpr int32_t kMaskedU16Version = 2;  // with magic 20240520: uint16 tokens
inline constexpr int32_t kMaskedU32Version = 8;  // with magic 20240801: uint32 tokens

// The flags byte of a token in a fine-tuning file. The bits above bit 1 are reserved (0).
inline constexpr uint8_t kTokenIsTarget = 1;         // bit 0: the loss predicts this token
inline constexpr uint8_t kTokenStartsDocument = 2;   // bit 1: position ids restart at 0 here
inline constexpr uint8_t kTokenFlagsReserved = 0xfc;

// The token width and magic: kGpt2 = 20240520, uint16 tokens; kLlama3 = 20240801, uint32.
enum class TokenFileFormat : uint8_t { kGpt2, kLlama3 };

struct TokenFileHeader {
  int32_t magic = 0;
  int32_t version = 0;
  uint64_t token_count = 0;  // header[2]
  size_t token_bytes = 2;    // 2 (magic 20240520) or 4 (magic 20240801)
  // Fine-tuning versions (2 and 8) only; plain llm.c files leave these at their defaults.
  bool has_flags = false;        // a flags byte per token follows the tokens
  uint64_t row_length = 0;       // header[3]: tokens per row (seq_len + 1), 0 = one stream
  int32_t pad_token = -1;        // header[4]: the padding token, -1 = none recorded
  uint64_t target_count = 0;     // header[5]: tokens with kTokenIsTarget
  uint64_t document_count = 0;   // header[6]: tokens with kTokenStartsDocument

  uint64_t flags_offset() const { return kLlmcHeaderBytes + token_count * token_bytes; }
  uint64_t file_bytes() const { return flags_offset() + (has_flags ? token_count : 0); }
};

// Reads and checks the header of `path`: the file holds at least the 1024-byte header,
// header[0] (magic) is 20240520 or 20240801, header[1] (version) is one of that magic's
// (1 or 2; 7 or 8), header[2] (token count) is positive and the file is exactly
// 1024 + count x token bytes (+ count flag bytes for versions 2 and 8). Versions 2 and 8
// also need header[3] (row length) to be 0 or a divisor >= 2 of the count, header[4] (pad
// token) >= -1, header[5] and header[6] (target and document counts) within the count,
// and header[7..255] zero. Errors (kInvalidArgument; kNotFound for a missing file) name
// the file and the field.
StatusOr<TokenFileHeader> read_token_file_header(const std::string& path);
// The checks of read_token_file_header on bytes in memory: `prefix` is the file's first
// min(file_bytes, 1024) bytes (more are ignored), `file_bytes` its size; `where` ("token
// file <path>") starts every message.
StatusOr<TokenFileHeader> parse_token_file_header(std::span<const std::byte> prefix, uint64_t file_bytes, std::string_view where);
// Writes `tokens` in the llm.c format (each must fit the format's token type).
Status write_token_file(const std::string& path, std::span<const int32_t> tokens, TokenFileFormat format = TokenFileFormat::kGpt2);

struct FineTuningFileOptions {
  TokenFileFormat format = TokenFileFormat::kGpt2;  // the token width
  uint64_t row_length = 0;                          // 0 = one stream
  int32_t pad_token = -1;
};
// Writes a fine-tuning token file (version 2 or 8): `tokens`, then `flags` (one per
// token), the target and document counts taken from the flags. The contents must pass
// check_token_file_flags (the writer refuses what the reader would).
Status write_fine_tuning_file(const std::string& path, std::span<const int32_t> tokens, std::span<const uint8_t> flags,
                              const FineTuningFileOptions& options);

// ---------------------------------------------------------------------------------------
// Datasets

enum class DataSplit : uint8_t { kTrain, kEval };
std::string_view data_split_name(DataSplit split);  // "train" | "eval"

struct SyntheticLanguageOptions {
  int64_t vocab_size = 256;
  int order = 1;            // 1 or 2: tokens of context that decide the next token's successors
  int64_t successors = 4;   // k, in [1, vocab_size]: the entropy rate is ln k nats/token
  uint64_t seed = 20240520; // draws the language (permutations and offsets), not the samples
};

struct FileDataOptions {
  double eval_fraction = 0.0;  // share of the tokens held out for eval (the end of the file), in [0, 1)
  int64_t vocab_size = 0;      // token files: the model's vocabulary, 0 = the format's (50257 for GPT-2 files);
                               // every token must be below it (checked at open)
};

// How check_token_file_vocabulary scans (the defaults are what opening a file uses).
struct TokenScanOptions {
  std::optional<CpuIsa> isa;  // unset = the fastest this CPU runs (optim/cpu_isa.h)
  int threads = 0;            // 0 = the cores this process may run on
};

// Every token of the llm.c token file `path` (header as read_token_file_header checks it)
// is below `vocab_size`, scanned over the memory-mapped file with the vectorized scan of
// examples/data/token_scan.h. The error names the file, the first offending token's index
// and byte offset, its value and the vocabulary size. Cost: docs/benchmarks.md.
Status check_token_file_vocabulary(const std::string& path, int64_t vocab_size, const TokenScanOptions& options = {});

// The flags of a fine-tuning file (nothing to check in a plain llm.c file): no reserved
// bit set; no token both a target and a document start (the first token of a document
// has nothing before it in its document to be predicted from); every row's first token
// starts a document (a row is an example: nothing before it is visible); and the counts
// of targets and document starts equal header[5] and header[6]. The error names the file,
// the first offending token's index and byte offset, and the rule.
Status check_token_file_flags(const std::string& path);
// The same checks on flags in memory (`flags` holds header.token_count bytes; byte offsets
// in messages count from header.flags_offset()); `where` ("token file <path>") starts
// every message.
Status check_token_flags(std::span<const uint8_t> flags, const TokenFileHeader& header, std::string_view where);

class TokenDataset {
 public:
  static StatusOr<std::shared_ptr<const TokenDataset>> synthetic(const SyntheticLanguageOptions& options);
  // A text file read as bytes: vocabulary 256.
  static StatusOr<std::shared_ptr<const TokenDataset>> open_text_file(const std::string& path, const FileDataOptions& options);
  // An llm.c or fine-tuning token file (header checked as read_token_file_header does,
  // every token checked against the vocabulary as check_token_file_vocabulary does, the
  // flags as check_token_file_flags does). The vocabulary is options.vocab_size (the
  // model's) when set, else the format's: 50257 for llm.c GPT-2 files, 2^16 for uint16
  // fine-tuning files, 2^31 - 1 for uint32 files.
  static StatusOr<std::shared_ptr<const TokenDataset>> open_token_file(const std::string& path, const FileDataOptions& options);
  // From the config's strata.data section; `synthetic` gives the synthetic language's
  // shape (the trainer sets its vocab_size from the model), and its vocab_size is the
  // bound every token of a token file is checked against.
  static StatusOr<std::shared_ptr<const TokenDataset>> open(const DataConfig& config, const SyntheticLanguageOptions& synthetic);

  virtual ~TokenDataset() = default;

  virtual int64_t vocab_size() const = 0;
  // The entropy rate in nats/token when it is known (the synthetic language: ln k).
  virtual std::optional<double> entropy_floor() const = 0;
  // "synthetic order-1 language: vocab 256, 4 successors, floor 1.3863 nats/token", ...
  virtual std::string describe() const = 0;
  // Tokens in a split, or nullopt when unbounded (synthetic).
  virtual std::optional<uint64_t> split_tokens(DataSplit split) const = 0;

  // Fills `tokens` (any length >= 1) with sample `index` of `split` under data seed `seed`.
  // Thread-safe. Errors name the file and position (a token past the vocabulary, a split
  // shorter than the sample).
  virtual Status sample(DataSplit split, uint64_t seed, uint64_t index, std::span<int32_t> tokens) const = 0;

  // Fine-tuning files with rows: the row length (every sample is one row, seq_len + 1 =
  // row length), else nullopt (samples of any length).
  virtual std::optional<uint64_t> row_length() const { return std::nullopt; }
  // As sample, and `flags` (as long as `tokens`) gets each token's flags. Data without
  // flags makes every token a target and only the sample's first token a document start.
  virtual Status sample_with_flags(DataSplit split, uint64_t seed, uint64_t index, std::span<int32_t> tokens,
                                   std::span<uint8_t> flags) const;

  // Tokens [first, first + tokens.size()) of the whole file, whatever the splits and rows
  // (the strided windows of a perplexity evaluation). Synthetic data has no file:
  // kFailedPrecondition. A range past the end: kInvalidArgument naming the file's length.
  virtual Status tokens_at(uint64_t first, std::span<int32_t> tokens) const;
  // Tokens in the whole file (nullopt for synthetic data).
  virtual std::optional<uint64_t> total_tokens() const { return std::nullopt; }
};

// The synthetic language's next-token table, for tests and diagnostics: the k successors
// of context (previous, last) (order 1 ignores `previous`).
std::vector<int32_t> synthetic_successors(const SyntheticLanguageOptions& options, int32_t previous, int32_t last);

// ---------------------------------------------------------------------------------------
// Batches

struct DataLoaderOptions {
  int64_t global_batch = 1;     // rows per micro-batch over all ranks (micro batch per GPU x world size)
  int64_t seq_len = 0;          // tokens per row
  int micro_batches = 1;        // gradient accumulation steps: micro-batch index = step * micro_batches + micro
  int rank = 0;
  int world_size = 1;
  uint64_t seed = 0;            // the data seed (which samples), not the language's
  DataSplit split = DataSplit::kTrain;
};

class DataLoader {
 public:
  // Errors name the bad option: global_batch not a multiple of world_size, seq_len < 1,
  // rank out of range, a split too short for one sample, an eval split of a file
  // dataset with eval_fraction 0, a seq_len + 1 other than a fine-tuning file's rows.
  static StatusOr<DataLoader> create(std::shared_ptr<const TokenDataset> dataset, const DataLoaderOptions& options);

  const TokenDataset& dataset() const { return *dataset_; }
  const DataLoaderOptions& options() const { return options_; }
  int64_t local_rows() const { return options_.global_batch / options_.world_size; }
  // Elements of inputs and of targets: local_rows x seq_len.
  size_t batch_elements() const { return static_cast<size_t>(local_rows() * options_.seq_len); }

  // Micro-batch `batch_index` (counted over the run): this rank's rows, row-major
  // [local_rows, seq_len]; targets[t] is the sample's token t + 1 when it is a loss target,
  // else -1; positions[t] is token t's position id (0 at the row's first token and at each
  // document start, else the previous one's + 1). The overloads without positions give
  // the same inputs and targets.
  Status batch_at(uint64_t batch_index, std::span<int32_t> inputs, std::span<int32_t> targets,
                  std::span<int32_t> positions) const;
  Status batch_at(uint64_t batch_index, std::span<int32_t> inputs, std::span<int32_t> targets) const;
  // Micro-batch `micro` of step `step`: batch_at(step * micro_batches + micro).
  Status batch(int64_t step, int micro, std::span<int32_t> inputs, std::span<int32_t> targets,
               std::span<int32_t> positions) const;
  Status batch(int64_t step, int micro, std::span<int32_t> inputs, std::span<int32_t> targets) const;

  // Sequential use: the batch at position(), then position() + 1.
  Status next(std::span<int32_t> inputs, std::span<int32_t> targets, std::span<int32_t> positions);
  Status next(std::span<int32_t> inputs, std::span<int32_t> targets);
  uint64_t position() const { return position_; }  // micro-batches consumed
  void set_position(uint64_t position) { position_ = position; }
  // {"position": N, "seed": S, "split": "train", "global_batch": B, "seq_len": T} and back;
  // restoring refuses a state saved with another seed, split, global batch or seq_len
  // (the batches would differ), naming the field.
  std::string state_json() const;
  Status restore_json(std::string_view json);

 private:
  DataLoader(std::shared_ptr<const TokenDataset> dataset, const DataLoaderOptions& options)
      : dataset_(std::move(dataset)), options_(options) {}
  Status fill(uint64_t batch_index, std::span<int32_t> inputs, std::span<int32_t> targets,
              std::optional<std::span<int32_t>> positions) const;
  std::shared_ptr<const TokenDataset> dataset_;
  DataLoaderOptions options_;
  uint64_t position_ = 0;
};

}  // namespace strata::data
