#include "examples/data/token_data.h"

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
#include "examples/data/token_scan.h"

namespace strata::data {

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

// Where a file's tokens (and flags) are: `header_bytes`, then `tokens` tokens of
// `token_bytes` each, then (fine-tuning files) a flags byte per token at `flags_offset`.
struct FileLayout {
  std::string kind;  // "text file", "token file", "fine-tuning file"
  uint64_t header_bytes = 0;
  size_t token_bytes = 1;
  uint64_t tokens = 0;
  std::optional<uint64_t> flags_offset;
  uint64_t row_length = 0;  // 0: samples are windows drawn at random; else rows in file order
};

class FileDataset final : public TokenDataset {
 public:
  FileDataset(std::string path, File file, FileLayout layout, int64_t vocab_size, double eval_fraction)
      : path_(std::move(path)), file_(std::move(file)), layout_(std::move(layout)), vocab_size_(vocab_size) {
    // Rows are examples: the eval split holds whole rows.
    const uint64_t unit = layout_.row_length > 0 ? layout_.row_length : 1;
    eval_tokens_ = static_cast<uint64_t>(std::llround(static_cast<double>(layout_.tokens / unit) * eval_fraction)) * unit;
  }
  FileDataset(const FileDataset&) = delete;
  FileDataset& operator=(const FileDataset&) = delete;

  int64_t vocab_size() const override { return vocab_size_; }
  std::optional<double> entropy_floor() const override { return std::nullopt; }
  std::string describe() const override {
    std::string text = layout_.kind + " " + path_ + ": " + std::to_string(layout_.tokens) + " tokens (" +
                       std::to_string(layout_.tokens - eval_tokens_) + " train, " + std::to_string(eval_tokens_) + " eval)";
    if (layout_.row_length > 0) {
      text += " in rows of " + std::to_string(layout_.row_length) + " (" + std::to_string((layout_.tokens - eval_tokens_) / layout_.row_length) +
              " train, " + std::to_string(eval_tokens_ / layout_.row_length) + " eval)";
    }
    return text + ", vocab " + std::to_string(vocab_size_);
  }
  std::optional<uint64_t> split_tokens(DataSplit split) const override {
    return split == DataSplit::kTrain ? layout_.tokens - eval_tokens_ : eval_tokens_;
  }
  std::optional<uint64_t> row_length() const override {
    return layout_.row_length > 0 ? std::optional<uint64_t>(layout_.row_length) : std::nullopt;
  }

  Status sample(DataSplit split, uint64_t seed, uint64_t index, std::span<int32_t> tokens) const override {
    STRATA_ASSIGN_OR_RETURN(const uint64_t start, sample_start(split, seed, index, tokens.size()));
    return read_tokens(start, tokens);
  }

  std::optional<uint64_t> total_tokens() const override { return layout_.tokens; }
  Status tokens_at(uint64_t first, std::span<int32_t> tokens) const override {
    if (first > layout_.tokens || tokens.size() > layout_.tokens - first)
      return InvalidArgumentError(layout_.kind + " " + path_ + " holds " + std::to_string(layout_.tokens) + " tokens; tokens [" +
                             std::to_string(first) + ", " + std::to_string(first + tokens.size()) + ") were asked");
    return read_tokens(first, tokens);
  }

  Status sample_with_flags(DataSplit split, uint64_t seed, uint64_t index, std::span<int32_t> tokens,
                           std::span<uint8_t> flags) const override {
    if (!layout_.flags_offset) return TokenDataset::sample_with_flags(split, seed, index, tokens, flags);
    if (flags.size() != tokens.size()) return InvalidArgumentError(layout_.kind + " " + path_ + ": flags and tokens of a sample differ in length");
    STRATA_ASSIGN_OR_RETURN(const uint64_t start, sample_start(split, seed, index, tokens.size()));
    STRATA_RETURN_IF_ERROR(read_tokens(start, tokens));
    STRATA_RETURN_IF_ERROR(file_.read_exact(flags.data(), flags.size(), *layout_.flags_offset + start));
    // A window cut from a stream begins a document wherever it starts: nothing before it is visible.
    flags[0] = static_cast<uint8_t>((flags[0] | kTokenStartsDocument) & ~kTokenIsTarget);
    return Status::Ok();
  }

 private:
  // The token index where sample `index` of `split` starts.
  StatusOr<uint64_t> sample_start(DataSplit split, uint64_t seed, uint64_t index, uint64_t length) const {
    const uint64_t begin = split == DataSplit::kTrain ? 0 : layout_.tokens - eval_tokens_;
    const uint64_t end = split == DataSplit::kTrain ? layout_.tokens - eval_tokens_ : layout_.tokens;
    const std::string where = layout_.kind + " " + path_;
    if (layout_.row_length > 0 && length != layout_.row_length) {
      return InvalidArgumentError(where + ": its rows are " + std::to_string(layout_.row_length) + " tokens, a sample of " +
                                  std::to_string(length) + " was asked (set seq_len to " + std::to_string(layout_.row_length - 1) +
                                  ", the length scripts/prepare-data was given)");
    }
    if (end - begin < length) {
      return InvalidArgumentError(where + ": the " + std::string(data_split_name(split)) + " split has " +
                                  std::to_string(end - begin) + " tokens, fewer than one sample of " + std::to_string(length) +
                                  (split == DataSplit::kEval ? " (raise strata.data.eval_fraction or shorten the sequence)"
                                                             : " (shorten the sequence)"));
    }
    if (layout_.row_length > 0) {
      const uint64_t rows = (end - begin) / layout_.row_length;
      return begin + (index % rows) * layout_.row_length;
    }
    SampleRandom random(seed, split, index, kTagWindow);
    return begin + random.below(end - begin - length + 1);
  }

  // Decodes tokens [start, start + tokens.size()) and checks each against the vocabulary.
  Status read_tokens(uint64_t start, std::span<int32_t> tokens) const {
    const size_t length = tokens.size();
    const size_t width = layout_.token_bytes;
    std::vector<unsigned char> raw(length * width);
    STRATA_RETURN_IF_ERROR(file_.read_exact(raw.data(), raw.size(), layout_.header_bytes + start * width));
    for (size_t i = 0; i < length; ++i) {
      uint32_t value = 0;
      if (width == 1) value = raw[i];
      else if (width == 2) value = static_cast<uint32_t>(raw[2 * i]) | (static_cast<uint32_t>(raw[2 * i + 1]) << 8);
      else std::memcpy(&value, raw.data() + 4 * i, 4);  // little-endian host
      if (static_cast<int64_t>(value) >= vocab_size_) {
        return InvalidArgumentError(layout_.kind + " " + path_ + ": token " + std::to_string(start + i) + " is " + std::to_string(value) +
                                    ", outside the vocabulary of " + std::to_string(vocab_size_));
      }
      tokens[i] = static_cast<int32_t>(value);
    }
    return Status::Ok();
  }

  std::string path_;
  File file_;
  FileLayout layout_;
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

namespace {

// header[3..255] of a fine-tuning file (versions 2 and 8).
Status parse_fine_tuning_fields(const int32_t* header, const std::string& where, TokenFileHeader& result) {
  const int32_t row_length = header[3];
  if (row_length < 0 || row_length == 1 || (row_length > 0 && result.token_count % static_cast<uint64_t>(row_length) != 0)) {
    return InvalidArgumentError(where + ": header[3] (row length) is " + std::to_string(row_length) +
                                ", expected 0 (one stream) or a length >= 2 that divides header[2] (token count) " +
                                std::to_string(result.token_count));
  }
  result.row_length = static_cast<uint64_t>(row_length);
  if (header[4] < -1) {
    return InvalidArgumentError(where + ": header[4] (pad token) is " + std::to_string(header[4]) + ", expected a token id or -1 (none)");
  }
  result.pad_token = header[4];
  const char* count_names[] = {"header[5] (target count)", "header[6] (document count)"};
  for (int i = 0; i < 2; ++i) {
    if (header[5 + i] < 0 || static_cast<uint64_t>(header[5 + i]) > result.token_count) {
      return InvalidArgumentError(where + ": " + count_names[i] + " is " + std::to_string(header[5 + i]) + ", expected 0 to the token count " +
                                  std::to_string(result.token_count));
    }
  }
  result.target_count = static_cast<uint64_t>(header[5]);
  result.document_count = static_cast<uint64_t>(header[6]);
  for (size_t i = 7; i < kLlmcHeaderInts; ++i) {
    if (header[i] != 0) {
      return InvalidArgumentError(where + ": header[" + std::to_string(i) + "] is " + std::to_string(header[i]) +
                                  ", expected 0 (reserved in version " + std::to_string(result.version) + ")");
    }
  }
  return Status::Ok();
}

}  // namespace

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
  int32_t plain_version = 0;
  int32_t fine_tuning_version = 0;
  if (result.magic == kLlmcGpt2Magic) {
    result.token_bytes = 2;
    plain_version = kLlmcGpt2Version;
    fine_tuning_version = kMaskedU16Version;
  } else if (result.magic == kLlmcLlama3Magic) {
    result.token_bytes = 4;
    plain_version = kLlmcLlama3Version;
    fine_tuning_version = kMaskedU32Version;
  } else {
    return InvalidArgumentError(where + ": header[0] (magic) is " + std::to_string(result.magic) + ", expected " +
                                std::to_string(kLlmcGpt2Magic) + " (llm.c GPT-2 tokens) or " + std::to_string(kLlmcLlama3Magic) +
                                " (llm.c Llama 3 tokens)");
  }
  if (result.version != plain_version && result.version != fine_tuning_version) {
    return InvalidArgumentError(where + ": header[1] (version) is " + std::to_string(result.version) + ", expected " +
                                std::to_string(plain_version) + " (llm.c tokens) or " + std::to_string(fine_tuning_version) +
                                " (Strata fine-tuning tokens with flags) for magic " + std::to_string(result.magic));
  }
  result.has_flags = result.version == fine_tuning_version;
  if (header[2] <= 0) {
    return InvalidArgumentError(where + ": header[2] (token count) is " + std::to_string(header[2]) + ", expected a positive count");
  }
  result.token_count = static_cast<uint64_t>(header[2]);
  if (result.has_flags) STRATA_RETURN_IF_ERROR(parse_fine_tuning_fields(header, where, result));
  const uint64_t expected = result.file_bytes();
  if (file_bytes != expected) {
    return InvalidArgumentError(where + ": header[2] (token count) is " + std::to_string(result.token_count) + ", so the file should be " +
                                std::to_string(expected) + " bytes" +
                                (result.has_flags ? " (header, tokens of " + std::to_string(result.token_bytes) + " bytes, a flags byte each)" : "") +
                                ", but it is " + std::to_string(file_bytes) + (file_bytes < expected ? " (truncated?)" : ""));
  }
  return result;
}

namespace {

// The flags' counts, and whether any breaks a rule of check_token_flags: one branch-free
// pass (vectorized by the compiler); the slower pass that names the first offender
// (first_flags_violation) runs only on a bad file.
struct FlagsSummary {
  uint64_t targets = 0;
  uint64_t documents = 0;
  bool breaks_a_rule = false;
};

FlagsSummary summarize_flags(std::span<const uint8_t> flags, uint64_t row_length) {
  FlagsSummary summary;
  uint8_t bad = 0;
  for (const uint8_t f : flags) {
    summary.targets += f & kTokenIsTarget;
    summary.documents += (f & kTokenStartsDocument) >> 1;
    bad |= static_cast<uint8_t>((f & kTokenFlagsReserved) | ((f & (f >> 1)) & 1));
  }
  for (uint64_t row = 0; row_length > 0 && row < flags.size(); row += row_length) {
    bad |= static_cast<uint8_t>((flags[row] & kTokenStartsDocument) == 0);
  }
  summary.breaks_a_rule = bad != 0;
  return summary;
}

// The file's bytes: `header`, then `tokens` in the format's width (each must fit it), then `flags`.
Status write_token_bytes(const std::string& path, const int32_t (&header)[kLlmcHeaderInts], std::span<const int32_t> tokens,
                         std::span<const uint8_t> flags, TokenFileFormat format) {
  const bool narrow = format == TokenFileFormat::kGpt2;
  const size_t width = narrow ? 2 : 4;
  std::vector<unsigned char> data(kLlmcHeaderBytes + tokens.size() * width + flags.size());
  std::memcpy(data.data(), header, kLlmcHeaderBytes);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t token = tokens[i];
    if (token < 0 || (narrow && token > 0xffff)) {
      return InvalidArgumentError("token file " + path + ": token " + std::to_string(i) + " is " + std::to_string(token) +
                                  ", which does not fit " + (narrow ? "uint16" : "uint32"));
    }
    unsigned char* out = data.data() + kLlmcHeaderBytes + i * width;
    for (size_t b = 0; b < width; ++b) out[b] = static_cast<unsigned char>(static_cast<uint32_t>(token) >> (8 * b));  // little-endian
  }
  if (!flags.empty()) std::memcpy(data.data() + kLlmcHeaderBytes + tokens.size() * width, flags.data(), flags.size());
  STRATA_ASSIGN_OR_RETURN(File file, File::open(path, {.flags = O_WRONLY | O_CREAT | O_TRUNC}));
  STRATA_RETURN_IF_ERROR(file.write_all(data.data(), data.size()));
  STRATA_RETURN_IF_ERROR(file.close());
  return Status::Ok();
}

Status check_token_count(const std::string& path, size_t count) {
  if (count == 0 || count >= (uint64_t{1} << 31)) {
    return InvalidArgumentError("token file " + path + ": " + std::to_string(count) + " tokens; the llm.c format holds 1 to 2^31 - 1");
  }
  return Status::Ok();
}

}  // namespace

Status write_token_file(const std::string& path, std::span<const int32_t> tokens, TokenFileFormat format) {
  STRATA_RETURN_IF_ERROR(check_token_count(path, tokens.size()));
  const bool gpt2 = format == TokenFileFormat::kGpt2;
  int32_t header[kLlmcHeaderInts] = {};
  header[0] = gpt2 ? kLlmcGpt2Magic : kLlmcLlama3Magic;
  header[1] = gpt2 ? kLlmcGpt2Version : kLlmcLlama3Version;
  header[2] = static_cast<int32_t>(tokens.size());
  return write_token_bytes(path, header, tokens, {}, format);
}

Status write_fine_tuning_file(const std::string& path, std::span<const int32_t> tokens, std::span<const uint8_t> flags,
                              const FineTuningFileOptions& options) {
  STRATA_RETURN_IF_ERROR(check_token_count(path, tokens.size()));
  if (flags.size() != tokens.size()) {
    return InvalidArgumentError("token file " + path + ": " + std::to_string(flags.size()) + " flags for " + std::to_string(tokens.size()) +
                                " tokens; a fine-tuning file has one flags byte per token");
  }
  const bool narrow = options.format == TokenFileFormat::kGpt2;
  TokenFileHeader fields;
  fields.magic = narrow ? kLlmcGpt2Magic : kLlmcLlama3Magic;
  fields.version = narrow ? kMaskedU16Version : kMaskedU32Version;
  fields.token_count = tokens.size();
  fields.token_bytes = narrow ? 2 : 4;
  fields.has_flags = true;
  const FlagsSummary counts = summarize_flags(flags, 0);
  int32_t header[kLlmcHeaderInts] = {};
  header[0] = fields.magic;
  header[1] = fields.version;
  header[2] = static_cast<int32_t>(fields.token_count);
  header[3] = static_cast<int32_t>(std::min<uint64_t>(options.row_length, INT32_MAX));
  header[4] = options.pad_token;
  header[5] = static_cast<int32_t>(counts.targets);
  header[6] = static_cast<int32_t>(counts.documents);
  // Refuse what the reader would refuse, with the reader's words.
  const std::string where = "token file " + path + " (being written)";
  STRATA_RETURN_IF_ERROR(parse_fine_tuning_fields(header, where, fields));
  STRATA_RETURN_IF_ERROR(check_token_flags(flags, fields, where));
  return write_token_bytes(path, header, tokens, flags, options.format);
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
  const FileLayout layout{.kind = "text file", .header_bytes = 0, .token_bytes = 1, .tokens = size};
  return std::shared_ptr<const TokenDataset>(std::make_shared<FileDataset>(path, std::move(file), layout, 256, options.eval_fraction));
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
  // The tokens only (the header check proved the file holds them).
  STRATA_ASSIGN_OR_RETURN(const ReadOnlyMapping mapping, ReadOnlyMapping::map(file, header.flags_offset()));
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

namespace {

struct FlagsViolation {
  uint64_t index = 0;  // the first token that breaks a rule
  std::string rule;    // what it breaks, as the error says it
};

// The first token breaking a rule of check_token_flags (the caller knows one does).
FlagsViolation first_flags_violation(std::span<const uint8_t> flags, uint64_t row_length) {
  for (uint64_t index = 0; index < flags.size(); ++index) {
    const uint8_t f = flags[index];
    if ((f & kTokenFlagsReserved) != 0) {
      return {index, "has reserved bits set (flags " + std::to_string(f) + "; only bits 0 and 1 are defined)"};
    }
    if ((f & kTokenIsTarget) != 0 && (f & kTokenStartsDocument) != 0) {
      return {index, "is both a loss target and a document start (the first token of a document has nothing before it to be predicted from)"};
    }
    if (row_length > 0 && index % row_length == 0 && (f & kTokenStartsDocument) == 0) {
      return {index, "begins row " + std::to_string(index / row_length) + " but does not start a document (every row is an example on its own)"};
    }
  }
  return {flags.size(), "breaks no rule"};
}

}  // namespace

Status check_token_flags(std::span<const uint8_t> flags, const TokenFileHeader& header, std::string_view where_view) {
  const std::string where(where_view);
  if (flags.size() != header.token_count) {
    return InvalidArgumentError(where + ": " + std::to_string(flags.size()) + " flags for " + std::to_string(header.token_count) + " tokens");
  }
  const FlagsSummary summary = summarize_flags(flags, header.row_length);
  if (summary.breaks_a_rule) {
    const FlagsViolation violation = first_flags_violation(flags, header.row_length);
    return InvalidArgumentError(where + ": token " + std::to_string(violation.index) + " (flags byte offset " +
                                std::to_string(header.flags_offset() + violation.index) + ") " + violation.rule);
  }
  if (summary.targets != header.target_count || summary.documents != header.document_count) {
    return InvalidArgumentError(where + ": the flags mark " + std::to_string(summary.targets) + " loss targets and " +
                                std::to_string(summary.documents) +
                                " document starts, but header[5] and header[6] say " + std::to_string(header.target_count) + " and " +
                                std::to_string(header.document_count) + " (a corrupted or mismatched flags section)");
  }
  return Status::Ok();
}

Status check_token_file_flags(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(const TokenFileHeader header, read_token_file_header(path));
  if (!header.has_flags) return Status::Ok();
  STRATA_ASSIGN_OR_RETURN(const File file, open_read_only(path, "token file"));
  STRATA_ASSIGN_OR_RETURN(const ReadOnlyMapping mapping, ReadOnlyMapping::map(file, header.file_bytes()));
  const std::span<const uint8_t> flags(mapping.bytes() + header.flags_offset(), header.token_count);
  return check_token_flags(flags, header, "token file " + path);
}

StatusOr<std::shared_ptr<const TokenDataset>> TokenDataset::open_token_file(const std::string& path, const FileDataOptions& options) {
  STRATA_RETURN_IF_ERROR(check_eval_fraction(options.eval_fraction, path));
  STRATA_ASSIGN_OR_RETURN(const TokenFileHeader header, read_token_file_header(path));
  int64_t vocab = options.vocab_size;
  if (vocab == 0) {
    if (header.token_bytes == 4) vocab = (int64_t{1} << 31) - 1;
    else vocab = header.has_flags ? int64_t{1} << 16 : kGpt2VocabSize;
  }
  if (vocab < 1) return InvalidArgumentError("token file " + path + ": vocab_size " + std::to_string(vocab) + " must be positive");
  STRATA_RETURN_IF_ERROR(check_token_file_vocabulary(path, vocab));
  STRATA_RETURN_IF_ERROR(check_token_file_flags(path));
  STRATA_ASSIGN_OR_RETURN(File file, open_read_only(path, "token file"));
  FileLayout layout{.kind = header.has_flags ? "fine-tuning file" : "token file",
                    .header_bytes = kLlmcHeaderBytes,
                    .token_bytes = header.token_bytes,
                    .tokens = header.token_count,
                    .row_length = header.row_length};
  if (header.has_flags) layout.flags_offset = header.flags_offset();
  return std::shared_ptr<const TokenDataset>(std::make_shared<FileDataset>(path, std::move(file), layout, vocab, options.eval_fraction));
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

Status TokenDataset::tokens_at(uint64_t, std::span<int32_t>) const {
  return FailedPreconditionError(describe() + ": has no file to read windows from (a perplexity evaluation needs a token or text file)");
}

Status TokenDataset::sample_with_flags(DataSplit split, uint64_t seed, uint64_t index, std::span<int32_t> tokens,
                                       std::span<uint8_t> flags) const {
  if (flags.size() != tokens.size()) return InvalidArgumentError(describe() + ": flags and tokens of a sample differ in length");
  STRATA_RETURN_IF_ERROR(sample(split, seed, index, tokens));
  // No flags in the data: a language-model stream, every token predicted from the ones
  // before it in the sample.
  std::fill(flags.begin(), flags.end(), kTokenIsTarget);
  if (!flags.empty()) flags[0] = kTokenStartsDocument;
  return Status::Ok();
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
  if (const auto row = dataset->row_length(); row && *row != static_cast<uint64_t>(options.seq_len) + 1) {
    return InvalidArgumentError("data loader: seq_len " + std::to_string(options.seq_len) + " needs rows of " +
                                std::to_string(options.seq_len + 1) + " tokens (seq_len + 1), but the rows of " + dataset->describe() +
                                " are " + std::to_string(*row) + "; set seq_len to " + std::to_string(*row - 1) +
                                " or prepare the data again with --seq-len " + std::to_string(options.seq_len));
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

Status DataLoader::fill(uint64_t batch_index, std::span<int32_t> inputs, std::span<int32_t> targets,
                        std::optional<std::span<int32_t>> positions) const {
  const size_t elements = batch_elements();
  if (inputs.size() != elements || targets.size() != elements || (positions && positions->size() != elements)) {
    return InvalidArgumentError("data loader: a batch is " + std::to_string(local_rows()) + " x " + std::to_string(options_.seq_len) +
                                " = " + std::to_string(elements) + " tokens; got buffers of " + std::to_string(inputs.size()) + ", " +
                                std::to_string(targets.size()) + (positions ? " and " + std::to_string(positions->size()) : std::string()));
  }
  const auto seq_len = static_cast<size_t>(options_.seq_len);
  std::vector<int32_t> sample(seq_len + 1);
  std::vector<uint8_t> flags(seq_len + 1);
  const uint64_t first_row = batch_index * static_cast<uint64_t>(options_.global_batch) +
                             static_cast<uint64_t>(options_.rank) * static_cast<uint64_t>(local_rows());
  for (int64_t row = 0; row < local_rows(); ++row) {
    STRATA_RETURN_IF_ERROR(dataset_->sample_with_flags(options_.split, options_.seed, first_row + static_cast<uint64_t>(row), sample, flags));
    const size_t base = static_cast<size_t>(row) * seq_len;
    int32_t position = 0;
    for (size_t t = 0; t < seq_len; ++t) {
      inputs[base + t] = sample[t];
      targets[base + t] = (flags[t + 1] & kTokenIsTarget) != 0 ? sample[t + 1] : -1;
      // Padding carries no document start, so it continues the document's count.
      position = (t == 0 || (flags[t] & kTokenStartsDocument) != 0) ? 0 : position + 1;
      if (positions) (*positions)[base + t] = position;
    }
  }
  return Status::Ok();
}

Status DataLoader::batch_at(uint64_t batch_index, std::span<int32_t> inputs, std::span<int32_t> targets,
                            std::span<int32_t> positions) const {
  return fill(batch_index, inputs, targets, positions);
}

Status DataLoader::batch_at(uint64_t batch_index, std::span<int32_t> inputs, std::span<int32_t> targets) const {
  return fill(batch_index, inputs, targets, std::nullopt);
}

namespace {

StatusOr<uint64_t> batch_index_of(int64_t step, int micro, int micro_batches) {
  if (step < 0 || micro < 0 || micro >= micro_batches) {
    return InvalidArgumentError("data loader: step " + std::to_string(step) + ", micro-batch " + std::to_string(micro) + " of " +
                                std::to_string(micro_batches));
  }
  return static_cast<uint64_t>(step) * static_cast<uint64_t>(micro_batches) + static_cast<uint64_t>(micro);
}

}  // namespace

Status DataLoader::batch(int64_t step, int micro, std::span<int32_t> inputs, std::span<int32_t> targets,
                         std::span<int32_t> positions) const {
  STRATA_ASSIGN_OR_RETURN(const uint64_t index, batch_index_of(step, micro, options_.micro_batches));
  return fill(index, inputs, targets, positions);
}

Status DataLoader::batch(int64_t step, int micro, std::span<int32_t> inputs, std::span<int32_t> targets) const {
  STRATA_ASSIGN_OR_RETURN(const uint64_t index, batch_index_of(step, micro, options_.micro_batches));
  return fill(index, inputs, targets, std::nullopt);
}

Status DataLoader::next(std::span<int32_t> inputs, std::span<int32_t> targets, std::span<int32_t> positions) {
  STRATA_RETURN_IF_ERROR(fill(position_, inputs, targets, positions));
  ++position_;
  return Status::Ok();
}

Status DataLoader::next(std::span<int32_t> inputs, std::span<int32_t> targets) {
  STRATA_RETURN_IF_ERROR(fill(position_, inputs, targets, std::nullopt));
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

}  // namespace strata::data
