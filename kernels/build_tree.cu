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
//    step (the loads `L1::no_allocate`), with the next step's loads in flight in a second set
//    of registers (the two sets trade roles every step; the step TOPK_PREFETCH ahead is asked
//    of L2) while a step is processed, and no block barrier after the first step (see below)
//    until the end. Per lane it keeps an online max and sum of exp(x - max) over finite x and a
//    count of +inf, a step at a time with no branch in the common case (each exponent one fma
//    with the maximum's rounding error put back per step). Candidates are 64-bit composites
//    order_key(x) << 32 | ~token (larger composite = larger scaled logit x, equal x smaller token
//    id). A vector whose largest entry reaches the block's running threshold is a "hit": its lane
//    stores the raw vector in the warp's hit buffer, and once DDTREE_EXPAND_AT hits are buffered
//    (the plan's expand_at: 32, or 128 from K 17 on where the larger buffers keep the blocks
//    per SM) the warp expands them together (32 a round, one vector per lane, a warp prefix sum
//    places the entries at or above the then current threshold in the warp's buffer of `cap`
//    composites). Before a round could overflow it, the warp keeps the K largest of its buffer
//    (a warp radix select) and raises the block threshold to the smallest of them (a lower bound
//    of the row's K-th largest entry: the warp saw K entries at or above it). A second, tighter bound: each warp publishes
//    a value it holds j = ceil(K / TOPK_WARPS) distinct entries at or above, and the smallest of
//    the warps' values bounds the row's K-th largest entry too (K entries in all are at or above
//    it). A warp publishes the j-th largest of its kept candidates after each shrink and, when
//    every warp of the block has a whole first step and j <= 32 * UNROLL, first the j-th largest
//    of its first-step vector maxima (one block barrier, so that the first steps already use it).
//    While it streams, when j <= TOPK_BOUND_MAX_J, a warp also publishes the j-th largest of its
//    lanes' running maxima (each lane's maximum is one entry, and the lanes' entries are
//    distinct; for j > 4 rounded down by at most 31 order-key steps) at steps 1, 2, 4, 8, ...
//    (every step or every second step was slower; without step 16's the top-k at B 32 K 64
//    took 15 % longer, and with one after the last step in its place 1 % longer). That bound
//    rises as the row streams by, so the threshold follows the row's K-th largest entry instead
//    of staying near the first steps' (B 32, K 64: 66 instead of 211 hit vectors per warp).
//    On random logits only O(K log(V / K)) entries ever pass. At the end every warp writes its
//    statistics and its candidates at or above the final threshold (a superset of its share of
//    the row's top K; its K largest if more than K are), padded with composite 0, as one "part"
//    of the row. With merge_here (the plan's choice: one block per row, at most two waves of
//    blocks, K <= 400 at UNROLL 4) the block instead merges the row itself with launch 2's
//    result (ddtree_merge_here: with DDTREE_MERGE_RANKS, from K 17 on, each warp sorts its
//    own candidates in the hit buffers and an entry's rank is the sum over the warps' sorted
//    lists of their entries above it; else the warps' parts are gathered there and ordered as
//    launch 2 orders them), and launch 2 is skipped. In early plans (DDTREE_EARLY_DEPTHS > 0:
//    merge_here with two waves of blocks) the blocks take the rows depth by depth (blockIdx.y =
//    depth * batch + request), so that the first wave holds every request's first depths, and
//    each block of a depth below DDTREE_EARLY_DEPTHS resets its row's ready flag before it lets
//    the select launch and raises it once the row is written (release order). A deeper row's
//    flag, reset by its block in the same way, is raised by the select instead, once it knows
//    that no pop reads the row; the block's warps read it a step before each lane-bound
//    publication, and one that finds it raised sets the block threshold above every composite
//    (DDTREE_UNNEEDED) and stops reading the row: from then on no warp records hits or keeps
//    candidates and no bound moves the threshold, every warp stops streaming at the publication
//    where it finds the flag, and the block writes nothing for the row. So only the rows some
//    pop may read are read to their end.
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
//    (ddtree_sibling_run). With the plan's bulk_after >= 0 (batches of 4 and more, budgets of 32
//    and more), at round bulk_after + 1 the bulk select may take a request's remaining budget:
//    warp 0 lists every untaken node above a threshold level by level, and after a barrier the
//    whole block ranks them and writes the first as the next pops (not on peaked rows, whose
//    deep trees the register pops take; build_tree_select_bulk.cuh). Budgets of at least
//    wide_min_budget, when the plan gives the launch a store (wide_cap nodes), take the wide
//    select instead (ddtree_select_pops_wide; the plan's choice: above 96): the whole block
//    lists every node above a rising score threshold level by level and orders them, and falls
//    back to the serial pops only when exact ties at the budget-th score outnumber half the
//    store. Shared memory: the popped nodes, the shared frontier or the bulk select's store (one
//    union), plus the per-depth log-prob table when it fits, plus the wide select's store.
//    An early plan's select (128 threads, so that every request's block fits beside the second
//    wave's top-k blocks) waits for the flags of its request's first DDTREE_EARLY_DEPTHS rows
//    instead of the whole top-k launch, and pops over those depths alone when their rows show
//    that no deeper node can enter the tree (ddtree_depths_suffice: the budget-th depth-1 token
//    scores strictly above the chain of those depths' best tokens, or a depth among them has no
//    possible token), and then raises the deeper rows' flags (above); else it waits for the
//    launch and loads the other rows. Either way the pops are those over every depth, and every
//    exit waits for the launch.
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
#ifndef DDTREE_EXPAND_AT
#define DDTREE_EXPAND_AT 32  // hit vectors a warp records before it expands them
#endif
#ifndef DDTREE_MERGE_RANKS
#define DDTREE_MERGE_RANKS 0  // 1: merge_here orders a row by its warps' ranks (when it may)
#endif
#ifndef MERGE_THREADS
#define MERGE_THREADS 256
#endif
#ifndef SELECT_THREADS
#define SELECT_THREADS 512  // 16 warps: the wide select's levels are block-parallel
#endif
// A block of fewer threads (an early select's 128) is asked to let 512 threads' worth share an
// SM, which caps its registers at 128 a thread as 512 threads do.
#if SELECT_THREADS < 512
#define DDTREE_SELECT_BOUNDS __launch_bounds__(SELECT_THREADS, 512 / SELECT_THREADS)
#else
#define DDTREE_SELECT_BOUNDS __launch_bounds__(SELECT_THREADS)
#endif
#ifndef DDTREE_EARLY_DEPTHS
#define DDTREE_EARLY_DEPTHS 0  // > 0: the select starts on the rows of the depths below it
#endif
// The top-k's rows, as the select reads them. An early select reads them while the top-k may
// still write other rows, so they are not read-only for its lifetime there: without
// __restrict__ they are never loaded through the read-only (non-coherent) data path.
#if DDTREE_EARLY_DEPTHS > 0
#define DDTREE_TOPK_ROWS
#else
#define DDTREE_TOPK_ROWS __restrict__
#endif
#ifndef DDTREE_BULK_AFTER
#define DDTREE_BULK_AFTER -1  // register select rounds before the bulk select (< 0: never)
#endif

#define DDTREE_FULL 0xFFFFFFFFu
#define DDTREE_LOG2E 1.4426950408889634f
// Composite of the smallest finite value with the largest token id: below every possible entry.
#define DDTREE_FINITE_FLOOR (((uint64_t)0x00800000u) << 32)
// A block threshold above every composite (its key is a NaN's, which no entry compares at or
// above): the row is not needed (early plans), and its block gathers no more candidates.
#define DDTREE_UNNEEDED (~0ull)

// Each launch's machinery is a header of its own, inlined here by the runtime compiler: the row
// helpers (composites, reductions, ordering and writing a row), then launch 1's top-k pass.
#include "build_tree_rows.cuh"
#include "build_tree_topk.cuh"

extern "C" __global__ void __launch_bounds__(TOPK_WARPS * 32, TOPK_MIN_BLOCKS) ddtree_build_topk(
    const ddtree_logit_t* __restrict__ logits,  // [rows, vocab]
    float temperature, int32_t vocab, int32_t span, int32_t top_k, int32_t cap,
    int32_t vectorized,
    uint64_t* __restrict__ part_keys,  // [rows, num_chunks * TOPK_WARPS, top_k] (merge_here: unused)
    float* __restrict__ part_stats,    // [rows, num_chunks * TOPK_WARPS, 3]: max, sum, +inf count
    int32_t merge_here, int32_t sort_size,  // merge_here: one block per row merges it (below)
    float* __restrict__ topk_lp,            // [rows, top_k] (merge_here only, as the merge's)
    int32_t* __restrict__ topk_tok,         // [rows, top_k]
    int32_t* __restrict__ topk_count,       // [rows]
    int32_t batch, int32_t draft_len,       // early plans: rows taken depth by depth
    int32_t* row_ready) {  // [rows] early plans: written (first depths) or unneeded (deeper)
  // [TOPK_WARPS, cap] candidate buffers, [TOPK_WARPS, DDTREE_HITS] hit vectors and their
  // [TOPK_WARPS, DDTREE_HITS] first tokens.
  extern __shared__ uint64_t smem[];
  __shared__ unsigned long long threshold;
  __shared__ uint32_t warp_bound[TOPK_WARPS];  // see the comment above; 0: none yet
  __shared__ uint32_t hist[TOPK_WARPS][256];
  // A dependent select may get its blocks resident early (early plans: once the flag is reset).
  if (DDTREE_EARLY_DEPTHS == 0) ddtree_allow_dependents();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunk = blockIdx.x;
  // Early plans (merge_here, one chunk a row) take the rows depth by depth, so that the first
  // wave holds every request's first depths. Each row's flag is reset here, before the select
  // may start (it starts once every block has passed ddtree_allow_dependents). The block of a
  // row of the depths below DDTREE_EARLY_DEPTHS raises it once the row is written; the select
  // raises the flag of a deeper row once it knows that its tree cannot reach the row (a hint:
  // the block then drops its candidates and the rest of the row, ddtree_topk_warp).
  const int64_t row = DDTREE_EARLY_DEPTHS > 0
                          ? (int64_t)(blockIdx.y % batch) * draft_len + blockIdx.y / batch
                          : (int64_t)blockIdx.y;
  const bool flags_row =
      DDTREE_EARLY_DEPTHS > 0 && (int)(blockIdx.y / batch) < DDTREE_EARLY_DEPTHS;
  const int32_t* unneeded = DDTREE_EARLY_DEPTHS > 0 && !flags_row ? row_ready + row : nullptr;
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
  if (threadIdx.x == 0) {
    threshold = DDTREE_FINITE_FLOOR;
    if (DDTREE_EARLY_DEPTHS > 0) {
      *(volatile int32_t*)(row_ready + row) = 0;
      __threadfence();
    }
  }
  // Block-uniform: every warp has a whole first step (a span holds at least TOPK_WARPS steps),
  // and j = ceil(K / warps) vectors of it.
  const bool first_threshold = (top_k + TOPK_WARPS - 1) / TOPK_WARPS <= 32 * UNROLL &&
                               span_begin + TOPK_WARPS * DDTREE_STEP <= vocab;
  if (lane == 0) warp_bound[warp] = 0;
  __syncthreads();
  if (DDTREE_EARLY_DEPTHS > 0) ddtree_allow_dependents();
  float m = -DDTREE_INF, s = 0.0f, infs = 0.0f;
  int count;
  if (temperature == 1.0f) {
    count = ddtree_topk_warp<true>(src, temperature, begin, end, top_k, cap, vectorized != 0,
                                   cand, hit_vec, hit_token, hist[warp], &threshold,
                                   first_threshold, warp_bound, unneeded, m, s, infs);
  } else {
    count = ddtree_topk_warp<false>(src, temperature, begin, end, top_k, cap, vectorized != 0,
                                    cand, hit_vec, hit_token, hist[warp], &threshold,
                                    first_threshold, warp_bound, unneeded, m, s, infs);
  }
  ddtree_warp_stats(m, s, infs);  // the warp's statistics, in every lane
  __syncthreads();  // every warp is done: the block threshold is final
  const uint64_t final_threshold = threshold;
  if (DDTREE_EARLY_DEPTHS > 0 && final_threshold == DDTREE_UNNEEDED) return;  // nobody reads it
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
    if (flags_row) ddtree_publish_flag(row_ready + row);
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

// Launch 3's machinery: the serial pops and the node writes, then the wide and the bulk selects.
#include "build_tree_select.cuh"
#include "build_tree_select_wide.cuh"
#include "build_tree_select_bulk.cuh"

extern "C" __global__ void DDTREE_SELECT_BOUNDS ddtree_build_select(
    const float* DDTREE_TOPK_ROWS topk_lp,       // [batch, draft_len, top_k]
    const int32_t* DDTREE_TOPK_ROWS topk_tok,    // [batch, draft_len, top_k]
    const int32_t* DDTREE_TOPK_ROWS topk_count,  // [batch, draft_len]
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
    int32_t wide_min_budget, int32_t sort_size,
    int32_t* row_ready) {
  // row_ready: [batch, draft_len], early plans (DDTREE_EARLY_DEPTHS > 0) only.
  // lp_table: [draft_len, top_k] when lp_in_smem, then (16-byte aligned) the wide select's store
  // when wide_cap > 0.
  extern __shared__ __align__(16) float lp_table[];
  __shared__ int16_t node_parent[DDTREE_MAX_NODES];
  __shared__ int16_t node_rank[DDTREE_MAX_NODES];
  __shared__ int8_t node_depth[DDTREE_MAX_NODES];
  __shared__ float node_score[DDTREE_MAX_NODES];
  __shared__ ddtree_lex2 node_lex[DDTREE_REG_MAX_NODES];  // the register select's tie tuples
  __shared__ ddtree_select_store frontier;
  __shared__ int counts[DDTREE_MAX_DEPTH + 1];  // 0 past the depths in use
  __shared__ int skip, total;
  __shared__ int bulk_taken;  // the taken nodes when the bulk select listed the rest, else -1
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t b = blockIdx.x;
  // Caller data that no launch of this op writes, read before the wait (the launch before this
  // one began after every earlier kernel of the stream had ended), so that after it the pops
  // wait for one round trip to L2 (the top-k lists), not two.
  const int64_t root = root_tokens[b];
  const int requested = budgets[b];
  const int entry_flags = tid == 0 ? error_flags[b] : 0;
  // Early plans start on the request's first `early` depths as soon as the top-k has flagged
  // their rows (while it streams the deeper ones); the pops keep to them when that gives the
  // whole tree (ddtree_depths_suffice), else wait for the whole launch. Every exit waits for
  // it: a grid may not end before the one it follows.
  const int early = DDTREE_EARLY_DEPTHS > 0 ? min(DDTREE_EARLY_DEPTHS, draft_len) : 0;
  if (early > 0) ddtree_wait_flags(row_ready + b * draft_len, early);  // a block barrier
  if (early == 0) ddtree_wait_for_previous_grid();  // the top-k or merge may still run
  const float* lp_global = topk_lp + b * draft_len * (int64_t)top_k;
  const float* lp = lp_in_smem ? lp_table : lp_global;
#if DDTREE_EARLY_DEPTHS > 0
  int use = early;  // depths whose rows the pops use (the first `early`, or every one)
#else
  const int use = draft_len;  // (a variable only in early plans: the others compile as before)
#endif
  ddtree_select_load_rows(0, use, top_k, lp_in_smem, lp_global, topk_count + b * draft_len,
                          lp_table, counts);
  if (tid == 0) {
    int flags = entry_flags;
    if (root < 0 || root >= vocab) {
      flags |= DDTREE_ERR_TOKEN;
      atomicOr(&error_flags[b], DDTREE_ERR_TOKEN);
    }
    skip = flags;
    bulk_taken = -1;
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
    if (__syncthreads_or(bad)) {
      if (early > 0) ddtree_wait_for_previous_grid();
      return;
    }
  } else {
    __syncthreads();
  }
  const int budget = skip ? 0 : min(max(requested, 0), num_nodes_max - 1);
#if DDTREE_EARLY_DEPTHS > 0
  if (use < draft_len && !ddtree_depths_suffice(use, budget, top_k, lp, counts)) {
    ddtree_wait_for_previous_grid();  // the tree may reach deeper: every row is needed
    ddtree_select_load_rows(use, draft_len, top_k, lp_in_smem, lp_global,
                            topk_count + b * draft_len, lp_table, counts);
    use = draft_len;
    __syncthreads();
  }
  // The deeper rows' blocks may drop their candidates: no pop reads those rows.
  for (int d = use + tid; d < draft_len; d += blockDim.x) {
    *(volatile int32_t*)(row_ready + b * draft_len + d) = 1;
  }
#endif

  int popped = -1;
  if (wide_cap > 0 && budget >= wide_min_budget) {
    const int lp_floats = lp_in_smem ? (draft_len * top_k + 3) / 4 * 4 : 0;
    popped = ddtree_select_pops_wide(budget, use, top_k, lp, counts,
                                     reinterpret_cast<unsigned char*>(lp_table + lp_floats),
                                     wide_cap, sort_size, node_parent, node_rank, node_depth,
                                     node_score);
    if (popped >= 0 && tid == 0) total = 1 + popped;
  }
  if (tid < 32 && popped < 0) {
    // The bulk select's listing; its pops are taken by the whole block below.
    const auto bulk = [&](int taken) {
      if (DDTREE_BULK_AFTER < 0) return -1;
      const int listed =
          ddtree_select_bulk_list(taken, budget, use, top_k, lp, counts, node_parent, node_rank,
                                  node_depth, node_score, node_lex, frontier.bulk);
      if (listed < 0) return -1;
      if (lane == 0) bulk_taken = taken;
      return taken + min(budget - taken, listed);
    };
    if (budget <= 64) {
      popped = ddtree_select_pops_registers<2>(budget, use, top_k, lp, counts, node_parent,
                                               node_rank, node_depth, node_score, node_lex, bulk);
    } else if (budget <= 96) {
      popped = ddtree_select_pops_registers<3>(budget, use, top_k, lp, counts, node_parent,
                                               node_rank, node_depth, node_score, node_lex, bulk);
    } else {
      popped = ddtree_select_pops_shared(budget, use, top_k, lp, counts, node_parent, node_rank,
                                         node_depth, node_score, frontier.shared);
    }
    if (lane == 0) total = 1 + popped;
  }
  __syncthreads();
  if (DDTREE_BULK_AFTER >= 0 && bulk_taken >= 0) {
    ddtree_select_bulk_take(bulk_taken, budget, node_parent, node_rank, node_depth, node_score,
                            frontier.bulk);
  }
  ddtree_select_write(total, b, root, topk_tok, draft_len, top_k, num_nodes_max, words,
                      node_parent, node_rank, node_depth, node_score, tokens, parents, depths,
                      log_probs, num_nodes, mask);
  if (early > 0) ddtree_wait_for_previous_grid();
}
