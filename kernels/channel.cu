// GPU doorbell channel: the device side of docs/channel.md (both the caller's and the service's).
//
// Python side: ddtree.kernels.channel (layout constants, descriptor packing, the host mirror of
// ddtree_channel_resolve's validation, ``validate_descriptor``, which the CPU tests compare with).
//
// The op kernels are THE SAME source as the RPC path's: build_tree.cu, accept.cu and
// commit_kv.cu are included below with `__global__` redefined as `__device__` (and their launch
// bounds dropped), so their entry points become device functions that the ddtree_channel_*
// kernels call after reading the step's pointers, batch size and scalars from the args block
// that ddtree_channel_resolve wrote. A block past the step's batch returns before calling in,
// so a launch sized for the channel's largest batch serves any smaller step. The launch bounds
// are restored on the wrappers with the same macros (TOPK_WARPS, TOPK_MIN_BLOCKS, ...).
//
// Compile-time selection: DDTREE_CHANNEL_OP = 1 (build_tree: build_tree.cu with DDTREE_DTYPE the
// draft logits' dtype) or 2 (accept: accept.cu + commit_kv.cu, DDTREE_DTYPE the target logits'
// dtype, ACCEPT_THREADS 256 for target tokens or 1024 for target logits); 0 (the default) builds
// only the protocol kernels (post, wait, resolve, finish), which the caller side loads.
//
// Kernels (all tiny except the wrapped op kernels):
//   ddtree_channel_post     caller stream; grid 1, block 1. Writes descriptor words into ring slot
//                           (k - 1) % ring_size with k = doorbell + 1, the last-status record
//                           {PENDING, 0, k}, done = 0, then (after a system fence) doorbell = k.
//                           On a channel whose state is not OPEN it only writes the status record
//                           {CLOSED or SERVICE_LOST} and done = 1, so the caller's wait returns.
//   ddtree_channel_wait     caller stream, grid 1, block 1: spins (with nanosleep) until done == 1;
//                           the alternative to cuStreamWaitValue32 where stream memory operations
//                           are not available.
//   ddtree_channel_resolve  service stream after cuStreamWaitValue32(doorbell >= k); grid 1, block
//                           RESOLVE_THREADS. Reads descriptor k once, validates every field and
//                           every reference against the region table (base, size) recorded at
//                           OpenChannel, and writes the args block; on any failure (or once the
//                           channel is closing, or the caller's watchdog marked the block
//                           SERVICE_LOST) the args block says status != 0 and the op kernels do
//                           nothing.
//   ddtree_channel_finish   service stream after the op kernels; grid 1, block FINISH_THREADS.
//                           Writes completion = k, then done = 1 (caller memory), then the step's
//                           small results into a pinned host slot for metrics (off the caller's
//                           path: the caller is already released).
// Shared memory: a few hundred bytes (resolve's copy of the descriptor).
#include "common.cuh"

#ifndef DDTREE_CHANNEL_OP
#define DDTREE_CHANNEL_OP 0
#endif
#ifndef RESOLVE_THREADS
#define RESOLVE_THREADS 128
#endif
#ifndef FINISH_THREADS
#define FINISH_THREADS 128
#endif

// ---- control block layout (byte offsets; docs/channel.md) -----------------------------------
#define DDTREE_CH_DOORBELL 0      // u64, written by the caller
#define DDTREE_CH_COMPLETION 8    // u64, written by the service
#define DDTREE_CH_DONE 16         // u32, 0 by the caller's post, 1 by the service (or watchdog)
#define DDTREE_CH_STATE 20        // u32, 0 open, 1 closed by the service, 2 service lost
#define DDTREE_CH_LAST_STATUS 24  // {u32 status, u32 detail, u64 step}
#define DDTREE_CH_RECORDS 64      // ring_size records {u32 status, u32 detail, u64 step}
#define DDTREE_CH_RING(ring) ((DDTREE_CH_RECORDS + 16 * (ring) + 255) / 256 * 256)
#define DDTREE_CH_DESC_BYTES 256
#define DDTREE_CH_DESC_WORDS 32
#define DDTREE_CH_REFS 14

#define DDTREE_CH_STATE_OPEN 0
#define DDTREE_CH_STATE_CLOSED 1
#define DDTREE_CH_STATE_LOST 2

// Step status codes (kernels/channel.py StepStatus).
#define DDTREE_ST_OK 0
#define DDTREE_ST_PENDING 1
#define DDTREE_ST_BAD_OP 2
#define DDTREE_ST_BAD_BATCH 3
#define DDTREE_ST_BAD_FLAGS 4
#define DDTREE_ST_BAD_BUDGET 5
#define DDTREE_ST_BAD_TEMPERATURE 6
#define DDTREE_ST_BAD_REGION 7
#define DDTREE_ST_OUT_OF_BOUNDS 8
#define DDTREE_ST_MISALIGNED 9
#define DDTREE_ST_CLOSED 10
#define DDTREE_ST_SERVICE_LOST 11

// Descriptor flags.
#define DDTREE_DF_BUDGETS 1
#define DDTREE_DF_ERROR_FLAGS 2
#define DDTREE_DF_KV_COMMIT 4
#define DDTREE_DF_CLEAR_FLAGS 8

// Reference slots of the two ops.
#define DDTREE_B_LOGITS 0
#define DDTREE_B_ROOTS 1
#define DDTREE_B_BUDGETS 2
#define DDTREE_B_TOKENS 3
#define DDTREE_B_PARENTS 4
#define DDTREE_B_DEPTHS 5
#define DDTREE_B_LOG_PROBS 6
#define DDTREE_B_NUM_NODES 7
#define DDTREE_B_MASK 8
#define DDTREE_B_FLAGS 9
#define DDTREE_A_TOKENS 0
#define DDTREE_A_PARENTS 1
#define DDTREE_A_DEPTHS 2
#define DDTREE_A_NUM_NODES 3
#define DDTREE_A_TARGET 4
#define DDTREE_A_PATH_NODES 5
#define DDTREE_A_PATH_TOKENS 6
#define DDTREE_A_LENGTH 7
#define DDTREE_A_BONUS 8
#define DDTREE_A_FLAGS 9
#define DDTREE_A_KV_CACHE 10
#define DDTREE_A_BLOCK_TABLE 11
#define DDTREE_A_PREFIX_LENS 12

// Fixed shape of a channel (service memory, written once at OpenChannel).
struct DdtreeChannelConfig {
  int32_t op;              // 1 build_tree, 2 accept
  int32_t max_batch;
  int32_t draft_len;       // L
  int32_t vocab;           // V of the draft logits (build) or target logits (accept, 0: tokens)
  int32_t logit_bytes;     // element size of those logits
  int32_t num_nodes_max;   // N = 1 + max_budget
  int32_t words;           // mask words per node
  int32_t max_budget;
  int32_t logit_align;     // byte alignment the logits need (16 for the vectorised top-k)
  int32_t has_kv;          // accept: KV commit allowed
  int32_t kv_row_bytes;    // head_dim * element size
  int32_t num_pages;
  int32_t page_size;
  int32_t max_pages;
  int32_t kv_align;        // element size of the KV cache (16-byte rows are checked too)
  int32_t num_regions;
};

// Per-step arguments of the op kernels (service memory, written by resolve).
struct DdtreeChannelArgs {
  int32_t status;  // != 0: the op kernels do nothing
  int32_t batch_size;
  int32_t mode;    // accept: 0 target tokens, 1 greedy logits, 2 sampled logits
  float temperature;
  int64_t seed;
  int32_t has_kv;
  int32_t flags;
  uint64_t step;
  void* ptr[DDTREE_CH_REFS];
};

// ---------------------------------------------------------------------------- caller side

#define DDTREE_W(i) uint64_t w##i
extern "C" __global__ void ddtree_channel_post(
    uint8_t* __restrict__ ctrl, int32_t ring_size,
    DDTREE_W(0), DDTREE_W(1), DDTREE_W(2), DDTREE_W(3), DDTREE_W(4), DDTREE_W(5), DDTREE_W(6),
    DDTREE_W(7), DDTREE_W(8), DDTREE_W(9), DDTREE_W(10), DDTREE_W(11), DDTREE_W(12),
    DDTREE_W(13), DDTREE_W(14), DDTREE_W(15), DDTREE_W(16), DDTREE_W(17), DDTREE_W(18),
    DDTREE_W(19), DDTREE_W(20), DDTREE_W(21), DDTREE_W(22), DDTREE_W(23), DDTREE_W(24),
    DDTREE_W(25), DDTREE_W(26), DDTREE_W(27), DDTREE_W(28), DDTREE_W(29), DDTREE_W(30),
    DDTREE_W(31)) {
  volatile uint64_t* doorbell = (volatile uint64_t*)(ctrl + DDTREE_CH_DOORBELL);
  volatile uint32_t* done = (volatile uint32_t*)(ctrl + DDTREE_CH_DONE);
  volatile uint32_t* state = (volatile uint32_t*)(ctrl + DDTREE_CH_STATE);
  volatile uint32_t* last = (volatile uint32_t*)(ctrl + DDTREE_CH_LAST_STATUS);
  const uint64_t k = *doorbell + 1;
  const uint32_t s = *state;
  if (s != DDTREE_CH_STATE_OPEN) {
    last[0] = s == DDTREE_CH_STATE_CLOSED ? DDTREE_ST_CLOSED : DDTREE_ST_SERVICE_LOST;
    last[1] = 0;
    *(volatile uint64_t*)(last + 2) = k;
    __threadfence_system();
    *done = 1;
    return;
  }
  const uint64_t words[DDTREE_CH_DESC_WORDS] = {w0,  w1,  w2,  w3,  w4,  w5,  w6,  w7,
                                                w8,  w9,  w10, w11, w12, w13, w14, w15,
                                                w16, w17, w18, w19, w20, w21, w22, w23,
                                                w24, w25, w26, w27, w28, w29, w30, w31};
  const int slot = (int)((k - 1) % (uint64_t)ring_size);
  volatile uint64_t* desc =
      (volatile uint64_t*)(ctrl + DDTREE_CH_RING(ring_size) + slot * DDTREE_CH_DESC_BYTES);
#pragma unroll
  for (int i = 0; i < DDTREE_CH_DESC_WORDS; ++i) desc[i] = words[i];
  last[0] = DDTREE_ST_PENDING;
  last[1] = 0;
  *(volatile uint64_t*)(last + 2) = k;
  *done = 0;
  __threadfence_system();
  *doorbell = k;
}

extern "C" __global__ void ddtree_channel_wait(const uint8_t* __restrict__ ctrl) {
  const volatile uint32_t* done = (const volatile uint32_t*)(ctrl + DDTREE_CH_DONE);
  while (*done != 1) __nanosleep(200);
  __threadfence_system();
}

// ---------------------------------------------------------------------------- service side

// Bytes of reference `r` for a batch of `b` (0: the op does not use it), and its alignment.
__device__ __forceinline__ void ddtree_ref_need(const DdtreeChannelConfig& c, int r, int64_t b,
                                                uint32_t flags, int mode_tokens, int64_t* bytes,
                                                int64_t* align) {
  const int64_t n = c.num_nodes_max;
  const int64_t p = c.draft_len + 1;
  *bytes = 0;
  *align = 1;
  if (c.op == 1) {
    switch (r) {
      case DDTREE_B_LOGITS: *bytes = b * c.draft_len * (int64_t)c.vocab * c.logit_bytes;
        *align = c.logit_align; break;
      case DDTREE_B_ROOTS: *bytes = b * 8; *align = 8; break;
      case DDTREE_B_BUDGETS: *bytes = (flags & DDTREE_DF_BUDGETS) ? b * 4 : 0; *align = 4; break;
      case DDTREE_B_TOKENS: *bytes = b * n * 8; *align = 8; break;
      case DDTREE_B_PARENTS: case DDTREE_B_DEPTHS: case DDTREE_B_LOG_PROBS:
        *bytes = b * n * 4; *align = 4; break;
      case DDTREE_B_NUM_NODES: *bytes = b * 4; *align = 4; break;
      case DDTREE_B_MASK: *bytes = b * n * c.words * 8; *align = 8; break;
      case DDTREE_B_FLAGS: *bytes = (flags & DDTREE_DF_ERROR_FLAGS) ? b * 4 : 0; *align = 4; break;
      default: break;
    }
  } else {
    const bool kv = (flags & DDTREE_DF_KV_COMMIT) != 0;
    switch (r) {
      case DDTREE_A_TOKENS: *bytes = b * n * 8; *align = 8; break;
      case DDTREE_A_PARENTS: case DDTREE_A_DEPTHS: *bytes = b * n * 4; *align = 4; break;
      case DDTREE_A_NUM_NODES: *bytes = b * 4; *align = 4; break;
      case DDTREE_A_TARGET:
        if (mode_tokens) { *bytes = b * n * 8; *align = 8; }
        else { *bytes = b * n * (int64_t)c.vocab * c.logit_bytes; *align = c.logit_bytes; }
        break;
      case DDTREE_A_PATH_NODES: *bytes = b * p * 4; *align = 4; break;
      case DDTREE_A_PATH_TOKENS: *bytes = b * p * 8; *align = 8; break;
      case DDTREE_A_LENGTH: *bytes = b * 4; *align = 4; break;
      case DDTREE_A_BONUS: *bytes = b * 8; *align = 8; break;
      case DDTREE_A_FLAGS: *bytes = (flags & DDTREE_DF_ERROR_FLAGS) ? b * 4 : 0; *align = 4; break;
      case DDTREE_A_KV_CACHE:
        *bytes = kv ? (int64_t)c.num_pages * c.page_size * c.kv_row_bytes : 0; *align = 16; break;
      case DDTREE_A_BLOCK_TABLE: *bytes = kv ? b * c.max_pages * 4 : 0; *align = 4; break;
      case DDTREE_A_PREFIX_LENS: *bytes = kv ? b * 4 : 0; *align = 4; break;
      default: break;
    }
  }
}

extern "C" __global__ void __launch_bounds__(RESOLVE_THREADS) ddtree_channel_resolve(
    uint8_t* __restrict__ ctrl, int32_t ring_size, uint64_t step,
    const DdtreeChannelConfig* __restrict__ cfg,
    const uint64_t* __restrict__ regions,  // [num_regions, 2]: base address, byte size
    const int32_t* __restrict__ cancel,    // [1], service memory: non-zero once closing
    DdtreeChannelArgs* __restrict__ args,
    int32_t* __restrict__ budgets,         // [max_batch], service memory
    int32_t* __restrict__ own_flags) {     // [max_batch], service memory
  __shared__ uint64_t desc[DDTREE_CH_DESC_WORDS];
  __shared__ int status, detail, batch;
  const int tid = threadIdx.x;
  const DdtreeChannelConfig c = *cfg;
  const int slot = (int)((step - 1) % (uint64_t)ring_size);
  if (tid < DDTREE_CH_DESC_WORDS) {
    // One read of each word: the caller may rewrite its slot meanwhile, only this copy counts.
    const volatile uint64_t* src =
        (const volatile uint64_t*)(ctrl + DDTREE_CH_RING(ring_size) + slot * DDTREE_CH_DESC_BYTES);
    desc[tid] = src[tid];
  }
  __syncthreads();
  const uint32_t op = (uint32_t)desc[0];
  const int64_t b = (int64_t)(uint32_t)(desc[0] >> 32);
  const uint32_t flags = (uint32_t)desc[1];
  const uint32_t budget = (uint32_t)(desc[1] >> 32);
  const float temperature = __uint_as_float((uint32_t)desc[2]);
  const int mode_tokens = c.op == 2 && c.vocab == 0;
  if (tid == 0) {
    int st = DDTREE_ST_OK, det = 0;
    const uint32_t allowed = DDTREE_DF_ERROR_FLAGS | DDTREE_DF_CLEAR_FLAGS |
                             (c.op == 1 ? DDTREE_DF_BUDGETS : 0) |
                             (c.op == 2 && c.has_kv ? DDTREE_DF_KV_COMMIT : 0);
    const bool clear_alone = (flags & DDTREE_DF_CLEAR_FLAGS) && !(flags & DDTREE_DF_ERROR_FLAGS);
    if (*(const volatile int32_t*)cancel) {
      st = DDTREE_ST_CLOSED;
    } else if (*(const volatile uint32_t*)(ctrl + DDTREE_CH_STATE) == DDTREE_CH_STATE_LOST) {
      // The caller's watchdog gave up on this service (a step overdue) and released its
      // stream: a step posted before that, reached only now, must not write the caller's memory.
      st = DDTREE_ST_SERVICE_LOST;
    } else if (op != (uint32_t)c.op) {
      st = DDTREE_ST_BAD_OP;
    } else if (b < 1 || b > c.max_batch) {
      st = DDTREE_ST_BAD_BATCH;
    } else if ((flags & ~allowed) || clear_alone) {
      st = DDTREE_ST_BAD_FLAGS;
    } else if (c.op == 1 && !(flags & DDTREE_DF_BUDGETS) &&
               (budget < 1 || budget > (uint32_t)c.max_budget)) {
      st = DDTREE_ST_BAD_BUDGET;
    } else if (c.op == 1 ? !(temperature > 0.0f && temperature <= 3.402823466e38f)
                         : !(temperature >= 0.0f && temperature <= 3.402823466e38f) ||
                               (mode_tokens && temperature != 0.0f)) {
      st = DDTREE_ST_BAD_TEMPERATURE;
    }
    for (int r = 0; st == DDTREE_ST_OK && r < DDTREE_CH_REFS; ++r) {
      int64_t need, align;
      ddtree_ref_need(c, r, b, flags, mode_tokens, &need, &align);
      const uint32_t region = (uint32_t)desc[4 + 2 * r];
      const uint64_t offset = desc[5 + 2 * r];
      if (need == 0) {
        args->ptr[r] = nullptr;
        continue;
      }
      if (region >= (uint32_t)c.num_regions) {
        st = DDTREE_ST_BAD_REGION;
        det = r;
        break;
      }
      const uint64_t base = regions[2 * region];
      const uint64_t size = regions[2 * region + 1];
      if ((base + offset) % (uint64_t)align != 0) {
        st = DDTREE_ST_MISALIGNED;
        det = r;
        break;
      }
      if (offset > size || (uint64_t)need > size - offset) {  // no overflow
        st = DDTREE_ST_OUT_OF_BOUNDS;
        det = r;
        break;
      }
      args->ptr[r] = (void*)(base + offset);
    }
    status = st;
    detail = det;
    batch = st == DDTREE_ST_OK ? (int)b : 0;
  }
  __syncthreads();
  // Budgets and error flags live in service memory: copied (and checked) or filled here.
  if (status == DDTREE_ST_OK && c.op == 1) {
    const int32_t* given = (flags & DDTREE_DF_BUDGETS) ? (const int32_t*)args->ptr[DDTREE_B_BUDGETS]
                                                       : nullptr;
    int bad = 0;
    for (int i = tid; i < batch; i += RESOLVE_THREADS) {
      const int32_t v = given ? given[i] : (int32_t)budget;
      if (v < 1 || v > c.max_budget) bad = 1;
      budgets[i] = v;
    }
    if (__syncthreads_or(bad) && tid == 0) {
      status = DDTREE_ST_BAD_BUDGET;
      detail = DDTREE_B_BUDGETS;
      batch = 0;
    }
    __syncthreads();
  }
  if (status == DDTREE_ST_OK && !(flags & DDTREE_DF_ERROR_FLAGS)) {
    for (int i = tid; i < batch; i += RESOLVE_THREADS) own_flags[i] = 0;
  }
  if (status == DDTREE_ST_OK && (flags & DDTREE_DF_CLEAR_FLAGS)) {
    int32_t* given = (int32_t*)args->ptr[c.op == 1 ? DDTREE_B_FLAGS : DDTREE_A_FLAGS];
    for (int i = tid; i < batch; i += RESOLVE_THREADS) given[i] = 0;
  }
  if (tid == 0) {
    const int fr = c.op == 1 ? DDTREE_B_FLAGS : DDTREE_A_FLAGS;
    if (status == DDTREE_ST_OK && !(flags & DDTREE_DF_ERROR_FLAGS)) args->ptr[fr] = own_flags;
    if (c.op == 1 && status == DDTREE_ST_OK) args->ptr[DDTREE_B_BUDGETS] = budgets;
    args->status = status;
    args->batch_size = batch;
    args->temperature = temperature;
    args->seed = (int64_t)desc[3];
    args->mode = mode_tokens ? 0 : (temperature > 0.0f ? 2 : 1);
    args->has_kv = (flags & DDTREE_DF_KV_COMMIT) != 0;
    args->flags = (int32_t)flags;
    args->step = step;
    volatile uint32_t* rec = (volatile uint32_t*)(ctrl + DDTREE_CH_RECORDS + 16 * slot);
    rec[0] = status == DDTREE_ST_OK ? DDTREE_ST_PENDING : status;
    rec[1] = detail;
    *(volatile uint64_t*)(rec + 2) = step;
    volatile uint32_t* last = (volatile uint32_t*)(ctrl + DDTREE_CH_LAST_STATUS);
    last[0] = rec[0];
    last[1] = detail;
    *(volatile uint64_t*)(last + 2) = step;
  }
}

// Host slot of one step's results (pinned host memory, read by the service's step thread):
// [0] step (written last), [1] status, [2] batch, [3] op, then per request num_nodes (build) or
// length, num_nodes, path nodes (accept), as int32.
extern "C" __global__ void __launch_bounds__(FINISH_THREADS) ddtree_channel_finish(
    uint8_t* __restrict__ ctrl, int32_t ring_size, const DdtreeChannelConfig* __restrict__ cfg,
    const DdtreeChannelArgs* __restrict__ args, volatile int64_t* __restrict__ host_slot) {
  const int tid = threadIdx.x;
  const DdtreeChannelConfig c = *cfg;
  const int status = args->status;
  const int batch = args->batch_size;
  const uint64_t step = args->step;
  if (tid == 0) {
    const int slot = (int)((step - 1) % (uint64_t)ring_size);
    if (status == DDTREE_ST_OK) {
      volatile uint32_t* rec = (volatile uint32_t*)(ctrl + DDTREE_CH_RECORDS + 16 * slot);
      rec[0] = DDTREE_ST_OK;
      volatile uint32_t* last = (volatile uint32_t*)(ctrl + DDTREE_CH_LAST_STATUS);
      last[0] = DDTREE_ST_OK;
    }
    __threadfence_system();
    *(volatile uint64_t*)(ctrl + DDTREE_CH_COMPLETION) = step;
    __threadfence_system();
    *(volatile uint32_t*)(ctrl + DDTREE_CH_DONE) = 1;
  }
  // The caller is released; now the metrics copy.
  volatile int32_t* out = (volatile int32_t*)(host_slot + 1);
  if (status == DDTREE_ST_OK) {
    const int p = c.draft_len + 1;
    for (int i = tid; i < batch; i += FINISH_THREADS) {
      if (c.op == 1) {
        out[4 + i] = ((const int32_t*)args->ptr[DDTREE_B_NUM_NODES])[i];
      } else {
        out[4 + i] = ((const int32_t*)args->ptr[DDTREE_A_LENGTH])[i];
        out[4 + c.max_batch + i] = ((const int32_t*)args->ptr[DDTREE_A_NUM_NODES])[i];
      }
    }
    if (c.op == 2) {
      const int32_t* nodes = (const int32_t*)args->ptr[DDTREE_A_PATH_NODES];
      for (int i = tid; i < batch * p; i += FINISH_THREADS) out[4 + 2 * c.max_batch + i] = nodes[i];
    }
  }
  __syncthreads();
  if (tid == 0) {
    out[0] = status;
    out[1] = batch;
    out[2] = c.op;
    __threadfence_system();
    host_slot[0] = (int64_t)step;
  }
}

// ---------------------------------------------------------------------------- op kernels

#if DDTREE_CHANNEL_OP != 0
// NVRTC's push_macro/pop_macro do not restore these built-in macros, so they are redefined
// explicitly afterwards (to the definitions of crt/host_defines.h).
#undef __global__
#define __global__ __device__
#undef __launch_bounds__
#define __launch_bounds__(...)
#if DDTREE_CHANNEL_OP == 1
#include "build_tree.cu"
#else
#include "accept.cu"
#include "commit_kv.cu"
#endif
#undef __global__
#define __global__ __attribute__((global))
#undef __launch_bounds__
#define __launch_bounds__(...) __attribute__((launch_bounds(__VA_ARGS__)))
#endif

#if DDTREE_CHANNEL_OP == 1
extern "C" __global__ void __launch_bounds__(TOPK_WARPS * 32, TOPK_MIN_BLOCKS)
    ddtree_channel_build_topk(const DdtreeChannelArgs* __restrict__ a, int32_t draft_len,
                              int32_t vocab, int32_t span, int32_t top_k, int32_t cap,
                              int32_t vectorized, uint64_t* part_keys, float* part_stats,
                              int32_t merge_here, int32_t sort_size, float* topk_lp,
                              int32_t* topk_tok, int32_t* topk_count, int32_t* row_ready) {
  if (a->status != 0 || blockIdx.y >= (unsigned)(a->batch_size * draft_len)) return;
  ddtree_build_topk((const ddtree_logit_t*)a->ptr[DDTREE_B_LOGITS], a->temperature, vocab, span,
                    top_k, cap, vectorized, part_keys, part_stats, merge_here, sort_size, topk_lp,
                    topk_tok, topk_count, a->batch_size, draft_len, row_ready);
}

extern "C" __global__ void __launch_bounds__(MERGE_THREADS) ddtree_channel_build_merge(
    const DdtreeChannelArgs* __restrict__ a, int32_t draft_len, const uint64_t* part_keys,
    const float* part_stats, int32_t num_parts, int32_t top_k, int32_t sort_size, int32_t vocab,
    float* topk_lp, int32_t* topk_tok, int32_t* topk_count) {
  if (a->status != 0 || blockIdx.x >= (unsigned)(a->batch_size * draft_len)) return;
  ddtree_build_merge(part_keys, part_stats, num_parts, top_k, sort_size, vocab, topk_lp, topk_tok,
                     topk_count);
}

extern "C" __global__ void DDTREE_SELECT_BOUNDS
    ddtree_channel_build_select(const DdtreeChannelArgs* __restrict__ a, const float* topk_lp,
                                const int32_t* topk_tok, const int32_t* topk_count, int32_t vocab,
                                int32_t draft_len, int32_t top_k, int32_t num_nodes_max,
                                int32_t words, int32_t lp_in_smem, int32_t wide_cap,
                                int32_t wide_min_budget, int32_t sort_size,
                                int32_t* row_ready) {
  if (a->status != 0 || blockIdx.x >= (unsigned)a->batch_size) return;
  ddtree_build_select(topk_lp, topk_tok, topk_count, (const int64_t*)a->ptr[DDTREE_B_ROOTS],
                      (const int32_t*)a->ptr[DDTREE_B_BUDGETS], (int32_t*)a->ptr[DDTREE_B_FLAGS],
                      (int64_t*)a->ptr[DDTREE_B_TOKENS], (int32_t*)a->ptr[DDTREE_B_PARENTS],
                      (int32_t*)a->ptr[DDTREE_B_DEPTHS], (float*)a->ptr[DDTREE_B_LOG_PROBS],
                      (int32_t*)a->ptr[DDTREE_B_NUM_NODES], (int64_t*)a->ptr[DDTREE_B_MASK],
                      vocab, draft_len, top_k, num_nodes_max, words, lp_in_smem, a->batch_size,
                      0, wide_cap, wide_min_budget, sort_size, row_ready);
}
#endif

#if DDTREE_CHANNEL_OP == 2
extern "C" __global__ void __launch_bounds__(ACCEPT_THREADS) ddtree_channel_accept(
    const DdtreeChannelArgs* __restrict__ a, int32_t num_nodes_max, int32_t draft_len,
    int32_t vocab) {
  if (a->status != 0 || blockIdx.x >= (unsigned)a->batch_size) return;
  const int mode = a->mode;
  ddtree_accept((const int64_t*)a->ptr[DDTREE_A_TOKENS], (const int32_t*)a->ptr[DDTREE_A_PARENTS],
                (const int32_t*)a->ptr[DDTREE_A_DEPTHS], (const int32_t*)a->ptr[DDTREE_A_NUM_NODES],
                mode == 0 ? (const int64_t*)a->ptr[DDTREE_A_TARGET] : nullptr,
                mode == 0 ? nullptr : (const ddtree_logit_t*)a->ptr[DDTREE_A_TARGET], &a->seed,
                (int32_t*)a->ptr[DDTREE_A_FLAGS], (int32_t*)a->ptr[DDTREE_A_PATH_NODES],
                (int64_t*)a->ptr[DDTREE_A_PATH_TOKENS], (int32_t*)a->ptr[DDTREE_A_LENGTH],
                (int64_t*)a->ptr[DDTREE_A_BONUS], num_nodes_max, draft_len, vocab, mode,
                a->temperature, a->batch_size, 0);
}

extern "C" __global__ void ddtree_channel_commit_kv(const DdtreeChannelArgs* __restrict__ a,
                                                   int32_t num_pages, int32_t page_size,
                                                   int32_t row_vecs, int32_t max_pages,
                                                   int32_t path_len) {
  if (a->status != 0 || !a->has_kv || blockIdx.x >= (unsigned)a->batch_size) return;
  ddtree_commit_kv((uint4*)a->ptr[DDTREE_A_KV_CACHE], (const int32_t*)a->ptr[DDTREE_A_BLOCK_TABLE],
                   (const int32_t*)a->ptr[DDTREE_A_PREFIX_LENS],
                   (const int32_t*)a->ptr[DDTREE_A_PATH_NODES],
                   (const int32_t*)a->ptr[DDTREE_A_LENGTH], (int32_t*)a->ptr[DDTREE_A_FLAGS],
                   num_pages, page_size, row_vecs, max_pages, path_len, a->batch_size, 0);
}
#endif
