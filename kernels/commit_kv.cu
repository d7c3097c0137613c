// ddtree_commit_kv: compact each request's accepted path in a paged latent KV cache, in place.
//
// Python reference: ddtree.kernels.reference.commit_kv (contract: ddtree.kernels.kv.commit_kv).
// Logical position p of request b lives at cache[block_table[b, p / page_size], p % page_size].
// For every accepted m < length[b]: row prefix_lens[b] + nodes[b, m] moves to prefix_lens[b] + m.
//
// Grid: (batch_size, column_blocks). Block: 32 * COMMIT_WARPS threads. Each block owns one request
// and a slice of COLS_PER_BLOCK 16-byte columns of every row (the head_dim slices are independent,
// so blocks never race). The block first validates the request (every block of a request reaches
// the same verdict from the same data; only column block 0 ORs the error flag), then loads all
// accepted rows of its slice into shared memory, synchronises, and only then writes them: sources
// are all read before any destination is written, so overlapping paths are safe.
//
// PHASE (a launch argument): 0 = validate and move each request on its own; all or nothing, in
// two launches: 1 = validate only (grid (batch_size, 1): flags, the cache untouched), then 2 =
// every block first reads the flags of the whole batch (an earlier op's too) and moves nothing
// if any is set, else validates again and moves as in 0.
//
// Shared memory: path_len * COLS_PER_BLOCK * 16 bytes (path_len <= 33, so <= 33 * 16 * 64 bytes).
// Preconditions (checked on the host): row_bytes = head_dim * element size is a multiple of 16
// and the cache is 16-byte aligned and contiguous; 1 <= page_size <= 256.
// Caller data is validated here: a bad path (ACCEPTANCE), prefix length (LENGTH) or block-table
// entry (BLOCK_TABLE) flags the request and leaves its cache untouched; nothing is ever read or
// written out of bounds.
#include "common.cuh"

#ifndef COLS_PER_BLOCK
#define COLS_PER_BLOCK 64
#endif

extern "C" __global__ void ddtree_commit_kv(
    uint4* __restrict__ cache,            // [num_pages, page_size, row_vecs] (16-byte vectors)
    const int32_t* __restrict__ block_table,  // [batch_size, max_pages]
    const int32_t* __restrict__ prefix_lens,  // [batch_size]
    const int32_t* __restrict__ nodes,        // [batch_size, path_len]
    const int32_t* __restrict__ length,       // [batch_size]
    int32_t* __restrict__ error_flags,        // [batch_size]
    int32_t num_pages, int32_t page_size, int32_t row_vecs, int32_t max_pages,
    int32_t path_len, int32_t batch_size, int32_t phase) {
  __shared__ uint4 rows[33 * COLS_PER_BLOCK];
  __shared__ int32_t src_row[33];  // page * page_size + slot of each accepted source
  __shared__ int32_t dst_row[33];
  __shared__ int32_t verdict;
  ddtree_wait_for_previous_grid();  // launched dependent: the kernel before may still run
  ddtree_allow_dependents();
  const int b = blockIdx.x;
  const int tid = threadIdx.x;
  if (phase == 2) {
    int any = 0;
    for (int r = tid; r < batch_size; r += blockDim.x) any |= error_flags[r];
    if (__syncthreads_or(any)) return;
  }
  if (tid == 0) verdict = 0;
  __syncthreads();

  const int len = length[b];
  const int prefix = prefix_lens[b];
  const bool len_ok = len >= 1 && len <= path_len;
  // Path shape first (checks.acceptance_flags); paging is judged only for well-formed paths.
  if (tid < path_len && len_ok && tid < len) {
    const int node = nodes[(int64_t)b * path_len + tid];
    const bool bad = tid == 0 ? node != 0 : node <= nodes[(int64_t)b * path_len + tid - 1];
    if (bad) atomicOr(&verdict, DDTREE_ERR_ACCEPTANCE);
  }
  if (tid == 0 && !len_ok) atomicOr(&verdict, DDTREE_ERR_ACCEPTANCE);
  __syncthreads();
  if (verdict == 0 && tid < len) {
    // checks.commit_kv_flags: LENGTH for a negative prefix or a last source past the table,
    // BLOCK_TABLE for a touched position inside the table whose entry is out of range.
    const int m = tid;
    const int64_t capacity = (int64_t)max_pages * page_size;
    const int64_t src = (int64_t)prefix + nodes[(int64_t)b * path_len + m];
    const int64_t dst = (int64_t)prefix + m;
    int flags = 0;
    if (prefix < 0 || (m == len - 1 && src >= capacity)) flags |= DDTREE_ERR_LENGTH;
    int sp = -1, dp = -1;
    if (src >= 0 && src < capacity) {
      sp = block_table[(int64_t)b * max_pages + (int)(src / page_size)];
      if (sp < 0 || sp >= num_pages) flags |= DDTREE_ERR_BLOCK_TABLE;
    }
    if (dst >= 0 && dst < capacity) {
      dp = block_table[(int64_t)b * max_pages + (int)(dst / page_size)];
      if (dp < 0 || dp >= num_pages) flags |= DDTREE_ERR_BLOCK_TABLE;
    }
    src_row[m] = sp * page_size + (int)(src % page_size);
    dst_row[m] = dp * page_size + (int)(dst % page_size);
    if (flags) atomicOr(&verdict, flags);
  }
  __syncthreads();
  const int found = verdict;
  if (blockIdx.y == 0 && tid == 0 && found) atomicOr(&error_flags[b], found);
  // A request already flagged by an earlier op is left untouched as well.
  if (phase == 1 || found != 0 || error_flags[b] != 0) return;

  const int col0 = blockIdx.y * COLS_PER_BLOCK;
  const int cols = min(COLS_PER_BLOCK, row_vecs - col0);
  for (int e = tid; e < len * cols; e += blockDim.x) {
    const int m = e / cols;
    const int c = e - m * cols;
    rows[m * COLS_PER_BLOCK + c] = cache[(int64_t)src_row[m] * row_vecs + col0 + c];
  }
  __syncthreads();
  for (int e = tid; e < len * cols; e += blockDim.x) {
    const int m = e / cols;
    const int c = e - m * cols;
    cache[(int64_t)dst_row[m] * row_vecs + col0 + c] = rows[m * COLS_PER_BLOCK + c];
  }
}
