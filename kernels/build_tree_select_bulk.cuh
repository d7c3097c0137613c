// build_tree's launch 3, the bulk select: where the register select's pops get dear (a request's
// round DDTREE_BULK_AFTER + 1), warp 0 lists the candidates for the rest of the budget and the
// whole block then ranks them and writes them as the request's next pops. Part of build_tree.cu
// (after build_tree_select_wide.cuh, whose child count it uses).
#pragma once

// ---------------------------------------------------------------------------------------------
// The pops of budget n are the first n nodes in the total order (score key descending, rank tuple
// ascending), and the set of nodes at or above a key t is closed under parents and earlier
// siblings (see the wide select). With `popped` nodes taken, the next `want` = n - popped are the
// first `want` of the nodes not taken, so, for any t at or below the want-th of those, they are
// the first `want` of the untaken nodes at or above t. The warp lists those level by level: the
// untaken children of each taken node p are ranks next_child[p], next_child[p] + 1, ... (taken
// children are a prefix of ranks), and those at or above t are a prefix of that range (a search
// in the sorted row); then the children at or above t of the nodes just listed, and so on.
//
// t starts at the best of the taken nodes' want-th untaken child keys (that child and the
// want - 1 before it are untaken and at or above it), or at the smallest finite key where no taken
// node has that many. When a level would overflow the store (DDTREE_BULK_CAP nodes), t rises to
// the want-th best key among the listed nodes and the first of the level's candidates (up to
// DDTREE_BULK_KEYS in all: still untaken nodes at or above t, so t stays a bound), and the store
// drops the nodes below it. If that does not raise t (exact ties at t wider than the store), the
// bulk select gives up having changed nothing, and the register pops go on.
//
// One level costs one warp about as much as a few reduction rounds of the register pops, and the
// listing takes about as many levels as the chain of best tokens from the root stays at or above
// t. On peaked rows (deep trees: the chain stays above t for more than DDTREE_BULK_MAX_LEVELS
// depths) the bulk select gives up before listing, and the register pops go on.
//
// After a block barrier the whole block ranks the listed nodes by the total order (each against
// all: score keys, then packed rank tuples, walking parents through taken and listed nodes alike
// only where those agree), and the first `want` become nodes popped + 1 .. popped + want in that
// order; a listed parent is always among them, before its child. Before the CUDA, a CPU model of
// the listing and ordering (not in the repository) matched best-first on every case of random
// budgets 1-96, depths 1-32, vocabularies 8-5000 and bf16 rows (randn 3, 12, rounded to halves,
// -inf tails) but flat rows, where it gave up.

#define DDTREE_BULK_CAP 256
#define DDTREE_BULK_KEYS 512
// The longest chain of best tokens at or above the starting t that the bulk select lists.
#define DDTREE_BULK_MAX_LEVELS 4
// Node ids across both tables: taken nodes (at most DDTREE_REG_MAX_NODES) below, listed node j
// at DDTREE_BULK_LISTED + j.
#define DDTREE_BULK_LISTED 128
// A rise of t selects the want-th best (want <= 96, below DDTREE_REG_MAX_NODES) of more than
// DDTREE_BULK_CAP keys, and node ids of both tables fit in int16.
static_assert(DDTREE_BULK_CAP >= DDTREE_REG_MAX_NODES && DDTREE_BULK_KEYS > DDTREE_BULK_CAP,
              "the bulk store must hold more nodes than the register select pops");
static_assert(DDTREE_BULK_LISTED >= DDTREE_REG_MAX_NODES &&
                  DDTREE_BULK_LISTED + DDTREE_BULK_CAP <= 32767,
              "taken and listed node ids must not overlap and must fit in int16");

// The listed nodes (score, key, packed rank tuple, parent id, rank, depth; `listed` of them), a
// level's child offsets (off), the listed nodes' ranks or new indices (pos), the keys a rise of t
// selects from (cand, with its radix histogram), and each taken node's first untaken child rank.
struct ddtree_bulk_store {
  int listed;
  uint64_t cand[DDTREE_BULK_KEYS];
  ddtree_lex2 lex[DDTREE_BULK_CAP];
  float score[DDTREE_BULK_CAP];
  uint32_t key[DDTREE_BULK_CAP];
  int off[DDTREE_BULK_CAP + 1];
  int pos[DDTREE_BULK_CAP];
  int16_t parent[DDTREE_BULK_CAP];
  int16_t rank[DDTREE_BULK_CAP];
  int8_t depth[DDTREE_BULK_CAP];
  int next_child[DDTREE_REG_MAX_NODES];
  uint32_t hist[256];
};

// The select's frontier store: the shared-memory frontier (budgets above 96) or the bulk select's
// (the register select's budgets), never both in one request.
union ddtree_select_store {
  ddtree_shared_frontier shared;
  ddtree_bulk_store bulk;
};

// The nodes of one level of the listing: the taken nodes 0..popped (from their first untaken
// child), or the listed nodes [first, first + count) (from rank 0).
struct ddtree_bulk_level {
  bool taken;
  int first, count;
};

// Item i of a level: node id, score, depth, first child rank to consider and packed tuple.
struct ddtree_bulk_item {
  int id;
  float score;
  int depth, from;
  ddtree_lex2 lex;
};

// The bulk select's listing for one request's remaining budget (see above): fills the store and
// returns the number of listed nodes (ddtree_select_bulk_take pops the first budget - popped of
// them), or returns -1 (the ties at t outnumber the store). Writes no node. One whole warp calls
// it; 0 <= popped < budget <= 96.
__device__ __noinline__ int ddtree_select_bulk_list(int popped, int budget, int draft_len,
                                                    int top_k, const float* lp, const int* counts,
                                                    int16_t* node_parent, int16_t* node_rank,
                                                    int8_t* node_depth, float* node_score,
                                                    ddtree_lex2* node_lex, ddtree_bulk_store& s) {
  const int lane = threadIdx.x & 31;
  const int want = budget - popped;
  for (int n = lane; n <= popped; n += 32) s.next_child[n] = 0;
  __syncwarp();
  for (int n = 1 + lane; n <= popped; n += 32) {
    atomicMax(&s.next_child[node_parent[n]], node_rank[n] + 1);
  }
  __syncwarp();
  uint32_t bound = 0u;
  for (int p = lane; p <= popped; p += 32) {
    const int d = node_depth[p], r = s.next_child[p] + want - 1;
    if (r < counts[d]) {
      bound = max(bound, ddtree_order_key(node_score[p] + lp[d * top_k + r] + 0.0f));
    }
  }
  uint32_t t = max(__reduce_max_sync(DDTREE_FULL, bound), (uint32_t)DDTREE_NEG_INF_KEY + 1u);
  // A level of the listing costs about as much as a few reduction rounds of the register pops,
  // and it takes about as many levels as the chain of best tokens from the root stays at or
  // above t: on peaked rows (deep trees) the register pops are cheaper, and take the request.
  float chain = 0.0f;
  for (int d = 0; d < draft_len && counts[d] > 0; ++d) {
    chain += lp[d * top_k];
    if (ddtree_order_key(chain + 0.0f) < t) break;
    if (d == DDTREE_BULK_MAX_LEVELS) return -1;
  }
  const int bits = 32 - __clz(top_k);  // rank + 1 <= top_k
  const int per = 64 / bits;
  // The taken nodes' packed tuples (node_lex[0] is the root's, all zero). With the root alone
  // (a request's first round, DDTREE_BULK_AFTER 0) there is nothing to fill, and the out-of-line
  // call is skipped: its select launch took 0.3-0.7 us less at batches 8 and 128 (session 29).
  if (popped > 0) {
    ddtree_fill_lex2(popped, bits, per, node_parent, node_rank, node_depth, node_lex);
  }

  const auto item = [&](const ddtree_bulk_level& level, int i) -> ddtree_bulk_item {
    if (level.taken) return {i, node_score[i], (int)node_depth[i], s.next_child[i], node_lex[i]};
    const int j = level.first + i;
    return {DDTREE_BULK_LISTED + j, s.score[j], (int)s.depth[j], 0, s.lex[j]};
  };
  // The level's children at or above t: exclusive offsets in off[0, count], their total.
  const auto offsets = [&](const ddtree_bulk_level& level) -> int {
    int run = 0;
    for (int base = 0; base < level.count; base += 32) {
      const int i = base + lane;
      int n = 0;
      if (i < level.count) {
        const ddtree_bulk_item it = item(level, i);
        n = ddtree_children_at_least(it.score, it.depth, it.from, t, top_k, lp, counts);
      }
      const int incl = ddtree_warp_inclusive_sum(n);
      if (i < level.count) s.off[i] = run + incl - n;
      run += __shfl_sync(DDTREE_FULL, incl, 31);
    }
    if (lane == 0) s.off[level.count] = run;
    __syncwarp();
    return run;
  };
  // The level's child c (< the total): its item (the last with off <= c) and rank.
  const auto child_of = [&](const ddtree_bulk_level& level, int c, ddtree_bulk_item& parent) {
    const int lo = ddtree_offset_owner(s.off, level.count, c);
    parent = item(level, lo);
    return parent.from + c - s.off[lo];
  };

  int listed = 0;
  ddtree_bulk_level level = {true, 0, popped + 1};
  while (true) {
    int m = offsets(level);
    while (listed + m > DDTREE_BULK_CAP) {
      // Raise t to the want-th best of the listed nodes and the level's first candidates.
      // n > DDTREE_BULK_CAP >= want: the keys hold the want-th best (static_assert above).
      const int n = listed + min(m, DDTREE_BULK_KEYS - listed);
      for (int i = lane; i < n; i += 32) {
        uint32_t key;
        if (i < listed) {
          key = s.key[i];
        } else {
          ddtree_bulk_item p;
          const int r = child_of(level, i - listed, p);
          key = ddtree_order_key(p.score + lp[p.depth * top_k + r] + 0.0f);
        }
        s.cand[i] = (uint64_t)key << 32 | (uint32_t)i;
      }
      __syncwarp();
      const uint32_t raised = (uint32_t)(ddtree_warp_select(s.cand, n, want, false, s.hist) >> 32);
      if (raised <= t) return -1;
      t = raised;
      // Keep the listed nodes at or above t, in order (parents first), renumbering parents.
      int kept = 0, kept_before = 0;
      for (int base = 0; base < listed; base += 32) {
        const int i = base + lane;
        const bool keep = i < listed && s.key[i] >= t;
        const int incl = ddtree_warp_inclusive_sum(keep ? 1 : 0);
        if (i < listed) s.pos[i] = keep ? kept + incl - 1 : -1;
        kept_before += __popc(__ballot_sync(DDTREE_FULL, keep && i < level.first));
        kept += __shfl_sync(DDTREE_FULL, incl, 31);
      }
      __syncwarp();
      for (int base = 0; base < listed; base += 32) {
        const int i = base + lane;
        const int to = i < listed ? s.pos[i] : -1;
        float score = 0.0f;
        uint32_t key = 0u;
        ddtree_lex2 lex = {0ull, 0ull};
        int parent = 0, rank = 0, depth = 0;
        if (to >= 0) {
          score = s.score[i];
          lex = s.lex[i];
          key = s.key[i];
          parent = s.parent[i];
          rank = s.rank[i];
          depth = s.depth[i];
          if (parent >= DDTREE_BULK_LISTED) {
            parent = DDTREE_BULK_LISTED + s.pos[parent - DDTREE_BULK_LISTED];
          }
        }
        __syncwarp();  // the chunk is read before any of it is overwritten
        if (to >= 0) {
          s.score[to] = score;
          s.key[to] = key;
          s.lex[to] = lex;
          s.parent[to] = (int16_t)parent;
          s.rank[to] = (int16_t)rank;
          s.depth[to] = (int8_t)depth;
        }
      }
      if (!level.taken) {
        level.count = kept - kept_before;  // the level was the last listed
        level.first = kept_before;
      }
      listed = kept;
      __syncwarp();
      m = offsets(level);
    }
    if (m == 0) break;
    for (int c = lane; c < m; c += 32) {
      ddtree_bulk_item p;
      const int r = child_of(level, c, p);
      const float score = p.score + lp[p.depth * top_k + r] + 0.0f;
      const int j = listed + c;
      s.score[j] = score;
      s.key[j] = ddtree_order_key(score);
      s.lex[j] = ddtree_lex2_add(p.lex, p.depth + 1, r + 1, bits, per);
      s.parent[j] = (int16_t)p.id;
      s.rank[j] = (int16_t)r;
      s.depth[j] = (int8_t)(p.depth + 1);
    }
    __syncwarp();
    level = {false, listed, m};
    listed += m;
  }

  if (lane == 0) s.listed = listed;
  __syncwarp();
  return listed;
}

// The bulk select's pops (after ddtree_select_bulk_list returned listed >= 0 for the request's
// `popped` nodes, and a block barrier): ranks the listed nodes by the total order, `split` threads
// per node, each taking every split-th other node, and writes the first budget - popped of them
// as nodes popped + 1 .. in that order. Every thread of the block calls it; the block is
// synchronised on return.
__device__ void ddtree_select_bulk_take(int popped, int budget, int16_t* node_parent,
                                        int16_t* node_rank, int8_t* node_depth,
                                        float* node_score, ddtree_bulk_store& s) {
  const int listed = s.listed, take = min(budget - popped, listed);
  int split = 1;  // a power of two up to 8: the groups of a node's threads stay within a warp
  while (split < 8 && listed * split * 2 <= (int)blockDim.x) split *= 2;
  const int parts = (int)blockDim.x / split;
  const auto parent_of = [&](int id) {
    return id < DDTREE_BULK_LISTED ? (int)node_parent[id] : (int)s.parent[id - DDTREE_BULK_LISTED];
  };
  const auto rank_of = [&](int id) {
    return id < DDTREE_BULK_LISTED ? (int)node_rank[id] : (int)s.rank[id - DDTREE_BULK_LISTED];
  };
  for (int base = 0; base < listed; base += parts) {
    const int i = base + (int)threadIdx.x / split, part = (int)threadIdx.x % split;
    int before = 0;
    if (i < listed) {
      const uint32_t key = s.key[i];
      const ddtree_lex2 lex = s.lex[i];
      bool alike = false;
      for (int j = part; j < listed; j += split) {
        const uint32_t k = s.key[j];
        const ddtree_lex2 l = s.lex[j];
        const bool lex_less = l.hi != lex.hi ? l.hi < lex.hi : l.lo < lex.lo;
        before += k > key || (k == key && lex_less) ? 1 : 0;
        alike |= k == key && l.hi == lex.hi && l.lo == lex.lo && j != i;
      }
      if (alike) {
        // Tuples equal in every packed depth: compare them by walking parents.
        for (int j = part; j < listed; j += split) {
          if (j != i && s.key[j] == key && s.lex[j].hi == lex.hi && s.lex[j].lo == lex.lo &&
              ddtree_lex_less_by(s.parent[j], s.rank[j], s.depth[j], s.parent[i], s.rank[i],
                                 s.depth[i], parent_of, rank_of)) {
            ++before;
          }
        }
      }
    }
    for (int o = 1; o < split; o <<= 1) before += __shfl_xor_sync(DDTREE_FULL, before, o);
    if (i < listed && part == 0) s.pos[i] = before;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < listed; i += blockDim.x) {
    const int at = s.pos[i];
    if (at < take) {
      const int p = s.parent[i];
      const int parent = p < DDTREE_BULK_LISTED ? p : popped + 1 + s.pos[p - DDTREE_BULK_LISTED];
      ddtree_store_node(popped + 1 + at, parent, s.rank[i], s.depth[i], s.score[i], node_parent,
                        node_rank, node_depth, node_score);
    }
  }
  __syncthreads();
}
