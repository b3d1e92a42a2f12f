// CPU twins of the transformer ops (kernels/transformer_ops.h), fp32 only.
//
// Each runs on the calling thread and fans out through `executor`; the host entry
// points call them on a CpuDevice stream's worker. Exposed for tests and for callers
// already on a CPU worker. Shapes, layouts and GradWrite semantics are those of
// kernels/transformer_ops.h.
//
// Parallel splits never change the order of a sum: rows are independent, column sums
// (dgamma, dbeta, dbias, dwpe, dwte) are split by column and run over rows in order,
// attention is split by (batch, head) (below: GPT-2's attention is
// the grouped-query attention on its fused qkv), matrix products by fixed 64-row/column tiles of
// the result (one single-threaded BLAS call each). So results do not depend on the
// thread count.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/core/executor.h"
#include "engine/core/status.h"
#include "kernels/gqa_attention.h"
#include "kernels/transformer_ops.h"

namespace strata::kernels::cpu {

Status embedding_forward(Executor& executor, const EmbeddingShape& shape, const int32_t* tokens, const float* wte,
                         const float* wpe, float* out);
Status embedding_backward(Executor& executor, const EmbeddingShape& shape, const int32_t* tokens, const float* dout,
                          float* dwte, float* dwpe, GradWrite param_grad);

void layernorm_forward(Executor& executor, const LayerNormShape& shape, const float* x, const float* gamma,
                       const float* beta, float* y, float* mean, float* rstd);
void layernorm_backward(Executor& executor, const LayerNormShape& shape, const float* dy, const float* x,
                        const float* gamma, const float* mean, const float* rstd, float* dx, float* dgamma, float* dbeta,
                        const GradOptions& options);

void matmul_forward(Executor& executor, const MatmulShape& shape, const float* x, const float* weight, const float* bias,
                    float* y);
void matmul_backward(Executor& executor, const MatmulShape& shape, const float* dy, const float* x, const float* weight,
                     float* dx, float* dweight, float* dbias, const GradOptions& options);

// dbias[c] (+)= sum over rows of dy[r, c] (dy: [rows, columns]), rows added in order:
// matmul_backward's dbias, and the bias gradient gelu_matmul_backward passes on.
void bias_backward(Executor& executor, size_t rows, size_t columns, const float* dy, float* dbias, GradWrite param_grad);

void gelu_forward(Executor& executor, const float* x, float* y, size_t count);
void gelu_backward(Executor& executor, const float* dy, const float* x, float* dx, size_t count, GradWrite input_grad);

void residual_forward(Executor& executor, const float* a, const float* b, float* out, size_t count);
void residual_backward(Executor& executor, const float* dout, float* da, float* db, size_t count, GradWrite input_grad);

void attention_forward(Executor& executor, const AttentionShape& shape, const float* qkv, float* out, float* lse);
void attention_backward(Executor& executor, const AttentionShape& shape, const float* dout, const float* qkv,
                        const float* lse, float* dqkv, GradWrite input_grad);

Status cross_entropy_forward(Executor& executor, const CrossEntropyShape& shape, const float* logits,
                             const int32_t* targets, float* losses, float* lse, float* mean_loss);
Status cross_entropy_backward(Executor& executor, const CrossEntropyShape& shape, const float* logits,
                              const int32_t* targets, const float* lse, float grad_scale, float* dlogits,
                              GradWrite input_grad);
Status cross_entropy_fused(Executor& executor, const CrossEntropyShape& shape, const float* logits,
                           const int32_t* targets, float grad_scale, float* losses, float* mean_loss, float* dlogits);

// True when matrix products use a CPU BLAS (cblas_sgemm); false when this build fell
// back to the plain loops (no cblas.h at build time).
bool has_blas();

// Makes the CPU BLAS single-threaded for the whole process, once: the matrix products
// run one single-threaded BLAS call per tile on the executor's threads, and BLAS
// threads inside those oversubscribe the cores and serialize on OpenBLAS's level-3
// lock. With OpenBLAS's threaded build it also stops the pool OpenBLAS started at load,
// whose idle threads otherwise spin in sched_yield and take CPU from CPU Adam, the
// gradient landing and the I/O threads. BlasContext::create on a CPU device and every
// CPU matrix product call it; a program calls reexec_with_single_threaded_blas (below)
// first thing instead, so the pool does not spin through its set-up either. Idempotent
// and thread-safe; a no-op without OpenBLAS.
void keep_blas_single_threaded();

// Makes OpenBLAS map, now, the working buffers of `callers` threads that call it at once
// (process-wide: the first call maps them, later ones only what is still missing). OpenBLAS
// takes a buffer of about 128 MiB from a table of slots on a thread's first matrix product
// and keeps it for the next; where that allocation fails (an address-space limit,
// `ulimit -v`) it retries forever, and the product never returns. So each buffer is first
// tried with malloc of the same size: when the system refuses it, this returns
// OUT_OF_MEMORY naming the buffer (and OpenBLAS is not asked); else OpenBLAS maps it at
// once, and the products reuse it later whatever else the program has mapped since.
// BlasContext::create calls it on a CPU device, before the model's activations are
// allocated. A no-op without OpenBLAS (or an OpenBLAS without blas_memory_alloc).
Status reserve_blas_buffers(int callers);

// For a program's main, first thing: makes the CPU BLAS single-threaded from the moment
// it loads. OpenBLAS's threaded build starts its pool in its library constructor, before
// main, and each pool thread maps a 128 MiB buffer; where that mmap fails (an address-space
// limit, `ulimit -v`) the thread retries forever, so keep_blas_single_threaded() would wait
// forever for it to stop and the program would hang before its first line. Only the
// environment OpenBLAS reads at load keeps the pool from starting, so when a pool was
// started and OPENBLAS_NUM_THREADS is not 1, this sets it to 1 and re-executes the program
// (/proc/self/exe with the same argv: argv[0], which names the program in its messages,
// and every flag are kept). The new image finds the variable set and does not re-execute
// again. Returns when no re-execution was needed (or possible: a program started through
// an explicit `ld.so PROGRAM`, whose /proc/self/exe is the loader, stops the pool as
// before), or with the reason it failed (the program may go on: the pool is then stopped
// as before). Either way the BLAS is single-threaded on return (keep_blas_single_threaded).
//
// Why a re-execution: a .preinit_array entry in the executable runs before the libraries'
// constructors, but glibc sets up the C library's environment only after it, so a
// setenv there is lost; and a serial OpenBLAS is not what libopenblas-dev links by default,
// its path differs between distributions, so the program would not choose it reliably.
Status reexec_with_single_threaded_blas(char** argv);

// Causal grouped-query attention (kernels/gqa_attention.h), split by (batch, head) forward
// and (batch, KV head) backward; GPT-2's attention above wraps it.
void gqa_attention_forward(Executor& executor, const GqaAttentionShape& shape, const float* q, const float* k,
                           const float* v, float* out, float* lse);
void gqa_attention_backward(Executor& executor, const GqaAttentionShape& shape, const float* dout, const float* q,
                            const float* k, const float* v, const float* lse, float* dq, float* dk, float* dv,
                            GradWrite input_grad);

}  // namespace strata::kernels::cpu
