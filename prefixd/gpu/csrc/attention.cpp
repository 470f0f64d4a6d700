// prefixd's CPU paged attention for mode "int4": every query row attends keys 0..p of its own
// lane, read in place from the KV pool through the lane's page table (no gather), each row on
// its own: a row's bits depend on its q, its position and its lane's keys and values only, not
// on the other rows, lanes or threads of the call, nor on the instruction set (the AVX-512 BF16
// path, the AVX-512 path and the portable one run the same operations;
// tests/gpu/test_cpu_attention.py compares them).
//
// K pages: inside a page of P keys, kv head g's keys lie in pairs of dims: element (offset o,
// kv head g, dim d) at ((g * D/2 + d/2) * P + o) * 2 + d % 2, so that dims 2i, 2i + 1 of 16
// consecutive keys are one 64-byte vector (`to_key_pages` in kv_pool.py gives this layout
// of keys laid out (P, kv_heads, D)). V pages are (P, kv_heads, D).
//
// For a row at position p, q head h (pre-scaled) and its kv head g = h / (heads / kv_heads),
// with D = 16 * C (q, k, v read from bf16 exactly), its keys t = 0..p are reduced in chunks of
// 512 (chunk j: keys 512j .. min(512j + 511, p)), each chunk on its own:
//   score s_t:  s = 0, then for i = 0 .. D/2 - 1 in order: s = fma(q[2i + 1], k_t[2i + 1], s),
//               s = fma(q[2i], k_t[2i], s)  (what one AVX-512 BF16 dot product step gives: the
//               products are exact in fp32, each sum rounded)
//   m_j = max s_t over the chunk (NaN when some s_t is NaN)
//   e_t = exp(s_t - m_j), the fixed polynomial `exp_fixed` (0 below -87)
//   l_j: lane i < 16 sums e_t for t = i (mod 16) in order, then the same halvings
//   o_j[d] = fma(e_t, v_t[d], o_j[d]) for the chunk's t in order, from 0.
// One chunk (p < 512): out[d] = o_0[d] / l_0. More: m = max_j m_j (NaN when some m_j is NaN),
// w_j = exp_fixed(m_j - m), l = l + w_j * l_j and o[d] = fma(w_j, o_j[d], o[d]) for j in order
// from 0, out[d] = o[d] / l (for one chunk this gives o_0 / l_0 too: w_0 = 1). The chunks are
// fixed by position, so a lone lane's long row can be read by several threads, a chunk each,
// with the bits it has in any other call.
//
// The BF16 instruction treats subnormal inputs and sums as zero on some CPUs and not on others,
// so the scores are defined only where none arises: q and k hold no nonzero magnitude below
// 2^-30 (rope_kv flushes such values to zero). Then every product is a multiple of 2^-74 and so
// is every sum: each is zero or at least 2^-74, a normal float, and all three paths agree.
//
// 8-bit pages (mode int4's pool; layout at "8-bit pages" below): K and V rows are 8-bit codes
// with a scale per row, kv head and block of 32 dims (`quantize_block`), and so is each row's q
// (quantized from its bf16 values by the call). The arithmetic differs from the above in two
// places, with the chunks, softmax and join unchanged:
//   score s_t:  s = 0, then for each block b of 32 dims in order: s = fma(fp32(i_b) * sq_b,
//               sk_t,b, s), where i_b = the exact int32 sum of q's codes times k_t's codes in
//               the block (what `vpdpbusd` gives, K stored as code + 128, less 128 times the
//               sum of q's codes), sq_b q's scale and sk_t,b the key's
//   o_j[d] = fma(w_t,b, fp32(v_t[d]'s code), o_j[d]) for the block b holding d, where
//               w_t,b = `bf16_weight`(e_t * sv_t,b): the product rounded to bf16 (0 below 2^-60)
// Integer sums make the scores independent of the order of their products, and each product of
// a bf16 weight and a code is exact, so that the BF16 dot product (two keys a step, the
// "avx512-bf16" path), fmas (the "avx512-vnni" path) and the portable loop give the same bits
// (the AVX-512 path without VNNI takes the portable one).
//
// Inputs: q ((R + 1) * q_stride, D) bf16, round row r's head h at r * q_stride + h; k, v pools
// (pages, P, kv_heads, D) bf16 (K pages as above), or 8-bit pages (pages, P, kv_heads, D + D/8)
// uint8; spans (S, 3) int64: (first row, first position, rows) per lane; tables (S, T) int32:
// each lane's pages; out (R + 1, heads * D) fp32, rows of the spans written.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

using prefixd_cpu::halve16;
#ifdef PREFIXD_X86
using prefixd_cpu::load_bf16;
#endif

constexpr int LANES = 16;
constexpr int MAX_CHUNKS = 16;  // D up to 256
constexpr int MAX_GROUP = 16;   // q heads per kv head
constexpr int ROW_BLOCK = 8;    // consecutive rows of a lane in one task (a lane's verify rows: one task)
constexpr int64_t KEY_CHUNK = 512;  // keys a row reduces at a time (a multiple of 16)
// Blocks of 16 keys ahead whose K lines (the scores) and V lines (the value sums) a chunk
// prefetches, page by page through the lane's table: a decode row's keys come from memory
// (every layer's pages evict the last's), and the lines of one block arrive too late to hide
// behind its own arithmetic. A prefetch is a hint: it changes no arithmetic and cannot fault.
// Measured with bench/attend_bound.py (docs/runtime.md, *Why prefetch four blocks ahead*):
// streamed calls 18-33 % faster at 512 to 2K keys, decode rounds 11-20 % faster.
constexpr int64_t PREFETCH_BLOCKS = 4;

constexpr auto bf16f = prefixd_cpu::bf16_to_float;

inline float pow2(int n) {  // 2^n for n in [-126, 127]: exact
  uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

constexpr float LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693359375f;
constexpr float LN2_LO = -2.12194440e-4f;
constexpr float EXP_MIN = -87.f;  // below: 0; at or above, every result is a normal float
constexpr float C2 = 0.5f, C3 = 1.f / 6, C4 = 1.f / 24, C5 = 1.f / 120, C6 = 1.f / 720;

inline float exp_fixed(float x) {  // x <= 0
  if (x < EXP_MIN) return 0.f;
  const float n = std::nearbyint(x * LOG2E);
  float r = std::fma(n, -LN2_HI, x);
  r = std::fma(n, -LN2_LO, r);
  float p = std::fma(C6, r, C5);
  p = std::fma(p, r, C4);
  p = std::fma(p, r, C3);
  p = std::fma(p, r, C2);
  p = std::fma(p, r, 1.f);
  p = std::fma(p, r, 1.f);
  return p * pow2(static_cast<int>(n));  // NaN stays NaN
}

struct Attn {
  const uint16_t* q;
  const uint16_t* k;  // bf16 pools (else null)
  const uint16_t* v;
  const int64_t* spans;
  const int32_t* tables;
  float* out;
  int64_t q_stride, heads, kv_heads, dim, page, table_len;
  const uint8_t* k8 = nullptr;  // 8-bit pools (else null): `page_bytes` a page, codes then scales
  const uint8_t* v8 = nullptr;
  int64_t page_bytes = 0;
  int page_shift = -1;  // log2(page) when page is a power of two (the daemon's 16), else -1
};

// Key t's page in its table and its slot in that page (t >= 0): a shift and a mask when the page
// size is a power of two, else a division (a key's address is made for every key a value sum
// reads; without the division a decode row's call at 4,096 keys takes ~5 % less).
inline int64_t page_index(const Attn& a, int64_t t) { return a.page_shift >= 0 ? t >> a.page_shift : t / a.page; }
inline int64_t page_slot(const Attn& a, int64_t t) { return a.page_shift >= 0 ? t & (a.page - 1) : t % a.page; }

struct Task {
  int64_t span, row, rows, head_from, head_to;  // rows [row, row + rows) of the span; q heads
                                                // [head_from, head_to), kv heads h / group
  int64_t chunk_from, chunk_to;                 // its rows' key chunks [chunk_from, chunk_to)
  int64_t split_at;  // -1: the task holds every chunk of its rows and writes out; else where its
                     // block's partials go in the split buffer, (rows, heads, the block's chunks,
                     // D + 2), joined after all tasks
};

// A chunk's partial for one (row, head), D + 2 floats: m, l, then o (the path's own dim order).
using ChunkFn = void (*)(const Attn&, const Task&, int64_t chunk, float* part, int64_t pair_stride,
                         std::vector<float>& scratch);
// A (row, head)'s chunks joined into its output: `chunks` partials `stride` floats apart.
using CombineFn = void (*)(const float* part, int64_t stride, int64_t chunks, int64_t dim, float* out);

// A path's two halves: a chunk's partials, and their join.
struct Path {
  ChunkFn chunk;
  CombineFn combine;
};

inline int64_t chunks_of(int64_t keys) { return (keys + KEY_CHUNK - 1) / KEY_CHUNK; }

// Where key t's dims 2i, 2i + 1 of kv head kv lie (the K page layout above): two bf16, the even dim first.
inline const uint16_t* key_pair(const Attn& a, const int32_t* table, int64_t t, int64_t kv, int64_t i) {
  return a.k + static_cast<int64_t>(table[page_index(a, t)]) * a.page * a.kv_heads * a.dim +
         ((kv * (a.dim / 2) + i) * a.page + page_slot(a, t)) * 2;
}

inline const uint16_t* value_row(const Attn& a, const int32_t* table, int64_t t, int64_t kv) {
  return a.v + ((static_cast<int64_t>(table[page_index(a, t)]) * a.page + page_slot(a, t)) * a.kv_heads + kv) * a.dim;
}

// ---- 8-bit pages ---------------------------------------------------------------------------------
// A page of an 8-bit pool holds its P rows' codes, P * kv_heads * D bytes, then their scales,
// (kv_heads, D / 32, P) fp32: one scale per row, kv head and block of 32 dims. K codes lie as
// unsigned bytes code + 128 in quads of dims: element (offset o, kv head g, dim d) at
// ((g * D/4 + d/4) * P + o) * 4 + d % 4, so that dims 4i..4i+3 of 16 consecutive keys are one
// 64-byte vector; V codes are signed bytes in rows (P, kv_heads, D).

constexpr int64_t QBLOCK = 32;            // dims sharing a scale (q, K and V alike)
constexpr float QUANT_TINY = 0x1p-60f;    // a block whose largest magnitude is below: zero codes, scale 0

// A block of 32 values as 8-bit codes and its scale (the block is code * scale):
//   a = max |x| (NaN when some x is NaN); a not finite: codes 0, scale NaN (the row poisons
//   what reads it, as its values would); a < 2^-60: codes 0, scale 0; else inv = 127 / a,
//   code = round-half-even(x * inv) in [-127, 127], scale = a / 127 (each op rounded in fp32).
// KVPool.quantize_blocks in kv_pool.py has the same bits.
inline float quantize_block(const float* x, int8_t* codes) {
  float a = 0.f;
  bool nan = false;
  for (int64_t i = 0; i < QBLOCK; ++i) {
    nan = nan || std::isnan(x[i]);
    a = std::max(a, std::fabs(x[i]));
  }
  if (nan || std::isinf(a) || a < QUANT_TINY) {
    std::memset(codes, 0, QBLOCK);
    return nan || std::isinf(a) ? std::numeric_limits<float>::quiet_NaN() : 0.f;
  }
  const float inv = 127.f / a;
  for (int64_t i = 0; i < QBLOCK; ++i)
    codes[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[i] * inv))));
  return a / 127.f;
}

// A value weight of 8-bit pages (a key's e times its V scale, never negative) as the value sums
// take it: zero below 2^-60, else rounded to bf16, nearest-even (NaN stays NaN, its quiet bit
// set), held in fp32. Each product of such a weight and a code is then exact and a multiple of
// 2^-67, so every partial sum is zero or a normal float: the BF16 dot-product instruction (which
// flushes subnormal inputs and results) and an fma chain agree.
inline float bf16_weight(float w) {
  if (w < QUANT_TINY) return 0.f;  // NaN fails the test: kept
  uint32_t b;
  std::memcpy(&b, &w, sizeof b);
  b = std::isnan(w) ? b | 0x00400000u : b + 0x7fffu + ((b >> 16) & 1u);
  b &= 0xffff0000u;
  std::memcpy(&w, &b, sizeof w);
  return w;
}

inline const uint8_t* page8(const uint8_t* pool, const Attn& a, const int32_t* table, int64_t t) {
  return pool + static_cast<int64_t>(table[page_index(a, t)]) * a.page_bytes;
}

// key t's K codes of kv head g, dims 4i..4i+3 (unsigned, code + 128)
inline const uint8_t* key_quad(const Attn& a, const int32_t* table, int64_t t, int64_t g, int64_t i) {
  return page8(a.k8, a, table, t) + ((g * (a.dim / 4) + i) * a.page + page_slot(a, t)) * 4;
}

// key t's scale of kv head g, dims 32b..32b+31, in the K or V pool `pool`
inline const float* scale8(const uint8_t* pool, const Attn& a, const int32_t* table, int64_t t, int64_t g, int64_t b) {
  return reinterpret_cast<const float*>(page8(pool, a, table, t) + a.page * a.kv_heads * a.dim) +
         (g * (a.dim / QBLOCK) + b) * a.page + page_slot(a, t);
}

// key t's V codes of kv head g (D signed bytes; its kv heads side by side)
inline const int8_t* value_row8(const Attn& a, const int32_t* table, int64_t t, int64_t g) {
  return reinterpret_cast<const int8_t*>(page8(a.v8, a, table, t) + (page_slot(a, t) * a.kv_heads + g) * a.dim);
}

// m of the joined chunks: the largest chunk m, NaN when some chunk's is
inline float joined_max(const float* part, int64_t stride, int64_t chunks) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t c = 0; c < chunks; ++c) {
    nan = nan || std::isnan(part[c * stride]);
    m = std::max(m, part[c * stride]);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// ---- portable path -----------------------------------------------------------------------------

// A (row, head)'s chunk from its scores s[t - k0], t in [k0, end) (nan: some score is NaN):
// m, then e_t in key order into l's 16 lanes and, through add_value(t, e, o), into o = rec + 2
// (D floats, zeroed first); m and l into rec[0], rec[1].
template <class AddValue>
void softmax_portable(const float* s, int64_t k0, int64_t end, bool nan, int64_t dim, float* rec,
                      const AddValue& add_value) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = k0; t < end; ++t) m = std::max(m, s[t - k0]);
  if (nan) m = std::numeric_limits<float>::quiet_NaN();
  float l[LANES] = {};
  float* o = rec + 2;
  std::fill(o, o + dim, 0.f);
  for (int64_t t = k0; t < end; ++t) {
    const float e = exp_fixed(s[t - k0] - m);
    l[t % LANES] = l[t % LANES] + e;
    add_value(t, e, o);
  }
  rec[0] = m;
  rec[1] = halve16(l);
}

void chunk_portable(const Attn& a, const Task& task, int64_t chunk, float* part, int64_t pair_stride,
                    std::vector<float>& scores) {
  const int64_t* sp = a.spans + task.span * 3;
  const int32_t* table = a.tables + task.span * a.table_len;
  const int64_t group = a.heads / a.kv_heads, hn = task.head_to - task.head_from;
  const int64_t k0 = chunk * KEY_CHUNK;
  scores.resize(KEY_CHUNK);
  for (int64_t i = 0; i < task.rows; ++i) {
    const int64_t r = sp[0] + task.row + i, end = std::min(sp[1] + task.row + i + 1, k0 + KEY_CHUNK);
    for (int64_t h = task.head_from; h < task.head_to; ++h) {
      float* rec = part + (i * hn + h - task.head_from) * pair_stride;
      const int64_t kv = h / group;
      const uint16_t* q = a.q + (r * a.q_stride + h) * a.dim;
      float* s = scores.data();  // s[t - k0], t in [k0, end)
      bool nan = false;
      for (int64_t t = k0; t < end; ++t) {
        float dot = 0.f;
        for (int64_t i = 0; i < a.dim / 2; ++i) {
          const uint16_t* k = key_pair(a, table, t, kv, i);
          dot = std::fma(bf16f(q[2 * i + 1]), bf16f(k[1]), dot);
          dot = std::fma(bf16f(q[2 * i]), bf16f(k[0]), dot);
        }
        s[t - k0] = dot;
        nan = nan || std::isnan(dot);
      }
      softmax_portable(s, k0, end, nan, a.dim, rec, [&](int64_t t, float e, float* o) {
        const uint16_t* v = value_row(a, table, t, kv);
        for (int64_t d = 0; d < a.dim; ++d) o[d] = std::fma(e, bf16f(v[d]), o[d]);
      });
    }
  }
}

void combine_portable(const float* part, int64_t stride, int64_t chunks, int64_t dim, float* out) {
  if (chunks == 1) {  // what the general case gives for one chunk (w = 1): o / l
    for (int64_t d = 0; d < dim; ++d) out[d] = part[2 + d] / part[1];
    return;
  }
  const float m = joined_max(part, stride, chunks);
  float o[MAX_CHUNKS * LANES] = {};
  float l = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* rec = part + c * stride;
    const float w = exp_fixed(rec[0] - m);
    l = l + w * rec[1];
    for (int64_t d = 0; d < dim; ++d) o[d] = std::fma(w, rec[2 + d], o[d]);
  }
  for (int64_t d = 0; d < dim; ++d) out[d] = o[d] / l;
}

// 8-bit pools: a pair's q codes per block of 32 dims (from q's bf16 values), then the chunk as
// in the header's arithmetic for 8-bit pages. o in dim order: `combine_portable` joins it.
struct QCodes {
  int8_t codes[MAX_CHUNKS * LANES];
  float scale[MAX_CHUNKS * LANES / QBLOCK];
  int32_t offset[MAX_CHUNKS * LANES / QBLOCK];  // 128 * the block's sum of codes (K's unsigned bytes)
};

inline void quantize_q(const uint16_t* q, int64_t dim, QCodes& out) {
  float x[MAX_CHUNKS * LANES];
  for (int64_t d = 0; d < dim; ++d) x[d] = bf16f(q[d]);
  for (int64_t b = 0; b < dim / QBLOCK; ++b) {
    out.scale[b] = quantize_block(x + b * QBLOCK, out.codes + b * QBLOCK);
    int32_t sum = 0;
    for (int64_t i = 0; i < QBLOCK; ++i) sum += out.codes[b * QBLOCK + i];
    out.offset[b] = 128 * sum;
  }
}

void chunk_q8_portable(const Attn& a, const Task& task, int64_t chunk, float* part, int64_t pair_stride,
                       std::vector<float>& scores) {
  const int64_t* sp = a.spans + task.span * 3;
  const int32_t* table = a.tables + task.span * a.table_len;
  const int64_t group = a.heads / a.kv_heads, nq = a.dim / QBLOCK;
  const int64_t k0 = chunk * KEY_CHUNK, hn = task.head_to - task.head_from;
  scores.resize(KEY_CHUNK);
  QCodes qc;
  for (int64_t i = 0; i < task.rows; ++i) {
    const int64_t r = sp[0] + task.row + i, end = std::min(sp[1] + task.row + i + 1, k0 + KEY_CHUNK);
    for (int64_t h = task.head_from; h < task.head_to; ++h) {
      float* rec = part + (i * hn + h - task.head_from) * pair_stride;
      const int64_t kv = h / group;
      quantize_q(a.q + (r * a.q_stride + h) * a.dim, a.dim, qc);
      float* s = scores.data();
      bool nan = false;
      for (int64_t t = k0; t < end; ++t) {
        float dot = 0.f;
        for (int64_t b = 0; b < nq; ++b) {
          int32_t acc = 0;  // exact: the unsigned codes' products, less 128 times q's sum
          for (int64_t j = b * QBLOCK / 4; j < (b + 1) * QBLOCK / 4; ++j) {
            const uint8_t* k = key_quad(a, table, t, kv, j);
            for (int64_t x = 0; x < 4; ++x) acc += static_cast<int32_t>(k[x]) * qc.codes[4 * j + x];
          }
          dot = std::fma(static_cast<float>(acc - qc.offset[b]) * qc.scale[b], *scale8(a.k8, a, table, t, kv, b), dot);
        }
        s[t - k0] = dot;
        nan = nan || std::isnan(dot);
      }
      softmax_portable(s, k0, end, nan, a.dim, rec, [&](int64_t t, float e, float* o) {
        const int8_t* v = value_row8(a, table, t, kv);
        for (int64_t b = 0; b < nq; ++b) {
          const float ev = bf16_weight(e * *scale8(a.v8, a, table, t, kv, b));
          for (int64_t d = b * QBLOCK; d < (b + 1) * QBLOCK; ++d) o[d] = std::fma(ev, static_cast<float>(v[d]), o[d]);
        }
      });
    }
  }
}

#ifdef PREFIXD_X86
// ---- AVX-512 path ------------------------------------------------------------------------------

#define PREFIXD_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

PREFIXD_AVX512 inline float halve16(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));  // lanes j + j+2
  const __m128 d = _mm_add_ss(c, _mm_shuffle_ps(c, c, 1));  // lane 0 + lane 1
  return _mm_cvtss_f32(d);
}

PREFIXD_AVX512 inline __m512 exp_fixed(__m512 x) {
  const __m512 below = _mm512_set1_ps(EXP_MIN);
  const __mmask16 zero = _mm512_cmp_ps_mask(x, below, _CMP_LT_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(C6), r, _mm512_set1_ps(C5));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  // 2^n by its bits; lanes that will be zeroed (or NaN) may hold any n: clamp the integer
  __m512i ni = _mm512_cvtps_epi32(_mm512_max_ps(n, _mm512_set1_ps(-126.f)));
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(ni, _mm512_set1_epi32(127)), 23));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~zero), _mm512_mul_ps(p, scale));
}

#define PREFIXD_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

// 16 words of two bf16 each, widened exactly: each word's low half (shifted up) and its high
// half (masked).
PREFIXD_AVX512 inline void widen_pairs(__m512i w, __m512& low, __m512& high) {
  low = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  high = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
}

// The task's pairs of kv head kv, in groups of near-equal size up to `most`: fn(pairs, size)
// for each group, pairs (indices into the task's (row, head) pairs, row-major) in order in `buf`.
template <class Fn>
inline void for_pair_groups(const Task& task, int64_t group, int64_t kv, int64_t most, int64_t* buf, const Fn& fn) {
  const int64_t h0 = task.head_from, hn = task.head_to - h0;
  const int64_t j0 = std::max(h0, kv * group) - h0, j1 = std::min(task.head_to, (kv + 1) * group) - h0;
  const int64_t pairs = task.rows * (j1 - j0), groups = (pairs + most - 1) / most;
  for (int64_t x = 0, n = 0; x < groups; ++x) {
    const int64_t size = (pairs - n) / (groups - x);
    for (int64_t y = 0; y < size; ++y, ++n) buf[y] = (n / (j1 - j0)) * hn + j0 + n % (j1 - j0);
    fn(buf, size);
  }
}

constexpr int SCORE_GROUP = 8;  // chains scored together (pairs times key blocks), at most

// `for_pair_groups` of each kv head a task reads (kv0 .. kv0 + kvn - 1), listed once: making
// the groups divides, and a chunk walks them for every block of keys.
class PairGroups {
 public:
  PairGroups(const Task& task, int64_t group, int64_t kv0, int64_t kvn, int64_t most) : first_(kvn + 1) {
    int64_t buf[SCORE_GROUP];
    for (int64_t g = 0; g < kvn; ++g) {
      first_[g] = static_cast<int64_t>(sizes_.size());
      for_pair_groups(task, group, kv0 + g, most, buf, [&](const int64_t* p, int64_t size) {
        starts_.push_back(static_cast<int64_t>(pairs_.size()));
        sizes_.push_back(size);
        pairs_.insert(pairs_.end(), p, p + size);
      });
    }
    first_[kvn] = static_cast<int64_t>(sizes_.size());
  }
  // fn(pairs, size) for each group of kv head kv0 + g, in order
  template <class Fn>
  void each(int64_t g, const Fn& fn) const {
    for (int64_t i = first_[g]; i < first_[g + 1]; ++i) fn(pairs_.data() + starts_[i], sizes_[i]);
  }

 private:
  std::vector<int64_t> first_, starts_, sizes_, pairs_;
};

inline __mmask16 live_lanes(int64_t n, int64_t t) {  // lanes t .. n - 1 of a block of 16
  return n - t >= LANES ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - t)) - 1);
}

// m of a pair's n scores of a chunk: the largest, NaN when one is NaN
PREFIXD_AVX512 inline float chunk_max(const float* s, int64_t n) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t t = 0; t < n; t += LANES) {
    const __mmask16 live = live_lanes(n, t);
    const __m512 x = _mm512_maskz_loadu_ps(live, s + t);
    nan |= _mm512_mask_cmp_ps_mask(live, x, x, _CMP_UNORD_Q);
    mv = _mm512_mask_max_ps(mv, live, mv, x);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(mv);
}

// A pair's softmax over its n scores of a chunk (the header's m, e and l): the exponents in
// place of the scores, m and l into rec[0] and rec[1].
PREFIXD_AVX512 inline void softmax_chunk(float* s, int64_t n, float* rec) {
  const float m = chunk_max(s, n);
  __m512 l = _mm512_setzero_ps();
  const __m512 mm = _mm512_set1_ps(m);
  for (int64_t t = 0; t < n; t += LANES) {
    const __m512 e = _mm512_maskz_mov_ps(live_lanes(n, t), exp_fixed(_mm512_sub_ps(_mm512_loadu_ps(s + t), mm)));
    l = _mm512_add_ps(l, e);
    _mm512_storeu_ps(s + t, e);
  }
  rec[0] = m;
  rec[1] = halve16(l);
}

// The scores of NP (row, head) pairs of one kv head against NB blocks of 16 keys: lane t of
// out[n] + 16 b is key t of block b's score (the fma chain of the header). kb[b]: block b's
// D/2 vectors of dim pairs (32 bf16: 16 keys' dims 2i, 2i + 1), `stride` bf16 apart; q[n] /
// qf[n]: pair n's q row, bf16 / widened. The NP * NB chains are independent (hiding latency).
using ScoreFn = void (*)(const uint16_t* const* kb, int64_t stride, int64_t half, const uint16_t* const* q,
                         const float* const* qf, float* const* out);

template <int NP, int NB>
PREFIXD_AVX512_BF16 void scores_bf16(const uint16_t* const* kb, int64_t stride, int64_t half, const uint16_t* const* q,
                                     const float* const*, float* const* out) {
  __m512 acc[NP][NB];
  for (int n = 0; n < NP; ++n)
    for (int b = 0; b < NB; ++b) acc[n][b] = _mm512_setzero_ps();
  for (int64_t i = 0; i < half; ++i) {
    __m512bh k[NB];
    for (int b = 0; b < NB; ++b) k[b] = (__m512bh)_mm512_loadu_si512(kb[b] + i * stride);
    for (int n = 0; n < NP; ++n) {
      uint32_t w;  // q's dims 2i, 2i + 1
      std::memcpy(&w, q[n] + 2 * i, sizeof w);
      const __m512bh qw = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(w));
      for (int b = 0; b < NB; ++b) acc[n][b] = _mm512_dpbf16_ps(acc[n][b], qw, k[b]);
    }
  }
  for (int n = 0; n < NP; ++n)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out[n] + 16 * b, acc[n][b]);
}

// The same bits without the BF16 instruction: each 32-bit word's high half (the odd dim) and
// low half (the even dim) widened exactly, one fma each, the odd dim first.
template <int NP, int NB>
PREFIXD_AVX512 void scores_fma(const uint16_t* const* kb, int64_t stride, int64_t half, const uint16_t* const*,
                               const float* const* qf, float* const* out) {
  __m512 acc[NP][NB];
  for (int n = 0; n < NP; ++n)
    for (int b = 0; b < NB; ++b) acc[n][b] = _mm512_setzero_ps();
  for (int64_t i = 0; i < half; ++i) {
    __m512 even[NB], odd[NB];
    for (int b = 0; b < NB; ++b) widen_pairs(_mm512_loadu_si512(kb[b] + i * stride), even[b], odd[b]);
    for (int n = 0; n < NP; ++n) {
      const __m512 qo = _mm512_set1_ps(qf[n][2 * i + 1]), qe = _mm512_set1_ps(qf[n][2 * i]);
      for (int b = 0; b < NB; ++b) acc[n][b] = _mm512_fmadd_ps(qe, even[b], _mm512_fmadd_ps(qo, odd[b], acc[n][b]));
    }
  }
  for (int n = 0; n < NP; ++n)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out[n] + 16 * b, acc[n][b]);
}

template <bool BF16, int NP, int NB = SCORE_GROUP / NP>
ScoreFn score_fn_blocks(int64_t blocks) {
  constexpr ScoreFn fn = BF16 ? &scores_bf16<NP, NB> : &scores_fma<NP, NB>;
  if constexpr (NB == 1) {
    return fn;
  } else {
    return blocks == NB ? fn : score_fn_blocks<BF16, NP, NB - 1>(blocks);
  }
}

// The function for `pairs` pairs and `blocks` key blocks, pairs * blocks <= SCORE_GROUP.
template <bool BF16>
ScoreFn score_fn(int64_t pairs, int64_t blocks) {
  switch (pairs) {
#define PREFIXD_CASE(N) \
  case N: return score_fn_blocks<BF16, N>(blocks);
    PREFIXD_CASE(1) PREFIXD_CASE(2) PREFIXD_CASE(3) PREFIXD_CASE(4)
    PREFIXD_CASE(5) PREFIXD_CASE(6) PREFIXD_CASE(7) PREFIXD_CASE(8)
#undef PREFIXD_CASE
    default: return nullptr;
  }
}

// The value sums of NP (row, head) pairs of one kv head over a block of widened values vb
// (16 keys, D): o[n][x] = fma(e[n][k], vb[k][x], o[n][x]) for k = 0 .. end[n] - 1 in order.
// Keys below `common` (the least end) are read once for all NP pairs; each pair's last keys
// after them on their own, in order.
using ValueFn = void (*)(const float* vb, const float* const* e, float* const* o, const int64_t* end, int64_t common);

template <int C, int NP>
PREFIXD_AVX512 void values_group(const float* vb, const float* const* e, float* const* o, const int64_t* end, int64_t common) {
  constexpr int D = 16 * C;
  __m512 acc[NP][C];
  for (int n = 0; n < NP; ++n)
    for (int c = 0; c < C; ++c) acc[n][c] = _mm512_load_ps(o[n] + 16 * c);
  for (int64_t k = 0; k < common; ++k) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = _mm512_load_ps(vb + k * D + 16 * c);
    for (int n = 0; n < NP; ++n) {
      const __m512 ek = _mm512_set1_ps(e[n][k]);
      for (int c = 0; c < C; ++c) acc[n][c] = _mm512_fmadd_ps(ek, v[c], acc[n][c]);
    }
  }
  for (int n = 0; n < NP; ++n) {
    for (int64_t k = common; k < end[n]; ++k) {
      const __m512 ek = _mm512_set1_ps(e[n][k]);
      for (int c = 0; c < C; ++c) acc[n][c] = _mm512_fmadd_ps(ek, _mm512_load_ps(vb + k * D + 16 * c), acc[n][c]);
    }
    for (int c = 0; c < C; ++c) _mm512_store_ps(o[n] + 16 * c, acc[n][c]);
  }
}

// pairs a value group holds: their sums and one key's values fit the 32 vector registers
constexpr int values_group_max(int c) { return std::max(1, std::min(8, (28 - c) / c)); }

template <int C, int N = values_group_max(C)>
ValueFn value_fn(int64_t pairs) {
  if constexpr (N == 1) {
    return &values_group<C, 1>;
  } else {
    return pairs == N ? &values_group<C, N> : value_fn<C, N - 1>(pairs);
  }
}

// One chunk of keys for the task's (row, head) pairs. o is kept with dims in pairs of chunks:
// lane i of chunk pair c holds dims 32c + 2i (first chunk) and 32c + 2i + 1 (second), an odd
// last chunk in order; `combine_avx512` puts them back.
template <int C, bool BF16>
PREFIXD_AVX512 void chunk_avx512(const Attn& a, const Task& task, int64_t chunk, float* part, int64_t pair_stride,
                                 std::vector<float>& scratch) {
  const int64_t* sp = a.spans + task.span * 3;
  const int64_t r0 = sp[0] + task.row, pos0 = sp[1] + task.row, rows = task.rows;
  const int32_t* table = a.tables + task.span * a.table_len;
  const int64_t group = a.heads / a.kv_heads, h0 = task.head_from, hn = task.head_to - h0;
  const int64_t kv0 = h0 / group, kvn = (task.head_to - 1) / group - kv0 + 1;  // the kv heads read
  const int64_t rh = rows * hn;  // (row, head) pairs, row-major
  const int64_t k0 = chunk * KEY_CHUNK;
  const int64_t keys = std::min(pos0 + rows, k0 + KEY_CHUNK);  // the chunk's end for the last row; earlier rows' may be sooner
  const int64_t padded = (keys - k0 + LANES - 1) / LANES * LANES;
  const int64_t d = a.dim;
  // scratch: q (rh, D) | scores (rh, padded) | a block's values (kvn, 16, D) | the pairs' value
  // sums (rh, D) | a block's gathered dim pairs (kvn * D/2, 16) when pages are not read in place
  const int64_t block = LANES * d;  // one kv head's values of a block, widened
  scratch.resize(rh * d + rh * padded + kvn * block + rh * d + kvn * (d / 2) * LANES + LANES);
  float* qf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  float* scores = qf + rh * d;
  float* vbuf = scores + rh * padded;  // (kvn, 16 keys, D), aligned: rh * padded and D are multiples of 16
  float* obuf = vbuf + kvn * block;     // (rh, D)
  if constexpr (!BF16) {  // the fma path's q, widened once (the BF16 path reads q's bf16 pairs)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < hn; ++j) {
        const uint16_t* q = a.q + ((r0 + i) * a.q_stride + h0 + j) * d;
        for (int c = 0; c < C; ++c) _mm512_store_ps(qf + (i * hn + j) * d + c * LANES, load_bf16(q + c * LANES));
      }
  }
  // The pairs of kv head g (g - kv0 < kvn) in groups of near-equal size, up to SCORE_GROUP a
  // group for the scores, values_group_max(C) for the value sums: fn(pairs, size) for each
  // group, pairs in row-major order.
  const PairGroups score_groups(task, group, kv0, kvn, SCORE_GROUP), value_groups(task, group, kv0, kvn, values_group_max(C));
  // scores of every (row, head) pair, a step of blocks of 16 keys at a time: the pairs of one
  // kv head in groups, each dim pair vector of a block read once a group. With pages of a
  // multiple of 16 keys a block is one page's run of keys and is read in place; else its keys'
  // dim pairs are first gathered into the layout of one. A row's scores past its own position
  // (up to the block's end) are computed and never used.
  //
  // A step is one block, read in place or gathered: one block a step reads the pool in order,
  // which keeps it fastest from memory. A task of one or two pairs a kv head (a lone row's heads
  // cut between threads) takes several blocks a step read in place, up to 8 chains in all, so
  // that its chains are enough to hide their latency (probed: 30 layers at 4K, cold, 1 lane:
  // 6.1-6.5 ms a block a step against 7.4-9.8 with two; 1 lane at 512 cut by heads: 1.6 against 1.0).
  const int64_t half = d / 2;
  const bool in_place = a.page % LANES == 0;
  const int64_t most_pairs = rows * std::min(group, hn);
  const int64_t most_blocks = !in_place || most_pairs >= 3 ? 1 : SCORE_GROUP / most_pairs;
  uint32_t* gathered = reinterpret_cast<uint32_t*>(obuf + rh * d);  // (kvn * half, 16) dim pairs
  const uint16_t* qb[SCORE_GROUP];
  const float* qg[SCORE_GROUP];
  float* sg[SCORE_GROUP];
  for (int64_t tb = k0; tb < k0 + padded;) {
    const int64_t step = std::min<int64_t>(most_blocks, (k0 + padded - tb) / LANES);
    const uint16_t* blocks[SCORE_GROUP];
    int64_t stride;
    if (in_place) {
      for (int64_t b = 0; b < step; ++b) blocks[b] = key_pair(a, table, tb + b * LANES, kv0, 0);
      stride = a.page * 2;
      for (int64_t b = 0; b < step; ++b) {  // the step's blocks, PREFETCH_BLOCKS blocks on: their kv heads' lines
        const int64_t ahead = tb + (PREFETCH_BLOCKS + b) * LANES;
        if (ahead >= keys) break;
        const char* kp = reinterpret_cast<const char*>(key_pair(a, table, ahead, kv0, 0));
        for (int64_t l = 0; l < kvn * half; ++l) prefixd_cpu::prefetch_l2(kp + 64 * l);
      }
    } else {
      for (int64_t k = 0; k < LANES; ++k)
        for (int64_t j = 0; j < kvn * half; ++j) {
          uint32_t w = 0;
          if (tb + k < keys) std::memcpy(&w, key_pair(a, table, tb + k, kv0, j), sizeof w);
          gathered[j * LANES + k] = w;
        }
      blocks[0] = reinterpret_cast<const uint16_t*>(gathered);
      stride = LANES * 2;
    }
    for (int64_t g = 0; g < kvn; ++g)
      score_groups.each(g, [&](const int64_t* p, int64_t size) {
        const int64_t most = SCORE_GROUP / size;  // blocks a call: a few pairs take more blocks at once
        for (int64_t b0 = 0; b0 < step; b0 += most) {
          const int64_t nb = std::min(most, step - b0);
          const uint16_t* kb[SCORE_GROUP];
          for (int64_t b = 0; b < nb; ++b) kb[b] = blocks[b0 + b] + g * half * stride;
          for (int64_t y = 0; y < size; ++y) {
            qb[y] = a.q + ((r0 + p[y] / hn) * a.q_stride + h0 + p[y] % hn) * d;
            qg[y] = qf + p[y] * d;
            sg[y] = scores + p[y] * padded + tb + b0 * LANES - k0;
          }
          score_fn<BF16>(size, nb)(kb, stride, half, qb, qg, sg);
        }
      });
    tb += step * LANES;
  }
  for (int64_t p = 0; p < rh; ++p)  // the row's keys in this chunk
    softmax_chunk(scores + p * padded, std::min(pos0 + p / hn + 1, keys) - k0, part + p * pair_stride);
  // o = sum e_t v_t per (row, head). Values are widened once per block of 16 keys for every pair
  // of the task, two bf16 at a time: a 32-bit word's low half (shifted up) and its high half
  // (masked) are both exact, so a pair of chunks holds dims 32c + 2i and 32c + 2i + 1 in lane i;
  // each dim's sum is the same fma chain in key order, the pairs of a kv head in groups that
  // share each key's values in registers (`values_group`).
  constexpr int CP = C / 2;  // chunk pairs read two bf16 at a time; an odd last chunk is read as before
  std::fill(obuf, obuf + rh * d, 0.f);
  for (int64_t tb = k0; tb < keys; tb += LANES) {
    const int64_t live = std::min<int64_t>(LANES, keys - tb);
    if (tb + PREFETCH_BLOCKS * LANES < keys) {  // the values PREFETCH_BLOCKS blocks on
      const int64_t ahead = tb + PREFETCH_BLOCKS * LANES;
      const int64_t n = std::min<int64_t>(LANES, keys - ahead);
      for (int64_t k = 0; k < n; ++k) {
        const char* vp = reinterpret_cast<const char*>(value_row(a, table, ahead + k, kv0));
        for (int64_t l = 0; l < kvn * d * 2; l += 64) prefixd_cpu::prefetch_l2(vp + l);
      }
    }
    for (int64_t k = 0; k < live; ++k) {
      const uint16_t* vr = value_row(a, table, tb + k, kv0);
      for (int64_t g = 0; g < kvn; ++g) {
        const uint16_t* v = vr + g * d;
        float* vk = vbuf + g * block + k * d;
        for (int c = 0; c < CP; ++c) {
          __m512 low, high;
          widen_pairs(_mm512_loadu_si512(v + 32 * c), low, high);
          _mm512_store_ps(vk + 32 * c, low);
          _mm512_store_ps(vk + 32 * c + 16, high);
        }
        if (C % 2) _mm512_store_ps(vk + 32 * CP, load_bf16(v + 32 * CP));
      }
    }
    for (int64_t g = 0; g < kvn; ++g)
      value_groups.each(g, [&](const int64_t* p, int64_t size) {
        const float* e[SCORE_GROUP];
        float* o[SCORE_GROUP];
        int64_t end[SCORE_GROUP], common = LANES;
        for (int64_t y = 0; y < size; ++y) {
          e[y] = scores + p[y] * padded + tb - k0;
          o[y] = obuf + p[y] * d;
          end[y] = std::clamp<int64_t>(pos0 + p[y] / hn + 1 - tb, 0, live);  // the row's keys in this block
          common = std::min(common, end[y]);
        }
        value_fn<C>(size)(vbuf + g * block, e, o, end, common);
      });
  }
  for (int64_t p = 0; p < rh; ++p) std::memcpy(part + p * pair_stride + 2, obuf + p * d, d * sizeof(float));
}

// With PAIRED (the bf16 chunks' order), o's dims are put back in order; else (8-bit pages' chunks)
// they are in order already. Either way the arithmetic of `combine_portable`.
template <int C, bool PAIRED = true>
PREFIXD_AVX512 void combine_avx512(const float* part, int64_t stride, int64_t chunks, int64_t, float* out) {
  constexpr int CP = C / 2;
  __m512 o[C];
  float l;
  if (chunks == 1) {  // what the general case gives for one chunk (w = 1): o / l
    for (int c = 0; c < C; ++c) o[c] = _mm512_loadu_ps(part + 2 + 16 * c);
    l = part[1];
  } else {
    const float m = joined_max(part, stride, chunks);
    for (int c = 0; c < C; ++c) o[c] = _mm512_setzero_ps();
    l = 0.f;
    for (int64_t k = 0; k < chunks; ++k) {
      const float* rec = part + k * stride;
      const float w = exp_fixed(rec[0] - m);
      l = l + w * rec[1];
      const __m512 wv = _mm512_set1_ps(w);
      for (int c = 0; c < C; ++c) o[c] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(rec + 2 + 16 * c), o[c]);
    }
  }
  const __m512 sum = _mm512_set1_ps(l);
  if constexpr (!PAIRED) {
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_div_ps(o[c], sum));
    return;
  }
  const __m512i lo_idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi_idx = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int c = 0; c < CP; ++c) {
    const __m512 even = _mm512_div_ps(o[2 * c], sum);
    const __m512 odd = _mm512_div_ps(o[2 * c + 1], sum);
    _mm512_storeu_ps(out + 32 * c, _mm512_permutex2var_ps(even, lo_idx, odd));
    _mm512_storeu_ps(out + 32 * c + 16, _mm512_permutex2var_ps(even, hi_idx, odd));
  }
  if (C % 2) _mm512_storeu_ps(out + 32 * CP, _mm512_div_ps(o[C - 1], sum));
}

// ---- 8-bit pages, AVX-512 VNNI path -----------------------------------------------------------------

#define PREFIXD_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#define PREFIXD_AVX512_VNNI_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16")))

// The scores of NP pairs against NB blocks of 16 keys from 8-bit pages (the portable path's
// arithmetic): per block of 32 dims, 8 steps of `vpdpbusd` (4 dims of 16 keys, K's unsigned
// codes times the pair's signed codes, summed exactly in int32), less the pair's offset, to
// fp32, times the pair's scale, then fma with the keys' scales. kb[b]: key block b's quads,
// quad i `stride` bytes after quad 0; ks[b]: its scales, block j `sstride` floats after block 0.
template <int NQ, int NP, int NB>
PREFIXD_AVX512_VNNI void scores_q8(const uint8_t* const* kb, int64_t stride, const float* const* ks, int64_t sstride,
                                   const QCodes* const* q, float* const* out) {
  __m512 acc[NP][NB];
  for (int n = 0; n < NP; ++n)
    for (int b = 0; b < NB; ++b) acc[n][b] = _mm512_setzero_ps();
  for (int j = 0; j < NQ; ++j) {
    __m512i dot[NP][NB];
    for (int n = 0; n < NP; ++n)
      for (int b = 0; b < NB; ++b) dot[n][b] = _mm512_setzero_si512();
    for (int i = 0; i < QBLOCK / 4; ++i) {
      const int64_t quad = j * QBLOCK / 4 + i;
      __m512i k[NB];
      for (int b = 0; b < NB; ++b) k[b] = _mm512_loadu_si512(kb[b] + quad * stride);
      for (int n = 0; n < NP; ++n) {
        int32_t w;  // the pair's codes of dims 4 quad .. 4 quad + 3
        std::memcpy(&w, q[n]->codes + 4 * quad, sizeof w);
        const __m512i qw = _mm512_set1_epi32(w);
        for (int b = 0; b < NB; ++b) dot[n][b] = _mm512_dpbusd_epi32(dot[n][b], k[b], qw);
      }
    }
    for (int n = 0; n < NP; ++n) {
      const __m512i off = _mm512_set1_epi32(q[n]->offset[j]);
      const __m512 sq = _mm512_set1_ps(q[n]->scale[j]);
      for (int b = 0; b < NB; ++b) {
        const __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[n][b], off)), sq);
        acc[n][b] = _mm512_fmadd_ps(x, _mm512_loadu_ps(ks[b] + j * sstride), acc[n][b]);
      }
    }
  }
  for (int n = 0; n < NP; ++n)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out[n] + 16 * b, acc[n][b]);
}

using ScoreQ8Fn = void (*)(const uint8_t* const*, int64_t, const float* const*, int64_t, const QCodes* const*,
                           float* const*);

template <int NQ, int NP, int NB = SCORE_GROUP / NP>
ScoreQ8Fn score_q8_blocks(int64_t blocks) {
  if constexpr (NB == 1) {
    return &scores_q8<NQ, NP, 1>;
  } else {
    return blocks == NB ? &scores_q8<NQ, NP, NB> : score_q8_blocks<NQ, NP, NB - 1>(blocks);
  }
}

template <int NQ>
ScoreQ8Fn score_q8_fn(int64_t pairs, int64_t blocks) {
  switch (pairs) {
#define PREFIXD_CASE(N) \
  case N: return score_q8_blocks<NQ, N>(blocks);
    PREFIXD_CASE(1) PREFIXD_CASE(2) PREFIXD_CASE(3) PREFIXD_CASE(4)
    PREFIXD_CASE(5) PREFIXD_CASE(6) PREFIXD_CASE(7) PREFIXD_CASE(8)
#undef PREFIXD_CASE
    default: return nullptr;
  }
}

// Where the value sums read a block's values (16 keys, D in dim order) as fp32 vectors: from a
// widened block (16 keys x D floats), or each key's codes widened as they are read (rows[k]:
// key k's codes of the kv head), which spares a block stored and read back.
template <int D>
struct WidenedBlock {
  const float* vb;
  PREFIXD_AVX512 __m512 operator()(int64_t k, int c) const { return _mm512_load_ps(vb + k * D + 16 * c); }
};

struct CodeRows {
  const int8_t* const* rows;
  PREFIXD_AVX512 __m512 operator()(int64_t k, int c) const {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[k] + 16 * c))));
  }
};

// The value sums of NP pairs over a block of values:
// o[n][x] = fma(e[n][(x / 32) * estride + k], v[k][x], o[n][x]) for k = 0 .. end[n] - 1 in
// order (e: each pair's weights times the keys' V scales, a row of keys per block of 32 dims).
// Keys below `common` are read once for all NP pairs.
template <class Src>
using ValueQ8Fn = void (*)(Src src, const float* const* e, int64_t estride, float* const* o, const int64_t* end,
                           int64_t common);

template <int NQ, int NP, class Src>
PREFIXD_AVX512 void values_q8(Src src, const float* const* e, int64_t estride, float* const* o, const int64_t* end,
                              int64_t common) {
  constexpr int C = 2 * NQ;
  __m512 acc[NP][C];
  for (int n = 0; n < NP; ++n)
    for (int c = 0; c < C; ++c) acc[n][c] = _mm512_load_ps(o[n] + 16 * c);
  for (int64_t k = 0; k < common; ++k) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = src(k, c);
    for (int n = 0; n < NP; ++n)
      for (int j = 0; j < NQ; ++j) {
        const __m512 ek = _mm512_set1_ps(e[n][j * estride + k]);
        acc[n][2 * j] = _mm512_fmadd_ps(ek, v[2 * j], acc[n][2 * j]);
        acc[n][2 * j + 1] = _mm512_fmadd_ps(ek, v[2 * j + 1], acc[n][2 * j + 1]);
      }
  }
  for (int n = 0; n < NP; ++n) {
    for (int64_t k = common; k < end[n]; ++k)
      for (int j = 0; j < NQ; ++j) {
        const __m512 ek = _mm512_set1_ps(e[n][j * estride + k]);
        acc[n][2 * j] = _mm512_fmadd_ps(ek, src(k, 2 * j), acc[n][2 * j]);
        acc[n][2 * j + 1] = _mm512_fmadd_ps(ek, src(k, 2 * j + 1), acc[n][2 * j + 1]);
      }
    for (int c = 0; c < C; ++c) _mm512_store_ps(o[n] + 16 * c, acc[n][c]);
  }
}

constexpr int values_q8_max(int nq) { return std::max(1, std::min(8, (28 - 3 * nq) / (2 * nq))); }

template <int NQ, class Src, int N = values_q8_max(NQ)>
ValueQ8Fn<Src> value_q8_fn(int64_t pairs) {
  if constexpr (N == 1) {
    return &values_q8<NQ, 1, Src>;
  } else {
    return pairs == N ? &values_q8<NQ, N, Src> : value_q8_fn<NQ, Src, N - 1>(pairs);
  }
}

// The value weights of 16 keys as `bf16_weight` gives them (lanes of w, held in fp32).
PREFIXD_AVX512 inline __m512 bf16_weights(__m512 w) {
  const __mmask16 keep = _mm512_cmp_ps_mask(w, _mm512_set1_ps(QUANT_TINY), _CMP_NLT_UQ);  // >= 2^-60, or NaN
  const __mmask16 nan = _mm512_cmp_ps_mask(w, w, _CMP_UNORD_Q);
  const __m512i b = _mm512_castps_si512(w);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  r = _mm512_mask_or_epi32(r, nan, b, _mm512_set1_epi32(0x00400000));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u)));
  return _mm512_maskz_mov_ps(keep, _mm512_castsi512_ps(r));
}

// The BF16 value sums read keys two at a time: a 32-bit word holds key 2i's bf16 (of a weight,
// or of a code) in its high half and key 2i + 1's in its low half, and the instruction adds the
// high halves' product first, then the low halves': o = fma(w_2i, v_2i, o), then
// fma(w_2i+1, v_2i+1, o), the fma chain in key order. 16 keys' weights w (before rounding) as
// 8 such words: `bf16_weights`' bits by the BF16 conversion (nearest-even, NaN quieted; it
// would flush a subnormal input, but those lanes are zeroed first).
PREFIXD_AVX512_BF16 inline void store_weight_words(__m512 w, uint32_t* to) {
  const __mmask16 keep = _mm512_cmp_ps_mask(w, _mm512_set1_ps(QUANT_TINY), _CMP_NLT_UQ);  // >= 2^-60, or NaN
  const __m256i halves = (__m256i)_mm512_maskz_cvtneps_pbh(keep, w);  // key order
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), _mm256_ror_epi32(halves, 16));
}

// 16 dims of two keys' codes as such words: a code (|c| <= 127) widened to fp32 has a zero low
// half, so the high half of its bits is its bf16, exactly.
PREFIXD_AVX512 inline __m512i code_bits(const int8_t* c) {  // 16 codes' fp32 bits
  return _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)))));
}

PREFIXD_AVX512 inline __m512i code_pairs(const int8_t* first, const int8_t* second) {
  return _mm512_or_si512(code_bits(first), _mm512_srli_epi32(code_bits(second), 16));
}

// Where the BF16 value sums read a block's key pairs: from paired codes stored once (8 pairs x
// D words), or each pair's rows paired as they are read (rows[2i], rows[2i + 1]: the keys'
// codes of the kv head).
template <int D>
struct PairedBlock {
  const uint32_t* vb;
  PREFIXD_AVX512 __m512i operator()(int64_t kp, int c) const { return _mm512_loadu_si512(vb + kp * D + 16 * c); }
};

struct PairRows {
  const int8_t* const* rows;
  PREFIXD_AVX512 __m512i operator()(int64_t kp, int c) const { return code_pairs(rows[2 * kp] + 16 * c, rows[2 * kp + 1] + 16 * c); }
};

// The value sums of NP pairs as `values_q8` gives them, two keys an instruction: e[n] holds
// words of weights (a row of words per block of 32 dims, `estride` apart), and end, common
// count key pairs (a pair past a row's last key adds a weight of 0 times a finite code).
template <class Src>
using ValueDotFn = void (*)(Src src, const uint32_t* const* e, int64_t estride, float* const* o, const int64_t* end,
                            int64_t common);

template <int NQ, int NP, class Src>
PREFIXD_AVX512_BF16 void values_dot(Src src, const uint32_t* const* e, int64_t estride, float* const* o,
                                    const int64_t* end, int64_t common) {
  constexpr int C = 2 * NQ;
  __m512 acc[NP][C];
  for (int n = 0; n < NP; ++n)
    for (int c = 0; c < C; ++c) acc[n][c] = _mm512_load_ps(o[n] + 16 * c);
  for (int64_t kp = 0; kp < common; ++kp) {
    __m512bh v[C];
    for (int c = 0; c < C; ++c) v[c] = (__m512bh)src(kp, c);
    for (int n = 0; n < NP; ++n)
      for (int j = 0; j < NQ; ++j) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(e[n][j * estride + kp]));
        acc[n][2 * j] = _mm512_dpbf16_ps(acc[n][2 * j], w, v[2 * j]);
        acc[n][2 * j + 1] = _mm512_dpbf16_ps(acc[n][2 * j + 1], w, v[2 * j + 1]);
      }
  }
  for (int n = 0; n < NP; ++n) {
    for (int64_t kp = common; kp < end[n]; ++kp)
      for (int j = 0; j < NQ; ++j) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(e[n][j * estride + kp]));
        acc[n][2 * j] = _mm512_dpbf16_ps(acc[n][2 * j], w, (__m512bh)src(kp, 2 * j));
        acc[n][2 * j + 1] = _mm512_dpbf16_ps(acc[n][2 * j + 1], w, (__m512bh)src(kp, 2 * j + 1));
      }
    for (int c = 0; c < C; ++c) _mm512_store_ps(o[n] + 16 * c, acc[n][c]);
  }
}

template <int NQ, class Src, int N = values_q8_max(NQ)>
ValueDotFn<Src> value_dot_fn(int64_t pairs) {
  if constexpr (N == 1) {
    return &values_dot<NQ, 1, Src>;
  } else {
    return pairs == N ? &values_dot<NQ, N, Src> : value_dot_fn<NQ, Src, N - 1>(pairs);
  }
}

// One chunk of keys for the task's pairs from 8-bit pages: the bf16 chunk's plan (blocks of 16
// keys read in place when pages hold a multiple of 16 keys, else gathered; the pairs of a kv
// head in groups; prefetch PREFETCH_BLOCKS blocks on), with the arithmetic of `chunk_q8_portable`.
// (With the BF16 target for DOT's weight words, which inline only into a function that has it;
// the fma instantiation has no BF16 code to emit: it converts by integer operations.)
template <int NQ, bool DOT>
PREFIXD_AVX512_VNNI_BF16 void chunk_q8_vnni(const Attn& a, const Task& task, int64_t chunk, float* part, int64_t pair_stride,
                                       std::vector<float>& scratch) {
  constexpr int64_t D = QBLOCK * NQ, QUADS = D / 4;
  const int64_t* sp = a.spans + task.span * 3;
  const int64_t r0 = sp[0] + task.row, pos0 = sp[1] + task.row, rows = task.rows;
  const int32_t* table = a.tables + task.span * a.table_len;
  const int64_t group = a.heads / a.kv_heads, h0 = task.head_from, hn = task.head_to - h0;
  const int64_t kv0 = h0 / group, kvn = (task.head_to - 1) / group - kv0 + 1;
  const int64_t rh = rows * hn;
  const int64_t k0 = chunk * KEY_CHUNK;
  const int64_t keys = std::min(pos0 + rows, k0 + KEY_CHUNK);
  const int64_t padded = (keys - k0 + LANES - 1) / LANES * LANES;
  // scratch: q codes (rh QCodes) | scores (rh, padded) | weights (rh, NQ, padded) | a block's
  // values (kvn, 16, D), and before them the chunk's V scales (kvn, NQ, padded): 16 D floats a
  // kv head either way | value sums (rh, D) | a gathered block: quads (kvn * QUADS, 16) and
  // scales (kvn * NQ, 16) when pages are not read in place
  const int64_t qfloats = (rh * static_cast<int64_t>(sizeof(QCodes)) + 63) / 64 * 16;
  // sized for a whole chunk whatever this one holds: the buffer then stays where it is across
  // the task's chunks, and q's codes made on its first chunk serve the others
  const int64_t room = KEY_CHUNK;
  scratch.resize(qfloats + rh * room * (1 + NQ) + kvn * LANES * D + rh * D + kvn * (QUADS + NQ) * LANES + LANES);
  float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  QCodes* qc = reinterpret_cast<QCodes*>(base);
  float* scores = base + qfloats;
  float* weights = scores + rh * padded;
  float* vbuf = weights + rh * NQ * padded;
  float* obuf = vbuf + kvn * LANES * D;
  uint32_t* gathered = reinterpret_cast<uint32_t*>(obuf + rh * D);
  float* gathered_scales = reinterpret_cast<float*>(gathered + kvn * QUADS * LANES);
  if (chunk == task.chunk_from)  // the task's chunks run in order, on one thread, with one scratch
    for (int64_t p = 0; p < rh; ++p) quantize_q(a.q + ((r0 + p / hn) * a.q_stride + h0 + p % hn) * D, D, qc[p]);
  const PairGroups score_groups(task, group, kv0, kvn, SCORE_GROUP), value_groups(task, group, kv0, kvn, values_q8_max(NQ));
  const bool in_place = a.page % LANES == 0;
  const int64_t most_pairs = rows * std::min(group, hn);
  const int64_t most_blocks = !in_place || most_pairs >= 3 ? 1 : SCORE_GROUP / most_pairs;
  const QCodes* qp[SCORE_GROUP];
  float* sg[SCORE_GROUP];
  for (int64_t tb = k0; tb < k0 + padded;) {
    const int64_t step = std::min<int64_t>(most_blocks, (k0 + padded - tb) / LANES);
    const uint8_t* blocks[SCORE_GROUP];
    const float* block_scales[SCORE_GROUP];
    int64_t stride, sstride, gstride, gsstride;  // quads / scale rows apart; kv heads apart
    if (in_place) {
      for (int64_t b = 0; b < step; ++b) {
        blocks[b] = key_quad(a, table, tb + b * LANES, kv0, 0);
        block_scales[b] = scale8(a.k8, a, table, tb + b * LANES, kv0, 0);
      }
      stride = a.page * 4, sstride = a.page, gstride = QUADS * stride, gsstride = NQ * a.page;
      for (int64_t b = 0; b < step; ++b) {  // PREFETCH_BLOCKS blocks on: K's quads and scales, V's scales
        const int64_t ahead = tb + (PREFETCH_BLOCKS + b) * LANES;
        if (ahead >= keys) break;
        const char* kp = reinterpret_cast<const char*>(key_quad(a, table, ahead, kv0, 0));
        for (int64_t l = 0; l < kvn * QUADS; ++l) prefixd_cpu::prefetch_l2(kp + l * stride);
        const char* ks = reinterpret_cast<const char*>(scale8(a.k8, a, table, ahead, kv0, 0));
        const char* vs = reinterpret_cast<const char*>(scale8(a.v8, a, table, ahead, kv0, 0));
        for (int64_t l = 0; l < kvn * NQ; ++l) {
          prefixd_cpu::prefetch_l2(ks + l * sstride * 4);
          prefixd_cpu::prefetch_l2(vs + l * sstride * 4);
        }
      }
    } else {
      for (int64_t k = 0; k < LANES; ++k) {
        const bool live = tb + k < keys;
        for (int64_t j = 0; j < kvn * QUADS; ++j) {
          uint32_t w = 0;
          if (live) std::memcpy(&w, key_quad(a, table, tb + k, kv0 + j / QUADS, j % QUADS), sizeof w);
          gathered[j * LANES + k] = w;
        }
        for (int64_t j = 0; j < kvn * NQ; ++j)
          gathered_scales[j * LANES + k] = live ? *scale8(a.k8, a, table, tb + k, kv0 + j / NQ, j % NQ) : 0.f;
      }
      blocks[0] = reinterpret_cast<const uint8_t*>(gathered);
      block_scales[0] = gathered_scales;
      stride = LANES * 4, sstride = LANES, gstride = QUADS * stride, gsstride = NQ * LANES;
    }
    for (int64_t g = 0; g < kvn; ++g)
      score_groups.each(g, [&](const int64_t* p, int64_t size) {
        const int64_t most = SCORE_GROUP / size;
        for (int64_t b0 = 0; b0 < step; b0 += most) {
          const int64_t nb = std::min(most, step - b0);
          const uint8_t* kb[SCORE_GROUP];
          const float* ks[SCORE_GROUP];
          for (int64_t b = 0; b < nb; ++b) {
            kb[b] = blocks[b0 + b] + g * gstride;
            ks[b] = block_scales[b0 + b] + g * gsstride;
          }
          for (int64_t y = 0; y < size; ++y) {
            qp[y] = qc + p[y];
            sg[y] = scores + p[y] * padded + tb + b0 * LANES - k0;
          }
          score_q8_fn<NQ>(size, nb)(kb, stride, ks, sstride, qp, sg);
        }
      });
    tb += step * LANES;
  }
  // softmax: m, e and l as the bf16 chunk's (`softmax_chunk`); each pair's weights per block of
  // dims, e times the keys' V scales as `bf16_weight` rounds it (lanes past the pair's keys 0):
  // floats, or with DOT words of two. The V scales are read once for all of a kv head's pairs.
  uint32_t* words = reinterpret_cast<uint32_t*>(weights);
  float* vscales = vbuf;  // (kvn, NQ, padded): free until the value sums
  for (int64_t g = 0; g < kvn; ++g)
    for (int64_t j = 0; j < NQ; ++j)
      for (int64_t t = 0; t < padded; t += LANES) {
        float* to = vscales + (g * NQ + j) * padded + t;
        const __mmask16 live = live_lanes(keys - k0, t);
        if (in_place) {
          _mm512_storeu_ps(to, _mm512_maskz_loadu_ps(live, scale8(a.v8, a, table, k0 + t, kv0 + g, j)));
        } else {
          for (int64_t k = 0; k < LANES; ++k) to[k] = t + k < keys - k0 ? *scale8(a.v8, a, table, k0 + t + k, kv0 + g, j) : 0.f;
        }
      }
  for (int64_t p = 0; p < rh; ++p) {
    const int64_t n = std::min(pos0 + p / hn + 1, keys) - k0;
    const float* sv = vscales + ((h0 + p % hn) / group - kv0) * NQ * padded;
    const float* s = scores + p * padded;
    const float m = chunk_max(s, n);  // then e and l as `softmax_chunk`, each block's weights at once
    __m512 l = _mm512_setzero_ps();
    const __m512 mm = _mm512_set1_ps(m);
    for (int64_t t = 0; t < n; t += LANES) {
      const __mmask16 live = live_lanes(n, t);
      const __m512 e = _mm512_maskz_mov_ps(live, exp_fixed(_mm512_sub_ps(_mm512_loadu_ps(s + t), mm)));
      l = _mm512_add_ps(l, e);
      for (int64_t j = 0; j < NQ; ++j) {
        const __m512 w = _mm512_maskz_mul_ps(live, e, _mm512_loadu_ps(sv + j * padded + t));
        if constexpr (DOT)
          store_weight_words(w, words + (p * NQ + j) * (padded / 2) + t / 2);
        else
          _mm512_storeu_ps(weights + (p * NQ + j) * padded + t, bf16_weights(w));
      }
    }
    part[p * pair_stride] = m;
    part[p * pair_stride + 1] = halve16(l);
  }
  // o = sum of weights times codes, each dim's fma chain in key order; a block's codes widened
  // (with DOT: paired) once for every pair of the task, or as they are read where a kv head's
  // pairs are one group (a decode row's heads: no block stored and read back)
  const bool one_group = most_pairs <= values_q8_max(NQ);
  static const int8_t no_codes[MAX_CHUNKS * LANES] = {};  // a block's key past its last: weight 0
  std::fill(obuf, obuf + rh * D, 0.f);
  for (int64_t tb = k0; tb < keys; tb += LANES) {
    const int64_t live = std::min<int64_t>(LANES, keys - tb);
    const int64_t held = DOT ? (live + 1) / 2 * 2 : live;  // keys read: with DOT whole pairs
    if (tb + PREFETCH_BLOCKS * LANES < keys) {
      const int64_t ahead = tb + PREFETCH_BLOCKS * LANES;
      const int64_t n = std::min<int64_t>(LANES, keys - ahead);
      for (int64_t k = 0; k < n; ++k) {
        const char* vp = reinterpret_cast<const char*>(value_row8(a, table, ahead + k, kv0));
        for (int64_t l = 0; l < kvn * D; l += 64) prefixd_cpu::prefetch_l2(vp + l);
      }
    }
    const int8_t* vrows[LANES];  // each key's codes of the task's kv heads
    for (int64_t k = 0; k < live; ++k) vrows[k] = value_row8(a, table, tb + k, kv0);
    const auto codes_of = [&](int64_t k, int64_t g) { return k < live ? vrows[k] + g * D : no_codes; };
    if (!one_group) {
      for (int64_t g = 0; g < kvn; ++g) {
        if constexpr (DOT) {
          uint32_t* vw = reinterpret_cast<uint32_t*>(vbuf) + g * LANES / 2 * D;
          for (int64_t kp = 0; kp < held / 2; ++kp)
            for (int64_t c = 0; c < D / LANES; ++c)
              _mm512_storeu_si512(vw + kp * D + c * LANES, code_pairs(codes_of(2 * kp, g) + c * LANES, codes_of(2 * kp + 1, g) + c * LANES));
        } else {
          for (int64_t k = 0; k < live; ++k)
            for (int64_t c = 0; c < D / LANES; ++c) {
              const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(vrows[k] + g * D + c * LANES));
              _mm512_store_ps(vbuf + (g * LANES + k) * D + c * LANES, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)));
            }
        }
      }
    }
    for (int64_t g = 0; g < kvn; ++g)
      value_groups.each(g, [&](const int64_t* p, int64_t size) {
        float* o[SCORE_GROUP];
        int64_t end[SCORE_GROUP], common = LANES;
        for (int64_t y = 0; y < size; ++y) {
          o[y] = obuf + p[y] * D;
          end[y] = std::clamp<int64_t>(pos0 + p[y] / hn + 1 - tb, 0, live);
          if (DOT) end[y] = (end[y] + 1) / 2;  // key pairs
          common = std::min(common, end[y]);
        }
        const int8_t* rows_g[LANES];
        if (one_group)
          for (int64_t k = 0; k < held; ++k) rows_g[k] = codes_of(k, g);
        if constexpr (DOT) {
          const uint32_t* e[SCORE_GROUP];
          for (int64_t y = 0; y < size; ++y) e[y] = words + p[y] * NQ * (padded / 2) + (tb - k0) / 2;
          if (one_group)
            value_dot_fn<NQ, PairRows>(size)(PairRows{rows_g}, e, padded / 2, o, end, common);
          else
            value_dot_fn<NQ, PairedBlock<D>>(size)(PairedBlock<D>{reinterpret_cast<const uint32_t*>(vbuf) + g * LANES / 2 * D},
                                                   e, padded / 2, o, end, common);
        } else {
          const float* e[SCORE_GROUP];
          for (int64_t y = 0; y < size; ++y) e[y] = weights + p[y] * NQ * padded + tb - k0;
          if (one_group)
            value_q8_fn<NQ, CodeRows>(size)(CodeRows{rows_g}, e, padded, o, end, common);
          else
            value_q8_fn<NQ, WidenedBlock<D>>(size)(WidenedBlock<D>{vbuf + g * LANES * D}, e, padded, o, end, common);
        }
      });
  }
  for (int64_t p = 0; p < rh; ++p) std::memcpy(part + p * pair_stride + 2, obuf + p * D, D * sizeof(float));
}

// With `dot`, the value sums take the BF16 dot product (the "avx512-bf16" path), else fmas
// (the "avx512-vnni" path): the same bits. Chunks are joined in dim order (`combine_portable`'s
// arithmetic, vectorized).
Path q8_path(int64_t dim, bool dot) {
  switch (dim / QBLOCK) {
#define PREFIXD_CASE(NQ) \
  case NQ: return {dot ? &chunk_q8_vnni<NQ, true> : &chunk_q8_vnni<NQ, false>, &combine_avx512<2 * NQ, false>};
    PREFIXD_CASE(1) PREFIXD_CASE(2) PREFIXD_CASE(3) PREFIXD_CASE(4) PREFIXD_CASE(8)
#undef PREFIXD_CASE
    default: return {nullptr, nullptr};
  }
}

Path avx512_path(int64_t chunks, bool bf16) {
  switch (chunks) {
#define PREFIXD_CASE(C) \
  case C: return {bf16 ? &chunk_avx512<C, true> : &chunk_avx512<C, false>, &combine_avx512<C>};
    PREFIXD_CASE(1) PREFIXD_CASE(2) PREFIXD_CASE(3) PREFIXD_CASE(4) PREFIXD_CASE(5) PREFIXD_CASE(6)
    PREFIXD_CASE(7) PREFIXD_CASE(8) PREFIXD_CASE(16)
#undef PREFIXD_CASE
    default: return {nullptr, nullptr};
  }
}

#endif  // PREFIXD_X86

bool have_avx512() {
#ifdef PREFIXD_X86
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return yes;
#else
  return false;  // the portable path only: the same bits
#endif
}

bool have_avx512_bf16() {
#ifdef PREFIXD_X86
  static const bool yes = have_avx512() && __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

bool have_avx512_vnni() {
#ifdef PREFIXD_X86
  static const bool yes = have_avx512() && __builtin_cpu_supports("avx512vnni");
  return yes;
#else
  return false;
#endif
}

// The fastest path this CPU has: "avx512-bf16", "avx512" or "portable" (the same bits).
std::string best_path() { return have_avx512_bf16() ? "avx512-bf16" : have_avx512() ? "avx512" : "portable"; }

// The same for 8-bit pools: "avx512-bf16" (VNNI scores, BF16 value sums), "avx512-vnni" (VNNI
// scores, fma value sums) or "portable" (the same bits).
std::string best_q8_path() {
  return have_avx512_vnni() && have_avx512_bf16() ? "avx512-bf16" : have_avx512_vnni() ? "avx512-vnni" : "portable";
}

// One task: its chunks' partials, then each (row, head)'s output (a task holding every chunk of
// its rows) or the partials into its block's share of the split buffer (combined after all tasks).
void run_task(const Attn& a, const Task& task, const Path& path, float* split, std::vector<float>& scratch,
              std::vector<float>& local) {
  const int64_t* sp = a.spans + task.span * 3;
  const int64_t hn = task.head_to - task.head_from, rh = task.rows * hn, rec = a.dim + 2;
  const int64_t nc = task.chunk_to - task.chunk_from;
  local.resize(rh * nc * rec);
  for (int64_t c = task.chunk_from; c < task.chunk_to; ++c)
    path.chunk(a, task, c, local.data() + (c - task.chunk_from) * rec, nc * rec, scratch);
  for (int64_t p = 0; p < rh; ++p) {
    const int64_t i = p / hn, h = task.head_from + p % hn;
    const int64_t chunks = chunks_of(sp[1] + task.row + i + 1);  // the row's own
    const float* mine = local.data() + p * nc * rec;
    if (task.split_at < 0) {
      path.combine(mine, rec, chunks, a.dim, a.out + ((sp[0] + task.row + i) * a.heads + h) * a.dim);
    } else {
      float* to = split + task.split_at + (i * a.heads + h) * chunks_of(sp[1] + task.row + task.rows) * rec;
      for (int64_t c = task.chunk_from; c < std::min(task.chunk_to, chunks); ++c)
        std::memcpy(to + c * rec, mine + (c - task.chunk_from) * rec, rec * sizeof(float));
    }
  }
}

// The K and V pools both ops read or write, contiguous, one shape: bf16 (pages, page_size,
// kv_heads, D), or 8-bit pages uint8 (pages, page_size, kv_heads, D + D/8) (codes, then scales:
// the byte count of a page, not its order). Returns D and whether the pools are 8-bit.
std::pair<int64_t, bool> check_pools(const at::Tensor& k_pool, const at::Tensor& v_pool, const char* op) {
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.scalar_type() == v_pool.scalar_type() &&
                  (k_pool.scalar_type() == at::kBFloat16 || k_pool.scalar_type() == at::kByte) &&
                  k_pool.is_contiguous() && v_pool.is_contiguous(),
              op, ": k and v pools must be contiguous bf16 (pages, page_size, kv_heads, D), or uint8 8-bit pages "
              "(pages, page_size, kv_heads, D + D/8), of one shape");
  if (k_pool.scalar_type() == at::kBFloat16) return {k_pool.size(3), false};
  const int64_t dim = k_pool.size(3) / 9 * 8;
  TORCH_CHECK(dim % QBLOCK == 0 && dim > 0 && dim <= MAX_CHUNKS * LANES && dim + dim / 8 == k_pool.size(3), op, ": an 8-bit page's last size ",
              k_pool.size(3), " is not D + D/8 for a D that is a multiple of 32 up to 256");
  return {dim, true};
}

struct Block {
  int64_t span, row, rows, keys;  // rows [row, row + rows) of the span; keys: its last row's
};

}  // namespace

struct prefixd_cpu::AttendPlan {
  Attn a;
  Path fns;
  bool q8;
  std::vector<Block> blocks;
  std::vector<std::vector<Task>> lists;            // each thread's tasks
  std::vector<Task> by_size;                       // every task, the largest first
  std::vector<float> split;                        // the cut blocks' partials
  std::vector<std::pair<size_t, int64_t>> splits;  // (block, its offset in split)
  std::vector<std::pair<size_t, int64_t>> joins;   // (split index, row * heads + head) of every cut (row, head)
};

namespace {

using prefixd_cpu::AttendPlan;

// attend's checks, its tasks and their lists: the plan of a call
std::shared_ptr<AttendPlan> plan_attend(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                        const at::Tensor& spans, const at::Tensor& tables, int64_t heads,
                                        int64_t q_stride, at::Tensor& out, c10::string_view path) {
  const auto [dim, q8] = check_pools(k_pool, v_pool, "attend");
  const int64_t page = k_pool.size(1), kv_heads = k_pool.size(2);
  TORCH_CHECK(dim % LANES == 0 && dim <= MAX_CHUNKS * LANES, "attend: head_dim must be a multiple of 16 up to 256, got ", dim);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= MAX_GROUP, "attend: ", heads, " heads over ", kv_heads, " kv heads");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.is_contiguous() && q.dim() == 2 && q.size(1) == dim && q_stride >= heads,
              "attend: q must be contiguous bf16 (rows * q_stride, D)");
  TORCH_CHECK(spans.scalar_type() == at::kLong && spans.is_contiguous() && spans.dim() == 2 && spans.size(1) == 3,
              "attend: spans must be contiguous int64 (S, 3)");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.is_contiguous() && tables.dim() == 2 && tables.size(0) == spans.size(0),
              "attend: tables must be contiguous int32 (S, T)");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(1) == heads * dim,
              "attend: out must be contiguous fp32 (rows, heads * D)");
  if (q8) {
    TORCH_CHECK(path == "auto" || path == "avx512-bf16" || path == "avx512-vnni" || path == "portable",
                "attend: path must be auto, avx512-bf16, avx512-vnni or portable for 8-bit pages");
  } else {
    TORCH_CHECK(path == "auto" || path == "avx512-bf16" || path == "avx512" || path == "portable",
                "attend: path must be auto, avx512-bf16, avx512 or portable");
  }
  const std::string take = path == "auto" ? (q8 ? best_q8_path() : best_path()) : std::string(path);
  TORCH_CHECK(take != "avx512" || have_avx512(), "attend: this CPU has no AVX-512");
  TORCH_CHECK(take != "avx512-bf16" || have_avx512_bf16(), "attend: this CPU has no AVX-512 BF16");
  TORCH_CHECK((take != "avx512-vnni" && !(q8 && take == "avx512-bf16")) || have_avx512_vnni(),
              "attend: this CPU has no AVX-512 VNNI");

  const int64_t s_count = spans.size(0), table_len = tables.size(1), q_rows = q.size(0) / q_stride;
  const int64_t* sp = spans.const_data_ptr<int64_t>();
  const int32_t* tb = tables.const_data_ptr<int32_t>();
  const int64_t pages = k_pool.size(0);
  auto plan = std::make_shared<AttendPlan>();
  std::vector<Block>& blocks = plan->blocks;
  for (int64_t s = 0; s < s_count; ++s) {
    const int64_t row = sp[s * 3], start = sp[s * 3 + 1], length = sp[s * 3 + 2];
    TORCH_CHECK(row >= 0 && start >= 0 && length >= 0 && row + length <= std::min(q_rows, out.size(0)), "attend: span ", s, " out of range");
    TORCH_CHECK(start + length <= table_len * page, "attend: span ", s, "'s page table cannot hold row ", start + length - 1);
    for (int64_t i = 0; i < (start + length + page - 1) / page; ++i)
      TORCH_CHECK(tb[s * table_len + i] >= 0 && tb[s * table_len + i] < pages, "attend: span ", s, " names page ", tb[s * table_len + i]);
    for (int64_t i = 0; i < length; i += ROW_BLOCK) {
      const int64_t rows = std::min<int64_t>(ROW_BLOCK, length - i);
      blocks.push_back({s, i, rows, start + i + rows});
    }
  }
  // A task is a block of up to ROW_BLOCK consecutive rows of a lane (they share each read of a
  // key), a range of its q heads and a range of its key chunks. With at least two blocks a
  // thread, a task is a whole block: all heads (a pool row's kv heads lie side by side, so the
  // task reads whole rows, which the caches fetch well) and all chunks. With fewer blocks but
  // at least two chunks a thread (a lone lane's long context), each block's chunks are cut into
  // ranges of about a task's share of the call's work, all heads: each thread reads its share
  // of the rows, whole. Else each block's heads are cut into near-equal ranges, all chunks, so
  // that there are two tasks a thread (a lone lane's 9 heads on 2 threads: 5 and 4 per thread).
  // The arithmetic of a (row, head) is the same in any task: a task only shares reads, and the
  // chunks of a block whose chunks were cut are joined after all tasks.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads()), want = 2 * threads, rec = dim + 2;
  int64_t total_chunks = 0, work = 0;
  for (const Block& b : blocks) {
    total_chunks += chunks_of(b.keys);
    work += b.keys * b.rows;
  }
  std::vector<Task> tasks;
  std::vector<float>& split = plan->split;
  std::vector<std::pair<size_t, int64_t>>& splits = plan->splits;
  if (static_cast<int64_t>(blocks.size()) >= want) {
    for (const Block& b : blocks) tasks.push_back({b.span, b.row, b.rows, 0, heads, 0, chunks_of(b.keys), -1});
  } else if (total_chunks >= want) {
    const int64_t share = (work + want - 1) / want;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (size_t i = 0; i < blocks.size(); ++i) {
      const Block& b = blocks[i];
      const int64_t chunks = chunks_of(b.keys);
      ranges.clear();
      for (int64_t c = 0, from = 0, acc = 0; c < chunks; ++c) {
        acc += std::min(KEY_CHUNK, b.keys - c * KEY_CHUNK) * b.rows;
        if (acc >= share || c == chunks - 1) {
          ranges.emplace_back(from, c + 1);
          from = c + 1;
          acc = 0;
        }
      }
      int64_t at = -1;
      if (ranges.size() > 1) {
        at = static_cast<int64_t>(split.size());
        splits.emplace_back(i, at);
        split.resize(split.size() + b.rows * heads * chunks * rec);
      }
      for (const auto& [from, to_chunk] : ranges) tasks.push_back({b.span, b.row, b.rows, 0, heads, from, to_chunk, at});
    }
  } else {
    const int64_t parts = blocks.empty() ? 1 : std::min<int64_t>(heads, (want + blocks.size() - 1) / blocks.size());
    for (const Block& b : blocks)
      for (int64_t j = 0; j < parts; ++j)
        tasks.push_back({b.span, b.row, b.rows, j * heads / parts, (j + 1) * heads / parts, 0, chunks_of(b.keys), -1});
  }
  // Each thread a list of tasks, the largest first to the least loaded (a task's work: its last
  // row's keys in its chunks, times its rows and heads), so that the lists are near-equal work.
  std::vector<std::pair<int64_t, size_t>> by_work;  // (-work, task)
  for (size_t i = 0; i < tasks.size(); ++i) {
    const Task& t = tasks[i];
    const int64_t last = sp[t.span * 3 + 1] + t.row + t.rows;  // the task's last row's keys
    const int64_t keys = std::min(last, t.chunk_to * KEY_CHUNK) - t.chunk_from * KEY_CHUNK;
    by_work.emplace_back(-keys * t.rows * (t.head_to - t.head_from), i);
  }
  std::sort(by_work.begin(), by_work.end());
  std::vector<std::vector<Task>>& lists = plan->lists;
  lists.resize(tasks.empty() ? 0 : static_cast<size_t>(std::min<int64_t>(threads, tasks.size())));
  std::vector<int64_t> load(lists.size(), 0);
  for (const auto& [neg, i] : by_work) plan->by_size.push_back(tasks[i]);
  for (const auto& [neg, i] : by_work) {
    const size_t least = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    lists[least].push_back(tasks[i]);
    load[least] -= neg;
  }

  Attn a{reinterpret_cast<const uint16_t*>(q.const_data_ptr<at::BFloat16>()),
         q8 ? nullptr : reinterpret_cast<const uint16_t*>(k_pool.const_data_ptr<at::BFloat16>()),
         q8 ? nullptr : reinterpret_cast<const uint16_t*>(v_pool.const_data_ptr<at::BFloat16>()),
         sp, tb, out.mutable_data_ptr<float>(), q_stride, heads, kv_heads, dim, page, table_len};
  if (page > 0 && (page & (page - 1)) == 0) a.page_shift = __builtin_ctzll(static_cast<unsigned long long>(page));
  Path fns{&chunk_portable, &combine_portable};
  if (q8) {
    a.k8 = k_pool.const_data_ptr<uint8_t>();
    a.v8 = v_pool.const_data_ptr<uint8_t>();
    a.page_bytes = page * kv_heads * (dim + dim / 8);
    fns.chunk = &chunk_q8_portable;
  }
#ifdef PREFIXD_X86
  if (q8 && take != "portable") {
    if (const Path p = q8_path(dim, take == "avx512-bf16"); p.chunk != nullptr) fns = p;
  } else if (!q8 && take != "portable") {
    const Path p = avx512_path(dim / LANES, take == "avx512-bf16");
    if (p.chunk != nullptr) fns = p;
  }
#endif
  plan->a = a;
  plan->fns = fns;
  plan->q8 = q8;
  for (size_t j = 0; j < splits.size(); ++j)
    for (int64_t p = 0; p < blocks[splits[j].first].rows * heads; ++p) plan->joins.emplace_back(j, p);
  return plan;
}

// the plan's call pointed at the pools at k and v
Attn attn_at(const AttendPlan& plan, const void* k, const void* v) {
  Attn a = plan.a;
  if (plan.q8) {
    a.k8 = static_cast<const uint8_t*>(k);
    a.v8 = static_cast<const uint8_t*>(v);
  } else {
    a.k = static_cast<const uint16_t*>(k);
    a.v = static_cast<const uint16_t*>(v);
  }
  return a;
}

// list i's tasks, against the pools at k and v
void run_list(AttendPlan& plan, int64_t i, const void* k, const void* v, std::vector<float>& scratch,
              std::vector<float>& local) {
  const Attn a = attn_at(plan, k, v);
  for (const Task& t : plan.lists[i]) run_task(a, t, plan.fns, plan.split.data(), scratch, local);
}

// the cut blocks' (row, head) pairs [begin, end) of `joins`: their chunks joined in order
void run_joins(const AttendPlan& plan, int64_t begin, int64_t end) {
  const Attn& a = plan.a;
  const int64_t rec = a.dim + 2;
  for (int64_t j = begin; j < end; ++j) {
    const auto [at_split, pair] = plan.joins[j];
    const auto& [i, offset] = plan.splits[at_split];
    const Block& b = plan.blocks[i];
    const int64_t r = pair / a.heads, h = pair % a.heads;
    const int64_t chunks = chunks_of(b.keys);
    const int64_t own = chunks_of(a.spans[b.span * 3 + 1] + b.row + r + 1);
    plan.fns.combine(plan.split.data() + offset + (r * a.heads + h) * chunks * rec, rec, own, a.dim,
                     a.out + ((a.spans[b.span * 3] + b.row + r) * a.heads + h) * a.dim);
  }
}

void attend(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& spans,
            const at::Tensor& tables, int64_t heads, int64_t q_stride, at::Tensor& out, c10::string_view path) {
  const std::shared_ptr<AttendPlan> plan = plan_attend(q, k_pool, v_pool, spans, tables, heads, q_stride, out, path);
  const void* k = k_pool.const_data_ptr();
  const void* v = v_pool.const_data_ptr();
  at::parallel_for(0, static_cast<int64_t>(plan->lists.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch, local;
    for (int64_t i = begin; i < end; ++i) run_list(*plan, i, k, v, scratch, local);
  });
  run_joins(*plan, 0, static_cast<int64_t>(plan->joins.size()));
}

// x, or +0 where |x| is below 2^-30 (exponent field under 127 - 30: zeros and subnormals too)
inline at::BFloat16 flush_tiny(at::BFloat16 x) { return ((x.x >> 7) & 0xff) < 97 ? at::BFloat16(0.f) : x; }

// One layer's rope and K/V write for mode int4, with the bits of the torch ops it replaces
// (model.rope_qk_into with scaled tables, then KVPool.write) but for two things: a q or k value
// of magnitude below 2^-30 becomes +0 (zeros too) (what `attend` needs of its inputs), and the K
// rows go to the pool in its K page layout. For every row r and q or k head j,
//   qk[r, j, i] = flush(bf16(fp32(x[i] * cos[r, j, i]) + fp32(x[i'] * sin[r, j, i])))   (each op rounded)
// where x is the head's slice of qkv and i' = i + D/2 for i < D/2, else i - D/2; then for rows
// r < n the k heads go to the pool at slots[r] as they are and the v heads as bf16(v).
}  // namespace

struct prefixd_cpu::RopeKv {  // rope_kv's inputs, checked
  const float* x;
  const float* cos;
  const float* sin;
  at::BFloat16* out;
  const int64_t* slots;
  int64_t n, rows, width, dim, heads, kv_heads, page_size;
  bool q8;
};

namespace {

using prefixd_cpu::RopeKv;

std::shared_ptr<RopeKv> plan_rope_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& qk,
                                     at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(), "rope_kv: qkv must be contiguous fp32 (R, N)");
  const auto [dim, q8] = check_pools(k_pool, v_pool, "rope_kv");
  const int64_t rows = qkv.size(0), kv_heads = k_pool.size(2), qk_heads = heads + kv_heads;
  const int64_t page_size = k_pool.size(1), slots_n = k_pool.size(0) * page_size;
  TORCH_CHECK(dim % 2 == 0 && qkv.size(1) == (qk_heads + kv_heads) * dim, "rope_kv: qkv's width is not (", qk_heads,
              " + ", kv_heads, ") * ", dim);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 3 && cos.size(0) == rows &&
                  cos.size(1) == qk_heads && cos.size(2) == dim,
              "rope_kv: cos and sin must be contiguous fp32 (R, heads + kv_heads, D)");
  TORCH_CHECK(qk.scalar_type() == at::kBFloat16 && qk.is_contiguous() && qk.dim() == 3 && qk.size(0) >= rows &&
                  qk.size(1) == qk_heads && qk.size(2) == dim,
              "rope_kv: qk must be contiguous bf16 (>= R, heads + kv_heads, D)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1 && slots.size(0) <= rows,
              "rope_kv: slots must be contiguous int64 (n <= R)");
  const int64_t n = slots.size(0), width = qkv.size(1);
  const int64_t* sl = slots.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(sl[r] >= 0 && sl[r] < slots_n, "rope_kv: slot ", sl[r], " outside the pool");
  auto r = std::make_shared<RopeKv>();
  *r = {qkv.const_data_ptr<float>(), cos.const_data_ptr<float>(), sin.const_data_ptr<float>(),
        qk.mutable_data_ptr<at::BFloat16>(), sl, n, rows, width, dim, heads, kv_heads, page_size, q8};
  return r;
}

// Rows [begin, end) of the plan: their q and k heads, and the K/V rows of those below n into
// the pools at k_pool and v_pool (a layer's, of the planned shape).
void rope_rows(const RopeKv& p, void* k_pool, void* v_pool, int64_t begin, int64_t end) {
  const float* x = p.x;
  const float* cs = p.cos;
  const float* sn = p.sin;
  at::BFloat16* out = p.out;
  const int64_t* sl = p.slots;
  const int64_t n = p.n, width = p.width, dim = p.dim, half = dim / 2, heads = p.heads, kv_heads = p.kv_heads;
  const int64_t qk_heads = heads + kv_heads, page_size = p.page_size;
  const bool q8 = p.q8;
  at::BFloat16* kp = q8 ? nullptr : static_cast<at::BFloat16*>(k_pool);
  at::BFloat16* vp = q8 ? nullptr : static_cast<at::BFloat16*>(v_pool);
  uint8_t* kp8 = q8 ? static_cast<uint8_t*>(k_pool) : nullptr;
  uint8_t* vp8 = q8 ? static_cast<uint8_t*>(v_pool) : nullptr;
  const int64_t page_bytes = page_size * kv_heads * (dim + dim / 8), codes_bytes = page_size * kv_heads * dim;
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t j = 0; j < qk_heads; ++j) {
        const float* xh = x + r * width + j * dim;
        const float* c = cs + (r * qk_heads + j) * dim;
        const float* s = sn + (r * qk_heads + j) * dim;
        at::BFloat16* o = out + (r * qk_heads + j) * dim;
        for (int64_t i = 0; i < dim; ++i) {
          const float a = xh[i] * c[i];
          const float b = xh[i < half ? i + half : i - half] * s[i];
          o[i] = flush_tiny(at::BFloat16(a + b));
        }
      }
      if (r < n && q8) {  // 8-bit pages: K from its bf16 values, V from its fp32 ones, in blocks of 32
        const int64_t page = sl[r] / page_size, off = sl[r] % page_size;
        float* k_scales = reinterpret_cast<float*>(kp8 + page * page_bytes + codes_bytes);
        float* v_scales = reinterpret_cast<float*>(vp8 + page * page_bytes + codes_bytes);
        for (int64_t g = 0; g < kv_heads; ++g) {
          float kx[MAX_CHUNKS * LANES];
          int8_t codes[MAX_CHUNKS * LANES];
          const at::BFloat16* kh = out + (r * qk_heads + heads + g) * dim;
          for (int64_t i = 0; i < dim; ++i) kx[i] = static_cast<float>(kh[i]);
          for (int64_t b = 0; b < dim / QBLOCK; ++b)
            k_scales[(g * (dim / QBLOCK) + b) * page_size + off] = quantize_block(kx + b * QBLOCK, codes + b * QBLOCK);
          for (int64_t i = 0; i < dim; ++i)  // the K quad layout, unsigned
            kp8[page * page_bytes + ((g * (dim / 4) + i / 4) * page_size + off) * 4 + i % 4] =
                static_cast<uint8_t>(codes[i] + 128);
          const float* v = x + r * width + (qk_heads + g) * dim;
          for (int64_t b = 0; b < dim / QBLOCK; ++b)
            v_scales[(g * (dim / QBLOCK) + b) * page_size + off] = quantize_block(v + b * QBLOCK, codes + b * QBLOCK);
          std::memcpy(vp8 + page * page_bytes + (off * kv_heads + g) * dim, codes, dim);
        }
      } else if (r < n) {
        const int64_t page = sl[r] / page_size, off = sl[r] % page_size;
        for (int64_t g = 0; g < kv_heads; ++g)
          for (int64_t i = 0; i < half; ++i)  // the K page layout of `attend`: dims 2i, 2i + 1 together
            std::memcpy(kp + page * page_size * kv_heads * dim + ((g * half + i) * page_size + off) * 2,
                        out + (r * qk_heads + heads + g) * dim + 2 * i, 2 * sizeof(at::BFloat16));
        const float* v = x + r * width + qk_heads * dim;
        at::BFloat16* vo = vp + sl[r] * kv_heads * dim;
        for (int64_t i = 0; i < kv_heads * dim; ++i) vo[i] = at::BFloat16(v[i]);
      }
    }
}

void rope_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& qk, at::Tensor& k_pool,
             at::Tensor& v_pool, const at::Tensor& slots, int64_t heads) {
  const std::shared_ptr<RopeKv> plan = plan_rope_kv(qkv, cos, sin, qk, k_pool, v_pool, slots, heads);
  void* k = k_pool.mutable_data_ptr();
  void* v = v_pool.mutable_data_ptr();
  at::parallel_for(0, plan->rows, 16, [&](int64_t begin, int64_t end) { rope_rows(*plan, k, v, begin, end); });
}

}  // namespace

namespace prefixd_cpu {

std::shared_ptr<AttendPlan> attend_plan(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                        const at::Tensor& spans, const at::Tensor& tables, int64_t heads,
                                        int64_t q_stride, at::Tensor& out, c10::string_view path) {
  return plan_attend(q, k_pool, v_pool, spans, tables, heads, q_stride, out, path);
}

int64_t attend_tasks(const AttendPlan& plan) { return static_cast<int64_t>(plan.by_size.size()); }

int64_t attend_joins(const AttendPlan& plan) { return static_cast<int64_t>(plan.joins.size()); }

void attend_task(AttendPlan& plan, int64_t i, const void* k, const void* v, std::vector<float>& scratch,
                 std::vector<float>& local) {
  run_task(attn_at(plan, k, v), plan.by_size[i], plan.fns, plan.split.data(), scratch, local);
}

void attend_join(const AttendPlan& plan, int64_t begin, int64_t end) { run_joins(plan, begin, end); }

std::shared_ptr<RopeKv> rope_kv_plan(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                     at::Tensor& qk, at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots,
                                     int64_t heads) {
  return plan_rope_kv(qkv, cos, sin, qk, k_pool, v_pool, slots, heads);
}

void rope_kv_rows(const RopeKv& r, void* k_pool, void* v_pool, int64_t begin, int64_t end) {
  rope_rows(r, k_pool, v_pool, begin, end);
}

}  // namespace prefixd_cpu

TORCH_LIBRARY_FRAGMENT(prefixd, m) {
  m.def("attend(Tensor q, Tensor k_pool, Tensor v_pool, Tensor spans, Tensor tables, int heads, int q_stride, "
        "Tensor(a!) out, str path='auto') -> ()");
  m.def("rope_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) qk, Tensor(b!) k_pool, Tensor(c!) v_pool, "
        "Tensor slots, int heads) -> ()");
  m.def("attention_isa() -> str", [] { return best_path(); });
  m.def("attention_q8_isa() -> str", [] { return best_q8_path(); });
}

TORCH_LIBRARY_IMPL(prefixd, CPU, m) {
  m.impl("attend", &attend);
  m.impl("rope_kv", &rope_kv);
}
