// build_tree's launch 3 for larger budgets, the wide select: the whole block lists the nodes above
// a rising score threshold level by level and orders them, instead of popping one at a time.
// Part of build_tree.cu (after build_tree_select.cuh, whose node tables it fills).
#pragma once

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

// Number of children at or above key t of a node with score s at `depth` (>= 0), from rank
// `from` on: the prefix of row `depth` (counts[depth] possible tokens) past `from` with
// key(s + lp) >= t. Most nodes have few, so the search gallops from `from` (probes from, from + 1,
// from + 3, ...) before it bisects.
__device__ __forceinline__ int ddtree_children_at_least(float s, int depth, int from, uint32_t t,
                                                        int top_k, const float* lp,
                                                        const int* counts) {
  if (ddtree_order_key(s) < t) return 0;  // children are no better than their parent
  const float* row = lp + depth * top_k;
  const int n = counts[depth];
  auto passes = [&](int r) { return ddtree_order_key(s + row[r] + 0.0f) >= t; };
  int lo = from, hi = max(n, from), width = 1;  // every rank in [from, lo) passes; none from hi on
  for (int probe = from; probe < n; probe += width, width <<= 1) {
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
  return lo - from;
}

// The last i in [0, count) with off[i] <= c, for offsets off[0, count] ascending with off[0]
// <= c < off[count]: the node whose children, placed at exclusive offsets off, include child c.
__device__ __forceinline__ int ddtree_offset_owner(const int* off, int count, int c) {
  int lo = 0, hi = count;  // off[lo] <= c < off[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (off[mid] <= c) {
      lo = mid;
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
    s.work[i] = ddtree_children_at_least(s.score[level_start + i], depth, 0, t, top_k, lp,
                                        counts);
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
    local += ddtree_children_at_least(s.score[i], depth, 0, t, top_k, lp, counts);
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
      const int lo = ddtree_offset_owner(s.work, nodes, j);  // work[nodes] = m
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
