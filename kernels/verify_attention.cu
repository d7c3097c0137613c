// Tree-verify MLA attention (absorbed form) over a paged latent cache, on tensor cores.
//
// Python reference: ddtree.kernels.reference.verify_attention (contract: kernels/attention.py).
//
// Problem. Request b has R = num_nodes_max * num_heads query rows (row r = node * num_heads +
// head, so q[b] is a contiguous [R, HEAD_DIM] matrix) that all attend to ONE latent K/V sequence:
// logical positions p < prefix_len (no mask) and prefix_len + j for j < num_nodes whose bit j is
// set in the row's tree.mask row (ancestor-or-self). K is the full HEAD_DIM latent, V its first
// V_DIM dims, so one shared-memory tile of keys serves both products.
//
// Kernels (all extern "C"; variants by -D macros, defaults below compile for sm_90/100/120):
//   ddtree_verify_attention_check    grid (batch_size), block 256. Validates num_nodes, prefix
//       lengths and every block-table entry the request reads (the bits of
//       ddtree.kernels.checks.attention_flags); writes them to flags[b], ORs them into
//       error_flags[b] (when given) and sets skip[b] when the request must be left untouched
//       (its own bits, or bits an earlier op set in error_flags).
//   ddtree_verify_attention          grid (m_tiles, num_splits, batch_size), block 32 *
//       WARPS_M * WARPS_N. One CTA = BLOCK_M query rows x one contiguous range of key tiles (its
//       split of the request's ceil((prefix_len + num_nodes) / BLOCK_N) tiles). Flash-style
//       online softmax over key tiles of BLOCK_N keys, cp.async double buffering of the tiles
//       (one barrier per tile for the pipeline, one for the row-max exchange, one for P).
//       Warp (wm, wn) of WARPS_M x WARPS_N computes S for rows wm*WM.. and keys wn*WN..,
//       exchanges row maxima through shared memory, writes its P slice (bf16) to shared memory,
//       then accumulates O for rows wm*WM.. and value dims wn*WD.. from the whole P tile.
//       Portable path (VA_WGMMA=0, sm_80+): mma.sync m16n8k16 bf16 -> fp32 with ldmatrix.
//       Hopper path (VA_WGMMA=1, sm_90a only): the same schedule with warpgroup wn issuing
//       wgmma m64n32k16 for S and m64n256k16 for O straight from shared memory.
//       With num_splits == 1 the CTA writes out/lse; otherwise normalised fp32 partials.
//   ddtree_verify_attention_combine  grid (R, batch_size), block 128. Merges the splits of one
//       row by their log-sum-exp and writes out/lse.
//
// Shared memory (dynamic, bytes): Q tile BLOCK_M*HEAD_DIM*2, two key tiles 2*BLOCK_N*HEAD_DIM*2
// (16-byte chunks XOR-swizzled by row & 7: conflict-free ldmatrix, and wgmma's 128-byte swizzle
// when stored as 64-dim column blocks), the P tile and WARPS_N*BLOCK_M floats for cross-warp
// row reductions. Portable 64x64 tiles, 2x4 warps: 231424 bytes; wgmma 64x64, 4x2 warps: 229888
// (Hopper/B200 allow 232448 per block). sm_120 (99 KB per block) uses -DVA_BLOCK_M=32
// -DVA_BLOCK_N=16 -DVA_WARPS_M=2 -DVA_WARPS_N=2: 75520 bytes.
//
// Preconditions (checked on the host): q, kv_cache, mask, out, lse contiguous, q/kv/out 16-byte
// aligned; HEAD_DIM % 64 == 0; V_DIM % (16 * WARPS_N) == 0; V_DIM <= HEAD_DIM. Caller data
// (prefix lengths, num_nodes, block-table entries) is validated by the check kernel: requests
// with skip[b] set get no writes, and no address is formed from an unvalidated entry.
//
// Numerics: scores are scaled by sm_scale * log2(e) and exponentiated with ex2.approx; running
// max/sum in fp32; P is rounded to bf16 for the second product (as FlashAttention does). Rows of
// node slots at or past num_nodes get out = 0, lse = -inf; a row that sees no key (a malformed
// mask without its self bit and an empty prefix) gets the same.

#ifndef VA_HEAD_DIM
#define VA_HEAD_DIM 576
#endif
#ifndef VA_V_DIM
#define VA_V_DIM 512
#endif
#ifndef VA_BLOCK_M
#define VA_BLOCK_M 64
#endif
#ifndef VA_BLOCK_N
#define VA_BLOCK_N 64
#endif
#ifndef VA_WARPS_M
#define VA_WARPS_M 2
#endif
#ifndef VA_WARPS_N
#define VA_WARPS_N 4
#endif
// 1: Hopper path (compile for sm_90a only): S and O products on wgmma with shared-memory
// descriptors instead of ldmatrix + mma.sync; needs VA_WARPS_M=4 VA_WARPS_N=2 VA_BLOCK_M=64
// VA_BLOCK_N=64 (warpgroup wn owns keys wn*32.. of S and value dims wn*256.. of O).
#ifndef VA_WGMMA
#define VA_WGMMA 0
#endif

namespace {

constexpr int kHeadDim = VA_HEAD_DIM;
constexpr int kVDim = VA_V_DIM;
constexpr int kBlockM = VA_BLOCK_M;
constexpr int kBlockN = VA_BLOCK_N;
constexpr int kWarpsM = VA_WARPS_M;
constexpr int kWarpsN = VA_WARPS_N;
constexpr int kThreads = 32 * kWarpsM * kWarpsN;
constexpr int kWarpRows = kBlockM / kWarpsM;  // query rows per warp
constexpr int kMTiles = kWarpRows / 16;       // m16 tiles per warp
constexpr int kWarpKeys = kBlockN / kWarpsN;  // keys per warp in S = Q K^T
constexpr int kNTiles = kWarpKeys / 8;        // n8 tiles per warp in S
constexpr int kWarpDims = kVDim / kWarpsN;    // value dims per warp in O
constexpr int kDTiles = kWarpDims / 8;        // n8 tiles per warp in O
constexpr int kChunks = kHeadDim / 8;         // 16-byte chunks per latent row
constexpr int kRowBytes = kHeadDim * 2;
#if VA_WGMMA
constexpr int kPStride = kBlockN * 2;  // one 128-byte swizzled row per query row
#else
constexpr int kPStride = kBlockN * 2 + 16;  // bytes per P row (padded: conflict-free ldmatrix)
#endif
constexpr int kLoadersPerRow = kThreads / kBlockN;
constexpr int kQBytes = kBlockM * kRowBytes;
constexpr int kKBytes = kBlockN * kRowBytes;
constexpr int kPBytes = kBlockM * kPStride;
constexpr int kSmemBytes = kQBytes + 2 * kKBytes + kPBytes + kWarpsN * kBlockM * 4;
static_assert(kSmemBytes <= 232448, "tiles exceed the largest per-block shared memory");

static_assert(kHeadDim % 64 == 0, "VA_HEAD_DIM must be a multiple of 64");
static_assert(kVDim <= kHeadDim, "VA_V_DIM must not exceed VA_HEAD_DIM");
static_assert(kWarpRows % 16 == 0, "VA_BLOCK_M / VA_WARPS_M must be a multiple of 16");
static_assert(kWarpKeys % 8 == 0, "VA_BLOCK_N / VA_WARPS_N must be a multiple of 8");
static_assert(kBlockN % 16 == 0, "VA_BLOCK_N must be a multiple of 16");
static_assert(kWarpDims % 16 == 0, "VA_V_DIM / VA_WARPS_N must be a multiple of 16");
static_assert(kThreads % kBlockN == 0 && kChunks % kLoadersPerRow == 0,
              "key-tile loaders must split rows evenly");
#if VA_WGMMA
static_assert(kBlockM == 64 && kBlockN == 64 && kWarpsM == 4 && kWarpsN == 2 && kVDim == 512,
              "VA_WGMMA needs 64 x 64 tiles, 4 x 2 warps (two warpgroups) and V_DIM 512");
#endif

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// Byte offset of 16-byte chunk `chunk` of latent row `row` in a tile of kRows rows, chunks
// XOR-swizzled by row & 7 so that ldmatrix and wgmma read without bank conflicts. The wgmma path
// stores the tile as HEAD_DIM / 64 column blocks of [kRows][128 bytes] (wgmma's 128-byte-swizzle
// K-major layout); the portable path keeps whole rows contiguous (fewer address registers).
template <int kRows>
__device__ __forceinline__ int swz(int row, int chunk) {
#if VA_WGMMA
  return (chunk >> 3) * (kRows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
#else
  return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
#endif
}

// Byte offset of keys (key, key + 1) of query row `row` in the P tile.
__device__ __forceinline__ int p_off(int row, int key) {
#if VA_WGMMA
  return row * 128 + ((((key >> 3) ^ (row & 7))) << 4) + (key & 7) * 2;
#else
  return row * kPStride + key * 2;
#endif
}

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;  // 0: zero-fill without reading src
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2,
                                        unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(unsigned addr, unsigned& r0, unsigned& r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r0), "=r"(r1)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2,
                                          unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

#if VA_WGMMA
// Shared-memory matrix descriptor, 128-byte swizzle. K-major operands (Q, K, P): 8-row groups
// 1024 bytes apart (stride offset), leading offset unused. N-major V: leading offset = next
// 64-dim column block, stride offset = next 8 keys.
__device__ __forceinline__ unsigned long long desc_sw128(unsigned addr, unsigned lead,
                                                         unsigned stride) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) |
         ((unsigned long long)(lead >> 4) << 16) | ((unsigned long long)(stride >> 4) << 32) |
         (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit_and_wait() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// Generic-proxy shared-memory writes (cp.async, st.shared) become visible to wgmma.
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_m64n32(float (&d)[16], unsigned long long desc_a,
                                            unsigned long long desc_b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
      "}, %16, %17, 1, 1, 1, 0, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b));
}

__device__ __forceinline__ void wgmma_m64n256(float (&d)[128], unsigned long long desc_a,
                                            unsigned long long desc_b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
      "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
      "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
      "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
      "}, %128, %129, 1, 1, 1, 0, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b));
}
#else
__device__ __forceinline__ void fence_async_smem() {}
#endif

}  // namespace

extern "C" __global__ void __launch_bounds__(256) ddtree_verify_attention_check(
    const int* __restrict__ block_table,  // [batch_size, max_pages]
    const int* __restrict__ prefix_lens,  // [batch_size]
    const int* __restrict__ num_nodes,    // [batch_size]
    int* __restrict__ flags,              // [batch_size] out: this op's bits
    int* __restrict__ error_flags,        // [batch_size] or null: OR-ed in place
    int* __restrict__ skip,               // [batch_size] out: 1 = leave the request untouched
    int num_nodes_max, int num_pages, int page_size, int max_pages) {
  const int b = blockIdx.x;
  const long long prefix = prefix_lens[b];
  const int nn = num_nodes[b];
  int bits = 0;
  if (nn < 1 || nn > num_nodes_max) bits |= 2;  // ErrorFlag.TREE
  const long long clamped = nn < 1 ? 1 : (nn > num_nodes_max ? num_nodes_max : nn);
  const long long end = prefix + clamped;
  const long long capacity = (long long)max_pages * page_size;
  if (prefix < 0 || end > capacity) bits |= 8;  // ErrorFlag.LENGTH
  const long long used_end = end < capacity ? end : capacity;
  const long long used_pages = used_end <= 0 ? 0 : (used_end + page_size - 1) / page_size;
  int bad = 0;
  for (long long i = threadIdx.x; i < used_pages; i += blockDim.x) {
    const int page = block_table[(long long)b * max_pages + i];
    bad |= (page < 0 || page >= num_pages);
  }
  if (__syncthreads_or(bad)) bits |= 4;  // ErrorFlag.BLOCK_TABLE
  if (threadIdx.x == 0) {
    flags[b] = bits;
    int all = bits;
    if (error_flags != nullptr) {
      all |= error_flags[b];
      error_flags[b] = all;
    }
    skip[b] = all != 0;
  }
}

extern "C" __global__ void __launch_bounds__(kThreads, 1) ddtree_verify_attention(
    const unsigned short* __restrict__ q,   // [batch_size, num_nodes_max, num_heads, HEAD_DIM]
    const unsigned short* __restrict__ kv,  // [num_pages, page_size, HEAD_DIM]
    const int* __restrict__ block_table,    // [batch_size, max_pages]
    const int* __restrict__ prefix_lens,    // [batch_size]
    const int* __restrict__ num_nodes,      // [batch_size]
    const long long* __restrict__ mask,     // [batch_size, num_nodes_max, mask_words]
    const int* __restrict__ skip,           // [batch_size]
    unsigned short* __restrict__ out,       // [batch_size, num_nodes_max, num_heads, V_DIM]
    float* __restrict__ lse,                // [batch_size, num_nodes_max, num_heads]
    float* __restrict__ part_o,             // [num_splits, batch_size, R, V_DIM] (splits > 1)
    float* __restrict__ part_lse,           // [num_splits, batch_size, R] (splits > 1)
    int batch_size, int num_nodes_max, int num_heads, int mask_words, int page_size,
    int max_pages, float scale_log2, int num_splits) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* const sq = smem;
  unsigned char* const sk = smem + kQBytes;
  unsigned char* const sp = sk + 2 * kKBytes;
  float* const red = reinterpret_cast<float*>(sp + kPBytes);  // [WARPS_N][BLOCK_M]

  const int b = blockIdx.z;
  const int split = blockIdx.y;
  if (skip[b] != 0) return;
  const int rows = num_nodes_max * num_heads;
  const int row0 = blockIdx.x * kBlockM;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp % kWarpsM;
  const int wn = warp / kWarpsM;
  const int g = lane >> 2;
  const int tq = lane & 3;

  const int prefix = prefix_lens[b];
  const int nn = num_nodes[b];
  const int total = prefix + nn;
  const int valid_rows = nn * num_heads;
  const long long row_base = (long long)b * rows;  // first row of request b

  const int num_tiles = (total + kBlockN - 1) / kBlockN;
  const int per_split = (num_tiles + num_splits - 1) / num_splits;
  const int t_begin = split * per_split;
  const int t_end = min(num_tiles, t_begin + per_split);

  if (row0 >= valid_rows || t_begin >= t_end) {
    // Padding rows only, or an empty split: nothing to accumulate.
    if (num_splits > 1) {
      for (int r = tid; r < kBlockM; r += kThreads) {
        const int row = row0 + r;
        if (row < rows) part_lse[((long long)split * batch_size) * rows + row_base + row] = neg_inf();
      }
    } else {
      for (int r = tid; r < kBlockM; r += kThreads) {
        const int row = row0 + r;
        if (row < rows) lse[row_base + row] = neg_inf();
      }
      for (int i = tid; i < kBlockM * (kVDim / 8); i += kThreads) {
        const int row = row0 + i / (kVDim / 8);
        if (row < rows) {
          uint4* dst = reinterpret_cast<uint4*>(out + (row_base + row) * kVDim) + i % (kVDim / 8);
          *dst = make_uint4(0, 0, 0, 0);
        }
      }
    }
    return;
  }

  // Q tile: rows past the request's slots are zero-filled (never read out of bounds).
  for (int i = tid; i < kBlockM * kChunks; i += kThreads) {
    const int r = i / kChunks;
    const int c = i % kChunks;
    const bool in = row0 + r < rows;
    const unsigned short* src = q + (row_base + (in ? row0 + r : 0)) * kHeadDim + c * 8;
    cp_async16(smem_addr(sq + swz<kBlockM>(r, c)), src, in);
  }

  // Key tile loader: each thread owns one key row of the tile and every kLoadersPerRow-th chunk.
  const int load_row = tid / kLoadersPerRow;
  const int load_c0 = tid % kLoadersPerRow;
  const int* const table = block_table + (long long)b * max_pages;
  auto load_tile = [&](int tile, int stage) {
    const int pos = tile * kBlockN + load_row;
    const bool in = pos < total;
    long long off = 0;
    if (in) {
      const int page = table[pos / page_size];
      off = ((long long)page * page_size + pos % page_size) * kHeadDim;
    }
    const unsigned dst = smem_addr(sk + stage * kKBytes);
#pragma unroll
    for (int c = load_c0; c < kChunks; c += kLoadersPerRow) {
      cp_async16(dst + swz<kBlockN>(load_row, c), kv + off + c * 8, in);
    }
  };

  load_tile(t_begin, 0);
  cp_async_commit();

  float acc_o[kMTiles][kDTiles][4];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int d = 0; d < kDTiles; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mi][d][e] = 0.f;
  float row_max[kMTiles][2];
  float row_sum[kMTiles][2];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[mi][h] = neg_inf();
      row_sum[mi][h] = 0.f;
    }

  const unsigned sq_addr = smem_addr(sq);
  const unsigned sp_addr = smem_addr(sp);

  for (int tile = t_begin; tile < t_end; ++tile) {
    const int stage = (tile - t_begin) & 1;
    // One barrier: this tile has landed for every thread, and every warp is done with the
    // previous tile, whose buffer the prefetch below refills.
    cp_async_wait<0>();
    fence_async_smem();
    __syncthreads();
    if (tile + 1 < t_end) load_tile(tile + 1, stage ^ 1);
    cp_async_commit();

    const unsigned sk_addr = smem_addr(sk + stage * kKBytes);

    // S = Q K^T for rows wm*WM.., keys wn*WK..
    float s[kMTiles][kNTiles][4];
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][ni][e] = 0.f;

#if VA_WGMMA
    {
      // Warpgroup wn: S[64 rows, keys wn*32..] over HEAD_DIM / 16 k-steps, both from shared.
      float(&d)[16] = reinterpret_cast<float(&)[16]>(s[0]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        const unsigned a = sq_addr + (kk >> 2) * (kBlockM * 128) + (kk & 3) * 32;
        const unsigned b = sk_addr + (kk >> 2) * (kBlockN * 128) + wn * 32 * 128 + (kk & 3) * 32;
        wgmma_m64n32(d, desc_sw128(a, 16, 1024), desc_sw128(b, 16, 1024));
      }
      wgmma_commit_and_wait();
    }
#else
#pragma unroll 4
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      unsigned a[kMTiles][4];
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
        const int r = wm * kWarpRows + mi * 16 + (lane & 15);
        ldsm_x4(sq_addr + swz<kBlockM>(r, kk * 2 + (lane >> 4)), a[mi][0], a[mi][1], a[mi][2], a[mi][3]);
      }
      unsigned bk[kNTiles][2];
#pragma unroll
      for (int np = 0; np + 1 < kNTiles; np += 2) {
        const int m = lane >> 3;
        const int r = wn * kWarpKeys + (np + (m >> 1)) * 8 + (lane & 7);
        ldsm_x4(sk_addr + swz<kBlockN>(r, kk * 2 + (m & 1)), bk[np][0], bk[np][1], bk[np + 1][0],
                bk[np + 1][1]);
      }
      if constexpr (kNTiles % 2 == 1) {
        const int r = wn * kWarpKeys + (kNTiles - 1) * 8 + (lane & 7);
        ldsm_x2(sk_addr + swz<kBlockN>(r, kk * 2 + ((lane >> 3) & 1)), bk[kNTiles - 1][0],
                bk[kNTiles - 1][1]);
      }
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni) mma_bf16(s[mi][ni], a[mi], bk[ni][0], bk[ni][1]);
    }

#endif

    // Scale to the log2 domain; mask the tree tail and positions past the end.
    const int key0 = tile * kBlockN + wn * kWarpKeys;
    const bool has_tail = tile * kBlockN + kBlockN > prefix;
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNTiles; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[mi][ni][e] * scale_log2;
          if (has_tail) {
            const int key = key0 + ni * 8 + 2 * tq + (e & 1);
            const int j = key - prefix;
            if (j >= 0) {
              bool visible = false;
              if (j < nn) {
                // Tail tiles only (one or two per request): the row's node is recomputed here
                // rather than kept in registers through the whole loop.
                const int row = row0 + wm * kWarpRows + mi * 16 + g + 8 * (e >> 1);
                const int node = min(row, rows - 1) / num_heads;
                const unsigned long long word = (unsigned long long)
                    mask[((long long)b * num_nodes_max + node) * mask_words + (j >> 6)];
                visible = (word >> (j & 63)) & 1ull;
              }
              if (!visible) x = neg_inf();
            }
          }
          s[mi][ni][e] = x;
        }

    // Row maxima across this warp's keys, then across the WARPS_N warps of the row group.
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float m = neg_inf();
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni) m = fmaxf(m, fmaxf(s[mi][ni][2 * h], s[mi][ni][2 * h + 1]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        if (tq == 0) red[wn * kBlockM + wm * kWarpRows + mi * 16 + g + 8 * h] = m;
      }
    __syncthreads();
    float alpha[kMTiles][2];
    bool rescale = false;
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wm * kWarpRows + mi * 16 + g + 8 * h;
        float m_new = row_max[mi][h];
#pragma unroll
        for (int w = 0; w < kWarpsN; ++w) m_new = fmaxf(m_new, red[w * kBlockM + r]);
        const float base = m_new == neg_inf() ? 0.f : m_new;
        alpha[mi][h] = fast_exp2(row_max[mi][h] - base);
        rescale |= m_new != row_max[mi][h];
        row_max[mi][h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni) {
          const float p0 = fast_exp2(s[mi][ni][2 * h] - base);
          const float p1 = fast_exp2(s[mi][ni][2 * h + 1] - base);
          sum += p0 + p1;
          const int key = wn * kWarpKeys + ni * 8 + 2 * tq;
          *reinterpret_cast<unsigned*>(sp + p_off(r, key)) = pack_bf16(p0, p1);
        }
        row_sum[mi][h] = row_sum[mi][h] * alpha[mi][h] + sum;
      }
    // Once the running maxima settle (most tiles), no row of the warp changes and the
    // V_DIM / WARPS_N accumulators per row need no rescaling.
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
          acc_o[mi][d][0] *= alpha[mi][0];
          acc_o[mi][d][1] *= alpha[mi][0];
          acc_o[mi][d][2] *= alpha[mi][1];
          acc_o[mi][d][3] *= alpha[mi][1];
        }
    }
    fence_async_smem();
    __syncthreads();

#if VA_WGMMA
    {
      // Warpgroup wn: O[64 rows, dims wn*256..] += P[64, 64] V[64 keys, 256 dims].
      float(&d)[128] = reinterpret_cast<float(&)[128]>(acc_o[0]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        const unsigned a = sp_addr + kk * 32;
        const unsigned b = sk_addr + wn * 4 * (kBlockN * 128) + kk * 16 * 128;
        wgmma_m64n256(d, desc_sw128(a, 16, 1024), desc_sw128(b, kBlockN * 128, 1024));
      }
      wgmma_commit_and_wait();
    }
#else
    // O += P V for rows wm*WM.., value dims wn*WD..
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      unsigned a[kMTiles][4];
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
        const int r = wm * kWarpRows + mi * 16 + (lane & 15);
        ldsm_x4(sp_addr + p_off(r, kk * 16 + (lane >> 4) * 8), a[mi][0], a[mi][1],
                a[mi][2], a[mi][3]);
      }
#pragma unroll
      for (int dp = 0; dp < kDTiles; dp += 2) {
        const int m = lane >> 3;
        const int key = kk * 16 + (m & 1) * 8 + (lane & 7);
        const int chunk = (wn * kWarpDims + dp * 8) / 8 + (m >> 1);
        unsigned b0, b1, b2, b3;
        ldsm_x4_t(sk_addr + swz<kBlockN>(key, chunk), b0, b1, b2, b3);
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
          mma_bf16(acc_o[mi][dp], a[mi], b0, b1);
          mma_bf16(acc_o[mi][dp + 1], a[mi], b2, b3);
        }
      }
    }
#endif
  }

  // Row sums across the WARPS_N warps (all warps passed the last tile's barriers after their
  // last read of `red`).
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = row_sum[mi][h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if (tq == 0) red[wn * kBlockM + wm * kWarpRows + mi * 16 + g + 8 * h] = l;
    }
  __syncthreads();

  const float ln2 = 0.69314718055994531f;
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm * kWarpRows + mi * 16 + g + 8 * h;
      const int row = row0 + r;
      float l = 0.f;
#pragma unroll
      for (int w = 0; w < kWarpsN; ++w) l += red[w * kBlockM + r];
      // Padding rows (node >= num_nodes) and rows that saw no key: out 0, lse -inf. A NaN sum
      // (a NaN or infinity in q or the cache) stays live, so the NaN reaches out and lse.
      const bool live = row < valid_rows && !(l == 0.f);
      const float inv = live ? 1.f / l : 0.f;
      const float row_lse = live ? (row_max[mi][h] + __log2f(l)) * ln2 : neg_inf();
      if (row >= rows) continue;
      const long long orow = row_base + row;
      if (num_splits > 1) {
        float* dst = part_o + ((long long)split * batch_size * rows + orow) * kVDim +
                     wn * kWarpDims + 2 * tq;
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
          *reinterpret_cast<float2*>(dst + d * 8) =
              make_float2(acc_o[mi][d][2 * h] * inv, acc_o[mi][d][2 * h + 1] * inv);
        }
        if (wn == 0 && tq == 0) part_lse[(long long)split * batch_size * rows + orow] = row_lse;
      } else {
        unsigned short* dst = out + orow * kVDim + wn * kWarpDims + 2 * tq;
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
          *reinterpret_cast<unsigned*>(dst + d * 8) =
              pack_bf16(acc_o[mi][d][2 * h] * inv, acc_o[mi][d][2 * h + 1] * inv);
        }
        if (wn == 0 && tq == 0) lse[orow] = row_lse;
      }
    }
}

extern "C" __global__ void __launch_bounds__(128) ddtree_verify_attention_combine(
    const float* __restrict__ part_o,    // [num_splits, batch_size, R, V_DIM]
    const float* __restrict__ part_lse,  // [num_splits, batch_size, R]
    const int* __restrict__ num_nodes,   // [batch_size]
    const int* __restrict__ skip,        // [batch_size]
    unsigned short* __restrict__ out,    // [batch_size, R, V_DIM]
    float* __restrict__ lse,             // [batch_size, R]
    int batch_size, int rows, int num_heads, int num_splits) {
  const int b = blockIdx.y;
  const int row = blockIdx.x;
  if (skip[b] != 0) return;
  const long long orow = (long long)b * rows + row;
  const long long split_stride = (long long)batch_size * rows;
  float m = neg_inf();
  bool nan = false;  // fmaxf skips NaN: a NaN split must not make the row look empty
  if (row < num_nodes[b] * num_heads) {
    for (int s = 0; s < num_splits; ++s) {
      const float ls = part_lse[s * split_stride + orow];
      m = fmaxf(m, ls);
      nan |= isnan(ls);
    }
  }
  constexpr int kVec = kVDim / 4;  // float4 groups per row
  if (m == neg_inf() && !nan) {
    for (int i = threadIdx.x; i < kVec; i += blockDim.x) {
      *reinterpret_cast<uint2*>(out + orow * kVDim + 4 * i) = make_uint2(0, 0);
    }
    if (threadIdx.x == 0) lse[orow] = neg_inf();
    return;
  }
  for (int i = threadIdx.x; i < kVec; i += blockDim.x) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float l = 0.f;
    for (int s = 0; s < num_splits; ++s) {
      const float ls = part_lse[s * split_stride + orow];
      if (ls == neg_inf()) continue;  // empty split: its partial O was never written
      const float w = __expf(ls - m);
      const float4 v =
          *reinterpret_cast<const float4*>(part_o + (s * split_stride + orow) * kVDim + 4 * i);
      acc.x += w * v.x;
      acc.y += w * v.y;
      acc.z += w * v.z;
      acc.w += w * v.w;
      l += w;
    }
    const float inv = 1.f / l;
    *reinterpret_cast<uint2*>(out + orow * kVDim + 4 * i) =
        make_uint2(pack_bf16(acc.x * inv, acc.y * inv), pack_bf16(acc.z * inv, acc.w * inv));
    if (i == 0) lse[orow] = m + __logf(l);
  }
}
