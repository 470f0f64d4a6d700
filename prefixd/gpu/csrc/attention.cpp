// prefixd's CPU paged attention for mode "int4": every query row attends keys 0..p of its own
// lane, read in place from the KV pool through the lane's page table (no gather), each row on
// its own: a row's bits depend on its q, its position and its lane's keys and values only, not
// on the other rows, lanes or threads of the call, nor on the instruction set (the AVX-512 path
// and the portable one run the same operations; tests/gpu/test_cpu_attention.py compares them).
//
// For a row at position p, q head h (pre-scaled) and its kv head g = h / (heads / kv_heads),
// with D = 16 * C (q, k, v read from bf16 exactly):
//   score s_t, t = 0..p:  lane i < 16: P_i = q[i] * k_t[i], then P_i = fma(q[16c + i], k_t[16c + i], P_i)
//                         for c = 1..C-1; s_t = ((P_j + P_j+8) over j < 8, then + 4, + 2, + 1 halvings)
//   m = max_t s_t (NaN when some s_t is NaN)
//   e_t = exp(s_t - m), the fixed polynomial `exp_fixed` (0 below -87)
//   l: lane i < 16 sums e_t for t = i (mod 16) in order, then the same halvings
//   o[d] = fma(e_t, v_t[d], o[d]) for t = 0..p in order, from 0;  out[d] = o[d] / l.
//
// Inputs: q ((R + 1) * q_stride, D) bf16, round row r's head h at r * q_stride + h; k, v pools
// (pages, P, kv_heads, D) bf16; spans (S, 3) int64: (first row, first position, rows) per lane;
// tables (S, T) int32: each lane's pages; out (R + 1, heads * D) fp32, rows of the spans written.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

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
constexpr int ROW_BLOCK = 4;    // consecutive rows of a lane in one task

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
  const uint16_t* k;
  const uint16_t* v;
  const int64_t* spans;
  const int32_t* tables;
  float* out;
  int64_t q_stride, heads, kv_heads, dim, page, table_len;
};

using RowFn = void (*)(const Attn&, const struct Task&, std::vector<float>&);

struct Task {
  int64_t span, row, rows, head_from, head_to;  // rows [row, row + rows) of the span; q heads
                                                // [head_from, head_to), kv heads h / group
};

inline const uint16_t* key_row(const Attn& a, const int32_t* table, int64_t t, int64_t kv) {
  return a.k + ((static_cast<int64_t>(table[t / a.page]) * a.page + t % a.page) * a.kv_heads + kv) * a.dim;
}

inline const uint16_t* value_row(const Attn& a, const int32_t* table, int64_t t, int64_t kv) {
  return a.v + ((static_cast<int64_t>(table[t / a.page]) * a.page + t % a.page) * a.kv_heads + kv) * a.dim;
}

// ---- portable path -----------------------------------------------------------------------------

void row_portable(const Attn& a, const Task& task, int64_t row, std::vector<float>& scores) {
  const int64_t* sp = a.spans + task.span * 3;
  const int64_t r = sp[0] + row, pos = sp[1] + row, n = pos + 1;
  const int32_t* table = a.tables + task.span * a.table_len;
  const int64_t group = a.heads / a.kv_heads, chunks = a.dim / LANES;
  scores.resize(n);
  for (int64_t h = task.head_from; h < task.head_to; ++h) {
    const int64_t kv = h / group;
    const uint16_t* q = a.q + (r * a.q_stride + h) * a.dim;
    float* s = scores.data();
    bool nan = false;
    for (int64_t t = 0; t < n; ++t) {
      const uint16_t* k = key_row(a, table, t, kv);
      float lane[LANES];
      for (int i = 0; i < LANES; ++i) lane[i] = bf16f(q[i]) * bf16f(k[i]);
      for (int64_t c = 1; c < chunks; ++c)
        for (int i = 0; i < LANES; ++i) lane[i] = std::fma(bf16f(q[c * LANES + i]), bf16f(k[c * LANES + i]), lane[i]);
      s[t] = halve16(lane);
      nan = nan || std::isnan(s[t]);
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
    if (nan) m = std::numeric_limits<float>::quiet_NaN();
    float l[LANES] = {};
    float o[MAX_CHUNKS * LANES] = {};
    for (int64_t t = 0; t < n; ++t) {
      const float e = exp_fixed(s[t] - m);
      l[t % LANES] = l[t % LANES] + e;
      const uint16_t* v = value_row(a, table, t, kv);
      for (int64_t d = 0; d < a.dim; ++d) o[d] = std::fma(e, bf16f(v[d]), o[d]);
    }
    const float sum = halve16(l);
    float* out = a.out + r * a.heads * a.dim + h * a.dim;
    for (int64_t d = 0; d < a.dim; ++d) out[d] = o[d] / sum;
  }
}

void rows_portable(const Attn& a, const Task& task, std::vector<float>& scores) {
  for (int64_t i = 0; i < task.rows; ++i) row_portable(a, task, task.row + i, scores);
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

// The scores of 16 keys from their 16 lane partial vectors: for each key the halvings of
// `halve16` (lanes j + j+8, then + 4, + 2, + 1), four keys' worth per shuffle.
PREFIXD_AVX512 inline __m512 halve16_keys(const __m512* part /* 16 keys' lane vectors */) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = part[2 * i], b = part[2 * i + 1];
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // z holds key 4e + m at lane 4m + e
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, z);
}

template <int C>
PREFIXD_AVX512 void rows_avx512(const Attn& a, const Task& task, std::vector<float>& scratch) {
  const int64_t* sp = a.spans + task.span * 3;
  const int64_t r0 = sp[0] + task.row, pos0 = sp[1] + task.row, rows = task.rows;
  const int32_t* table = a.tables + task.span * a.table_len;
  const int64_t group = a.heads / a.kv_heads, h0 = task.head_from, hn = task.head_to - h0;
  const int64_t kv0 = h0 / group, kvn = (task.head_to - 1) / group - kv0 + 1;  // the kv heads read
  const int64_t rh = rows * hn;  // (row, head) pairs, row-major
  const int64_t keys = pos0 + rows;  // the last row's keys; earlier rows use a prefix
  const int64_t padded = (keys + LANES - 1) / LANES * LANES;
  const int64_t d = a.dim;
  // scratch: q (rh, D) | exponent sums (rh, 16) | scores (rh, padded) | a block's keys, then its
  // values (kvn, 16, D) | the pairs' value sums (rh, D)
  const int64_t block = LANES * d;  // one kv head's keys or values of a block, widened
  scratch.resize(rh * d + rh * LANES + rh * padded + kvn * block + rh * d + LANES);
  float* qf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  float* sums = qf + rh * d;
  float* scores = sums + rh * LANES;
  float* vbuf = scores + rh * padded;  // (kvn, 16 keys, D), aligned: rh * padded and D are multiples of 16
  float* obuf = vbuf + kvn * block;     // (rh, D)
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < hn; ++j) {
      const uint16_t* q = a.q + ((r0 + i) * a.q_stride + h0 + j) * d;
      for (int c = 0; c < C; ++c) _mm512_store_ps(qf + (i * hn + j) * d + c * LANES, load_bf16(q + c * LANES));
    }
  // scores of every (row, head) pair from one read of each key: a block of 16 keys is widened
  // to fp32 once (the task's kv heads of a pool row lie side by side: one contiguous read), then
  // each pair's 16 lane vectors stay in registers through their halvings. A row's scores past
  // its own position (up to the block's end) are computed and never used.
  float* kbuf = vbuf;  // (kvn, 16 keys, D), free until the values are read
  for (int64_t tb = 0; tb < padded; tb += LANES) {
    const int64_t live = std::min<int64_t>(LANES, keys - tb);
    for (int64_t k = 0; k < LANES; ++k) {
      if (k >= live) {
        for (int64_t g = 0; g < kvn; ++g)
          for (int c = 0; c < C; ++c) _mm512_store_ps(kbuf + g * block + k * d + c * LANES, _mm512_setzero_ps());
        continue;
      }
      const uint16_t* kr = key_row(a, table, tb + k, kv0);
      for (int64_t g = 0; g < kvn; ++g)
        for (int c = 0; c < C; ++c) _mm512_store_ps(kbuf + g * block + k * d + c * LANES, load_bf16(kr + g * d + c * LANES));
    }
    for (int64_t p = 0; p < rh; ++p) {
      const float* q = qf + p * d;
      const float* kb = kbuf + ((h0 + p % hn) / group - kv0) * block;
      __m512 qc[C];
      for (int c = 0; c < C; ++c) qc[c] = _mm512_load_ps(q + c * LANES);
      __m512 acc[LANES];
#pragma GCC unroll 16
      for (int k = 0; k < LANES; ++k) {
        const float* kk = kb + k * d;
        acc[k] = _mm512_mul_ps(qc[0], _mm512_load_ps(kk));
        for (int c = 1; c < C; ++c) acc[k] = _mm512_fmadd_ps(qc[c], _mm512_load_ps(kk + c * LANES), acc[k]);
      }
      _mm512_storeu_ps(scores + p * padded + tb, halve16_keys(acc));
    }
  }
  for (int64_t p = 0; p < rh; ++p) {
    const int64_t n = pos0 + p / hn + 1;
    float* s = scores + p * padded;
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __mmask16 nan = 0;
    for (int64_t t = 0; t < n; t += LANES) {
      const __mmask16 live = n - t >= LANES ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - t)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(live, s + t);
      nan |= _mm512_mask_cmp_ps_mask(live, x, x, _CMP_UNORD_Q);
      mv = _mm512_mask_max_ps(mv, live, mv, x);
    }
    const float m = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(mv);
    __m512 l = _mm512_setzero_ps();
    const __m512 mm = _mm512_set1_ps(m);
    for (int64_t t = 0; t < n; t += LANES) {
      const __mmask16 live = n - t >= LANES ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - t)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(live, exp_fixed(_mm512_sub_ps(_mm512_loadu_ps(s + t), mm)));
      l = _mm512_add_ps(l, e);
      _mm512_storeu_ps(s + t, e);
    }
    sums[p] = halve16(l);
  }
  // o = sum e_t v_t per (row, head). Values are read once per block of 16 keys for every pair of
  // the task, two bf16 at a time: a 32-bit word's low half (shifted up) and its high half (masked)
  // are both exact, so a pair of chunks holds dims 32c + 2i and 32c + 2i + 1 in lane i; each
  // dim's sum is the same fma chain in key order, and the outputs are put back in dim order.
  constexpr int CP = C / 2;  // chunk pairs read two bf16 at a time; an odd last chunk is read as before
  std::fill(obuf, obuf + rh * d, 0.f);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t tb = 0; tb < keys; tb += LANES) {
    const int64_t live = std::min<int64_t>(LANES, keys - tb);
    for (int64_t k = 0; k < live; ++k) {
      const uint16_t* vr = value_row(a, table, tb + k, kv0);
      for (int64_t g = 0; g < kvn; ++g) {
        const uint16_t* v = vr + g * d;
        float* vk = vbuf + g * block + k * d;
        for (int c = 0; c < CP; ++c) {
          const __m512i w = _mm512_loadu_si512(v + 32 * c);
          _mm512_store_ps(vk + 32 * c, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
          _mm512_store_ps(vk + 32 * c + 16, _mm512_castsi512_ps(_mm512_and_si512(w, high)));
        }
        if (C % 2) _mm512_store_ps(vk + 32 * CP, load_bf16(v + 32 * CP));
      }
    }
    for (int64_t p = 0; p < rh; ++p) {
      const int64_t end = std::min<int64_t>(live, pos0 + p / hn + 1 - tb);  // the row's keys in this block
      if (end <= 0) continue;
      float* op = obuf + p * d;
      const float* e = scores + p * padded + tb;
      const float* vb = vbuf + ((h0 + p % hn) / group - kv0) * block;
      __m512 o[C];
      for (int c = 0; c < C; ++c) o[c] = _mm512_load_ps(op + 16 * c);
      for (int64_t k = 0; k < end; ++k) {
        const __m512 ek = _mm512_set1_ps(e[k]);
        const float* vk = vb + k * d;
        for (int c = 0; c < C; ++c) o[c] = _mm512_fmadd_ps(ek, _mm512_load_ps(vk + 16 * c), o[c]);
      }
      for (int c = 0; c < C; ++c) _mm512_store_ps(op + 16 * c, o[c]);
    }
  }
  const __m512i lo_idx = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi_idx = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int64_t p = 0; p < rh; ++p) {
    const int64_t i = p / hn, j = p % hn;
    const __m512 sum = _mm512_set1_ps(sums[p]);
    const float* op = obuf + p * d;
    float* out = a.out + (r0 + i) * a.heads * d + (h0 + j) * d;
    for (int c = 0; c < CP; ++c) {
      const __m512 even = _mm512_div_ps(_mm512_load_ps(op + 32 * c), sum);
      const __m512 odd = _mm512_div_ps(_mm512_load_ps(op + 32 * c + 16), sum);
      _mm512_storeu_ps(out + 32 * c, _mm512_permutex2var_ps(even, lo_idx, odd));
      _mm512_storeu_ps(out + 32 * c + 16, _mm512_permutex2var_ps(even, hi_idx, odd));
    }
    if (C % 2) _mm512_storeu_ps(out + 32 * CP, _mm512_div_ps(_mm512_load_ps(op + 32 * CP), sum));
  }
}

RowFn avx512_row(int64_t chunks) {
  switch (chunks) {
    case 1: return &rows_avx512<1>;
    case 2: return &rows_avx512<2>;
    case 3: return &rows_avx512<3>;
    case 4: return &rows_avx512<4>;
    case 5: return &rows_avx512<5>;
    case 6: return &rows_avx512<6>;
    case 7: return &rows_avx512<7>;
    case 8: return &rows_avx512<8>;
    case 16: return &rows_avx512<16>;
    default: return nullptr;
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

// The K and V pools both ops read or write: (pages, page_size, kv_heads, D) bf16, contiguous, one shape.
void check_pools(const at::Tensor& k_pool, const at::Tensor& v_pool, const char* op) {
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.scalar_type() == at::kBFloat16 &&
                  v_pool.scalar_type() == at::kBFloat16 && k_pool.is_contiguous() && v_pool.is_contiguous(),
              op, ": k and v pools must be contiguous bf16 (pages, page_size, kv_heads, D) of one shape");
}

void attend(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& spans,
            const at::Tensor& tables, int64_t heads, int64_t q_stride, at::Tensor& out, c10::string_view path) {
  check_pools(k_pool, v_pool, "attend");
  const int64_t page = k_pool.size(1), kv_heads = k_pool.size(2), dim = k_pool.size(3);
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
  TORCH_CHECK(path == "auto" || path == "avx512" || path == "portable", "attend: path must be auto, avx512 or portable");
  const bool vec = path == "avx512" || (path == "auto" && have_avx512());
  TORCH_CHECK(!vec || have_avx512(), "attend: this CPU has no AVX-512");

  const int64_t s_count = spans.size(0), table_len = tables.size(1), q_rows = q.size(0) / q_stride;
  const int64_t* sp = spans.const_data_ptr<int64_t>();
  const int32_t* tb = tables.const_data_ptr<int32_t>();
  const int64_t pages = k_pool.size(0);
  int64_t blocks = 0;
  for (int64_t s = 0; s < s_count; ++s) {
    const int64_t row = sp[s * 3], start = sp[s * 3 + 1], length = sp[s * 3 + 2];
    TORCH_CHECK(row >= 0 && start >= 0 && length >= 0 && row + length <= std::min(q_rows, out.size(0)), "attend: span ", s, " out of range");
    TORCH_CHECK(start + length <= table_len * page, "attend: span ", s, "'s page table cannot hold row ", start + length - 1);
    for (int64_t i = 0; i < (start + length + page - 1) / page; ++i)
      TORCH_CHECK(tb[s * table_len + i] >= 0 && tb[s * table_len + i] < pages, "attend: span ", s, " names page ", tb[s * table_len + i]);
    blocks += (length + ROW_BLOCK - 1) / ROW_BLOCK;
  }
  // A task is a block of up to ROW_BLOCK consecutive rows of a lane (they share each read of a
  // key) and a range of its q heads: all of them while that leaves at least two tasks a thread
  // (a pool row's kv heads lie side by side, so such a task reads whole rows, which the caches
  // fetch well), else each block's heads cut into as many near-equal ranges as give two tasks
  // a thread (a lone lane's 9 heads on 2 threads: 5 and 4 per thread, not 6 and 3 as a task
  // per kv head would). A head's arithmetic is the same in any task; a task only shares reads.
  const int64_t want = 2 * static_cast<int64_t>(at::get_num_threads());
  const int64_t parts = blocks == 0 || blocks >= want ? 1 : std::min<int64_t>(heads, (want + blocks - 1) / blocks);
  std::vector<Task> tasks;
  for (int64_t s = 0; s < s_count; ++s)
    for (int64_t i = 0; i < sp[s * 3 + 2]; i += ROW_BLOCK)
      for (int64_t j = 0; j < parts; ++j)
        tasks.push_back({s, i, std::min<int64_t>(ROW_BLOCK, sp[s * 3 + 2] - i), j * heads / parts, (j + 1) * heads / parts});
  // long rows and short ones alternate, so that the threads' equal shares of tasks are equal work
  std::vector<Task> order(tasks.size());
  for (size_t i = 0, lo = 0, hi = tasks.size(); i < tasks.size(); ++i) order[i] = (i % 2 == 0) ? tasks[lo++] : tasks[--hi];

  Attn a{reinterpret_cast<const uint16_t*>(q.const_data_ptr<at::BFloat16>()),
         reinterpret_cast<const uint16_t*>(k_pool.const_data_ptr<at::BFloat16>()),
         reinterpret_cast<const uint16_t*>(v_pool.const_data_ptr<at::BFloat16>()),
         sp, tb, out.mutable_data_ptr<float>(), q_stride, heads, kv_heads, dim, page, table_len};
#ifdef PREFIXD_X86
  RowFn fn = vec ? avx512_row(dim / LANES) : nullptr;
#else
  RowFn fn = nullptr;
#endif
  if (fn == nullptr) fn = &rows_portable;
  at::parallel_for(0, static_cast<int64_t>(order.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) fn(a, order[i], scores);
  });
}

// One layer's rope and K/V write for mode int4, with the bits of the torch ops it replaces
// (model.rope_qk_into with scaled tables, then KVPool.write): for every row r and q or k head j,
//   qk[r, j, i] = bf16(fp32(x[i] * cos[r, j, i]) + fp32(x[i'] * sin[r, j, i]))   (each op rounded)
// where x is the head's slice of qkv and i' = i + D/2 for i < D/2, else i - D/2; then for rows
// r < n the k heads go to the pool at slots[r] as they are and the v heads as bf16(v).
void rope_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& qk, at::Tensor& k_pool,
             at::Tensor& v_pool, const at::Tensor& slots, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(), "rope_kv: qkv must be contiguous fp32 (R, N)");
  check_pools(k_pool, v_pool, "rope_kv");
  const int64_t rows = qkv.size(0), kv_heads = k_pool.size(2), dim = k_pool.size(3), qk_heads = heads + kv_heads;
  const int64_t slots_n = k_pool.size(0) * k_pool.size(1);
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
  const int64_t n = slots.size(0), width = qkv.size(1), half = dim / 2;
  const int64_t* sl = slots.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(sl[r] >= 0 && sl[r] < slots_n, "rope_kv: slot ", sl[r], " outside the pool");
  const float* x = qkv.const_data_ptr<float>();
  const float* cs = cos.const_data_ptr<float>();
  const float* sn = sin.const_data_ptr<float>();
  at::BFloat16* out = qk.mutable_data_ptr<at::BFloat16>();
  at::BFloat16* kp = k_pool.mutable_data_ptr<at::BFloat16>();
  at::BFloat16* vp = v_pool.mutable_data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t j = 0; j < qk_heads; ++j) {
        const float* xh = x + r * width + j * dim;
        const float* c = cs + (r * qk_heads + j) * dim;
        const float* s = sn + (r * qk_heads + j) * dim;
        at::BFloat16* o = out + (r * qk_heads + j) * dim;
        for (int64_t i = 0; i < dim; ++i) {
          const float a = xh[i] * c[i];
          const float b = xh[i < half ? i + half : i - half] * s[i];
          o[i] = at::BFloat16(a + b);
        }
      }
      if (r < n) {
        std::memcpy(kp + sl[r] * kv_heads * dim, out + (r * qk_heads + heads) * dim, kv_heads * dim * sizeof(at::BFloat16));
        const float* v = x + r * width + qk_heads * dim;
        at::BFloat16* vo = vp + sl[r] * kv_heads * dim;
        for (int64_t i = 0; i < kv_heads * dim; ++i) vo[i] = at::BFloat16(v[i]);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixd, m) {
  m.def("attend(Tensor q, Tensor k_pool, Tensor v_pool, Tensor spans, Tensor tables, int heads, int q_stride, "
        "Tensor(a!) out, str path='auto') -> ()");
  m.def("rope_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) qk, Tensor(b!) k_pool, Tensor(c!) v_pool, "
        "Tensor slots, int heads) -> ()");
  m.def("attention_isa() -> str", [] { return std::string(have_avx512() ? "avx512" : "portable"); });
}

TORCH_LIBRARY_IMPL(prefixd, CPU, m) {
  m.impl("attend", &attend);
  m.impl("rope_kv", &rope_kv);
}
