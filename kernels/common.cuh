// Shared device helpers of the ddtree kernels (header-only; sources include it by its quoted name and
// the runtime compiler inlines it, so its bytes are part of every kernel's cache key).
//
// No torch headers: kernels see raw pointers only. Logit dtypes are selected at compile time with
// -DDDTREE_DTYPE=0 (fp32), 1 (bf16) or 2 (fp16); ddtree_load_logit() widens one element to fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#if defined(__CUDACC_RTC__)
// NVRTC ships no <stdint.h>; these are the LP64 widths the kernels rely on.
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif

#define DDTREE_INF __int_as_float(0x7f800000)

#define DDTREE_DTYPE_F32 0
#define DDTREE_DTYPE_BF16 1
#define DDTREE_DTYPE_F16 2

#ifndef DDTREE_DTYPE
#define DDTREE_DTYPE DDTREE_DTYPE_F32
#endif

#if DDTREE_DTYPE == DDTREE_DTYPE_F32
typedef float ddtree_logit_t;
#elif DDTREE_DTYPE == DDTREE_DTYPE_BF16
typedef __nv_bfloat16 ddtree_logit_t;
#else
typedef __half ddtree_logit_t;
#endif

// ErrorFlag values of ddtree.kernels.types (wire contract).
#define DDTREE_ERR_TOKEN 1
#define DDTREE_ERR_TREE 2
#define DDTREE_ERR_BLOCK_TABLE 4
#define DDTREE_ERR_LENGTH 8
#define DDTREE_ERR_ACCEPTANCE 16

// Programmatic dependent launch (sm_90 and later). A kernel launched with
// jit.LaunchParams(dependent=True) may start while the previous kernel of its stream still runs:
// every one of its threads calls ddtree_wait_for_previous_grid() before it touches global memory
// that kernel could read or write (so the grid cannot end before its predecessor, and a
// dependent launched behind it waits for both). ddtree_allow_dependents() lets the next such
// kernel get its blocks resident while this one runs. Without the launch attribute both return
// at once.
__device__ __forceinline__ void ddtree_wait_for_previous_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void ddtree_allow_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A flag another grid raises with ddtree_publish_flag, read at GPU scope with acquire order:
// once it reads non-zero, what the publishing block wrote before is visible to this thread (and,
// after a block barrier, to its block).
__device__ __forceinline__ int ddtree_load_acquire(const int32_t* flag) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

// Raises `*flag` once every thread of the block has written what it guards (every thread calls
// it: each thread's fence, then a barrier, then one store with release order).
__device__ __forceinline__ void ddtree_publish_flag(int32_t* flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(flag), "r"(1) : "memory");
  }
}

__device__ __forceinline__ float ddtree_to_float(float x) { return x; }
__device__ __forceinline__ float ddtree_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ddtree_to_float(__half x) { return __half2float(x); }

// Logit scaled by 1/temperature in fp32 with NaN counted as -inf (the reference's rule).
__device__ __forceinline__ float ddtree_scaled_logit(ddtree_logit_t raw, float temperature) {
  float x = ddtree_to_float(raw) / temperature;
  return isnan(x) ? -DDTREE_INF : x;
}

// Monotone map of fp32 to uint32: a < b (as floats, no NaN) iff key(a) < key(b).
__device__ __forceinline__ uint32_t ddtree_order_key(float x) {
  uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float ddtree_key_to_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// 32-bit integer hash (lowbias32 by C. Wellons); the reference's mix32.
__device__ __forceinline__ uint32_t ddtree_mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// Per-(request, node) key of the counter-based Gumbel noise (see reference.accept).
__device__ __forceinline__ uint32_t ddtree_noise_key(int64_t seed, uint32_t request, uint32_t node) {
  uint32_t lo = (uint32_t)((uint64_t)seed & 0xFFFFFFFFull);
  uint32_t hi = (uint32_t)((uint64_t)seed >> 32);
  uint32_t k = ddtree_mix32(ddtree_mix32(lo) ^ hi);
  k = ddtree_mix32(k ^ request);
  return ddtree_mix32(k ^ node);
}

// Gumbel(0, 1) noise of token v under key k: h = mix32(k ^ v), u = ((h >> 9) + 0.5) * 2^-23
// (exact in fp32, inside (0, 1)), g = -log(-log(u)) in fp32 (reference.sampling_noise).
__device__ __forceinline__ float ddtree_gumbel(uint32_t key, uint32_t token) {
  const uint32_t h = ddtree_mix32(key ^ token);
  const float u = ((float)(h >> 9) + 0.5f) * 1.1920928955078125e-07f;
  return -logf(-logf(u));
}

// (value, index) pair ordering used by every argmax/top-k: larger value first, then smaller id.
__device__ __forceinline__ bool ddtree_better(float a, int ia, float b, int ib) {
  return a > b || (a == b && ia < ib);
}

__device__ __forceinline__ void ddtree_warp_argmax(float& v, int& i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    float ov = __shfl_xor_sync(0xFFFFFFFFu, v, off);
    int oi = __shfl_xor_sync(0xFFFFFFFFu, i, off);
    if (ddtree_better(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}
