// build_tree's launch 1, the top-k pass: a block streams one span of one row once, keeping
// each lane's online max and sum of exp and the candidates that reach the block's running
// threshold (hit vectors, expanded DDTREE_EXPAND_AT at a time into the warps' buffers, which
// shrink by radix select), and writes the warps' parts, or merges the row itself (merge_here).
// Part of build_tree.cu (after build_tree_rows.cuh), whose comment gives the design (launch 1).
#pragma once

constexpr int DDTREE_VEC = 16 / sizeof(ddtree_logit_t);
constexpr int DDTREE_STEP = 32 * UNROLL * DDTREE_VEC;  // entries one warp reads per step
// Entries from the start of one of a warp's steps to the start of its next (see build_tree.cu's
// comment).
constexpr int DDTREE_STRIDE = TOPK_WARPS * DDTREE_STEP;

// One 16-byte vector of logits that is read once: through the read-only path and not kept in
// L1 (`L1::no_allocate`). On the H200 the top-k took 0-4 % less time than with `__ldg` (B 32
// K 64: 68.2 -> 67.3 us; bench/results/2026-12-01-h200-topk-streaming-s24.json) in the
// interior steps, and 0-0.6 % less in a span's first and last steps too (66.9 -> 66.5 us;
// ...-topk-lane-rank-s25.json, run 4).
__device__ __forceinline__ uint4 ddtree_load_once(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Loads one warp step: vector u of lane l covers entries start + (u * 32 + l) * VEC .. + VEC - 1.
__device__ __forceinline__ void ddtree_load_step(uint4 (&v)[UNROLL], const ddtree_logit_t* src,
                                                 int start, int end, bool vectorized) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int first = start + (u * 32 + lane) * DDTREE_VEC;
    if (vectorized && first + DDTREE_VEC <= end) {
      v[u] = ddtree_load_once(reinterpret_cast<const uint4*>(src + first));
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

#if DDTREE_DTYPE != DDTREE_DTYPE_F32
// The two 16-bit logits packed in a word (low half first), widened to fp32 (bf16: a shift or a
// mask each).
__device__ __forceinline__ float2 ddtree_widen_pair(uint32_t w) {
#if DDTREE_DTYPE == DDTREE_DTYPE_BF16
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
#else
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
#endif
}
#endif

// All VEC elements of a raw 16-byte vector of logits, widened to fp32.
__device__ __forceinline__ void ddtree_unpack(const uint4& v, float (&x)[DDTREE_VEC]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#if DDTREE_DTYPE == DDTREE_DTYPE_F32
    x[k] = __uint_as_float(w[k]);
#else
    const float2 f = ddtree_widen_pair(w[k]);
    x[2 * k] = f.x;
    x[2 * k + 1] = f.y;
#endif
  }
}

// 2^x with subnormal results flushed to 0 (one MUFU.EX2, none of exp2f's subnormal fix-up):
// every term it feeds is summed with the running maximum's own term 1, so a term below 2^-126
// could not change the sum.
__device__ __forceinline__ float ddtree_exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Sum of t[0, N) by a tree of pairwise additions (N a power of two; t is overwritten): log2(N)
// dependent steps instead of N - 1.
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

// A vector's largest entry kept raw (ddtree_vector_peak): for 16-bit logits one word of two
// candidates, the pairwise maxima of the vector's packed pairs (max.bf16x2 or max.f16x2, which
// ignore one NaN as fmaxf does, with subnormals kept), so that a step's maxima take half the
// instructions of maxima of the widened entries; for fp32 the largest entry itself.
// ddtree_peak_value widens a peak to the largest entry's fp32 value: exactly the largest non-NaN
// widened entry, NaN when every entry is NaN.
#if DDTREE_DTYPE == DDTREE_DTYPE_F32
typedef float ddtree_peak_t;

__device__ __forceinline__ ddtree_peak_t ddtree_peak_max(ddtree_peak_t a, ddtree_peak_t b) {
  return fmaxf(a, b);
}

__device__ __forceinline__ float ddtree_peak_value(ddtree_peak_t p) { return p; }

__device__ __forceinline__ ddtree_peak_t ddtree_vector_peak(const uint4& v) {
  return fmaxf(fmaxf(__uint_as_float(v.x), __uint_as_float(v.y)),
               fmaxf(__uint_as_float(v.z), __uint_as_float(v.w)));
}
#else
typedef uint32_t ddtree_peak_t;

__device__ __forceinline__ ddtree_peak_t ddtree_peak_max(ddtree_peak_t a, ddtree_peak_t b) {
  uint32_t r;
#if DDTREE_DTYPE == DDTREE_DTYPE_BF16
  asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#else
  asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#endif
  return r;
}

__device__ __forceinline__ float ddtree_peak_value(ddtree_peak_t p) {
  const float2 f = ddtree_widen_pair(p);
  return fmaxf(f.x, f.y);
}

__device__ __forceinline__ ddtree_peak_t ddtree_vector_peak(const uint4& v) {
  return ddtree_peak_max(ddtree_peak_max(v.x, v.y), ddtree_peak_max(v.z, v.w));
}
#endif

// The largest of N peaks (N a power of two) by a tree of pairwise maxima; t is overwritten.
template <int N>
__device__ __forceinline__ ddtree_peak_t ddtree_tree_peak(ddtree_peak_t (&t)[N]) {
  static_assert(N >= 1 && (N & (N - 1)) == 0, "pairwise trees need a power of two (UNROLL)");
#pragma unroll
  for (int k = 0; k < N / 2; ++k) t[k] = ddtree_peak_max(t[k], t[k + N / 2]);
  if constexpr (N > 2) {
    return ddtree_tree_peak(reinterpret_cast<ddtree_peak_t(&)[N / 2]>(t));
  } else {
    return t[0];
  }
}

// A peak's value scaled by 1/temperature (UNIT: temperature == 1): the largest scaled entry,
// since the division by a positive temperature is monotone.
template <bool UNIT>
__device__ __forceinline__ float ddtree_scaled_peak(ddtree_peak_t p, float temperature) {
  return UNIT ? ddtree_peak_value(p) : ddtree_peak_value(p) / temperature;
}

// The entries x of a raw vector scaled by 1/temperature (UNIT: temperature == 1).
template <bool UNIT>
__device__ __forceinline__ void ddtree_scale_vector(const uint4& v, float temperature,
                                                    float (&x)[DDTREE_VEC]) {
  ddtree_unpack(v, x);
  if (!UNIT) {
#pragma unroll
    for (int k = 0; k < DDTREE_VEC; ++k) x[k] /= temperature;
  }
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

// Largest |m| whose exponents the streaming loop takes as one fma each (ddtree_step_stats):
// below it, m * log2(e) rounds by at most 2^-9, and that error is put back exactly. Rows with
// larger logits take the careful pass, as rows with +inf or NaN do. The fma instead of a
// subtraction and a product took 30 of the loop's 383 instructions per step away; on the H200
// the top-k took 0-2 % less time (B 32 K 64: 69.3 -> 68.2 us, ...-topk-streaming-s24.json).
#define DDTREE_FMA_MAX 32768.0f

// Statistics of one step's UNROLL vectors (entries x, largest non-NaN entry smax): online max
// m, sum s of exp(x - m) over finite x, count of +inf. The common case (smax finite, |m| <
// DDTREE_FMA_MAX, no NaN) has no branch but the rare rescale, and sums by a tree, so that the
// vectors' chains overlap.
__device__ __forceinline__ void ddtree_step_stats(const float (&x)[UNROLL][DDTREE_VEC],
                                                  float smax, float& m, float& s, float& infs) {
  if (smax > -DDTREE_INF && smax < DDTREE_INF) {
    if (smax > m) {
      s *= ddtree_exp2_ftz((m - smax) * DDTREE_LOG2E);
      m = smax;
    }
    if (fabsf(m) < DDTREE_FMA_MAX) {
      // Each exponent is one fma, x * log2(e) - mh, with mh = m * log2(e) rounded: the fma
      // rounds once, and (x - m) * log2(e) = (x * log2(e) - mh) - ml exactly, where ml, the
      // product's rounding error, is exact and |ml| <= 2^-9 here. So the step's sum is the
      // terms' sum times 2^-ml. (A pre-rounded mh alone, with no ml, would shift every
      // exponent by up to 6e-5 at m = 1e3: a row's top token could get a log-prob above 0.)
      const float mh = m * DDTREE_LOG2E;
      const float ml = fmaf(m, DDTREE_LOG2E, -mh);
      float t[UNROLL * DDTREE_VEC];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
        for (int k = 0; k < DDTREE_VEC; ++k) {
          t[u * DDTREE_VEC + k] = ddtree_exp2_ftz(fmaf(x[u][k], DDTREE_LOG2E, -mh));
        }
      }
      const float vs = ddtree_tree_sum(t);
      if (!isnan(vs)) {
        s = fmaf(vs, ddtree_exp2_ftz(-ml), s);
        return;
      }
    }
  }
  // A +inf, a NaN, no finite entry, or |m| >= DDTREE_FMA_MAX (m may already be smax: the
  // careful pass agrees).
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

// Raises the block threshold to `raised` or to the smallest of the warps' published bounds (in
// build_tree.cu's comment), whichever is larger. A bound not yet published reads 0; one read
// stale is smaller than the current one and still a bound. Other warps raise their bounds
// meanwhile, by atomicMax (volatile reads here): no barrier orders the two, on purpose. One
// whole warp calls it.
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

// A lower bound of the j-th largest (1 <= j <= 32, counting equal keys separately) of the warp's
// keys (all > 0), in every lane: j lanes hold keys at or above it. Up to j = 4 the j-th largest
// itself, by j rounds of a warp max, each retiring one lane. Beyond, by each lane's rank among
// keys made distinct by the lane id in their 5 low bits (32 shuffles with no chain between them,
// one compare each), with those bits cleared: at most 31 below the j-th largest key, and the j
// lanes ranked first still hold keys at or above it. On the H200 the ranks made the top-k 1-5 %
// faster than rounds at j = 8 and 16 (B 32 K 64 71.4 -> 70.8 us, K 128 92.8 -> 88.1;
// bench/results/2026-11-30-h200-topk-lane-bound-s15.json) and 3 % slower at j = 2
// (...-topk-experiments-s15.json, run "lane_bound"); the distinct keys took 70 of the 190
// instructions of a rank count away, and 0-1.5 % of the top-k's time (B 32 K 64 67.3 -> 66.5
// us; ...-topk-lane-rank-s25.json). One whole warp calls it.
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
  const uint32_t mine = (key & ~31u) | lane;
  int rank = 0;  // keys above this lane's
#pragma unroll
  for (int i = 0; i < 32; ++i) rank += __shfl_sync(DDTREE_FULL, mine, i) > mine ? 1 : 0;
  const int at = __ffs(__ballot_sync(DDTREE_FULL, rank == j - 1)) - 1;
  return __shfl_sync(DDTREE_FULL, mine, at) & ~31u;
}

// Publishes a lower bound of the j-th largest (1 <= j <= 32) of the lanes' running maxima m
// (ddtree_warp_jth_largest) as the warp's bound when it beats the one published, and raises the
// block threshold. The lanes read disjoint entries and each m is one of them (finite), so j
// distinct entries of the warp are at or above the published value. One whole warp calls it, a
// few times per row (not inlined: see ddtree_step_stats_careful).
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

// Vectors a warp may have recorded as hits and not yet expanded: fewer than DDTREE_EXPAND_AT
// before a step, plus at most one per lane and vector of the step.
#define DDTREE_HITS (DDTREE_EXPAND_AT + 32 * UNROLL)

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
      ddtree_scale_vector<UNIT>(v, temperature, x);
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
// the span); see build_tree.cu's comment (launch 1). UNIT: temperature == 1. Returns the warp's
// number of candidates in cand (at most cap).
template <bool UNIT>
__device__ int ddtree_topk_warp(const ddtree_logit_t* __restrict__ src, float temperature,
                                int begin, int end, int top_k, int cap, bool vectorized,
                                uint64_t* cand, uint4* hit_vec, int32_t* hit_token, uint32_t* hist,
                                unsigned long long* block_threshold, bool first_threshold,
                                uint32_t* warp_bound, const int32_t* unneeded, float& m,
                                float& s, float& infs) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int j = (top_k + TOPK_WARPS - 1) / TOPK_WARPS;
  uint4 cur[UNROLL], nxt[UNROLL];
  if (begin < end) ddtree_load_step(cur, src, begin, end, vectorized);
  if (first_threshold) {
    // The warps' first bounds (build_tree.cu's comment): this warp's j-th largest vector maximum
    // by j rounds of a warp max that each retire one vector. Every warp takes part (the caller
    // checked that each has a whole first step).
    uint32_t keys[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const float vmax =
          fmaxf(-DDTREE_INF, ddtree_scaled_peak<UNIT>(ddtree_vector_peak(cur[u]), temperature));
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
  int count = 0, nh = 0;
  uint32_t step = 0;
  // The steps after which the warp publishes its lane bound: 1, 2, 4, 8, ... (none when j >
  // TOPK_BOUND_MAX_J). Step 1's lane maxima are a subset of the first-step vector maxima, so
  // after the first-step bound their j-th largest cannot beat it: then from step 2.
  uint32_t publish_at = j > TOPK_BOUND_MAX_J ? 0u : first_threshold ? 2u : 1u;
  // Early plans: the select's hint that no pop reads this row (`unneeded`: the row's flag;
  // nullptr for rows the select waits for), as read last by lane 0; checked where the warp
  // would publish its bound.
  int hint = 0;
  // This lane's first vector of the next step (read only where the step is whole and the row
  // 16-byte aligned), advanced by each step.
  const uint4* next_vectors = reinterpret_cast<const uint4*>(src + begin + DDTREE_STRIDE) + lane;
  constexpr int STRIDE_VECTORS = DDTREE_STRIDE / DDTREE_VEC;
  int start = begin;
  // One step: the vectors `now`, at `start`, while the next step's vectors load into `ahead`.
  auto one_step = [&](const uint4 (&now)[UNROLL], uint4 (&ahead)[UNROLL]) {
    if (vectorized && start + DDTREE_STRIDE + DDTREE_STEP <= end) {
      // An interior step (the common case): every vector whole, no bounds to check.
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) ahead[u] = ddtree_load_once(next_vectors + u * 32);
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
      for (int u = 0; u < UNROLL; ++u) ahead[u] = tail.v[u];
    }
    // A vector whose largest entry reaches the threshold is a hit: its lane stores the raw
    // vector for a later warp-wide expansion (one predicated shared store instead of a
    // divergent loop).
    const float floor_value = ddtree_threshold_value(block_threshold);
    float x[UNROLL][DDTREE_VEC];
    ddtree_peak_t peak[UNROLL], tree[UNROLL];  // tree: overwritten by ddtree_tree_peak
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      ddtree_scale_vector<UNIT>(now[u], temperature, x[u]);
      peak[u] = tree[u] = ddtree_vector_peak(now[u]);
    }
    const float smax =
        fmaxf(-DDTREE_INF, ddtree_scaled_peak<UNIT>(ddtree_tree_peak(tree), temperature));
    ddtree_step_stats(x, smax, m, s, infs);
    if (++step == publish_at) {
      if (DDTREE_EARLY_DEPTHS > 0 && __any_sync(DDTREE_FULL, hint != 0)) {
        // The select needs no pop from this row: no more hits, bounds, candidates or steps.
        if (lane == 0) atomicMax(block_threshold, DDTREE_UNNEEDED);
        publish_at = 0u;  // Redundant with start = end, but 0-2 % faster compiled (session 37).
        start = end;
      } else {
        ddtree_publish_lane_bound(m, j, warp_bound, block_threshold);
        publish_at *= 2u;
      }
    }
    // The hint is read a step before it is used, so that no warp waits for the load.
    if (DDTREE_EARLY_DEPTHS > 0 && unneeded != nullptr && lane == 0 && step + 1u == publish_at) {
      hint = *reinterpret_cast<const volatile int32_t*>(unneeded);
    }
    if (__ballot_sync(DDTREE_FULL, smax >= floor_value) != 0u) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const bool hit = ddtree_scaled_peak<UNIT>(peak[u], temperature) >= floor_value;
        const uint32_t ballot = __ballot_sync(DDTREE_FULL, hit);
        const int at = nh + __popc(ballot & ddtree_lanes_below());  // < DDTREE_HITS
        ddtree_store_shared_if(hit_vec + at, now[u], hit);
        ddtree_store_shared_if(hit_token + at, start + (u * 32 + lane) * DDTREE_VEC, hit);
        nh += __popc(ballot);
      }
    }
    if (nh >= DDTREE_EXPAND_AT) {
      count = ddtree_expand_hits<UNIT>(hit_vec, hit_token, nh, temperature, cand, count, cap,
                                       top_k, j, hist, warp_bound, block_threshold);
      nh = 0;
    }
    start += DDTREE_STRIDE;
    next_vectors += STRIDE_VECTORS;
  };
  // Two steps per iteration, the buffers trading roles. A loop of one step ended by copying the
  // next step's vectors from `nxt` to `cur`, and a copy waits for its loads: each warp stalled
  // there until they had landed, before it could issue the loads of the step after. Now a
  // step's first use of its vectors waits, with the following step's loads already issued.
  // On the H200 the top-k took 0-3 % less time (B 32 K 64: 70.8 -> 69.3 us, B 128 231.9 ->
  // 228.6; ...-topk-streaming-s24.json).
  while (start < end) {
    one_step(cur, nxt);
    if (start >= end) break;
    one_step(nxt, cur);
  }
  // The sum holds the lane's maximum's own term 1, which the fma exponents compute as 2^ml *
  // 2^-ml (ddtree_step_stats) and can round just below 1: then a row's top token would get a
  // log-prob above 0 (seen on peaked bf16 rows), and the selects rely on no child outscoring
  // its parent. Every other term only adds to it.
  if (m > -DDTREE_INF) s = fmaxf(s, 1.0f);
  return ddtree_expand_hits<UNIT>(hit_vec, hit_token, nh, temperature, cand, count, cap, top_k,
                                  j, hist, warp_bound, block_threshold);
}

// Most candidates a warp may hold for ddtree_merge_here to order its row by ranks (below, with
// DDTREE_MERGE_RANKS); with more in any warp it orders the row as ddtree_build_merge does.
#define DDTREE_RANK_MAX 128

// The merge of a row by its only top-k block (merge_here, in build_tree.cu's comment, launch 1):
// each warp's `count` (<= top_k) candidates `cand` and statistics (wm, ws, infs) become the
// row's sorted top_k tokens, log-probs and count of possible ones, exactly as
// ddtree_build_merge writes them. `gathered` holds TOPK_WARPS * top_k composites and does not
// overlap the candidate buffers; `sorted` (2 * sort_size composites) may. `hist` is 256 shared
// counters. Every thread of the block calls it.
//
// With DDTREE_MERGE_RANKS (the plan's choice from top_k 17 on) and at most DDTREE_RANK_MAX
// candidates in every warp, each warp sorts its own into gathered[warp * top_k, ..) (an entry's
// place: the warp's entries above it), and after one barrier an entry's rank in the row is the
// sum over the warps' sorted lists of their entries above it (a binary search in each, the
// warps' searches side by side). The row's top_k entries are written straight from their ranks.
// Otherwise every candidate is ranked against all of the row's (ddtree_order_row). On the H200
// the warps' ranks took the top-k at B 32 K 128 from 80.4 to 76.0 us (hits expanded at 128 on
// both sides; bench/results/2026-12-01-h200-topk-expand-s31.json); with the searches one list
// after another instead of side by side it was 4 us slower than the block's ranking at K 64.
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
  float row_max, row_sum, row_inf;
#if DDTREE_MERGE_RANKS
  int held[TOPK_WARPS], most = 0;
#pragma unroll
  for (int w = 0; w < TOPK_WARPS; ++w) {
    held[w] = counts[w];
    most = max(most, held[w]);
  }
  if (most <= DDTREE_RANK_MAX) {
    uint64_t* mine = gathered + warp * (int64_t)top_k;
    for (int i = lane; i < count; i += 32) {
      const uint64_t c = cand[i];
      int above = 0;
#pragma unroll 8
      for (int k = 0; k < count; ++k) above += cand[k] > c ? 1 : 0;
      mine[above] = c;
    }
    // Its barrier publishes the sorted lists (and `counter`, the count of possible entries).
    ddtree_row_stats(stats, TOPK_WARPS, scratch, row_max, row_sum, row_inf);
    const float log_sum = logf(row_sum);
    const int top = most > 0 ? 1 << (31 - __clz(most)) : 0;
    int valid = 0;
    for (int i = lane; i < count; i += 32) {
      const uint64_t c = mine[i];
      // Binary searches for each list's entries above c, their probes side by side (steps
      // top, top / 2, ..., 1 reach any count below 2 * top); the warp's own list: i.
      int above[TOPK_WARPS];
#pragma unroll
      for (int w = 0; w < TOPK_WARPS; ++w) above[w] = 0;
      for (int step = top; step > 0; step >>= 1) {
#pragma unroll
        for (int w = 0; w < TOPK_WARPS; ++w) {
          const int probe = above[w] + step - 1;
          if (w != warp && probe < held[w] && gathered[w * (int64_t)top_k + probe] > c) {
            above[w] += step;
          }
        }
      }
      int rank = i;
#pragma unroll
      for (int w = 0; w < TOPK_WARPS; ++w) rank += above[w];
      if (rank < top_k) {
        const float lp = ddtree_composite_log_prob(c, vocab, row_max, log_sum, row_inf);
        topk_lp[row * top_k + rank] = lp;
        topk_tok[row * top_k + rank] = (int32_t)ddtree_composite_token(c);
        valid += lp > -DDTREE_INF ? 1 : 0;
      }
    }
    // Ranks n .. top_k - 1: pads (token 0xFFFFFFFF, log-prob -inf).
    for (int r = n + threadIdx.x; r < top_k; r += blockDim.x) {
      topk_lp[row * top_k + r] = -DDTREE_INF;
      topk_tok[row * top_k + r] = -1;
    }
    valid = (int)__reduce_add_sync(DDTREE_FULL, (unsigned)valid);
    if (lane == 0 && valid > 0) atomicAdd(&counter, valid);
    __syncthreads();
    if (threadIdx.x == 0) topk_count[row] = counter;
    return;
  }
#endif
  for (int i = lane; i < count; i += 32) gathered[offset + i] = cand[i];
  __syncthreads();  // every candidate is gathered: the buffers under `sorted` are free
  for (int i = threadIdx.x; i < 2 * sort_size; i += blockDim.x) sorted[i] = 0;
  ddtree_row_stats(stats, TOPK_WARPS, scratch, row_max, row_sum, row_inf);  // publishes `sorted`
  ddtree_order_row(gathered, n, top_k, sort_size, sorted, hist, &select_scratch, &counter);
  ddtree_write_row(sorted, row, top_k, vocab, row_max, logf(row_sum), row_inf, scratch, topk_lp,
                   topk_tok, topk_count);
}
