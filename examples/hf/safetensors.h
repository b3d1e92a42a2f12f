// The safetensors format (Hugging Face), read and written in a streaming way.
//
// A file is: 8 bytes, the header length N as a little-endian uint64; N bytes of JSON, an
// object mapping each tensor name to {"dtype": "F32", "shape": [..], "data_offsets":
// [begin, end]} (byte offsets into the data section that follows the header), plus an
// optional "__metadata__" object of string values; then the data section. Tensors are
// row-major, little-endian.
//
// The reader parses and validates the header (the length within the file, known dtypes,
// non-negative shapes, data_offsets inside the data section, byte counts equal to
// dtype size x element count, no two tensors overlapping) and reads any element range of
// a tensor into a caller's fp32 buffer (F32, BF16, F16 and F64 convert) with pread in
// bounded chunks, never holding the file in memory. The writer takes the list of tensors
// up front (so the header, written first, knows every size), then their data tensor by
// tensor, in chunks from the caller; it writes to "<path>.tmp" and renames on finish().

#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/file.h"
#include "engine/core/status.h"

namespace strata::hf {

enum class SafetensorsDType : uint8_t {
  kBool, kU8, kI8, kF8E5M2, kF8E4M3, kI16, kU16, kF16, kBF16, kI32, kU32, kF32, kF64, kI64, kU64,
};
std::string_view safetensors_dtype_name(SafetensorsDType dtype);  // "F32", "BF16", ...
StatusOr<SafetensorsDType> parse_safetensors_dtype(std::string_view text);
size_t safetensors_dtype_size(SafetensorsDType dtype);            // bytes per element
// True for the dtypes read_fp32 converts (F32, BF16, F16, F64) and append_fp32 writes (F32, BF16, F16).
bool safetensors_dtype_is_float(SafetensorsDType dtype);

// "[768, 2304]".
std::string shape_text(std::span<const int64_t> shape);

struct SafetensorsTensor {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets in the data section
  uint64_t end = 0;
  uint64_t numel = 0;
  uint64_t bytes() const { return end - begin; }
};

// A file's parsed header: what SafetensorsReader::open checks before it reads any data.
struct SafetensorsHeader {
  std::vector<SafetensorsTensor> tensors;  // in data-offset order
  std::map<std::string, std::string> metadata;
};

// The first 8 bytes of a file of `file_bytes` bytes, as the header's length: within the
// 100 MB limit and the file. `where` ("safetensors file <path>") starts every message.
StatusOr<uint64_t> parse_safetensors_header_length(std::span<const unsigned char, 8> prefix, uint64_t file_bytes,
                                                   std::string_view where);
// Parses and validates the JSON header of a file whose data section holds `data_bytes`
// bytes: known dtypes, non-negative shapes, data_offsets inside the data section, byte
// counts equal to dtype size x element count, no two tensors overlapping.
// kInvalidArgument starting with `where` and naming the tensor and the field.
StatusOr<SafetensorsHeader> parse_safetensors_header(std::string_view header_json, uint64_t data_bytes, std::string_view where);

struct SafetensorsReadOptions {
  size_t chunk_bytes = size_t{4} << 20;  // the most one pread moves (and the reader's scratch buffer per call)
};

class SafetensorsReader {
 public:
  // Opens and validates `path`. Errors (kInvalidArgument for a malformed file, kNotFound
  // for a missing one) name the file and the problem.
  static StatusOr<SafetensorsReader> open(const std::string& path, const SafetensorsReadOptions& options = {});
  SafetensorsReader(SafetensorsReader&& other) noexcept = default;
  SafetensorsReader& operator=(SafetensorsReader&& other) noexcept = default;
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;
  ~SafetensorsReader() = default;

  const std::string& path() const { return path_; }
  uint64_t file_bytes() const { return file_bytes_; }
  uint64_t data_offset() const { return data_offset_; }  // 8 + header length
  // In data-offset order.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // nullptr when absent.
  const SafetensorsTensor* find(std::string_view name) const;
  // The tensor, which must exist (kNotFound naming it and the file) and have
  // `expected_shape` (kInvalidArgument naming the tensor, the file, both shapes).
  StatusOr<const SafetensorsTensor*> require(std::string_view name, std::span<const int64_t> expected_shape) const;

  // Elements [first, first + out.size()) of `tensor` (row-major), converted to fp32.
  // Thread-safe (pread; scratch per call).
  Status read_fp32(const SafetensorsTensor& tensor, uint64_t first, std::span<float> out) const;
  // Raw bytes [byte_offset, byte_offset + out.size()) of the tensor's data.
  Status read_bytes(const SafetensorsTensor& tensor, uint64_t byte_offset, std::span<std::byte> out) const;

 private:
  SafetensorsReader() = default;

  std::string path_;
  File file_;
  uint64_t file_bytes_ = 0;
  uint64_t data_offset_ = 0;
  SafetensorsReadOptions options_;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

struct SafetensorsTensorSpec {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<int64_t> shape;
};

class SafetensorsWriter {
 public:
  // Fills `out` with elements [first, first + out.size()) of the tensor being written.
  using Fp32Source = std::function<Status(uint64_t first, std::span<float> out)>;

  // Starts "<path>.tmp" with the header for `tensors` (data in this order, each right
  // after the previous). Errors name the path, or the tensor for a bad spec (duplicate
  // name, negative dimension, the name "__metadata__").
  static StatusOr<SafetensorsWriter> create(const std::string& path, std::vector<SafetensorsTensorSpec> tensors,
                                            std::map<std::string, std::string> metadata = {});
  SafetensorsWriter(SafetensorsWriter&& other) noexcept;
  SafetensorsWriter& operator=(SafetensorsWriter&& other) noexcept;
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  // Without finish(): removes the temporary file.
  ~SafetensorsWriter();

  // Appends to tensor `name`, which must be the one being written (the first that is not
  // complete): values are converted from fp32 to its dtype (F32, BF16, F16). Appending
  // past the tensor's end is an error naming it.
  Status append_fp32(std::string_view name, std::span<const float> values);
  Status append_bytes(std::string_view name, std::span<const std::byte> bytes);
  // Writes all of tensor `name` from `fill`, chunk by chunk (chunk_elements at a time).
  Status write_tensor(std::string_view name, const Fp32Source& fill, size_t chunk_elements = size_t{1} << 20);

  // Checks every tensor is complete (naming the first that is not), flushes, fsyncs and
  // renames "<path>.tmp" to `path`.
  Status finish();

  const std::string& path() const { return path_; }

 private:
  SafetensorsWriter() = default;
  Status check_current(std::string_view name, uint64_t bytes);
  Status write_out(const void* data, size_t bytes);
  Status flush();
  void close_and_remove();

  std::string path_;
  std::string tmp_path_;
  File file_;  // "<path>.tmp" until finish()
  std::vector<SafetensorsTensorSpec> specs_;
  std::vector<uint64_t> sizes_;  // bytes per tensor
  size_t current_ = 0;           // tensor being written
  uint64_t written_in_current_ = 0;
  std::vector<std::byte> buffer_;  // pending output
  bool finished_ = false;
};

}  // namespace strata::hf
