// build_tree: the DDTree draft tree on the GPU in three launches with no host round trip.
//
// Python reference: ddtree.kernels.reference.build_tree (contract: ddtree.kernels.build.build_tree).
// Rows are (request, depth) pairs, row = b * draft_len + (depth - 1). K = top_k = min(max_budget, V).
//
// 1. ddtree_build_topk  grid (num_chunks, rows), block TOPK_WARPS warps, dynamic shared memory
//    TOPK_WARPS * (cap * 8 + DDTREE_HITS * 20) bytes. A block covers one span of one row; each
//    warp streams its own steps of the span exactly once (warp w the span's steps w, w +
//    TOPK_WARPS, ...: every warp's bounds sample the whole span, also where large logits
//    cluster at some token ids, as real vocabularies' do), UNROLL 16-byte vectors per lane and
//    step, with the next step's loads in flight (and the step TOPK_PREFETCH ahead asked of L2)
//    while a step is processed, and no block barrier after the first step (see below) until the
//    end. Per lane it keeps an online max and sum of exp(x - max) over finite x and a count of
//    +inf, a step at a time with no branch in the common case. Candidates are 64-bit composites
//    order_key(x) << 32 | ~token (larger composite = larger scaled logit x, equal x smaller token
//    id). A vector whose largest entry reaches the block's running threshold is a "hit": its lane
//    stores the raw vector in the warp's hit buffer, and once 32 hits are buffered the warp
//    expands them together (one vector per lane, a warp prefix sum places the entries at or
//    above the then current threshold in the warp's buffer of `cap` composites). Before a round
//    could overflow it, the warp keeps the K largest of its buffer (a warp radix select) and
//    raises the block threshold to the smallest of them (a lower bound of the row's K-th largest
//    entry: the warp saw K entries at or above it). A second, tighter bound: each warp publishes
//    a value it holds j = ceil(K / TOPK_WARPS) distinct entries at or above, and the smallest of
//    the warps' values bounds the row's K-th largest entry too (K entries in all are at or above
//    it). A warp publishes the j-th largest of its kept candidates after each shrink and, when
//    every warp of the block has a whole first step and j <= 32 * UNROLL, first the j-th largest
//    of its first-step vector maxima (one block barrier, so that the first steps already use it).
//    While it streams, when j <= TOPK_BOUND_MAX_J, a warp also publishes the j-th largest of its
//    lanes' running maxima (each lane's maximum is one entry, and the lanes' entries are
//    distinct) at steps 1, 2, 4, 8, ... (each costs j warp reductions; every step or every
//    second step was slower). That bound rises as the row streams by, so the threshold follows
//    the row's K-th largest entry instead of staying near the first steps' (B 32, K 64: 66
//    instead of 211 hit vectors per warp).
//    On random logits only O(K log(V / K)) entries ever pass. At the end every warp writes its
//    statistics and its candidates at or above the final threshold (a superset of its share of
//    the row's top K; its K largest if more than K are), padded with composite 0, as one "part"
//    of the row. With merge_here (the plan's choice: one block per row, at most two waves of
//    blocks, K <= 400 at UNROLL 4) the block instead gathers its warps' parts in its hit
//    buffers and merges the row itself exactly as launch 2 would (ddtree_merge_here), and
//    launch 2 is skipped.
// 2. ddtree_build_merge  grid (rows), block of any multiple of 32 threads up to MERGE_THREADS
//    (the plan's merge_threads), dynamic shared memory
//    (num_parts * K + 2 * sort_size) * 8 bytes. Gathers the row's non-pad candidates, combines
//    the parts' statistics into the row's log-sum-exp (warp 0 alone up to 32 parts), orders
//    the candidates (no more than the block's threads by ranking each against all; else
//    bitonic, and when there are more than 2 * sort_size, only the top K after a radix select)
//    and writes the sorted top-K tokens, their log-probabilities and the number of possible
//    ones.
// 3. ddtree_build_select  grid (batch_size), block SELECT_THREADS; warp 0 runs the best-first
//    selection of one request (or the whole block the wide select, below), then the whole block
//    writes the nodes and ancestor masks. The frontier (at most budget candidates) is split
//    over the lanes, slot g owned by lane g % 32.
//    A pop is one warp max-reduction of the lanes' best keys (order_key of the score); exact
//    score ties go to the lexicographically smaller rank tuple (a parent before its children).
//    The node's successors are its first child and its next sibling: both join the frontier,
//    one in the popped slot, unless the better one continues a chain (below). For budgets up
//    to 96 the slots live in registers (two or three per lane, each with the keys of
//    its own first child and next sibling computed when it enters, so that a pop waits on no
//    memory; ties compare the popped nodes' rank tuples packed in two words, built from a
//    request's first tie on). Beyond that they live in shared memory, each
//    lane keeps the best of its slots in registers, ties compare a packed prefix of the tuple
//    first (`bits` per depth, rank + 1, 0 past the node's depth: a few word compares) and walk
//    parents only when the prefixes agree, and after a pop the whole warp rescans the owner's
//    slots. After a pop found by reduction, the pop's better successor is the next pop whenever
//    it beats the rest of the frontier strictly (one more reduction gives the rest's best key),
//    and so on along a chain that needs no reduction; within a chain, a run of next siblings
//    that beat the run's first children and the rest is popped in one warp step
//    (ddtree_sibling_run). Budgets of at least wide_min_budget, when the plan gives the launch a
//    store (wide_cap nodes), take the wide select instead (ddtree_select_pops_wide; the plan's
//    choice: above 96): the whole block lists every
//    node above a rising score threshold level by level and orders them, and falls back to the
//    serial pops only when exact ties at the budget-th score outnumber half the store. Shared
//    memory: the popped nodes, plus the per-depth log-prob table when it fits, plus the wide
//    select's store.
//
// Rules shared with the reference: x = logits.float() / temperature (true division), NaN -> -inf,
// a row holding +inf gives its +inf tokens log-prob -log(count) and every other token -inf, an
// all -inf row has no possible token; scores are fp32 running sums in depth order.
// Caller data read here: root_tokens (checked: out of range -> ErrorFlag.TOKEN, root-only tree),
// budgets (clamped to [0, num_nodes_max - 1]), error_flags (non-zero on entry -> root-only tree).
// With all_or_nothing (outputs in caller memory), a bad root or an entry flag anywhere in the
// batch leaves every output unwritten instead (the flags are still set).
#include "common.cuh"

#ifndef TOPK_WARPS
#define TOPK_WARPS 8
#endif
#ifndef UNROLL
#define UNROLL 2
#endif
#ifndef TOPK_MIN_BLOCKS
#define TOPK_MIN_BLOCKS 2
#endif
#ifndef TOPK_PREFETCH
#define TOPK_PREFETCH 2
#endif
#ifndef TOPK_BOUND_MAX_J
#define TOPK_BOUND_MAX_J 16
#endif
#ifndef MERGE_THREADS
#define MERGE_THREADS 256
#endif
#ifndef SELECT_THREADS
#define SELECT_THREADS 512  // 16 warps: the wide select's levels are block-parallel
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

__device__ __forceinline__ float ddtree_block_reduce_max(float v, float* scratch) {
  v = ddtree_warp_max(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return ddtree_warp_max(lane < warps ? scratch[lane] : -DDTREE_INF);
}

__device__ __forceinline__ float ddtree_block_reduce_sum(float v, float* scratch) {
  v = ddtree_warp_sum(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return ddtree_warp_sum(lane < warps ? scratch[lane] : 0.0f);
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

constexpr int DDTREE_VEC = 16 / sizeof(ddtree_logit_t);
constexpr int DDTREE_STEP = 32 * UNROLL * DDTREE_VEC;  // entries one warp reads per step
// Entries from the start of one of a warp's steps to the start of its next (see the file comment).
constexpr int DDTREE_STRIDE = TOPK_WARPS * DDTREE_STEP;

// Loads one warp step: vector u of lane l covers entries start + (u * 32 + l) * VEC .. + VEC - 1.
__device__ __forceinline__ void ddtree_load_step(uint4 (&v)[UNROLL], const ddtree_logit_t* src,
                                                 int start, int end, bool vectorized) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int first = start + (u * 32 + lane) * DDTREE_VEC;
    if (vectorized && first + DDTREE_VEC <= end) {
      v[u] = __ldg(reinterpret_cast<const uint4*>(src + first));
    } else {
      ddtree_logit_t* e = reinterpret_cast<ddtree_logit_t*>(&v[u]);
#pragma unroll
      for (int k = 0; k < DDTREE_VEC; ++k) {
        // Past the end: NaN, which is never a candidate and adds nothing to the statistics.
        e[k] = first + k < end ? src[first + k] : ddtree_logit_t(__int_as_float(0x7FC00000));
      }
    }
  }
}

// Element k (0 <= k < VEC, any index) of a raw 16-byte vector of logits, widened to fp32.
__device__ __forceinline__ float ddtree_vector_element(const uint4& v, int k) {
#if DDTREE_DTYPE == DDTREE_DTYPE_F32
  const uint32_t word = k < 2 ? (k == 0 ? v.x : v.y) : (k == 2 ? v.z : v.w);
  return __uint_as_float(word);
#else
  const int w = k >> 1;
  const uint32_t word = w < 2 ? (w == 0 ? v.x : v.y) : (w == 2 ? v.z : v.w);
  const uint16_t bits = (uint16_t)((k & 1) ? (word >> 16) : (word & 0xFFFFu));
  ddtree_logit_t e;
  memcpy(&e, &bits, sizeof(bits));
  return ddtree_to_float(e);
#endif
}

// All VEC elements of a raw 16-byte vector of logits, widened to fp32 (bf16: a shift or a mask
// per element).
__device__ __forceinline__ void ddtree_unpack(const uint4& v, float (&x)[DDTREE_VEC]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#if DDTREE_DTYPE == DDTREE_DTYPE_F32
#pragma unroll
  for (int k = 0; k < 4; ++k) x[k] = __uint_as_float(w[k]);
#elif DDTREE_DTYPE == DDTREE_DTYPE_BF16
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x[2 * k] = __uint_as_float(w[k] << 16);
    x[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
  }
#else
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[k]));
    x[2 * k] = f.x;
    x[2 * k + 1] = f.y;
  }
#endif
}

// 2^x with subnormal results flushed to 0 (one MUFU.EX2, none of exp2f's subnormal fix-up):
// every term it feeds is summed with the running maximum's own term 1, so a term below 2^-126
// could not change the sum.
__device__ __forceinline__ float ddtree_exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Sum and largest non-NaN value (fmaxf ignores one NaN) of t[0, N) by trees of pairwise
// operations (N a power of two; t is overwritten): log2(N) dependent steps instead of N - 1.
template <int N>
__device__ __forceinline__ float ddtree_tree_sum(float (&t)[N]) {
  static_assert(N >= 1 && (N & (N - 1)) == 0, "pairwise trees need a power of two (UNROLL)");
#pragma unroll
  for (int k = 0; k < N / 2; ++k) t[k] += t[k + N / 2];
  if constexpr (N > 2) {
    return ddtree_tree_sum(reinterpret_cast<float(&)[N / 2]>(t));
  } else {
    return t[0];
  }
}

template <int N>
__device__ __forceinline__ float ddtree_tree_max(float (&t)[N]) {
  static_assert(N >= 1 && (N & (N - 1)) == 0, "pairwise trees need a power of two (UNROLL)");
#pragma unroll
  for (int k = 0; k < N / 2; ++k) t[k] = fmaxf(t[k], t[k + N / 2]);
  if constexpr (N > 2) {
    return ddtree_tree_max(reinterpret_cast<float(&)[N / 2]>(t));
  } else {
    return t[0];
  }
}

// The entries x of a raw vector scaled by 1/temperature (UNIT: temperature == 1) and their
// largest non-NaN value (-inf when every entry is NaN), by a tree of pairwise maxima.
template <bool UNIT>
__device__ __forceinline__ float ddtree_scaled_vector(const uint4& v, float temperature,
                                                      float (&x)[DDTREE_VEC]) {
  ddtree_unpack(v, x);
  if (!UNIT) {
#pragma unroll
    for (int k = 0; k < DDTREE_VEC; ++k) x[k] /= temperature;
  }
  float t[DDTREE_VEC];
#pragma unroll
  for (int k = 0; k < DDTREE_VEC; ++k) t[k] = x[k];
  return fmaxf(-DDTREE_INF, ddtree_tree_max(t));  // NaN only when every entry is NaN
}

// Statistics of one vector, the careful way (any +inf, NaN or -inf): online max m, sum s of
// exp(x - m) over finite x, count of +inf.
__device__ __forceinline__ void ddtree_vector_stats_careful(const float (&x)[DDTREE_VEC],
                                                            float& m, float& s, float& infs) {
  float fmax = -DDTREE_INF;
#pragma unroll
  for (int k = 0; k < DDTREE_VEC; ++k) {
    if (x[k] == DDTREE_INF) {
      infs += 1.0f;
    } else if (x[k] > -DDTREE_INF) {
      fmax = fmaxf(fmax, x[k]);
    }
  }
  if (fmax > m) {
    s *= ddtree_exp2_ftz((m - fmax) * DDTREE_LOG2E);
    m = fmax;
  }
  if (m > -DDTREE_INF) {
#pragma unroll
    for (int k = 0; k < DDTREE_VEC; ++k) {
      if (x[k] > -DDTREE_INF && x[k] < DDTREE_INF) {
        s += ddtree_exp2_ftz((x[k] - m) * DDTREE_LOG2E);
      }
    }
  }
}

// A lane's statistics: online max m, sum s of exp(x - m) over finite x, count of +inf.
struct ddtree_stats {
  float m, s, infs;
};

// One step's entries (UNROLL vectors of VEC), widened to fp32.
struct ddtree_step_values {
  float x[UNROLL][DDTREE_VEC];
};

// The careful pass over a step's vectors (ddtree_vector_stats_careful), out of line: the rare
// step with +inf, NaN or no finite entry calls it, and the streaming loop's code stays small
// (with the tail loads and the lane bounds also out of line, and the hit stores predicated, the
// loop's code went from 27 to 15 KB and the top-k got up to 6 % faster on the H200, B 32 K 64
// 75.4 -> 71.1 us; bench/results/2026-11-30-h200-topk-loop-s15.json).
__device__ __noinline__ ddtree_stats ddtree_step_stats_careful(ddtree_step_values values,
                                                               ddtree_stats stats) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    ddtree_vector_stats_careful(values.x[u], stats.m, stats.s, stats.infs);
  }
  return stats;
}

// Statistics of one step's UNROLL vectors (entries x, largest non-NaN entry smax): online max
// m, sum s of exp(x - m) over finite x, count of +inf. The common case (smax finite, no NaN)
// has no branch but the rare rescale, and sums by a tree, so that the vectors' chains overlap.
__device__ __forceinline__ void ddtree_step_stats(const float (&x)[UNROLL][DDTREE_VEC],
                                                  float smax, float& m, float& s, float& infs) {
  if (smax > -DDTREE_INF && smax < DDTREE_INF) {
    if (smax > m) {
      s *= ddtree_exp2_ftz((m - smax) * DDTREE_LOG2E);
      m = smax;
    }
    // (x - m) first: folding m into an fma with a pre-rounded m * log2(e) would add that
    // product's rounding error (up to 6e-5 at m = 1e3, 1e31 at m = 1e38) to every exponent,
    // and a row's top token could get a log-prob above 0.
    float t[UNROLL * DDTREE_VEC];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
      for (int k = 0; k < DDTREE_VEC; ++k) {
        t[u * DDTREE_VEC + k] = ddtree_exp2_ftz((x[u][k] - m) * DDTREE_LOG2E);
      }
    }
    const float vs = ddtree_tree_sum(t);
    if (!isnan(vs)) {
      s += vs;
      return;
    }
  }
  // A +inf, a NaN, or no finite entry (m may already be smax: the careful pass agrees).
  ddtree_step_values values;
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
    for (int k = 0; k < DDTREE_VEC; ++k) values.x[u][k] = x[u][k];
  }
  const ddtree_stats stats = ddtree_step_stats_careful(values, ddtree_stats{m, s, infs});
  m = stats.m;
  s = stats.s;
  infs = stats.infs;
}

// Raises the block threshold to `raised` or to the smallest of the warps' published bounds (see
// the file comment), whichever is larger. A bound not yet published reads 0; one read stale is
// smaller than the current one and still a bound. Other warps raise their bounds meanwhile, by
// atomicMax (volatile reads here): no barrier orders the two, on purpose. One whole warp calls
// it.
__device__ __forceinline__ void ddtree_raise_threshold(const uint32_t* warp_bound,
                                                       unsigned long long* block_threshold,
                                                       uint64_t raised) {
  const int lane = threadIdx.x & 31;
  const uint32_t bound =
      lane < TOPK_WARPS ? *reinterpret_cast<const volatile uint32_t*>(&warp_bound[lane]) : ~0u;
  const uint32_t low = __reduce_min_sync(DDTREE_FULL, bound);
  if (lane == 0) atomicMax(block_threshold, max((unsigned long long)raised,
                                                (unsigned long long)low << 32));
}

// The j-th largest (1 <= j <= 32, counting equal keys separately) of the warp's keys (all > 0),
// in every lane. Up to j = 4 by j rounds of a warp max, each retiring one lane; beyond, by each
// lane's rank (larger keys first, equal keys by lane: 32 shuffles with no chain between them).
// On the H200 the ranks made the top-k 1-5 % faster at j = 8 and 16 (B 32 K 64 71.4 -> 70.8 us,
// K 128 92.8 -> 88.1; bench/results/2026-11-30-h200-topk-lane-bound-s15.json) and 3 % slower at
// j = 2 (...-topk-experiments-s15.json, run "lane_bound"). One whole warp calls it.
__device__ uint32_t ddtree_warp_jth_largest(uint32_t key, int j) {
  const int lane = threadIdx.x & 31;
  if (j <= 4) {
    uint32_t top = 0;
    for (int round = 0; round < j; ++round) {
      top = __reduce_max_sync(DDTREE_FULL, key);
      if (lane == __ffs(__ballot_sync(DDTREE_FULL, key == top)) - 1) key = 0;  // retired
    }
    return top;
  }
  int rank = 0;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const uint32_t other = __shfl_sync(DDTREE_FULL, key, i);
    rank += (other > key || (other == key && i < lane)) ? 1 : 0;
  }
  return __shfl_sync(DDTREE_FULL, key, __ffs(__ballot_sync(DDTREE_FULL, rank == j - 1)) - 1);
}

// Publishes the j-th largest (1 <= j <= 32) of the lanes' running maxima m as the warp's bound
// when it beats the one published, and raises the block threshold. The lanes read disjoint
// entries and each m is one of them (finite), so j distinct entries of the warp are at or above
// the published value. One whole warp calls it, a few times per row (not inlined: see
// ddtree_step_stats_careful).
__device__ __noinline__ void ddtree_publish_lane_bound(float m, int j, uint32_t* warp_bound,
                                                       unsigned long long* block_threshold) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // m is never NaN, so its order key is > 0.
  const uint32_t top = ddtree_warp_jth_largest(ddtree_order_key(m + 0.0f), j);
  if (top > warp_bound[warp]) {
    __syncwarp();
    if (lane == 0) atomicMax(&warp_bound[warp], top);  // other warps read it meanwhile
    __syncwarp();
    ddtree_raise_threshold(warp_bound, block_threshold, 0);
  }
}

// Shared-memory stores done only where `store` holds, as one predicated instruction each (p
// must point into shared memory): the streaming loop records its hits with them instead of a
// branch per vector.
__device__ __forceinline__ void ddtree_store_shared_if(int32_t* p, int32_t v, bool store) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q st.shared.b32 [%0], %1;\n}"
               :
               : "r"(a), "r"(v), "r"((int)store)
               : "memory");
}

__device__ __forceinline__ void ddtree_store_shared_if(uint4* p, const uint4& v, bool store) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n"
      " @q st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n}"
      :
      : "r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"((int)store)
      : "memory");
}

// Vectors a warp may have recorded as hits and not yet expanded: fewer than 32 before a step,
// plus at most one per lane and vector of the step.
#define DDTREE_HITS (32 * (UNROLL + 1))

// The block threshold's value: entries below it are not candidates (the floor's value is
// -FLT_MAX, so -inf and NaN never pass).
__device__ __forceinline__ float ddtree_threshold_value(const unsigned long long* threshold) {
  return ddtree_key_to_float(
      (uint32_t)(*reinterpret_cast<const volatile unsigned long long*>(threshold) >> 32));
}

// Shrinks a warp's buffer of n > 2 * top_k candidates to at most 2 * top_k (see
// ddtree_warp_shrink), publishes the j-th largest kept value as the warp's bound and raises the
// block threshold. Returns the new count. One whole warp calls it.
__device__ int ddtree_shrink_and_raise(uint64_t* cand, int n, int top_k, int j, uint32_t* hist,
                                       uint32_t* warp_bound, unsigned long long* block_threshold) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint64_t raised;
  const int kept = ddtree_warp_shrink(cand, n, top_k, 2 * top_k, hist, &raised);
  const uint32_t held = (uint32_t)(ddtree_warp_select(cand, kept, j, false, hist) >> 32);
  if (lane == 0) atomicMax(&warp_bound[warp], held);  // other warps read it meanwhile
  __syncwarp();
  ddtree_raise_threshold(warp_bound, block_threshold, raised);
  return kept;
}

// Expands the warp's nh recorded hit vectors (raw vectors hit_vec[i], first token hit_token[i])
// into candidates: 32 vectors per round, one per lane, each entry at or above the block
// threshold (re-read every round: it may have risen since the hit) appended to cand[count, ..)
// at positions from a warp prefix sum. Before a round that could overflow the buffer (of `cap`
// >= 2 * top_k + 32 * VEC composites) the buffer is shrunk. Returns the new count. One whole
// warp calls it. Not inlined, so that the streaming loop stays small: 0-11 % faster over B 1..128
// and K 16..256 on the H200 (B 32 K 64: 1.3 %).
template <bool UNIT>
__device__ __noinline__ int ddtree_expand_hits(const uint4* hit_vec, const int32_t* hit_token,
                                               int nh, float temperature, uint64_t* cand,
                                               int count, int cap, int top_k, int j,
                                               uint32_t* hist, uint32_t* warp_bound,
                                               unsigned long long* block_threshold) {
  const int lane = threadIdx.x & 31;
  __syncwarp();  // every lane's hits are visible
  for (int base = 0; base < nh; base += 32) {
    if (count > cap - 32 * DDTREE_VEC) {
      count = ddtree_shrink_and_raise(cand, count, top_k, j, hist, warp_bound, block_threshold);
    }
    const float floor_value = ddtree_threshold_value(block_threshold);
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    int token0 = 0;
    uint32_t bits = 0;
    if (base + lane < nh) {
      v = hit_vec[base + lane];
      token0 = hit_token[base + lane];
      float x[DDTREE_VEC];
      ddtree_scaled_vector<UNIT>(v, temperature, x);
#pragma unroll
      for (int k = 0; k < DDTREE_VEC; ++k) bits |= (x[k] >= floor_value ? 1u : 0u) << k;
    }
    const int mine = __popc(bits);
    const int incl = ddtree_warp_inclusive_sum(mine);
    int slot = count + incl - mine;
    // Usually one entry of a hit vector passes: loop over the set bits only (the entry is
    // re-read from the raw vector, which a dynamic index into x[] would send to local memory).
    while (bits != 0u) {
      const int k = __ffs(bits) - 1;
      bits &= bits - 1u;
      const float f = ddtree_vector_element(v, k);
      cand[slot++] = ddtree_composite(UNIT ? f : f / temperature, (uint32_t)(token0 + k));
    }
    count += __shfl_sync(DDTREE_FULL, incl, 31);
  }
  __syncwarp();  // every lane has read its hits before the buffer is reused
  return count;
}

// One warp step's raw vectors (ddtree_load_step), returned by value.
struct ddtree_step_vectors {
  uint4 v[UNROLL];
};

// ddtree_load_step out of line, for the rare step that is not interior (the last of a span, or
// rows not 16-byte aligned): see ddtree_step_stats_careful.
__device__ __noinline__ ddtree_step_vectors ddtree_load_tail(const ddtree_logit_t* src, int start,
                                                             int end, bool vectorized) {
  ddtree_step_vectors tail;
  ddtree_load_step(tail.v, src, start, end, vectorized);
  return tail;
}

// Streams one warp's steps of a row, from begin every DDTREE_STRIDE entries up to end (the end of
// the span); see the file comment (launch 1). UNIT: temperature == 1. Returns the warp's number
// of candidates in cand (at most cap).
template <bool UNIT>
__device__ int ddtree_topk_warp(const ddtree_logit_t* __restrict__ src, float temperature,
                                int begin, int end, int top_k, int cap, bool vectorized,
                                uint64_t* cand, uint4* hit_vec, int32_t* hit_token, uint32_t* hist,
                                unsigned long long* block_threshold, bool first_threshold,
                                uint32_t* warp_bound, float& m, float& s, float& infs) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int j = (top_k + TOPK_WARPS - 1) / TOPK_WARPS;
  uint4 cur[UNROLL], nxt[UNROLL];
  if (begin < end) ddtree_load_step(cur, src, begin, end, vectorized);
  if (first_threshold) {
    // The warps' first bounds (see the file comment): this warp's j-th largest vector maximum
    // by j rounds of a warp max that each retire one vector. Every warp takes part (the caller
    // checked that each has a whole first step).
    uint32_t keys[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float x[DDTREE_VEC];
      const float vmax = ddtree_scaled_vector<UNIT>(cur[u], temperature, x);
      keys[u] = ddtree_order_key(vmax + 0.0f);  // > 0: key 0 marks a retired vector
    }
    uint32_t top = 0;
    for (int round = 0; round < j; ++round) {
      uint32_t mine = 0;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) mine = max(mine, keys[u]);
      top = __reduce_max_sync(DDTREE_FULL, mine);
      if (lane == __ffs(__ballot_sync(DDTREE_FULL, mine == top)) - 1) {
        bool retired = false;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          if (!retired && keys[u] == top) {
            keys[u] = 0;
            retired = true;
          }
        }
      }
    }
    if (lane == 0) warp_bound[warp] = top;
    __syncthreads();
    ddtree_raise_threshold(warp_bound, block_threshold, 0);
  }
  int count = 0, nh = 0, step = 0;
  // This lane's first vector of the next step (read only where the step is whole and the row
  // 16-byte aligned), advanced one step per iteration.
  const uint4* next_vectors = reinterpret_cast<const uint4*>(src + begin + DDTREE_STRIDE) + lane;
  constexpr int STRIDE_VECTORS = DDTREE_STRIDE / DDTREE_VEC;
  for (int start = begin; start < end; start += DDTREE_STRIDE, next_vectors += STRIDE_VECTORS) {
    if (vectorized && start + DDTREE_STRIDE + DDTREE_STEP <= end) {
      // An interior step (the common case): every vector whole, no bounds to check.
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) nxt[u] = __ldg(next_vectors + u * 32);
      if (start + TOPK_PREFETCH * DDTREE_STRIDE + DDTREE_STEP <= end) {
        // Ask L2 for the step TOPK_PREFETCH steps ahead, so that its loads wait on L2 only.
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          asm volatile("prefetch.global.L2 [%0];" ::"l"(next_vectors +
                                                        (TOPK_PREFETCH - 1) * STRIDE_VECTORS +
                                                        u * 32));
        }
      }
    } else if (start + DDTREE_STRIDE < end) {
      const ddtree_step_vectors tail =
          ddtree_load_tail(src, start + DDTREE_STRIDE, end, vectorized);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) nxt[u] = tail.v[u];
    }
    // A vector whose largest entry reaches the threshold is a hit: its lane stores the raw
    // vector for a later warp-wide expansion (one predicated shared store instead of a
    // divergent loop).
    const float floor_value = ddtree_threshold_value(block_threshold);
    float x[UNROLL][DDTREE_VEC], vmax[UNROLL];
    float smax = -DDTREE_INF;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      vmax[u] = ddtree_scaled_vector<UNIT>(cur[u], temperature, x[u]);
      smax = fmaxf(smax, vmax[u]);
    }
    ddtree_step_stats(x, smax, m, s, infs);
    ++step;
    // Steps 1, 2, 4, 8, ...; step 1's lane maxima are a subset of the first-step vector maxima,
    // so after the first-step bound their j-th largest cannot beat it.
    if (j <= TOPK_BOUND_MAX_J && (step & (step - 1)) == 0 && (step > 1 || !first_threshold)) {
      ddtree_publish_lane_bound(m, j, warp_bound, block_threshold);
    }
    if (__ballot_sync(DDTREE_FULL, smax >= floor_value) != 0u) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const bool hit = vmax[u] >= floor_value;
        const uint32_t ballot = __ballot_sync(DDTREE_FULL, hit);
        const int at = nh + __popc(ballot & ddtree_lanes_below());  // < DDTREE_HITS
        ddtree_store_shared_if(hit_vec + at, cur[u], hit);
        ddtree_store_shared_if(hit_token + at, start + (u * 32 + lane) * DDTREE_VEC, hit);
        nh += __popc(ballot);
      }
    }
    if (nh >= 32) {
      count = ddtree_expand_hits<UNIT>(hit_vec, hit_token, nh, temperature, cand, count, cap,
                                       top_k, j, hist, warp_bound, block_threshold);
      nh = 0;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) cur[u] = nxt[u];
  }
  return ddtree_expand_hits<UNIT>(hit_vec, hit_token, nh, temperature, cand, count, cap, top_k,
                                  j, hist, warp_bound, block_threshold);
}

// The merge of a row by its only top-k block (launch 1 with merge_here; see the file comment):
// each warp's `count` (<= top_k) candidates `cand` and statistics (wm, ws, infs) are gathered in
// shared memory and ordered and written exactly as ddtree_build_merge would. `gathered` holds
// TOPK_WARPS * top_k composites and does not overlap the candidate buffers; `sorted` (2 *
// sort_size composites) may, as it is cleared only once they are gathered. `hist` is 256 shared
// counters. Every thread of the block calls it.
__device__ void ddtree_merge_here(const uint64_t* cand, int count, float wm, float ws, float infs,
                                  uint64_t* sorted, uint64_t* gathered, int64_t row, int top_k,
                                  int sort_size, int vocab, uint32_t* hist,
                                  float* __restrict__ topk_lp, int32_t* __restrict__ topk_tok,
                                  int32_t* __restrict__ topk_count) {
  __shared__ int counts[TOPK_WARPS], counter;
  __shared__ float stats[TOPK_WARPS * 3], scratch[32];
  __shared__ ddtree_select_scratch select_scratch;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    counts[warp] = count;
    stats[3 * warp] = wm;
    stats[3 * warp + 1] = ws;
    stats[3 * warp + 2] = infs;
  }
  if (threadIdx.x == 0) counter = 0;
  __syncthreads();
  int offset = 0, n = 0;
#pragma unroll
  for (int w = 0; w < TOPK_WARPS; ++w) {
    offset += w < warp ? counts[w] : 0;
    n += counts[w];
  }
  for (int i = lane; i < count; i += 32) gathered[offset + i] = cand[i];
  __syncthreads();  // every candidate is gathered: the buffers under `sorted` are free
  for (int i = threadIdx.x; i < 2 * sort_size; i += blockDim.x) sorted[i] = 0;
  float row_max, row_sum, row_inf;
  ddtree_row_stats(stats, TOPK_WARPS, scratch, row_max, row_sum, row_inf);  // publishes `sorted`
  ddtree_order_row(gathered, n, top_k, sort_size, sorted, hist, &select_scratch, &counter);
  ddtree_write_row(sorted, row, top_k, vocab, row_max, logf(row_sum), row_inf, scratch, topk_lp,
                   topk_tok, topk_count);
}

extern "C" __global__ void __launch_bounds__(TOPK_WARPS * 32, TOPK_MIN_BLOCKS) ddtree_build_topk(
    const ddtree_logit_t* __restrict__ logits,  // [rows, vocab]
    float temperature, int32_t vocab, int32_t span, int32_t top_k, int32_t cap,
    int32_t vectorized,
    uint64_t* __restrict__ part_keys,  // [rows, num_chunks * TOPK_WARPS, top_k] (merge_here: unused)
    float* __restrict__ part_stats,    // [rows, num_chunks * TOPK_WARPS, 3]: max, sum, +inf count
    int32_t merge_here, int32_t sort_size,  // merge_here: one block per row merges it (below)
    float* __restrict__ topk_lp,            // [rows, top_k] (merge_here only, as the merge's)
    int32_t* __restrict__ topk_tok,         // [rows, top_k]
    int32_t* __restrict__ topk_count) {     // [rows]
  // [TOPK_WARPS, cap] candidate buffers, [TOPK_WARPS, DDTREE_HITS] hit vectors and their
  // [TOPK_WARPS, DDTREE_HITS] first tokens.
  extern __shared__ uint64_t smem[];
  __shared__ unsigned long long threshold;
  __shared__ uint32_t warp_bound[TOPK_WARPS];  // see the file comment; 0: none yet
  __shared__ uint32_t hist[TOPK_WARPS][256];
  ddtree_allow_dependents();  // a dependent select may get its blocks resident early
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunk = blockIdx.x;
  const int64_t row = blockIdx.y;
  // The span's first entry, the warp's first entry, and the end of the span whose steps the
  // warps share.
  const int span_begin = chunk * span;
  const int begin = span_begin + warp * DDTREE_STEP;
  const int end = min(vocab, span_begin + span);
  const ddtree_logit_t* src = logits + row * (int64_t)vocab;
  uint64_t* cand = smem + warp * (int64_t)cap;
  uint4* hit_vecs = reinterpret_cast<uint4*>(smem + TOPK_WARPS * (int64_t)cap);
  uint4* hit_vec = hit_vecs + warp * DDTREE_HITS;
  int32_t* hit_token =
      reinterpret_cast<int32_t*>(hit_vecs + TOPK_WARPS * DDTREE_HITS) + warp * DDTREE_HITS;
  if (threadIdx.x == 0) threshold = DDTREE_FINITE_FLOOR;
  // Block-uniform: every warp has a whole first step (a span holds at least TOPK_WARPS steps),
  // and j = ceil(K / warps) vectors of it.
  const bool first_threshold = (top_k + TOPK_WARPS - 1) / TOPK_WARPS <= 32 * UNROLL &&
                               span_begin + TOPK_WARPS * DDTREE_STEP <= vocab;
  if (lane == 0) warp_bound[warp] = 0;
  __syncthreads();
  float m = -DDTREE_INF, s = 0.0f, infs = 0.0f;
  int count;
  if (temperature == 1.0f) {
    count = ddtree_topk_warp<true>(src, temperature, begin, end, top_k, cap, vectorized != 0,
                                   cand, hit_vec, hit_token, hist[warp], &threshold,
                                   first_threshold, warp_bound, m, s, infs);
  } else {
    count = ddtree_topk_warp<false>(src, temperature, begin, end, top_k, cap, vectorized != 0,
                                    cand, hit_vec, hit_token, hist[warp], &threshold,
                                    first_threshold, warp_bound, m, s, infs);
  }
  ddtree_warp_stats(m, s, infs);  // the warp's statistics, in every lane
  __syncthreads();  // every warp is done: the block threshold is final
  const uint64_t final_threshold = threshold;
  const int64_t parts = (int64_t)gridDim.x * TOPK_WARPS;
  const int64_t part = row * parts + chunk * TOPK_WARPS + warp;
  uint64_t* out = part_keys + part * top_k;
  // Entries below the final threshold are not among the row's top K. Usually at most K of the
  // warp's remain, so the radix select below seldom runs (filtering after the barrier instead
  // of selecting before it: top-k 5-14 % faster on the H200, B 32 K 64 74.5 -> 70.3 us).
  count = ddtree_warp_filter(cand, count, final_threshold, cand);
  if (count > top_k) {
    uint64_t kept_from;
    count = ddtree_warp_shrink(cand, count, top_k, top_k, hist[warp], &kept_from);
  }
  if (merge_here) {
    ddtree_merge_here(cand, count, m, s, infs, smem, reinterpret_cast<uint64_t*>(hit_vecs), row,
                      top_k, sort_size, vocab, &hist[0][0], topk_lp, topk_tok, topk_count);
    return;
  }
  // Pads: composite 0, below every real composite (token 0xFFFFFFFF).
  for (int i = lane; i < top_k; i += 32) out[i] = i < count ? cand[i] : 0;
  if (lane == 0) {
    float* stats = part_stats + part * 3;
    stats[0] = m;
    stats[1] = s;
    stats[2] = infs;
  }
}

extern "C" __global__ void __launch_bounds__(MERGE_THREADS) ddtree_build_merge(
    const uint64_t* __restrict__ part_keys,   // [rows, num_parts, top_k]
    const float* __restrict__ part_stats,     // [rows, num_parts, 3]
    int32_t num_parts, int32_t top_k, int32_t sort_size, int32_t vocab,
    float* __restrict__ topk_lp,              // [rows, top_k]
    int32_t* __restrict__ topk_tok,           // [rows, top_k]
    int32_t* __restrict__ topk_count) {       // [rows]
  // [num_parts * top_k] candidates, then [2 * sort_size] sorted
  extern __shared__ uint64_t smem[];
  __shared__ float scratch[32];
  __shared__ int found, counter;
  __shared__ ddtree_select_scratch select_scratch;
  __shared__ uint32_t hist[256];
  ddtree_allow_dependents();  // a dependent select may get its blocks resident early
  const int tid = threadIdx.x, lane = tid & 31, threads = blockDim.x;
  const int64_t row = blockIdx.x;
  const int n_all = num_parts * top_k;
  uint64_t* cand = smem;
  uint64_t* sorted = smem + n_all;
  if (tid == 0) {
    found = 0;
    counter = 0;
  }
  for (int i = tid; i < 2 * sort_size; i += threads) sorted[i] = 0;
  __syncthreads();
  // Gather the real candidates (every real composite is above DDTREE_FINITE_FLOOR > 0).
  const uint64_t* src = part_keys + row * (int64_t)n_all;
  const int rounded = (n_all + threads - 1) / threads * threads;
  for (int i = tid; i < rounded; i += threads) {
    const uint64_t v = i < n_all ? src[i] : 0;
    const uint32_t ballot = __ballot_sync(DDTREE_FULL, v != 0);
    int base = 0;
    if (lane == 0 && ballot != 0) base = atomicAdd(&found, __popc(ballot));
    base = __shfl_sync(DDTREE_FULL, base, 0);
    if (v != 0) cand[base + __popc(ballot & ddtree_lanes_below())] = v;
  }
  float row_max, row_sum, row_inf;
  // A barrier in it publishes `found` and the gathered candidates.
  ddtree_row_stats(part_stats + row * num_parts * 3, num_parts, scratch, row_max, row_sum,
                   row_inf);
  ddtree_order_row(cand, found, top_k, sort_size, sorted, hist, &select_scratch, &counter);
  ddtree_write_row(sorted, row, top_k, vocab, row_max, logf(row_sum), row_inf, scratch, topk_lp,
                   topk_tok, topk_count);
}

#define DDTREE_MAX_NODES 1025
#define DDTREE_MAX_DEPTH 32
// order_key(-inf): a frontier whose best key is at or below this has nothing left to pop.
#define DDTREE_NEG_INF_KEY 0x007FFFFFu

// Lexicographic comparison of the rank tuples of two candidates (parent node, rank, depth) by
// walking popped nodes' parents: true when candidate 1's tuple is smaller.
__device__ __noinline__ bool ddtree_lex_less(int p1, int r1, int d1, int p2, int r2, int d2,
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

// The packed prefix of a node's next sibling from the node's own: rank + 2 in place of rank + 1
// at `depth` (the field is free below it: rank + 2 <= top_k < 2^bits).
__device__ __forceinline__ uint64_t ddtree_lex_next_sibling(uint64_t lex, int depth, int bits) {
  const int shift = 64 - bits * depth;
  return shift >= 0 ? lex + (1ull << shift) : lex;
}

// Candidate order: larger score key first, then the smaller rank tuple.
__device__ __forceinline__ bool ddtree_cand_better(uint32_t ka, uint64_t la, uint32_t ia,
                                                   uint32_t kb, uint64_t lb, uint32_t ib,
                                                   const int16_t* parent, const int16_t* rank) {
  if (ka != kb) return ka > kb;
  if (la != lb) return la < lb;
  return ddtree_slot_lex_less(ia, ib, parent, rank);
}

// Writes one request's tree from its popped nodes (node 0 the root; `count` nodes) with every
// thread of the block: tokens, parents, depths, log-probs, sentinels past `count`, num_nodes and
// the ancestor-or-self masks.
__device__ void ddtree_select_write(int count, int64_t b, int64_t root,
                                    const int32_t* __restrict__ topk_tok, int draft_len,
                                    int top_k, int num_nodes_max, int words,
                                    const int16_t* node_parent, const int16_t* node_rank,
                                    const int8_t* node_depth, const float* node_score,
                                    int64_t* __restrict__ tokens, int32_t* __restrict__ parents,
                                    int32_t* __restrict__ depths, float* __restrict__ log_probs,
                                    int32_t* __restrict__ num_nodes, int64_t* __restrict__ mask) {
  const int tid = threadIdx.x;
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

// A frontier candidate: score key (0: no candidate), packed (parent, rank, depth), packed
// rank-tuple prefix.
struct ddtree_cand {
  uint32_t key;
  uint32_t info;
  uint64_t lex;
};

// Of the lanes in `tied` (their candidates' infos in `info`, tied in every packed comparison),
// the one whose candidate has the smallest rank tuple, by walking the popped nodes' parents;
// *win_info receives its info. Every lane calls it with the same `tied`.
__device__ __forceinline__ int ddtree_tied_owner(uint32_t tied, uint32_t info,
                                                 const int16_t* node_parent,
                                                 const int16_t* node_rank, uint32_t* win_info) {
  int owner = __ffs(tied) - 1;
  uint32_t won = __shfl_sync(DDTREE_FULL, info, owner);
  for (uint32_t rest = tied & (tied - 1); rest != 0; rest &= rest - 1) {
    const int other = __ffs(rest) - 1;
    const uint32_t other_info = __shfl_sync(DDTREE_FULL, info, other);
    if (ddtree_slot_lex_less(other_info, won, node_parent, node_rank)) {
      won = other_info;
      owner = other;
    }
  }
  *win_info = won;
  return owner;
}

// Narrows the lanes with `in` set to those whose `word` is the least among them (every lane
// calls it: the reduction comes before the &&).
__device__ __forceinline__ bool ddtree_keep_least(bool in, uint32_t word) {
  const uint32_t v = in ? word : ~0u;
  const uint32_t least = __reduce_min_sync(DDTREE_FULL, v);
  return in && v == least;
}

// The lane whose best candidate (key, prefix, info) is the warp's best, `top` being the largest
// key: exact score ties go to the smaller rank tuple, by the packed prefixes (high word, then low
// word) and then by walking the popped nodes' parents. Every lane calls it (no short-circuit
// around the reductions); *win_info receives the winner's info.
__device__ __forceinline__ int ddtree_pop_owner(uint32_t top, uint32_t best_key, uint64_t best_lex,
                                                uint32_t best_info, const int16_t* node_parent,
                                                const int16_t* node_rank, uint32_t* win_info) {
  bool in = best_key == top;
  uint32_t tied = __ballot_sync(DDTREE_FULL, in);
  if ((tied & (tied - 1)) != 0) {
    in = ddtree_keep_least(in, (uint32_t)(best_lex >> 32));
    in = ddtree_keep_least(in, (uint32_t)best_lex);
    tied = __ballot_sync(DDTREE_FULL, in);
  }
  return ddtree_tied_owner(tied, best_info, node_parent, node_rank, win_info);
}

// Score key of the first child of a node at `depth` (0: the root) with score `score`: 0 when
// the node is at the last depth or the next depth has no possible token.
__device__ __forceinline__ uint32_t ddtree_child_key(float score, int depth, int draft_len,
                                                     int top_k, const float* lp,
                                                     const int* counts) {
  return depth < draft_len && counts[depth] > 0
             ? ddtree_order_key(score + lp[depth * top_k] + 0.0f)
             : 0u;
}

// Score key of the next sibling of the node of rank `rank` at `depth` (>= 1) whose parent has
// score `parent_score`: 0 when that depth has no further possible token.
__device__ __forceinline__ uint32_t ddtree_sibling_key(float parent_score, int rank, int depth,
                                                       int top_k, const float* lp,
                                                       const int* counts) {
  return rank + 1 < counts[depth - 1]
             ? ddtree_order_key(parent_score + lp[(depth - 1) * top_k + rank + 1] + 0.0f)
             : 0u;
}

// Writes popped node n to the node tables (the calling thread; the warp synchronises before
// they are read). For a pop the whole warp agrees on, every lane calls it with the same node:
// the same values land in the same words, with no branch to a single lane. On the H200 that
// made the select 1-6 % faster than lane 0 alone (B 32 K 64: 26.1 -> 25.0 us; see
// bench/results/2026-11-30-h200-select-record-s16.json).
__device__ __forceinline__ void ddtree_store_node(int n, int parent, int rank, int depth,
                                                  float score, int16_t* node_parent,
                                                  int16_t* node_rank, int8_t* node_depth,
                                                  float* node_score) {
  node_parent[n] = (int16_t)parent;
  node_rank[n] = (int16_t)rank;
  node_depth[n] = (int8_t)depth;
  node_score[n] = score;
}

// The first candidate of a request: its best depth-1 token, the root's first child (key 0 when
// none is possible).
__device__ __forceinline__ ddtree_cand ddtree_first_cand(int draft_len, int top_k,
                                                         const float* lp, const int* counts,
                                                         int bits) {
  return {ddtree_child_key(0.0f, 0, draft_len, top_k, lp, counts), ddtree_pack_slot(0, 0, 1),
          ddtree_lex_extend(0, 0, 1, bits)};
}

// Records popped node n (score key `top`, candidate `info`, prefix `lex`) in the node tables
// (every lane, the same node; the warp synchronises after) and, unless `last`, returns its first
// child and next sibling as candidates (key 0: none).
__device__ __forceinline__ void ddtree_pop_expand(int n, uint32_t top, uint32_t info,
                                                  uint64_t lex, bool last, int draft_len,
                                                  int top_k, int bits, const float* lp,
                                                  const int* counts, int16_t* node_parent,
                                                  int16_t* node_rank, int8_t* node_depth,
                                                  float* node_score, ddtree_cand& child,
                                                  ddtree_cand& sibling) {
  const float score = ddtree_key_to_float(top);
  const int parent = info & 2047, rank = (info >> 11) & 1023, depth = info >> 21;
  ddtree_store_node(n, parent, rank, depth, score, node_parent, node_rank, node_depth,
                    node_score);
  __syncwarp();  // node_score[parent] below may be this pop's
  if (last) return;  // the budget is spent: no candidates needed
  child.key = ddtree_child_key(score, depth, draft_len, top_k, lp, counts);
  child.info = ddtree_pack_slot(n, 0, depth + 1);
  child.lex = ddtree_lex_extend(lex, 0, depth + 1, bits);
  sibling.key = ddtree_sibling_key(node_score[parent], rank, depth, top_k, lp, counts);
  sibling.info = ddtree_pack_slot(parent, rank + 1, depth);
  sibling.lex = ddtree_lex_next_sibling(lex, depth, bits);
}

// A popped node's successors, its first child c and next sibling s (key 0: none): the better
// one continues the chain and is returned (the child on equal keys: its rank tuple is smaller),
// the other, if any, joins the frontier through `insert` and raises `rest`, the best key of the
// frontier outside the chain. Slot: ddtree_cand or ddtree_reg_slot.
template <typename Slot, typename Insert>
__device__ __forceinline__ Slot ddtree_chain_successor(Slot c, Slot s, uint32_t& rest,
                                                       Insert& insert) {
  const bool c_first = c.key != 0u && c.key >= s.key;
  const Slot other = c_first ? s : c;
  const Slot next = c_first ? c : s;
  if (other.key != 0u) {
    insert(other);
    rest = max(rest, other.key);
  }
  return next;
}

// A sibling run of the chained selects. The chain's next pop X_0 (score key x0, first-child key
// c0; rank `rank` at `depth` under a parent of score `parent_score`) is followed in best-first
// order by its next sibling X_1 when X_1 beats both X_0's first child C_0 (the chain takes the
// child on equal keys) and the rest of the frontier strictly, and so on: X_{j+1} is the next pop
// after X_j while its key is above max(rest, C_0, ..., C_j). Lane j evaluates X_j and C_j at
// once; a max-scan of the children and a ballot give the run's length m <= max_run: X_0 ..
// X_{m-1} are the next m pops (their first children join the frontier) and X_m the one after.
struct ddtree_run {
  int m;          // X_0 .. X_{m-1} are popped in the run
  uint32_t x, c;  // this lane's X_j and C_j score keys (j = lane; 0: none)
  uint32_t rest;  // max(rest, C_0, ..., C_{m-1})
};

__device__ __forceinline__ ddtree_run ddtree_sibling_run(uint32_t x0, uint32_t c0,
                                                         float parent_score, int rank, int depth,
                                                         uint32_t rest, int max_run,
                                                         int draft_len, int top_k,
                                                         const float* lp, const int* counts) {
  const int lane = threadIdx.x & 31;
  ddtree_run run;
  run.x = lane == 0 ? x0
                    : ddtree_sibling_key(parent_score, rank + lane - 1, depth, top_k, lp, counts);
  run.c = lane == 0 ? c0
          : run.x != 0u
              ? ddtree_child_key(ddtree_key_to_float(run.x), depth, draft_len, top_k, lp, counts)
              : 0u;
  // max(rest, C_0, ..., C_lane)
  const auto larger = [](uint32_t a, uint32_t b) { return max(a, b); };
  const uint32_t bound = ddtree_warp_inclusive_scan(max(run.c, rest), larger);
  const uint32_t x_after = __shfl_down_sync(DDTREE_FULL, run.x, 1);
  const uint32_t follows = __ballot_sync(DDTREE_FULL, lane < 31 && x_after > bound);
  run.m = min(__ffs(~follows) - 1, max_run);
  const uint32_t run_bound = __shfl_sync(DDTREE_FULL, bound, max(run.m - 1, 0));
  run.rest = run.m > 0 ? run_bound : rest;
  return run;
}

// Best-first pops of one request by one warp with the frontier in shared memory (any budget):
// lane l owns slots l, l + 32, ... and keeps the best of them in registers. Writes nodes 1..popped
// of the node tables and returns popped.
__device__ __noinline__ int ddtree_select_pops_shared(int budget, int draft_len, int top_k,
                                                      const float* lp, const int* counts,
                                                      int16_t* node_parent, int16_t* node_rank,
                                                      int8_t* node_depth, float* node_score) {
  __shared__ uint32_t slot_key[DDTREE_MAX_NODES];
  __shared__ uint32_t slot_info[DDTREE_MAX_NODES];
  __shared__ uint64_t slot_lex[DDTREE_MAX_NODES];
  const int lane = threadIdx.x & 31;
  const int bits = 32 - __clz(top_k);  // rank + 1 <= top_k
  // (best_key, best_lex, best_info, best_slot): the best of this lane's slots (key 0: none).
  uint32_t best_key = 0, best_info = 0;
  uint64_t best_lex = 0;
  int best_slot = -1;
  if (lane == 0) {  // slot 0: the best depth-1 token
    const ddtree_cand first = ddtree_first_cand(draft_len, top_k, lp, counts, bits);
    best_key = first.key;
    best_info = first.info;
    best_lex = first.lex;
    best_slot = 0;
    slot_key[0] = best_key;
    slot_info[0] = best_info;
    slot_lex[0] = best_lex;
  }
  __syncwarp();
  int size = 1, popped = 0;
  // Puts candidate c in a fresh slot; its lane keeps the better of it and its best.
  auto insert = [&](const ddtree_cand& c) {
    const int fresh = size++;
    if (lane == (fresh & 31)) {
      slot_key[fresh] = c.key;
      slot_info[fresh] = c.info;
      slot_lex[fresh] = c.lex;
      if (best_slot < 0 || ddtree_cand_better(c.key, c.lex, c.info, best_key, best_lex,
                                              best_info, node_parent, node_rank)) {
        best_key = c.key;
        best_lex = c.lex;
        best_info = c.info;
        best_slot = fresh;
      }
    }
  };
  // The frontier's best key when the last round computed it (the `rest` below), else 0.
  uint32_t known_top = 0u;
  while (popped < budget) {
    const uint32_t top = known_top != 0u ? known_top : __reduce_max_sync(DDTREE_FULL, best_key);
    if (top <= DDTREE_NEG_INF_KEY) break;  // nothing left, or only impossible nodes
    uint32_t info;
    const int owner =
        ddtree_pop_owner(top, best_key, best_lex, best_info, node_parent, node_rank, &info);
    const int win = __shfl_sync(DDTREE_FULL, best_slot, owner);
    const uint64_t lex = __shfl_sync(DDTREE_FULL, best_lex, owner);
    ++popped;
    ddtree_cand child, sibling;
    ddtree_pop_expand(popped, top, info, lex, popped == budget, draft_len, top_k, bits, lp,
                      counts, node_parent, node_rank, node_depth, node_score, child, sibling);
    if (popped == budget) break;
    // The popped slot takes the worse successor (the child goes first on equal keys: its rank
    // tuple is the smaller); the better one, `next`, waits outside the slots.
    const bool child_first = child.key != 0u && child.key >= sibling.key;
    ddtree_cand next = child_first ? child : sibling;
    const ddtree_cand second = child_first ? sibling : child;
    if (lane == owner) {
      slot_key[win] = second.key;
      slot_info[win] = second.info;
      slot_lex[win] = second.lex;
    }
    __syncwarp();
    // The owner's new best: the whole warp reads the owner's slots (owner + 32 * lane) and
    // reduces them like a pop, instead of the owner rescanning them one after another.
    const int sl = owner + 32 * lane;
    uint32_t k = 0u, i = 0u;
    uint64_t l = 0ull;
    if (sl < size) {
      k = slot_key[sl];
      l = slot_lex[sl];
      i = slot_info[sl];
    }
    const uint32_t again = __reduce_max_sync(DDTREE_FULL, k);
    if (again != 0u) {
      uint32_t again_info;
      const int who = ddtree_pop_owner(again, k, l, i, node_parent, node_rank, &again_info);
      const uint64_t again_lex = __shfl_sync(DDTREE_FULL, l, who);
      if (lane == owner) {
        best_key = again;
        best_lex = again_lex;
        best_info = again_info;
        best_slot = owner + 32 * who;
      }
    } else if (lane == owner) {
      best_key = 0;
      best_slot = -1;
    }
    // The best key of the rest of the frontier. While `next` beats it strictly, `next` is the
    // next pop, known to every lane: pop a chain of such successors with no reduction, each
    // time putting the other successor in a fresh slot.
    uint32_t rest = max(__reduce_max_sync(DDTREE_FULL, best_key), (uint32_t)DDTREE_NEG_INF_KEY);
    while (next.key > rest) {
      if (popped + 1 < budget) {
        // A sibling run (ddtree_sibling_run) of m >= 0 pops. Lane j records X_j and puts C_j in
        // fresh slot size + j (lane (size + j) % 32, none twice); X_m becomes `next`.
        const int p = next.info & 2047, k = (next.info >> 11) & 1023, d = next.info >> 21;
        const float parent_score = node_score[p];
        const uint32_t c0 = ddtree_child_key(ddtree_key_to_float(next.key), d, draft_len, top_k,
                                             lp, counts);
        const ddtree_run run = ddtree_sibling_run(next.key, c0, parent_score, k, d, rest,
                                                  budget - popped - 1, draft_len, top_k, lp,
                                                  counts);
        if (run.m > 0) {
          if (lane < run.m) {
            ddtree_store_node(popped + 1 + lane, p, k + lane, d, ddtree_key_to_float(run.x),
                              node_parent, node_rank, node_depth, node_score);
          }
          __syncwarp();  // the tie-break below may walk the new nodes
          const int shift = 64 - bits * d;  // X_j's prefix: X_0's with rank + j at depth d
          const uint64_t x_lex = shift >= 0 ? next.lex + ((uint64_t)lane << shift) : next.lex;
          const int from = (lane - size) & 31;
          const uint32_t key = __shfl_sync(DDTREE_FULL, run.c, from);
          const uint64_t lex =
              ddtree_lex_extend(__shfl_sync(DDTREE_FULL, x_lex, from), 0, d + 1, bits);
          if (from < run.m) {
            const int fresh = size + from;
            const uint32_t info = ddtree_pack_slot(popped + 1 + from, 0, d + 1);
            slot_key[fresh] = key;
            slot_info[fresh] = info;
            slot_lex[fresh] = lex;
            if (key != 0u && (best_slot < 0 || ddtree_cand_better(key, lex, info, best_key,
                                                                  best_lex, best_info,
                                                                  node_parent, node_rank))) {
              best_key = key;
              best_lex = lex;
              best_info = info;
              best_slot = fresh;
            }
          }
          next.key = __shfl_sync(DDTREE_FULL, run.x, run.m);
          next.info = ddtree_pack_slot(p, k + run.m, d);
          next.lex = __shfl_sync(DDTREE_FULL, x_lex, run.m);
          size += run.m;
          popped += run.m;
          rest = run.rest;
        }
      }
      ++popped;
      ddtree_cand c, s;
      ddtree_pop_expand(popped, next.key, next.info, next.lex, popped == budget, draft_len,
                        top_k, bits, lp, counts, node_parent, node_rank, node_depth,
                        node_score, c, s);
      if (popped == budget) break;
      next = ddtree_chain_successor(c, s, rest, insert);
    }
    if (popped == budget) break;
    if (next.key != 0u) insert(next);  // the chain's last successor joins the frontier
    known_top = rest;  // no slot holds more: `next` and every inserted key are at most rest
  }
  return popped;
}

// The register select's popped nodes (root included): budgets up to 96.
#define DDTREE_REG_MAX_NODES 97

// A rank tuple packed in two words for the register select's exact ties: depth d's rank + 1 in
// `bits` bits, `per` = 64 / bits depths per word (depths 1..per in hi, per + 1..2 per in lo), 0
// past the node's depth, so that comparing (hi, lo) is comparing tuples, a prefix first. Depths
// past 2 per are not packed: two tuples that differ only there compare equal, and the caller
// walks parents (at budget 64: 7 bits, 18 depths packed).
struct ddtree_lex2 {
  uint64_t hi, lo;
};

// `lex` with `add` added to depth's field: a node's tuple from its parent's (add = rank + 1).
// Fields never carry: rank + 1 <= top_k < 2^bits.
__device__ __forceinline__ ddtree_lex2 ddtree_lex2_add(ddtree_lex2 lex, int depth, int add,
                                                       int bits, int per) {
  const int i = depth - 1;
  if (i < per) {
    lex.hi += (uint64_t)add << (64 - bits * (i + 1));
  } else if (i < 2 * per) {
    lex.lo += (uint64_t)add << (64 - bits * (i - per + 1));
  }
  return lex;
}

// The packed tuple of a frontier candidate (packed parent, rank, depth) from its parent's.
__device__ __forceinline__ ddtree_lex2 ddtree_cand_lex2(uint32_t info, const ddtree_lex2* node_lex,
                                                        int bits, int per) {
  return ddtree_lex2_add(node_lex[info & 2047], info >> 21, ((info >> 11) & 1023) + 1, bits, per);
}

// The packed tuples of popped nodes 1..popped, each by walking its parents (lane l takes nodes
// l + 1, l + 33, ...), out of line: the register select builds them once, at a request's first
// exact tie, and from then on extends each pop's from its parent's. One whole warp calls it.
__device__ __noinline__ void ddtree_fill_lex2(int popped, int bits, int per,
                                              const int16_t* node_parent, const int16_t* node_rank,
                                              const int8_t* node_depth, ddtree_lex2* node_lex) {
  for (int n = 1 + (threadIdx.x & 31); n <= popped; n += 32) {
    ddtree_lex2 lex = {0ull, 0ull};
    for (int j = n; j > 0; j = node_parent[j]) {
      lex = ddtree_lex2_add(lex, node_depth[j], node_rank[j] + 1, bits, per);
    }
    node_lex[n] = lex;
  }
  __syncwarp();
}

// The lane holding the warp's smallest tuple among the lanes with `in` set (their best
// candidates at the top key, `info` / `lex`): a warp min of each 32-bit word in turn while more
// than one lane is left, then, for tuples equal in every packed depth, walks of the popped
// nodes' parents. Every lane calls it; *win_info receives the winner's info.
__device__ __forceinline__ int ddtree_lex2_owner(bool in, uint32_t info, ddtree_lex2 lex,
                                                 const int16_t* node_parent,
                                                 const int16_t* node_rank, uint32_t* win_info) {
  const uint32_t words[4] = {(uint32_t)(lex.hi >> 32), (uint32_t)lex.hi, (uint32_t)(lex.lo >> 32),
                             (uint32_t)lex.lo};
  uint32_t tied = __ballot_sync(DDTREE_FULL, in);
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    if ((tied & (tied - 1)) == 0) break;
    in = ddtree_keep_least(in, words[w]);
    tied = __ballot_sync(DDTREE_FULL, in);
  }
  return ddtree_tied_owner(tied, info, node_parent, node_rank, win_info);
}

// A compile-time flag for a generic lambda's two instances.
template <bool B>
struct ddtree_flag {
  static constexpr bool value = B;
};

// A register frontier slot: the candidate (score key, 0: none; packed parent, rank, depth), its
// parent's score, and the keys of its own first child and next sibling, computed when it enters
// the frontier so that popping it needs no memory access on the path to the next pop.
struct ddtree_reg_slot {
  uint32_t key, info;
  float parent_score;
  uint32_t child_key, sibling_key;
};

// The register slot of a candidate at `depth` (1-based) with the given rank, score key and
// parent score (see ddtree_reg_slot).
__device__ __forceinline__ ddtree_reg_slot ddtree_make_slot(uint32_t key, int parent, int rank,
                                                            int depth, float parent_score,
                                                            int draft_len, int top_k,
                                                            const float* lp, const int* counts) {
  const float score = ddtree_key_to_float(key);
  ddtree_reg_slot slot;
  slot.key = key;
  slot.info = ddtree_pack_slot(parent, rank, depth);
  slot.parent_score = parent_score;
  slot.child_key = ddtree_child_key(score, depth, draft_len, top_k, lp, counts);
  slot.sibling_key = ddtree_sibling_key(parent_score, rank, depth, top_k, lp, counts);
  return slot;
}

// The same pops with the frontier in registers: slot g is register g / 32 of lane g % 32, REGS
// per lane, budget <= 32 * REGS (the frontier never exceeds the budget). A pop is a warp max of
// the lanes' largest keys; when one slot of the warp holds it (the common case) its lane
// broadcasts the slot, whose children's keys are already known. Exact ties (common on peaked
// bf16 rows) compare the candidates' rank tuples packed in two words (ddtree_lex2). The pop
// loop is compiled twice: the first copy stores no tuples and stops at a request's first tie,
// the popped nodes' tuples are then built by walking their parents, and the second copy extends
// each pop's from its parent's (one loop testing a flag cost 5 % on rows without ties: session
// 20 in docs/kernels.md). Register masks rather
// than index compares pick slots: the compiler keeps them as selects on registers instead of
// moving `slot` to local memory.
template <int REGS>
__device__ __forceinline__ int ddtree_select_pops_registers(int budget, int draft_len, int top_k,
                                                            const float* lp, const int* counts,
                                                            int16_t* node_parent,
                                                            int16_t* node_rank,
                                                            int8_t* node_depth,
                                                            float* node_score,
                                                            ddtree_lex2* node_lex) {
  const int lane = threadIdx.x & 31;
  const int bits = 32 - __clz(top_k);  // rank + 1 <= top_k
  const int per = 64 / bits;
  node_lex[0] = {0ull, 0ull};  // every lane, the same value (reads follow a __syncwarp)
  ddtree_reg_slot slot[REGS];
#pragma unroll
  for (int r = 0; r < REGS; ++r) slot[r] = {0u, 0u, 0.0f, 0u, 0u};
  if (lane == 0) {  // slot 0: the best depth-1 token
    const uint32_t key = ddtree_child_key(0.0f, 0, draft_len, top_k, lp, counts);
    slot[0] = ddtree_make_slot(key, 0, 0, 1, 0.0f, draft_len, top_k, lp, counts);
  }
  int size = 1, popped = 0;
  // Puts candidate c in a fresh slot (a register mask picks it: see above).
  auto insert = [&](const ddtree_reg_slot& c) {
    const int fresh = size++;
    const uint32_t fresh_reg = lane == (fresh & 31) ? 1u << (fresh >> 5) : 0u;
#pragma unroll
    for (int r = 0; r < REGS; ++r) {
      if (fresh_reg & (1u << r)) slot[r] = c;
    }
  };
  // The frontier's best key when the last round computed it (the `rest` below), else 0.
  uint32_t known_top = 0u;
  // The pop loop, compiled twice: without tuples (LEX false) it returns true at the first exact
  // tie, before that round changes anything, and the loop with tuples takes over from there.
  const auto pops = [&](auto lex_tag) -> bool {
    constexpr bool LEX = decltype(lex_tag)::value;
    while (popped < budget) {
      uint32_t mine = 0u;
#pragma unroll
      for (int r = 0; r < REGS; ++r) mine = max(mine, slot[r].key);
      const uint32_t top = known_top != 0u ? known_top : __reduce_max_sync(DDTREE_FULL, mine);
      if (top <= DDTREE_NEG_INF_KEY) break;  // nothing left, or only impossible nodes
      uint32_t at_top = 0u;  // this lane's slots holding the top key
#pragma unroll
      for (int r = 0; r < REGS; ++r) at_top |= (slot[r].key == top ? 1u : 0u) << r;
      const uint32_t lanes = __ballot_sync(DDTREE_FULL, at_top != 0u);
      const uint32_t several = __ballot_sync(DDTREE_FULL, (at_top & (at_top - 1u)) != 0u);
      int owner;
      uint32_t pick;  // the owner's popped slot, as a register mask
      if ((lanes & (lanes - 1u)) == 0u && several == 0u) {
        owner = __ffs(lanes) - 1;
        pick = at_top;
      } else {
        // An exact score tie: this lane's smallest tuple at the top key, then the warp's, by the
        // packed tuples (parents walked only where they agree in every packed depth).
        if constexpr (!LEX) return true;
        __syncwarp();  // the node tables the tie-break reads are complete
        uint32_t best_info = 0u;
        ddtree_lex2 best_lex = {0ull, 0ull};
        int best = -1;
#pragma unroll
        for (int r = 0; r < REGS; ++r) {
          if (slot[r].key == top) {
            const ddtree_lex2 lex = ddtree_cand_lex2(slot[r].info, node_lex, bits, per);
            bool smaller = best < 0;
            if (!smaller) {
              smaller = lex.hi != best_lex.hi   ? lex.hi < best_lex.hi
                        : lex.lo != best_lex.lo ? lex.lo < best_lex.lo
                                                : ddtree_slot_lex_less(slot[r].info, best_info,
                                                                       node_parent, node_rank);
            }
            if (smaller) {
              best_info = slot[r].info;
              best_lex = lex;
              best = r;
            }
          }
        }
        uint32_t info;
        owner = ddtree_lex2_owner(best >= 0, best_info, best_lex, node_parent, node_rank, &info);
        pick = best >= 0 ? 1u << best : 0u;
      }
      ddtree_reg_slot won = slot[0];
#pragma unroll
      for (int r = 1; r < REGS; ++r) {
        if (pick & (1u << r)) won = slot[r];
      }
      const uint32_t info = __shfl_sync(DDTREE_FULL, won.info, owner);
      const float parent_score = __shfl_sync(DDTREE_FULL, won.parent_score, owner);
      const uint32_t child_key = __shfl_sync(DDTREE_FULL, won.child_key, owner);
      const uint32_t sibling_key = __shfl_sync(DDTREE_FULL, won.sibling_key, owner);
      const float score = ddtree_key_to_float(top);
      const int parent = info & 2047, rank = (info >> 11) & 1023, depth = info >> 21;
      ++popped;
      ddtree_store_node(popped, parent, rank, depth, score, node_parent, node_rank, node_depth,
                        node_score);
      if constexpr (LEX) {
        __syncwarp();  // the parent's tuple, stored by every lane, is complete
        node_lex[popped] = ddtree_cand_lex2(info, node_lex, bits, per);
      }
      if (popped == budget) break;
      // The popped slot takes the first child, else the next sibling; a fresh slot takes the
      // sibling when there are both.
      const ddtree_reg_slot child = ddtree_make_slot(child_key, popped, 0, depth + 1, score,
                                                     draft_len, top_k, lp, counts);
      const ddtree_reg_slot sibling = ddtree_make_slot(sibling_key, parent, rank + 1, depth,
                                                       parent_score, draft_len, top_k, lp, counts);
      const uint32_t popped_reg = lane == owner ? pick : 0u;
      // The best key of the rest of the frontier (every slot but the popped one).
      uint32_t other = 0u;
#pragma unroll
      for (int r = 0; r < REGS; ++r) {
        if (!(popped_reg & (1u << r))) other = max(other, slot[r].key);
      }
      uint32_t rest = max(__reduce_max_sync(DDTREE_FULL, other), (uint32_t)DDTREE_NEG_INF_KEY);
      // The better successor (the child on equal keys: its rank tuple is the smaller). When it
      // beats the whole rest strictly it is the next pop, known to every lane: pop a chain of such
      // successors with no warp reduction, each time putting the other successor in a fresh slot.
      const bool child_first = child_key != 0u && child_key >= sibling_key;
      ddtree_reg_slot next = child_first ? child : sibling;
      if (next.key <= rest) {
        uint32_t fresh_reg = 0u;
        if (child_key != 0u && sibling_key != 0u) {
          const int fresh = size++;
          fresh_reg = lane == (fresh & 31) ? 1u << (fresh >> 5) : 0u;
        }
        const bool take_child = child_key != 0u;
#pragma unroll
        for (int r = 0; r < REGS; ++r) {
          if (popped_reg & (1u << r)) slot[r] = take_child ? child : sibling;
          if (fresh_reg & (1u << r)) slot[r] = sibling;
        }
        known_top = rest;  // the successors are at most rest
        continue;
      }
      {
        const ddtree_reg_slot second = child_first ? sibling : child;  // key 0: none
#pragma unroll
        for (int r = 0; r < REGS; ++r) {
          if (popped_reg & (1u << r)) slot[r] = second;
        }
        rest = max(rest, second.key);
      }
      while (next.key > rest) {
        if (next.sibling_key > max(rest, next.child_key) && popped + 1 < budget) {
          // A sibling run (ddtree_sibling_run) of m >= 1 pops. Lane j records X_j and makes
          // C_j's slot, which joins fresh slot size + j (lane (size + j) % 32, none twice); X_m
          // becomes `next`.
          const int p = next.info & 2047, k = (next.info >> 11) & 1023, d = next.info >> 21;
          const ddtree_run run =
              ddtree_sibling_run(next.key, next.child_key, next.parent_score, k, d, rest,
                                 budget - popped - 1, draft_len, top_k, lp, counts);
          const float x_score = ddtree_key_to_float(run.x);
          if constexpr (LEX) __syncwarp();  // the parent's tuple is complete
          if (lane < run.m) {
            ddtree_store_node(popped + 1 + lane, p, k + lane, d, x_score, node_parent, node_rank,
                              node_depth, node_score);
            if constexpr (LEX) {
              node_lex[popped + 1 + lane] =
                  ddtree_lex2_add(node_lex[p], d, k + lane + 1, bits, per);
            }
          }
          const ddtree_reg_slot made = ddtree_make_slot(run.c, popped + 1 + lane, 0, d + 1, x_score,
                                                        draft_len, top_k, lp, counts);
          const int from = (lane - size) & 31;
          ddtree_reg_slot got;
          got.key = __shfl_sync(DDTREE_FULL, made.key, from);
          got.info = __shfl_sync(DDTREE_FULL, made.info, from);
          got.parent_score = __shfl_sync(DDTREE_FULL, made.parent_score, from);
          got.child_key = __shfl_sync(DDTREE_FULL, made.child_key, from);
          got.sibling_key = __shfl_sync(DDTREE_FULL, made.sibling_key, from);
          const uint32_t fresh_reg = from < run.m ? 1u << ((size + from) >> 5) : 0u;
#pragma unroll
          for (int r = 0; r < REGS; ++r) {
            if (fresh_reg & (1u << r)) slot[r] = got;
          }
          const uint32_t after = __shfl_sync(DDTREE_FULL, run.x, (run.m + 1) & 31);
          next.key = __shfl_sync(DDTREE_FULL, run.x, run.m);
          next.child_key = __shfl_sync(DDTREE_FULL, run.c, run.m);
          next.info = ddtree_pack_slot(p, k + run.m, d);
          next.sibling_key = run.m < 31 ? after
                                        : ddtree_sibling_key(next.parent_score, k + run.m, d, top_k,
                                                             lp, counts);
          size += run.m;
          popped += run.m;
          rest = run.rest;
        }
        const float next_score = ddtree_key_to_float(next.key);
        const int p = next.info & 2047, k = (next.info >> 11) & 1023, d = next.info >> 21;
        ++popped;
        ddtree_store_node(popped, p, k, d, next_score, node_parent, node_rank, node_depth,
                          node_score);
        if constexpr (LEX) {
          __syncwarp();  // as above
          node_lex[popped] = ddtree_cand_lex2(next.info, node_lex, bits, per);
        }
        if (popped == budget) break;
        const ddtree_reg_slot c = ddtree_make_slot(next.child_key, popped, 0, d + 1, next_score,
                                                   draft_len, top_k, lp, counts);
        const ddtree_reg_slot s = ddtree_make_slot(next.sibling_key, p, k + 1, d,
                                                   next.parent_score, draft_len, top_k, lp,
                                                   counts);
        next = ddtree_chain_successor(c, s, rest, insert);
      }
      if (popped == budget) break;
      if (next.key != 0u) insert(next);  // the chain's last successor joins the frontier
      known_top = rest;  // no slot holds more: `next` and every inserted key are at most rest
    }
    return false;
  };
  if (pops(ddtree_flag<false>{})) {
    __syncwarp();  // the node tables the tuples are built from are complete
    ddtree_fill_lex2(popped, bits, per, node_parent, node_rank, node_depth, node_lex);
    pops(ddtree_flag<true>{});
  }
  __syncwarp();  // the node tables are complete
  return popped;
}

// ---------------------------------------------------------------------------------------------
// The wide select (the plan's larger budgets, when it gives the launch a store): the whole block
// finds the same pops as the serial paths without popping one node at a time.
//
// The set of nodes whose score key is >= t is closed under parents and earlier siblings (log-
// probs are <= 0 and rows sorted), so it can be listed level by level: a node's children at or
// above t are a prefix of its row (a binary search), a block prefix sum places them, and each
// level is kept in lexicographic order (parents in order, ranks ascending). t starts at the
// smallest finite key. Whenever the next level would overflow the store (`cap` nodes), t rises
// and the store drops the nodes below it: first to the budget-th best stored key (a radix
// select; at least budget nodes are at or above it), then, if the level still overflows, by
// bisection (of score values, then keys) to a key at which the stored nodes and the next level's
// candidates number from budget to cap / 2. So t stays at or below the budget-th node's key T,
// and at the end every node >= t is stored: the pops are the first `budget` of them by (key
// descending, preorder ascending), the preorder being the lexicographic order of rank tuples
// (from subtree sizes). Exact score ties at T resolve as in the serial paths. If a bisection
// finds no such key (ties wider than the store), the caller falls back to the serial select.
//
// Store (dynamic shared memory for `cap` nodes, 25 * cap + 16 * sort_size + 4 bytes: tree_cuda's
// wide_select_bytes): composites or scratch (uint64), the sort buffer (2 * sort_size uint64),
// score (fp32), work and aux (int32; work has one more entry), parent (int16, -1 at depth 1),
// rank (int16), depth (int8).

struct ddtree_wide_store {
  uint64_t* cand;
  uint64_t* sorted;
  float* score;
  int* work;
  int* aux;
  int16_t* parent;
  int16_t* rank;
  int8_t* depth;
};

__device__ ddtree_wide_store ddtree_wide_layout(unsigned char* base, int cap, int sort_size) {
  ddtree_wide_store s;
  s.cand = reinterpret_cast<uint64_t*>(base);
  s.sorted = s.cand + cap;
  s.score = reinterpret_cast<float*>(s.sorted + 2 * sort_size);
  s.work = reinterpret_cast<int*>(s.score + cap);
  s.aux = s.work + cap + 1;
  s.parent = reinterpret_cast<int16_t*>(s.aux + cap);
  s.rank = s.parent + cap;
  s.depth = reinterpret_cast<int8_t*>(s.rank + cap);
  return s;
}

// Sum of v over the block (every thread gets it). `scratch` holds 32 ints.
__device__ int ddtree_block_sum_int(int v, int* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = __reduce_add_sync(DDTREE_FULL, v);
  __syncthreads();  // scratch is free
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  int total = 0;
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += scratch[w];
  return total;
}

// In-place exclusive prefix sum of a[0, len) (shared); returns the total. Each thread sums a
// contiguous chunk; barriers before (a is complete) and after (a and scratch are reusable).
__device__ int ddtree_block_scan(int* a, int len, int* scratch) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = (len + (int)blockDim.x - 1) / (int)blockDim.x;
  const int begin = min(tid * per, len), end = min(begin + per, len);
  __syncthreads();
  int local = 0;
  for (int i = begin; i < end; ++i) local += a[i];
  const int incl = ddtree_warp_inclusive_sum(local);
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  int run = incl - local, total = 0;
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
    const int v = scratch[w];
    run += w < warp ? v : 0;
    total += v;
  }
  for (int i = begin; i < end; ++i) {
    const int v = a[i];
    a[i] = run;
    run += v;
  }
  __syncthreads();
  return total;
}

// Number of children at or above key t of a node with score s at `depth` (>= 1): the prefix of
// row `depth` (counts[depth] possible tokens) with key(s + lp) >= t. Most nodes have few, so
// the search gallops from the row's start (probes 0, 1, 3, 7, ...) before it bisects.
__device__ __forceinline__ int ddtree_children_at_least(float s, int depth, uint32_t t,
                                                        int top_k, const float* lp,
                                                        const int* counts) {
  if (ddtree_order_key(s) < t) return 0;  // children are no better than their parent
  const float* row = lp + depth * top_k;
  const int n = counts[depth];
  auto passes = [&](int r) { return ddtree_order_key(s + row[r] + 0.0f) >= t; };
  int lo = 0, hi = n, width = 1;  // every rank below lo passes; none from hi on
  for (int probe = 0; probe < n; probe += width, width <<= 1) {
    if (!passes(probe)) {
      hi = probe;
      break;
    }
    lo = probe + 1;
  }
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (passes(mid)) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Keeps the stored nodes [0, stored) whose key is >= t, in order, with parents renumbered.
// Updates stored and level_start (the first node of the last level). Every thread calls it.
__device__ void ddtree_wide_compact(const ddtree_wide_store& s, uint32_t t, int& stored,
                                    int& level_start, int* scratch) {
  for (int i = threadIdx.x; i < stored; i += blockDim.x) {
    s.work[i] = ddtree_order_key(s.score[i]) >= t ? 1 : 0;
  }
  const int alive = ddtree_block_scan(s.work, stored, scratch);
  const int new_start = level_start < stored ? s.work[level_start] : alive;
  for (int i = threadIdx.x; i < stored; i += blockDim.x) {
    if (ddtree_order_key(s.score[i]) >= t) {
      const int p = s.parent[i];  // alive too: a parent is no worse than its child
      const uint32_t parent = p < 0 ? 0xFFFFu : (uint32_t)s.work[p];
      s.cand[s.work[i]] = (uint64_t)__float_as_uint(s.score[i]) << 32 | parent << 16 |
                          (uint32_t)s.rank[i] << 6 | (uint32_t)s.depth[i];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < alive; i += blockDim.x) {
    const uint64_t c = s.cand[i];
    const uint32_t parent = (uint32_t)(c >> 16) & 0xFFFFu;
    s.score[i] = __uint_as_float((uint32_t)(c >> 32));
    s.parent[i] = parent == 0xFFFFu ? (int16_t)-1 : (int16_t)parent;
    s.rank[i] = (int16_t)((c >> 6) & 1023u);
    s.depth[i] = (int8_t)(c & 63u);
  }
  __syncthreads();
  stored = alive;
  level_start = new_start;
}

// Children counts of the last level [level_start, stored) at threshold t (depth-`depth` row),
// as exclusive offsets in work[0, stored - level_start); returns their total.
__device__ int ddtree_wide_offsets(const ddtree_wide_store& s, int level_start, int stored,
                                   int depth, uint32_t t, int top_k, const float* lp,
                                   const int* counts, int* scratch) {
  const int nodes = stored - level_start;
  for (int i = threadIdx.x; i < nodes; i += blockDim.x) {
    s.work[i] = ddtree_children_at_least(s.score[level_start + i], depth, t, top_k, lp, counts);
  }
  return ddtree_block_scan(s.work, nodes, scratch);
}

// Stored nodes >= t plus the last level's children >= t.
__device__ int ddtree_wide_count(const ddtree_wide_store& s, int level_start, int stored,
                                 int depth, uint32_t t, int top_k, const float* lp,
                                 const int* counts, int* scratch) {
  int local = 0;
  for (int i = threadIdx.x; i < stored; i += blockDim.x) {
    local += ddtree_order_key(s.score[i]) >= t ? 1 : 0;
  }
  for (int i = level_start + (int)threadIdx.x; i < stored; i += blockDim.x) {
    local += ddtree_children_at_least(s.score[i], depth, t, top_k, lp, counts);
  }
  return ddtree_block_sum_int(local, scratch);
}

// The wide select of one request (see above): writes nodes 1..popped of the node tables and
// returns popped, or -1 when the store cannot hold the ties (nothing written). Every thread of
// the block calls it; budget >= 1.
__device__ __noinline__ int ddtree_select_pops_wide(int budget, int draft_len, int top_k,
                                                    const float* lp, const int* counts,
                                                    unsigned char* store, int cap,
                                                    int sort_size, int16_t* node_parent,
                                                    int16_t* node_rank, int8_t* node_depth,
                                                    float* node_score) {
  __shared__ int scratch[32];
  __shared__ float fscratch[32];
  __shared__ int level_of[DDTREE_MAX_DEPTH + 2];
  __shared__ uint32_t hist[256];
  __shared__ ddtree_select_scratch select_scratch;
  __shared__ int counter;
  const int tid = threadIdx.x;
  const ddtree_wide_store s = ddtree_wide_layout(store, cap, sort_size);
  if (counts[0] == 0) return 0;
  uint32_t t = DDTREE_NEG_INF_KEY + 1;  // the smallest finite key
  int stored = counts[0], level_start = 0;  // counts[0] <= top_k <= cap
  for (int r = tid; r < stored; r += blockDim.x) {
    s.score[r] = 0.0f + lp[r] + 0.0f;
    s.parent[r] = -1;
    s.rank[r] = (int16_t)r;
    s.depth[r] = 1;
  }
  __syncthreads();
  for (int depth = 1; depth < draft_len && counts[depth] > 0; ++depth) {
    // Every stored node is >= t here (t rises only with a compaction; children join >= t).
    int m = ddtree_wide_offsets(s, level_start, stored, depth, t, top_k, lp, counts, scratch);
    if (stored + m > cap && stored >= budget) {
      // Raise t to the budget-th best stored key (budget nodes are at or above it).
      for (int i = tid; i < stored; i += blockDim.x) {
        s.cand[i] = (uint64_t)ddtree_order_key(s.score[i]) << 32 | (uint32_t)i;
      }
      const uint64_t kth =
          ddtree_radix_select<true>(s.cand, stored, budget, false, hist, &select_scratch);
      t = max(t, (uint32_t)(kth >> 32));
      ddtree_wide_compact(s, t, stored, level_start, scratch);
      m = ddtree_wide_offsets(s, level_start, stored, depth, t, top_k, lp, counts, scratch);
    }
    if (stored + m > cap) {
      // Raise t to a key with from budget to cap / 2 stored nodes and candidates at or above
      // it, bisecting the scores' values (then keys). Every candidate is at or above the
      // lowest stored score plus the row's last log-prob, and more than cap are at or above t;
      // none is above the best stored score.
      float low = DDTREE_INF, high = -DDTREE_INF;
      for (int i = tid; i < stored; i += blockDim.x) {
        low = fminf(low, s.score[i]);
        high = fmaxf(high, s.score[i]);
      }
      high = ddtree_block_reduce_max(high, fscratch);
      low = -ddtree_block_reduce_max(-low, fscratch);
      uint32_t lo = max(t, ddtree_order_key(low + lp[depth * top_k + counts[depth] - 1] + 0.0f));
      uint32_t hi = ddtree_order_key(high) + 1u;
      bool found = false;
      while (hi - lo > 1u) {
        uint32_t mid =
            ddtree_order_key(0.5f * (ddtree_key_to_float(lo) + ddtree_key_to_float(hi)) + 0.0f);
        if (mid <= lo || mid >= hi) mid = lo + (hi - lo) / 2u;
        const int c = ddtree_wide_count(s, level_start, stored, depth, mid, top_k, lp, counts,
                                        scratch);
        if (c > cap / 2) {
          lo = mid;
        } else if (c < budget) {
          hi = mid;
        } else {
          t = mid;
          found = true;
          break;
        }
      }
      if (!found) return -1;
      ddtree_wide_compact(s, t, stored, level_start, scratch);
      m = ddtree_wide_offsets(s, level_start, stored, depth, t, top_k, lp, counts, scratch);
    }
    if (m == 0) break;
    // The next level: child j belongs to the last node i with offset <= j.
    const int nodes = stored - level_start;
    const float* row = lp + depth * top_k;
    for (int j = tid; j < m; j += blockDim.x) {
      int lo = 0, hi = nodes;  // work[lo] <= j < work[hi] (work[nodes] = m)
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (s.work[mid] <= j) {
          lo = mid;
        } else {
          hi = mid;
        }
      }
      const int p = level_start + lo, r = j - s.work[lo];
      s.score[stored + j] = s.score[p] + row[r] + 0.0f;
      s.parent[stored + j] = (int16_t)p;
      s.rank[stored + j] = (int16_t)r;
      s.depth[stored + j] = (int8_t)(depth + 1);
    }
    __syncthreads();
    level_start = stored;
    stored += m;
  }
  const int n = stored;  // every node >= t; the depths ascend
  const int max_depth = s.depth[n - 1];
  for (int i = tid; i < n; i += blockDim.x) {
    if (i == 0 || s.depth[i] != s.depth[i - 1]) level_of[s.depth[i]] = i;
    s.aux[i] = 1;
  }
  if (tid == 0) level_of[max_depth + 1] = n;
  __syncthreads();
  // Subtree sizes, deepest level first.
  for (int d = max_depth; d >= 2; --d) {
    for (int i = level_of[d] + tid; i < level_of[d + 1]; i += blockDim.x) {
      atomicAdd(&s.aux[s.parent[i]], s.aux[i]);
    }
    __syncthreads();
  }
  // Preorder (root 0): a node's follows its parent's by 1 plus its earlier siblings' sizes.
  int* pre = reinterpret_cast<int*>(s.cand);
  for (int i = tid; i < level_of[2]; i += blockDim.x) s.work[i] = s.aux[i];
  ddtree_block_scan(s.work, level_of[2], scratch);
  for (int i = tid; i < level_of[2]; i += blockDim.x) pre[i] = 1 + s.work[i];
  for (int d = 2; d <= max_depth; ++d) {
    const int a = level_of[d], b = level_of[d + 1];
    for (int i = a + tid; i < b; i += blockDim.x) s.work[i - a] = s.aux[i];
    ddtree_block_scan(s.work, b - a, scratch);
    // Each parent's slot in aux (its size is spent) takes its first child's offset.
    for (int i = a + tid; i < b; i += blockDim.x) {
      if (i == a || s.parent[i] != s.parent[i - 1]) s.aux[s.parent[i]] = s.work[i - a];
    }
    __syncthreads();
    for (int i = a + tid; i < b; i += blockDim.x) {
      pre[i] = pre[s.parent[i]] + 1 + s.work[i - a] - s.aux[s.parent[i]];
    }
    __syncthreads();
  }
  // Composites: key, then the smaller preorder, then the store index (pre, i < 2^16).
  for (int i = tid; i < n; i += blockDim.x) s.work[i] = pre[i];
  __syncthreads();
  for (int i = tid; i < n; i += blockDim.x) {
    s.cand[i] = (uint64_t)ddtree_order_key(s.score[i]) << 32 |
                (uint64_t)(0xFFFFu - (uint32_t)s.work[i]) << 16 | (uint64_t)i;
  }
  for (int i = tid; i < 2 * sort_size; i += blockDim.x) s.sorted[i] = 0;
  if (tid == 0) counter = 0;
  __syncthreads();
  const int popped = min(budget, n);
  ddtree_order_row(s.cand, n, popped, sort_size, s.sorted, hist, &select_scratch, &counter);
  for (int j = tid; j < popped; j += blockDim.x) s.work[s.sorted[j] & 0xFFFFu] = j;
  __syncthreads();
  for (int j = tid; j < popped; j += blockDim.x) {
    const int i = (int)(s.sorted[j] & 0xFFFFu), p = s.parent[i];
    ddtree_store_node(1 + j, p < 0 ? 0 : 1 + s.work[p], s.rank[i], s.depth[i], s.score[i],
                      node_parent, node_rank, node_depth, node_score);
  }
  __syncthreads();
  return popped;
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
    int32_t lp_in_smem, int32_t batch, int32_t all_or_nothing, int32_t wide_cap,
    int32_t wide_min_budget, int32_t sort_size) {
  // [draft_len, top_k] when lp_in_smem, then (16-byte aligned) the wide select's store when
  // wide_cap > 0.
  extern __shared__ __align__(16) float lp_table[];
  __shared__ int16_t node_parent[DDTREE_MAX_NODES];
  __shared__ int16_t node_rank[DDTREE_MAX_NODES];
  __shared__ int8_t node_depth[DDTREE_MAX_NODES];
  __shared__ float node_score[DDTREE_MAX_NODES];
  __shared__ ddtree_lex2 node_lex[DDTREE_REG_MAX_NODES];  // the register select's tie tuples
  __shared__ int counts[DDTREE_MAX_DEPTH + 1];  // 0 past draft_len
  __shared__ int skip, total;
  ddtree_wait_for_previous_grid();  // launched dependent: the top-k or merge may still run
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t b = blockIdx.x;
  const float* lp_global = topk_lp + b * draft_len * (int64_t)top_k;
  const float* lp = lp_in_smem ? lp_table : lp_global;
  if (lp_in_smem) {
    // Eight loads in flight per thread before their stores (the pops read the table next).
    const int n = draft_len * top_k;
    for (int base = tid; base < n; base += 8 * SELECT_THREADS) {
      float v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int i = base + u * SELECT_THREADS;
        v[u] = i < n ? lp_global[i] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int i = base + u * SELECT_THREADS;
        if (i < n) lp_table[i] = v[u];
      }
    }
  }
  // Zero past draft_len: a last-depth node's missing child (key 0) asks counts[draft_len].
  for (int i = tid; i <= DDTREE_MAX_DEPTH; i += blockDim.x) {
    counts[i] = i < draft_len ? topk_count[b * draft_len + i] : 0;
  }
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
  if (all_or_nothing) {
    // Every block decides alike whether the batch is clean: a bad root or a request flagged on
    // entry anywhere leaves all outputs unwritten. Reading flags that another block may be
    // OR-ing TOKEN into is benign: that block's root is bad, which this block sees directly.
    bool bad = false;
    for (int i = tid; i < batch; i += blockDim.x) {
      const int64_t r = root_tokens[i];
      bad |= r < 0 || r >= vocab || error_flags[i] != 0;
    }
    if (__syncthreads_or(bad)) return;
  } else {
    __syncthreads();
  }
  const int budget = skip ? 0 : min(max(budgets[b], 0), num_nodes_max - 1);

  int popped = -1;
  if (wide_cap > 0 && budget >= wide_min_budget) {
    const int lp_floats = lp_in_smem ? (draft_len * top_k + 3) / 4 * 4 : 0;
    popped = ddtree_select_pops_wide(budget, draft_len, top_k, lp, counts,
                                     reinterpret_cast<unsigned char*>(lp_table + lp_floats),
                                     wide_cap, sort_size, node_parent, node_rank, node_depth,
                                     node_score);
    if (popped >= 0 && tid == 0) total = 1 + popped;
  }
  if (tid < 32 && popped < 0) {
    if (budget <= 64) {
      popped = ddtree_select_pops_registers<2>(budget, draft_len, top_k, lp, counts,
                                               node_parent, node_rank, node_depth, node_score,
                                               node_lex);
    } else if (budget <= 96) {
      popped = ddtree_select_pops_registers<3>(budget, draft_len, top_k, lp, counts,
                                               node_parent, node_rank, node_depth, node_score,
                                               node_lex);
    } else {
      popped = ddtree_select_pops_shared(budget, draft_len, top_k, lp, counts, node_parent,
                                         node_rank, node_depth, node_score);
    }
    if (lane == 0) total = 1 + popped;
  }
  __syncthreads();
  ddtree_select_write(total, b, root, topk_tok, draft_len, top_k, num_nodes_max, words,
                      node_parent, node_rank, node_depth, node_score, tokens, parents, depths,
                      log_probs, num_nodes, mask);
}
