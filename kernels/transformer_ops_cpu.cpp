// Before every include: GCC does not inline functions compiled under other optimization
// options, so std::bit_cast / std::max from the headers must share this one.
#pragma GCC optimize("no-trapping-math")

#include "kernels/transformer_ops_cpu.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cpu_elements.h"

#if __has_include(<cblas.h>)
#include <cblas.h>
#include <dlfcn.h>
#include <sys/auxv.h>
#include <unistd.h>
#define STRATA_KERNELS_HAVE_CBLAS 1
#endif

namespace strata::kernels::cpu {
namespace {

using namespace elements;  // NOLINT: the shared element functions of kernels/cpu_elements.h

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

// GPT-2's 0.5 x (1 + tanh(u)) written as x * sigmoid(2u), the same function, which
// needs one exp and no tanh and does not cancel for u < 0.
[[gnu::always_inline]] inline float gelu(float x) {
  const float u = kGeluScale * (x + kGeluCubic * x * x * x);
  return x / (1.0f + exp_approx(-2.0f * u));
}

// d/dx [x s(2u)] = s + 2 x s (1 - s) du/dx, s = sigmoid(2u) = (1 + tanh(u)) / 2.
[[gnu::always_inline]] inline float gelu_grad(float x) {
  const float u = kGeluScale * (x + kGeluCubic * x * x * x);
  const float s = 1.0f / (1.0f + exp_approx(-2.0f * u));
  const float du_dx = kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
  return s + 2.0f * x * s * (1.0f - s) * du_dx;
}

// One row-major GEMM on the calling thread: C[M,N] = alpha * op(A)[M,K] op(B)[K,N] +
// beta * C; lda/ldb/ldc are the stored row lengths. beta == 0 ignores C's old contents
// (it may hold NaN).
void gemm_tile(bool trans_a, bool trans_b, size_t m, size_t n, size_t k, float alpha, const float* a, size_t lda,
               const float* b, size_t ldb, float beta, float* c, size_t ldc) {
#if defined(STRATA_KERNELS_HAVE_CBLAS)
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta, c,
              static_cast<int>(ldc));
#else
  // Plain loops for builds without a BLAS.
  std::vector<float> row(n);
  for (size_t i = 0; i < m; ++i) {
    std::fill(row.begin(), row.end(), 0.0f);
    for (size_t p = 0; p < k; ++p) {
      const float a_ip = trans_a ? a[p * lda + i] : a[i * lda + p];
      if (trans_b) {
        for (size_t j = 0; j < n; ++j) row[j] += a_ip * b[j * ldb + p];
      } else {
        axpy(a_ip, b + p * ldb, row.data(), n);
      }
    }
    float* c_row = c + i * ldc;
    for (size_t j = 0; j < n; ++j) c_row[j] = alpha * row[j] + (beta == 0.0f ? 0.0f : beta * c_row[j]);
  }
#endif
}

// Rows (or columns) of C per tile. Tiles are fixed by the shape, never by the thread
// count, so results do not depend on how many threads the executor has.
constexpr size_t kGemmTile = 64;

// Row-major GEMM as above, split into tiles of kGemmTile rows of C (or columns, when C
// has more columns than rows) run in parallel on the executor, one single-threaded BLAS
// call each.
void gemm(Executor& executor, bool trans_a, bool trans_b, size_t m, size_t n, size_t k, float alpha, const float* a,
          size_t lda, const float* b, size_t ldb, float beta, float* c, size_t ldc) {
  keep_blas_single_threaded();
  if (m >= n) {
    const size_t tiles = (m + kGemmTile - 1) / kGemmTile;
    executor.parallel_for(0, tiles, 1, [&](size_t lo, size_t hi) {
      for (size_t tile = lo; tile < hi; ++tile) {
        const size_t i0 = tile * kGemmTile;
        const size_t rows = std::min(kGemmTile, m - i0);
        // Rows i0.. of op(A): rows of A, or columns of the stored A^T.
        const float* a_tile = trans_a ? a + i0 : a + i0 * lda;
        gemm_tile(trans_a, trans_b, rows, n, k, alpha, a_tile, lda, b, ldb, beta, c + i0 * ldc, ldc);
      }
    });
  } else {
    const size_t tiles = (n + kGemmTile - 1) / kGemmTile;
    executor.parallel_for(0, tiles, 1, [&](size_t lo, size_t hi) {
      for (size_t tile = lo; tile < hi; ++tile) {
        const size_t j0 = tile * kGemmTile;
        const size_t columns = std::min(kGemmTile, n - j0);
        // Columns j0.. of op(B): columns of B, or rows of the stored B^T.
        const float* b_tile = trans_b ? b + j0 * ldb : b + j0;
        gemm_tile(trans_a, trans_b, m, columns, k, alpha, a, lda, b_tile, ldb, beta, c + j0, ldc);
      }
    });
  }
}

}  // namespace

bool has_blas() {
#if defined(STRATA_KERNELS_HAVE_CBLAS)
  return true;
#else
  return false;
#endif
}

// OpenBLAS's pool threads, started when the library loads, stay alive after
// openblas_set_num_threads(1), and with Debian's 0.3.21 on the 2-core dev VMs their idle
// loop never went to sleep: ~270k sched_yield calls a second for as long as the process
// ran (docs/benchmarks.md). So the pool is stopped too. Its shutdown entry point is OpenBLAS's own (it
// runs it at fork); it is looked up at run time because other BLAS builds lack it, and
// a serial OpenBLAS has no pool. With one thread set, OpenBLAS starts no new pool.
void keep_blas_single_threaded() {
#if defined(OPENBLAS_VERSION)
  static const bool once = [] {
    openblas_set_num_threads(1);
    if (openblas_get_parallel() == OPENBLAS_THREAD) {
      using Shutdown = int (*)();
      if (auto shutdown = reinterpret_cast<Shutdown>(dlsym(RTLD_DEFAULT, "blas_thread_shutdown_"))) shutdown();
    }
    return true;
  }();
  (void)once;
#endif
}

// OpenBLAS's working buffer as x86-64 builds allocate it (BUFFER_SIZE, 128 MiB, plus a
// page of alignment): the largest any OpenBLAS target uses, so a buffer this probe finds
// room for fits.
constexpr size_t kOpenBlasBufferBytes = (size_t{128} << 20) + 4096;
// The most buffers reserved: Debian's OpenBLAS has slots for 128 (twice its 64 threads); a
// caller beyond this many still maps its own on its first product, as without a reservation.
constexpr int kMaxReservedBlasBuffers = 64;

Status reserve_blas_buffers(int callers) {
#if defined(OPENBLAS_VERSION)
  using Alloc = void* (*)(int);
  using Free = void (*)(void*);
  static const auto blas_alloc = reinterpret_cast<Alloc>(dlsym(RTLD_DEFAULT, "blas_memory_alloc"));
  static const auto blas_free = reinterpret_cast<Free>(dlsym(RTLD_DEFAULT, "blas_memory_free"));
  keep_blas_single_threaded();
  if (blas_alloc == nullptr || blas_free == nullptr) return {};
  static std::mutex mutex;
  static int reserved = 0;  // buffers mapped by earlier calls
  std::lock_guard lock(mutex);
  callers = std::min(callers, kMaxReservedBlasBuffers);
  // Every buffer is held until all are mapped, so each takes a slot of its own; freed, the
  // slots keep their buffers for the threads that call OpenBLAS next.
  std::vector<void*> held;
  Status status;
  while (reserved + static_cast<int>(held.size()) < callers) {
    void* probe = std::malloc(kOpenBlasBufferBytes);
    if (probe == nullptr) {
      status = OutOfMemoryError("the system refused " + std::to_string(kOpenBlasBufferBytes) + " bytes (" +
                                std::to_string(kOpenBlasBufferBytes >> 20) + " MiB) for 'OpenBLAS working buffer " +
                                std::to_string(reserved + static_cast<int>(held.size()) + 1) + " of " + std::to_string(callers) +
                                "' (malloc): OpenBLAS retries a refused buffer forever, so the matrix products could not start");
      break;
    }
    std::free(probe);
    void* buffer = blas_alloc(0);
    if (buffer == nullptr) break;  // out of slots: OpenBLAS said so itself
    held.push_back(buffer);
  }
  for (void* buffer : held) blas_free(buffer);
  reserved += static_cast<int>(held.size());
  return status;
#else
  (void)callers;
  keep_blas_single_threaded();
  return {};
#endif
}

Status reexec_with_single_threaded_blas(char** argv) {
  Status status;
#if defined(OPENBLAS_VERSION)
  const char* threads = std::getenv("OPENBLAS_NUM_THREADS");
  const bool pool_started = openblas_get_parallel() == OPENBLAS_THREAD && openblas_get_num_threads() > 1;
  // With no interpreter base the kernel started the dynamic loader itself (`ld.so PROGRAM
  // ...`): /proc/self/exe is then the loader, which would take the flags for its own.
  const bool exe_is_the_program = ::getauxval(AT_BASE) != 0;
  if (pool_started && exe_is_the_program && (threads == nullptr || std::strcmp(threads, "1") != 0)) {
    if (::setenv("OPENBLAS_NUM_THREADS", "1", 1) == 0) ::execv("/proc/self/exe", argv);
    status = UnavailableError(std::string("cannot re-execute /proc/self/exe with OPENBLAS_NUM_THREADS=1 (") +
                              std::strerror(errno) +
                              "); OpenBLAS's thread pool is stopped instead, which waits forever where an "
                              "address-space limit keeps its threads from mapping their buffers");
  }
#else
  (void)argv;
#endif
  keep_blas_single_threaded();
  return status;
}

// Embedding --------------------------------------------------------------------------

Status embedding_forward(Executor& executor, const EmbeddingShape& shape, const int32_t* tokens, const float* wte,
                         const float* wpe, float* out) {
  const size_t positions = shape.batch * shape.seq_len;
  const size_t channels = shape.channels;
  for (size_t i = 0; i < positions; ++i) {
    if (tokens[i] < 0 || static_cast<size_t>(tokens[i]) >= shape.vocab_size) {
      return InvalidArgumentError("embedding_forward: token " + std::to_string(tokens[i]) + " at position " +
                                  std::to_string(i) + " is outside the vocabulary [0, " +
                                  std::to_string(shape.vocab_size) + ")");
    }
  }
  executor.parallel_for(0, positions, row_grain(channels), [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      const float* token_row = wte + static_cast<size_t>(tokens[i]) * channels;
      float* out_row = out + i * channels;
      if (wpe == nullptr) {
        std::memcpy(out_row, token_row, channels * sizeof(float));
        continue;
      }
      const float* position_row = wpe + (i % shape.seq_len) * channels;
      for (size_t c = 0; c < channels; ++c) out_row[c] = token_row[c] + position_row[c];
    }
  });
  return {};
}

Status embedding_backward(Executor& executor, const EmbeddingShape& shape, const int32_t* tokens, const float* dout,
                          float* dwte, float* dwpe, GradWrite param_grad) {
  const size_t positions = shape.batch * shape.seq_len;
  const size_t channels = shape.channels;
  if (dwte != nullptr) {
    for (size_t i = 0; i < positions; ++i) {
      if (tokens[i] < 0 || static_cast<size_t>(tokens[i]) >= shape.vocab_size) {
        return InvalidArgumentError("embedding_backward: token " + std::to_string(tokens[i]) + " at position " +
                                    std::to_string(i) + " is outside the vocabulary [0, " +
                                    std::to_string(shape.vocab_size) + ")");
      }
    }
    if (param_grad == GradWrite::kOverwrite) {
      executor.parallel_for(0, shape.vocab_size, row_grain(channels), [&](size_t lo, size_t hi) {
        std::memset(dwte + lo * channels, 0, (hi - lo) * channels * sizeof(float));
      });
    }
    // Split by columns; each column adds the positions in order (deterministic, and
    // the same order as the CUDA kernel).
    executor.parallel_for(0, channels, kColumnsPerChunk, [&](size_t lo, size_t hi) {
      for (size_t i = 0; i < positions; ++i) {
        float* grad_row = dwte + static_cast<size_t>(tokens[i]) * channels;
        const float* d_row = dout + i * channels;
        for (size_t c = lo; c < hi; ++c) grad_row[c] += d_row[c];
      }
    });
  }
  if (dwpe != nullptr) {
    executor.parallel_for(0, shape.seq_len, row_grain(channels * shape.batch), [&](size_t lo, size_t hi) {
      std::vector<float> acc(channels);
      for (size_t t = lo; t < hi; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (size_t b = 0; b < shape.batch; ++b) {
          const float* d_row = dout + (b * shape.seq_len + t) * channels;
          for (size_t c = 0; c < channels; ++c) acc[c] += d_row[c];
        }
        for (size_t c = 0; c < channels; ++c) write_grad(&dwpe[t * channels + c], acc[c], param_grad);
      }
    });
  }
  return {};
}

// LayerNorm --------------------------------------------------------------------------

void layernorm_forward(Executor& executor, const LayerNormShape& shape, const float* x, const float* gamma,
                       const float* beta, float* y, float* mean, float* rstd) {
  const size_t channels = shape.channels;
  const float inverse_channels = 1.0f / static_cast<float>(channels);
  executor.parallel_for(0, shape.rows, row_grain(channels), [&](size_t lo, size_t hi) {
    for (size_t r = lo; r < hi; ++r) {
      const float* x_row = x + r * channels;
      float sum = 0.0f;
      for (size_t c = 0; c < channels; ++c) sum += x_row[c];
      const float mu = sum * inverse_channels;
      float squares = 0.0f;
      for (size_t c = 0; c < channels; ++c) {
        const float centered = x_row[c] - mu;
        squares += centered * centered;
      }
      const float inv_std = 1.0f / std::sqrt(squares * inverse_channels + shape.epsilon);
      float* y_row = y + r * channels;
      for (size_t c = 0; c < channels; ++c) y_row[c] = (x_row[c] - mu) * inv_std * gamma[c] + beta[c];
      if (mean != nullptr) mean[r] = mu;
      if (rstd != nullptr) rstd[r] = inv_std;
    }
  });
}

void layernorm_backward(Executor& executor, const LayerNormShape& shape, const float* dy, const float* x,
                        const float* gamma, const float* mean, const float* rstd, float* dx, float* dgamma, float* dbeta,
                        const GradOptions& options) {
  const size_t channels = shape.channels;
  const float inverse_channels = 1.0f / static_cast<float>(channels);
  if (dx != nullptr) {
    executor.parallel_for(0, shape.rows, row_grain(channels), [&](size_t lo, size_t hi) {
      for (size_t r = lo; r < hi; ++r) {
        const float* x_row = x + r * channels;
        const float* dy_row = dy + r * channels;
        const float mu = mean[r];
        const float inv_std = rstd[r];
        float sum_dxhat = 0.0f;
        float sum_dxhat_xhat = 0.0f;
        for (size_t c = 0; c < channels; ++c) {
          const float dxhat = dy_row[c] * gamma[c];
          sum_dxhat += dxhat;
          sum_dxhat_xhat += dxhat * (x_row[c] - mu) * inv_std;
        }
        const float mean_dxhat = sum_dxhat * inverse_channels;
        const float mean_dxhat_xhat = sum_dxhat_xhat * inverse_channels;
        float* dx_row = dx + r * channels;
        for (size_t c = 0; c < channels; ++c) {
          const float xhat = (x_row[c] - mu) * inv_std;
          const float dxhat = dy_row[c] * gamma[c];
          write_grad(&dx_row[c], inv_std * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat), options.input_grad);
        }
      }
    });
  }
  if (dgamma != nullptr) {
    column_sums(executor, shape.rows, channels, dgamma, options.param_grad, [&](size_t r, size_t c0, size_t c1, float* acc) {
      const float* x_row = x + r * channels;
      const float* dy_row = dy + r * channels;
      const float mu = mean[r];
      const float inv_std = rstd[r];
      for (size_t c = c0; c < c1; ++c) acc[c - c0] += dy_row[c] * ((x_row[c] - mu) * inv_std);
    });
  }
  if (dbeta != nullptr) {
    column_sums(executor, shape.rows, channels, dbeta, options.param_grad, [&](size_t r, size_t c0, size_t c1, float* acc) {
      const float* dy_row = dy + r * channels;
      for (size_t c = c0; c < c1; ++c) acc[c - c0] += dy_row[c];
    });
  }
}

// Matrix products --------------------------------------------------------------------

void matmul_forward(Executor& executor, const MatmulShape& shape, const float* x, const float* weight, const float* bias,
                    float* y) {
  const size_t m = shape.rows;
  const size_t k = shape.in_features;
  const size_t n = shape.out_features;
  float beta = 0.0f;
  if (bias != nullptr) {
    // Broadcast the bias into y and let the GEMM add onto it.
    executor.parallel_for(0, m, row_grain(n), [&](size_t lo, size_t hi) {
      for (size_t r = lo; r < hi; ++r) std::memcpy(y + r * n, bias, n * sizeof(float));
    });
    beta = 1.0f;
  }
  const bool out_in = shape.layout == WeightLayout::kOutIn;
  gemm(executor, false, out_in, m, n, k, 1.0f, x, k, weight, out_in ? k : n, beta, y, n);
}

void matmul_backward(Executor& executor, const MatmulShape& shape, const float* dy, const float* x, const float* weight,
                     float* dx, float* dweight, float* dbias, const GradOptions& options) {
  const size_t m = shape.rows;
  const size_t k = shape.in_features;
  const size_t n = shape.out_features;
  const bool out_in = shape.layout == WeightLayout::kOutIn;
  if (dx != nullptr) {
    // dx[m,k] = dy[m,n] . W'^T: W' = W (stored [k,n]) for in_out, W^T (stored [n,k]) for out_in.
    const float beta = options.input_grad == GradWrite::kAccumulate ? 1.0f : 0.0f;
    gemm(executor, false, !out_in, m, k, n, 1.0f, dy, n, weight, out_in ? k : n, beta, dx, k);
  }
  if (dweight != nullptr) {
    const float beta = options.param_grad == GradWrite::kAccumulate ? 1.0f : 0.0f;
    if (out_in) {
      gemm(executor, true, false, n, k, m, 1.0f, dy, n, x, k, beta, dweight, k);  // dW[n,k] = dy^T x
    } else {
      gemm(executor, true, false, k, n, m, 1.0f, x, k, dy, n, beta, dweight, n);  // dW[k,n] = x^T dy
    }
  }
  if (dbias != nullptr) bias_backward(executor, m, n, dy, dbias, options.param_grad);
}

void bias_backward(Executor& executor, size_t rows, size_t columns, const float* dy, float* dbias, GradWrite param_grad) {
  column_sums(executor, rows, columns, dbias, param_grad, [&](size_t r, size_t c0, size_t c1, float* acc) {
    const float* dy_row = dy + r * columns;
    for (size_t c = c0; c < c1; ++c) acc[c - c0] += dy_row[c];
  });
}

// GELU and residual ------------------------------------------------------------------

namespace {

STRATA_SIMD_SPAN void gelu_forward_span(const float* x, float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] = gelu(x[i]);
}

STRATA_SIMD_SPAN void gelu_backward_span(const float* dy, const float* x, float* dx, size_t n, GradWrite mode) {
  if (mode == GradWrite::kAccumulate) {
    for (size_t i = 0; i < n; ++i) dx[i] += gelu_grad(x[i]) * dy[i];
  } else {
    for (size_t i = 0; i < n; ++i) dx[i] = gelu_grad(x[i]) * dy[i];
  }
}

}  // namespace

void gelu_forward(Executor& executor, const float* x, float* y, size_t count) {
  executor.parallel_for(0, count, kElementsPerChunk, [&](size_t lo, size_t hi) { gelu_forward_span(x + lo, y + lo, hi - lo); });
}

void gelu_backward(Executor& executor, const float* dy, const float* x, float* dx, size_t count, GradWrite input_grad) {
  executor.parallel_for(0, count, kElementsPerChunk, [&](size_t lo, size_t hi) {
    gelu_backward_span(dy + lo, x + lo, dx + lo, hi - lo, input_grad);
  });
}

void residual_forward(Executor& executor, const float* a, const float* b, float* out, size_t count) {
  executor.parallel_for(0, count, kElementsPerChunk, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) out[i] = a[i] + b[i];
  });
}

void residual_backward(Executor& executor, const float* dout, float* da, float* db, size_t count, GradWrite input_grad) {
  executor.parallel_for(0, count, kElementsPerChunk, [&](size_t lo, size_t hi) {
    for (float* grad : {da, db}) {
      if (grad == nullptr) continue;
      if (input_grad == GradWrite::kAccumulate) {
        for (size_t i = lo; i < hi; ++i) grad[i] += dout[i];
      } else {
        std::memcpy(grad + lo, dout + lo, (hi - lo) * sizeof(float));
      }
    }
  });
}

// Attention --------------------------------------------------------------------------
//
// One implementation for GPT-2's fused-qkv attention and grouped-query attention: the
// same algorithm as the CUDA path, one (batch, head) at a time: single-threaded BLAS
// GEMMs on the head's [T, head_dim] slices of q, k, v (strided rows, so no permute)
// and vectorized softmax rows over a T x T scratch. The GEMMs compute the whole square;
// the causal softmax zeroes the upper triangle of P, so it adds nothing. The forward's
// task is one (b, h); the backward's one (b, kv head), which runs the query heads that
// share the KV head in head order, the first writing dk/dv per GradWrite and the others
// adding, so each task is the only writer of its slices and results do not depend on
// threads. With kv_heads == heads this is exactly the per-(b, h) multi-head computation.

namespace {

struct AttentionGeometry {
  size_t seq;          // T
  size_t heads;        // H
  size_t group;        // query heads per KV head, H / kv_heads
  size_t head_dim;     // hd
  size_t q_stride;     // elements between rows of q (and dq)
  size_t k_stride;     // ... of k (and dk)
  size_t v_stride;     // ... of v (and dv)
  size_t out_stride;   // H * hd, the row length of out (and dout)
  float scale;         // 1 / sqrt(hd)

  explicit AttentionGeometry(const GqaAttentionShape& shape)
      : seq(shape.seq_len),
        heads(shape.heads),
        group(shape.heads / shape.kv_heads),
        head_dim(shape.head_dim),
        q_stride(shape.q_stride != 0 ? shape.q_stride : shape.heads * shape.head_dim),
        k_stride(shape.k_stride != 0 ? shape.k_stride : shape.kv_heads * shape.head_dim),
        v_stride(shape.v_stride != 0 ? shape.v_stride : shape.kv_heads * shape.head_dim),
        out_stride(shape.heads * shape.head_dim),
        scale(1.0f / std::sqrt(static_cast<float>(shape.head_dim))) {}

  // Offsets of the first row of batch element b for query head h (q, out) and KV head g.
  size_t q_offset(size_t b, size_t h) const { return b * seq * q_stride + h * head_dim; }
  size_t k_offset(size_t b, size_t g) const { return b * seq * k_stride + g * head_dim; }
  size_t v_offset(size_t b, size_t g) const { return b * seq * v_stride + g * head_dim; }
  size_t out_offset(size_t b, size_t h) const { return b * seq * out_stride + h * head_dim; }
};

// Rows of a [T, T] score matrix in place: P[t, j] = exp(S[t, j] - lse_t) for j <= t, 0
// above. With `lse_in` the logsumexp is given (backward); otherwise it is computed and
// written to lse_out.
STRATA_SIMD_SPAN void causal_softmax_rows(float* scores, size_t seq, const float* lse_in, float* lse_out) {
  for (size_t t = 0; t < seq; ++t) {
    float* row = scores + t * seq;
    float row_lse;
    if (lse_in != nullptr) {
      row_lse = lse_in[t];
    } else {
      float max_score = row[0];
      for (size_t j = 1; j <= t; ++j) max_score = std::max(max_score, row[j]);
      float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (size_t j = 0; j <= t; ++j) partial[j % 8] += exp_approx(row[j] - max_score);
      const float sum = ((partial[0] + partial[1]) + (partial[2] + partial[3])) + ((partial[4] + partial[5]) + (partial[6] + partial[7]));
      row_lse = max_score + std::log(sum);
      lse_out[t] = row_lse;
    }
    for (size_t j = 0; j <= t; ++j) row[j] = exp_approx(row[j] - row_lse);
    std::fill(row + t + 1, row + seq, 0.0f);
  }
}

// dS = P o (dP - D) with D_t = sum_j P[t, j] dP[t, j], written over dP.
STRATA_SIMD_SPAN void softmax_backward_rows(const float* probs, float* dprobs, size_t seq) {
  for (size_t t = 0; t < seq; ++t) {
    const float* p = probs + t * seq;
    float* dp = dprobs + t * seq;
    float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (size_t j = 0; j <= t; ++j) partial[j % 8] += p[j] * dp[j];
    const float d = ((partial[0] + partial[1]) + (partial[2] + partial[3])) + ((partial[4] + partial[5]) + (partial[6] + partial[7]));
    for (size_t j = 0; j <= t; ++j) dp[j] = p[j] * (dp[j] - d);
    std::fill(dp + t + 1, dp + seq, 0.0f);
  }
}

void attention_forward_head(const AttentionGeometry& g, const float* q_all, const float* k_all, const float* v_all,
                            float* out, float* lse, size_t b, size_t h, float* scores) {
  const size_t T = g.seq;
  const size_t kv = h / g.group;
  const float* q = q_all + g.q_offset(b, h);
  const float* k = k_all + g.k_offset(b, kv);
  const float* v = v_all + g.v_offset(b, kv);
  gemm_tile(false, true, T, T, g.head_dim, g.scale, q, g.q_stride, k, g.k_stride, 0.0f, scores, T);  // S = scale Q K^T
  causal_softmax_rows(scores, T, nullptr, lse + (b * g.heads + h) * T);
  float* o = out + g.out_offset(b, h);
  gemm_tile(false, false, T, g.head_dim, T, 1.0f, scores, T, v, g.v_stride, 0.0f, o, g.out_stride);  // O = P V
}

struct AttentionGradients {
  float* dq;
  float* dk;
  float* dv;
};

// One query head's backward; kv_beta is 0 (overwrite dk, dv) or 1 (add to them).
void attention_backward_head(const AttentionGeometry& g, const float* dout, const float* q_all, const float* k_all,
                             const float* v_all, const float* lse, const AttentionGradients& grads, size_t b, size_t h,
                             float q_beta, float kv_beta, float* probs, float* dprobs) {
  const size_t T = g.seq;
  const size_t hd = g.head_dim;
  const size_t kv = h / g.group;
  const float* q = q_all + g.q_offset(b, h);
  const float* k = k_all + g.k_offset(b, kv);
  const float* v = v_all + g.v_offset(b, kv);
  const float* d_o = dout + g.out_offset(b, h);
  float* dq = grads.dq + g.q_offset(b, h);
  float* dk = grads.dk + g.k_offset(b, kv);
  float* dv = grads.dv + g.v_offset(b, kv);
  gemm_tile(false, true, T, T, hd, g.scale, q, g.q_stride, k, g.k_stride, 0.0f, probs, T);        // S
  causal_softmax_rows(probs, T, lse + (b * g.heads + h) * T, nullptr);                           // P from the saved lse
  gemm_tile(true, false, T, hd, T, 1.0f, probs, T, d_o, g.out_stride, kv_beta, dv, g.v_stride);   // dV (+)= P^T dO
  gemm_tile(false, true, T, T, hd, 1.0f, d_o, g.out_stride, v, g.v_stride, 0.0f, dprobs, T);     // dP = dO V^T
  softmax_backward_rows(probs, dprobs, T);                                                       // dS
  gemm_tile(false, false, T, hd, T, g.scale, dprobs, T, k, g.k_stride, q_beta, dq, g.q_stride);   // dQ = scale dS K
  gemm_tile(true, false, T, hd, T, g.scale, dprobs, T, q, g.q_stride, kv_beta, dk, g.k_stride);   // dK (+)= scale dS^T Q
}

}  // namespace

void gqa_attention_forward(Executor& executor, const GqaAttentionShape& shape, const float* q, const float* k,
                           const float* v, float* out, float* lse) {
  const AttentionGeometry g(shape);
  keep_blas_single_threaded();
  executor.parallel_for(0, shape.batch * shape.heads, 1, [&](size_t lo, size_t hi) {
    std::vector<float> scores(g.seq * g.seq);
    for (size_t task = lo; task < hi; ++task) {
      attention_forward_head(g, q, k, v, out, lse, task / g.heads, task % g.heads, scores.data());
    }
  });
}

void gqa_attention_backward(Executor& executor, const GqaAttentionShape& shape, const float* dout, const float* q,
                            const float* k, const float* v, const float* lse, float* dq, float* dk, float* dv,
                            GradWrite input_grad) {
  const AttentionGeometry g(shape);
  const AttentionGradients grads{dq, dk, dv};
  const float beta = input_grad == GradWrite::kAccumulate ? 1.0f : 0.0f;
  keep_blas_single_threaded();
  executor.parallel_for(0, shape.batch * shape.kv_heads, 1, [&](size_t lo, size_t hi) {
    std::vector<float> probs(g.seq * g.seq);
    std::vector<float> dprobs(g.seq * g.seq);
    for (size_t task = lo; task < hi; ++task) {
      const size_t b = task / shape.kv_heads;
      const size_t first = (task % shape.kv_heads) * g.group;
      for (size_t h = first; h < first + g.group; ++h) {
        attention_backward_head(g, dout, q, k, v, lse, grads, b, h, beta, h == first ? beta : 1.0f, probs.data(),
                                dprobs.data());
      }
    }
  });
}

// GPT-2's fused qkv: q | k | v in one row of 3C.
void attention_forward(Executor& executor, const AttentionShape& shape, const float* qkv, float* out, float* lse) {
  const size_t channels = shape.heads * shape.head_dim;
  gqa_attention_forward(executor, gqa_shape_of_fused_qkv(shape), qkv, qkv + channels, qkv + 2 * channels, out, lse);
}

void attention_backward(Executor& executor, const AttentionShape& shape, const float* dout, const float* qkv,
                        const float* lse, float* dqkv, GradWrite input_grad) {
  const size_t channels = shape.heads * shape.head_dim;
  gqa_attention_backward(executor, gqa_shape_of_fused_qkv(shape), dout, qkv, qkv + channels, qkv + 2 * channels, lse, dqkv,
                         dqkv + channels, dqkv + 2 * channels, input_grad);
}

// Cross-entropy ----------------------------------------------------------------------

namespace {

Status check_targets(const CrossEntropyShape& shape, const int32_t* targets, const char* op) {
  for (size_t r = 0; r < shape.rows; ++r) {
    const int32_t target = targets[r];
    if (target == shape.ignore_index) continue;
    if (target < 0 || static_cast<size_t>(target) >= shape.vocab_size) {
      return InvalidArgumentError(std::string(op) + ": target " + std::to_string(target) + " of row " + std::to_string(r) +
                                  " is outside the vocabulary [0, " + std::to_string(shape.vocab_size) +
                                  ") and is not the ignore index " + std::to_string(shape.ignore_index));
    }
  }
  return {};
}

// logsumexp of a row: max, then the sum of exp(x - max) in 8 double partials.
STRATA_SIMD_SPAN float row_logsumexp(const float* row, size_t n) {
  float max_value = -std::numeric_limits<float>::infinity();
  for (size_t j = 0; j < n; ++j) max_value = std::max(max_value, row[j]);
  double partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    for (size_t k = 0; k < 8; ++k) partial[k] += exp_approx(row[j + k] - max_value);
  }
  for (; j < n; ++j) partial[0] += exp_approx(row[j] - max_value);
  const double sum = ((partial[0] + partial[1]) + (partial[2] + partial[3])) + ((partial[4] + partial[5]) + (partial[6] + partial[7]));
  return max_value + static_cast<float>(std::log(sum));
}

void mean_over_valid(const CrossEntropyShape& shape, const int32_t* targets, const float* losses, float* mean_loss) {
  double sum = 0.0;
  size_t valid = 0;
  for (size_t r = 0; r < shape.rows; ++r) {
    if (targets[r] == shape.ignore_index) continue;
    sum += losses[r];
    ++valid;
  }
  *mean_loss = valid == 0 ? 0.0f : static_cast<float>(sum / static_cast<double>(valid));
}

// grad_row[j] (+)= (softmax_j - [j == target]) * grad_scale. In place over the logits
// is fine: element j is read before it is written.
STRATA_SIMD_SPAN void write_row_grad(const float* logits_row, float row_lse, int32_t target, float grad_scale,
                                     float* grad_row, size_t n, GradWrite mode) {
  if (mode == GradWrite::kAccumulate) {
    for (size_t j = 0; j < n; ++j) grad_row[j] += exp_approx(logits_row[j] - row_lse) * grad_scale;
  } else {
    for (size_t j = 0; j < n; ++j) grad_row[j] = exp_approx(logits_row[j] - row_lse) * grad_scale;
  }
  grad_row[target] -= grad_scale;
}

}  // namespace

Status cross_entropy_forward(Executor& executor, const CrossEntropyShape& shape, const float* logits,
                             const int32_t* targets, float* losses, float* lse, float* mean_loss) {
  if (Status status = check_targets(shape, targets, "cross_entropy_forward"); !status.ok()) return status;
  const size_t vocab = shape.vocab_size;
  executor.parallel_for(0, shape.rows, 1, [&](size_t lo, size_t hi) {
    for (size_t r = lo; r < hi; ++r) {
      const float* row = logits + r * vocab;
      const float row_lse = row_logsumexp(row, vocab);
      if (lse != nullptr) lse[r] = row_lse;
      losses[r] = targets[r] == shape.ignore_index ? 0.0f : row_lse - row[targets[r]];
    }
  });
  if (mean_loss != nullptr) mean_over_valid(shape, targets, losses, mean_loss);
  return {};
}

Status cross_entropy_backward(Executor& executor, const CrossEntropyShape& shape, const float* logits,
                              const int32_t* targets, const float* lse, float grad_scale, float* dlogits,
                              GradWrite input_grad) {
  if (Status status = check_targets(shape, targets, "cross_entropy_backward"); !status.ok()) return status;
  const size_t vocab = shape.vocab_size;
  executor.parallel_for(0, shape.rows, 1, [&](size_t lo, size_t hi) {
    for (size_t r = lo; r < hi; ++r) {
      float* grad_row = dlogits + r * vocab;
      if (targets[r] == shape.ignore_index) {
        if (input_grad == GradWrite::kOverwrite) std::fill_n(grad_row, vocab, 0.0f);
        continue;
      }
      write_row_grad(logits + r * vocab, lse[r], targets[r], grad_scale, grad_row, vocab, input_grad);
    }
  });
  return {};
}

Status cross_entropy_fused(Executor& executor, const CrossEntropyShape& shape, const float* logits,
                           const int32_t* targets, float grad_scale, float* losses, float* mean_loss, float* dlogits) {
  if (Status status = check_targets(shape, targets, "cross_entropy_fused"); !status.ok()) return status;
  const size_t vocab = shape.vocab_size;
  executor.parallel_for(0, shape.rows, 1, [&](size_t lo, size_t hi) {
    for (size_t r = lo; r < hi; ++r) {
      const float* row = logits + r * vocab;
      float* grad_row = dlogits + r * vocab;
      const int32_t target = targets[r];
      if (target == shape.ignore_index) {
        losses[r] = 0.0f;
        std::fill_n(grad_row, vocab, 0.0f);
        continue;
      }
      const float row_lse = row_logsumexp(row, vocab);
      losses[r] = row_lse - row[target];
      write_row_grad(row, row_lse, target, grad_scale, grad_row, vocab, GradWrite::kOverwrite);
    }
  });
  if (mean_loss != nullptr) mean_over_valid(shape, targets, losses, mean_loss);
  return {};
}

}  // namespace strata::kernels::cpu
