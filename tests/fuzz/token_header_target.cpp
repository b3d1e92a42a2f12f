// examples/data/token_data.cpp's llm.c and fine-tuning token files under fuzzing: the input
// is a whole file. Its header is checked in memory; a file whose header passes is also
// opened as a dataset (through a memfd) and sampled with its flags, so the reader behind
// the header (vocabulary scan, flags check, rows) runs too.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>
#include <string>

#include "examples/data/token_data.h"
#include "tests/fuzz/fuzz_targets.h"

namespace strata::fuzz {

namespace {

// Opens the bytes as a token dataset and draws one short sample from it.
void sample_token_file(const uint8_t* data, size_t size, const data::TokenFileHeader& header) {
  const int fd = ::memfd_create("strata-fuzz-tokens", 0);
  STRATA_FUZZ_CHECK(fd >= 0, "token_header: memfd_create failed");
  STRATA_FUZZ_CHECK(::write(fd, data, size) == static_cast<ssize_t>(size), "token_header: writing the memfd failed");
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  data::FileDataOptions options;
  options.vocab_size = data[size - 1] % 2 == 0 ? 0 : 1 + data[size - 1];  // the format's vocabulary, or a small one
  StatusOr<std::shared_ptr<const data::TokenDataset>> dataset = data::TokenDataset::open_token_file(path, options);
  if (dataset.ok()) {
    STRATA_FUZZ_CHECK((*dataset)->split_tokens(data::DataSplit::kTrain) == header.token_count,
                      "token_header: the dataset's token count disagrees with the header");
    // A row's worth for a file of rows (any other length is refused), else 4 tokens.
    std::vector<int32_t> tokens(std::min<uint64_t>(header.row_length > 0 ? header.row_length : 4, 64));
    std::vector<uint8_t> flags(tokens.size());
    const Status sampled = (*dataset)->sample_with_flags(data::DataSplit::kTrain, /*seed=*/data[0], /*index=*/data[size - 1], tokens, flags);
    if (sampled.ok()) {
      for (const int32_t token : tokens) {
        STRATA_FUZZ_CHECK(token >= 0 && token < (*dataset)->vocab_size(), "token_header: a sampled token outside the vocabulary");
      }
      STRATA_FUZZ_CHECK((flags[0] & data::kTokenStartsDocument) != 0 && (flags[0] & data::kTokenIsTarget) == 0,
                        "token_header: a sample whose first token does not start a document");
      for (const uint8_t f : flags) STRATA_FUZZ_CHECK((f & data::kTokenFlagsReserved) == 0, "token_header: reserved flag bits passed");
    }
  }
  ::close(fd);
}

}  // namespace

int fuzz_token_header(const uint8_t* data, size_t size) {
  constexpr std::string_view kWhere = "token file fuzz.bin";
  const std::span<const std::byte> prefix(reinterpret_cast<const std::byte*>(data), std::min(size, data::kLlmcHeaderBytes));
  StatusOr<data::TokenFileHeader> header = data::parse_token_file_header(prefix, size, kWhere);
  if (!header.ok()) {
    STRATA_FUZZ_CHECK(header.status().message().starts_with(kWhere), "token_header: an error that does not name the file");
    return 0;
  }
  STRATA_FUZZ_CHECK(header->token_bytes == 2 || header->token_bytes == 4, "token_header: a token size other than 2 or 4");
  STRATA_FUZZ_CHECK(header->file_bytes() == size, "token_header: an accepted header whose token count disagrees with the file size");
  STRATA_FUZZ_CHECK(header->has_flags || header->row_length == 0, "token_header: a row length in an llm.c file");
  STRATA_FUZZ_CHECK(header->row_length == 0 || header->token_count % header->row_length == 0,
                    "token_header: an accepted row length that does not divide the token count");
  sample_token_file(data, size, *header);
  return 0;
}

}  // namespace strata::fuzz
