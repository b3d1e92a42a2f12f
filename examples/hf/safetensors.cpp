#include "examples/hf/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "engine/core/dtype.h"
#include "engine/core/json_depth.h"
#include "engine/core/log.h"

namespace strata::hf {

namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// The safetensors library refuses headers above 100 MB; so do we.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// A header nests 3 levels (header, tensor, shape); deeper is damage, refused before parsing.
constexpr size_t kMaxHeaderDepth = 8;
constexpr std::string_view kMetadataKey = "__metadata__";

struct DTypeInfo {
  SafetensorsDType dtype;
  std::string_view name;
  size_t size;
};
constexpr std::array<DTypeInfo, 15> kDTypes = {{
    {SafetensorsDType::kBool, "BOOL", 1},     {SafetensorsDType::kU8, "U8", 1},
    {SafetensorsDType::kI8, "I8", 1},         {SafetensorsDType::kF8E5M2, "F8_E5M2", 1},
    {SafetensorsDType::kF8E4M3, "F8_E4M3", 1}, {SafetensorsDType::kI16, "I16", 2},
    {SafetensorsDType::kU16, "U16", 2},       {SafetensorsDType::kF16, "F16", 2},
    {SafetensorsDType::kBF16, "BF16", 2},     {SafetensorsDType::kI32, "I32", 4},
    {SafetensorsDType::kU32, "U32", 4},       {SafetensorsDType::kF32, "F32", 4},
    {SafetensorsDType::kF64, "F64", 8},       {SafetensorsDType::kI64, "I64", 8},
    {SafetensorsDType::kU64, "U64", 8},
}};

std::string offsets_text(uint64_t begin, uint64_t end) {
  char text[48];
  std::snprintf(text, sizeof(text), "[%llu, %llu]", static_cast<unsigned long long>(begin), static_cast<unsigned long long>(end));
  return text;
}

Status errno_status(int error, const std::string& what) { return Status::FromErrno(error, what); }

}  // namespace

std::string_view safetensors_dtype_name(SafetensorsDType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return info.name;
  }
  return "?";
}

StatusOr<SafetensorsDType> parse_safetensors_dtype(std::string_view text) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.name == text) return info.dtype;
  }
  return InvalidArgumentError("unknown safetensors dtype '" + std::string(text) +
                              "' (expected one of BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64)");
}

size_t safetensors_dtype_size(SafetensorsDType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return info.size;
  }
  return 1;
}

bool safetensors_dtype_is_float(SafetensorsDType dtype) {
  return dtype == SafetensorsDType::kF32 || dtype == SafetensorsDType::kBF16 || dtype == SafetensorsDType::kF16 ||
         dtype == SafetensorsDType::kF64;
}

std::string shape_text(std::span<const int64_t> shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// ---------------------------------------------------------------------------------------
// Reader

StatusOr<uint64_t> parse_safetensors_header_length(std::span<const unsigned char, 8> prefix, uint64_t file_bytes,
                                                   std::string_view where_view) {
  const std::string where(where_view);
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | prefix[static_cast<size_t>(i)];
  if (header_bytes > kMaxHeaderBytes) {
    return InvalidArgumentError(where + ": header length " + std::to_string(header_bytes) + " exceeds the 100 MB limit");
  }
  if (8 + header_bytes > file_bytes) {
    return InvalidArgumentError(where + ": header length " + std::to_string(header_bytes) + " runs past the end of the file (" +
                                std::to_string(file_bytes) + " bytes; truncated?)");
  }
  return header_bytes;
}

StatusOr<SafetensorsReader> SafetensorsReader::open(const std::string& path, const SafetensorsReadOptions& options) {
  SafetensorsReader reader;
  reader.path_ = path;
  reader.options_ = options;
  if (reader.options_.chunk_bytes < 64) reader.options_.chunk_bytes = 64;
  StatusOr<File> file = File::open(path);
  if (!file.ok()) {
    if (file.status().error_number() == ENOENT) return NotFoundError("safetensors file " + path + " does not exist");
    return std::move(file).status();
  }
  reader.file_ = std::move(file).value();
  STRATA_ASSIGN_OR_RETURN(reader.file_bytes_, reader.file_.size());
  const std::string where = "safetensors file " + path;
  if (reader.file_bytes_ < 8) {
    return InvalidArgumentError(where + " is " + std::to_string(reader.file_bytes_) +
                                " bytes, too short for the 8-byte header length (truncated?)");
  }
  unsigned char length_bytes[8];
  STRATA_RETURN_IF_ERROR(reader.file_.read_exact(length_bytes, 8, 0));
  STRATA_ASSIGN_OR_RETURN(const uint64_t header_bytes,
                          parse_safetensors_header_length(std::span<const unsigned char, 8>(length_bytes), reader.file_bytes_, where));
  std::string header_json(header_bytes, '\0');
  STRATA_RETURN_IF_ERROR(reader.file_.read_exact(header_json.data(), header_json.size(), 8));
  reader.data_offset_ = 8 + header_bytes;
  STRATA_ASSIGN_OR_RETURN(SafetensorsHeader header, parse_safetensors_header(header_json, reader.file_bytes_ - reader.data_offset_, where));
  reader.tensors_ = std::move(header.tensors);
  reader.metadata_ = std::move(header.metadata);
  for (size_t i = 0; i < reader.tensors_.size(); ++i) reader.index_.emplace(reader.tensors_[i].name, i);
  return reader;
}

namespace {

// One tensor's entry of the header: its dtype, shape and data_offsets, checked against the
// data section's `data_bytes`.
StatusOr<SafetensorsTensor> parse_tensor_entry(const std::string& name, const json& entry, uint64_t data_bytes,
                                               const std::string& where) {
  const std::string what = where + ": tensor '" + name + "'";
  if (!entry.is_object()) return InvalidArgumentError(what + " is not an object");
  const auto dtype_it = entry.find("dtype");
  const auto shape_it = entry.find("shape");
  const auto offsets_it = entry.find("data_offsets");
  if (dtype_it == entry.end() || !dtype_it->is_string()) return InvalidArgumentError(what + " has no string 'dtype'");
  if (shape_it == entry.end() || !shape_it->is_array()) return InvalidArgumentError(what + " has no array 'shape'");
  if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
    return InvalidArgumentError(what + " has no 'data_offsets' pair");
  }
  SafetensorsTensor tensor;
  tensor.name = name;
  auto dtype = parse_safetensors_dtype(dtype_it->get<std::string>());
  if (!dtype.ok()) return InvalidArgumentError(what + ": " + dtype.status().message());
  tensor.dtype = *dtype;
  uint64_t numel = 1;
  for (const json& dim : *shape_it) {
    if (!dim.is_number_integer() || dim.get<int64_t>() < 0) {
      return InvalidArgumentError(what + " has a shape entry that is not a non-negative integer: " + shape_it->dump());
    }
    const auto value = static_cast<uint64_t>(dim.get<int64_t>());
    if (value != 0 && numel > std::numeric_limits<uint64_t>::max() / 8 / value) {
      return InvalidArgumentError(what + ": shape " + shape_it->dump() + " is too large");
    }
    numel *= value;
    tensor.shape.push_back(static_cast<int64_t>(value));
  }
  tensor.numel = numel;
  for (const json& offset : *offsets_it) {
    if (!offset.is_number_unsigned() && !(offset.is_number_integer() && offset.get<int64_t>() >= 0)) {
      return InvalidArgumentError(what + ": data_offsets " + offsets_it->dump() + " are not non-negative integers");
    }
  }
  tensor.begin = (*offsets_it)[0].get<uint64_t>();
  tensor.end = (*offsets_it)[1].get<uint64_t>();
  if (tensor.end < tensor.begin) {
    return InvalidArgumentError(what + ": data_offsets " + offsets_text(tensor.begin, tensor.end) + " end before they begin");
  }
  if (tensor.end > data_bytes) {
    return InvalidArgumentError(what + ": data_offsets " + offsets_text(tensor.begin, tensor.end) +
                                " run past the data section (" + std::to_string(data_bytes) + " bytes; truncated?)");
  }
  const uint64_t needed = numel * safetensors_dtype_size(tensor.dtype);
  if (needed != tensor.bytes()) {
    return InvalidArgumentError(what + ": dtype " + std::string(safetensors_dtype_name(tensor.dtype)) + " shape " +
                                shape_text(tensor.shape) + " needs " + std::to_string(needed) + " bytes, but data_offsets " +
                                offsets_text(tensor.begin, tensor.end) + " hold " + std::to_string(tensor.bytes()));
  }
  return tensor;
}

// Sorted by offset, no two tensors may share a byte.
Status check_no_overlap(std::vector<SafetensorsTensor>& tensors, const std::string& where) {
  std::sort(tensors.begin(), tensors.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < tensors.size(); ++i) {
    const SafetensorsTensor& a = tensors[i - 1];
    const SafetensorsTensor& b = tensors[i];
    if (b.begin < a.end) {
      return InvalidArgumentError(where + ": tensors '" + a.name + "' " + offsets_text(a.begin, a.end) + " and '" + b.name +
                                  "' " + offsets_text(b.begin, b.end) + " overlap");
    }
  }
  return {};
}

}  // namespace

StatusOr<SafetensorsHeader> parse_safetensors_header(std::string_view header_json, uint64_t data_bytes, std::string_view where_view) {
  const std::string where(where_view);
  if (const size_t depth = json_nesting_depth(header_json); depth > kMaxHeaderDepth) {
    return InvalidArgumentError(where + ": the header nests " + std::to_string(depth) + " levels of objects and arrays; a safetensors header has 3 (damaged?)");
  }
  SafetensorsHeader header;
  json root;
  try {
    root = json::parse(header_json);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1e999
    return InvalidArgumentError(where + ": the header is not valid JSON: " + e.what());
  }
  if (!root.is_object()) return InvalidArgumentError(where + ": the header is not a JSON object");
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& name = it.key();
    const json& entry = it.value();
    if (name == kMetadataKey) {
      if (!entry.is_object()) return InvalidArgumentError(where + ": __metadata__ is not an object");
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        if (!m.value().is_string()) {
          return InvalidArgumentError(where + ": __metadata__." + m.key() + " is not a string");
        }
        header.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(SafetensorsTensor tensor, parse_tensor_entry(name, entry, data_bytes, where));
    header.tensors.push_back(std::move(tensor));
  }
  STRATA_RETURN_IF_ERROR(check_no_overlap(header.tensors, where));
  return header;
}

const SafetensorsTensor* SafetensorsReader::find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

StatusOr<const SafetensorsTensor*> SafetensorsReader::require(std::string_view name, std::span<const int64_t> expected_shape) const {
  const SafetensorsTensor* tensor = find(name);
  if (tensor == nullptr) {
    return NotFoundError("tensor '" + std::string(name) + "' is missing from safetensors file " + path_ + " (expected shape " +
                         shape_text(expected_shape) + ")");
  }
  if (!std::equal(tensor->shape.begin(), tensor->shape.end(), expected_shape.begin(), expected_shape.end())) {
    return InvalidArgumentError("tensor '" + std::string(name) + "' in safetensors file " + path_ + " has shape " +
                                shape_text(tensor->shape) + ", expected " + shape_text(expected_shape));
  }
  return tensor;
}

Status SafetensorsReader::read_bytes(const SafetensorsTensor& tensor, uint64_t byte_offset, std::span<std::byte> out) const {
  if (byte_offset + out.size() > tensor.bytes()) {
    return InvalidArgumentError("tensor '" + tensor.name + "' in " + path_ + ": bytes [" + std::to_string(byte_offset) + ", " +
                                std::to_string(byte_offset + out.size()) + ") run past its " + std::to_string(tensor.bytes()) +
                                " bytes");
  }
  for (size_t done = 0; done < out.size();) {
    const size_t bytes = std::min(options_.chunk_bytes, out.size() - done);
    STRATA_RETURN_IF_ERROR(file_.read_exact(out.data() + done, bytes, data_offset_ + tensor.begin + byte_offset + done));
    done += bytes;
  }
  return Status::Ok();
}

Status SafetensorsReader::read_fp32(const SafetensorsTensor& tensor, uint64_t first, std::span<float> out) const {
  if (!safetensors_dtype_is_float(tensor.dtype)) {
    return InvalidArgumentError("tensor '" + tensor.name + "' in " + path_ + " has dtype " +
                                std::string(safetensors_dtype_name(tensor.dtype)) + ", which does not convert to fp32");
  }
  if (first + out.size() > tensor.numel) {
    return InvalidArgumentError("tensor '" + tensor.name + "' in " + path_ + ": elements [" + std::to_string(first) + ", " +
                                std::to_string(first + out.size()) + ") run past its " + std::to_string(tensor.numel) +
                                " elements " + shape_text(tensor.shape));
  }
  const size_t element_bytes = safetensors_dtype_size(tensor.dtype);
  if (tensor.dtype == SafetensorsDType::kF32) {
    // Straight into the destination (little-endian host).
    return read_bytes(tensor, first * 4, std::as_writable_bytes(out));
  }
  const size_t chunk_elements = std::max<size_t>(1, options_.chunk_bytes / element_bytes);
  std::vector<unsigned char> scratch(std::min(out.size(), chunk_elements) * element_bytes);
  for (size_t done = 0; done < out.size();) {
    const size_t count = std::min(chunk_elements, out.size() - done);
    STRATA_RETURN_IF_ERROR(file_.read_exact(scratch.data(), count * element_bytes,
                                     data_offset_ + tensor.begin + (first + done) * element_bytes));
    float* target = out.data() + done;
    switch (tensor.dtype) {
      case SafetensorsDType::kBF16:
        for (size_t i = 0; i < count; ++i) {
          uint16_t bits;
          std::memcpy(&bits, scratch.data() + 2 * i, 2);
          target[i] = bf16_bits_to_float(bits);
        }
        break;
      case SafetensorsDType::kF16:
        for (size_t i = 0; i < count; ++i) {
          uint16_t bits;
          std::memcpy(&bits, scratch.data() + 2 * i, 2);
          target[i] = fp16_bits_to_float(bits);
        }
        break;
      case SafetensorsDType::kF64:
        for (size_t i = 0; i < count; ++i) {
          double value;
          std::memcpy(&value, scratch.data() + 8 * i, 8);
          target[i] = static_cast<float>(value);
        }
        break;
      default: break;
    }
    done += count;
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------
// Writer

SafetensorsWriter::SafetensorsWriter(SafetensorsWriter&& other) noexcept { *this = std::move(other); }

SafetensorsWriter& SafetensorsWriter::operator=(SafetensorsWriter&& other) noexcept {
  if (this != &other) {
    close_and_remove();
    path_ = std::move(other.path_);
    tmp_path_ = std::move(other.tmp_path_);
    file_ = std::move(other.file_);
    specs_ = std::move(other.specs_);
    sizes_ = std::move(other.sizes_);
    current_ = other.current_;
    written_in_current_ = other.written_in_current_;
    buffer_ = std::move(other.buffer_);
    finished_ = std::exchange(other.finished_, true);
  }
  return *this;
}

SafetensorsWriter::~SafetensorsWriter() { close_and_remove(); }

void SafetensorsWriter::close_and_remove() {
  if (file_.is_open()) {
    file_.reset();
    if (!finished_ && !tmp_path_.empty()) ::unlink(tmp_path_.c_str());
  }
}

StatusOr<SafetensorsWriter> SafetensorsWriter::create(const std::string& path, std::vector<SafetensorsTensorSpec> tensors,
                                                      std::map<std::string, std::string> metadata) {
  SafetensorsWriter writer;
  writer.path_ = path;
  writer.tmp_path_ = path + ".tmp";
  ordered_json header = ordered_json::object();
  if (!metadata.empty()) {
    ordered_json meta = ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header[std::string(kMetadataKey)] = std::move(meta);
  }
  std::set<std::string, std::less<>> names;
  uint64_t offset = 0;
  for (const SafetensorsTensorSpec& spec : tensors) {
    const std::string what = "safetensors writer (" + path + "): tensor '" + spec.name + "'";
    if (spec.name.empty() || spec.name == kMetadataKey) return InvalidArgumentError(what + ": not a usable tensor name");
    if (!names.insert(spec.name).second) return InvalidArgumentError(what + " is listed twice");
    uint64_t numel = 1;
    for (int64_t dim : spec.shape) {
      if (dim < 0) return InvalidArgumentError(what + " has a negative dimension in " + shape_text(spec.shape));
      numel *= static_cast<uint64_t>(dim);
    }
    const uint64_t bytes = numel * safetensors_dtype_size(spec.dtype);
    header[spec.name] = {{"dtype", std::string(safetensors_dtype_name(spec.dtype))},
                         {"shape", spec.shape},
                         {"data_offsets", {offset, offset + bytes}}};
    writer.sizes_.push_back(bytes);
    offset += bytes;
  }
  writer.specs_ = std::move(tensors);
  std::string text = header.dump();
  // Pad with spaces so the data section starts 8-byte aligned, as the reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');

  STRATA_ASSIGN_OR_RETURN(writer.file_, File::open(writer.tmp_path_, {.flags = O_WRONLY | O_CREAT | O_TRUNC}));
  writer.buffer_.reserve(size_t{1} << 20);
  unsigned char length[8];
  uint64_t value = text.size();
  for (int i = 0; i < 8; ++i, value >>= 8) length[i] = static_cast<unsigned char>(value & 0xff);
  STRATA_RETURN_IF_ERROR(writer.write_out(length, 8));
  STRATA_RETURN_IF_ERROR(writer.write_out(text.data(), text.size()));
  // Zero-sized tensors are complete from the start.
  while (writer.current_ < writer.sizes_.size() && writer.sizes_[writer.current_] == 0) ++writer.current_;
  return writer;
}

Status SafetensorsWriter::write_out(const void* data, size_t bytes) {
  const auto* source = static_cast<const std::byte*>(data);
  buffer_.insert(buffer_.end(), source, source + bytes);
  if (buffer_.size() >= (size_t{1} << 20)) return flush();
  return Status::Ok();
}

Status SafetensorsWriter::flush() {
  STRATA_RETURN_IF_ERROR(file_.write_all(buffer_.data(), buffer_.size()));
  buffer_.clear();
  return Status::Ok();
}

Status SafetensorsWriter::check_current(std::string_view name, uint64_t bytes) {
  if (!file_.is_open() || finished_) return FailedPreconditionError("safetensors writer (" + path_ + "): already finished");
  if (current_ >= specs_.size()) {
    return InvalidArgumentError("safetensors writer (" + path_ + "): every tensor is complete; nothing more to write to '" +
                                std::string(name) + "'");
  }
  const SafetensorsTensorSpec& spec = specs_[current_];
  if (spec.name != name) {
    return InvalidArgumentError("safetensors writer (" + path_ + "): writing '" + std::string(name) + "' but '" + spec.name +
                                "' is next (tensors are written in the order given to create())");
  }
  if (written_in_current_ + bytes > sizes_[current_]) {
    return InvalidArgumentError("safetensors writer (" + path_ + "): tensor '" + spec.name + "' " + shape_text(spec.shape) +
                                " holds " + std::to_string(sizes_[current_]) + " bytes; " +
                                std::to_string(written_in_current_ + bytes) + " were written");
  }
  return Status::Ok();
}

Status SafetensorsWriter::append_bytes(std::string_view name, std::span<const std::byte> bytes) {
  STRATA_RETURN_IF_ERROR(check_current(name, bytes.size()));
  STRATA_RETURN_IF_ERROR(write_out(bytes.data(), bytes.size()));
  written_in_current_ += bytes.size();
  while (current_ < specs_.size() && written_in_current_ == sizes_[current_]) {
    ++current_;
    written_in_current_ = 0;
  }
  return Status::Ok();
}

Status SafetensorsWriter::append_fp32(std::string_view name, std::span<const float> values) {
  if (current_ < specs_.size() && specs_[current_].name == name) {
    const SafetensorsDType dtype = specs_[current_].dtype;
    if (dtype == SafetensorsDType::kF32) return append_bytes(name, std::as_bytes(values));
    if (dtype == SafetensorsDType::kBF16 || dtype == SafetensorsDType::kF16) {
      std::vector<uint16_t> converted(values.size());
      for (size_t i = 0; i < values.size(); ++i) {
        converted[i] = dtype == SafetensorsDType::kBF16 ? float_to_bf16_bits(values[i]) : float_to_fp16_bits(values[i]);
      }
      return append_bytes(name, std::as_bytes(std::span<const uint16_t>(converted)));
    }
    return InvalidArgumentError("safetensors writer (" + path_ + "): tensor '" + std::string(name) + "' has dtype " +
                                std::string(safetensors_dtype_name(dtype)) + "; append_fp32 writes F32, BF16 or F16");
  }
  return check_current(name, 0);  // names the problem
}

Status SafetensorsWriter::write_tensor(std::string_view name, const Fp32Source& fill, size_t chunk_elements) {
  STRATA_RETURN_IF_ERROR(check_current(name, 0));
  const SafetensorsTensorSpec& spec = specs_[current_];
  const uint64_t numel = sizes_[current_] / safetensors_dtype_size(spec.dtype);
  if (written_in_current_ != 0) {
    return FailedPreconditionError("safetensors writer (" + path_ + "): tensor '" + spec.name + "' is partly written already");
  }
  chunk_elements = std::max<size_t>(1, chunk_elements);
  std::vector<float> chunk(static_cast<size_t>(std::min<uint64_t>(numel, chunk_elements)));
  const std::string tensor_name = spec.name;  // append_fp32 may move past this spec
  for (uint64_t first = 0; first < numel;) {
    const size_t count = static_cast<size_t>(std::min<uint64_t>(chunk_elements, numel - first));
    std::span<float> out(chunk.data(), count);
    STRATA_RETURN_IF_ERROR_CTX(fill(first, out), "safetensors writer (" + path_ + "): filling tensor '" + tensor_name +
                                                     "' elements [" + std::to_string(first) + ", " +
                                                     std::to_string(first + count) + ")");
    STRATA_RETURN_IF_ERROR(append_fp32(tensor_name, out));
    first += count;
  }
  return Status::Ok();
}

Status SafetensorsWriter::finish() {
  if (!file_.is_open() || finished_) return FailedPreconditionError("safetensors writer (" + path_ + "): already finished");
  if (current_ < specs_.size()) {
    return FailedPreconditionError("safetensors writer (" + path_ + "): tensor '" + specs_[current_].name + "' has " +
                                   std::to_string(written_in_current_) + " of its " + std::to_string(sizes_[current_]) +
                                   " bytes" + (current_ + 1 < specs_.size() ? " (and later tensors none)" : ""));
  }
  STRATA_RETURN_IF_ERROR(flush());
  STRATA_RETURN_IF_ERROR(file_.sync());
  if (Status closed = file_.close(); !closed.ok()) {
    ::unlink(tmp_path_.c_str());
    return closed;
  }
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp_path_.c_str());
    return errno_status(error, "rename(" + tmp_path_ + ", " + path_ + ")");
  }
  finished_ = true;
  return Status::Ok();
}

}  // namespace strata::hf
