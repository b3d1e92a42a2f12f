// Token data: llm.c token files (round trip, header errors), text as bytes, the synthetic
// language's statistics against its stated floor, and the data loader's determinism,
// rank slicing and resumable position.
#include "examples/gpt/token_data.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "engine/core/check.h"
#include "tests/support/test_support.h"

namespace strata::gpt {
namespace {

namespace fs = std::filesystem;

bool contains(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

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

}  // namespace
}  // namespace strata::gpt
