// ddtree_accept: walk each request's draft tree along the target's tokens, one launch per batch.
//
// Python reference: ddtree.kernels.reference.accept (contract: ddtree.kernels.accept.accept).
// Grid: (batch_size). Block: ACCEPT_THREADS threads, one request per block. MODE (a launch
// argument): 0 = target tokens given, 1 = greedy argmax of target logits, 2 = Gumbel-max sampling
// from target logits at `temperature` with the counter-based noise of reference.sampling_noise.
// In logit modes only the rows of visited nodes are read (at most draft_len + 1 per request),
// each with a block-wide argmax (scaled logit, NaN -> -inf, a row holding +inf samples among its
// +inf tokens only, equal values smaller token id first).
//
// Caller data is validated here, exactly as checks.tree_flags / checks.target_token_flags:
// a malformed tree sets ErrorFlag.TREE, a negative target token at a node < num_nodes sets
// ErrorFlag.TOKEN; such a request (or one whose error_flags entry is already non-zero) gets
// length 0, bonus -1 and -1 paths. Every index is range-checked before use.
// PHASE (a launch argument): 0 = validate and walk each request on its own (above); for outputs
// in caller memory, written all or nothing, two launches: 1 = validate only (flags, nothing
// else written), then 2 = every block first reads the flags of the whole batch and writes
// nothing if any is set, else validates again (the data may not be trusted to stay put) and
// walks as in 0.
// Shared memory: a few words per block.
#include "common.cuh"

#ifndef ACCEPT_THREADS
#define ACCEPT_THREADS 256
#endif

__device__ __forceinline__ void ddtree_block_argmax(float& v, int& i, float* sv, int* si) {
  ddtree_warp_argmax(v, i);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) {
    sv[warp] = v;
    si[warp] = i;
  }
  __syncthreads();
  v = lane < (ACCEPT_THREADS >> 5) ? sv[lane] : -DDTREE_INF;
  i = lane < (ACCEPT_THREADS >> 5) ? si[lane] : 0x7FFFFFFF;
  ddtree_warp_argmax(v, i);
}

extern "C" __global__ void __launch_bounds__(ACCEPT_THREADS) ddtree_accept(
    const int64_t* __restrict__ tree_tokens,  // [batch, num_nodes_max]
    const int32_t* __restrict__ parents,      // [batch, num_nodes_max]
    const int32_t* __restrict__ depths,       // [batch, num_nodes_max]
    const int32_t* __restrict__ num_nodes,    // [batch]
    const int64_t* __restrict__ target_tokens,      // [batch, num_nodes_max] (mode 0)
    const ddtree_logit_t* __restrict__ target_logits,  // [batch, num_nodes_max, vocab] (1, 2)
    const int64_t* __restrict__ seed,         // [1] (mode 2)
    int32_t* __restrict__ error_flags,        // [batch]
    int32_t* __restrict__ path_nodes,         // [batch, path_len]
    int64_t* __restrict__ path_tokens,        // [batch, path_len]
    int32_t* __restrict__ length,             // [batch]
    int64_t* __restrict__ bonus,              // [batch]
    int32_t num_nodes_max, int32_t draft_len, int32_t vocab, int32_t mode, float temperature,
    int32_t batch_size, int32_t phase) {
  __shared__ int flags;
  __shared__ int child;
  __shared__ float sv[32], sv2[32];
  __shared__ int si[32], si2[32];
  ddtree_wait_for_previous_grid();  // launched dependent: the kernel before may still run
  ddtree_allow_dependents();
  const int tid = threadIdx.x;
  const int64_t b = blockIdx.x;
  const int path_len = draft_len + 1;
  const int64_t base = b * (int64_t)num_nodes_max;
  if (phase == 2) {
    int any = 0;
    for (int r = tid; r < batch_size; r += ACCEPT_THREADS) any |= error_flags[r];
    if (__syncthreads_or(any)) return;
  }
  const int num = num_nodes[b];
  if (tid == 0) flags = 0;
  __syncthreads();
  int mine = 0;
  if (num < 1 || num > num_nodes_max || depths[base] != 0) mine |= DDTREE_ERR_TREE;
  const int limit = min(max(num, 0), num_nodes_max);
  for (int i = 1 + tid; i < limit; i += ACCEPT_THREADS) {
    const int p = parents[base + i];
    if (p < 0 || p >= i) {
      mine |= DDTREE_ERR_TREE;
    } else {
      const int d = depths[base + i];
      if (d != depths[base + p] + 1 || d > draft_len) mine |= DDTREE_ERR_TREE;
    }
  }
  if (mode == 0) {
    for (int i = tid; i < limit; i += ACCEPT_THREADS) {
      if (target_tokens[base + i] < 0) mine |= DDTREE_ERR_TOKEN;
    }
  }
  if (mine) atomicOr(&flags, mine);
  __syncthreads();
  const int found = flags;
  if (tid == 0 && found) atomicOr(&error_flags[b], found);
  if (phase == 1) return;
  const bool skip = found != 0 || error_flags[b] != 0;
  if (skip) {
    for (int s = tid; s < path_len; s += ACCEPT_THREADS) {
      path_nodes[b * path_len + s] = -1;
      path_tokens[b * path_len + s] = -1;
    }
    if (tid == 0) {
      length[b] = 0;
      bonus[b] = -1;
    }
    return;
  }

  int cur = 0;
  int steps = 0;
  int64_t last_choice = -1;
  for (int s = 0; s < path_len; ++s) {
    if (tid == 0) {
      path_nodes[b * path_len + s] = cur;
      path_tokens[b * path_len + s] = tree_tokens[base + cur];
    }
    ++steps;
    int64_t chosen;
    if (mode == 0) {
      chosen = target_tokens[base + cur];
    } else {
      const ddtree_logit_t* row = target_logits + (base + cur) * (int64_t)vocab;
      // Noise key of node `cur`: k = mix32(mix32(K0 ^ b) ^ i), built by ddtree_noise_key.
      const uint32_t key = mode == 2 ? ddtree_noise_key(seed[0], (uint32_t)b, (uint32_t)cur) : 0u;
      const float t = mode == 2 ? temperature : 1.0f;
      float best = -DDTREE_INF, best_inf = -DDTREE_INF;
      int best_i = 0x7FFFFFFF, best_inf_i = 0x7FFFFFFF;
      for (int v = tid; v < vocab; v += ACCEPT_THREADS) {
        const float x = ddtree_scaled_logit(row[v], t);
        const float g = mode == 2 ? ddtree_gumbel(key, (uint32_t)v) : 0.0f;
        if (x == DDTREE_INF) {
          if (ddtree_better(g, v, best_inf, best_inf_i)) {
            best_inf = g;
            best_inf_i = v;
          }
        } else if (ddtree_better(x + g, v, best, best_i)) {
          best = x + g;
          best_i = v;
        }
      }
      ddtree_block_argmax(best, best_i, sv, si);
      ddtree_block_argmax(best_inf, best_inf_i, sv2, si2);
      // A row of only -inf (or NaN) yields token 0, as torch.argmax does.
      chosen = best_inf_i != 0x7FFFFFFF ? best_inf_i : (best_i != 0x7FFFFFFF ? best_i : 0);
    }
    last_choice = chosen;
    __syncthreads();
    if (tid == 0) child = 0x7FFFFFFF;
    __syncthreads();
    for (int c = cur + 1 + tid; c < num; c += ACCEPT_THREADS) {
      if (parents[base + c] == cur && tree_tokens[base + c] == chosen) atomicMin(&child, c);
    }
    __syncthreads();
    const int next = child;
    if (next == 0x7FFFFFFF) break;
    cur = next;
  }
  for (int s = steps + tid; s < path_len; s += ACCEPT_THREADS) {
    path_nodes[b * path_len + s] = -1;
    path_tokens[b * path_len + s] = -1;
  }
  if (tid == 0) {
    length[b] = steps;
    bonus[b] = last_choice;
  }
}
