// What both of prefixd's CPU kernels (int4_mm.cpp, attention.cpp) share: the x86 switch, exact
// bf16 and fp16 reads and the fixed order in which 16 lane sums are joined.
#pragma once

#if (defined(__x86_64__) || defined(__i386__)) && !defined(PREFIXD_PORTABLE_ONLY)  // the latter: to check the other build
#define PREFIXD_X86 1
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace prefixd_cpu {

inline float bf16_to_float(uint16_t h) {  // exact
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float fp16_to_float(uint16_t h) {  // exact, subnormals included (every fp16 is an fp32)
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef PREFIXD_X86
// Every software prefetch of the kernels (weights ahead in int4_mm.cpp, K/V lines ahead in
// attention.cpp): a hint into the second-level cache, not the first. A first-level prefetch
// holds one of the core's few first-level miss slots until its line arrives; streaming from
// memory, the kernels issued them faster than lines came back and stalled on the prefetch
// itself (perf: a fifth of a 4K decode row's attention chunk on the instruction after it).
// The second level tracks more misses at once, and a line there is a few cycles from the
// load that takes it. Measured on the EPYC, alternating in one session: a decode row's
// attention streamed at 4K keys 138-156 -> 108-117 µs, decode 1 lane @ 4K 101-103 -> 117-133
// tok/s (docs/runtime.md, *Prefetch into the second-level cache*). A hint: no arithmetic changes.
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// 16 bf16 widened to fp32, exactly (each value's bits shifted into the high half of its lane).
__attribute__((target("avx512f"))) inline __m512 load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// 16 fp16 widened to fp32, exactly (the conversion is exact whatever the rounding mode).
__attribute__((target("avx512f"))) inline __m512 load_fp16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// The fixed halvings of 16 lane sums: lanes j + j+8, then j + j+4, j + j+2, j + j+1. The
// kernels' vector paths join their lanes in this same order.
inline float halve16(const float* v) {
  float a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j) a[j] = v[j] + v[j + 8];
  for (int j = 0; j < 4; ++j) b[j] = a[j] + a[j + 4];
  for (int j = 0; j < 2; ++j) c[j] = b[j] + b[j + 2];
  return c[0] + c[1];
}

}  // namespace prefixd_cpu
