// build_tree: the DDTree draft tree on the GPU in three launches with no host round trip.
//
// Python reference: ddtree.kernels.reference.build_tree (contract: ddtree.kernels.build.build_tree).
// Rows are (request, depth) pairs, row = b * draft_len + (depth - 1). K = min(max_budget, V).
//
// 1. ddtree_build_partial  grid (num_chunks, rows), block PARTIAL_THREADS (256), dynamic shared
//    memory (256 * TOPM + chunk) * 8 bytes, chunk = 256 * ELEMS entries. Each block reads one
//    chunk of one row of logits exactly once (16-byte loads) into registers, ELEMS per thread.
//    It writes the chunk's max finite x, its sum of exp(x - max) and its count of +inf, and its
//    top min(K, chunk) entries as 64-bit composites order_key(x) << 32 | ~token (larger
//    composite = larger scaled logit x, equal x smaller token id). Selection: every thread
//    nominates its TOPM largest composites; the K-th largest nomination (radix select in shared
//    memory) is a lower bound of the chunk's K-th largest, so only entries above it (at most K
//    threads hold any) are compacted to shared memory and radix-selected exactly.
// 2. ddtree_build_merge  grid (rows), block MERGE_THREADS, dynamic shared memory
//    num_chunks * chunk_keep * 8 + pow2(K) * 8 bytes. Combines the chunk statistics into the
//    row's log-sum-exp, selects the row's top-K composites, sorts them (bitonic), and writes the
//    sorted top-K tokens, their log-probabilities and the number of possible ones.
// 3. ddtree_build_select  grid (batch_size), block 32 * ceil(max_budget / 32) threads, one
//    frontier slot per thread. Best-first selection: each pop is a block-wide argmax over the
//    frontier (score descending, rank tuple lexicographically ascending; ties are resolved by
//    walking the popped nodes' parents in shared memory), the popped slot takes the node's first
//    child and a fresh slot its next sibling. Then every thread writes nodes and ancestor masks.
//    Shared memory: 16 bytes per node slot plus, when it fits, the per-depth log-prob table.
//
// Rules shared with the reference: x = logits.float() / temperature (true division), NaN -> -inf,
// a row holding +inf gives its +inf tokens log-prob -log(count) and every other token -inf, an
// all -inf row has no possible token; scores are fp32 running sums in depth order.
// Caller data read here: root_tokens (checked: out of range -> ErrorFlag.TOKEN, root-only tree),
// budgets (clamped to [0, num_nodes_max - 1]), error_flags (non-zero on entry -> root-only tree).
#include "common.cuh"

#ifndef PARTIAL_THREADS
#define PARTIAL_THREADS 256
#endif
#ifndef ELEMS
#define ELEMS 16
#endif
#ifndef TOPM
#define TOPM 1
#endif
#ifndef MERGE_THREADS
#define MERGE_THREADS 512
#endif

__device__ __forceinline__ uint64_t ddtree_composite(float x, uint32_t token) {
  x += 0.0f;  // -0.0 and +0.0 compare equal in the reference's sort: rank them by id alone
  return ((uint64_t)ddtree_order_key(x) << 32) | (uint64_t)(0xFFFFFFFFu - token);
}

__device__ __forceinline__ float ddtree_composite_value(uint64_t c) {
  return ddtree_key_to_float((uint32_t)(c >> 32));
}

__device__ __forceinline__ uint32_t ddtree_composite_token(uint64_t c) {
  return 0xFFFFFFFFu - (uint32_t)(c & 0xFFFFFFFFull);
}

// Radix select over n distinct composites in shared memory: afterwards the k largest are exactly
// those with (c & *mask) >= *prefix (all of them when k >= n). Every thread of the block must
// call it; hist holds 256 counters and state 4 words of shared memory.
__device__ void ddtree_radix_select(const uint64_t* vals, int n, int k, uint32_t* hist,
                                    uint64_t* state, uint64_t* prefix_out, uint64_t* mask_out) {
  const int tid = threadIdx.x;
  if (k >= n) {
    *prefix_out = 0;
    *mask_out = 0;
    return;
  }
  // state: [0] prefix, [1] mask, [2] remaining, [3] done
  if (tid == 0) {
    state[0] = 0;
    state[1] = 0;
    state[2] = (uint64_t)k;
    state[3] = 0;
  }
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    const uint64_t prefix = state[0];
    const uint64_t mask = state[1];
    // The high digits of one row's keys are nearly all equal: aggregate equal bins per warp
    // before the shared-memory atomic, or the atomics serialise.
    const int rounded = (n + blockDim.x - 1) / blockDim.x * blockDim.x;
    for (int i = tid; i < rounded; i += blockDim.x) {
      uint32_t bin = 256u;
      if (i < n) {
        const uint64_t v = vals[i];
        if ((v & mask) == prefix) bin = (uint32_t)(v >> shift) & 255u;
      }
      const uint32_t peers = __match_any_sync(0xFFFFFFFFu, bin);
      if (bin < 256u && (tid & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
    }
    __syncthreads();
    if (tid < 32) {
      const uint32_t rem = (uint32_t)state[2];
      // Lane l covers bins 255 - 8l down to 248 - 8l (largest digits first).
      uint32_t local = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) local += hist[255 - 8 * tid - j];
      uint32_t incl = local;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const uint32_t o = __shfl_up_sync(0xFFFFFFFFu, incl, off);
        if (tid >= off) incl += o;
      }
      const uint32_t hit = __ballot_sync(0xFFFFFFFFu, incl >= rem);
      const int lane = __ffs(hit) - 1;
      if (tid == lane) {
        uint32_t cum = incl - local;
        for (int j = 0; j < 8; ++j) {
          const int bin = 255 - 8 * tid - j;
          const uint32_t c = hist[bin];
          if (cum + c >= rem) {
            const uint32_t new_rem = rem - cum;
            state[0] = prefix | ((uint64_t)bin << shift);
            state[1] = mask | ((uint64_t)0xFF << shift);
            state[2] = new_rem;
            state[3] = (c == new_rem) ? 1 : 0;
            break;
          }
          cum += c;
        }
      }
    }
    __syncthreads();
    if (state[3]) break;
  }
  *prefix_out = state[0];
  *mask_out = state[1];
}

__device__ __forceinline__ float ddtree_block_reduce_max(float v, float* scratch) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : -DDTREE_INF;
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  return v;
}

__device__ __forceinline__ float ddtree_block_reduce_sum(float v, float* scratch) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0f;
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
  return v;
}

// Inserts composite c into a descending list of the thread's TOPM largest composites.
__device__ __forceinline__ void ddtree_top_insert(uint64_t (&top)[TOPM], uint64_t c) {
#pragma unroll
  for (int j = 0; j < TOPM; ++j) {
    const uint64_t t = top[j];
    const bool swap = c > t;
    top[j] = swap ? c : t;
    c = swap ? t : c;
  }
}

extern "C" __global__ void __launch_bounds__(PARTIAL_THREADS) ddtree_build_partial(
    const ddtree_logit_t* __restrict__ logits,  // [rows, vocab]
    float temperature, int32_t vocab, int32_t num_chunks, int32_t keep, int32_t cand_capacity,
    int32_t vectorized,
    uint64_t* __restrict__ part_keys,   // [rows, num_chunks, keep]
    float* __restrict__ part_stats) {   // [rows, num_chunks, 3]: max, sum exp(x - max), +inf count
  // Shared memory: the threads' top-TOPM lists, then up to cand_capacity candidates.
  extern __shared__ uint64_t smem[];
  uint64_t* lists = smem;                               // [PARTIAL_THREADS * TOPM]
  uint64_t* cand = smem + PARTIAL_THREADS * TOPM;       // [cand_capacity]
  __shared__ uint32_t hist[256];
  __shared__ uint64_t state[4];
  __shared__ float scratch[32];
  __shared__ int counter;
  constexpr int VEC = 16 / sizeof(ddtree_logit_t);
  constexpr int CHUNK = PARTIAL_THREADS * ELEMS;
  const int tid = threadIdx.x, lane = tid & 31;
  const int chunk = blockIdx.x;
  const int64_t row = blockIdx.y;
  const int start = chunk * CHUNK;
  const int len = min(CHUNK, vocab - start);
  const ddtree_logit_t* src = logits + row * (int64_t)vocab + start;

  // Element e of vector j of this thread is chunk entry (tid + j * PARTIAL_THREADS) * VEC + e:
  // consecutive threads read consecutive 16-byte vectors. The chunk stays in registers.
  float x[ELEMS];
#pragma unroll
  for (int j = 0; j < ELEMS / VEC; ++j) {
    const int first = (tid + j * PARTIAL_THREADS) * VEC;
    if (vectorized && first + VEC <= len) {
      uint4 raw = __ldg(reinterpret_cast<const uint4*>(src + first));
      const ddtree_logit_t* e = reinterpret_cast<const ddtree_logit_t*>(&raw);
#pragma unroll
      for (int k = 0; k < VEC; ++k) x[j * VEC + k] = ddtree_scaled_logit(e[k], temperature);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        x[j * VEC + k] = first + k < len ? ddtree_scaled_logit(src[first + k], temperature)
                                         : __int_as_float(0x7FC00000);  // NaN: not an entry
      }
    }
  }
  float local_max = -DDTREE_INF, local_inf = 0.0f;
  uint64_t top[TOPM];
#pragma unroll
  for (int j = 0; j < TOPM; ++j) top[j] = 0;
#pragma unroll
  for (int i = 0; i < ELEMS; ++i) {
    const float v = x[i];
    if (v == DDTREE_INF) local_inf += 1.0f;
    else if (!isnan(v)) local_max = fmaxf(local_max, v);
    if (!isnan(v)) {
      const int idx = (tid + (i / VEC) * PARTIAL_THREADS) * VEC + (i % VEC);
      ddtree_top_insert(top, ddtree_composite(v, (uint32_t)(start + idx)));
    }
  }
  const float row_max = ddtree_block_reduce_max(local_max, scratch);
  const float inf_count = ddtree_block_reduce_sum(local_inf, scratch);
  float local_sum = 0.0f;
  if (row_max > -DDTREE_INF) {
#pragma unroll
    for (int i = 0; i < ELEMS; ++i) {
      const float v = x[i];
      if (v > -DDTREE_INF && v < DDTREE_INF) local_sum += expf(v - row_max);
    }
  }
  const float sum = ddtree_block_reduce_sum(local_sum, scratch);
  if (tid == 0) {
    float* stats = part_stats + (row * num_chunks + chunk) * 3;
    stats[0] = row_max;
    stats[1] = sum;
    stats[2] = inf_count;
    counter = 0;
  }
#pragma unroll
  for (int j = 0; j < TOPM; ++j) lists[tid * TOPM + j] = top[j];
  __syncthreads();

  // Threshold: the keep-th largest of the threads' top lists is a lower bound of the chunk's
  // keep-th largest entry, and at most `keep` threads hold an entry above it.
  uint64_t prefix = 0, mask = 0;
  const bool take_all = len <= keep;
  if (!take_all) ddtree_radix_select(lists, PARTIAL_THREADS * TOPM, keep, hist, state, &prefix, &mask);
  // Compact the candidates (warp-aggregated offsets).
  int mine = 0;
#pragma unroll
  for (int i = 0; i < ELEMS; ++i) {
    const float v = x[i];
    if (!isnan(v)) {
      const int idx = (tid + (i / VEC) * PARTIAL_THREADS) * VEC + (i % VEC);
      mine += (ddtree_composite(v, (uint32_t)(start + idx)) & mask) >= prefix ? 1 : 0;
    }
  }
  int incl = mine;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int o = __shfl_up_sync(0xFFFFFFFFu, incl, off);
    if (lane >= off) incl += o;
  }
  int base = 0;
  if (lane == 31) base = atomicAdd(&counter, incl);
  base = __shfl_sync(0xFFFFFFFFu, base, 31);
  int pos = base + incl - mine;
#pragma unroll
  for (int i = 0; i < ELEMS; ++i) {
    const float v = x[i];
    if (!isnan(v)) {
      const int idx = (tid + (i / VEC) * PARTIAL_THREADS) * VEC + (i % VEC);
      const uint64_t c = ddtree_composite(v, (uint32_t)(start + idx));
      if ((c & mask) >= prefix && pos < cand_capacity) cand[pos++] = c;
    }
  }
  __syncthreads();
  const int n = min(counter, cand_capacity);
  __syncthreads();
  if (tid == 0) counter = 0;
  __syncthreads();
  ddtree_radix_select(cand, n, keep, hist, state, &prefix, &mask);
  uint64_t* out = part_keys + (row * num_chunks + chunk) * (int64_t)keep;
  for (int i = tid; i < n; i += PARTIAL_THREADS) {
    const uint64_t c = cand[i];
    if ((c & mask) >= prefix) {
      const int p = atomicAdd(&counter, 1);
      if (p < keep) out[p] = c;
    }
  }
  __syncthreads();
  // A short chunk pads with composite 0: below every real composite, token 0xFFFFFFFF.
  for (int i = min(counter, keep) + tid; i < keep; i += PARTIAL_THREADS) out[i] = 0;
}

extern "C" __global__ void __launch_bounds__(MERGE_THREADS) ddtree_build_merge(
    const uint64_t* __restrict__ part_keys,   // [rows, num_chunks, keep]
    const float* __restrict__ part_stats,     // [rows, num_chunks, 3]
    int32_t num_chunks, int32_t keep, int32_t top_k, int32_t sort_size, int32_t vocab,
    float* __restrict__ topk_lp,              // [rows, top_k]
    int32_t* __restrict__ topk_tok,           // [rows, top_k]
    int32_t* __restrict__ topk_count) {       // [rows]
  extern __shared__ uint64_t smem[];  // [num_chunks * keep] candidates, then [sort_size] sorted
  __shared__ uint32_t hist[256];
  __shared__ uint64_t state[4];
  __shared__ float scratch[32];
  __shared__ int counter;
  __shared__ float row_max, row_log_sum, row_inf;
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x;
  const int n = num_chunks * keep;
  uint64_t* cand = smem;
  uint64_t* sorted = smem + n;
  const uint64_t* src = part_keys + row * (int64_t)n;
  for (int i = tid; i < n; i += MERGE_THREADS) cand[i] = src[i];
  if (tid == 0) {
    const float* st = part_stats + row * num_chunks * 3;
    float m = -DDTREE_INF, inf = 0.0f;
    for (int c = 0; c < num_chunks; ++c) {
      m = fmaxf(m, st[3 * c]);
      inf += st[3 * c + 2];
    }
    float s = 0.0f;
    if (m > -DDTREE_INF) {
      for (int c = 0; c < num_chunks; ++c) {
        if (st[3 * c] > -DDTREE_INF) s += st[3 * c + 1] * expf(st[3 * c] - m);
      }
    }
    row_max = m;
    row_log_sum = logf(s);
    row_inf = inf;
    counter = 0;
  }
  for (int i = tid; i < sort_size; i += MERGE_THREADS) sorted[i] = 0;
  __syncthreads();
  uint64_t prefix, mask;
  ddtree_radix_select(cand, n, top_k, hist, state, &prefix, &mask);
  for (int i = tid; i < n; i += MERGE_THREADS) {
    const uint64_t v = cand[i];
    if ((v & mask) >= prefix) {
      const int pos = atomicAdd(&counter, 1);
      if (pos < sort_size) sorted[pos] = v;
    }
  }
  __syncthreads();
  // Bitonic sort, descending.
  for (int size = 2; size <= sort_size; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = tid; i < sort_size; i += MERGE_THREADS) {
        const int j = i ^ stride;
        if (j > i) {
          const uint64_t a = sorted[i], c = sorted[j];
          const bool descending = (i & size) == 0;
          if (descending ? (a < c) : (a > c)) {
            sorted[i] = c;
            sorted[j] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  const float inf = row_inf, m = row_max, log_sum = row_log_sum;
  int valid = 0;
  for (int r = tid; r < top_k; r += MERGE_THREADS) {
    const uint64_t c = sorted[r];
    const float x = ddtree_composite_value(c);
    const uint32_t token = ddtree_composite_token(c);
    float lp = -DDTREE_INF;
    if (token < (uint32_t)vocab) {
      if (inf > 0.0f) {
        if (x == DDTREE_INF) lp = -logf(inf);
      } else if (x > -DDTREE_INF) {
        lp = (x - m) - log_sum;
      }
    }
    topk_lp[row * top_k + r] = lp;
    topk_tok[row * top_k + r] = (int32_t)token;
    valid += lp > -DDTREE_INF ? 1 : 0;
  }
  const float total = ddtree_block_reduce_sum((float)valid, scratch);
  if (tid == 0) topk_count[row] = (int32_t)total;
}

// Lexicographic comparison of the rank tuples of two candidates (parent node, rank, depth):
// true when candidate 1's tuple is smaller. Popped nodes' parents and ranks are in shared memory.
__device__ bool ddtree_lex_less(int p1, int r1, int d1, int p2, int r2, int d2,
                                const int16_t* parent, const int16_t* rank) {
  const int depth1 = d1, depth2 = d2;
  while (d1 > d2) {
    r1 = rank[p1];
    p1 = parent[p1];
    --d1;
  }
  while (d2 > d1) {
    r2 = rank[p2];
    p2 = parent[p2];
    --d2;
  }
  if (p1 == p2 && r1 == r2) return depth1 < depth2;  // one is a prefix of the other
  while (p1 != p2) {
    r1 = rank[p1];
    p1 = parent[p1];
    r2 = rank[p2];
    p2 = parent[p2];
  }
  return r1 < r2;
}

struct DdtreeCand {
  float score;
  int parent, rank, depth;
};

#define DDTREE_MAX_NODES 1025

extern "C" __global__ void ddtree_build_select(
    const float* __restrict__ topk_lp,      // [batch, draft_len, top_k]
    const int32_t* __restrict__ topk_tok,   // [batch, draft_len, top_k]
    const int32_t* __restrict__ topk_count, // [batch, draft_len]
    const int64_t* __restrict__ root_tokens,  // [batch]
    const int32_t* __restrict__ budgets,      // [batch]
    int32_t* __restrict__ error_flags,        // [batch]
    int64_t* __restrict__ tokens,     // [batch, num_nodes_max]
    int32_t* __restrict__ parents,    // [batch, num_nodes_max]
    int32_t* __restrict__ depths,     // [batch, num_nodes_max]
    float* __restrict__ log_probs,    // [batch, num_nodes_max]
    int32_t* __restrict__ num_nodes,  // [batch]
    int64_t* __restrict__ mask,       // [batch, num_nodes_max, words]
    int32_t vocab, int32_t draft_len, int32_t top_k, int32_t num_nodes_max, int32_t words,
    int32_t lp_in_smem) {
  extern __shared__ float lp_table[];  // [draft_len, top_k] when lp_in_smem
  __shared__ int16_t node_parent[DDTREE_MAX_NODES];
  __shared__ int16_t node_rank[DDTREE_MAX_NODES];
  __shared__ int8_t node_depth[DDTREE_MAX_NODES];
  __shared__ float node_score[DDTREE_MAX_NODES];
  __shared__ int counts[32];
  __shared__ int16_t slot_parent[1024];
  __shared__ int16_t slot_rank[1024];
  __shared__ int8_t slot_depth[1024];
  __shared__ DdtreeCand red[2][32];
  __shared__ int red_slot[2][32];
  __shared__ int skip;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  const int64_t b = blockIdx.x;
  const float* lp_global = topk_lp + b * draft_len * (int64_t)top_k;
  const float* lp = lp_in_smem ? lp_table : lp_global;
  if (lp_in_smem) {
    for (int i = tid; i < draft_len * top_k; i += blockDim.x) lp_table[i] = lp_global[i];
  }
  for (int i = tid; i < draft_len; i += blockDim.x) counts[i] = topk_count[b * draft_len + i];
  const int64_t root = root_tokens[b];
  if (tid == 0) {
    int flags = error_flags[b];
    if (root < 0 || root >= vocab) {
      flags |= DDTREE_ERR_TOKEN;
      atomicOr(&error_flags[b], DDTREE_ERR_TOKEN);
    }
    skip = flags;
    node_parent[0] = -1;
    node_rank[0] = 0;
    node_depth[0] = 0;
    node_score[0] = 0.0f;
  }
  __syncthreads();
  const int budget = skip ? 0 : min(max(budgets[b], 0), num_nodes_max - 1);

  // Frontier slot `tid`: its candidate lives in registers and, for in-warp tie-breaks, in
  // shared memory (written only by its owner lane, read only by lanes of the same warp).
  DdtreeCand mine = {-DDTREE_INF, 0, 0, 1};
  if (tid == 0 && counts[0] > 0) mine.score = lp[0];
  slot_parent[tid] = 0;
  slot_rank[tid] = 0;
  slot_depth[tid] = 1;
  __syncwarp();
  int size = 1;
  int popped = 0;
  while (popped < budget) {
    // In-warp argmax over (score, slot); equal finite scores compare rank tuples.
    float best_score = mine.score;
    int best_slot = tid;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float os = __shfl_xor_sync(0xFFFFFFFFu, best_score, off);
      const int oslot = __shfl_xor_sync(0xFFFFFFFFu, best_slot, off);
      bool take = os > best_score;
      if (os == best_score) {
        take = os > -DDTREE_INF
                   ? ddtree_lex_less(slot_parent[oslot], slot_rank[oslot], slot_depth[oslot],
                                     slot_parent[best_slot], slot_rank[best_slot],
                                     slot_depth[best_slot], node_parent, node_rank)
                   : oslot < best_slot;
      }
      if (take) {
        best_score = os;
        best_slot = oslot;
      }
    }
    DdtreeCand best;
    if (warps > 1) {
      const int par = popped & 1;
      if (lane == 0) {
        red[par][warp] = {best_score, slot_parent[best_slot], slot_rank[best_slot],
                          slot_depth[best_slot]};
        red_slot[par][warp] = best_slot;
      }
      __syncthreads();
      // Across warps: lane w holds warp w's winner; the same shuffle argmax over warp ids.
      int w_best = lane < warps ? lane : 0;
      float s_best = lane < warps ? red[par][lane].score : -DDTREE_INF;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const float os = __shfl_xor_sync(0xFFFFFFFFu, s_best, off);
        const int ow = __shfl_xor_sync(0xFFFFFFFFu, w_best, off);
        bool take = os > s_best;
        if (os == s_best) {
          const DdtreeCand& a = red[par][ow];
          const DdtreeCand& c = red[par][w_best];
          take = os > -DDTREE_INF ? ddtree_lex_less(a.parent, a.rank, a.depth, c.parent, c.rank,
                                                    c.depth, node_parent, node_rank)
                                  : ow < w_best;
        }
        if (take) {
          s_best = os;
          w_best = ow;
        }
      }
      best = red[par][w_best];
      best_slot = red_slot[par][w_best];
    } else {
      best = {best_score, slot_parent[best_slot], slot_rank[best_slot], slot_depth[best_slot]};
    }
    if (best.score == -DDTREE_INF) break;  // uniform: every thread saw the same winner
    const int n = ++popped;
    // Every warp writes the (identical) node record itself so its own later reads see it.
    if (lane == 0) {
      node_parent[n] = (int16_t)best.parent;
      node_rank[n] = (int16_t)best.rank;
      node_depth[n] = (int8_t)best.depth;
      node_score[n] = best.score;
    }
    __syncwarp();
    if (popped == budget) break;
    const int d = best.depth;
    const bool has_child = d < draft_len && counts[d] > 0;
    const bool has_sibling = best.rank + 1 < counts[d - 1];
    const bool owns_popped = tid == best_slot;
    const bool owns_fresh = has_child && has_sibling && tid == size;
    if (owns_popped) {
      if (has_child) {
        mine = {best.score + lp[d * top_k], n, 0, d + 1};
      } else if (has_sibling) {
        mine = {node_score[best.parent] + lp[(d - 1) * top_k + best.rank + 1], best.parent,
                best.rank + 1, d};
      } else {
        mine.score = -DDTREE_INF;
      }
    }
    if (owns_fresh) {
      mine = {node_score[best.parent] + lp[(d - 1) * top_k + best.rank + 1], best.parent,
              best.rank + 1, d};
    }
    if (owns_popped || owns_fresh) {
      slot_parent[tid] = mine.parent;
      slot_rank[tid] = mine.rank;
      slot_depth[tid] = mine.depth;
    }
    __syncwarp();
    if (has_child && has_sibling) ++size;
  }
  __syncthreads();
  const int count = 1 + popped;
  const int64_t base = b * (int64_t)num_nodes_max;
  for (int i = tid; i < num_nodes_max; i += blockDim.x) {
    if (i == 0) {
      tokens[base] = root;
      parents[base] = -1;
      depths[base] = 0;
      log_probs[base] = 0.0f;
    } else if (i < count) {
      const int d = node_depth[i];
      tokens[base + i] = topk_tok[(b * draft_len + d - 1) * (int64_t)top_k + node_rank[i]];
      parents[base + i] = node_parent[i];
      depths[base + i] = d;
      log_probs[base + i] = node_score[i];
    } else {
      tokens[base + i] = -1;
      parents[base + i] = -1;
      depths[base + i] = -1;
      log_probs[base + i] = -DDTREE_INF;
    }
  }
  if (tid == 0) num_nodes[b] = count;
  // Ancestor-or-self bits: one thread per node row, walking to the root (at most 33 steps).
  for (int i = tid; i < num_nodes_max; i += blockDim.x) {
    int64_t* out = mask + (base + i) * words;
    uint64_t acc[(DDTREE_MAX_NODES + 63) / 64];
    for (int w = 0; w < words; ++w) acc[w] = 0;
    if (i < count) {
      for (int j = i; j >= 0; j = node_parent[j]) acc[j >> 6] |= 1ull << (j & 63);
    }
    for (int w = 0; w < words; ++w) out[w] = (int64_t)acc[w];
  }
}
