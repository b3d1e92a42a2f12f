// The CUDA attention kernels (kernels/flash_attention_kernels.cuh) run on the host, so
// that their tiling, masking, online softmax, GQA grouping and strided writes are
// checked where no GPU is (the CI machine). Every thread of a block is a host thread;
// __syncthreads and __syncwarp are barriers; a shuffle goes through a per-warp exchange
// array between two warp barriers. Shared memory is filled with NaN before each block,
// so a read of a tile element nobody wrote shows up in the result. fp32 only (the bf16
// path differs only in load/store); compared with the double-precision reference
// (kernels/reference.h) at the fp32 tolerance of rmsnorm_rope_swiglu_gqa_test.cpp, 2e-5.
//
// What this cannot see: races between warps that the host threads happen to order, the
// GPU's memory model, launch limits and shared-memory sizes (the gpu-labelled tests and
// the compute-sanitizer racecheck pass do). Slow (a thread per simulated CUDA thread):
// three small cases that still cross tile boundaries and use each head-dim bucket.
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/gqa_attention.h"
#include "kernels/reference.h"
#include "tests/kernels/op_test_harness.h"

// The CUDA built-ins and keywords the kernels use, on the host ----------------------------

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct float4 {
  float x, y, z, w;
};
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(threads)
#define __shared__

namespace strata::kernels::cuda {
namespace {

constexpr int kSimulatedThreads = 128;  // kAttentionThreads
constexpr int kSimulatedWarps = kSimulatedThreads / 32;

thread_local dim3 threadIdx;
dim3 blockIdx;  // one block runs at a time
dim3 gridDim;
std::barrier<>* block_barrier = nullptr;
std::barrier<>* warp_barriers[kSimulatedWarps] = {};
float shuffle_exchange[kSimulatedWarps][32];

void __syncthreads() { block_barrier->arrive_and_wait(); }
void __syncwarp() { warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }
float shuffle_xor(float value, int offset) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  shuffle_exchange[warp][lane] = value;
  __syncwarp();
  const float other = shuffle_exchange[warp][lane ^ offset];
  __syncwarp();
  return other;
}
float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += shuffle_xor(v, offset);
  return v;
}
float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = std::fmax(v, shuffle_xor(v, offset));
  return v;
}
float load(const float* p, size_t i) { return p[i]; }
void store(float* p, size_t i, float v) { p[i] = v; }
void store_grad(float* p, size_t i, float v, bool accumulate) { p[i] = accumulate ? p[i] + v : v; }

}  // namespace
}  // namespace strata::kernels::cuda

#include "kernels/flash_attention_kernels.cuh"  // built with -Wno-unknown-pragmas: #pragma unroll

namespace strata::kernels::cuda::flash {
alignas(16) float4 shared_words[size_t{80} << 10 >> 4];  // the kernels' dynamic shared memory (80 KiB)
}  // namespace strata::kernels::cuda::flash

namespace strata {
namespace {

namespace flash = kernels::cuda::flash;
namespace sim = kernels::cuda;
using kernels::GqaAttentionShape;
using test_ops::relative_error;

using Params = flash::AttentionParams<float>;

// Runs `kernel` over `grid`, one block after the other, each block's threads at once.
void launch(void (*kernel)(Params), const Params& params, dim3 grid) {
  sim::gridDim = grid;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        sim::blockIdx = {x, y, z};
        std::memset(flash::shared_words, 0xFF, sizeof(flash::shared_words));  // NaN: unwritten reads show
        std::barrier<> block(sim::kSimulatedThreads);
        std::vector<std::unique_ptr<std::barrier<>>> warps;
        for (int w = 0; w < sim::kSimulatedWarps; ++w) {
          warps.push_back(std::make_unique<std::barrier<>>(32));
          sim::warp_barriers[w] = warps.back().get();
        }
        sim::block_barrier = &block;
        std::vector<std::jthread> threads;
        for (unsigned t = 0; t < sim::kSimulatedThreads; ++t) {
          threads.emplace_back([&params, kernel, t] {
            sim::threadIdx = {t, 0, 0};
            kernel(params);
          });
        }
      }
    }
  }
}

template <int kDim>
void run_attention(const Params& params, size_t batch, size_t heads, size_t kv_heads) {
  const unsigned tiles = static_cast<unsigned>((params.seq_len + flash::kTile - 1) / flash::kTile);
  launch(&flash::flash_forward_kernel<float, kDim>, params, {tiles, unsigned(heads), unsigned(batch)});
  launch(&flash::flash_backward_dq_kernel<float, kDim>, params, {tiles, unsigned(heads), unsigned(batch)});
  launch(&flash::flash_backward_dkv_kernel<float, kDim>, params, {tiles, unsigned(kv_heads), unsigned(batch)});
}

struct SimCase {
  size_t batch, seq_len, heads, kv_heads, head_dim;
  bool fused;       // q | k | v rows of one buffer, gradients likewise
  bool accumulate;  // GradWrite::kAccumulate onto 1.0
};

std::vector<float> as_float(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }
std::vector<double> as_double(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

void expect_kernels_match_reference(const SimCase& c) {
  const std::string what = "batch " + std::to_string(c.batch) + " T " + std::to_string(c.seq_len) + " heads " +
                           std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " head_dim " +
                           std::to_string(c.head_dim) + (c.fused ? " fused" : "") + (c.accumulate ? " accumulate" : "");
  std::mt19937 rng(static_cast<unsigned>(c.seq_len * 31 + c.head_dim));
  const size_t q_width = c.heads * c.head_dim;
  const size_t kv_width = c.kv_heads * c.head_dim;
  const size_t row = c.fused ? q_width + 2 * kv_width : 0;
  const size_t rows = c.batch * c.seq_len;
  const GqaAttentionShape shape{.batch = c.batch, .seq_len = c.seq_len, .heads = c.heads, .kv_heads = c.kv_heads,
                                .head_dim = c.head_dim, .q_stride = row, .k_stride = row, .v_stride = row};
  const size_t q_stride = c.fused ? row : q_width;
  const size_t kv_stride = c.fused ? row : kv_width;
  // Values exactly representable in fp32, so both sides see the same inputs.
  const auto q = test_ops::rounded(test_ops::random_vector(rows * q_stride, rng), DType::kFloat32);
  const auto k = test_ops::rounded(test_ops::random_vector(c.fused ? 0 : rows * kv_width, rng), DType::kFloat32);
  const auto v = test_ops::rounded(test_ops::random_vector(c.fused ? 0 : rows * kv_width, rng), DType::kFloat32);
  const auto dout = test_ops::rounded(test_ops::random_vector(rows * q_width, rng), DType::kFloat32);
  const double* k_ref = c.fused ? q.data() + q_width : k.data();
  const double* v_ref = c.fused ? q.data() + q_width + kv_width : v.data();
  std::vector<double> want_out(rows * q_width), want_lse(c.batch * c.heads * c.seq_len);
  kernels::reference::gqa_attention_forward(shape, q.data(), k_ref, v_ref, want_out.data(), want_lse.data());
  std::vector<double> want_dq(rows * q_stride, 0.0), want_dk(k.size(), 0.0), want_dv(v.size(), 0.0);
  double* dk_ref = c.fused ? want_dq.data() + q_width : want_dk.data();
  double* dv_ref = c.fused ? want_dq.data() + q_width + kv_width : want_dv.data();
  kernels::reference::gqa_attention_backward(shape, dout.data(), q.data(), k_ref, v_ref, want_dq.data(), dk_ref, dv_ref);

  const auto q_in = as_float(q), k_in = as_float(k), v_in = as_float(v), dout_in = as_float(dout);
  const float start = c.accumulate ? 1.0f : NAN;
  std::vector<float> out(rows * q_width, NAN), lse(want_lse.size(), NAN), delta(want_lse.size(), NAN);
  std::vector<float> dq(want_dq.size(), start), dk(want_dk.size(), start), dv(want_dv.size(), start);
  Params params{};
  params.q = q_in.data();
  params.k = c.fused ? q_in.data() + q_width : k_in.data();
  params.v = c.fused ? q_in.data() + q_width + kv_width : v_in.data();
  params.dout = dout_in.data();
  params.out = out.data();
  params.dq = dq.data();
  params.dk = c.fused ? dq.data() + q_width : dk.data();
  params.dv = c.fused ? dq.data() + q_width + kv_width : dv.data();
  params.lse = lse.data();
  params.delta = delta.data();
  params.seq_len = c.seq_len;
  params.heads = c.heads;
  params.group = c.heads / c.kv_heads;
  params.head_dim = c.head_dim;
  params.q_stride = q_stride;
  params.k_stride = kv_stride;
  params.v_stride = kv_stride;
  params.scale = 1.0f / std::sqrt(float(c.head_dim));
  params.accumulate = c.accumulate;
  if (c.head_dim <= 32) {
    run_attention<32>(params, c.batch, c.heads, c.kv_heads);
  } else if (c.head_dim <= 64) {
    run_attention<64>(params, c.batch, c.heads, c.kv_heads);
  } else {
    run_attention<128>(params, c.batch, c.heads, c.kv_heads);
  }

  auto started = [&](const std::vector<double>& want) {
    if (!c.accumulate) return want;
    std::vector<double> plus_one(want);
    for (double& x : plus_one) x += 1.0;
    return plus_one;
  };
  constexpr double kTolerance = 2e-5;
  EXPECT_LE(relative_error(as_double(out), want_out), kTolerance) << "out, " << what;
  EXPECT_LE(relative_error(as_double(lse), want_lse), kTolerance) << "lse, " << what;
  EXPECT_LE(relative_error(as_double(dq), started(want_dq)), kTolerance) << "dq (all of qkv when fused), " << what;
  if (!c.fused) {
    EXPECT_LE(relative_error(as_double(dk), started(want_dk)), kTolerance) << "dk, " << what;
    EXPECT_LE(relative_error(as_double(dv), started(want_dv)), kTolerance) << "dv, " << what;
  }
}

TEST(FlashAttentionSimulationTest, GroupedHeadsAcrossTwoTilesMatchTheReference) {
  // T 40: a full tile and a partial one; head_dim 10 in the 32 bucket; 4 query heads on 2 KV heads.
  expect_kernels_match_reference({.batch = 1, .seq_len = 40, .heads = 4, .kv_heads = 2, .head_dim = 10,
                                  .fused = false, .accumulate = true});
}

TEST(FlashAttentionSimulationTest, FusedQkvRowsAtHeadDim64MatchTheReference) {
  // GPT-2's layout (q | k | v in one row, kv_heads == heads), two batch elements.
  expect_kernels_match_reference({.batch = 2, .seq_len = 33, .heads = 2, .kv_heads = 2, .head_dim = 64,
                                  .fused = true, .accumulate = false});
}

TEST(FlashAttentionSimulationTest, MultiQueryAtHeadDim128MatchesTheReference) {
  expect_kernels_match_reference({.batch = 1, .seq_len = 9, .heads = 2, .kv_heads = 1, .head_dim = 100,
                                  .fused = false, .accumulate = false});
}

}  // namespace
}  // namespace strata
