// Host reduction kernels.
//
// Layout: every (dtype, op) goes through one template, map_blocks<Elem, Fn>:
// blocks of a constant number of elements (256 bytes of compute values) are
// reduced element by element with `#pragma GCC ivdep`, then the tail one
// element at a time. The constant trip count and ivdep let GCC vectorise the
// block loop even at -O2, whose "very cheap" cost model refuses loops that
// need runtime alias checks or epilogues. Elem says how a stored element
// becomes a compute value (float16 and bfloat16 widen to float32 and round
// back to nearest even); they bring their own block routines at the AVX2
// (F16C; shifts and packs) and AVX-512 levels.
// Loads and stores go through memcpy, so buffers need no particular alignment,
// and each element is read before it is written, so dst may be a or b.
//
// The same template is compiled three times: baseline (SSE2 on x86-64), AVX2
// with F16C, and AVX-512 (F/BW/DQ/VL), with a fourth variant of bfloat16's
// for AVX512_BF16's conversion; the variant is chosen once, at the first
// call, from CPUID. BRAID_CPU_ISA=default|avx2|avx512|avx512_bf16 caps the
// choice (to exercise the fallbacks); nothing raises it above what the CPU
// supports.
#include "kernels/cpu/reduce_kernels.h"

#include <bit>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#define BRAID_KERNELS_X86 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define BRAID_KERNELS_X86 0
#endif

#define BRAID_ALWAYS_INLINE inline __attribute__((always_inline))

// "Iterations of the next loop are independent" (see fused_block).
#if defined(__clang__)
#define BRAID_IVDEP _Pragma("clang loop vectorize(assume_safety)")
#else
#define BRAID_IVDEP _Pragma("GCC ivdep")
#endif

namespace braid::kernels {
namespace {

// ---------------------------------------------------------------------------
// Scalar float16 / bfloat16 conversions (bit manipulation, round to nearest
// even, subnormals, infinities; NaN stays NaN and comes out quiet).

BRAID_ALWAYS_INLINE float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {  // inf or NaN; a NaN gets the quiet bit
    bits = sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x00400000u : 0u);
  } else if (exp != 0) {  // normal: rebias 15 -> 127
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {  // signed zero
    bits = sign;
  } else {             // subnormal m * 2^-24: normalise into a float32 normal
    uint32_t e = 113;  // biased float32 exponent of 2^-14
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    bits = sign | (e << 23) | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

BRAID_ALWAYS_INLINE uint16_t float_to_half_bits(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) {  // NaN: quiet, keep the top payload bits
    return static_cast<uint16_t>(sign | 0x7e00u | ((u >> 13) & 0x3ffu));
  }
  if (u >= 0x477ff000u) {  // >= 65520 (half-way above 65504, odd): rounds to inf; also inf itself
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (u >= 0x38800000u) {  // normal half (>= 2^-14): rebias, round on the 13 dropped bits
    const uint32_t odd = (u >> 13) & 1u;
    u = u - (112u << 23) + 0xfffu + odd;  // a carry into the exponent is the right answer
    return static_cast<uint16_t>(sign | (u >> 13));
  }
  if (u <= 0x33000000u) {  // <= 2^-25: half-way to 2^-24 or less rounds to (even) zero
    return sign;
  }
  // Subnormal half: the result is round(|f| / 2^-24), 1..1024 (1024 is 2^-14, the
  // smallest normal, whose encoding 0x0400 follows on naturally).
  const uint32_t e = u >> 23;  // 102..112 here
  const uint32_t m = (u & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (q & 1u) != 0)) ++q;
  return static_cast<uint16_t>(sign | q);
}

BRAID_ALWAYS_INLINE float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  if ((u & 0x7fffffffu) > 0x7f800000u) u |= 0x00400000u;  // quiet a NaN
  return std::bit_cast<float>(u);
}

// The kernels widen without quieting: arithmetic quiets a NaN anyway, and one
// that MIN/MAX pass through is quieted when it is narrowed again.
BRAID_ALWAYS_INLINE float bf16_bits_widen(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

BRAID_ALWAYS_INLINE uint16_t float_to_bf16_bits(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if (f != f) {  // NaN: quiet it (never truncate to inf); f != f vectorises to one compare
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  // Round to nearest even on the low 16 bits; carries reach the exponent and,
  // past the largest finite value, give inf, which is correct.
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// ---------------------------------------------------------------------------
// Element policies: how a stored element (kSize bytes, any alignment) becomes
// a compute value and back. A policy may also bring its own whole-block
// routine (HalfF16c); otherwise map_blocks uses load1/store1 throughout.

template <class T>
struct Plain {
  using Compute = T;
  static constexpr size_t kSize = sizeof(T);
  static BRAID_ALWAYS_INLINE T load1(const unsigned char* p) {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
  }
  static BRAID_ALWAYS_INLINE void store1(unsigned char* p, T v) { std::memcpy(p, &v, sizeof(T)); }
};

// A 16-bit float format held as uint16_t and computed in float32.
template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
struct Narrow {
  using Compute = float;
  static constexpr size_t kSize = 2;
  static BRAID_ALWAYS_INLINE float load1(const unsigned char* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return ToFloat(v);
  }
  static BRAID_ALWAYS_INLINE void store1(unsigned char* p, float f) {
    const uint16_t v = FromFloat(f);
    std::memcpy(p, &v, 2);
  }
};

using HalfSoft = Narrow<half_bits_to_float, float_to_half_bits>;
using BFloat16 = Narrow<bf16_bits_widen, float_to_bf16_bits>;

#if BRAID_KERNELS_X86
// float16 with the F16C instructions, 8 lanes at a time. vcvtps2ph with an
// immediate round-to-nearest-even and vcvtph2ps agree bit for bit with the
// software conversions above, NaNs included (quieted, top payload kept).
// The operation is applied to GCC vector values (the Op functors are written
// so that the same expressions work on scalars and on vectors). Each group of 8
// is read completely before it is written, so aliasing is safe.
// Not always_inline: map_blocks is first compiled for the baseline target,
// where an F16C body cannot be forced inline.
typedef float Float8 __attribute__((vector_size(32)));

struct HalfF16c : HalfSoft {
  template <size_t B, class Fn>
  __attribute__((target("avx2,f16c"))) static void block(unsigned char* dst, const unsigned char* a,
                                                         const unsigned char* b, Fn fn) {
    static_assert(B % 8 == 0);
    for (size_t j = 0; j < B; j += 8) {
      Float8 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 2 * j)));
      const Float8 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * j)));
      fn(x, y);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * j),
                       _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
  }
};

// bfloat16, 16 lanes at a time with AVX2. Interleaving each 16-bit value with
// a zero word widens it to float32 (the value lands in the high half); the
// two halves come out in a shuffled order that the 32-to-16 pack undoes, so
// the lanes' order never needs a cross-lane permute. Narrowing uses the same
// round-to-nearest-even and NaN quieting as float_to_bf16_bits (GCC leaves
// that scalar loop unvectorised: the NaN select defeats it).
struct BFloat16Avx2 : BFloat16 {
  // Round to nearest even on the dropped 16 bits, NaNs quieted; the result
  // sits in the low half of each 32-bit lane.
  __attribute__((target("avx2"), always_inline)) static inline void narrow(const Float8& x, __m256i& out) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    out = _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, _mm256_set1_epi32(0x0040)), nan);
  }

  template <size_t B, class Fn>
  __attribute__((target("avx2"))) static void block(unsigned char* dst, const unsigned char* a,
                                                    const unsigned char* b, Fn fn) {
    static_assert(B % 16 == 0);
    const __m256i zero = _mm256_setzero_si256();
    for (size_t j = 0; j < B; j += 16) {
      const __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2 * j));
      const __m256i vb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2 * j));
      Float8 xlo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, va));
      Float8 xhi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, va));
      const Float8 ylo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, vb));
      const Float8 yhi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, vb));
      fn(xlo, ylo);
      fn(xhi, yhi);
      __m256i rlo, rhi;
      narrow(xlo, rlo);
      narrow(xhi, rhi);
      // Values fit 16 bits, so the signed-to-unsigned pack never saturates.
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * j), _mm256_packus_epi32(rlo, rhi));
    }
  }
};

// GCC 12 reports AVX-512 intrinsics' undefined pass-through operands as
// "may be used uninitialized" once inlined (GCC bug 105593, fixed in 13),
// and as "used uninitialized" in the sanitizer builds.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#define BRAID_AVX512_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx2,f16c"
typedef float Float16v __attribute__((vector_size(64)));

struct OpMin;
struct OpMax;

// acc = acc op x on 16 floats. GCC 12 turns the ops' NaN-aware select on
// 512-bit vectors into work per lane (MIN and MAX ran at 2 GB/s). Compare
// masks and a blend make the scalar rule's choice (acc where acc < x or acc
// is NaN, else x) and keep the chosen input's bits: minps and maxps return a
// subnormal input as 0 when the thread has denormals-are-zero set
// (torch.set_flush_denormal, -ffast-math), which the scalar path does not.
template <class Fn>
__attribute__((target(BRAID_AVX512_TARGET), always_inline)) inline void apply512(Fn fn, Float16v& acc,
                                                                                 const Float16v& x) {
  if constexpr (std::is_same_v<Fn, OpMin> || std::is_same_v<Fn, OpMax>) {
    constexpr int kWins = std::is_same_v<Fn, OpMin> ? _CMP_LT_OQ : _CMP_GT_OQ;
    const __mmask16 keep = _mm512_cmp_ps_mask(acc, x, kWins) | _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q);
    acc = _mm512_mask_blend_ps(keep, x, acc);
  } else {
    fn(acc, x);
  }
}

// float16 with AVX-512F's conversions, 16 lanes at a time: the same
// round-to-nearest-even and NaN handling as F16C's.
struct HalfAvx512 : HalfSoft {
  template <size_t B, class Fn>
  __attribute__((target(BRAID_AVX512_TARGET))) static void block(unsigned char* dst, const unsigned char* a,
                                                                 const unsigned char* b, Fn fn) {
    static_assert(B % 16 == 0);
    for (size_t j = 0; j < B; j += 16) {
      Float16v x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2 * j)));
      const Float16v y = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2 * j)));
      apply512(fn, x, y);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * j),
                          _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
  }
};

// bfloat16, 32 lanes at a time: BFloat16Avx2's widening and rounding on
// 512-bit registers (unpack and pack stay inside 128-bit lanes there too, so
// they still undo each other), with a mask register for the NaN select. The
// AVX2 loop ran at 20-40% of memcpy's speed from cache, bound by its
// instruction count. Where the CPU has AVX512_BF16, BFloat16Avx512Bf16
// narrows with its conversion and falls back to this one's narrow().
struct BFloat16Avx512 : BFloat16 {
  __attribute__((target(BRAID_AVX512_TARGET), always_inline)) static inline __m512i narrow(
      const Float16v& x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(hi, _mm512_set1_epi32(0x0040)));
  }

  template <size_t B, class Fn>
  __attribute__((target(BRAID_AVX512_TARGET))) static void block(unsigned char* dst, const unsigned char* a,
                                                                 const unsigned char* b, Fn fn) {
    static_assert(B % 32 == 0);
    const __m512i zero = _mm512_setzero_si512();
    for (size_t j = 0; j < B; j += 32) {
      const __m512i va = _mm512_loadu_si512(a + 2 * j);
      const __m512i vb = _mm512_loadu_si512(b + 2 * j);
      Float16v xlo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, va));
      Float16v xhi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, va));
      const Float16v ylo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, vb));
      const Float16v yhi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, vb));
      apply512(fn, xlo, ylo);
      apply512(fn, xhi, yhi);
      _mm512_storeu_si512(dst + 2 * j, _mm512_packus_epi32(narrow(xlo), narrow(xhi)));
    }
  }
};

// bfloat16 where the CPU has AVX512_BF16: one conversion narrows 32 lanes
// with the same rounding and NaN quieting (BFloat16Avx512's shifts took
// three times the instructions, and ran at 50-60% of memcpy's speed).
// Widening by shift and mask (even elements, odd elements) keeps the
// shuffle port free; one word permute puts the two halves back in order.
// The conversion flushes subnormal results to zero, so 32 lanes holding one
// are narrowed by BFloat16Avx512's shifts instead; vfpclassps sees
// subnormals only while MXCSR.DAZ is clear (map_avx512_bf16's caller).
struct BFloat16Avx512Bf16 : BFloat16 {
  template <size_t B, class Fn>
  __attribute__((target(BRAID_AVX512_TARGET ",avx512bf16"))) static void block(unsigned char* dst,
                                                                               const unsigned char* a,
                                                                               const unsigned char* b,
                                                                               Fn fn) {
    static_assert(B % 32 == 0);
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    // Word k of the result: even k from the first half (even elements),
    // odd k from the second.
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23,
                                           7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    constexpr int kSubnormal = 0x20;  // vfpclassps category
    for (size_t j = 0; j < B; j += 32) {
      const __m512i va = _mm512_loadu_si512(a + 2 * j);
      const __m512i vb = _mm512_loadu_si512(b + 2 * j);
      Float16v even = _mm512_castsi512_ps(_mm512_slli_epi32(va, 16));
      Float16v odd = _mm512_castsi512_ps(_mm512_and_si512(va, high));
      apply512(fn, even, _mm512_castsi512_ps(_mm512_slli_epi32(vb, 16)));
      apply512(fn, odd, _mm512_castsi512_ps(_mm512_and_si512(vb, high)));
      __m512i out;
      if ((_mm512_fpclass_ps_mask(even, kSubnormal) | _mm512_fpclass_ps_mask(odd, kSubnormal)) == 0) {
        out = _mm512_permutexvar_epi16(order, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even)));
      } else {
        out = _mm512_mask_blend_epi16(0xAAAAAAAAu, BFloat16Avx512::narrow(even),
                                      _mm512_slli_epi32(BFloat16Avx512::narrow(odd), 16));
      }
      _mm512_storeu_si512(dst + 2 * j, out);
    }
  }
};
#endif

// The policy each vector ISA level uses for a stored type: float16 and
// bfloat16 bring their own block routines (F16C, and shifts and packs, on
// 256 or 512 bits); every other type takes the element loop.
template <class E, bool kAvx512>
struct Vectorised {
  using type = E;
};
#if BRAID_KERNELS_X86
template <bool kAvx512>
struct Vectorised<HalfSoft, kAvx512> {
  using type = std::conditional_t<kAvx512, HalfAvx512, HalfF16c>;
};
template <bool kAvx512>
struct Vectorised<BFloat16, kAvx512> {
  using type = std::conditional_t<kAvx512, BFloat16Avx512, BFloat16Avx2>;
};
#endif

// ---------------------------------------------------------------------------
// Operations on compute values, applied in place: acc = acc op x. Integers
// wrap (done in the unsigned type, at least as wide as unsigned int, so no
// promotion to signed int can overflow). The HalfF16c block also applies them
// to 32-byte GCC vectors, hence references rather than by-value vectors, whose
// ABI would depend on the target (GCC -Wpsabi).

template <class T>
using Wide = std::common_type_t<std::make_unsigned_t<T>, unsigned>;

struct OpSum {
  template <class T>
  BRAID_ALWAYS_INLINE void operator()(T& acc, const T& x) const {
    if constexpr (std::is_integral_v<T>) {
      acc = static_cast<T>(static_cast<Wide<T>>(acc) + static_cast<Wide<T>>(x));
    } else {
      acc = acc + x;
    }
  }
};

struct OpProd {
  template <class T>
  BRAID_ALWAYS_INLINE void operator()(T& acc, const T& x) const {
    if constexpr (std::is_integral_v<T>) {
      acc = static_cast<T>(static_cast<Wide<T>>(acc) * static_cast<Wide<T>>(x));
    } else {
      acc = acc * x;
    }
  }
};

// Floating MIN/MAX: a NaN in either input gives NaN. (acc != acc) is the NaN
// test that also works lane-wise on vectors; when only x is NaN the comparison
// is false and x is taken.
struct OpMin {
  template <class T>
  BRAID_ALWAYS_INLINE void operator()(T& acc, const T& x) const {
    if constexpr (std::is_integral_v<T>) {
      acc = acc < x ? acc : x;
    } else {
      acc = ((acc < x) | (acc != acc)) ? acc : x;
    }
  }
};

struct OpMax {
  template <class T>
  BRAID_ALWAYS_INLINE void operator()(T& acc, const T& x) const {
    if constexpr (std::is_integral_v<T>) {
      acc = acc > x ? acc : x;
    } else {
      acc = ((acc > x) | (acc != acc)) ? acc : x;
    }
  }
};

// Bitwise ops, integer types only (vectors of integers too).
struct OpBand {
  template <class T>
  BRAID_ALWAYS_INLINE void operator()(T& acc, const T& x) const {
    acc = acc & x;
  }
};
struct OpBor {
  template <class T>
  BRAID_ALWAYS_INLINE void operator()(T& acc, const T& x) const {
    acc = acc | x;
  }
};
struct OpBxor {
  template <class T>
  BRAID_ALWAYS_INLINE void operator()(T& acc, const T& x) const {
    acc = acc ^ x;
  }
};

// divide(): acc /= divisor; the second input is ignored. T is C or a vector of C.
template <class C>
struct OpDivide {
  C divisor;
  template <class T>
  BRAID_ALWAYS_INLINE void operator()(T& acc, const T&) const {
    acc = acc / divisor;
  }
};

// ---------------------------------------------------------------------------
// The one loop.

constexpr size_t kBlockBytes = 256;  // per block and input, in compute values

// dst[0] = a[0] op b[0], for one element.
template <class E, class Fn>
BRAID_ALWAYS_INLINE void apply1(unsigned char* dst, const unsigned char* a, const unsigned char* b, Fn fn) {
  typename E::Compute acc = E::load1(a);
  fn(acc, E::load1(b));
  E::store1(dst, acc);
}

// One block of B elements. `ivdep` states what the contract guarantees: dst is
// either a, b, or disjoint from both, so element j of dst never feeds element
// k != j, and the vectorised loop needs no runtime overlap check.
template <class E, size_t B, class Fn>
BRAID_ALWAYS_INLINE void fused_block(unsigned char* dst, const unsigned char* a, const unsigned char* b,
                                     Fn fn) {
  constexpr size_t kS = E::kSize;
  BRAID_IVDEP
  for (size_t j = 0; j < B; ++j) apply1<E>(dst + j * kS, a + j * kS, b + j * kS, fn);
}

template <class E, class Fn>
BRAID_ALWAYS_INLINE void map_blocks(unsigned char* dst, const unsigned char* a, const unsigned char* b,
                                    size_t n, Fn fn) {
  constexpr size_t kB = kBlockBytes / sizeof(typename E::Compute);
  constexpr size_t kS = E::kSize;
  size_t i = 0;
  for (; i + kB <= n; i += kB) {
    if constexpr (requires { E::template block<kB>(dst, a, b, fn); }) {
      E::template block<kB>(dst + i * kS, a + i * kS, b + i * kS, fn);
    } else {
      fused_block<E, kB>(dst + i * kS, a + i * kS, b + i * kS, fn);
    }
  }
  for (; i < n; ++i) apply1<E>(dst + i * kS, a + i * kS, b + i * kS, fn);
}

template <class E, class Fn>
void map_default(unsigned char* dst, const unsigned char* a, const unsigned char* b, size_t n, Fn fn) {
  map_blocks<E>(dst, a, b, n, fn);
}

#if BRAID_KERNELS_X86
template <class E, class Fn>
__attribute__((target("avx2,f16c"))) void map_avx2(unsigned char* dst, const unsigned char* a,
                                                   const unsigned char* b, size_t n, Fn fn) {
  map_blocks<typename Vectorised<E, false>::type>(dst, a, b, n, fn);
}

template <class E, class Fn>
__attribute__((target(BRAID_AVX512_TARGET))) void map_avx512(unsigned char* dst, const unsigned char* a,
                                                             const unsigned char* b, size_t n, Fn fn) {
  map_blocks<typename Vectorised<E, true>::type>(dst, a, b, n, fn);
}

// Only bfloat16 has a use for AVX512_BF16; other types take map_avx512.
template <class Fn>
__attribute__((target(BRAID_AVX512_TARGET ",avx512bf16"))) void map_avx512_bf16(unsigned char* dst,
                                                                                const unsigned char* a,
                                                                                const unsigned char* b,
                                                                                size_t n, Fn fn) {
  map_blocks<BFloat16Avx512Bf16>(dst, a, b, n, fn);
}
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// ---------------------------------------------------------------------------
// Runtime dispatch.

enum class Isa { kDefault = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

Isa detect_isa() {
  Isa best = Isa::kDefault;
#if BRAID_KERNELS_X86
  __builtin_cpu_init();
  // F16C is CPUID.1:ECX bit 29; asked directly, as not every compiler's
  // __builtin_cpu_supports knows the name.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
  if (__builtin_cpu_supports("avx2") && f16c) {
    best = Isa::kAvx2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
      best = Isa::kAvx512;
      if (__builtin_cpu_supports("avx512bf16")) best = Isa::kAvx512Bf16;
    }
  }
#endif
  // An invalid cap leaves the CPU's best: the communicator's init refuses it
  // with a message (Config), and kernels run before any init cannot report.
  if (const char* cap = std::getenv("BRAID_CPU_ISA")) {
    Isa limit = best;
    if (std::strcmp(cap, "default") == 0) {
      limit = Isa::kDefault;
    } else if (std::strcmp(cap, "avx2") == 0) {
      limit = Isa::kAvx2;
    } else if (std::strcmp(cap, "avx512") == 0) {
      limit = Isa::kAvx512;
    }
    if (limit < best) best = limit;
  }
  return best;
}

Isa current_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

constexpr unsigned kMxcsrDaz = 0x40;  // denormals are zero

template <class E, class Fn>
void run(void* dst, const void* a, const void* b, size_t n, Fn fn) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* pa = static_cast<const unsigned char*>(a);
  const auto* pb = static_cast<const unsigned char*>(b);
#if BRAID_KERNELS_X86
  switch (current_isa()) {
    case Isa::kAvx512Bf16:
      if constexpr (std::is_same_v<E, BFloat16>) {
        if ((_mm_getcsr() & kMxcsrDaz) == 0) {
          map_avx512_bf16(d, pa, pb, n, fn);
          return;
        }
      }
      [[fallthrough]];
    case Isa::kAvx512:
      map_avx512<E>(d, pa, pb, n, fn);
      return;
    case Isa::kAvx2:
      map_avx2<E>(d, pa, pb, n, fn);
      return;
    case Isa::kDefault:
      break;
  }
#endif
  map_default<E>(d, pa, pb, n, fn);
}

template <class E>
void reduce_as(braid_redop_t op, void* dst, const void* a, const void* b, size_t n) {
  switch (op) {
    case BRAID_SUM:
    case BRAID_AVG:  // the collective divides once at the end
      run<E>(dst, a, b, n, OpSum{});
      break;
    case BRAID_PROD:
      run<E>(dst, a, b, n, OpProd{});
      break;
    case BRAID_MIN:
      run<E>(dst, a, b, n, OpMin{});
      break;
    case BRAID_MAX:
      run<E>(dst, a, b, n, OpMax{});
      break;
    case BRAID_BAND:
    case BRAID_BOR:
    case BRAID_BXOR:
      if constexpr (std::is_integral_v<typename E::Compute>) {
        if (op == BRAID_BAND) run<E>(dst, a, b, n, OpBand{});
        if (op == BRAID_BOR) run<E>(dst, a, b, n, OpBor{});
        if (op == BRAID_BXOR) run<E>(dst, a, b, n, OpBxor{});
      }
      break;
    default:
      break;
  }
}

template <class E>
void divide_as(const void* in, void* out, size_t n, int divisor) {
  using C = typename E::Compute;
  run<E>(out, in, in, n, OpDivide<C>{static_cast<C>(divisor)});
}

}  // namespace

const char* active_isa() {
  switch (current_isa()) {
    case Isa::kAvx512Bf16:
      return "avx512_bf16";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kDefault:
      break;
  }
  return "default";
}

bool valid_isa_cap(const char* cap) {
  return std::strcmp(cap, "default") == 0 || std::strcmp(cap, "avx2") == 0 ||
         std::strcmp(cap, "avx512") == 0 || std::strcmp(cap, "avx512_bf16") == 0;
}

bool is_floating(braid_dtype_t dtype) {
  switch (dtype) {
    case BRAID_FLOAT16:
    case BRAID_BFLOAT16:
    case BRAID_FLOAT32:
    case BRAID_FLOAT64:
      return true;
    default:
      return false;
  }
}

bool redop_supported(braid_dtype_t dtype, braid_redop_t op) {
  switch (dtype) {
    case BRAID_INT8:
    case BRAID_UINT8:
    case BRAID_INT32:
    case BRAID_UINT32:
    case BRAID_INT64:
    case BRAID_UINT64:
    case BRAID_FLOAT16:
    case BRAID_BFLOAT16:
    case BRAID_FLOAT32:
    case BRAID_FLOAT64:
      break;
    default:
      return false;
  }
  switch (op) {
    case BRAID_SUM:
    case BRAID_PROD:
    case BRAID_MIN:
    case BRAID_MAX:
      return true;
    case BRAID_AVG:
      return is_floating(dtype);
    case BRAID_BAND:
    case BRAID_BOR:
    case BRAID_BXOR:
      return !is_floating(dtype);
    default:
      return false;
  }
}

void reduce(braid_dtype_t dtype, braid_redop_t op, void* dst, const void* a, const void* b, size_t count) {
  if (count == 0) return;
  switch (dtype) {
    case BRAID_INT8:
      return reduce_as<Plain<int8_t>>(op, dst, a, b, count);
    case BRAID_UINT8:
      return reduce_as<Plain<uint8_t>>(op, dst, a, b, count);
    case BRAID_INT32:
      return reduce_as<Plain<int32_t>>(op, dst, a, b, count);
    case BRAID_UINT32:
      return reduce_as<Plain<uint32_t>>(op, dst, a, b, count);
    case BRAID_INT64:
      return reduce_as<Plain<int64_t>>(op, dst, a, b, count);
    case BRAID_UINT64:
      return reduce_as<Plain<uint64_t>>(op, dst, a, b, count);
    case BRAID_FLOAT16:
      return reduce_as<HalfSoft>(op, dst, a, b, count);
    case BRAID_BFLOAT16:
      return reduce_as<BFloat16>(op, dst, a, b, count);
    case BRAID_FLOAT32:
      return reduce_as<Plain<float>>(op, dst, a, b, count);
    case BRAID_FLOAT64:
      return reduce_as<Plain<double>>(op, dst, a, b, count);
    default:
      return;
  }
}

void divide(braid_dtype_t dtype, const void* in, void* out, size_t count, int divisor) {
  if (count == 0) return;
  switch (dtype) {
    case BRAID_FLOAT16:
      return divide_as<HalfSoft>(in, out, count, divisor);
    case BRAID_BFLOAT16:
      return divide_as<BFloat16>(in, out, count, divisor);
    case BRAID_FLOAT32:
      return divide_as<Plain<float>>(in, out, count, divisor);
    case BRAID_FLOAT64:
      return divide_as<Plain<double>>(in, out, count, divisor);
    default:  // integer types have no AVG; nothing to do
      return;
  }
}

float half_to_float(uint16_t h) {
  return half_bits_to_float(h);
}
uint16_t float_to_half(float f) {
  return float_to_half_bits(f);
}
float bfloat16_to_float(uint16_t b) {
  return bf16_bits_to_float(b);
}
uint16_t float_to_bfloat16(float f) {
  return float_to_bf16_bits(f);
}

}  // namespace braid::kernels
