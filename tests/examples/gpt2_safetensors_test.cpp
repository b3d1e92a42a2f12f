// Hugging Face's GPT-2 names and shapes in a safetensors file (examples/gpt/gpt2_safetensors.h):
// a file written by Python from the documented format, and the missing or misshapen
// tensors an error names.
#include "examples/gpt/gpt2_safetensors.h"

#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "tests/support/test_support.h"

namespace strata::gpt {
namespace {

namespace fs = std::filesystem;

using hf::SafetensorsDType;
using hf::SafetensorsTensorSpec;
using hf::SafetensorsWriter;

using testing::contains;

// The value the script below stores at element k of tensor `index`: index + k / 1000 as a
// float32, or its top 16 bits (bf16 by truncation) for the BF16 tensors. The truncation
// selects a mask rather than a value: GCC 12.2 (-O1 and up) folds
// `bf16 ? bit_cast<float>(bit_cast<uint32_t>(v) & 0xffff0000u) : v` to plain `v`.
float python_value(size_t index, size_t k, bool bf16) {
  const auto value = static_cast<float>(static_cast<double>(index) + static_cast<double>(k) / 1000.0);
  const uint32_t mask = bf16 ? 0xffff0000u : 0xffffffffu;
  return std::bit_cast<float>(std::bit_cast<uint32_t>(value) & mask);
}

// A GPT-2 in Hugging Face's layout, written by Python from the documented format (the
// safetensors package is not needed), with the "transformer." prefix and the attention
// mask buffers some files carry.
TEST(Gpt2SafetensorsTest, ReadsAGpt2FileWrittenByPython) {
  if (!fs::exists("/usr/bin/python3")) GTEST_SKIP() << "/usr/bin/python3 is not installed";
  testing::TempDir dir;
  const fs::path script = dir.path() / "write.py";
  const fs::path path = dir.path() / "gpt2.safetensors";
  {
    std::ofstream out(script);
    out << R"PY(import json, struct, sys
L, C, V, T = 2, 8, 11, 5
shapes = [("wte.weight", [V, C]), ("wpe.weight", [T, C])]
for i in range(L):
    p = f"h.{i}."
    shapes += [(p + "ln_1.weight", [C]), (p + "ln_1.bias", [C]), (p + "attn.c_attn.weight", [C, 3 * C]),
               (p + "attn.c_attn.bias", [3 * C]), (p + "attn.c_proj.weight", [C, C]), (p + "attn.c_proj.bias", [C]),
               (p + "ln_2.weight", [C]), (p + "ln_2.bias", [C]), (p + "mlp.c_fc.weight", [C, 4 * C]),
               (p + "mlp.c_fc.bias", [4 * C]), (p + "mlp.c_proj.weight", [4 * C, C]), (p + "mlp.c_proj.bias", [C])]
shapes += [("ln_f.weight", [C]), ("ln_f.bias", [C])]
header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
def add(name, dtype, shape, data):
    global offset
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
    blobs.append(data)
    offset += len(data)
for index, (name, shape) in enumerate(shapes):
    n = 1
    for d in shape: n *= d
    values = [index + k / 1000.0 for k in range(n)]
    if name.endswith("c_attn.weight"):  # one tensor in bf16: the top half of each float32
        add("transformer." + name, "BF16", shape, b"".join(struct.pack("<f", v)[2:] for v in values))
    else:
        add("transformer." + name, "F32", shape, struct.pack("<%df" % n, *values))
for i in range(L):
    add(f"transformer.h.{i}.attn.bias", "F32", [1, 1, T, T], struct.pack("<%df" % (T * T), *([1.0] * (T * T))))
    add(f"transformer.h.{i}.attn.masked_bias", "F32", [], struct.pack("<f", -1e4))
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for blob in blobs: f.write(blob)
)PY";
  }
  const std::string command = "/usr/bin/python3 " + script.string() + " " + path.string();
  ASSERT_EQ(std::system(command.c_str()), 0) << command;

  STRATA_ASSERT_OK_AND_ASSIGN(SafetensorsReader reader, SafetensorsReader::open(path.string()));
  STRATA_ASSERT_OK_AND_ASSIGN(Gpt2Dims dims, infer_gpt2_dims(reader));
  EXPECT_EQ(dims.n_layer, 2);
  EXPECT_EQ(dims.n_embd, 8);
  EXPECT_EQ(dims.vocab_size, 11);
  EXPECT_EQ(dims.n_ctx, 5);
  STRATA_ASSERT_OK(check_gpt2_file(reader, dims));
  const std::vector<NamedShape> shapes = gpt2_tensor_shapes(dims);
  ASSERT_EQ(shapes.size(), 2u + 2 * 12 + 2);
  for (size_t index = 0; index < shapes.size(); ++index) {
    STRATA_ASSERT_OK_AND_ASSIGN(const SafetensorsTensor* tensor, find_gpt2_tensor(reader, shapes[index].name, shapes[index].shape));
    std::vector<float> values(tensor->numel);
    STRATA_ASSERT_OK(reader.read_fp32(*tensor, 0, values));
    for (size_t k = 0; k < values.size(); k += 7) {
      const float expected = python_value(index, k, tensor->dtype == SafetensorsDType::kBF16);
      EXPECT_EQ(values[k], expected) << shapes[index].name << "[" << k << "] dtype " << safetensors_dtype_name(tensor->dtype);
    }
  }
  // The prefixed spelling finds the same tensor.
  STRATA_ASSERT_OK_AND_ASSIGN(const SafetensorsTensor* prefixed,
                              find_gpt2_tensor(reader, "transformer.h.1.mlp.c_fc.weight", std::vector<int64_t>{8, 32}));
  EXPECT_EQ(prefixed->name, "transformer.h.1.mlp.c_fc.weight");
  EXPECT_TRUE(is_gpt2_ignored_tensor("transformer.h.0.attn.masked_bias"));
  EXPECT_TRUE(is_gpt2_ignored_tensor("h.3.attn.bias"));
  EXPECT_TRUE(is_gpt2_ignored_tensor("lm_head.weight"));
  EXPECT_FALSE(is_gpt2_ignored_tensor("h.3.attn.c_attn.bias"));
}

// A GPT-2 file written by our writer without the prefix: a missing tensor and a wrong
// (transposed) shape are named with the file and both shapes.
TEST(Gpt2SafetensorsTest, Gpt2MissingTensorAndWrongShapeAreNamed) {
  testing::TempDir dir;
  const Gpt2Dims dims{2, 8, 11, 5};
  const std::string path = (dir.path() / "broken.safetensors").string();
  std::vector<SafetensorsTensorSpec> specs;
  for (const NamedShape& shape : gpt2_tensor_shapes(dims)) {
    if (shape.name == "h.1.ln_2.bias") continue;
    std::vector<int64_t> stored = shape.shape;
    if (shape.name == "h.0.attn.c_attn.weight") std::swap(stored[0], stored[1]);  // (out, in): a Linear, not a Conv1D
    specs.push_back({shape.name, SafetensorsDType::kF32, stored});
  }
  {
    STRATA_ASSERT_OK_AND_ASSIGN(SafetensorsWriter writer, SafetensorsWriter::create(path, specs));
    for (const auto& spec : specs) {
      STRATA_ASSERT_OK(writer.write_tensor(spec.name, [](uint64_t, std::span<float> out) {
        std::fill(out.begin(), out.end(), 0.5f);
        return Status::Ok();
      }));
    }
    STRATA_ASSERT_OK(writer.finish());
  }
  STRATA_ASSERT_OK_AND_ASSIGN(SafetensorsReader reader, SafetensorsReader::open(path));
  const Status check = check_gpt2_file(reader, dims);
  EXPECT_EQ(check.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(check.message(), path)) << check.to_string();
  EXPECT_TRUE(contains(check.message(), "h.1.ln_2.bias missing")) << check.to_string();
  EXPECT_TRUE(contains(check.message(), "h.0.attn.c_attn.weight has shape [24, 8], expected [8, 24]")) << check.to_string();

  const auto missing = find_gpt2_tensor(reader, "h.1.ln_2.bias", std::vector<int64_t>{8});
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(contains(missing.status().message(),
                       "GPT-2 tensor 'h.1.ln_2.bias' (or 'transformer.h.1.ln_2.bias') is missing from safetensors file " + path +
                           " (expected shape [8])"))
      << missing.status().to_string();
  const auto wrong = find_gpt2_tensor(reader, "h.0.attn.c_attn.weight", std::vector<int64_t>{8, 24});
  EXPECT_EQ(wrong.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(wrong.status().message(), "'h.0.attn.c_attn.weight' in safetensors file " + path +
                                                     " has shape [24, 8], expected [8, 24]"))
      << wrong.status().to_string();
}

}  // namespace
}  // namespace strata::gpt
