#include "examples/gpt/token_data.h"

#include <fcntl.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "engine/core/file.h"
#include "engine/core/executor.h"
#include "engine/counter_rng.h"
#include "examples/gpt/token_scan.h"

namespace strata::gpt {

namespace {

using json = nlohmann::json;

// splitmix64: the language's construction (permutations, offsets) draws from this; it is
// fully specified, unlike std::uniform_int_distribution, so the language is the same on
// every platform.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound), without modulo bias (rejection).
  uint64_t below(uint64_t bound) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
    uint64_t value;
    do {
      value = next();
    } while (value >= limit);
    return value % bound;
  }

 private:
  uint64_t state_;
};

std::vector<int32_t> random_permutation(int64_t size, SplitMix64& rng) {
  std::vector<int32_t> permutation(static_cast<size_t>(size));
  std::iota(permutation.begin(), permutation.end(), 0);
  for (int64_t i = size - 1; i > 0; --i) {
    std::swap(permutation[static_cast<size_t>(i)], permutation[rng.below(static_cast<uint64_t>(i) + 1)]);
  }
  return permutation;
}

__extension__ using Uint128 = unsigned __int128;

// A stream of counter-based random 32-bit words for one sample: Philox keyed by the data
// seed, counter (sample index, split and stream tag, block).
class SampleRandom {
 public:
  SampleRandom(uint64_t seed, DataSplit split, uint64_t index, uint32_t tag)
      : key_{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)},
        counter_{static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                 (static_cast<uint32_t>(split) << 16) | tag, 0} {}
  uint32_t next() {
    if (used_ == 4) {
      block_ = philox4x32(counter_, key_);
      ++counter_[3];
      used_ = 0;
    }
    return block_[used_++];
  }
  // Uniform in [0, bound) for bound <= 2^32 (multiply-shift on 64 random bits; the bias is
  // below bound / 2^64).
  uint64_t below(uint64_t bound) {
    const uint64_t bits = (static_cast<uint64_t>(next()) << 32) | next();
    return static_cast<uint64_t>((static_cast<Uint128>(bits) * bound) >> 64);
  }

 private:
  std::array<uint32_t, 2> key_;
  std::array<uint32_t, 4> counter_;
  std::array<uint32_t, 4> block_{};
  int used_ = 4;
};

constexpr uint32_t kTagSynthetic = 0x5359;
constexpr uint32_t kTagWindow = 0x5749;


StatusOr<File> open_read_only(const std::string& path, std::string_view what) {
  StatusOr<File> file = File::open(path);
  if (!file.ok() && file.status().error_number() == ENOENT) {
    return NotFoundError(std::string(what) + " " + path + " does not exist");
  }
  return file;
}

std::string format_nats(double value) {
  std::ostringstream out;
  out.precision(5);
  out << value;
  return out.str();
}

// ---------------------------------------------------------------------------------------

class SyntheticDataset final : public TokenDataset {
 public:
  explicit SyntheticDataset(const SyntheticLanguageOptions& options) : options_(options) {
    SplitMix64 rng(options.seed);
    sigma_ = random_permutation(options.vocab_size, rng);
    tau_ = random_permutation(options.vocab_size, rng);
    rho_ = random_permutation(options.vocab_size, rng);
    // k distinct offsets: the first k of a random permutation.
    std::vector<int32_t> offsets = random_permutation(options.vocab_size, rng);
    offsets_.assign(offsets.begin(), offsets.begin() + options.successors);
  }

  int64_t vocab_size() const override { return options_.vocab_size; }
  std::optional<double> entropy_floor() const override { return std::log(static_cast<double>(options_.successors)); }
  std::string describe() const override {
    return "synthetic order-" + std::to_string(options_.order) + " language: vocab " + std::to_string(options_.vocab_size) +
           ", " + std::to_string(options_.successors) + " successors per context, entropy floor " +
           format_nats(*entropy_floor()) + " nats/token";
  }
  std::optional<uint64_t> split_tokens(DataSplit) const override { return std::nullopt; }

  int32_t successor(int32_t previous, int32_t last, uint64_t j) const {
    const int64_t v = options_.vocab_size;
    int64_t position = tau_[static_cast<size_t>(last)] + offsets_[j];
    if (options_.order == 2) position += rho_[static_cast<size_t>(previous)];
    return sigma_[static_cast<size_t>(position % v)];
  }

  Status sample(DataSplit split, uint64_t seed, uint64_t index, std::span<int32_t> tokens) const override {
    if (tokens.empty()) return Status::Ok();
    SampleRandom random(seed, split, index, kTagSynthetic);
    const auto v = static_cast<uint64_t>(options_.vocab_size);
    // A uniformly drawn state: the chain's stationary distribution.
    int32_t previous = static_cast<int32_t>(random.below(v));
    int32_t last = static_cast<int32_t>(random.below(v));
    tokens[0] = last;
    const auto k = static_cast<uint64_t>(options_.successors);
    for (size_t t = 1; t < tokens.size(); ++t) {
      const int32_t next = successor(previous, last, random.below(k));
      previous = last;
      last = next;
      tokens[t] = next;
    }
    return Status::Ok();
  }

 private:
  SyntheticLanguageOptions options_;
  std::vector<int32_t> sigma_, tau_, rho_, offsets_;
};

// A token stream in a file: `header_bytes` then tokens of `token_bytes` each.
class FileDataset final : public TokenDataset {
 public:
  FileDataset(std::string path, File file, std::string kind, uint64_t header_bytes, size_t token_bytes, uint64_t tokens,
              int64_t vocab_size, double eval_fraction)
      : path_(std::move(path)),
        file_(std::move(file)),
        kind_(std::move(kind)),
        header_bytes_(header_bytes),
        token_bytes_(token_bytes),
        tokens_(tokens),
        vocab_size_(vocab_size) {
    eval_tokens_ = static_cast<uint64_t>(std::llround(static_cast<double>(tokens) * eval_fraction));
  }
  FileDataset(const FileDataset&) = delete;
  FileDataset& operator=(const FileDataset&) = delete;

  int64_t vocab_size() const override { return vocab_size_; }
  std::optional<double> entropy_floor() const override { return std::nullopt; }
  std::string describe() const override {
    return kind_ + " " + path_ + ": " + std::to_string(tokens_) + " tokens (" + std::to_string(tokens_ - eval_tokens_) +
           " train, " + std::to_string(eval_tokens_) + " eval), vocab " + std::to_string(vocab_size_);
  }
  std::optional<uint64_t> split_tokens(DataSplit split) const override {
    return split == DataSplit::kTrain ? tokens_ - eval_tokens_ : eval_tokens_;
  }

  Status sample(DataSplit split, uint64_t seed, uint64_t index, std::span<int32_t> tokens) const override {
    const uint64_t begin = split == DataSplit::kTrain ? 0 : tokens_ - eval_tokens_;
    const uint64_t end = split == DataSplit::kTrain ? tokens_ - eval_tokens_ : tokens_;
    const uint64_t length = tokens.size();
    if (end - begin < length) {
      return InvalidArgumentError(kind_ + " " + path_ + ": the " + std::string(data_split_name(split)) + " split has " +
                                  std::to_string(end - begin) + " tokens, fewer than one sample of " + std::to_string(length) +
                                  (split == DataSplit::kEval ? " (raise strata.data.eval_fraction or shorten the sequence)"
                                                             : " (shorten the sequence)"));
    }
    SampleRandom random(seed, split, index, kTagWindow);
    const uint64_t start = begin + random.below(end - begin - length + 1);
    std::vector<unsigned char> raw(length * token_bytes_);
    STRATA_RETURN_IF_ERROR(file_.read_exact(raw.data(), raw.size(), header_bytes_ + start * token_bytes_));
    for (size_t i = 0; i < length; ++i) {
      uint32_t value = 0;
      if (token_bytes_ == 1) value = raw[i];
      else if (token_bytes_ == 2) value = static_cast<uint32_t>(raw[2 * i]) | (static_cast<uint32_t>(raw[2 * i + 1]) << 8);
      else std::memcpy(&value, raw.data() + 4 * i, 4);  // little-endian host
      if (static_cast<int64_t>(value) >= vocab_size_) {
        return InvalidArgumentError(kind_ + " " + path_ + ": token " + std::to_string(start + i) + " is " + std::to_string(value) +
                                    ", outside the vocabulary of " + std::to_string(vocab_size_));
      }
      tokens[i] = static_cast<int32_t>(value);
    }
    return Status::Ok();
  }

 private:
  std::string path_;
  File file_;
  std::string kind_;
  uint64_t header_bytes_;
  size_t token_bytes_;
  uint64_t tokens_;
  int64_t vocab_size_;
  uint64_t eval_tokens_ = 0;
};

Status check_eval_fraction(double eval_fraction, const std::string& path) {
  if (!(eval_fraction >= 0.0 && eval_fraction < 1.0)) {
    return InvalidArgumentError("strata.data.eval_fraction = " + std::to_string(eval_fraction) + " for " + path +
                                ": expected a share in [0, 1)");
  }
  return Status::Ok();
}

}  // namespace

std::string_view data_split_name(DataSplit split) { return split == DataSplit::kTrain ? "train" : "eval"; }

// ---------------------------------------------------------------------------------------
// Token files

StatusOr<TokenFileHeader> read_token_file_header(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(const File file, open_read_only(path, "token file"));
  STRATA_ASSIGN_OR_RETURN(const uint64_t size, file.size());
  std::array<std::byte, kLlmcHeaderBytes> prefix{};
  const size_t prefix_bytes = static_cast<size_t>(std::min<uint64_t>(size, kLlmcHeaderBytes));
  STRATA_RETURN_IF_ERROR(file.read_exact(prefix.data(), prefix_bytes, 0));
  return parse_token_file_header(std::span<const std::byte>(prefix.data(), prefix_bytes), size, "token file " + path);
}

StatusOr<TokenFileHeader> parse_token_file_header(std::span<const std::byte> prefix, uint64_t file_bytes, std::string_view where_view) {
  const std::string where(where_view);
  if (file_bytes < kLlmcHeaderBytes || prefix.size() < kLlmcHeaderBytes) {
    return InvalidArgumentError(where + " is " + std::to_string(file_bytes) + " bytes, shorter than the llm.c header (" +
                                std::to_string(kLlmcHeaderBytes) + " bytes: 256 int32)");
  }
  int32_t header[kLlmcHeaderInts];
  std::memcpy(header, prefix.data(), sizeof(header));
  TokenFileHeader result;
  result.magic = header[0];
  result.version = header[1];
  if (result.magic == kLlmcGpt2Magic) {
    result.token_bytes = 2;
    if (result.version != kLlmcGpt2Version) {
      return InvalidArgumentError(where + ": header[1] (version) is " + std::to_string(result.version) + ", expected " +
                                  std::to_string(kLlmcGpt2Version) + " for magic " + std::to_string(kLlmcGpt2Magic));
    }
  } else if (result.magic == kLlmcLlama3Magic) {
    result.token_bytes = 4;
    if (result.version != kLlmcLlama3Version) {
      return InvalidArgumentError(where + ": header[1] (version) is " + std::to_string(result.version) + ", expected " +
                                  std::to_string(kLlmcLlama3Version) + " for magic " + std::to_string(kLlmcLlama3Magic));
    }
  } else {
    return InvalidArgumentError(where + ": header[0] (magic) is " + std::to_string(result.magic) + ", expected " +
                                std::to_string(kLlmcGpt2Magic) + " (llm.c GPT-2 tokens) or " + std::to_string(kLlmcLlama3Magic) +
                                " (llm.c Llama 3 tokens)");
  }
  if (header[2] <= 0) {
    return InvalidArgumentError(where + ": header[2] (token count) is " + std::to_string(header[2]) + ", expected a positive count");
  }
  result.token_count = static_cast<uint64_t>(header[2]);
  const uint64_t expected = kLlmcHeaderBytes + result.token_count * result.token_bytes;
  if (file_bytes != expected) {
    return InvalidArgumentError(where + ": header[2] (token count) is " + std::to_string(result.token_count) + ", so the file should be " +
                                std::to_string(expected) + " bytes, but it is " + std::to_string(file_bytes) +
                                (file_bytes < expected ? " (truncated?)" : ""));
  }
  return result;
}

Status write_token_file(const std::string& path, std::span<const int32_t> tokens, TokenFileFormat format) {
  const bool gpt2 = format == TokenFileFormat::kGpt2;
  if (tokens.empty() || tokens.size() >= (uint64_t{1} << 31)) {
    return InvalidArgumentError("token file " + path + ": " + std::to_string(tokens.size()) +
                                " tokens; the llm.c format holds 1 to 2^31 - 1");
  }
  int32_t header[kLlmcHeaderInts] = {};
  header[0] = gpt2 ? kLlmcGpt2Magic : kLlmcLlama3Magic;
  header[1] = gpt2 ? kLlmcGpt2Version : kLlmcLlama3Version;
  header[2] = static_cast<int32_t>(tokens.size());
  std::vector<unsigned char> data(kLlmcHeaderBytes + tokens.size() * (gpt2 ? 2 : 4));
  std::memcpy(data.data(), header, kLlmcHeaderBytes);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t token = tokens[i];
    if (token < 0 || (gpt2 && token > 0xffff)) {
      return InvalidArgumentError("token file " + path + ": token " + std::to_string(i) + " is " + std::to_string(token) +
                                  ", which does not fit " + (gpt2 ? "uint16" : "uint32"));
    }
    if (gpt2) {
      data[kLlmcHeaderBytes + 2 * i] = static_cast<unsigned char>(token & 0xff);
      data[kLlmcHeaderBytes + 2 * i + 1] = static_cast<unsigned char>(token >> 8);
    } else {
      std::memcpy(data.data() + kLlmcHeaderBytes + 4 * i, &token, 4);
    }
  }
  STRATA_ASSIGN_OR_RETURN(File file, File::open(path, {.flags = O_WRONLY | O_CREAT | O_TRUNC}));
  STRATA_RETURN_IF_ERROR(file.write_all(data.data(), data.size()));
  STRATA_RETURN_IF_ERROR(file.close());
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------
// Datasets

StatusOr<std::shared_ptr<const TokenDataset>> TokenDataset::synthetic(const SyntheticLanguageOptions& options) {
  if (options.vocab_size < 2 || options.vocab_size > (int64_t{1} << 31) - 1) {
    return InvalidArgumentError("synthetic language: vocab_size " + std::to_string(options.vocab_size) + " must be in [2, 2^31)");
  }
  if (options.order != 1 && options.order != 2) {
    return InvalidArgumentError("synthetic language: order " + std::to_string(options.order) + " must be 1 or 2");
  }
  if (options.successors < 1 || options.successors > options.vocab_size) {
    return InvalidArgumentError("synthetic language: successors " + std::to_string(options.successors) + " must be in [1, " +
                                std::to_string(options.vocab_size) + "] (the vocabulary)");
  }
  return std::shared_ptr<const TokenDataset>(std::make_shared<SyntheticDataset>(options));
}

StatusOr<std::shared_ptr<const TokenDataset>> TokenDataset::open_text_file(const std::string& path, const FileDataOptions& options) {
  STRATA_RETURN_IF_ERROR(check_eval_fraction(options.eval_fraction, path));
  STRATA_ASSIGN_OR_RETURN(File file, open_read_only(path, "text file"));
  STRATA_ASSIGN_OR_RETURN(const uint64_t size, file.size());
  if (size == 0) return InvalidArgumentError("text file " + path + " is empty");
  return std::shared_ptr<const TokenDataset>(std::make_shared<FileDataset>(
      path, std::move(file), "text file", 0, 1, size, 256, options.eval_fraction));
}

namespace {

// A read-only memory map of a whole file; unmapped by the destructor.
class ReadOnlyMapping {
 public:
  static StatusOr<ReadOnlyMapping> map(const File& file, uint64_t bytes) {
    void* data = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, file.fd(), 0);
    if (data == MAP_FAILED) return IoError("mmap " + file.path() + " (" + std::to_string(bytes) + " bytes): " + std::strerror(errno));
    // One pass front to back: let the kernel read ahead.
    ::madvise(data, bytes, MADV_SEQUENTIAL);
    return ReadOnlyMapping(data, bytes);
  }
  ReadOnlyMapping(ReadOnlyMapping&& other) noexcept : data_(std::exchange(other.data_, nullptr)), bytes_(other.bytes_) {}
  ReadOnlyMapping& operator=(ReadOnlyMapping&&) = delete;
  ReadOnlyMapping(const ReadOnlyMapping&) = delete;
  ~ReadOnlyMapping() {
    if (data_ != nullptr) ::munmap(data_, bytes_);
  }
  const unsigned char* bytes() const { return static_cast<const unsigned char*>(data_); }

 private:
  ReadOnlyMapping(void* data, uint64_t bytes) : data_(data), bytes_(bytes) {}
  void* data_;
  uint64_t bytes_;
};

}  // namespace

Status check_token_file_vocabulary(const std::string& path, int64_t vocab_size, const TokenScanOptions& options) {
  if (vocab_size < 1) return InvalidArgumentError("token file " + path + ": vocab_size " + std::to_string(vocab_size) + " must be positive");
  STRATA_ASSIGN_OR_RETURN(const TokenFileHeader header, read_token_file_header(path));
  STRATA_ASSIGN_OR_RETURN(const File file, open_read_only(path, "token file"));
  const uint64_t file_bytes = kLlmcHeaderBytes + header.token_count * header.token_bytes;  // the header check proved the size
  STRATA_ASSIGN_OR_RETURN(const ReadOnlyMapping mapping, ReadOnlyMapping::map(file, file_bytes));
  STRATA_ASSIGN_OR_RETURN(const TokenScanKernels kernels, token_scan_kernels(options.isa.value_or(best_cpu_isa())));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Executor> executor, make_executor({.threads = options.threads}));
  const TokenSpan tokens{.data = mapping.bytes() + kLlmcHeaderBytes, .token_bytes = header.token_bytes, .count = header.token_count};
  const std::optional<uint64_t> bad = find_token_at_or_above(tokens, static_cast<uint64_t>(vocab_size), kernels, *executor);
  if (!bad) return {};
  uint32_t value = 0;
  std::memcpy(&value, mapping.bytes() + kLlmcHeaderBytes + *bad * header.token_bytes, header.token_bytes);  // little-endian host
  return InvalidArgumentError("token file " + path + ": token " + std::to_string(*bad) + " (byte offset " +
                              std::to_string(kLlmcHeaderBytes + *bad * header.token_bytes) + ") is " + std::to_string(value) +
                              ", at or above the vocabulary size " + std::to_string(vocab_size) +
                              " (the first such token; was the file tokenized for another model?)");
}

StatusOr<std::shared_ptr<const TokenDataset>> TokenDataset::open_token_file(const std::string& path, const FileDataOptions& options) {
  STRATA_RETURN_IF_ERROR(check_eval_fraction(options.eval_fraction, path));
  STRATA_ASSIGN_OR_RETURN(const TokenFileHeader header, read_token_file_header(path));
  int64_t vocab = options.vocab_size;
  if (vocab == 0) vocab = header.token_bytes == 2 ? kGpt2VocabSize : (int64_t{1} << 31) - 1;
  if (vocab < 1) return InvalidArgumentError("token file " + path + ": vocab_size " + std::to_string(vocab) + " must be positive");
  STRATA_RETURN_IF_ERROR(check_token_file_vocabulary(path, vocab));
  STRATA_ASSIGN_OR_RETURN(File file, open_read_only(path, "token file"));
  return std::shared_ptr<const TokenDataset>(std::make_shared<FileDataset>(
      path, std::move(file), "token file", kLlmcHeaderBytes, header.token_bytes, header.token_count, vocab, options.eval_fraction));
}

StatusOr<std::shared_ptr<const TokenDataset>> TokenDataset::open(const DataConfig& config, const SyntheticLanguageOptions& synthetic) {
  FileDataOptions file_options;
  file_options.eval_fraction = config.eval_fraction;
  switch (config.kind) {
    case DataKind::kSynthetic: return TokenDataset::synthetic(synthetic);
    case DataKind::kText:
      if (config.path.empty()) return InvalidArgumentError("strata.data.path is required for data kind 'text'");
      return open_text_file(config.path, file_options);
    case DataKind::kTokens:
      if (config.path.empty()) return InvalidArgumentError("strata.data.path is required for data kind 'tokens'");
      // The model's vocabulary bounds the tokens, whatever the file's format allows.
      file_options.vocab_size = synthetic.vocab_size;
      return open_token_file(config.path, file_options);
  }
  return InvalidArgumentError("unknown data kind");
}

std::vector<int32_t> synthetic_successors(const SyntheticLanguageOptions& options, int32_t previous, int32_t last) {
  const SyntheticDataset language(options);
  std::vector<int32_t> successors;
  for (int64_t j = 0; j < options.successors; ++j) successors.push_back(language.successor(previous, last, static_cast<uint64_t>(j)));
  return successors;
}

// ---------------------------------------------------------------------------------------
// DataLoader

StatusOr<DataLoader> DataLoader::create(std::shared_ptr<const TokenDataset> dataset, const DataLoaderOptions& options) {
  if (dataset == nullptr) return InvalidArgumentError("data loader: no dataset");
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return InvalidArgumentError("data loader: rank " + std::to_string(options.rank) + " of world size " +
                                std::to_string(options.world_size));
  }
  if (options.global_batch < 1 || options.global_batch % options.world_size != 0) {
    return InvalidArgumentError("data loader: the global batch of " + std::to_string(options.global_batch) +
                                " rows does not split evenly over " + std::to_string(options.world_size) + " ranks");
  }
  if (options.seq_len < 1) return InvalidArgumentError("data loader: seq_len " + std::to_string(options.seq_len) + " must be >= 1");
  if (options.micro_batches < 1) {
    return InvalidArgumentError("data loader: micro_batches " + std::to_string(options.micro_batches) + " must be >= 1");
  }
  const auto tokens = dataset->split_tokens(options.split);
  if (tokens.has_value() && *tokens < static_cast<uint64_t>(options.seq_len) + 1) {
    if (options.split == DataSplit::kEval && *tokens == 0) {
      return InvalidArgumentError("data loader: " + dataset->describe() +
                                  " has no eval split (strata.data.eval_fraction is 0); set it to hold out data for eval loss");
    }
    return InvalidArgumentError("data loader: the " + std::string(data_split_name(options.split)) + " split of " +
                                dataset->describe() + " has " + std::to_string(*tokens) +
                                " tokens, fewer than one sample (seq_len + 1 = " + std::to_string(options.seq_len + 1) + ")");
  }
  return DataLoader(std::move(dataset), options);
}

Status DataLoader::batch_at(uint64_t batch_index, std::span<int32_t> inputs, std::span<int32_t> targets) const {
  const size_t elements = batch_elements();
  if (inputs.size() != elements || targets.size() != elements) {
    return InvalidArgumentError("data loader: a batch is " + std::to_string(local_rows()) + " x " + std::to_string(options_.seq_len) +
                                " = " + std::to_string(elements) + " tokens; got buffers of " + std::to_string(inputs.size()) +
                                " and " + std::to_string(targets.size()));
  }
  const auto seq_len = static_cast<size_t>(options_.seq_len);
  std::vector<int32_t> sample(seq_len + 1);
  const uint64_t first_row = batch_index * static_cast<uint64_t>(options_.global_batch) +
                             static_cast<uint64_t>(options_.rank) * static_cast<uint64_t>(local_rows());
  for (int64_t row = 0; row < local_rows(); ++row) {
    STRATA_RETURN_IF_ERROR(dataset_->sample(options_.split, options_.seed, first_row + static_cast<uint64_t>(row), sample));
    const size_t base = static_cast<size_t>(row) * seq_len;
    std::copy(sample.begin(), sample.end() - 1, inputs.begin() + static_cast<ptrdiff_t>(base));
    std::copy(sample.begin() + 1, sample.end(), targets.begin() + static_cast<ptrdiff_t>(base));
  }
  return Status::Ok();
}

Status DataLoader::batch(int64_t step, int micro, std::span<int32_t> inputs, std::span<int32_t> targets) const {
  if (step < 0 || micro < 0 || micro >= options_.micro_batches) {
    return InvalidArgumentError("data loader: step " + std::to_string(step) + ", micro-batch " + std::to_string(micro) + " of " +
                                std::to_string(options_.micro_batches));
  }
  return batch_at(static_cast<uint64_t>(step) * static_cast<uint64_t>(options_.micro_batches) + static_cast<uint64_t>(micro),
                  inputs, targets);
}

Status DataLoader::next(std::span<int32_t> inputs, std::span<int32_t> targets) {
  STRATA_RETURN_IF_ERROR(batch_at(position_, inputs, targets));
  ++position_;
  return Status::Ok();
}

std::string DataLoader::state_json() const {
  json state = {{"position", position_},
                {"seed", options_.seed},
                {"split", std::string(data_split_name(options_.split))},
                {"global_batch", options_.global_batch},
                {"seq_len", options_.seq_len}};
  return state.dump();
}

Status DataLoader::restore_json(std::string_view text) {
  const json state = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (state.is_discarded() || !state.is_object()) {
    return InvalidArgumentError("data loader state is not a JSON object: '" + std::string(text.substr(0, 200)) + "'");
  }
  auto field = [&](const char* name) -> const json* {
    const auto it = state.find(name);
    return it == state.end() ? nullptr : &*it;
  };
  const json* position = field("position");
  const json* seed = field("seed");
  const json* split = field("split");
  const json* global_batch = field("global_batch");
  const json* seq_len = field("seq_len");
  if (position == nullptr || !position->is_number_unsigned() || seed == nullptr || !seed->is_number_integer() ||
      split == nullptr || !split->is_string() || global_batch == nullptr || !global_batch->is_number_integer() ||
      seq_len == nullptr || !seq_len->is_number_integer()) {
    return InvalidArgumentError("data loader state '" + std::string(text.substr(0, 200)) +
                                "' lacks position, seed, split, global_batch or seq_len");
  }
  if (seed->get<uint64_t>() != options_.seed) {
    return InvalidArgumentError("data loader state was saved with data seed " + std::to_string(seed->get<uint64_t>()) +
                                ", this run uses " + std::to_string(options_.seed));
  }
  if (split->get<std::string>() != data_split_name(options_.split)) {
    return InvalidArgumentError("data loader state is for the " + split->get<std::string>() + " split, this loader reads " +
                                std::string(data_split_name(options_.split)));
  }
  if (global_batch->get<int64_t>() != options_.global_batch) {
    return InvalidArgumentError("data loader state was saved with a global batch of " + std::to_string(global_batch->get<int64_t>()) +
                                " rows, this run uses " + std::to_string(options_.global_batch));
  }
  if (seq_len->get<int64_t>() != options_.seq_len) {
    return InvalidArgumentError("data loader state was saved with seq_len " + std::to_string(seq_len->get<int64_t>()) +
                                ", this run uses " + std::to_string(options_.seq_len));
  }
  position_ = position->get<uint64_t>();
  return Status::Ok();
}

}  // namespace strata::gpt
