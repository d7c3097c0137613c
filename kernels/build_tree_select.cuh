// build_tree's launch 3, the serial select: best-first pops of one request by one warp, with the
// frontier in registers (budgets up to 96) or in shared memory, exact score ties broken by rank
// tuples, chains of successors and sibling runs popped without warp reductions; and the writing
// of the popped nodes and their ancestor masks. Part of build_tree.cu; see that file's comment,
// launch 3.
#pragma once

#define DDTREE_MAX_NODES 1025
#define DDTREE_MAX_DEPTH 32
// order_key(-inf): a frontier whose best key is at or below this has nothing left to pop.
#define DDTREE_NEG_INF_KEY 0x007FFFFFu

// Lexicographic comparison of the rank tuples of two candidates (parent node, rank, depth) by
// walking their ancestors' parents (parent_of) and ranks (rank_of): true when candidate 1's
// tuple is smaller.
template <typename ParentOf, typename RankOf>
__device__ __forceinline__ bool ddtree_lex_less_by(int p1, int r1, int d1, int p2, int r2, int d2,
                                                   ParentOf parent_of, RankOf rank_of) {
  const int depth1 = d1, depth2 = d2;
  while (d1 > d2) {
    r1 = rank_of(p1);
    p1 = parent_of(p1);
    --d1;
  }
  while (d2 > d1) {
    r2 = rank_of(p2);
    p2 = parent_of(p2);
    --d2;
  }
  if (p1 == p2 && r1 == r2) return depth1 < depth2;  // one is a prefix of the other
  while (p1 != p2) {
    r1 = rank_of(p1);
    p1 = parent_of(p1);
    r2 = rank_of(p2);
    p2 = parent_of(p2);
  }
  return r1 < r2;
}

// ddtree_lex_less_by over the popped nodes' tables.
__device__ __noinline__ bool ddtree_lex_less(int p1, int r1, int d1, int p2, int r2, int d2,
                                             const int16_t* parent, const int16_t* rank) {
  return ddtree_lex_less_by(
      p1, r1, d1, p2, r2, d2, [&](int n) { return (int)parent[n]; },
      [&](int n) { return (int)rank[n]; });
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

// One thread per node row: its token, parent, depth and log-prob, and its ancestor-or-self bits
// (`words` <= WORDS 64-bit words), walking to the root (at most 33 steps) while the token's load
// is in flight. Where WORDS is 2 the bits stay in registers (a word picked by compare, not by
// index, which would put the array in local memory).
template <int WORDS>
__device__ __forceinline__ void ddtree_select_write_rows(
    int count, int64_t b, int64_t root, const int32_t* DDTREE_TOPK_ROWS topk_tok, int draft_len,
    int top_k, int num_nodes_max, int words, const int16_t* node_parent, const int16_t* node_rank,
    const int8_t* node_depth, const float* node_score, int64_t* __restrict__ tokens,
    int32_t* __restrict__ parents, int32_t* __restrict__ depths, float* __restrict__ log_probs,
    int64_t* __restrict__ mask) {
  const int64_t base = b * (int64_t)num_nodes_max;
  for (int i = threadIdx.x; i < num_nodes_max; i += blockDim.x) {
    int64_t token = -1;
    int parent = -1, depth = -1;
    float score = -DDTREE_INF;
    if (i == 0) {
      token = root;
      depth = 0;
      score = 0.0f;
    } else if (i < count) {
      depth = node_depth[i];
      token = topk_tok[(b * draft_len + depth - 1) * (int64_t)top_k + node_rank[i]];
      parent = node_parent[i];
      score = node_score[i];
    }
    uint64_t acc[WORDS];
    for (int w = 0; w < (WORDS <= 2 ? WORDS : words); ++w) acc[w] = 0;
    if (i < count) {
      for (int j = i; j >= 0; j = node_parent[j]) {
        const uint64_t bit = 1ull << (j & 63);
        if (WORDS <= 2) {
#pragma unroll
          for (int w = 0; w < WORDS; ++w) acc[w] |= (j >> 6) == w ? bit : 0ull;
        } else {
          acc[j >> 6] |= bit;
        }
      }
    }
    int64_t* out = mask + (base + i) * words;
    if (WORDS <= 2) {
#pragma unroll
      for (int w = 0; w < WORDS; ++w) {
        if (w < words) out[w] = (int64_t)acc[w];
      }
    } else {
      for (int w = 0; w < words; ++w) out[w] = (int64_t)acc[w];
    }
    tokens[base + i] = token;
    parents[base + i] = parent;
    depths[base + i] = depth;
    log_probs[base + i] = score;
  }
}

// Writes one request's tree from its popped nodes (node 0 the root; `count` nodes) with every
// thread of the block: tokens, parents, depths, log-probs, sentinels past `count`, num_nodes and
// the ancestor-or-self masks.
__device__ void ddtree_select_write(int count, int64_t b, int64_t root,
                                    const int32_t* DDTREE_TOPK_ROWS topk_tok, int draft_len,
                                    int top_k, int num_nodes_max, int words,
                                    const int16_t* node_parent, const int16_t* node_rank,
                                    const int8_t* node_depth, const float* node_score,
                                    int64_t* __restrict__ tokens, int32_t* __restrict__ parents,
                                    int32_t* __restrict__ depths, float* __restrict__ log_probs,
                                    int32_t* __restrict__ num_nodes, int64_t* __restrict__ mask) {
  if (threadIdx.x == 0) num_nodes[b] = count;
  if (words <= 2) {
    ddtree_select_write_rows<2>(count, b, root, topk_tok, draft_len, top_k, num_nodes_max,
                                words, node_parent, node_rank, node_depth, node_score, tokens,
                                parents, depths, log_probs, mask);
  } else {
    ddtree_select_write_rows<(DDTREE_MAX_NODES + 63) / 64>(
        count, b, root, topk_tok, draft_len, top_k, num_nodes_max, words, node_parent, node_rank,
        node_depth, node_score, tokens, parents, depths, log_probs, mask);
  }
}

// An early plan's select waits until the top-k has flagged the request's rows of depths 0 ..
// n - 1 (n <= 32) written: warp 0 reads the flags (ddtree_publish_flag's release) with acquire
// order, and a block barrier hands the rows to the other warps. Every thread calls it.
__device__ void ddtree_wait_flags(const int32_t* ready, int n) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    bool seen = lane >= n;
    for (;;) {
      if (!seen) seen = ddtree_load_acquire(ready + lane) != 0;
      if (__all_sync(DDTREE_FULL, seen)) break;
      __nanosleep(128);
    }
  }
  __syncthreads();
}

// Whether the tree popped over the first `use` depths is the tree popped over every depth, by
// what those depths' rows alone tell. A node deeper than `use` descends from one at depth `use`
// and scores at most what it scores (log-probs are at most 0, and adding one to an fp32 score
// never raises it), and no node at depth `use` scores more than the chain of each depth's best
// token (sums round monotonically; summed here as the pops sum scores). The budget-th pop
// scores at least the budget-th best depth-1 node. So no deeper node can enter when some depth
// up to `use` has no possible token, or when depth 1 holds `budget` nodes and the budget-th of
// them scores strictly above that chain (an equal score would be decided by rank tuples).
// Every thread may call it; all get the same answer from the same shared data.
__device__ bool ddtree_depths_suffice(int use, int budget, int top_k, const float* lp,
                                      const int* counts) {
  if (budget == 0) return true;
  float chain = 0.0f;
  for (int d = 0; d < use; ++d) {
    if (counts[d] == 0) return true;  // no node deeper than d
    chain = chain + lp[d * top_k] + 0.0f;
  }
  return counts[0] >= budget && lp[budget - 1] > chain;
}

// The rows of depths [from, to) of one request: their log-prob rows into the table (when
// lp_in_smem) and their counts of possible tokens (counts[i] 0 from `to` on: a last-depth
// node's missing child, key 0, asks counts[to]). It writes nothing below depth `from`, which
// other threads may still read. Every thread calls it; a barrier must follow before the pops
// read them.
__device__ __forceinline__ void ddtree_select_load_rows(int from, int to, int top_k,
                                                        int lp_in_smem, const float* lp_global,
                                                        const int32_t* row_counts,
                                                        float* lp_table, int* counts) {
  const int tid = threadIdx.x;
  if (lp_in_smem) {
    // Eight loads in flight per thread before their stores (the pops read the table next).
    const int n = to * top_k;
    for (int base = from * top_k + tid; base < n; base += 8 * SELECT_THREADS) {
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
  for (int i = from + threadIdx.x; i <= DDTREE_MAX_DEPTH; i += blockDim.x) {
    counts[i] = i < to ? row_counts[i] : 0;
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

// The shared-memory frontier's slots: score key, packed candidate, packed rank-tuple prefix.
struct ddtree_shared_frontier {
  uint32_t key[DDTREE_MAX_NODES];
  uint32_t info[DDTREE_MAX_NODES];
  uint64_t lex[DDTREE_MAX_NODES];
};

// Best-first pops of one request by one warp with the frontier in shared memory (any budget):
// lane l owns slots l, l + 32, ... (`slots`) and keeps the best of them in registers. Writes
// nodes 1..popped of the node tables and returns popped.
__device__ __noinline__ int ddtree_select_pops_shared(int budget, int draft_len, int top_k,
                                                      const float* lp, const int* counts,
                                                      int16_t* node_parent, int16_t* node_rank,
                                                      int8_t* node_depth, float* node_score,
                                                      ddtree_shared_frontier& slots) {
  uint32_t* slot_key = slots.key;
  uint32_t* slot_info = slots.info;
  uint64_t* slot_lex = slots.lex;
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
// loop is compiled twice: the first copy stores no tuples and stops at its round
// DDTREE_BULK_AFTER + 1, where `bulk(popped)` may take the rest of the budget (the bulk select: it
// returns the final count, or -1 having changed nothing, and the copy goes on), and at a
// request's first exact tie, where the popped nodes' tuples are built by walking their parents
// and the second copy takes over, extending each pop's from its parent's (one loop testing a
// flag cost 5 % on rows without ties: session 20 in docs/kernels.md). Register masks rather than
// index compares pick slots: the compiler keeps them as selects on registers instead of moving
// `slot` to local memory.
template <int REGS, typename Bulk>
__device__ __forceinline__ int ddtree_select_pops_registers(int budget, int draft_len, int top_k,
                                                            const float* lp, const int* counts,
                                                            int16_t* node_parent,
                                                            int16_t* node_rank,
                                                            int8_t* node_depth,
                                                            float* node_score,
                                                            ddtree_lex2* node_lex, Bulk bulk) {
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
  int rounds = 0;
  // The pop loop, compiled twice: without tuples (LEX false) it stops at the first exact tie
  // (returning 1) or at round DDTREE_BULK_AFTER + 1 (returning 2), before that round changes
  // anything, and the bulk select or the loop with tuples takes over from there; 0: done.
  const auto pops = [&](auto lex_tag) -> int {
    constexpr bool LEX = decltype(lex_tag)::value;
    while (popped < budget) {
      if constexpr (!LEX) {
        if (rounds++ == DDTREE_BULK_AFTER) return 2;
      }
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
        if constexpr (!LEX) return 1;
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
    return 0;
  };
  int stop = pops(ddtree_flag<false>{});
  if (stop == 2) {
    __syncwarp();  // the node tables are complete
    const int all = bulk(popped);
    if (all >= 0) {
      popped = all;
      stop = 0;
    } else {
      stop = pops(ddtree_flag<false>{});  // on from the same round: it stops at a tie only
    }
  }
  if (stop == 1) {
    __syncwarp();  // as above
    ddtree_fill_lex2(popped, bits, per, node_parent, node_rank, node_depth, node_lex);
    pops(ddtree_flag<true>{});
  }
  __syncwarp();  // the node tables are complete (but the bulk select's nodes: see its take)
  return popped;
}
