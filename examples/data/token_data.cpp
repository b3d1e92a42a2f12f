#include "examples/data/token_data.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "engine/core/file.h"
#include "examples/data/read_only_file.h"
#include "examples/data/sample_random.h"

namespace strata::data {

namespace {

using internal::kTagWindow;
using internal::open_read_only;
using internal::SampleRandom;

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

StatusOr<std::shared_ptr<const TokenDataset>> TokenDataset::open_text_file(const std::string& path, const FileDataOptions& options) {
  STRATA_RETURN_IF_ERROR(check_eval_fraction(options.eval_fraction, path));
  STRATA_ASSIGN_OR_RETURN(File file, open_read_only(path, "text file"));
  STRATA_ASSIGN_OR_RETURN(const uint64_t size, file.size());
  if (size == 0) return InvalidArgumentError("text file " + path + " is empty");
  const FileLayout layout{.kind = "text file", .header_bytes = 0, .token_bytes = 1, .tokens = size};
  return std::shared_ptr<const TokenDataset>(std::make_shared<FileDataset>(path, std::move(file), layout, 256, options.eval_fraction));
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

}  // namespace strata::data
