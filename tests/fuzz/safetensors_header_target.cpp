// examples/hf/safetensors.cpp's header checks under fuzzing: the input is a whole file;
// a header the parser accepts describes tensors that lie inside the data section, in
// order, without overlap, each as large as its dtype and shape say.
#include <span>
#include <string_view>

#include "examples/hf/safetensors.h"
#include "tests/fuzz/fuzz_targets.h"

namespace strata::fuzz {

namespace {

__extension__ using u128 = unsigned __int128;  // products of two 64-bit sizes, never wrapping

void check_header_invariants(const hf::SafetensorsHeader& header, uint64_t data_bytes) {
  uint64_t previous_end = 0;
  for (const hf::SafetensorsTensor& tensor : header.tensors) {
    STRATA_FUZZ_CHECK(tensor.begin <= tensor.end && tensor.end <= data_bytes, "safetensors: a tensor outside the data section");
    STRATA_FUZZ_CHECK(tensor.begin >= previous_end, "safetensors: tensors out of order or overlapping");
    previous_end = tensor.end;
    u128 numel = 1;
    for (const int64_t dim : tensor.shape) {
      STRATA_FUZZ_CHECK(dim >= 0, "safetensors: a negative dimension");
      numel *= static_cast<uint64_t>(dim);
    }
    STRATA_FUZZ_CHECK(numel == tensor.numel, "safetensors: numel disagrees with the shape");
    STRATA_FUZZ_CHECK(numel * hf::safetensors_dtype_size(tensor.dtype) == tensor.bytes(),
                      "safetensors: a tensor's bytes disagree with its dtype and shape");
  }
}

}  // namespace

int fuzz_safetensors_header(const uint8_t* data, size_t size) {
  if (size < 8) return 0;  // SafetensorsReader::open refuses these before parsing
  constexpr std::string_view kWhere = "safetensors file fuzz.safetensors";
  StatusOr<uint64_t> header_bytes = hf::parse_safetensors_header_length(std::span<const unsigned char, 8>(data, 8), size, kWhere);
  if (!header_bytes.ok()) return 0;
  STRATA_FUZZ_CHECK(8 + *header_bytes <= size, "safetensors: an accepted header length runs past the file");
  const std::string_view header_json(reinterpret_cast<const char*>(data) + 8, *header_bytes);
  const uint64_t data_bytes = size - 8 - *header_bytes;
  StatusOr<hf::SafetensorsHeader> header = hf::parse_safetensors_header(header_json, data_bytes, kWhere);
  if (!header.ok()) {
    STRATA_FUZZ_CHECK(header.status().message().starts_with(kWhere), "safetensors: an error that does not name the file");
    return 0;
  }
  check_header_invariants(*header, data_bytes);
  return 0;
}

}  // namespace strata::fuzz
