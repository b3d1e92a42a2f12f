// Token data: llm.c token files (round trip, header errors), text as bytes, the synthetic
// language's statistics against its stated floor, and the data loader's determinism,
// rank slicing and resumable position.
#include "examples/data/token_data.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <numeric>
#include <set>

#include "engine/core/check.h"
#include "tests/support/test_support.h"

namespace strata::data {
namespace {

namespace fs = std::filesystem;

using testing::contains;

void write_header_file(const fs::path& path, std::vector<int32_t> header_values, size_t payload_bytes) {
  std::vector<int32_t> header(kLlmcHeaderInts, 0);
  std::copy(header_values.begin(), header_values.end(), header.begin());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(header.data()), kLlmcHeaderBytes);
  const std::vector<char> payload(payload_bytes, 0);
  out.write(payload.data(), static_cast<std::streamsize>(payload.size()));
}

TEST(TokenFileTest, RoundTripAndWindows) {
  testing::TempDir dir;
  const std::string path = (dir.path() / "tokens.bin").string();
  std::vector<int32_t> tokens(5000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 7 % 50000);
  STRATA_ASSERT_OK(write_token_file(path, tokens));
  EXPECT_EQ(fs::file_size(path), kLlmcHeaderBytes + 2 * tokens.size());
  STRATA_ASSERT_OK_AND_ASSIGN(TokenFileHeader header, read_token_file_header(path));
  EXPECT_EQ(header.magic, kLlmcGpt2Magic);
  EXPECT_EQ(header.version, 1);
  EXPECT_EQ(header.token_count, tokens.size());
  EXPECT_EQ(header.token_bytes, 2u);

  FileDataOptions options;
  options.eval_fraction = 0.1;
  STRATA_ASSERT_OK_AND_ASSIGN(auto dataset, TokenDataset::open_token_file(path, options));
  EXPECT_EQ(dataset->vocab_size(), kGpt2VocabSize);
  EXPECT_FALSE(dataset->entropy_floor().has_value());
  EXPECT_EQ(*dataset->split_tokens(DataSplit::kTrain), 4500u);
  EXPECT_EQ(*dataset->split_tokens(DataSplit::kEval), 500u);
  // Every sample is a window of the file inside its split.
  std::vector<int32_t> sample(65);
  std::map<int32_t, size_t> position_of;
  for (size_t i = 0; i < tokens.size(); ++i) position_of[tokens[i]] = i;  // the values are distinct
  for (DataSplit split : {DataSplit::kTrain, DataSplit::kEval}) {
    std::set<size_t> starts;
    for (uint64_t index = 0; index < 50; ++index) {
      STRATA_ASSERT_OK(dataset->sample(split, 5, index, sample));
      const size_t start = position_of.at(sample[0]);
      starts.insert(start);
      for (size_t t = 0; t < sample.size(); ++t) ASSERT_EQ(sample[t], tokens[start + t]) << "index " << index;
      if (split == DataSplit::kTrain) EXPECT_LE(start + sample.size(), 4500u);
      else EXPECT_GE(start, 4500u);
    }
    EXPECT_GT(starts.size(), 40u);  // windows are spread over the split
  }
}

TEST(TokenFileTest, Llama3FormatAndVocabularyCheck) {
  testing::TempDir dir;
  const std::string path = (dir.path() / "llama.bin").string();
  std::vector<int32_t> tokens = {5, 100000, 128000, 7, 9, 11};
  STRATA_ASSERT_OK(write_token_file(path, tokens, TokenFileFormat::kLlama3));
  STRATA_ASSERT_OK_AND_ASSIGN(TokenFileHeader header, read_token_file_header(path));
  EXPECT_EQ(header.magic, kLlmcLlama3Magic);
  EXPECT_EQ(header.token_bytes, 4u);
  FileDataOptions options;
  options.vocab_size = 128256;
  STRATA_ASSERT_OK_AND_ASSIGN(auto dataset, TokenDataset::open_token_file(path, options));
  std::vector<int32_t> all(6);
  STRATA_ASSERT_OK(dataset->sample(DataSplit::kTrain, 1, 0, all));
  EXPECT_EQ(all, tokens);
  // A token past the vocabulary is named with its position when the file is opened (it
  // used to be found only when a sampled window hit it).
  options.vocab_size = 1000;
  const auto small_vocab = TokenDataset::open_token_file(path, options);
  ASSERT_FALSE(small_vocab.ok());
  EXPECT_TRUE(contains(small_vocab.status().message(),
                       path + ": token 1 (byte offset 1028) is 100000, at or above the vocabulary size 1000"))
      << small_vocab.status().to_string();
  // A GPT-2 file cannot hold tokens above 65535.
  EXPECT_FALSE(write_token_file(path, std::vector<int32_t>{70000}).ok());
}

// Token files of odd lengths with one token at the vocabulary size at the first, a middle
// or the last position, in both formats: the open fails naming that token.
struct OffenderCase {
  size_t tokens;
  size_t position;
  TokenFileFormat format;
};

class TokenFileVocabularyTest : public ::testing::TestWithParam<OffenderCase> {};

TEST_P(TokenFileVocabularyTest, ATokenAtOrAboveTheVocabularyFailsTheOpenNamingItsPosition) {
  const OffenderCase c = GetParam();
  testing::TempDir dir;
  const std::string path = (dir.path() / "tokens.bin").string();
  constexpr int64_t kVocab = 50257;
  std::vector<int32_t> tokens(c.tokens);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7919) % kVocab);
  STRATA_ASSERT_OK(write_token_file(path, tokens, c.format));
  STRATA_ASSERT_OK(TokenDataset::open_token_file(path, {.vocab_size = kVocab}).status());
  // A later, larger offender too: the first is the one named.
  tokens[c.position] = static_cast<int32_t>(kVocab);
  if (c.position + 1 < tokens.size()) tokens.back() = 65535;
  STRATA_ASSERT_OK(write_token_file(path, tokens, c.format));
  const auto dataset = TokenDataset::open_token_file(path, {.vocab_size = kVocab});
  ASSERT_FALSE(dataset.ok());
  const size_t token_bytes = c.format == TokenFileFormat::kGpt2 ? 2 : 4;
  EXPECT_EQ(dataset.status().message(),
            "token file " + path + ": token " + std::to_string(c.position) + " (byte offset " +
                std::to_string(kLlmcHeaderBytes + c.position * token_bytes) +
                ") is 50257, at or above the vocabulary size 50257 (the first such token; was the file tokenized for another model?)");
}

std::vector<OffenderCase> offender_cases() {
  std::vector<OffenderCase> cases;
  for (TokenFileFormat format : {TokenFileFormat::kGpt2, TokenFileFormat::kLlama3})
    for (size_t n : {size_t{1}, size_t{7}, size_t{4097}})
      for (size_t position : std::set<size_t>{0, n / 2, n - 1}) cases.push_back({n, position, format});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(OddSizes, TokenFileVocabularyTest, ::testing::ValuesIn(offender_cases()),
                         [](const ::testing::TestParamInfo<OffenderCase>& info) {
                           return std::string(info.param.format == TokenFileFormat::kGpt2 ? "uint16_" : "uint32_") +
                                  std::to_string(info.param.tokens) + "_tokens_at_" + std::to_string(info.param.position);
                         });

// The trainer opens data through TokenDataset::open with the model's vocabulary as the
// synthetic vocab_size: that, not the file format's 50257, bounds a GPT-2 file's tokens.
TEST(TokenFileTest, TheModelsVocabularyBoundsTheTokensThroughOpen) {
  testing::TempDir dir;
  const std::string path = (dir.path() / "tokens.bin").string();
  STRATA_ASSERT_OK(write_token_file(path, std::vector<int32_t>{1, 2, 999, 3}));
  DataConfig config;
  config.kind = DataKind::kTokens;
  config.path = path;
  SyntheticLanguageOptions model_vocab;
  model_vocab.vocab_size = 1000;
  STRATA_ASSERT_OK_AND_ASSIGN(auto dataset, TokenDataset::open(config, model_vocab));
  EXPECT_EQ(dataset->vocab_size(), 1000);
  model_vocab.vocab_size = 999;
  const auto refused = TokenDataset::open(config, model_vocab);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(contains(refused.status().message(), ": token 2 (byte offset 1028) is 999, at or above the vocabulary size 999"))
      << refused.status().to_string();
}

struct HeaderCase {
  std::string name;
  std::vector<int32_t> header;
  size_t payload_bytes;
  std::string expected;
};

class TokenFileBadHeader : public ::testing::TestWithParam<HeaderCase> {};

TEST_P(TokenFileBadHeader, NamesTheFileAndTheField) {
  testing::TempDir dir;
  const fs::path path = dir.path() / "bad.bin";
  write_header_file(path, GetParam().header, GetParam().payload_bytes);
  const auto header = read_token_file_header(path.string());
  ASSERT_FALSE(header.ok());
  EXPECT_EQ(header.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(header.status().message(), "token file " + path.string())) << header.status().to_string();
  EXPECT_TRUE(contains(header.status().message(), GetParam().expected)) << header.status().to_string();
  // Opening it as a dataset gives the same error.
  const auto dataset = TokenDataset::open_token_file(path.string(), {});
  EXPECT_TRUE(contains(dataset.status().message(), GetParam().expected)) << dataset.status().to_string();
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TokenFileBadHeader,
    ::testing::Values(HeaderCase{"bad_magic", {12345, 1, 10}, 20, "header[0] (magic) is 12345, expected 20240520"},
                      HeaderCase{"bad_version", {20240520, 3, 10}, 20, "header[1] (version) is 3, expected 1 (llm.c tokens) or 2"},
                      HeaderCase{"llama_bad_version", {20240801, 1, 10}, 40, "header[1] (version) is 1, expected 7"},
                      HeaderCase{"zero_count", {20240520, 1, 0}, 0, "header[2] (token count) is 0"},
                      HeaderCase{"short_payload", {20240520, 1, 100}, 100,
                                 "header[2] (token count) is 100, so the file should be 1224 bytes, but it is 1124 (truncated?)"},
                      HeaderCase{"long_payload", {20240520, 1, 10}, 30, "should be 1044 bytes, but it is 1054"}),
    [](const auto& info) { return info.param.name; });

TEST(TokenFileTest, ShorterThanTheHeaderAndMissing) {
  testing::TempDir dir;
  const fs::path path = dir.path() / "short.bin";
  {
    std::ofstream out(path, std::ios::binary);
    out << "0123456789";
  }
  const auto header = read_token_file_header(path.string());
  EXPECT_TRUE(contains(header.status().message(), "is 10 bytes, shorter than the llm.c header (1024 bytes")) << header.status().to_string();
  EXPECT_EQ(read_token_file_header((dir.path() / "absent.bin").string()).status().code(), StatusCode::kNotFound);
}

TEST(TextFileTest, BytesAreTokens) {
  testing::TempDir dir;
  const fs::path path = dir.path() / "text.txt";
  std::string text;
  for (int i = 0; i < 200; ++i) text += "line " + std::to_string(i) + ": the quick brown fox \xc3\xa9\n";
  {
    std::ofstream out(path, std::ios::binary);
    out << text;
  }
  FileDataOptions options;
  options.eval_fraction = 0.25;
  STRATA_ASSERT_OK_AND_ASSIGN(auto dataset, TokenDataset::open_text_file(path.string(), options));
  EXPECT_EQ(dataset->vocab_size(), 256);
  std::vector<int32_t> sample(33);
  for (uint64_t index = 0; index < 20; ++index) {
    STRATA_ASSERT_OK(dataset->sample(DataSplit::kEval, 3, index, sample));
    std::string window;
    for (int32_t token : sample) {
      ASSERT_GE(token, 0);
      ASSERT_LT(token, 256);
      window.push_back(static_cast<char>(token));
    }
    const size_t at = text.find(window, text.size() - *dataset->split_tokens(DataSplit::kEval));
    EXPECT_NE(at, std::string::npos) << "eval sample " << index << " is not a window of the eval part";
  }
  EXPECT_EQ(TokenDataset::open_text_file((dir.path() / "absent.txt").string(), {}).status().code(), StatusCode::kNotFound);
  options.eval_fraction = 1.0;
  EXPECT_FALSE(TokenDataset::open_text_file(path.string(), options).ok());
}

// ---------------------------------------------------------------------------------------
// The synthetic language

struct LanguageStats {
  std::vector<uint64_t> unigram;
  double conditional_entropy = 0.0;  // empirical H(next | context of `order` tokens), nats
  double bigram_entropy = 0.0;       // empirical H(next | previous token only)
  uint64_t transitions = 0;
  uint64_t invalid_transitions = 0;  // next tokens outside the language's successor set
};

LanguageStats measure(const SyntheticLanguageOptions& language, uint64_t samples, size_t length) {
  auto dataset = TokenDataset::synthetic(language);
  STRATA_CHECK_OK(dataset);
  const auto v = static_cast<size_t>(language.vocab_size);
  LanguageStats stats;
  stats.unigram.assign(v, 0);
  std::vector<uint64_t> context_next(v * v * (language.order == 2 ? v : 1), 0);
  std::vector<uint64_t> bigram(v * v, 0);
  std::vector<std::set<int32_t>> successor_sets(language.order == 2 ? v * v : v);
  for (size_t a = 0; a < (language.order == 2 ? v : 1); ++a) {
    for (size_t b = 0; b < v; ++b) {
      const auto list = synthetic_successors(language, static_cast<int32_t>(a), static_cast<int32_t>(b));
      successor_sets[a * v + b] = std::set<int32_t>(list.begin(), list.end());
    }
  }
  std::vector<int32_t> sample(length);
  for (uint64_t index = 0; index < samples; ++index) {
    STRATA_CHECK_OK((*dataset)->sample(DataSplit::kTrain, 77, index, sample));
    for (size_t t = 0; t < length; ++t) {
      ++stats.unigram[static_cast<size_t>(sample[t])];
      if (t < 2) continue;  // order-2 contexts need two tokens before
      const auto a = static_cast<size_t>(sample[t - 2]);
      const auto b = static_cast<size_t>(sample[t - 1]);
      const auto c = static_cast<size_t>(sample[t]);
      const size_t context = language.order == 2 ? a * v + b : b;
      ++context_next[context * v + c];
      ++bigram[b * v + c];
      ++stats.transitions;
      if (successor_sets[context].count(sample[t]) == 0) ++stats.invalid_transitions;
    }
  }
  auto entropy = [&](const std::vector<uint64_t>& joint, size_t contexts) {
    double h = 0.0;
    for (size_t context = 0; context < contexts; ++context) {
      uint64_t total = 0;
      for (size_t c = 0; c < v; ++c) total += joint[context * v + c];
      for (size_t c = 0; c < v; ++c) {
        const uint64_t n = joint[context * v + c];
        if (n > 0) h -= static_cast<double>(n) * std::log(static_cast<double>(n) / static_cast<double>(total));
      }
    }
    return h / static_cast<double>(stats.transitions);
  };
  stats.conditional_entropy = entropy(context_next, language.order == 2 ? v * v : v);
  stats.bigram_entropy = entropy(bigram, v);
  return stats;
}

// Pearson's chi-square of the counts against a uniform distribution.
double chi_square_uniform(const std::vector<uint64_t>& counts) {
  uint64_t total = 0;
  for (uint64_t n : counts) total += n;
  const double expected = static_cast<double>(total) / static_cast<double>(counts.size());
  double chi = 0.0;
  for (uint64_t n : counts) chi += (static_cast<double>(n) - expected) * (static_cast<double>(n) - expected) / expected;
  return chi;
}

class SyntheticLanguageTest : public ::testing::TestWithParam<int> {};

TEST_P(SyntheticLanguageTest, UniformMarginalAndEntropyAtTheFloor) {
  SyntheticLanguageOptions language;
  language.order = GetParam();
  language.vocab_size = language.order == 1 ? 64 : 24;
  language.successors = 4;
  STRATA_ASSERT_OK_AND_ASSIGN(auto dataset, TokenDataset::synthetic(language));
  ASSERT_TRUE(dataset->entropy_floor().has_value());
  EXPECT_DOUBLE_EQ(*dataset->entropy_floor(), std::log(4.0));
  EXPECT_TRUE(contains(dataset->describe(), "entropy floor 1.3863 nats/token")) << dataset->describe();

  const LanguageStats stats = measure(language, 2000, 129);
  EXPECT_EQ(stats.invalid_transitions, 0u);
  // Uniform marginal: chi-square with V - 1 degrees of freedom stays within its mean plus
  // six standard deviations.
  const double dof = static_cast<double>(language.vocab_size - 1);
  EXPECT_LT(chi_square_uniform(stats.unigram), dof + 6.0 * std::sqrt(2.0 * dof));
  // The empirical conditional entropy sits at ln k (the plug-in estimate is biased low by
  // about cells / (2 N) nats).
  EXPECT_NEAR(stats.conditional_entropy, std::log(4.0), 0.01) << "order " << language.order;
  if (language.order == 2) {
    // The previous token alone says nothing: H(next | previous) is ln V.
    EXPECT_NEAR(stats.bigram_entropy, std::log(static_cast<double>(language.vocab_size)), 0.02);
  } else {
    EXPECT_NEAR(stats.bigram_entropy, std::log(4.0), 0.01);
  }
}

INSTANTIATE_TEST_SUITE_P(Orders, SyntheticLanguageTest, ::testing::Values(1, 2),
                         [](const auto& info) { return "order" + std::to_string(info.param); });

TEST(SyntheticLanguageTest, SuccessorsAreDistinctAndTheLanguageIsFixedBySeed) {
  SyntheticLanguageOptions language;
  language.vocab_size = 50257;  // GPT-2's vocabulary: construction stays cheap
  language.successors = 16;
  language.order = 2;
  const auto successors = synthetic_successors(language, 123, 45678);
  EXPECT_EQ(std::set<int32_t>(successors.begin(), successors.end()).size(), 16u);
  EXPECT_EQ(successors, synthetic_successors(language, 123, 45678));
  language.seed += 1;
  EXPECT_NE(successors, synthetic_successors(language, 123, 45678));
  EXPECT_FALSE(TokenDataset::synthetic({.vocab_size = 10, .order = 3, .successors = 2}).ok());
  EXPECT_FALSE(TokenDataset::synthetic({.vocab_size = 10, .order = 1, .successors = 11}).ok());
  EXPECT_FALSE(TokenDataset::synthetic({.vocab_size = 1, .order = 1, .successors = 1}).ok());
}

// ---------------------------------------------------------------------------------------
// The data loader

std::shared_ptr<const TokenDataset> small_language() {
  auto dataset = TokenDataset::synthetic({.vocab_size = 97, .order = 2, .successors = 3});
  STRATA_CHECK_OK(dataset);
  return *dataset;
}

struct Batch {
  std::vector<int32_t> inputs, targets;
  bool operator==(const Batch&) const = default;
};

Batch load(const DataLoader& loader, uint64_t index) {
  Batch batch{std::vector<int32_t>(loader.batch_elements()), std::vector<int32_t>(loader.batch_elements())};
  STRATA_CHECK_OK(loader.batch_at(index, batch.inputs, batch.targets));
  return batch;
}

TEST(DataLoaderTest, DeterministicAndShifted) {
  DataLoaderOptions options{.global_batch = 4, .seq_len = 16, .micro_batches = 3, .seed = 11};
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader a, DataLoader::create(small_language(), options));
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader b, DataLoader::create(small_language(), options));
  EXPECT_EQ(a.batch_elements(), 64u);
  for (uint64_t index : {0u, 1u, 7u, 1000u}) EXPECT_TRUE(load(a, index) == load(b, index)) << index;
  EXPECT_FALSE(load(a, 0) == load(a, 1));
  // (step, micro) addresses batch step * micro_batches + micro.
  Batch by_step{std::vector<int32_t>(64), std::vector<int32_t>(64)};
  STRATA_ASSERT_OK(a.batch(2, 1, by_step.inputs, by_step.targets));
  EXPECT_TRUE(by_step == load(a, 7));
  EXPECT_FALSE(a.batch(0, 3, by_step.inputs, by_step.targets).ok());
  // Targets are the inputs shifted by one within each row.
  const Batch batch = load(a, 5);
  for (int row = 0; row < 4; ++row) {
    for (int t = 0; t + 1 < 16; ++t) EXPECT_EQ(batch.targets[row * 16 + t], batch.inputs[row * 16 + t + 1]);
  }
  // Another data seed, other samples; the eval split differs from train.
  options.seed = 12;
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader other_seed, DataLoader::create(small_language(), options));
  EXPECT_FALSE(load(other_seed, 0) == load(a, 0));
  options.seed = 11;
  options.split = DataSplit::kEval;
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader eval, DataLoader::create(small_language(), options));
  EXPECT_FALSE(load(eval, 0) == load(a, 0));
}

TEST(DataLoaderTest, RanksTakeTheirSliceOfTheSameGlobalBatch) {
  const auto language = small_language();
  DataLoaderOptions options{.global_batch = 8, .seq_len = 10, .seed = 3};
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader whole, DataLoader::create(language, options));
  for (int world : {2, 4, 8}) {
    for (uint64_t index : {0u, 5u}) {
      const Batch expected = load(whole, index);
      Batch joined;
      for (int rank = 0; rank < world; ++rank) {
        DataLoaderOptions rank_options = options;
        rank_options.rank = rank;
        rank_options.world_size = world;
        STRATA_ASSERT_OK_AND_ASSIGN(DataLoader loader, DataLoader::create(language, rank_options));
        EXPECT_EQ(loader.local_rows(), 8 / world);
        const Batch part = load(loader, index);
        joined.inputs.insert(joined.inputs.end(), part.inputs.begin(), part.inputs.end());
        joined.targets.insert(joined.targets.end(), part.targets.begin(), part.targets.end());
      }
      EXPECT_TRUE(joined == expected) << "world " << world << " batch " << index;
    }
  }
  options.world_size = 3;  // 8 rows do not split over 3 ranks
  const auto uneven = DataLoader::create(language, options);
  EXPECT_TRUE(contains(uneven.status().message(), "global batch of 8 rows does not split evenly over 3 ranks"))
      << uneven.status().to_string();
}

TEST(DataLoaderTest, PositionSavesAndRestores) {
  DataLoaderOptions options{.global_batch = 2, .seq_len = 8, .seed = 21};
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader loader, DataLoader::create(small_language(), options));
  Batch batch{std::vector<int32_t>(16), std::vector<int32_t>(16)};
  for (int i = 0; i < 5; ++i) STRATA_ASSERT_OK(loader.next(batch.inputs, batch.targets));
  EXPECT_EQ(loader.position(), 5u);
  const std::string saved = loader.state_json();
  Batch expected{std::vector<int32_t>(16), std::vector<int32_t>(16)};
  STRATA_ASSERT_OK(loader.next(expected.inputs, expected.targets));

  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader resumed, DataLoader::create(small_language(), options));
  STRATA_ASSERT_OK(resumed.restore_json(saved));
  EXPECT_EQ(resumed.position(), 5u);
  STRATA_ASSERT_OK(resumed.next(batch.inputs, batch.targets));
  EXPECT_TRUE(batch == expected);

  options.seed = 22;
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader other, DataLoader::create(small_language(), options));
  const Status seed_mismatch = other.restore_json(saved);
  EXPECT_TRUE(contains(seed_mismatch.message(), "saved with data seed 21, this run uses 22")) << seed_mismatch.to_string();
  options.seed = 21;
  options.seq_len = 9;
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader longer, DataLoader::create(small_language(), options));
  EXPECT_TRUE(contains(longer.restore_json(saved).message(), "seq_len 8"));
  EXPECT_FALSE(longer.restore_json("{}").ok());
  EXPECT_FALSE(longer.restore_json("nonsense").ok());
}

TEST(DataLoaderTest, FileSplitsAndOptionErrors) {
  testing::TempDir dir;
  const std::string path = (dir.path() / "t.bin").string();
  std::vector<int32_t> tokens(300);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i);
  STRATA_ASSERT_OK(write_token_file(path, tokens));
  STRATA_ASSERT_OK_AND_ASSIGN(auto no_eval, TokenDataset::open_token_file(path, {}));
  DataLoaderOptions options{.global_batch = 2, .seq_len = 16, .split = DataSplit::kEval};
  const auto eval = DataLoader::create(no_eval, options);
  EXPECT_TRUE(contains(eval.status().message(), "no eval split (strata.data.eval_fraction is 0)")) << eval.status().to_string();
  STRATA_ASSERT_OK_AND_ASSIGN(auto little_eval, TokenDataset::open_token_file(path, {.eval_fraction = 0.03}));
  const auto short_eval = DataLoader::create(little_eval, options);
  EXPECT_TRUE(contains(short_eval.status().message(), "has 9 tokens, fewer than one sample (seq_len + 1 = 17)"))
      << short_eval.status().to_string();
  options.split = DataSplit::kTrain;
  options.seq_len = 0;
  EXPECT_FALSE(DataLoader::create(no_eval, options).ok());
  options.seq_len = 16;
  options.rank = 2;
  options.world_size = 2;
  EXPECT_FALSE(DataLoader::create(no_eval, options).ok());
  options.rank = 0;
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader loader, DataLoader::create(no_eval, options));
  std::vector<int32_t> wrong_size(5);
  EXPECT_FALSE(loader.batch_at(0, wrong_size, wrong_size).ok());

  // The config's data section picks the kind.
  DataConfig config;
  config.kind = DataKind::kTokens;
  config.path = path;
  config.eval_fraction = 0.5;
  // (The synthetic options' vocab_size is the model's, the bound for the file's tokens.)
  STRATA_ASSERT_OK_AND_ASSIGN(auto from_config, TokenDataset::open(config, {.vocab_size = kGpt2VocabSize}));
  EXPECT_EQ(*from_config->split_tokens(DataSplit::kEval), 150u);
  config.kind = DataKind::kSynthetic;
  STRATA_ASSERT_OK_AND_ASSIGN(auto synthetic, TokenDataset::open(config, {.vocab_size = 50}));
  EXPECT_EQ(synthetic->vocab_size(), 50);
  config.kind = DataKind::kText;
  config.path.clear();
  EXPECT_TRUE(contains(TokenDataset::open(config, {}).status().message(), "strata.data.path is required"));
}

// ---------------------------------------------------------------------------------------
// Fine-tuning token files (versions 2 and 8): rows, flags, masked targets, position ids

constexpr uint8_t kT = kTokenIsTarget;
constexpr uint8_t kD = kTokenStartsDocument;

std::vector<unsigned char> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<unsigned char>(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

void set_header_int(std::vector<unsigned char>& bytes, size_t index, int32_t value) { std::memcpy(bytes.data() + 4 * index, &value, 4); }

// Valid flags for `count` tokens: rows (or the stream) start documents, a few more
// documents start inside, and tokens that start no document are targets two times in three.
std::vector<uint8_t> valid_flags(size_t count, size_t row_length) {
  std::vector<uint8_t> flags(count);
  for (size_t i = 0; i < count; ++i) {
    const bool starts = (row_length > 0 ? i % row_length == 0 : i == 0) || i % 13 == 5;
    flags[i] = starts ? kD : (i % 3 != 0 ? kT : 0);
  }
  return flags;
}

struct RoundTripCase {
  size_t tokens;
  size_t row_length;
  TokenFileFormat format;
};

class FineTuningFileRoundTrip : public ::testing::TestWithParam<RoundTripCase> {};

TEST_P(FineTuningFileRoundTrip, HeaderTokensAndFlagsComeBackByteForByte) {
  const RoundTripCase c = GetParam();
  testing::TempDir dir;
  const std::string path = (dir.path() / "ft.bin").string();
  const bool narrow = c.format == TokenFileFormat::kGpt2;
  std::vector<int32_t> tokens(c.tokens);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7919 + 3) % (narrow ? 65536 : 200000));
  const std::vector<uint8_t> flags = valid_flags(c.tokens, c.row_length);
  STRATA_ASSERT_OK(write_fine_tuning_file(path, tokens, flags, {.format = c.format, .row_length = c.row_length, .pad_token = 0}));

  const size_t width = narrow ? 2 : 4;
  const std::vector<unsigned char> bytes = file_bytes(path);
  ASSERT_EQ(bytes.size(), kLlmcHeaderBytes + c.tokens * width + c.tokens);
  STRATA_ASSERT_OK_AND_ASSIGN(const TokenFileHeader header, read_token_file_header(path));
  EXPECT_EQ(header.magic, narrow ? kLlmcGpt2Magic : kLlmcLlama3Magic);
  EXPECT_EQ(header.version, narrow ? 2 : 8);
  EXPECT_TRUE(header.has_flags);
  EXPECT_EQ(header.token_count, c.tokens);
  EXPECT_EQ(header.row_length, c.row_length);
  EXPECT_EQ(header.pad_token, 0);
  EXPECT_EQ(header.target_count, static_cast<uint64_t>(std::count(flags.begin(), flags.end(), kT)));
  EXPECT_EQ(header.document_count, static_cast<uint64_t>(std::count(flags.begin(), flags.end(), kD)));
  for (size_t i = 0; i < c.tokens; ++i) {
    uint32_t token = 0;
    std::memcpy(&token, bytes.data() + kLlmcHeaderBytes + i * width, width);
    ASSERT_EQ(token, static_cast<uint32_t>(tokens[i])) << i;
    ASSERT_EQ(bytes[header.flags_offset() + i], flags[i]) << i;
  }

  STRATA_ASSERT_OK_AND_ASSIGN(auto dataset, TokenDataset::open_token_file(path, {}));
  if (c.row_length == 0) {
    EXPECT_FALSE(dataset->row_length().has_value());
    return;
  }
  // Sample i is row i, in file order, tokens and flags.
  EXPECT_EQ(dataset->row_length(), c.row_length);
  std::vector<int32_t> row(c.row_length);
  std::vector<uint8_t> row_flags(c.row_length);
  const size_t rows = c.tokens / c.row_length;
  for (size_t i = 0; i < rows + 1; ++i) {
    STRATA_ASSERT_OK(dataset->sample_with_flags(DataSplit::kTrain, 99, i, row, row_flags));
    const size_t begin = (i % rows) * c.row_length;
    EXPECT_TRUE(std::equal(row.begin(), row.end(), tokens.begin() + static_cast<ptrdiff_t>(begin))) << "row " << i;
    EXPECT_TRUE(std::equal(row_flags.begin(), row_flags.end(), flags.begin() + static_cast<ptrdiff_t>(begin))) << "row " << i;
  }
}

std::vector<RoundTripCase> round_trip_cases() {
  std::vector<RoundTripCase> cases;
  for (TokenFileFormat format : {TokenFileFormat::kGpt2, TokenFileFormat::kLlama3}) {
    for (RoundTripCase c : {RoundTripCase{1, 0}, RoundTripCase{7, 0}, RoundTripCase{7, 7}, RoundTripCase{22, 2}, RoundTripCase{22, 11},
                            RoundTripCase{55, 5}, RoundTripCase{4097, 17}, RoundTripCase{4097, 0}}) {
      c.format = format;
      cases.push_back(c);
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(OddSizes, FineTuningFileRoundTrip, ::testing::ValuesIn(round_trip_cases()),
                         [](const ::testing::TestParamInfo<RoundTripCase>& info) {
                           return std::string(info.param.format == TokenFileFormat::kGpt2 ? "uint16_" : "uint32_") +
                                  std::to_string(info.param.tokens) + "_tokens_rows_of_" + std::to_string(info.param.row_length);
                         });

// A good file of 4 rows of 6 tokens, then one change to its bytes; opening names the problem.
struct CorruptionCase {
  std::string name;
  std::function<void(std::vector<unsigned char>&)> corrupt;
  std::string expected;
};

class FineTuningFileCorruption : public ::testing::TestWithParam<CorruptionCase> {};

TEST_P(FineTuningFileCorruption, OpeningRefusesItNamingTheFieldOrToken) {
  testing::TempDir dir;
  const std::string path = (dir.path() / "ft.bin").string();
  std::vector<int32_t> tokens(24);
  std::iota(tokens.begin(), tokens.end(), 1);
  STRATA_ASSERT_OK(write_fine_tuning_file(path, tokens, valid_flags(24, 6), {.row_length = 6}));
  STRATA_ASSERT_OK(TokenDataset::open_token_file(path, {}).status());
  std::vector<unsigned char> bytes = file_bytes(path);
  GetParam().corrupt(bytes);
  write_bytes(path, bytes);
  const auto dataset = TokenDataset::open_token_file(path, {});
  ASSERT_FALSE(dataset.ok());
  EXPECT_EQ(dataset.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(dataset.status().message(), "token file " + path)) << dataset.status().to_string();
  EXPECT_TRUE(contains(dataset.status().message(), GetParam().expected)) << dataset.status().to_string();
}

constexpr size_t kFlags = kLlmcHeaderBytes + 24 * 2;  // where the good file's flags start

INSTANTIATE_TEST_SUITE_P(
    Cases, FineTuningFileCorruption,
    ::testing::Values(
        CorruptionCase{"truncated_by_one_byte", [](auto& b) { b.pop_back(); },
                       "should be 1096 bytes (header, tokens of 2 bytes, a flags byte each), but it is 1095 (truncated?)"},
        CorruptionCase{"flags_missing", [](auto& b) { b.resize(kFlags); }, "but it is 1072 (truncated?)"},
        CorruptionCase{"a_byte_too_many", [](auto& b) { b.push_back(0); }, "should be 1096 bytes"},
        CorruptionCase{"row_length_not_a_divisor", [](auto& b) { set_header_int(b, 3, 5); },
                       "header[3] (row length) is 5, expected 0 (one stream) or a length >= 2 that divides"},
        CorruptionCase{"row_length_one", [](auto& b) { set_header_int(b, 3, 1); }, "header[3] (row length) is 1"},
        CorruptionCase{"pad_token_negative", [](auto& b) { set_header_int(b, 4, -2); }, "header[4] (pad token) is -2"},
        CorruptionCase{"target_count_too_large", [](auto& b) { set_header_int(b, 5, 25); }, "header[5] (target count) is 25"},
        CorruptionCase{"reserved_header_int", [](auto& b) { set_header_int(b, 255, 1); }, "header[255] is 1, expected 0 (reserved in version 2)"},
        CorruptionCase{"reserved_flag_bit", [](auto& b) { b[kFlags + 9] |= 4; }, "token 9 (flags byte offset 1081) has reserved bits set"},
        CorruptionCase{"target_and_document_start", [](auto& b) { b[kFlags + 5] = kT | kD; }, "token 5 (flags byte offset 1077) is both a loss target and a document start"},
        CorruptionCase{"row_without_document_start", [](auto& b) { b[kFlags + 12] = kT; }, "token 12 (flags byte offset 1084) begins row 2 but does not start a document"},
        CorruptionCase{"a_target_bit_lost", [](auto& b) { b[kFlags + 1] = 0; }, "the flags mark 14 loss targets and 5 document starts, but header[5] and header[6] say 15 and 5"},
        CorruptionCase{"version_of_the_other_width", [](auto& b) { set_header_int(b, 1, 8); }, "header[1] (version) is 8, expected 1 (llm.c tokens) or 2"}),
    [](const auto& info) { return info.param.name; });

TEST(FineTuningFileTest, TheWriterRefusesWhatTheReaderWould) {
  testing::TempDir dir;
  const std::string path = (dir.path() / "ft.bin").string();
  const std::vector<int32_t> tokens = {1, 2, 3, 4};
  EXPECT_TRUE(contains(write_fine_tuning_file(path, tokens, std::vector<uint8_t>{kD, kT, kT}, {}).message(), "3 flags for 4 tokens"));
  EXPECT_TRUE(contains(write_fine_tuning_file(path, tokens, std::vector<uint8_t>{kD, kT, kD, kT}, {.row_length = 3}).message(),
                       "header[3] (row length) is 3"));
  EXPECT_TRUE(contains(write_fine_tuning_file(path, tokens, std::vector<uint8_t>{kD, kT, kT, kT}, {.row_length = 2}).message(),
                       "token 2 (flags byte offset 1034) begins row 1 but does not start a document"));
  EXPECT_TRUE(contains(write_fine_tuning_file(path, std::vector<int32_t>{1, 70000}, std::vector<uint8_t>{kD, kT}, {}).message(),
                       "token 1 is 70000, which does not fit uint16"));
  EXPECT_FALSE(fs::exists(path));
}

// The model's vocabulary, not the format's, bounds the tokens: a small model reads a file
// whose tokens all fit it, in every format, and refuses one that holds a larger token.
TEST(FineTuningFileTest, ASmallModelVocabularyLoadsEveryFormatWhoseTokensFitIt) {
  testing::TempDir dir;
  std::vector<int32_t> tokens(40);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i % 31);
  const std::vector<uint8_t> flags = valid_flags(tokens.size(), 8);
  struct Writer {
    std::string name;
    std::function<Status(const std::string&)> write;
  };
  const std::vector<Writer> writers = {
      {"llmc_gpt2.bin", [&](const std::string& p) { return write_token_file(p, tokens, TokenFileFormat::kGpt2); }},
      {"llmc_llama3.bin", [&](const std::string& p) { return write_token_file(p, tokens, TokenFileFormat::kLlama3); }},
      {"ft_u16.bin", [&](const std::string& p) { return write_fine_tuning_file(p, tokens, flags, {.row_length = 8}); }},
      {"ft_u32.bin", [&](const std::string& p) {
         return write_fine_tuning_file(p, tokens, flags, {.format = TokenFileFormat::kLlama3, .row_length = 8});
       }}};
  for (const Writer& writer : writers) {
    const std::string path = (dir.path() / writer.name).string();
    STRATA_ASSERT_OK(writer.write(path));
    DataConfig config;
    config.kind = DataKind::kTokens;
    config.path = path;
    STRATA_ASSERT_OK_AND_ASSIGN(auto dataset, TokenDataset::open(config, {.vocab_size = 31}));
    EXPECT_EQ(dataset->vocab_size(), 31) << writer.name;
    const auto refused = TokenDataset::open(config, {.vocab_size = 30});
    EXPECT_TRUE(contains(refused.status().message(), ": token 30 (byte offset")) << writer.name << ": " << refused.status().to_string();
    EXPECT_TRUE(contains(refused.status().message(), "is 30, at or above the vocabulary size 30")) << refused.status().to_string();
  }
}

struct FullBatch {
  std::vector<int32_t> inputs, targets, positions;
};

FullBatch load_full(const DataLoader& loader, uint64_t index) {
  FullBatch batch{std::vector<int32_t>(loader.batch_elements()), std::vector<int32_t>(loader.batch_elements()),
                  std::vector<int32_t>(loader.batch_elements())};
  STRATA_CHECK_OK(loader.batch_at(index, batch.inputs, batch.targets, batch.positions));
  return batch;
}

// Two rows of 9 tokens (seq_len 8): a packed row of two examples and a right-padded row of
// one. Prompt tokens are 100+, completions 200+, BOS 1, padding 0.
struct TwoRows {
  std::vector<int32_t> tokens = {1, 100, 101, 200, 201, /**/ 1, 102, 202, 203,  //
                                 1, 103, 204, 205, 206, /**/ 0, 0, 0, 0};
  std::vector<uint8_t> flags = {kD, 0, 0, kT, kT, /**/ kD, 0, kT, kT,  //
                                kD, 0, kT, kT, kT, /**/ 0, 0, 0, 0};
};

TEST(FineTuningLoaderTest, PackedAndPaddedRowsGiveMaskedTargetsAndRestartingPositions) {
  testing::TempDir dir;
  const std::string path = (dir.path() / "ft.bin").string();
  const TwoRows rows;
  STRATA_ASSERT_OK(write_fine_tuning_file(path, rows.tokens, rows.flags, {.row_length = 9, .pad_token = 0}));
  STRATA_ASSERT_OK_AND_ASSIGN(auto dataset, TokenDataset::open_token_file(path, {.vocab_size = 300}));
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader loader, DataLoader::create(dataset, {.global_batch = 2, .seq_len = 8, .seed = 5}));
  const FullBatch batch = load_full(loader, 0);
  EXPECT_EQ(batch.inputs, (std::vector<int32_t>{1, 100, 101, 200, 201, 1, 102, 202, /**/ 1, 103, 204, 205, 206, 0, 0, 0}));
  // A target only where the next token is a completion token; never across a document start or into padding.
  EXPECT_EQ(batch.targets, (std::vector<int32_t>{-1, -1, 200, 201, -1, -1, 202, 203, /**/ -1, 204, 205, 206, -1, -1, -1, -1}));
  // Positions restart at the packed example's start; padding continues the last document's count.
  EXPECT_EQ(batch.positions, (std::vector<int32_t>{0, 1, 2, 3, 4, 0, 1, 2, /**/ 0, 1, 2, 3, 4, 5, 6, 7}));
  // The overload without positions gives the same inputs and targets; the data seed does not pick rows.
  Batch two{std::vector<int32_t>(16), std::vector<int32_t>(16)};
  STRATA_ASSERT_OK(loader.batch_at(0, two.inputs, two.targets));
  EXPECT_EQ(two.inputs, batch.inputs);
  EXPECT_EQ(two.targets, batch.targets);
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader other_seed, DataLoader::create(dataset, {.global_batch = 2, .seq_len = 8, .seed = 6}));
  EXPECT_EQ(load_full(other_seed, 0).inputs, batch.inputs);
  // A second pass over the rows (epoch 2) repeats them.
  EXPECT_EQ(load_full(loader, 1).targets, batch.targets);
  std::vector<int32_t> short_positions(3);
  EXPECT_FALSE(loader.batch_at(0, two.inputs, two.targets, short_positions).ok());
}

TEST(FineTuningLoaderTest, RowsAreSamplesInFileOrderForEveryWorldSizeAndResume) {
  testing::TempDir dir;
  const std::string path = (dir.path() / "ft.bin").string();
  constexpr size_t kRows = 12, kRow = 5;
  std::vector<int32_t> tokens(kRows * kRow);
  std::iota(tokens.begin(), tokens.end(), 0);
  STRATA_ASSERT_OK(write_fine_tuning_file(path, tokens, valid_flags(tokens.size(), kRow), {.format = TokenFileFormat::kLlama3, .row_length = kRow}));
  STRATA_ASSERT_OK_AND_ASSIGN(auto dataset, TokenDataset::open_token_file(path, {.eval_fraction = 0.25}));
  EXPECT_EQ(*dataset->split_tokens(DataSplit::kTrain), 9 * kRow);
  EXPECT_EQ(*dataset->split_tokens(DataSplit::kEval), 3 * kRow);
  const DataLoaderOptions options{.global_batch = 4, .seq_len = kRow - 1, .seed = 1};
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader whole, DataLoader::create(dataset, options));
  // Batch b holds train rows 4b .. 4b+3 (mod the 9 train rows).
  for (uint64_t b = 0; b < 4; ++b) {
    const FullBatch batch = load_full(whole, b);
    for (size_t r = 0; r < 4; ++r) EXPECT_EQ(batch.inputs[r * (kRow - 1)], static_cast<int32_t>(((4 * b + r) % 9) * kRow)) << b << " " << r;
  }
  for (int world : {2, 4}) {
    for (uint64_t b : {0u, 3u}) {
      FullBatch joined;
      for (int rank = 0; rank < world; ++rank) {
        DataLoaderOptions rank_options = options;
        rank_options.rank = rank;
        rank_options.world_size = world;
        STRATA_ASSERT_OK_AND_ASSIGN(DataLoader loader, DataLoader::create(dataset, rank_options));
        const FullBatch part = load_full(loader, b);
        joined.inputs.insert(joined.inputs.end(), part.inputs.begin(), part.inputs.end());
        joined.targets.insert(joined.targets.end(), part.targets.begin(), part.targets.end());
        joined.positions.insert(joined.positions.end(), part.positions.begin(), part.positions.end());
      }
      const FullBatch expected = load_full(whole, b);
      EXPECT_EQ(joined.inputs, expected.inputs) << world;
      EXPECT_EQ(joined.targets, expected.targets) << world;
      EXPECT_EQ(joined.positions, expected.positions) << world;
    }
  }
  // The eval split is the last 3 rows.
  DataLoaderOptions eval_options = options;
  eval_options.global_batch = 3;
  eval_options.split = DataSplit::kEval;
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader eval, DataLoader::create(dataset, eval_options));
  const FullBatch eval_batch = load_full(eval, 0);
  for (size_t r = 0; r < 3; ++r) EXPECT_EQ(eval_batch.inputs[r * (kRow - 1)], static_cast<int32_t>((9 + r) * kRow));
  // Resuming by position continues with the same rows.
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader first, DataLoader::create(dataset, options));
  FullBatch step{std::vector<int32_t>(16), std::vector<int32_t>(16), std::vector<int32_t>(16)};
  STRATA_ASSERT_OK(first.next(step.inputs, step.targets, step.positions));
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader resumed, DataLoader::create(dataset, options));
  STRATA_ASSERT_OK(resumed.restore_json(first.state_json()));
  STRATA_ASSERT_OK(resumed.next(step.inputs, step.targets, step.positions));
  EXPECT_EQ(step.inputs, load_full(whole, 1).inputs);
  // A seq_len other than the rows' is refused, naming both.
  DataLoaderOptions wrong = options;
  wrong.seq_len = 8;
  const auto refused = DataLoader::create(dataset, wrong);
  EXPECT_TRUE(contains(refused.status().message(), "seq_len 8 needs rows of 9 tokens (seq_len + 1), but the rows of fine-tuning file "))
      << refused.status().to_string();
  EXPECT_TRUE(contains(refused.status().message(), " are 5; set seq_len to 4 or prepare the data again with --seq-len 8"))
      << refused.status().to_string();
}

// Plain llm.c files keep their meaning: every next token a target, positions 0..T-1 per window.
TEST(FineTuningLoaderTest, PlainLlmcFilesTargetEveryTokenWithPositionsFromZero) {
  testing::TempDir dir;
  const std::string path = (dir.path() / "plain.bin").string();
  std::vector<int32_t> tokens(500);
  std::iota(tokens.begin(), tokens.end(), 0);
  STRATA_ASSERT_OK(write_token_file(path, tokens));
  STRATA_ASSERT_OK_AND_ASSIGN(auto dataset, TokenDataset::open_token_file(path, {}));
  EXPECT_FALSE(dataset->row_length().has_value());
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader loader, DataLoader::create(dataset, {.global_batch = 3, .seq_len = 10, .seed = 8}));
  for (uint64_t b : {0u, 1u, 17u}) {
    const FullBatch batch = load_full(loader, b);
    const Batch old = load(loader, b);
    EXPECT_EQ(batch.inputs, old.inputs);
    EXPECT_EQ(batch.targets, old.targets);
    for (size_t i = 0; i < batch.inputs.size(); ++i) {
      EXPECT_EQ(batch.targets[i], batch.inputs[i] + 1);  // tokens are their own positions in the file
      EXPECT_EQ(batch.positions[i], static_cast<int32_t>(i % 10));
    }
  }
}

// A fine-tuning stream (row length 0): windows at random, as llm.c files, with the flags'
// targets and positions, and the window's first token starting a document wherever it falls.
TEST(FineTuningLoaderTest, AStreamFileGivesWindowsWithItsMaskAndPositions) {
  testing::TempDir dir;
  const std::string path = (dir.path() / "stream.bin").string();
  std::vector<int32_t> tokens(300);
  std::iota(tokens.begin(), tokens.end(), 0);
  const std::vector<uint8_t> flags = valid_flags(tokens.size(), 0);
  STRATA_ASSERT_OK(write_fine_tuning_file(path, tokens, flags, {}));
  STRATA_ASSERT_OK_AND_ASSIGN(auto dataset, TokenDataset::open_token_file(path, {}));
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader loader, DataLoader::create(dataset, {.global_batch = 4, .seq_len = 20, .seed = 2}));
  std::set<int32_t> starts;
  for (uint64_t b = 0; b < 5; ++b) {
    const FullBatch batch = load_full(loader, b);
    for (size_t r = 0; r < 4; ++r) {
      const size_t start = static_cast<size_t>(batch.inputs[r * 20]);
      starts.insert(static_cast<int32_t>(start));
      int32_t position = 0;
      for (size_t t = 0; t < 20; ++t) {
        const size_t i = r * 20 + t;
        ASSERT_EQ(batch.inputs[i], static_cast<int32_t>(start + t));
        EXPECT_EQ(batch.targets[i], (flags[start + t + 1] & kT) ? static_cast<int32_t>(start + t + 1) : -1) << start << "+" << t;
        position = (t == 0 || (flags[start + t] & kD)) ? 0 : position + 1;
        EXPECT_EQ(batch.positions[i], position) << start << "+" << t;
      }
    }
  }
  EXPECT_GT(starts.size(), 10u);
}

}  // namespace
}  // namespace strata::data
