// The synthetic language: an order-1 or order-2 chain over the vocabulary with a known
// entropy floor (TokenDataset::synthetic).
#include "examples/data/token_data.h"

#include <cmath>
#include <sstream>

#include "examples/data/sample_random.h"

namespace strata::data {

namespace {

using internal::kTagSynthetic;
using internal::random_permutation;
using internal::SampleRandom;
using internal::SplitMix64;

std::string format_nats(double value) {
  std::ostringstream out;
  out.precision(5);
  out << value;
  return out.str();
}

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

}  // namespace

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

std::vector<int32_t> synthetic_successors(const SyntheticLanguageOptions& options, int32_t previous, int32_t last) {
  const SyntheticDataset language(options);
  std::vector<int32_t> successors;
  for (int64_t j = 0; j < options.successors; ++j) successors.push_back(language.successor(previous, last, static_cast<uint64_t>(j)));
  return successors;
}

}  // namespace strata::data
