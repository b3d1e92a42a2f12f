// llm.c token files and Strata's fine-tuning files: their headers, writing them, and the
// checks of their tokens against a vocabulary and of their flags.
#include "examples/data/token_data.h"

#include <fcntl.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <utility>

#include "engine/core/executor.h"
#include "engine/core/file.h"
#include "examples/data/read_only_file.h"
#include "examples/data/token_scan.h"

namespace strata::data {

using internal::open_read_only;

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

}  // namespace strata::data
