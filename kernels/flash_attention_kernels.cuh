// The kernels of kernels/flash_attention.cu (read its header comment for the design),
// apart from their launchers so that a test can run them on the host:
// tests/kernels/flash_attention_simulation_test.cpp simulates each thread of a block
// with a host thread. Written against a few primitives that the includer declares in
// strata::kernels::cuda first: load / store / store_grad of fp32 values (float or bf16
// storage), warp_sum / warp_max (butterfly shuffles), __syncthreads, __syncwarp,
// threadIdx, blockIdx, gridDim, float4, and the CUDA keywords __global__, __device__,
// __forceinline__, __launch_bounds__ and __shared__. No CUDA header is included here.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace strata::kernels::cuda::flash {

constexpr int kTile = 32;                          // query rows and keys per tile: one per lane
constexpr int kAttentionWarps = 4;
constexpr int kAttentionThreads = kAttentionWarps * 32;
constexpr int kRowsPerWarp = kTile / kAttentionWarps;  // 8
constexpr int kPad = 4;                                // floats after each tile row

template <int kDim>
constexpr int tile_floats() {
  return kTile * (kDim + kPad);
}
constexpr int kWeightFloats = kAttentionWarps * kRowsPerWarp * kTile;  // a P or dS tile, 8 rows per warp

// Everything the three kernels read, passed by value. Row r of head h of batch element
// b starts at base + (b * seq_len + r) * stride + h * head_dim.
template <class T>
struct AttentionParams {
  const T* q;
  const T* k;
  const T* v;
  const T* dout;   // backward; dense [batch, seq_len, heads * head_dim]
  T* out;          // forward; dense like dout
  T* dq;           // strided like q
  T* dk;           // strided like k
  T* dv;           // strided like v
  float* lse;      // [batch, heads, seq_len]: written by the forward, read by the backward
  float* delta;    // [batch, heads, seq_len]: rowsum(P o dP), the backward's workspace
  size_t seq_len;
  size_t heads;
  size_t group;     // query heads per KV head
  size_t head_dim;  // <= kDim
  size_t q_stride;
  size_t k_stride;
  size_t v_stride;
  float scale;      // 1 / sqrt(head_dim)
  bool accumulate;  // GradWrite::kAccumulate for dq, dk, dv
};

// tile[r][d] = rows[row0 + r][d] as fp32; 0 past seq_len or head_dim. `rows` points at
// the head's first element of row 0. Consecutive threads read consecutive columns.
template <int kDim, class T>
__device__ __forceinline__ void load_tile(float* tile, const T* rows, size_t stride, size_t row0, size_t seq_len,
                                          size_t head_dim) {
  for (int i = threadIdx.x; i < kTile * kDim; i += kAttentionThreads) {
    const int r = i / kDim;
    const int d = i % kDim;
    const size_t row = row0 + r;
    tile[r * (kDim + kPad) + d] = (row < seq_len && size_t(d) < head_dim) ? load(rows, row * stride + d) : 0.0f;
  }
}

// out[r] = <shared_rows[r], own_row> for the warp's 8 rows; shared_rows are read by
// every lane at once (broadcast), own_row is the lane's row of another tile.
template <int kDim>
__device__ __forceinline__ void dot_rows(const float* shared_rows, const float* own_row, float (&out)[kRowsPerWarp]) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) out[r] = 0.0f;
#pragma unroll 4
  for (int d = 0; d < kDim; d += 4) {
    const float4 mine = *reinterpret_cast<const float4*>(own_row + d);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const float4 a = *reinterpret_cast<const float4*>(shared_rows + r * (kDim + kPad) + d);
      out[r] = fmaf(a.x, mine.x, out[r]);
      out[r] = fmaf(a.y, mine.y, out[r]);
      out[r] = fmaf(a.z, mine.z, out[r]);
      out[r] = fmaf(a.w, mine.w, out[r]);
    }
  }
}

// acc[r][i] += sum_j weights[r][j] tile[j][lane + 32 i], j in tile order: the warp's 8
// rows of (weights [8][32]) x (tile [32][kDim]).
template <int kDim>
__device__ __forceinline__ void accumulate_rows(const float* weights, const float* tile,
                                                float (&acc)[kRowsPerWarp][kDim / 32]) {
  constexpr int kPerLane = kDim / 32;
  const int lane = threadIdx.x & 31;
#pragma unroll 2
  for (int j = 0; j < kTile; j += 4) {
    float values[4][kPerLane];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) values[jj][i] = tile[(j + jj) * (kDim + kPad) + lane + 32 * i];
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const float4 w = *reinterpret_cast<const float4*>(weights + r * kTile + j);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        acc[r][i] = fmaf(w.x, values[0][i], acc[r][i]);
        acc[r][i] = fmaf(w.y, values[1][i], acc[r][i]);
        acc[r][i] = fmaf(w.z, values[2][i], acc[r][i]);
        acc[r][i] = fmaf(w.w, values[3][i], acc[r][i]);
      }
    }
  }
}

template <class P>
__device__ __forceinline__ size_t row_index(const P& p, size_t b, size_t h, size_t t) {
  return (b * p.heads + h) * p.seq_len + t;  // into lse and delta
}

// Blocks with the most tiles to visit start first, so the short ones fill the tail of
// the grid: query tiles in reverse (the last sees every key tile), key tiles in order
// (the first is seen by every query tile).
__device__ __forceinline__ size_t query_tile_of_block() { return gridDim.x - 1 - blockIdx.x; }
__device__ __forceinline__ size_t key_tile_of_block() { return blockIdx.x; }

// Key tile `key0`'s K and V rows into shared memory, once every warp is done with the
// previous tile's (the first barrier) and before any warp reads them (the second).
template <int kDim, class T>
__device__ __forceinline__ void load_kv_tiles(float* k_tile, float* v_tile, const T* k_rows, const T* v_rows, const AttentionParams<T>& p,
                                              size_t key0) {
  __syncthreads();
  load_tile<kDim>(k_tile, k_rows, p.k_stride, key0, p.seq_len, p.head_dim);
  load_tile<kDim>(v_tile, v_rows, p.v_stride, key0, p.seq_len, p.head_dim);
  __syncthreads();
}

// Forward ---------------------------------------------------------------------------------

template <class T, int kDim>
__global__ void __launch_bounds__(kAttentionThreads) flash_forward_kernel(AttentionParams<T> p) {
  constexpr int kPerLane = kDim / 32;
  constexpr int kLd = kDim + kPad;
  extern __shared__ float4 shared_words[];
  float* q_tile = reinterpret_cast<float*>(shared_words);
  float* k_tile = q_tile + tile_floats<kDim>();
  float* v_tile = k_tile + tile_floats<kDim>();
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  float* weights = v_tile + tile_floats<kDim>() + warp * kRowsPerWarp * kTile;  // this warp's P rows
  const size_t query_tile = query_tile_of_block();
  const size_t h = blockIdx.y;
  const size_t b = blockIdx.z;
  const size_t kv_head = h / p.group;
  const size_t T_len = p.seq_len;
  const size_t row0 = query_tile * kTile;
  const T* k_rows = p.k + b * T_len * p.k_stride + kv_head * p.head_dim;
  const T* v_rows = p.v + b * T_len * p.v_stride + kv_head * p.head_dim;
  load_tile<kDim>(q_tile, p.q + b * T_len * p.q_stride + h * p.head_dim, p.q_stride, row0, T_len, p.head_dim);

  float acc[kRowsPerWarp][kPerLane] = {};
  float row_max[kRowsPerWarp];
  float row_sum[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.0f;
  }
  const float* my_q_rows = q_tile + warp * kRowsPerWarp * kLd;
  // Key tiles 0 .. query_tile: the ones right of the diagonal are fully masked. Every
  // tile visited has key0 <= row and key0 < seq_len for each row of the query tile
  // (rows past seq_len included), so every row sees at least one key per tile and the
  // running max is finite after the first.
  for (size_t key_tile = 0; key_tile <= query_tile; ++key_tile) {
    const size_t key0 = key_tile * kTile;
    load_kv_tiles<kDim>(k_tile, v_tile, k_rows, v_rows, p, key0);
    float s[kRowsPerWarp];
    dot_rows<kDim>(my_q_rows, k_tile + lane * kLd, s);
    const size_t key = key0 + lane;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const size_t t = row0 + warp * kRowsPerWarp + r;
      const bool visible = key <= t && key < T_len;
      const float score = visible ? s[r] * p.scale : -INFINITY;
      const float new_max = fmaxf(row_max[r], warp_max(score));
      const float correction = expf(row_max[r] - new_max);  // 0 on the first tile (max -inf)
      const float prob = visible ? expf(score - new_max) : 0.0f;
      row_sum[r] = row_sum[r] * correction + warp_sum(prob);
      row_max[r] = new_max;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[r][i] *= correction;
      weights[r * kTile + lane] = prob;
    }
    __syncwarp();  // the warp's P rows are written before any lane reads them
    accumulate_rows<kDim>(weights, v_tile, acc);
    __syncwarp();  // and read by every lane before the next tile overwrites them
  }

  const size_t channels = p.heads * p.head_dim;
  T* out_rows = p.out + b * T_len * channels + h * p.head_dim;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const size_t t = row0 + warp * kRowsPerWarp + r;
    if (t >= T_len) continue;
    const float inverse_sum = 1.0f / row_sum[r];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const size_t d = lane + 32 * i;
      if (d < p.head_dim) store(out_rows, t * channels + d, acc[r][i] * inverse_sum);
    }
    if (lane == 0) p.lse[row_index(p, b, h, t)] = row_max[r] + logf(row_sum[r]);
  }
}

// Backward: dq and delta --------------------------------------------------------------------

// s = scale Q K^T and dP = dO V^T for the warp's 8 query rows against the lane's key,
// then P from the saved logsumexp (0 where masked).
template <int kDim>
__device__ __forceinline__ void probabilities_and_dprobs(const float* my_q_rows, const float* my_dout_rows,
                                                         const float* k_tile, const float* v_tile, size_t row0,
                                                         size_t key, size_t seq_len, float scale,
                                                         const float (&row_lse)[kRowsPerWarp], float (&prob)[kRowsPerWarp],
                                                         float (&dprob)[kRowsPerWarp]) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  dot_rows<kDim>(my_q_rows, k_tile + lane * (kDim + kPad), prob);
  dot_rows<kDim>(my_dout_rows, v_tile + lane * (kDim + kPad), dprob);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const size_t t = row0 + warp * kRowsPerWarp + r;
    const bool visible = key <= t && t < seq_len;
    prob[r] = visible ? expf(prob[r] * scale - row_lse[r]) : 0.0f;
  }
}

template <class T, int kDim>
__global__ void __launch_bounds__(kAttentionThreads) flash_backward_dq_kernel(AttentionParams<T> p) {
  constexpr int kPerLane = kDim / 32;
  constexpr int kLd = kDim + kPad;
  extern __shared__ float4 shared_words[];
  float* q_tile = reinterpret_cast<float*>(shared_words);
  float* dout_tile = q_tile + tile_floats<kDim>();
  float* k_tile = dout_tile + tile_floats<kDim>();
  float* v_tile = k_tile + tile_floats<kDim>();
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  float* weights = v_tile + tile_floats<kDim>() + warp * kRowsPerWarp * kTile;  // this warp's dS rows
  const size_t query_tile = query_tile_of_block();
  const size_t h = blockIdx.y;
  const size_t b = blockIdx.z;
  const size_t kv_head = h / p.group;
  const size_t T_len = p.seq_len;
  const size_t row0 = query_tile * kTile;
  const size_t channels = p.heads * p.head_dim;
  const T* k_rows = p.k + b * T_len * p.k_stride + kv_head * p.head_dim;
  const T* v_rows = p.v + b * T_len * p.v_stride + kv_head * p.head_dim;
  load_tile<kDim>(q_tile, p.q + b * T_len * p.q_stride + h * p.head_dim, p.q_stride, row0, T_len, p.head_dim);
  load_tile<kDim>(dout_tile, p.dout + b * T_len * channels + h * p.head_dim, channels, row0, T_len, p.head_dim);
  const float* my_q_rows = q_tile + warp * kRowsPerWarp * kLd;
  const float* my_dout_rows = dout_tile + warp * kRowsPerWarp * kLd;
  float row_lse[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const size_t t = row0 + warp * kRowsPerWarp + r;
    row_lse[r] = t < T_len ? p.lse[row_index(p, b, h, t)] : 0.0f;
  }

  // Pass 1: delta_t = sum_j P_tj dP_tj, each lane summing its keys, then the warp.
  float delta[kRowsPerWarp] = {};
  for (size_t key_tile = 0; key_tile <= query_tile; ++key_tile) {
    const size_t key0 = key_tile * kTile;
    load_kv_tiles<kDim>(k_tile, v_tile, k_rows, v_rows, p, key0);
    float prob[kRowsPerWarp];
    float dprob[kRowsPerWarp];
    probabilities_and_dprobs<kDim>(my_q_rows, my_dout_rows, k_tile, v_tile, row0, key0 + lane, T_len, p.scale, row_lse,
                                   prob, dprob);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) delta[r] = fmaf(prob[r], dprob[r], delta[r]);
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) delta[r] = warp_sum(delta[r]);

  // Pass 2: dS = P o (dP - delta); dq = scale dS K.
  float acc[kRowsPerWarp][kPerLane] = {};
  for (size_t key_tile = 0; key_tile <= query_tile; ++key_tile) {
    const size_t key0 = key_tile * kTile;
    load_kv_tiles<kDim>(k_tile, v_tile, k_rows, v_rows, p, key0);
    float prob[kRowsPerWarp];
    float dprob[kRowsPerWarp];
    probabilities_and_dprobs<kDim>(my_q_rows, my_dout_rows, k_tile, v_tile, row0, key0 + lane, T_len, p.scale, row_lse,
                                   prob, dprob);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) weights[r * kTile + lane] = prob[r] * (dprob[r] - delta[r]);
    __syncwarp();
    accumulate_rows<kDim>(weights, k_tile, acc);
    __syncwarp();
  }

  T* dq_rows = p.dq + b * T_len * p.q_stride + h * p.head_dim;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const size_t t = row0 + warp * kRowsPerWarp + r;
    if (t >= T_len) continue;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const size_t d = lane + 32 * i;
      if (d < p.head_dim) store_grad(dq_rows, t * p.q_stride + d, p.scale * acc[r][i], p.accumulate);
    }
    if (lane == 0) p.delta[row_index(p, b, h, t)] = delta[r];
  }
}

// Backward: dk and dv -----------------------------------------------------------------------

// Here the roles swap: each warp owns 8 keys (rows of the K and V tiles, read by every
// lane at once) and lane t is query row row0 + t.
template <class T, int kDim>
__global__ void __launch_bounds__(kAttentionThreads) flash_backward_dkv_kernel(AttentionParams<T> p) {
  constexpr int kPerLane = kDim / 32;
  constexpr int kLd = kDim + kPad;
  extern __shared__ float4 shared_words[];
  float* k_tile = reinterpret_cast<float*>(shared_words);
  float* v_tile = k_tile + tile_floats<kDim>();
  float* q_tile = v_tile + tile_floats<kDim>();
  float* dout_tile = q_tile + tile_floats<kDim>();
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  float* prob_rows = dout_tile + tile_floats<kDim>() + warp * kRowsPerWarp * kTile;  // P^T: [key][query]
  float* dscore_rows = prob_rows + kWeightFloats;                                     // dS^T likewise
  const size_t key_tile = key_tile_of_block();
  const size_t kv_head = blockIdx.y;
  const size_t b = blockIdx.z;
  const size_t T_len = p.seq_len;
  const size_t key0 = key_tile * kTile;
  const size_t channels = p.heads * p.head_dim;
  const size_t query_tiles = (T_len + kTile - 1) / kTile;
  load_tile<kDim>(k_tile, p.k + b * T_len * p.k_stride + kv_head * p.head_dim, p.k_stride, key0, T_len, p.head_dim);
  load_tile<kDim>(v_tile, p.v + b * T_len * p.v_stride + kv_head * p.head_dim, p.v_stride, key0, T_len, p.head_dim);
  const float* my_k_rows = k_tile + warp * kRowsPerWarp * kLd;
  const float* my_v_rows = v_tile + warp * kRowsPerWarp * kLd;

  float dk_acc[kRowsPerWarp][kPerLane] = {};
  float dv_acc[kRowsPerWarp][kPerLane] = {};
  for (size_t h = kv_head * p.group; h < (kv_head + 1) * p.group; ++h) {  // the group's query heads, in order
    const T* q_rows = p.q + b * T_len * p.q_stride + h * p.head_dim;
    const T* dout_rows = p.dout + b * T_len * channels + h * p.head_dim;
    // Query tiles from the diagonal down: the ones above it see none of these keys.
    for (size_t query_tile = key_tile; query_tile < query_tiles; ++query_tile) {
      const size_t row0 = query_tile * kTile;
      __syncthreads();  // every warp is done with the previous Q and dO tiles
      load_tile<kDim>(q_tile, q_rows, p.q_stride, row0, T_len, p.head_dim);
      load_tile<kDim>(dout_tile, dout_rows, channels, row0, T_len, p.head_dim);
      __syncthreads();
      const size_t t = row0 + lane;
      const bool row_exists = t < T_len;
      const float row_lse = row_exists ? p.lse[row_index(p, b, h, t)] : 0.0f;
      const float row_delta = row_exists ? p.delta[row_index(p, b, h, t)] : 0.0f;
      float score[kRowsPerWarp];
      float dprob[kRowsPerWarp];
      dot_rows<kDim>(my_k_rows, q_tile + lane * kLd, score);
      dot_rows<kDim>(my_v_rows, dout_tile + lane * kLd, dprob);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const size_t key = key0 + warp * kRowsPerWarp + r;
        const bool visible = key <= t && row_exists;  // key <= t < seq_len: the key exists too
        const float prob = visible ? expf(score[r] * p.scale - row_lse) : 0.0f;
        prob_rows[r * kTile + lane] = prob;
        dscore_rows[r * kTile + lane] = prob * (dprob[r] - row_delta);
      }
      __syncwarp();
      accumulate_rows<kDim>(prob_rows, dout_tile, dv_acc);
      accumulate_rows<kDim>(dscore_rows, q_tile, dk_acc);
      __syncwarp();
    }
  }

  T* dk_rows = p.dk + b * T_len * p.k_stride + kv_head * p.head_dim;
  T* dv_rows = p.dv + b * T_len * p.v_stride + kv_head * p.head_dim;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const size_t key = key0 + warp * kRowsPerWarp + r;
    if (key >= T_len) continue;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const size_t d = lane + 32 * i;
      if (d >= p.head_dim) continue;
      store_grad(dk_rows, key * p.k_stride + d, p.scale * dk_acc[r][i], p.accumulate);
      store_grad(dv_rows, key * p.v_stride + d, dv_acc[r][i], p.accumulate);
    }
  }
}

}  // namespace strata::kernels::cuda::flash
