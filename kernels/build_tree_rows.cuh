// build_tree's row machinery, shared by the top-k (launch 1) and the merge (launch 2): 64-bit
// candidate composites, warp and block reductions, the radix select, the bitonic sort and the
// ranking that order a row's candidates, a row's statistics from its parts, and the writing of a
// row's sorted tokens and log-probs. Part of build_tree.cu (its macros come first); see that
// file's comment for the design.
#pragma once

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

__device__ __forceinline__ uint32_t ddtree_lanes_below() {
  return (1u << (threadIdx.x & 31)) - 1u;
}

// The warp's largest v / sum of v, in every lane (an xor-shuffle tree: the same bits in every
// caller for the same lane values). One whole warp calls them.
__device__ __forceinline__ float ddtree_warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(DDTREE_FULL, v, off));
  return v;
}

__device__ __forceinline__ float ddtree_warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(DDTREE_FULL, v, off);
  return v;
}

// Inclusive scan of v over the warp's lanes by the associative `op` (lane l gets lanes 0..l's
// values combined), by shuffles up. One whole warp calls it.
template <typename T, typename Op>
__device__ __forceinline__ T ddtree_warp_inclusive_scan(T v, Op op) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const T o = __shfl_up_sync(DDTREE_FULL, v, off);
    if (lane >= off) v = op(v, o);
  }
  return v;
}

// Inclusive prefix sum of v over the warp's lanes. One whole warp calls it.
template <typename T>
__device__ __forceinline__ T ddtree_warp_inclusive_sum(T v) {
  return ddtree_warp_inclusive_scan(v, [](T a, T b) { return a + b; });
}

// Combines the lanes' statistics (max m, sum s of exp(x - m), +inf count) into the warp's, in
// every lane: the largest max, the sums rescaled to it and added, the +inf count.
__device__ __forceinline__ void ddtree_warp_stats(float& m, float& s, float& infs) {
  const float top = ddtree_warp_max(m);
  s = ddtree_warp_sum(m > -DDTREE_INF ? s * expf(m - top) : 0.0f);
  infs = ddtree_warp_sum(infs);
  m = top;
}

// The block's reduction of v by `warp_reduce` (a warp max or sum; `identity` stands for the
// lanes past the block's warps), in every thread. Every thread of the block calls it.
template <typename WarpReduce>
__device__ __forceinline__ float ddtree_block_reduce(float v, float* scratch,
                                                     WarpReduce warp_reduce, float identity) {
  v = warp_reduce(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_reduce(lane < warps ? scratch[lane] : identity);
}

__device__ __forceinline__ float ddtree_block_reduce_max(float v, float* scratch) {
  return ddtree_block_reduce(v, scratch, [](float x) { return ddtree_warp_max(x); }, -DDTREE_INF);
}

__device__ __forceinline__ float ddtree_block_reduce_sum(float v, float* scratch) {
  return ddtree_block_reduce(v, scratch, [](float x) { return ddtree_warp_sum(x); }, 0.0f);
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

// Places each of the n distinct composites cand[0, n) whose rank (the number of larger ones) is
// below k at sorted[rank]: the k largest in descending order, with no barrier inside (a thread
// counts for its own candidates, all threads reading the same entry at a time). Every thread
// of the block must call it; the caller synchronises before sorted is read.
__device__ void ddtree_rank_desc(const uint64_t* cand, int n, int k, uint64_t* sorted) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const uint64_t c = cand[i];
    int rank = 0;
#pragma unroll 8
    for (int j = 0; j < n; ++j) rank += cand[j] > c ? 1 : 0;
    if (rank < k) sorted[rank] = c;
  }
}

// The log-probability of a composite c (a pad, composite 0, has token 0xFFFFFFFF) under the row
// statistics (max finite x, log of the sum of exp(x - max), count of +inf): -inf for a pad or an
// impossible token.
__device__ __forceinline__ float ddtree_composite_log_prob(uint64_t c, int vocab, float m,
                                                           float log_sum, float inf) {
  const float x = ddtree_composite_value(c);
  if (ddtree_composite_token(c) >= (uint32_t)vocab) return -DDTREE_INF;
  if (inf > 0.0f) return x == DDTREE_INF ? -logf(inf) : -DDTREE_INF;
  return x > -DDTREE_INF ? (x - m) - log_sum : -DDTREE_INF;
}

// Writes a row's outputs from its composites sorted descending (pads are composite 0): the
// top_k tokens, their log-probabilities under the row statistics (ddtree_composite_log_prob)
// and the number of possible ones.
__device__ void ddtree_write_row(const uint64_t* sorted, int64_t row, int top_k, int vocab,
                                 float m, float log_sum, float inf, float* scratch,
                                 float* __restrict__ topk_lp, int32_t* __restrict__ topk_tok,
                                 int32_t* __restrict__ topk_count) {
  int valid = 0;
  for (int r = threadIdx.x; r < top_k; r += blockDim.x) {
    const uint64_t c = sorted[r];
    const uint32_t token = ddtree_composite_token(c);
    const float lp = ddtree_composite_log_prob(c, vocab, m, log_sum, inf);
    topk_lp[row * top_k + r] = lp;
    topk_tok[row * top_k + r] = (int32_t)token;
    valid += lp > -DDTREE_INF ? 1 : 0;
  }
  // One entry a thread at most (valid 0 or 1): a counting barrier.
  const int total = top_k <= (int)blockDim.x
                        ? __syncthreads_count(valid)
                        : (int)ddtree_block_reduce_sum((float)valid, scratch);
  if (threadIdx.x == 0) topk_count[row] = total;
}


// The digit of a radix-select pass: the bin of a 256-bin histogram (largest digits first) that
// holds the `remaining`-th largest entry, the count of entries in larger bins and the bin's own.
struct ddtree_digit {
  uint32_t bin, before, count;
};

// One whole warp calls it; every lane gets the digit.
__device__ ddtree_digit ddtree_pick_digit(const uint32_t* hist, uint32_t remaining) {
  const int lane = threadIdx.x & 31;
  // Lane l covers bins 255 - 8l down to 248 - 8l (largest digits first).
  uint32_t local = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) local += hist[255 - 8 * lane - j];
  const uint32_t incl = ddtree_warp_inclusive_sum(local);
  const int owner = __ffs(__ballot_sync(DDTREE_FULL, incl >= remaining)) - 1;
  ddtree_digit found = {0u, 0u, 0u};
  if (lane == owner) {
    uint32_t before = incl - local;
    for (int j = 0; j < 8; ++j) {
      const uint32_t bin = 255u - 8u * lane - j;
      const uint32_t c = hist[bin];
      if (before + c >= remaining) {
        found = {bin, before, c};
        break;
      }
      before += c;
    }
  }
  found.bin = __shfl_sync(DDTREE_FULL, found.bin, owner);
  found.before = __shfl_sync(DDTREE_FULL, found.before, owner);
  found.count = __shfl_sync(DDTREE_FULL, found.count, owner);
  return found;
}

// Radix selection over the n distinct composites of cand[0, n) (n >= k >= 1) by one warp
// (BLOCK false) or a whole block (BLOCK true: every thread calls it): the largest t with at
// least k of them >= t, where t ranges over value keys only (exact false: t = key << 32, the
// value of the k-th largest) or over all composites (exact true: t is the k-th largest and
// exactly k are >= t). 8-bit digits from the top, skipping digits in which every composite
// agrees, stopping early when one bin holds exactly the entries still wanted. `hist` is 256
// shared counters (the warp's, or the block's); a block also needs `scratch` (shared), in which
// warp 0 publishes each digit: three block barriers a digit.
struct ddtree_select_scratch {
  unsigned long long all_and, all_or;
  ddtree_digit digit;
};

template <bool BLOCK>
__device__ uint64_t ddtree_radix_select(const uint64_t* cand, int n, int k, bool exact,
                                        uint32_t* hist, ddtree_select_scratch* scratch) {
  const int first = BLOCK ? threadIdx.x : threadIdx.x & 31;
  const int stride = BLOCK ? blockDim.x : 32;
  auto sync = [] {
    if constexpr (BLOCK) {
      __syncthreads();
    } else {
      __syncwarp();
    }
  };
  if constexpr (BLOCK) {
    if (threadIdx.x == 0) {
      scratch->all_and = ~0ull;
      scratch->all_or = 0ull;
    }
    __syncthreads();
  }
  unsigned long long all_and = ~0ull, all_or = 0;
  for (int i = first; i < n; i += stride) {
    all_and &= cand[i];
    all_or |= cand[i];
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    all_and &= __shfl_xor_sync(DDTREE_FULL, all_and, off);
    all_or |= __shfl_xor_sync(DDTREE_FULL, all_or, off);
  }
  if constexpr (BLOCK) {
    if ((threadIdx.x & 31) == 0) {
      atomicAnd(&scratch->all_and, all_and);
      atomicOr(&scratch->all_or, all_or);
    }
    __syncthreads();
    all_and = scratch->all_and;
    all_or = scratch->all_or;
  }
  const uint64_t varying = all_and ^ all_or;
  uint64_t prefix = 0, mask = 0;
  uint32_t remaining = (uint32_t)k;
  const int last = exact ? 0 : 32;
  for (int shift = 56; shift >= last; shift -= 8) {
    if (((varying >> shift) & 0xFFull) == 0) {
      // Every candidate still in play has this digit (all of them share it).
      prefix |= all_and & (0xFFull << shift);
      mask |= 0xFFull << shift;
      continue;
    }
    for (int i = first; i < 256; i += stride) hist[i] = 0;
    sync();
    for (int i = first; i < n; i += stride) {
      const uint64_t c = cand[i];
      if ((c & mask) == prefix) atomicAdd(&hist[(uint32_t)(c >> shift) & 255u], 1u);
    }
    sync();
    ddtree_digit found;
    if constexpr (BLOCK) {
      if (threadIdx.x < 32) {
        found = ddtree_pick_digit(hist, remaining);
        if (threadIdx.x == 0) scratch->digit = found;
      }
      __syncthreads();
      found = scratch->digit;  // rewritten two barriers later at the earliest
    } else {
      found = ddtree_pick_digit(hist, remaining);
      __syncwarp();  // hist is cleared by the next digit
    }
    prefix |= (uint64_t)found.bin << shift;
    mask |= 0xFFull << shift;
    remaining -= found.before;
    if (found.count == remaining) break;  // the whole bin is wanted: lower digits may be 0
  }
  return prefix & mask;
}

// ddtree_radix_select by one warp (every lane calls it).
__device__ uint64_t ddtree_warp_select(const uint64_t* cand, int n, int k, bool exact,
                                       uint32_t* hist) {
  return ddtree_radix_select<false>(cand, n, k, exact, hist, nullptr);
}

// Copies the entries of src[0, n) that are >= t to dst, in order, and returns how many. dst
// may be src (in place: writes go to positions <= the read ones). One whole warp calls it.
__device__ int ddtree_warp_filter(const uint64_t* src, int n, uint64_t t, uint64_t* dst) {
  const int lane = threadIdx.x & 31;
  int out = 0;
  for (int base = 0; base < n; base += 32) {
    const int i = base + lane;
    const uint64_t c = i < n ? src[i] : 0;
    const bool take = i < n && c >= t;
    const uint32_t ballot = __ballot_sync(DDTREE_FULL, take);
    __syncwarp();  // every lane has read its entry before any write
    if (take) dst[out + __popc(ballot & ddtree_lanes_below())] = c;
    out += __popc(ballot);
    __syncwarp();
  }
  return out;
}

// Shrinks a warp's buffer of n > k distinct composites: keeps every entry at or above the value
// of the k-th largest when at most `room` are (room >= k), else exactly the k largest. Returns
// the new count; *threshold_out (a lower bound of the k-th largest entry of every superset)
// is the smallest composite a kept entry may have.
__device__ __noinline__ int ddtree_warp_shrink(uint64_t* cand, int n, int k, int room,
                                               uint32_t* hist, uint64_t* threshold_out) {
  __syncwarp();  // every lane's candidates are visible (ddtree_expand_hits appends them)
  uint64_t t = ddtree_warp_select(cand, n, k, false, hist);
  int kept = ddtree_warp_filter(cand, n, t, cand);
  if (kept > room) {
    t = ddtree_warp_select(cand, kept, k, true, hist);
    kept = ddtree_warp_filter(cand, kept, t, cand);
  }
  *threshold_out = t;
  return kept;
}

// A row's statistics from its parts' (max, sum of exp(x - max), +inf count) triples st[3 * p ..],
// p < num_parts: the largest max, the parts' sums rescaled to it and added, the +inf count.
// Every thread of the block calls it (block barriers inside). Up to 32 parts, warp 0 reduces
// alone and one barrier publishes the result: the same shuffle trees as the block-wide
// reductions, whose other warps hold only -inf and 0, so the same bits.
__device__ void ddtree_row_stats(const float* st, int num_parts, float* scratch, float& row_max,
                                 float& row_sum, float& row_inf) {
  const int tid = threadIdx.x, threads = blockDim.x;
  if (num_parts <= 32) {
    if (tid < 32) {
      const bool mine = tid < num_parts;
      float m = mine ? st[3 * tid] : -DDTREE_INF;
      float s = mine ? st[3 * tid + 1] : 0.0f;
      float inf = mine ? st[3 * tid + 2] : 0.0f;
      ddtree_warp_stats(m, s, inf);
      if (tid == 0) {
        scratch[0] = m;
        scratch[1] = s;
        scratch[2] = inf;
      }
    }
    __syncthreads();
    row_max = scratch[0];
    row_sum = scratch[1];
    row_inf = scratch[2];
    return;
  }
  float m = -DDTREE_INF, inf = 0.0f;
  for (int p = tid; p < num_parts; p += threads) {
    m = fmaxf(m, st[3 * p]);
    inf += st[3 * p + 2];
  }
  row_max = ddtree_block_reduce_max(m, scratch);
  float s = 0.0f;
  if (row_max > -DDTREE_INF) {
    for (int p = tid; p < num_parts; p += threads) {
      if (st[3 * p] > -DDTREE_INF) s += st[3 * p + 1] * expf(st[3 * p] - row_max);
    }
  }
  row_sum = ddtree_block_reduce_sum(s, scratch);
  row_inf = ddtree_block_reduce_sum(inf, scratch);
}

// Orders a row's n distinct candidates cand[0, n): sorted[0, top_k) gets the top_k largest in
// descending order, 0 past n. sorted[0, 2 * sort_size) and *counter must be 0 on entry and
// visible to the block; `hist` is 256 shared counters. Every thread of the block calls it; the
// block is synchronised on return.
__device__ void ddtree_order_row(const uint64_t* cand, int n, int top_k, int sort_size,
                                 uint64_t* sorted, uint32_t* hist,
                                 ddtree_select_scratch* select_scratch, int* counter) {
  if (n <= (int)blockDim.x) {
    // Usual with 256 threads: one pass over n entries per thread and one barrier, where the
    // sorts below take a barrier per stage (and the select a serial warp before them). On the
    // H200, B 32 K 64: 10.8 -> 8.1 us; ranking 2-5 candidates per thread was slower (B 128
    // K 64 on 64 threads: 18.1 -> 22.3 us).
    ddtree_rank_desc(cand, n, top_k, sorted);
    __syncthreads();
  } else if (n <= 2 * sort_size) {
    // Few enough to sort them all: the top_k largest lead the sorted list, and the rest of
    // `sorted` stays 0.
    for (int i = threadIdx.x; i < n; i += blockDim.x) sorted[i] = cand[i];
    __syncthreads();
    ddtree_bitonic_desc(sorted, n <= sort_size ? sort_size : 2 * sort_size);
  } else {
    // The top_k largest (the block finds the k-th), then their sort.
    const uint64_t cut = ddtree_radix_select<true>(cand, n, top_k, true, hist, select_scratch);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const uint64_t v = cand[i];
      if (v >= cut) sorted[atomicAdd(counter, 1)] = v;  // exactly top_k are >= cut
    }
    __syncthreads();
    ddtree_bitonic_desc(sorted, sort_size);
  }
}
