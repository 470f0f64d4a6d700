// prefixd's CPU product for mode "int4": out (M, N) fp32 = x (M, Kx) @ W.T, with W (N, K) held as
// 4-bit codes q in groups of 32 inputs, an fp16 (or bf16) scale and base per group and output
// (w = q * scale + base), and each row of x quantized to 8 bits per group of 32 inputs inside the
// call. The inner products are exact integer sums; the rest is a fixed sequence of fp32
// operations per output, so a row's bits depend on that row alone: not on the row count, the
// blocking, the thread count or the instruction set that runs it (the AVX-512 VNNI path and the
// portable one give the same bits; tests/gpu/test_int4.py checks both against a torch reference).
//
// x may be bf16 or fp32: only its values count. With `norm_weight`, x's rows are first
// RMS-normalized (`quantize_rows`), the layer's norm and product in one call. Per row m and group j of x (32 inputs, Gx = Kx / 32):
//   amax = max |x[m, 32j + i]|, d[m, j] = amax / 127 (fp32 division; NaN if any x is not finite),
//   xq[m, 32j + i] = nearest-even(x / d) (0 when d is 0), s[m, j] = sum_i xq[m, 32j + i].
// Per output n, for g = 0, 1, ..., K/32 - 1 in order, with j = g mod Gx:
//   dot  = sum_i q[n, 32g + i] * xq[m, 32j + i]           exact, int32
//   acc  = acc + d[m, j] * (float(dot) * scale[g, n] + base[g, n] * float(s[m, j]))
// each * and + one rounded fp32 operation (no fused multiply-add: built with -ffp-contract=off).
// K may be a multiple of Kx: a residual weight holds W's codes, then those of its rounding
// error, and reads x twice. With passes = 2 each row of x is quantized twice: its codes as
// above, then its rounding error, per group r[i] = x[i] - d * xq[i] (one fp32 multiply, one
// subtract; 0 for a group whose d is 0 or not finite), quantized by the same rule into (xq2, d2,
// s2). Each pass is a row of its own to the product (rows 2m and 2m + 1), and out[m] = acc(2m)
// + acc(2m + 1), one fp32 add, made as the second row is stored: about 15 bits of each
// activation for the cost of a second integer product over the weights already loaded (the
// lm_head's call). The codes may also be 8-bit (q in 0..255, the same arithmetic: |dot| < 2^20
// stays exact): the lm_head's format.
//
// Layout (prefixd/gpu/cpu_kernels.py packs it), N padded to NB blocks of 32 outputs:
//   codes  uint8 (NB, G, 4, 2, 64): byte 4*l + b of [nb, g, i, h] holds, for output
//          nb*32 + 16h + l, the code of input 32g + 8i + b in its low nibble and of input
//          32g + 8i + 4 + b in its high nibble (the order VNNI's 4-byte lanes read);
//   8-bit codes uint8 (NB, G, 8, 2, 64): byte 4*l + b of [nb, g, i, h] holds the code of input
//          32g + 4i + b for output nb*32 + 16h + l;
//   scales fp16 or bf16 (NB, G, 2, 32): [nb, g, 0, c] the scale of output nb*32 + c, [.., 1, c]
//          its base; either is widened to fp32 exactly, so only the values count.

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
#include <optional>
#include <string>
#include <vector>

namespace {

using prefixd_cpu::halve16;
#ifdef PREFIXD_X86
using prefixd_cpu::load_bf16;
using prefixd_cpu::load_fp16;
#endif

constexpr int GROUP = 32;
constexpr int BLOCK_N = 32;
constexpr int ROW_TILE = 6;    // rows whose sums stay in registers
constexpr int ROW_CHUNK = 64;  // rows of one task (its activations stay in cache)
static_assert(ROW_CHUNK % 2 == 0 && ROW_TILE % 2 == 0, "a pair's two rows share a task and a tile (`out_row`)");


struct Quantized {  // x's rows, quantized
  const int8_t* xq;   // (M, Kx)
  const float* d;     // (M, Gx)
  const float* sf;    // (M, Gx): the sums of xq, exact in fp32 (|sum| <= 32 * 127)
};

struct Call {
  Quantized x;
  const uint8_t* codes;
  const uint16_t* scales;
  float* out;  // (M, N)
  int64_t M, N, K, Kx;
  int bits;   // of a code: 4 or 8
  bool half;  // scales are fp16 (else bf16)
  bool accumulate = false;  // out += the product (one fp32 add an output), else out = it
  bool paired = false;      // rows 2m, 2m + 1 are a row's two passes: out (M / 2, N) = acc(2m) + acc(2m + 1)
  const prefixd_cpu::RowWatch* watch = nullptr;  // the out rows' finite flags and best picks (the head's call)
};

// Where row m's outputs go, and whether they are added (one fp32 add an output) to what is there:
// when the call accumulates, or m is a pair's second row (a task's rows start at a multiple of
// ROW_CHUNK and its tiles at multiples of ROW_TILE, both even, so a pair's first row is stored
// before its second, by the same thread).
inline float* out_row(const Call& c, int64_t m, bool* add) {
  *add = c.accumulate || (c.paired && (m & 1));
  return c.out + (c.paired ? m >> 1 : m) * c.N;
}

// A float's bits as an unsigned key in the floats' order, both zeros as +0's (they compare
// equal, and the lowest index of the largest value is the pick): for a finite f and g, key(f) <
// key(g) exactly when f < g.
inline uint32_t order_key(uint32_t u) {
  if ((u & 0x7fffffffu) == 0) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// A watched row's outcome for one tile: a non-finite output clears the row's flag (its pick is
// then never read); else the row's best key rises to `top` (the tile's largest output's order
// key) at index `at` (its lowest column).
inline void watch_result(const prefixd_cpu::RowWatch& w, int64_t row, bool bad, uint32_t top, int64_t at) {
  if (bad) {
    __atomic_store_n(w.finite + row, uint8_t{0}, __ATOMIC_RELAXED);
    return;
  }
  if (at < 0) return;  // no column below the limit
  const uint64_t key = (static_cast<uint64_t>(top) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(at));
  uint64_t* best = w.best + row;
  uint64_t seen = __atomic_load_n(best, __ATOMIC_RELAXED);
  while (key > seen && !__atomic_compare_exchange_n(best, &seen, key, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

// Out row m's final outputs o[0, cols) (columns n0 ...) into the call's watch, when it has one
// and m's outputs are final (not a pair's first pass): whether any is an inf or a NaN (read as
// integers: no compiler flag can fold the test away), and the largest below the limit at its
// lowest column. The AVX-512 path has its own (`watch_tile_vnni`), with the same outcome.
inline void watch_tile(const Call& c, const float* o, int64_t m, int64_t n0, int64_t cols) {
  if (c.watch == nullptr || (c.paired && !(m & 1))) return;
  const prefixd_cpu::RowWatch& w = *c.watch;
  const int64_t valid = std::clamp<int64_t>(w.limit - n0, 0, cols);
  uint32_t bad = 0, top = 0;
  for (int64_t i = 0; i < cols; ++i) {
    uint32_t u;
    std::memcpy(&u, o + i, 4);
    bad |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
    if (i < valid) top = std::max(top, order_key(u));
  }
  int64_t at = -1;
  for (int64_t i = 0; i < valid && at < 0; ++i) {
    uint32_t u;
    std::memcpy(&u, o + i, 4);
    if (order_key(u) == top) at = n0 + i;
  }
  watch_result(w, c.paired ? m >> 1 : m, bad != 0, top, at);
}

// A finished tile's rows into out, as they are or added to what out holds; returns where they went.
inline float* store_rows(const Call& c, const float* tile, int64_t m, int64_t n0, int64_t cols) {
  bool add;
  float* o = out_row(c, m, &add) + n0;
  if (!add) {
    std::memcpy(o, tile, cols * sizeof(float));
  } else {
    for (int64_t i = 0; i < cols; ++i) o[i] = o[i] + tile[i];
  }
  return o;
}

inline int64_t group_bytes(int bits) { return bits * 128; }  // 32 outputs x 32 inputs x bits / 8

// ---- the activations ---------------------------------------------------------------------------

inline float value(float v) { return v; }
inline float value(at::BFloat16 v) { return static_cast<float>(v); }  // exact

// With a norm weight, each row is first RMS-normalized in fp32, one operation at a time
// whatever the CPU: ss = sum of x^2 in 16 lanes by index (i mod 16), in order, joined by the
// halvings j + j+8, + 4, + 2, + 1; r = 1 / sqrt(ss / Kx + eps); y = (x * r) * w.

// One group's codes (the rule above); with `passes` = 2, r holds its rounding error.
inline void quantize_group(const float* v, int8_t* q, float* d, float* s, float* r) {
  float amax = 0.f;
  bool finite = true;
  for (int i = 0; i < GROUP; ++i) {
    const float a = std::fabs(v[i]);
    finite = finite && std::isfinite(a);
    amax = std::max(amax, a);
  }
  float dj = amax / 127.f;
  if (!finite) dj = std::numeric_limits<float>::quiet_NaN();  // the group's outputs become NaN
  const bool zero = !finite || dj == 0.f;
  int32_t sum = 0;
  for (int i = 0; i < GROUP; ++i) {
    const int32_t c = zero ? 0 : static_cast<int32_t>(std::nearbyint(v[i] / dj));
    q[i] = static_cast<int8_t>(c);
    sum += c;
    if (r != nullptr) r[i] = zero ? 0.f : v[i] - dj * static_cast<float>(c);
  }
  *d = dj;
  *s = static_cast<float>(sum);
}

// `rows` rows of x into passes * rows quantized rows (xq (passes * rows, kx), d and s
// (passes * rows, kx / 32)): row r's codes at passes * r, its error's at passes * r + 1.
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t kx, const float* norm, float eps, int passes, float* row,
                   int8_t* xq, float* d, float* s) {
  const int64_t gx = kx / GROUP;
  float err[GROUP];
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * kx;
    if (norm != nullptr) {
      float lanes[16] = {};
      for (int64_t i = 0; i < kx; ++i) {
        const float v = value(xr[i]);
        lanes[i % 16] = lanes[i % 16] + v * v;
      }
      const float inv = 1.f / std::sqrt(halve16(lanes) / static_cast<float>(kx) + eps);
      for (int64_t i = 0; i < kx; ++i) row[i] = (value(xr[i]) * inv) * norm[i];
    } else {
      for (int64_t i = 0; i < kx; ++i) row[i] = value(xr[i]);
    }
    const int64_t q0 = passes * r;
    for (int64_t j = 0; j < gx; ++j) {
      quantize_group(row + j * GROUP, xq + q0 * kx + j * GROUP, d + q0 * gx + j, s + q0 * gx + j,
                     passes == 2 ? err : nullptr);
      if (passes == 2)
        quantize_group(err, xq + (q0 + 1) * kx + j * GROUP, d + (q0 + 1) * gx + j, s + (q0 + 1) * gx + j, nullptr);
    }
  }
}

// ---- portable path: the same operations one by one -------------------------------------------

void tile_scalar(const Call& c, int64_t m0, int rows, int64_t nb) {
  const int64_t groups = c.K / GROUP, gx = c.Kx / GROUP;
  const int64_t n0 = nb * BLOCK_N;
  const int cols = static_cast<int>(std::min<int64_t>(BLOCK_N, c.N - n0));
  const auto widen = c.half ? prefixd_cpu::fp16_to_float : prefixd_cpu::bf16_to_float;
  for (int r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    for (int col = 0; col < cols; ++col) {
      const int h = col / 16, l = col % 16;
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t j = g % gx;
        const uint8_t* q = c.codes + (nb * groups + g) * group_bytes(c.bits) + h * 64 + 4 * l;
        const int8_t* a = c.x.xq + m * c.Kx + j * GROUP;
        int32_t dot = 0;
        if (c.bits == 8) {
          for (int i = 0; i < 8; ++i)
            for (int b = 0; b < 4; ++b) dot += static_cast<int32_t>(q[i * 128 + b]) * a[4 * i + b];
        } else {
          for (int i = 0; i < 4; ++i) {
            for (int b = 0; b < 4; ++b) {
              const uint8_t byte = q[i * 128 + b];
              dot += static_cast<int32_t>(byte & 15) * a[8 * i + b] + static_cast<int32_t>(byte >> 4) * a[8 * i + 4 + b];
            }
          }
        }
        const uint16_t* sz = c.scales + (nb * groups + g) * 2 * BLOCK_N;
        const float t = static_cast<float>(dot) * widen(sz[col]);
        const float u = widen(sz[BLOCK_N + col]) * c.x.sf[m * gx + j];
        const float sum = t + u;
        const float step = c.x.d[m * gx + j] * sum;
        acc = acc + step;
      }
      bool add;
      float* o = out_row(c, m, &add) + n0 + col;
      *o = add ? *o + acc : acc;
    }
    bool add;
    watch_tile(c, out_row(c, m, &add) + n0, m, n0, cols);
  }
}

#ifdef PREFIXD_X86
// ---- AVX-512 VNNI path -------------------------------------------------------------------------

#define PREFIXD_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

// With `fetch_next`, the codes and scales of block nb + 1 are prefetched group by group: the
// tasks of a thread run blocks in order, and once the weights outgrow the caches (a model's
// layers do) the next block's lines would otherwise arrive only when it starts. A block's
// first tile of rows fetches, at any row count: a decode row's product (one to three rows) was
// once left to the hardware's stream prefetch, which on a later machine read 10-20 % slower
// than with the hints (docs/runtime.md). A prefetch is a hint (it cannot fault past the end)
// and changes no arithmetic.
template <int R, int BITS>
PREFIXD_VNNI inline void tile_vnni_rows(const Call& c, int64_t m0, int64_t nb, float* out_tile /* (R, 32) */,
                                        bool fetch_next) {
  constexpr int64_t GB = BITS * 128;  // `group_bytes`
  const int64_t groups = c.K / GROUP, gx = c.Kx / GROUP;
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint8_t* q = c.codes + nb * groups * GB;
  const uint16_t* sz = c.scales + nb * groups * 2 * BLOCK_N;
  for (int64_t g = 0; g < groups; ++g, q += GB, sz += 2 * BLOCK_N) {
    const int64_t j = g % gx;
    if (fetch_next) {  // block nb + 1's group g: 8 (4-bit) or 16 lines of codes, 2 of scales
      const char* next_q = reinterpret_cast<const char*>(q + groups * GB);
      const char* next_s = reinterpret_cast<const char*>(sz + groups * 2 * BLOCK_N);
#pragma GCC unroll 16
      for (int l = 0; l < GB / 64; ++l) prefixd_cpu::prefetch_l2(next_q + 64 * l);
      prefixd_cpu::prefetch_l2(next_s);
      prefixd_cpu::prefetch_l2(next_s + 64);
    }
    __m512i dot[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
    if constexpr (BITS == 8) {
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {  // inputs 4i..4i+3 of the group, each output's 4-byte lane
        const __m512i w0 = _mm512_loadu_si512(q + i * 128), w1 = _mm512_loadu_si512(q + i * 128 + 64);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, c.x.xq + (m0 + r) * c.Kx + j * GROUP + 4 * i, 4);
          const __m512i b = _mm512_set1_epi32(four);
          dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, b);
          dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, b);
        }
      }
    } else {
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m512i p0 = _mm512_loadu_si512(q + i * 128);
        const __m512i p1 = _mm512_loadu_si512(q + i * 128 + 64);
        const __m512i w00 = _mm512_and_si512(p0, low4), w01 = _mm512_and_si512(_mm512_srli_epi16(p0, 4), low4);
        const __m512i w10 = _mm512_and_si512(p1, low4), w11 = _mm512_and_si512(_mm512_srli_epi16(p1, 4), low4);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* a = c.x.xq + (m0 + r) * c.Kx + j * GROUP + 8 * i;
          int32_t lo, hi;
          std::memcpy(&lo, a, 4);
          std::memcpy(&hi, a + 4, 4);
          const __m512i b0 = _mm512_set1_epi32(lo), b1 = _mm512_set1_epi32(hi);
          dot[r][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r][0], w00, b0), w01, b1);
          dot[r][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r][1], w10, b0), w11, b1);
        }
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512 scale = c.half ? load_fp16(sz + 16 * h) : load_bf16(sz + 16 * h);
      const __m512 base = c.half ? load_fp16(sz + BLOCK_N + 16 * h) : load_bf16(sz + BLOCK_N + 16 * h);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_set1_ps(c.x.sf[(m0 + r) * gx + j]);
        const __m512 d = _mm512_set1_ps(c.x.d[(m0 + r) * gx + j]);
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][h]), scale);
        const __m512 u = _mm512_mul_ps(base, s);
        acc[r][h] = _mm512_add_ps(acc[r][h], _mm512_mul_ps(d, _mm512_add_ps(t, u)));
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out_tile + r * BLOCK_N, acc[r][0]);
    _mm512_storeu_ps(out_tile + r * BLOCK_N + 16, acc[r][1]);
  }
}

// The activations' quantization (`quantize_rows`) 16 inputs at a time: the same operations on
// each input, the squares summed in the same 16 lanes in the same order, so the same bits
// (the portable path keeps the scalar loop, and the tests compare the two paths).
PREFIXD_VNNI inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
PREFIXD_VNNI inline __m512 load16(const at::BFloat16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }

// One group (v0, v1: its 32 inputs) as `quantize_group`; with r0 and r1, its rounding error.
PREFIXD_VNNI inline void quantize_group_vnni(__m512 v0, __m512 v1, int8_t* q, float* d, float* s, __m512* r0,
                                             __m512* r1) {
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  const __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1);
  const bool finite = (_mm512_cmp_ps_mask(a0, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a1, inf, _CMP_LT_OQ)) == 0xffff;
  float dj = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1)) / 127.f;
  if (!finite) dj = std::numeric_limits<float>::quiet_NaN();  // the group's outputs become NaN
  int32_t sum = 0;
  if (!finite || dj == 0.f) {
    std::memset(q, 0, GROUP);
    if (r0 != nullptr) *r0 = *r1 = _mm512_setzero_ps();
  } else {
    const __m512 dv = _mm512_set1_ps(dj);
    constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512 c0 = _mm512_roundscale_ps(_mm512_div_ps(v0, dv), nearest);
    const __m512 c1 = _mm512_roundscale_ps(_mm512_div_ps(v1, dv), nearest);
    const __m512i q0 = _mm512_cvtps_epi32(c0), q1 = _mm512_cvtps_epi32(c1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
    sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    if (r0 != nullptr) {
      *r0 = _mm512_sub_ps(v0, _mm512_mul_ps(dv, c0));
      *r1 = _mm512_sub_ps(v1, _mm512_mul_ps(dv, c1));
    }
  }
  *d = dj;
  *s = static_cast<float>(sum);
}

template <typename T>
PREFIXD_VNNI void quantize_rows_vnni(const T* x, int64_t rows, int64_t kx, const float* norm, float eps, int passes,
                                     float* row, int8_t* xq, float* d, float* s) {
  const int64_t gx = kx / GROUP;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * kx;
    if (norm != nullptr) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < kx; i += 16) {
        const __m512 v = load16(xr + i);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
      }
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, acc);
      const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(halve16(lanes) / static_cast<float>(kx) + eps));
      for (int64_t i = 0; i < kx; i += 16)
        _mm512_storeu_ps(row + i, _mm512_mul_ps(_mm512_mul_ps(load16(xr + i), inv), _mm512_loadu_ps(norm + i)));
    } else {
      for (int64_t i = 0; i < kx; i += 16) _mm512_storeu_ps(row + i, load16(xr + i));
    }
    const int64_t q0 = passes * r;
    for (int64_t j = 0; j < gx; ++j) {
      const __m512 v0 = _mm512_loadu_ps(row + j * GROUP), v1 = _mm512_loadu_ps(row + j * GROUP + 16);
      if (passes == 2) {
        __m512 r0, r1;
        quantize_group_vnni(v0, v1, xq + q0 * kx + j * GROUP, d + q0 * gx + j, s + q0 * gx + j, &r0, &r1);
        quantize_group_vnni(r0, r1, xq + (q0 + 1) * kx + j * GROUP, d + (q0 + 1) * gx + j, s + (q0 + 1) * gx + j,
                            nullptr, nullptr);
      } else {
        quantize_group_vnni(v0, v1, xq + q0 * kx + j * GROUP, d + q0 * gx + j, s + q0 * gx + j, nullptr, nullptr);
      }
    }
  }
}

// `watch_tile` for a whole block (BLOCK_N = 32 outputs, two vectors), with its outcome: the
// order keys' unsigned maximum, and the first lane holding it.
PREFIXD_VNNI inline void watch_tile_vnni(const Call& c, const float* o, int64_t m, int64_t n0) {
  static_assert(BLOCK_N == 32, "two vectors a block");
  if (c.watch == nullptr || (c.paired && !(m & 1))) return;
  const prefixd_cpu::RowWatch& w = *c.watch;
  const int64_t valid = std::clamp<int64_t>(w.limit - n0, 0, BLOCK_N);
  const __m512i exp = _mm512_set1_epi32(0x7f800000), mag = _mm512_set1_epi32(0x7fffffff);
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u)), ones = _mm512_set1_epi32(-1);
  __m512i key[2];
  bool bad = false;
  for (int h = 0; h < 2; ++h) {
    __m512i u = _mm512_loadu_si512(o + 16 * h);
    bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, exp), exp) != 0;
    u = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(u, mag), u);  // -0 as +0
    const __mmask16 neg = _mm512_test_epi32_mask(u, sign);
    key[h] = _mm512_mask_xor_epi32(_mm512_or_si512(u, sign), neg, u, ones);  // ~u where negative
    const int64_t lanes = std::clamp<int64_t>(valid - 16 * h, 0, 16);
    key[h] = _mm512_maskz_mov_epi32(static_cast<__mmask16>((1u << lanes) - 1), key[h]);  // 0: below every key
  }
  const uint32_t top = static_cast<uint32_t>(_mm512_reduce_max_epu32(_mm512_max_epu32(key[0], key[1])));
  int64_t at = -1;
  if (valid > 0) {
    const __m512i t = _mm512_set1_epi32(static_cast<int>(top));
    const uint32_t hits = _mm512_cmpeq_epi32_mask(key[0], t) | (static_cast<uint32_t>(_mm512_cmpeq_epi32_mask(key[1], t)) << 16);
    at = n0 + __builtin_ctz(hits);
  }
  watch_result(w, c.paired ? m >> 1 : m, bad, top, at);
}

template <int BITS>
PREFIXD_VNNI void tile_vnni(const Call& c, int64_t m0, int rows, int64_t nb) {
  alignas(64) float tile[ROW_TILE * BLOCK_N];
  const int64_t n0 = nb * BLOCK_N;
  const int64_t cols = std::min<int64_t>(BLOCK_N, c.N - n0);
  for (int r = 0; r < rows; r += ROW_TILE) {
    const int n = std::min(ROW_TILE, rows - r);
    const bool fetch = r == 0;
    switch (n) {
      case 6: tile_vnni_rows<6, BITS>(c, m0 + r, nb, tile, fetch); break;
      case 5: tile_vnni_rows<5, BITS>(c, m0 + r, nb, tile, fetch); break;
      case 4: tile_vnni_rows<4, BITS>(c, m0 + r, nb, tile, fetch); break;
      case 3: tile_vnni_rows<3, BITS>(c, m0 + r, nb, tile, fetch); break;
      case 2: tile_vnni_rows<2, BITS>(c, m0 + r, nb, tile, fetch); break;
      default: tile_vnni_rows<1, BITS>(c, m0 + r, nb, tile, fetch); break;
    }
    for (int i = 0; i < n; ++i) {
      const float* o = store_rows(c, tile + i * BLOCK_N, m0 + r + i, n0, cols);
      if (cols == BLOCK_N)
        watch_tile_vnni(c, o, m0 + r + i, n0);
      else
        watch_tile(c, o, m0 + r + i, n0, cols);
    }
  }
}

#endif  // PREFIXD_X86

// ---- the call ----------------------------------------------------------------------------------

bool have_vnni() {
#ifdef PREFIXD_X86
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni");
  return yes;
#else
  return false;  // the portable path only: the same bits
#endif
}

// The checks of a packed weight (codes and scales of n outputs), and its shape for the product.
prefixd_cpu::Int4Weight weight_of(const at::Tensor& codes, const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(codes.dim() == 5 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  (codes.size(2) == 4 || codes.size(2) == 8) && codes.size(3) == 2 && codes.size(4) == 64,
              "int4_mm: codes must be contiguous uint8 (NB, G, 4, 2, 64), or (NB, G, 8, 2, 64) for 8-bit codes");
  const int bits = static_cast<int>(codes.size(2));
  const int64_t nblocks = codes.size(0), groups = codes.size(1);
  TORCH_CHECK(n > 0 && nblocks == (n + BLOCK_N - 1) / BLOCK_N, "int4_mm: codes do not hold ", n, " outputs in blocks of 32");
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scales.scalar_type() == at::kBFloat16) && scales.is_contiguous() && scales.dim() == 4 &&
                  scales.size(0) == nblocks && scales.size(1) == groups && scales.size(2) == 2 && scales.size(3) == BLOCK_N,
              "int4_mm: scales must be contiguous fp16 or bf16 (NB, G, 2, 32)");
  return {codes.const_data_ptr<uint8_t>(), static_cast<const uint16_t*>(scales.const_data_ptr()), n, groups * GROUP,
          nblocks, bits, half};
}

// Rows [begin, end) of x, each quantized on its own into `passes` rows of codes: row r's first
// at xq + passes * r * kx, their groups' d and s at passes * r * kx / 32; `row`: kx floats of scratch.
template <typename T>
void quantize_range(const T* x, int64_t begin, int64_t end, int64_t kx, const float* norm, float eps, int passes,
                    bool vnni, float* row, int8_t* xq, float* d, float* s) {
  const int64_t gx = kx / GROUP;
  x += begin * kx;
  xq += begin * passes * kx;
  d += begin * passes * gx;
  s += begin * passes * gx;
#ifdef PREFIXD_X86
  if (vnni) return quantize_rows_vnni(x, end - begin, kx, norm, eps, passes, row, xq, d, s);
#endif
  quantize_rows(x, end - begin, kx, norm, eps, passes, row, xq, d, s);
}

// The product's tasks [begin, end): task t is rows [64 (t / NB), +64) of output block t % NB.
void tiles(const Call& c, bool vnni, int64_t begin, int64_t end) {
  const int64_t nblocks = (c.N + BLOCK_N - 1) / BLOCK_N;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t chunk = t / nblocks, nb = t % nblocks;
    const int64_t m0 = chunk * ROW_CHUNK;
    const int rows = static_cast<int>(std::min<int64_t>(ROW_CHUNK, c.M - m0));
#ifdef PREFIXD_X86
    if (vnni && c.bits == 8) tile_vnni<8>(c, m0, rows, nb);
    else if (vnni) tile_vnni<4>(c, m0, rows, nb);
    else tile_scalar(c, m0, rows, nb);
#else
    (void)vnni;
    tile_scalar(c, m0, rows, nb);
#endif
  }
}

// "vnni", "portable" or "auto" (the best this CPU has); the tests run both paths
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n, c10::string_view path,
                   const std::optional<at::Tensor>& norm_weight, double eps, int64_t passes,
                   const std::optional<at::Tensor>& finite, const std::optional<at::Tensor>& best, int64_t limit) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && x.device().is_cpu(),
              "int4_mm: x must be a 2-D CPU bf16 or fp32 tensor");
  const prefixd_cpu::Int4Weight w = weight_of(codes, scales, n);
  const int64_t k = w.k;
  const int64_t m = x.size(0), kx = x.size(1);
  TORCH_CHECK(kx > 0 && kx % GROUP == 0 && k % kx == 0, "int4_mm: x's width ", kx, " does not divide the weight's ", k);
  TORCH_CHECK(path == "auto" || path == "vnni" || path == "portable", "int4_mm: path must be auto, vnni or portable");
  const float* norm = nullptr;
  at::Tensor norm_c;
  if (norm_weight.has_value()) {
    norm_c = norm_weight->contiguous();
    TORCH_CHECK(norm_c.scalar_type() == at::kFloat && norm_c.dim() == 1 && norm_c.size(0) == kx && k == kx,
                "int4_mm: norm_weight must be fp32 (Kx,) and the weight not residual");
    norm = norm_c.const_data_ptr<float>();
  }
  TORCH_CHECK(passes == 1 || passes == 2, "int4_mm: passes must be 1 or 2, not ", passes);
  const bool vnni = path == "vnni" || (path == "auto" && have_vnni());
  TORCH_CHECK(!vnni || have_vnni(), "int4_mm: this CPU has no AVX-512 VNNI");

  // the out rows' watch, as the head's call keeps it: for the tests of both paths
  const std::optional<prefixd_cpu::RowWatch> watch = prefixd_cpu::row_watch(finite, best, m, n, limit, "int4_mm");
  if (m == 0) return at::empty({m, n}, x.options().dtype(at::kFloat));
  const at::Tensor xc = x.contiguous();
  const int64_t gx = kx / GROUP, rows_q = passes * m;  // the product's rows: one per pass of each row of x
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  // the rows' codes (rows_q, kx) int8 and their groups' d and s (rows_q, gx) fp32, in the calling
  // thread's buffer kept between calls (a decode token makes ~120 calls: three allocations each
  // were ~0.15 ms of a token); the workers only read and write their rows of it
  thread_local std::vector<float> quantized;
  const int64_t q_floats = (rows_q * kx + 3) / 4;
  quantized.resize(q_floats + 2 * rows_q * gx);
  int8_t* xq = reinterpret_cast<int8_t*>(quantized.data());
  float* d = quantized.data() + q_floats;
  float* s = d + rows_q * gx;
  const int p = static_cast<int>(passes);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(kx);
    const float e = static_cast<float>(eps);
    if (xc.scalar_type() == at::kFloat)
      quantize_range(xc.const_data_ptr<float>(), begin, end, kx, norm, e, p, vnni, row.data(), xq, d, s);
    else
      quantize_range(xc.const_data_ptr<at::BFloat16>(), begin, end, kx, norm, e, p, vnni, row.data(), xq, d, s);
  });

  Call c{{xq, d, s}, w.codes, w.scales, out.mutable_data_ptr<float>(), rows_q, n, k, kx, w.bits, w.half};
  c.paired = passes == 2;
  c.watch = watch ? &*watch : nullptr;
  const int64_t chunks = (rows_q + ROW_CHUNK - 1) / ROW_CHUNK;
  at::parallel_for(0, chunks * w.nblocks, 1, [&](int64_t begin, int64_t end) { tiles(c, vnni, begin, end); });
  return out;
}

std::string int4_isa() { return have_vnni() ? "avx512-vnni" : "portable"; }

}  // namespace

namespace prefixd_cpu {

Int4Weight int4_weight(const at::Tensor& codes, const at::Tensor& scales, int64_t n) { return weight_of(codes, scales, n); }

bool int4_vnni() { return have_vnni(); }

void int4_quantize(const float* x, int64_t begin, int64_t end, int64_t kx, const float* norm, float eps, float* row,
                   int8_t* xq, float* d, float* s) {
  quantize_range(x, begin, end, kx, norm, eps, 1, have_vnni(), row, xq, d, s);
}

void int4_quantize(const at::BFloat16* x, int64_t begin, int64_t end, int64_t kx, const float* norm, float eps,
                   float* row, int8_t* xq, float* d, float* s) {
  quantize_range(x, begin, end, kx, norm, eps, 1, have_vnni(), row, xq, d, s);
}

void int4_quantize_passes(const float* x, int64_t begin, int64_t end, int64_t kx, int passes, float* row, int8_t* xq,
                          float* d, float* s) {
  quantize_range(x, begin, end, kx, nullptr, 0.f, passes, have_vnni(), row, xq, d, s);
}

int64_t int4_tasks(const Int4Weight& w, int64_t rows) { return (rows + ROW_CHUNK - 1) / ROW_CHUNK * w.nblocks; }

std::optional<RowWatch> row_watch(const std::optional<at::Tensor>& finite, const std::optional<at::Tensor>& best,
                                  int64_t rows, int64_t n, int64_t limit, const char* who) {
  TORCH_CHECK(finite.has_value() == best.has_value(), who, ": finite and best go together");
  if (!finite.has_value()) return std::nullopt;
  TORCH_CHECK(finite->scalar_type() == at::kByte && finite->dim() == 1 && finite->size(0) == rows &&
                  finite->is_contiguous() && best->scalar_type() == at::kLong && best->dim() == 1 &&
                  best->size(0) == rows && best->is_contiguous() && 0 <= limit && limit <= n &&
                  limit < (int64_t{1} << 32),
              who, ": finite (uint8 (", rows, ",)) and best (int64 (", rows, ",)), with 0 <= limit <= ", n);
  uint8_t* f = finite->mutable_data_ptr<uint8_t>();
  uint64_t* b = reinterpret_cast<uint64_t*>(best->mutable_data_ptr<int64_t>());
  std::fill(f, f + rows, uint8_t{1});
  std::fill(b, b + rows, uint64_t{0});
  return RowWatch{f, b, limit};
}

void int4_tiles(const Int4Weight& w, const int8_t* xq, const float* d, const float* s, int64_t rows, int64_t kx,
                float* out, bool accumulate, int64_t begin, int64_t end, bool paired, const RowWatch* watch) {
  Call c{{xq, d, s}, w.codes, w.scales, out, rows, w.n, w.k, kx, w.bits, w.half};
  c.accumulate = accumulate;
  c.paired = paired;
  c.watch = watch;
  tiles(c, have_vnni(), begin, end);
}

}  // namespace prefixd_cpu

TORCH_LIBRARY(prefixd, m) {
  m.def("int4_mm(Tensor x, Tensor codes, Tensor scales, int n, str path='auto', Tensor? norm_weight=None, "
        "float eps=0.0, int passes=1, Tensor(a!)? finite=None, Tensor(b!)? best=None, int limit=0) -> Tensor");
  m.def("int4_isa() -> str", [] { return int4_isa(); });
}

TORCH_LIBRARY_IMPL(prefixd, CPU, m) { m.impl("int4_mm", &int4_mm); }
