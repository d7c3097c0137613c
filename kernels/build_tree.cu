// build_tree: the DDTree draft tree on the GPU in two or three launches with no host round trip.
//
// Python reference: ddtree.kernels.reference.build_tree (contract: ddtree.kernels.build.build_tree).
// Rows are (request, depth) pairs, row = b * draft_len + (depth - 1). K = min(max_budget, V).
//
// 1. ddtree_build_topk  grid (num_chunks, rows), block TOPK_THREADS (512), dynamic shared memory
//    (cap + spare) * 8 bytes. Each block streams one span of one row of logits exactly once, in
//    tiles of TOPK_THREADS * LOADS 16-byte vectors (the next tile's loads are in flight while a
//    tile is processed). Per thread it keeps an online max and sum of exp(x - max) over finite x
//    and a count of +inf. Candidates are 64-bit composites order_key(x) << 32 | ~token (larger
//    composite = larger scaled logit x, equal x smaller token id). Only entries whose composite
//    is >= a running threshold enter the shared buffer `cand`: the threshold is first a lower
//    bound of the K-th largest entry of the first tile (the K-th largest of the threads' tile
//    maxima, when K <= TOPK_THREADS), then, after every compaction of the buffer to its `keep`
//    largest entries (radix select), the smallest kept composite. On random logits only
//    O(K log(V / K)) entries ever pass, so a tile costs one barrier. NaN and -inf entries are
//    never candidates (they are impossible tokens and do not change the count of possible ones).
//    With one chunk per row (num_chunks == 1) the block sorts its K survivors and writes the
//    row's outputs itself; otherwise it writes its statistics and `keep` composites for 2.
// 2. ddtree_build_merge  grid (rows), block MERGE_THREADS, dynamic shared memory
//    num_chunks * keep * 8 + sort_size * 8 bytes (only when num_chunks > 1). Combines the chunk
//    statistics into the row's log-sum-exp, selects the row's top-K composites, sorts them
//    (bitonic), and writes the sorted top-K tokens, their log-probabilities and the number of
//    possible ones.
// 3. ddtree_build_select  grid (batch_size), block SELECT_THREADS; warp 0 runs the best-first
//    selection of one request, then the whole block writes the nodes and ancestor masks. The
//    frontier (at most budget + 1 candidates) lives in shared memory, slot s owned by lane s % 32,
//    which keeps the best of its slots in registers. A pop is one warp max-reduction of the lanes'
//    best keys (order_key of the score). Exact score ties compare rank tuples lexicographically:
//    first a packed prefix of the tuple (rank + 1 of the first 64 / bits(top_k) depths in one
//    64-bit word, two more warp reductions), and only when those agree by walking parents. The
//    popped slot takes the node's first child and a fresh slot its next sibling; only the lanes
//    that own a changed slot rescan. Shared memory: the node and frontier tables, plus the
//    per-depth log-prob table when it fits.
//
// Rules shared with the reference: x = logits.float() / temperature (true division), NaN -> -inf,
// a row holding +inf gives its +inf tokens log-prob -log(count) and every other token -inf, an
// all -inf row has no possible token; scores are fp32 running sums in depth order.
// Caller data read here: root_tokens (checked: out of range -> ErrorFlag.TOKEN, root-only tree),
// budgets (clamped to [0, num_nodes_max - 1]), error_flags (non-zero on entry -> root-only tree).
#include "common.cuh"

#ifndef TOPK_THREADS
#define TOPK_THREADS 512
#endif
#ifndef LOADS
#define LOADS 2
#endif
#ifndef TOPK_MIN_BLOCKS
#define TOPK_MIN_BLOCKS 2
#endif
#ifndef SELECT_THREADS
#define SELECT_THREADS 128
#endif
#ifndef MERGE_THREADS
#define MERGE_THREADS 512
#endif

#define DDTREE_FULL 0xFFFFFFFFu
#define DDTREE_LOG2E 1.4426950408889634f
// Composite of the smallest finite value with the largest token id: below every possible entry.
#define DDTREE_FINITE_FLOOR (((uint64_t)0x00800000u) << 32)

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

// Shared-memory scratch of ddtree_radix_select.
struct DdtreeRadix {
  uint32_t hist[256];
  uint64_t prefix, mask, remaining, done, all_and, all_or;
};

// Radix select over n composites in shared memory: afterwards the k largest are among those with
// (c & *mask) >= *prefix, exactly those when the composites are distinct (all of them when
// k >= n). Digits in which every composite agrees are skipped. Every thread of the block must
// call it.
__device__ void ddtree_radix_select(const uint64_t* vals, int n, int k, DdtreeRadix* rs,
                                    uint64_t* prefix_out, uint64_t* mask_out) {
  const int tid = threadIdx.x;
  if (k >= n) {
    *prefix_out = 0;
    *mask_out = 0;
    return;
  }
  if (tid == 0) {
    rs->prefix = 0;
    rs->mask = 0;
    rs->remaining = (uint64_t)k;
    rs->done = 0;
    rs->all_and = ~0ull;
    rs->all_or = 0;
  }
  __syncthreads();
  uint64_t all_and = ~0ull, all_or = 0;
  for (int i = tid; i < n; i += blockDim.x) {
    all_and &= vals[i];
    all_or |= vals[i];
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    all_and &= __shfl_xor_sync(0xFFFFFFFFu, all_and, off);
    all_or |= __shfl_xor_sync(0xFFFFFFFFu, all_or, off);
  }
  if ((tid & 31) == 0) {
    atomicAnd(reinterpret_cast<unsigned long long*>(&rs->all_and), all_and);
    atomicOr(reinterpret_cast<unsigned long long*>(&rs->all_or), all_or);
  }
  __syncthreads();
  const uint64_t varying = rs->all_and ^ rs->all_or;
  for (int shift = 56; shift >= 0; shift -= 8) {
    if (((varying >> shift) & 0xFFull) == 0) continue;  // block-uniform
    for (int i = tid; i < 256; i += blockDim.x) rs->hist[i] = 0;
    __syncthreads();
    const uint64_t prefix = rs->prefix;
    const uint64_t mask = rs->mask;
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
      if (bin < 256u && (tid & 31) == __ffs(peers) - 1) atomicAdd(&rs->hist[bin], __popc(peers));
    }
    __syncthreads();
    if (tid < 32) {
      const uint32_t rem = (uint32_t)rs->remaining;
      // Lane l covers bins 255 - 8l down to 248 - 8l (largest digits first).
      uint32_t local = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) local += rs->hist[255 - 8 * tid - j];
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
          const uint32_t c = rs->hist[bin];
          if (cum + c >= rem) {
            const uint32_t new_rem = rem - cum;
            rs->prefix = prefix | ((uint64_t)bin << shift);
            rs->mask = mask | ((uint64_t)0xFF << shift);
            rs->remaining = new_rem;
            rs->done = (c == new_rem) ? 1 : 0;
            break;
          }
          cum += c;
        }
      }
    }
    __syncthreads();
    if (rs->done) break;
  }
  *prefix_out = rs->prefix;
  *mask_out = rs->mask;
  __syncthreads();  // rs is reused by the caller's next select
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

// Sorts sorted[0, size) descending (size a power of two). Every thread of the block must call it.
__device__ void ddtree_bitonic_desc(uint64_t* sorted, int size) {
  for (int width = 2; width <= size; width <<= 1) {
    for (int stride = width >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < size; i += blockDim.x) {
        const int j = i ^ stride;
        if (j > i) {
          const uint64_t a = sorted[i], c = sorted[j];
          const bool descending = (i & width) == 0;
          if (descending ? (a < c) : (a > c)) {
            sorted[i] = c;
            sorted[j] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

// Writes a row's outputs from its composites sorted descending (pads are composite 0): the
// top_k tokens, their log-probabilities under the row statistics (max finite x, log of the sum
// of exp(x - max), count of +inf) and the number of possible ones.
__device__ void ddtree_write_row(const uint64_t* sorted, int64_t row, int top_k, int vocab,
                                 float m, float log_sum, float inf, float* scratch,
                                 float* __restrict__ topk_lp, int32_t* __restrict__ topk_tok,
                                 int32_t* __restrict__ topk_count) {
  int valid = 0;
  for (int r = threadIdx.x; r < top_k; r += blockDim.x) {
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
  if (threadIdx.x == 0) topk_count[row] = (int32_t)total;
}

// Shared state of ddtree_build_topk besides the candidate buffer.
struct DdtreeTopkShared {
  DdtreeRadix radix;
  uint64_t threshold;  // entries with a smaller composite can no longer be in the top `keep`
  uint64_t kept_min;
  int count;           // entries in cand
  int moved;
  float scratch[32];
};

// Keeps the `keep` largest of the n composites in cand (n > keep) and raises the threshold to
// the smallest of them. Every thread of the block must call it.
__device__ void ddtree_compact(uint64_t* cand, uint64_t* spare, int n, int keep,
                               DdtreeTopkShared* sh) {
  uint64_t prefix, mask;
  ddtree_radix_select(cand, n, keep, &sh->radix, &prefix, &mask);
  if (threadIdx.x == 0) {
    sh->moved = 0;
    sh->kept_min = ~0ull;
  }
  __syncthreads();
  uint64_t low = ~0ull;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const uint64_t c = cand[i];
    if ((c & mask) >= prefix) {
      const int p = atomicAdd(&sh->moved, 1);
      if (p < keep) spare[p] = c;
      low = c < low ? c : low;
    }
  }
  if (low != ~0ull) atomicMin(reinterpret_cast<unsigned long long*>(&sh->kept_min), low);
  __syncthreads();
  const int kept = min(sh->moved, keep);
  for (int i = threadIdx.x; i < kept; i += blockDim.x) cand[i] = spare[i];
  if (threadIdx.x == 0) {
    sh->count = kept;
    if (sh->kept_min > sh->threshold) sh->threshold = sh->kept_min;
  }
  __syncthreads();
}

constexpr int DDTREE_VEC = 16 / sizeof(ddtree_logit_t);
constexpr int DDTREE_TILE_ELEMS = LOADS * DDTREE_VEC;  // entries per thread per tile
constexpr int DDTREE_TILE = TOPK_THREADS * DDTREE_TILE_ELEMS;

// Raw 16-byte vectors of one tile: vector j of thread t covers tile entries
// (t + j * TOPK_THREADS) * VEC .. + VEC - 1 (consecutive threads read consecutive vectors).
struct DdtreeTile {
  uint4 v[LOADS];
};

__device__ __forceinline__ void ddtree_load_tile(DdtreeTile& t, const ddtree_logit_t* src,
                                                 int start, int end, bool vectorized) {
#pragma unroll
  for (int j = 0; j < LOADS; ++j) {
    const int first = start + (threadIdx.x + j * TOPK_THREADS) * DDTREE_VEC;
    if (vectorized && first + DDTREE_VEC <= end) {
      t.v[j] = __ldg(reinterpret_cast<const uint4*>(src + first));
    } else {
      ddtree_logit_t* e = reinterpret_cast<ddtree_logit_t*>(&t.v[j]);
#pragma unroll
      for (int k = 0; k < DDTREE_VEC; ++k) {
        // Past the end: NaN, which is never a candidate and adds nothing to the statistics.
        e[k] = first + k < end ? src[first + k] : ddtree_logit_t(__int_as_float(0x7FC00000));
      }
    }
  }
}

__device__ __forceinline__ uint32_t ddtree_tile_token(int start, int i) {
  return (uint32_t)(start + (threadIdx.x + (i / DDTREE_VEC) * TOPK_THREADS) * DDTREE_VEC +
                    (i % DDTREE_VEC));
}

// Streams one span of one row; see the file comment (launch 1). UNIT: temperature == 1.
template <bool UNIT>
__device__ void ddtree_topk_body(const ddtree_logit_t* __restrict__ src, float temperature,
                                 int begin, int end, int keep, int cap, bool vectorized,
                                 uint64_t* cand, uint64_t* spare, DdtreeTopkShared* sh,
                                 float& m, float& s, float& infs) {
  const int tid = threadIdx.x, lane = tid & 31;
  DdtreeTile next;
  if (begin < end) ddtree_load_tile(next, src, begin, end, vectorized);
  for (int start = begin; start < end; start += DDTREE_TILE) {
    float x[DDTREE_TILE_ELEMS];
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      const ddtree_logit_t* e = reinterpret_cast<const ddtree_logit_t*>(&next.v[j]);
#pragma unroll
      for (int k = 0; k < DDTREE_VEC; ++k) {
        const float f = ddtree_to_float(e[k]);
        x[j * DDTREE_VEC + k] = UNIT ? f : f / temperature;
      }
    }
    if (start + DDTREE_TILE < end) ddtree_load_tile(next, src, start + DDTREE_TILE, end, vectorized);

    // Statistics. fmaxf ignores NaN, so tmax is the largest non-NaN entry.
    float tmax = -DDTREE_INF;
#pragma unroll
    for (int i = 0; i < DDTREE_TILE_ELEMS; ++i) tmax = fmaxf(tmax, x[i]);
    bool careful = tmax == DDTREE_INF;
    if (!careful && tmax > -DDTREE_INF) {
      if (tmax > m) {
        s *= exp2f((m - tmax) * DDTREE_LOG2E);
        m = tmax;
      }
      const float mb = m * DDTREE_LOG2E;
      float ts = 0.0f;
#pragma unroll
      for (int i = 0; i < DDTREE_TILE_ELEMS; ++i) ts += exp2f(fmaf(x[i], DDTREE_LOG2E, -mb));
      if (isnan(ts)) careful = true;  // a NaN entry
      else s += ts;
    }
    if (careful) {
      float fmax = -DDTREE_INF;
#pragma unroll
      for (int i = 0; i < DDTREE_TILE_ELEMS; ++i) {
        const float v = x[i];
        if (v == DDTREE_INF) infs += 1.0f;
        else if (v > -DDTREE_INF) fmax = fmaxf(fmax, v);
      }
      if (fmax > m) {
        s *= exp2f((m - fmax) * DDTREE_LOG2E);
        m = fmax;
      }
      if (m > -DDTREE_INF) {
        const float mb = m * DDTREE_LOG2E;
#pragma unroll
        for (int i = 0; i < DDTREE_TILE_ELEMS; ++i) {
          const float v = x[i];
          if (v > -DDTREE_INF && v < DDTREE_INF) s += exp2f(fmaf(v, DDTREE_LOG2E, -mb));
        }
      }
    }

    if (start == begin && keep <= TOPK_THREADS && keep < end - begin) {
      // First tile: the keep-th largest of the threads' maxima bounds the keep-th largest entry
      // from below (at least keep entries reach it).
      uint64_t best = 0;
#pragma unroll
      for (int i = 0; i < DDTREE_TILE_ELEMS; ++i) {
        if (x[i] > -DDTREE_INF) {
          const uint64_t c = ddtree_composite(x[i], ddtree_tile_token(start, i));
          best = c > best ? c : best;
        }
      }
      spare[tid] = best;
      __syncthreads();
      uint64_t prefix, mask;
      ddtree_radix_select(spare, TOPK_THREADS, keep, &sh->radix, &prefix, &mask);
      if (tid == 0 && prefix > sh->threshold) sh->threshold = prefix;
      __syncthreads();
    }

    // Candidates: composites at or above the threshold.
    const uint64_t threshold = sh->threshold;
    int mine = 0;
    if (tmax > -DDTREE_INF && ddtree_order_key(tmax + 0.0f) >= (uint32_t)(threshold >> 32)) {
#pragma unroll
      for (int i = 0; i < DDTREE_TILE_ELEMS; ++i) {
        if (x[i] > -DDTREE_INF && ddtree_composite(x[i], ddtree_tile_token(start, i)) >= threshold)
          ++mine;
      }
    }
    if (__any_sync(0xFFFFFFFFu, mine > 0)) {
      int incl = mine;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int o = __shfl_up_sync(0xFFFFFFFFu, incl, off);
        if (lane >= off) incl += o;
      }
      int base = 0;
      if (lane == 31) base = atomicAdd(&sh->count, incl);
      base = __shfl_sync(0xFFFFFFFFu, base, 31);
      int pos = base + incl - mine;
      if (mine > 0) {
#pragma unroll
        for (int i = 0; i < DDTREE_TILE_ELEMS; ++i) {
          if (x[i] > -DDTREE_INF) {
            const uint64_t c = ddtree_composite(x[i], ddtree_tile_token(start, i));
            if (c >= threshold) cand[pos++] = c;
          }
        }
      }
    }
    if (__syncthreads_or(mine > 0)) {
      const int n = sh->count;
      __syncthreads();
      // After a compaction at most keep <= cap - TILE entries remain, so the next tile fits.
      if (n > cap - DDTREE_TILE) ddtree_compact(cand, spare, n, keep, sh);
    }
  }
}

extern "C" __global__ void __launch_bounds__(TOPK_THREADS, TOPK_MIN_BLOCKS) ddtree_build_topk(
    const ddtree_logit_t* __restrict__ logits,  // [rows, vocab]
    float temperature, int32_t vocab, int32_t span, int32_t num_chunks, int32_t keep,
    int32_t cap, int32_t vectorized,
    uint64_t* __restrict__ part_keys,  // [rows, num_chunks, keep] (num_chunks > 1)
    float* __restrict__ part_stats,    // [rows, num_chunks, 3]: max, sum exp(x - max), +inf count
    int32_t top_k, int32_t sort_size,
    float* __restrict__ topk_lp,       // [rows, top_k] (num_chunks == 1)
    int32_t* __restrict__ topk_tok,    // [rows, top_k] (num_chunks == 1)
    int32_t* __restrict__ topk_count) {  // [rows] (num_chunks == 1)
  // Shared memory: cap candidates, then max(keep, sort_size, TOPK_THREADS) spare slots.
  extern __shared__ uint64_t smem[];
  uint64_t* cand = smem;
  uint64_t* spare = smem + cap;
  __shared__ DdtreeTopkShared sh;
  const int tid = threadIdx.x;
  const int chunk = blockIdx.x;
  const int64_t row = blockIdx.y;
  const int begin = chunk * span;
  const int end = min(vocab, begin + span);
  const ddtree_logit_t* src = logits + row * (int64_t)vocab;
  if (tid == 0) {
    sh.count = 0;
    sh.threshold = DDTREE_FINITE_FLOOR;
  }
  __syncthreads();
  float m = -DDTREE_INF, s = 0.0f, infs = 0.0f;
  if (temperature == 1.0f) {
    ddtree_topk_body<true>(src, temperature, begin, end, keep, cap, vectorized != 0, cand, spare,
                           &sh, m, s, infs);
  } else {
    ddtree_topk_body<false>(src, temperature, begin, end, keep, cap, vectorized != 0, cand,
                            spare, &sh, m, s, infs);
  }
  __syncthreads();
  if (sh.count > keep) ddtree_compact(cand, spare, sh.count, keep, &sh);
  const int n = min(sh.count, keep);
  const float row_max = ddtree_block_reduce_max(m, sh.scratch);
  const float scaled = m > -DDTREE_INF ? s * expf(m - row_max) : 0.0f;
  const float sum = ddtree_block_reduce_sum(scaled, sh.scratch);
  const float inf_count = ddtree_block_reduce_sum(infs, sh.scratch);
  if (num_chunks == 1) {
    for (int i = tid; i < sort_size; i += blockDim.x) spare[i] = i < n ? cand[i] : 0;
    __syncthreads();
    ddtree_bitonic_desc(spare, sort_size);
    ddtree_write_row(spare, row, top_k, vocab, row_max, logf(sum), inf_count, sh.scratch,
                     topk_lp, topk_tok, topk_count);
    return;
  }
  if (tid == 0) {
    float* stats = part_stats + (row * num_chunks + chunk) * 3;
    stats[0] = row_max;
    stats[1] = sum;
    stats[2] = inf_count;
  }
  // A chunk with fewer entries pads with composite 0: below every real composite, token
  // 0xFFFFFFFF.
  uint64_t* out = part_keys + (row * num_chunks + chunk) * (int64_t)keep;
  for (int i = tid; i < keep; i += blockDim.x) out[i] = i < n ? cand[i] : 0;
}

extern "C" __global__ void __launch_bounds__(MERGE_THREADS) ddtree_build_merge(
    const uint64_t* __restrict__ part_keys,   // [rows, num_chunks, keep]
    const float* __restrict__ part_stats,     // [rows, num_chunks, 3]
    int32_t num_chunks, int32_t keep, int32_t top_k, int32_t sort_size, int32_t vocab,
    float* __restrict__ topk_lp,              // [rows, top_k]
    int32_t* __restrict__ topk_tok,           // [rows, top_k]
    int32_t* __restrict__ topk_count) {       // [rows]
  extern __shared__ uint64_t smem[];  // [num_chunks * keep] candidates, then [sort_size] sorted
  __shared__ DdtreeRadix radix;
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
  ddtree_radix_select(cand, n, top_k, &radix, &prefix, &mask);
  for (int i = tid; i < n; i += MERGE_THREADS) {
    const uint64_t v = cand[i];
    if ((v & mask) >= prefix) {
      const int pos = atomicAdd(&counter, 1);
      if (pos < sort_size) sorted[pos] = v;
    }
  }
  __syncthreads();
  ddtree_bitonic_desc(sorted, sort_size);
  ddtree_write_row(sorted, row, top_k, vocab, row_max, row_log_sum, row_inf, scratch, topk_lp,
                   topk_tok, topk_count);
}

#define DDTREE_MAX_NODES 1025
// order_key(-inf): a frontier whose best key is at or below this has nothing left to pop.
#define DDTREE_NEG_INF_KEY 0x007FFFFFu

// Lexicographic comparison of the rank tuples of two candidates (parent node, rank, depth) by
// walking popped nodes' parents: true when candidate 1's tuple is smaller.
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

// A frontier candidate: parent node (11 bits), rank (10 bits), depth (6 bits).
__device__ __forceinline__ uint32_t ddtree_pack_slot(int parent, int rank, int depth) {
  return (uint32_t)parent | ((uint32_t)rank << 11) | ((uint32_t)depth << 21);
}

__device__ __forceinline__ bool ddtree_slot_lex_less(uint32_t a, uint32_t b, const int16_t* parent,
                                                     const int16_t* rank) {
  return ddtree_lex_less(a & 2047, (a >> 11) & 1023, a >> 21, b & 2047, (b >> 11) & 1023, b >> 21,
                         parent, rank);
}

// Packed rank-tuple prefix: depth d's rank + 1 in `bits` bits at shift 64 - bits * d, for the
// depths that fit (64 / bits of them); 0 beyond a node's depth. Equal packed prefixes compare
// their full tuples by walking parents.
__device__ __forceinline__ uint64_t ddtree_lex_extend(uint64_t parent_lex, int rank, int depth,
                                                      int bits) {
  const int shift = 64 - bits * depth;
  return shift >= 0 ? parent_lex | ((uint64_t)(rank + 1) << shift) : parent_lex;
}

// Candidate order: larger score key first, then the smaller rank tuple.
__device__ __forceinline__ bool ddtree_cand_better(uint32_t ka, uint64_t la, uint32_t ia,
                                                   uint32_t kb, uint64_t lb, uint32_t ib,
                                                   const int16_t* parent, const int16_t* rank) {
  if (ka != kb) return ka > kb;
  if (la != lb) return la < lb;
  return ddtree_slot_lex_less(ia, ib, parent, rank);
}

extern "C" __global__ void __launch_bounds__(SELECT_THREADS) ddtree_build_select(
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
  __shared__ uint64_t node_lex[DDTREE_MAX_NODES];
  __shared__ uint32_t slot_key[DDTREE_MAX_NODES];
  __shared__ uint32_t slot_info[DDTREE_MAX_NODES];
  __shared__ uint64_t slot_lex[DDTREE_MAX_NODES];
  __shared__ int counts[32];
  __shared__ int skip, total;
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t b = blockIdx.x;
  const int bits = 32 - __clz(top_k);  // rank + 1 <= top_k
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
    node_lex[0] = 0;
  }
  __syncthreads();
  const int budget = skip ? 0 : min(max(budgets[b], 0), num_nodes_max - 1);

  if (tid < 32) {
    // Slot 0: the best depth-1 token. Lane l owns slots l, l + 32, ...; (best_key, best_lex,
    // best_slot) is the best of its slots (key 0: none).
    uint32_t best_key = 0;
    uint64_t best_lex = 0;
    int best_slot = -1;
    if (lane == 0) {
      slot_key[0] = counts[0] > 0 ? ddtree_order_key(lp[0] + 0.0f) : 0u;
      slot_info[0] = ddtree_pack_slot(0, 0, 1);
      slot_lex[0] = ddtree_lex_extend(0, 0, 1, bits);
      best_key = slot_key[0];
      best_lex = slot_lex[0];
      best_slot = 0;
    }
    __syncwarp();
    int size = 1, popped = 0;
    while (popped < budget) {
      const uint32_t top = __reduce_max_sync(DDTREE_FULL, best_key);
      if (top <= DDTREE_NEG_INF_KEY) break;  // nothing left, or only impossible nodes
      bool in = best_key == top;
      uint32_t tied = __ballot_sync(DDTREE_FULL, in);
      if ((tied & (tied - 1)) != 0) {
        // Equal scores: the smallest packed tuple prefix (high word, then low word) ...
        // (every lane takes part in each reduction: no short-circuit around them).
        const uint32_t hi = in ? (uint32_t)(best_lex >> 32) : ~0u;
        const uint32_t min_hi = __reduce_min_sync(DDTREE_FULL, hi);
        in = in && hi == min_hi;
        const uint32_t lo = in ? (uint32_t)best_lex : ~0u;
        const uint32_t min_lo = __reduce_min_sync(DDTREE_FULL, lo);
        in = in && lo == min_lo;
        tied = __ballot_sync(DDTREE_FULL, in);
      }
      int win = __shfl_sync(DDTREE_FULL, best_slot, __ffs(tied) - 1);
      if ((tied & (tied - 1)) != 0) {
        // ... and equal prefixes (tuples deeper than the packed depths): walk the parents.
        for (uint32_t rest = tied & (tied - 1); rest != 0; rest &= rest - 1) {
          const int other = __shfl_sync(DDTREE_FULL, best_slot, __ffs(rest) - 1);
          if (ddtree_slot_lex_less(slot_info[other], slot_info[win], node_parent, node_rank)) {
            win = other;
          }
        }
      }
      const uint32_t info = slot_info[win];
      const uint64_t lex = slot_lex[win];
      const float score = ddtree_key_to_float(top);
      const int parent = info & 2047, rank = (info >> 11) & 1023, depth = info >> 21;
      const int n = ++popped;
      if (lane == 0) {
        node_parent[n] = (int16_t)parent;
        node_rank[n] = (int16_t)rank;
        node_depth[n] = (int8_t)depth;
        node_score[n] = score;
        node_lex[n] = lex;
      }
      __syncwarp();
      if (popped == budget) break;
      const bool has_child = depth < draft_len && counts[depth] > 0;
      const bool has_sibling = rank + 1 < counts[depth - 1];
      const uint32_t sibling_key =
          has_sibling ? ddtree_order_key(node_score[parent] + lp[(depth - 1) * top_k + rank + 1] +
                                         0.0f)
                      : 0u;
      const uint32_t sibling_info = ddtree_pack_slot(parent, rank + 1, depth);
      const uint64_t sibling_lex = ddtree_lex_extend(node_lex[parent], rank + 1, depth, bits);
      // The popped slot takes the first child, else the next sibling; a fresh slot takes the
      // sibling when there are both.
      const int owner = win & 31;
      if (lane == owner) {
        if (has_child) {
          slot_key[win] = ddtree_order_key(score + lp[depth * top_k] + 0.0f);
          slot_info[win] = ddtree_pack_slot(n, 0, depth + 1);
          slot_lex[win] = ddtree_lex_extend(lex, 0, depth + 1, bits);
        } else {
          slot_key[win] = sibling_key;
          slot_info[win] = sibling_info;
          slot_lex[win] = sibling_lex;
        }
      }
      int fresh = -1;
      if (has_child && has_sibling) {
        fresh = size++;
        if (lane == (fresh & 31)) {
          slot_key[fresh] = sibling_key;
          slot_info[fresh] = sibling_info;
          slot_lex[fresh] = sibling_lex;
        }
      }
      __syncwarp();
      if (lane == owner) {
        best_key = 0;
        best_slot = -1;
        for (int sl = lane; sl < size; sl += 32) {
          const uint32_t k = slot_key[sl];
          if (k == 0u) continue;
          const uint64_t l = slot_lex[sl];
          if (best_slot < 0 || ddtree_cand_better(k, l, slot_info[sl], best_key, best_lex,
                                                  slot_info[best_slot], node_parent, node_rank)) {
            best_key = k;
            best_lex = l;
            best_slot = sl;
          }
        }
      } else if (fresh >= 0 && lane == (fresh & 31) && sibling_key != 0u) {
        if (best_slot < 0 || ddtree_cand_better(sibling_key, sibling_lex, sibling_info, best_key,
                                                best_lex, slot_info[best_slot], node_parent,
                                                node_rank)) {
          best_key = sibling_key;
          best_lex = sibling_lex;
          best_slot = fresh;
        }
      }
    }
    if (lane == 0) total = 1 + popped;
  }
  __syncthreads();
  const int count = total;
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
