// BlasContext: what the matrix products of the transformer ops need from a BLAS.
//
// On a CudaDevice it owns one cuBLAS handle, created on that GPU, and a cuBLAS
// workspace allocated from the device (so the GEMMs stay inside the device budget;
// cuBLAS's own default pool would not). Each call that uses it takes its mutex, points
// the handle at the stream the op was launched on and sets the workspace again (cuBLAS
// resets the workspace on every cublasSetStream). GEMMs enqueued through one context
// share its workspace, so give each compute stream its own BlasContext: two streams
// that run GEMMs concurrently through one context would race on the workspace.
//
// On a CpuDevice it holds nothing: matrix products are split into fixed tiles of 64
// rows (or columns) of the result, run in parallel on the device executor, one
// single-threaded CPU BLAS call (OpenBLAS's cblas_sgemm) each. Creating the context
// (or the first CPU matrix product) therefore makes the BLAS single-threaded,
// process-wide, and stops OpenBLAS's idle pool (cpu::keep_blas_single_threaded):
// OpenBLAS threads inside executor threads oversubscribe the cores and serialize on
// OpenBLAS's level-3 lock. Measured on the 2-core dev box while other builds ran, backward of a
// [256 x 128] . [128 x 512] product: 24 ms as one call with OpenBLAS's 2 threads beside
// a 2-thread executor, 1.1 ms as one single-threaded call, 0.57 ms in executor tiles.
// Creating it also has OpenBLAS map the working buffers of the threads that will multiply
// (cpu::reserve_blas_buffers), so an address-space limit that leaves no room for them
// fails here with OUT_OF_MEMORY instead of inside a product that would retry forever.
//
// Why an object the caller keeps rather than a cache keyed by stream inside kernels/:
// the handle and the workspace are resources with a device and a budget, and this
// project keeps resources in move-only owners with a visible lifetime, not in globals.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "engine/core/device.h"
#include "engine/core/status.h"

namespace strata::kernels {

// Which GEMMs may take cuBLASLt's GELU epilogues (matmul_bias_gelu_forward and
// gelu_matmul_backward, kernels/transformer_ops.h, say why bf16 only by default).
enum class GeluEpilogue : uint8_t {
  kBf16Only,  // bf16 GEMMs: the epilogue agrees with gelu_forward to bf16 precision whichever GELU it computes
  kAlways,    // fp32 GEMMs too: what a test uses to measure cuBLASLt's GELU against gelu_forward at fp32 precision
  kNever,     // always the unfused path (GEMM, then the GELU kernels): for comparing the two
};

struct BlasOptions {
  // How fp32 GEMMs run on the GPU (engine/core/device.h); unset = the device's
  // matmul_precision() (strata.matmul_precision). An op that needs exact products sets kFp32.
  std::optional<MatmulPrecision> matmul_precision;
  GeluEpilogue gelu_epilogue = GeluEpilogue::kBf16Only;
  size_t cuda_workspace_bytes = size_t{32} << 20;  // cuBLAS workspace from the device budget (NVIDIA suggests 32 MiB on Hopper)
};

// What became of the GEMMs that asked cuBLASLt for an epilogue (bias, bias gradient,
// GELU): `fused` ran with it; `fallbacks` found no algorithm for the combination (shape,
// types, alignment), and the op took its unfused path (slower, same result). Zero on a
// CpuDevice. Tests and benchmarks read it to tell a fused run from a fallback.
// `gelu_fused` is the part of `fused` that carried a GELU (forward or gradient): a GEMM
// whose GELU took the unfused path may still have fused its bias.
struct EpilogueCounts {
  uint64_t fused = 0;
  uint64_t fallbacks = 0;
  uint64_t gelu_fused = 0;
};

class BlasContext {
 public:
  struct Impl;  // defined in kernels/blas_context_impl.h (cuBLAS state); opaque to callers

  // Creates the context for `device`. On a CudaDevice: cublasCreate on that GPU and the
  // workspace allocation; fails with the cuBLAS error or the budget error.
  static StatusOr<BlasContext> create(Device& device, const BlasOptions& options = {});

  BlasContext(BlasContext&& other) noexcept;
  BlasContext& operator=(BlasContext&& other) noexcept;
  BlasContext(const BlasContext&) = delete;
  BlasContext& operator=(const BlasContext&) = delete;
  ~BlasContext();

  Device& device() const;
  const BlasOptions& options() const;
  // How this context's fp32 GEMMs run: options().matmul_precision, else the device's.
  MatmulPrecision matmul_precision() const;
  // The epilogue outcomes of the GEMMs run through this context so far.
  EpilogueCounts epilogue_counts() const;
  Impl& impl() const { return *impl_; }

 private:
  explicit BlasContext(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::kernels
