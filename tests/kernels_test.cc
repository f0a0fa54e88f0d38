// Unit tests for kernels/cpu: element-wise reduce and divide for every dtype and
// op, the float16 / bfloat16 conversions, all checked bit for bit, and the
// streaming copy.
#include <braid/braid.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "kernels/cpu/copy_kernels.h"
#include "kernels/cpu/reduce_kernels.h"

namespace braid::kernels {
namespace {

constexpr braid_dtype_t kAllDtypes[] = {BRAID_INT8,    BRAID_UINT8,  BRAID_INT32,   BRAID_UINT32,
                                        BRAID_INT64,   BRAID_UINT64, BRAID_FLOAT16, BRAID_BFLOAT16,
                                        BRAID_FLOAT32, BRAID_FLOAT64};
constexpr braid_redop_t kAllOps[] = {BRAID_SUM, BRAID_PROD, BRAID_MIN, BRAID_MAX,
                                     BRAID_AVG, BRAID_BAND, BRAID_BOR, BRAID_BXOR};

bool bitwise(braid_redop_t op) {
  return op == BRAID_BAND || op == BRAID_BOR || op == BRAID_BXOR;
}

// Counts around the vector block sizes (32, 64, 128 or 256 elements) and tails.
constexpr size_t kCounts[] = {0, 1, 7, 33, 63, 64, 65, 255, 257, 1000, 1031};

size_t elem_size(braid_dtype_t dt) {
  switch (dt) {
    case BRAID_INT8:
    case BRAID_UINT8:
      return 1;
    case BRAID_FLOAT16:
    case BRAID_BFLOAT16:
      return 2;
    case BRAID_INT32:
    case BRAID_UINT32:
    case BRAID_FLOAT32:
      return 4;
    default:
      return 8;
  }
}

std::string name_of(braid_dtype_t dt, braid_redop_t op) {
  return "dtype " + std::to_string(static_cast<int>(dt)) + " op " + std::to_string(static_cast<int>(op));
}

float f32_from_bits(uint32_t u) {
  return std::bit_cast<float>(u);
}
uint32_t bits_of(float f) {
  return std::bit_cast<uint32_t>(f);
}
bool half_is_nan(uint16_t h) {
  return (h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0;
}
bool bf16_is_nan(uint16_t b) {
  return (b & 0x7f80) == 0x7f80 && (b & 0x007f) != 0;
}

// Exact value of a finite float16 bit pattern, from the definition.
double half_value(uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -mag : mag;
}

// Each element as a zero-extended 64-bit pattern, so any T compares exactly
// (floats by bits: -0 differs from +0) and prints as a number.
template <class T>
std::vector<uint64_t> bit_patterns(const std::vector<T>& v) {
  std::vector<uint64_t> out(v.size(), 0);
  for (size_t i = 0; i < v.size(); ++i) std::memcpy(&out[i], &v[i], sizeof(T));
  return out;
}

// ---------------------------------------------------------------------------
// redop_supported, is_floating, out-of-range enums.

TEST(KernelsSupport, IsFloating) {
  for (braid_dtype_t dt : kAllDtypes) {
    const bool want =
        dt == BRAID_FLOAT16 || dt == BRAID_BFLOAT16 || dt == BRAID_FLOAT32 || dt == BRAID_FLOAT64;
    EXPECT_EQ(is_floating(dt), want) << name_of(dt, BRAID_SUM);
  }
}

TEST(KernelsSupport, RedopSupported) {
  for (braid_dtype_t dt : kAllDtypes) {
    for (braid_redop_t op : kAllOps) {
      const bool want = bitwise(op) ? !is_floating(dt) : (op != BRAID_AVG || is_floating(dt));
      EXPECT_EQ(redop_supported(dt, op), want) << name_of(dt, op);
    }
  }
  EXPECT_FALSE(redop_supported(BRAID_INT8, BRAID_AVG));
  EXPECT_FALSE(redop_supported(BRAID_UINT64, BRAID_AVG));
  EXPECT_TRUE(redop_supported(BRAID_FLOAT16, BRAID_AVG));
  EXPECT_TRUE(redop_supported(BRAID_BFLOAT16, BRAID_AVG));
  EXPECT_TRUE(redop_supported(BRAID_FLOAT32, BRAID_AVG));
  EXPECT_TRUE(redop_supported(BRAID_FLOAT64, BRAID_AVG));
}

TEST(KernelsSupport, UnknownDtypeOrOpIsRejectedAndIgnored) {
  // Values inside the enums' value ranges (0..15 for both) but not enumerators.
  const auto bad_dtype = static_cast<braid_dtype_t>(BRAID_NUM_DTYPES);
  const auto bad_dtype2 = static_cast<braid_dtype_t>(15);
  const auto bad_op = static_cast<braid_redop_t>(BRAID_NUM_OPS);
  const auto bad_op2 = static_cast<braid_redop_t>(15);
  EXPECT_FALSE(redop_supported(bad_dtype, BRAID_SUM));
  EXPECT_FALSE(redop_supported(bad_dtype2, BRAID_SUM));
  EXPECT_FALSE(redop_supported(BRAID_FLOAT32, bad_op));
  EXPECT_FALSE(redop_supported(BRAID_INT32, bad_op2));
  EXPECT_FALSE(is_floating(bad_dtype));

  const std::vector<uint64_t> a(100, 3), b(100, 4);
  std::vector<uint64_t> dst(100, 7);
  reduce(bad_dtype, BRAID_SUM, dst.data(), a.data(), b.data(), a.size());
  reduce(bad_dtype2, BRAID_SUM, dst.data(), a.data(), b.data(), a.size());
  for (braid_dtype_t dt : kAllDtypes) {
    reduce(dt, bad_op, dst.data(), a.data(), b.data(), 100 * 8 / elem_size(dt));
    reduce(dt, bad_op2, dst.data(), a.data(), b.data(), 100 * 8 / elem_size(dt));
  }
  divide(bad_dtype, dst.data(), dst.data(), dst.size(), 2);
  EXPECT_EQ(dst, std::vector<uint64_t>(100, 7));
}

// ---------------------------------------------------------------------------
// float16 conversions.

TEST(KernelsHalf, KnownValues) {
  EXPECT_EQ(float_to_half(1.0f), 0x3C00);
  EXPECT_EQ(half_to_float(0x3C00), 1.0f);
  EXPECT_EQ(float_to_half(-2.0f), 0xC000);
  EXPECT_EQ(float_to_half(0.5f), 0x3800);
  EXPECT_EQ(float_to_half(1.0f / 3.0f), 0x3555);
  EXPECT_EQ(float_to_half(0.1f), 0x2E66);
  EXPECT_EQ(float_to_half(65504.0f), 0x7BFF);  // largest finite
  EXPECT_EQ(half_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(float_to_half(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(half_to_float(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(half_to_float(0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(half_to_float(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(float_to_half(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(half_to_float(0x03FF), std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(float_to_half(std::ldexp(1023.0f, -24)), 0x03FF);
  EXPECT_EQ(half_to_float(0x0400), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_EQ(half_to_float(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(float_to_half(0.0f), 0x0000);
  EXPECT_EQ(float_to_half(-0.0f), 0x8000);
  EXPECT_EQ(bits_of(half_to_float(0x8000)), 0x80000000u);
  EXPECT_EQ(bits_of(half_to_float(0x0000)), 0x00000000u);
}

TEST(KernelsHalf, RoundToNearestEven) {
  const float ulp = std::ldexp(1.0f, -10);                                   // float16 ulp at 1.0
  EXPECT_EQ(float_to_half(1.0f + ulp / 2), 0x3C00);                          // tie, down to even
  EXPECT_EQ(float_to_half(1.0f + 3 * ulp / 2), 0x3C02);                      // tie, up to even
  EXPECT_EQ(float_to_half(1.0f + ulp / 2 + std::ldexp(1.0f, -20)), 0x3C01);  // just above the tie
  EXPECT_EQ(float_to_half(std::nextafter(1.0f + ulp / 2, 0.0f)), 0x3C00);    // just below
  EXPECT_EQ(float_to_half(-(1.0f + 3 * ulp / 2)), 0xBC02);                   // sign is symmetric
  EXPECT_EQ(float_to_half(2.0f - ulp / 4), 0x4000);                          // carry into the exponent
  // Overflow: 65520 is half-way between 65504 (odd mantissa) and 2^16.
  EXPECT_EQ(float_to_half(65519.0f), 0x7BFF);
  EXPECT_EQ(float_to_half(std::nextafter(65520.0f, 0.0f)), 0x7BFF);
  EXPECT_EQ(float_to_half(65520.0f), 0x7C00);
  EXPECT_EQ(float_to_half(-65520.0f), 0xFC00);
  EXPECT_EQ(float_to_half(1.0e6f), 0x7C00);
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::max()), 0x7C00);
  // Subnormal results: units of 2^-24.
  const float sub = std::ldexp(1.0f, -24);
  EXPECT_EQ(float_to_half(sub / 2), 0x0000);  // tie between 0 and 1: even is 0
  EXPECT_EQ(float_to_half(std::nextafter(sub / 2, 1.0f)), 0x0001);
  EXPECT_EQ(float_to_half(sub / 4), 0x0000);
  EXPECT_EQ(float_to_half(1.5f * sub), 0x0002);     // 1.5 -> 2
  EXPECT_EQ(float_to_half(2.5f * sub), 0x0002);     // 2.5 -> 2
  EXPECT_EQ(float_to_half(3.5f * sub), 0x0004);     // 3.5 -> 4
  EXPECT_EQ(float_to_half(1023.5f * sub), 0x0400);  // rounds up into the smallest normal
  EXPECT_EQ(float_to_half(1022.5f * sub), 0x03FE);
  EXPECT_EQ(float_to_half(-std::ldexp(1.0f, -26)), 0x8000);  // underflow keeps the sign
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::min()), 0x0000);
}

TEST(KernelsHalf, NaN) {
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::quiet_NaN()), 0x7E00);
  EXPECT_TRUE(half_is_nan(float_to_half(f32_from_bits(0x7F800001u))));  // signalling, low payload
  EXPECT_TRUE(half_is_nan(float_to_half(f32_from_bits(0xFF800001u))));
  EXPECT_EQ(float_to_half(f32_from_bits(0xFF800001u)) & 0x8000, 0x8000);
  EXPECT_TRUE(half_is_nan(float_to_half(f32_from_bits(0x7FFFFFFFu))));
  EXPECT_TRUE(std::isnan(half_to_float(0x7E00)));
  EXPECT_TRUE(std::isnan(half_to_float(0x7C01)));
  EXPECT_TRUE(std::isnan(half_to_float(0xFFFF)));
  // A signalling NaN comes out quiet.
  EXPECT_NE(bits_of(half_to_float(0x7C01)) & 0x00400000u, 0u);
}

TEST(KernelsHalf, AllBitPatternsRoundTrip) {
  for (uint32_t i = 0; i < 0x10000; ++i) {
    const auto h = static_cast<uint16_t>(i);
    const float f = half_to_float(h);
    if (half_is_nan(h)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      const uint16_t back = float_to_half(f);
      ASSERT_TRUE(half_is_nan(back)) << std::hex << i;
      ASSERT_EQ(back & 0x8000, h & 0x8000) << std::hex << i;
      continue;
    }
    if ((h & 0x7fff) == 0x7c00) {
      ASSERT_TRUE(std::isinf(f)) << std::hex << i;
    } else {
      ASSERT_EQ(static_cast<double>(f), half_value(h)) << std::hex << i;
    }
    ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << i;
    ASSERT_EQ(float_to_half(f), h) << std::hex << i;
  }
}

// Round-to-nearest-even from first principles: the two neighbouring float16
// values, with 2^16 standing in as the neighbour above 65504 (overflow rounds
// to inf exactly when unbounded rounding would give 2^16 or more).
uint16_t reference_float_to_half(float f) {
  static const std::vector<double> values = [] {
    std::vector<double> v(0x7C01);
    for (uint16_t h = 0; h < 0x7C00; ++h) v[h] = half_value(h);
    v[0x7C00] = 65536.0;
    return v;
  }();
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double x = std::fabs(static_cast<double>(f));
  if (x >= 65536.0) return sign | 0x7C00;
  const auto hi_it = std::upper_bound(values.begin(), values.end(), x);  // first value > x
  const auto hi = static_cast<uint16_t>(hi_it - values.begin());
  const auto lo = static_cast<uint16_t>(hi - 1);
  if (values[lo] == x) return sign | lo;
  const double below = x - values[lo];
  const double above = values[hi] - x;
  if (below < above) return sign | lo;
  if (above < below) return sign | hi;
  return sign | ((lo & 1) ? hi : lo);
}

TEST(KernelsHalf, FloatToHalfMatchesReferenceOnSweep) {
  // A stride through every float bit pattern (both signs, all exponents).
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 4099) {
    const float f = f32_from_bits(static_cast<uint32_t>(u));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_half(f), reference_float_to_half(f)) << std::hex << u;
  }
}

TEST(KernelsHalf, EveryMidpointRoundsToEven) {
  for (uint16_t h = 0; h < 0x7C00; ++h) {
    const double next = h == 0x7BFF ? 65536.0 : half_value(static_cast<uint16_t>(h + 1));
    const auto mid = static_cast<float>((half_value(h) + next) / 2);  // exact in float
    ASSERT_EQ(static_cast<double>(mid), (half_value(h) + next) / 2);
    const uint16_t even = (h & 1) ? static_cast<uint16_t>(h + 1) : h;
    ASSERT_EQ(float_to_half(mid), even) << std::hex << h;
    ASSERT_EQ(float_to_half(-mid), even | 0x8000) << std::hex << h;
    ASSERT_EQ(float_to_half(std::nextafter(mid, 0.0f)), h) << std::hex << h;
    ASSERT_EQ(float_to_half(std::nextafter(mid, 1.0e9f)), h + 1) << std::hex << h;
  }
}

// ---------------------------------------------------------------------------
// bfloat16 conversions.

TEST(KernelsBFloat16, KnownValues) {
  EXPECT_EQ(float_to_bfloat16(1.0f), 0x3F80);
  EXPECT_EQ(bfloat16_to_float(0x3F80), 1.0f);
  EXPECT_EQ(float_to_bfloat16(-2.0f), 0xC000);
  EXPECT_EQ(float_to_bfloat16(1.0f / 3.0f), 0x3EAB);
  EXPECT_EQ(float_to_bfloat16(0.0f), 0x0000);
  EXPECT_EQ(float_to_bfloat16(-0.0f), 0x8000);
  EXPECT_EQ(bits_of(bfloat16_to_float(0x8000)), 0x80000000u);
  EXPECT_EQ(float_to_bfloat16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(float_to_bfloat16(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(bfloat16_to_float(0x7F80), std::numeric_limits<float>::infinity());
  EXPECT_EQ(bfloat16_to_float(0x7F7F), f32_from_bits(0x7F7F0000u));  // largest finite
  EXPECT_EQ(bfloat16_to_float(0x0001), f32_from_bits(0x00010000u));  // smallest subnormal
}

TEST(KernelsBFloat16, RoundToNearestEven) {
  const float ulp = std::ldexp(1.0f, -7);                    // bfloat16 ulp at 1.0
  EXPECT_EQ(float_to_bfloat16(1.0f + ulp / 2), 0x3F80);      // tie, down to even
  EXPECT_EQ(float_to_bfloat16(1.0f + 3 * ulp / 2), 0x3F82);  // tie, up to even
  EXPECT_EQ(float_to_bfloat16(1.0f + ulp / 2 + std::ldexp(1.0f, -20)), 0x3F81);
  EXPECT_EQ(float_to_bfloat16(std::nextafter(1.0f + ulp / 2, 0.0f)), 0x3F80);
  EXPECT_EQ(float_to_bfloat16(-(1.0f + 3 * ulp / 2)), 0xBF82);
  EXPECT_EQ(float_to_bfloat16(f32_from_bits(0x3FFFFFFFu)), 0x4000);  // carry into the exponent
  // Overflow to inf.
  EXPECT_EQ(float_to_bfloat16(f32_from_bits(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(float_to_bfloat16(f32_from_bits(0x7F7F8000u)), 0x7F80);  // tie, odd: up to inf
  EXPECT_EQ(float_to_bfloat16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(float_to_bfloat16(-std::numeric_limits<float>::max()), 0xFF80);
  // Subnormals.
  EXPECT_EQ(float_to_bfloat16(f32_from_bits(0x00010000u)), 0x0001);
  EXPECT_EQ(float_to_bfloat16(f32_from_bits(0x00008000u)), 0x0000);  // tie to even 0
  EXPECT_EQ(float_to_bfloat16(f32_from_bits(0x00008001u)), 0x0001);
  EXPECT_EQ(float_to_bfloat16(f32_from_bits(0x00018000u)), 0x0002);  // tie to even 2
  EXPECT_EQ(float_to_bfloat16(f32_from_bits(0x007FFFFFu)), 0x0080);  // up into the smallest normal
  EXPECT_EQ(float_to_bfloat16(f32_from_bits(0x80008000u)), 0x8000);
}

TEST(KernelsBFloat16, NaN) {
  EXPECT_TRUE(bf16_is_nan(float_to_bfloat16(std::numeric_limits<float>::quiet_NaN())));
  // Payload only in the low 16 bits: truncation would give inf; must stay NaN.
  EXPECT_TRUE(bf16_is_nan(float_to_bfloat16(f32_from_bits(0x7F800001u))));
  EXPECT_TRUE(bf16_is_nan(float_to_bfloat16(f32_from_bits(0xFF800001u))));
  EXPECT_EQ(float_to_bfloat16(f32_from_bits(0xFF800001u)) & 0x8000, 0x8000);
  EXPECT_TRUE(bf16_is_nan(float_to_bfloat16(f32_from_bits(0x7FFFFFFFu))));  // no carry into the sign
  EXPECT_EQ(float_to_bfloat16(f32_from_bits(0x7FFFFFFFu)) & 0x8000, 0);
  EXPECT_TRUE(std::isnan(bfloat16_to_float(0x7FC0)));
  EXPECT_TRUE(std::isnan(bfloat16_to_float(0x7F81)));
  EXPECT_NE(bits_of(bfloat16_to_float(0x7F81)) & 0x00400000u, 0u);  // quieted
}

TEST(KernelsBFloat16, AllBitPatternsRoundTrip) {
  for (uint32_t i = 0; i < 0x10000; ++i) {
    const auto b = static_cast<uint16_t>(i);
    const float f = bfloat16_to_float(b);
    if (bf16_is_nan(b)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      const uint16_t back = float_to_bfloat16(f);
      ASSERT_TRUE(bf16_is_nan(back)) << std::hex << i;
      ASSERT_EQ(back & 0x8000, b & 0x8000) << std::hex << i;
      continue;
    }
    ASSERT_EQ(bits_of(f), static_cast<uint32_t>(b) << 16) << std::hex << i;
    ASSERT_EQ(float_to_bfloat16(f), b) << std::hex << i;
  }
}

uint16_t reference_float_to_bfloat16(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t mag = u & 0x7fffffffu;
  const auto lo = static_cast<uint16_t>(mag >> 16);  // truncation toward zero
  const double x = std::fabs(static_cast<double>(f));
  const double lo_v = f32_from_bits(static_cast<uint32_t>(lo) << 16);
  if (lo_v == x) return sign | lo;
  const double hi_v =
      lo == 0x7F7F ? std::ldexp(1.0, 128) : f32_from_bits(static_cast<uint32_t>(lo + 1) << 16);
  const double below = x - lo_v;
  const double above = hi_v - x;
  if (below < above) return sign | lo;
  if (above < below) return sign | static_cast<uint16_t>(lo + 1);
  return sign | ((lo & 1) ? static_cast<uint16_t>(lo + 1) : lo);
}

TEST(KernelsBFloat16, FloatToBFloat16MatchesReferenceOnSweep) {
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 4099) {
    const float f = f32_from_bits(static_cast<uint32_t>(u));
    if (std::isnan(f) || std::isinf(f)) continue;
    ASSERT_EQ(float_to_bfloat16(f), reference_float_to_bfloat16(f)) << std::hex << u;
  }
}

// ---------------------------------------------------------------------------
// reduce() on small arrays with known answers. Each case is checked out of
// place, with dst == a, with dst == b, and tiled to over 1000 elements so the
// vector blocks (not only the scalar tail) see the same values.

template <class T>
void check_reduce(braid_dtype_t dt, braid_redop_t op, const std::vector<T>& a, const std::vector<T>& b,
                  const std::vector<T>& want) {
  SCOPED_TRACE(name_of(dt, op));
  ASSERT_EQ(a.size(), b.size());
  ASSERT_EQ(a.size(), want.size());
  for (size_t reps : {size_t{1}, 1 + 1000 / a.size()}) {
    SCOPED_TRACE("repetitions " + std::to_string(reps));
    std::vector<T> ta, tb, tw;
    for (size_t r = 0; r < reps; ++r) {
      ta.insert(ta.end(), a.begin(), a.end());
      tb.insert(tb.end(), b.begin(), b.end());
      tw.insert(tw.end(), want.begin(), want.end());
    }
    const size_t n = ta.size();
    std::vector<T> dst(n);
    reduce(dt, op, dst.data(), ta.data(), tb.data(), n);
    EXPECT_EQ(bit_patterns(dst), bit_patterns(tw)) << "out of place";
    std::vector<T> in_a = ta;
    reduce(dt, op, in_a.data(), in_a.data(), tb.data(), n);
    EXPECT_EQ(bit_patterns(in_a), bit_patterns(tw)) << "dst == a";
    std::vector<T> in_b = tb;
    reduce(dt, op, in_b.data(), ta.data(), in_b.data(), n);
    EXPECT_EQ(bit_patterns(in_b), bit_patterns(tw)) << "dst == b";
  }
}

TEST(KernelsReduceKnown, Int8) {
  using V = std::vector<int8_t>;
  const V a = {1, -5, 127, -128, 100, -100, 0};
  const V b = {2, 3, 1, -1, 100, -100, -7};
  check_reduce(BRAID_INT8, BRAID_SUM, a, b, V{3, -2, -128, 127, -56, 56, -7});
  check_reduce(BRAID_INT8, BRAID_PROD, V{3, -4, 16, -128, 127, -128, 11}, V{5, 6, 16, -1, 127, -128, -11},
               V{15, -24, 0, -128, 1, 0, -121});
  check_reduce(BRAID_INT8, BRAID_MIN, a, b, V{1, -5, 1, -128, 100, -100, -7});
  check_reduce(BRAID_INT8, BRAID_MAX, a, b, V{2, 3, 127, -1, 100, -100, 0});
}

TEST(KernelsReduceKnown, UInt8) {
  using V = std::vector<uint8_t>;
  const V a = {1, 200, 255, 0, 16, 128};
  const V b = {2, 100, 1, 255, 16, 128};
  check_reduce(BRAID_UINT8, BRAID_SUM, a, b, V{3, 44, 0, 255, 32, 0});
  check_reduce(BRAID_UINT8, BRAID_PROD, V{3, 16, 255, 0, 15, 2}, V{5, 16, 255, 200, 17, 128},
               V{15, 0, 1, 0, 255, 0});
  check_reduce(BRAID_UINT8, BRAID_MIN, a, b, V{1, 100, 1, 0, 16, 128});
  check_reduce(BRAID_UINT8, BRAID_MAX, a, b, V{2, 200, 255, 255, 16, 128});
}

TEST(KernelsReduceKnown, Int32) {
  using V = std::vector<int32_t>;
  constexpr int32_t kMax = std::numeric_limits<int32_t>::max();
  constexpr int32_t kMin = std::numeric_limits<int32_t>::min();
  const V a = {1, -5, kMax, kMin, -1000000, 7};
  const V b = {2, 3, 1, -1, -2000000, -7};
  check_reduce(BRAID_INT32, BRAID_SUM, a, b, V{3, -2, kMin, kMax, -3000000, 0});
  check_reduce(BRAID_INT32, BRAID_PROD, V{-3, 65536, 46341, kMin, kMax, 100000},
               V{7, 65536, 46341, -1, kMax, -100000}, V{-21, 0, -2147479015, kMin, 1, -1410065408});
  check_reduce(BRAID_INT32, BRAID_MIN, a, b, V{1, -5, 1, kMin, -2000000, -7});
  check_reduce(BRAID_INT32, BRAID_MAX, a, b, V{2, 3, kMax, -1, -1000000, 7});
}

TEST(KernelsReduceKnown, UInt32) {
  using V = std::vector<uint32_t>;
  constexpr uint32_t kMax = std::numeric_limits<uint32_t>::max();
  const V a = {1, kMax, 0x80000000u, 0, 123456789};
  const V b = {2, 2, 0x80000000u, kMax, 987654321};
  check_reduce(BRAID_UINT32, BRAID_SUM, a, b, V{3, 1, 0, kMax, 1111111110});
  check_reduce(BRAID_UINT32, BRAID_PROD, V{3, 0x10000u, kMax, 0, 0x80000001u}, V{5, 0x10000u, kMax, 9, 2},
               V{15, 0, 1, 0, 2});
  check_reduce(BRAID_UINT32, BRAID_MIN, a, b, V{1, 2, 0x80000000u, 0, 123456789});
  check_reduce(BRAID_UINT32, BRAID_MAX, a, b, V{2, kMax, 0x80000000u, kMax, 987654321});
}

TEST(KernelsReduceKnown, Int64) {
  using V = std::vector<int64_t>;
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  const V a = {1, -5, kMax, kMin, int64_t{1} << 40, -3};
  const V b = {2, 3, 1, -1, int64_t{1} << 40, 3};
  check_reduce(BRAID_INT64, BRAID_SUM, a, b, V{3, -2, kMin, kMax, int64_t{1} << 41, 0});
  check_reduce(BRAID_INT64, BRAID_PROD, V{-3, int64_t{1} << 32, kMin, kMax, -1, 3037000500},
               V{7, int64_t{1} << 32, -1, kMax, -1, 3037000500}, V{-21, 0, kMin, 1, 1, -9223372036709301616});
  check_reduce(BRAID_INT64, BRAID_MIN, a, b, V{1, -5, 1, kMin, int64_t{1} << 40, -3});
  check_reduce(BRAID_INT64, BRAID_MAX, a, b, V{2, 3, kMax, -1, int64_t{1} << 40, 3});
}

TEST(KernelsReduceKnown, UInt64) {
  using V = std::vector<uint64_t>;
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  const V a = {1, kMax, uint64_t{1} << 63, 0, 5};
  const V b = {2, 1, uint64_t{1} << 63, kMax, 5};
  check_reduce(BRAID_UINT64, BRAID_SUM, a, b, V{3, 0, 0, kMax, 10});
  check_reduce(BRAID_UINT64, BRAID_PROD, V{3, kMax, uint64_t{1} << 32, 0, kMax},
               V{5, kMax, uint64_t{1} << 32, 7, 2}, V{15, 1, 0, 0, kMax - 1});
  check_reduce(BRAID_UINT64, BRAID_MIN, a, b, V{1, 1, uint64_t{1} << 63, 0, 5});
  check_reduce(BRAID_UINT64, BRAID_MAX, a, b, V{2, kMax, uint64_t{1} << 63, kMax, 5});
}

template <class F>
void check_float_known(braid_dtype_t dt) {
  using V = std::vector<F>;
  constexpr F kInf = std::numeric_limits<F>::infinity();
  const V a = {1.5, -2.0, 0.25, 1e10, -kInf, 3.0, -0.5};
  const V b = {2.25, 3.0, -0.125, 1e10, 5.0, -3.0, -0.75};
  check_reduce(dt, BRAID_SUM, a, b, V{3.75, 1.0, 0.125, 2e10, -kInf, 0.0, -1.25});
  check_reduce(dt, BRAID_AVG, a, b, V{3.75, 1.0, 0.125, 2e10, -kInf, 0.0, -1.25});  // AVG reduces as SUM
  check_reduce(dt, BRAID_PROD, a, b, V{3.375, -6.0, -0.03125, 1e20, -kInf, -9.0, 0.375});
  check_reduce(dt, BRAID_MIN, a, b, V{1.5, -2.0, -0.125, 1e10, -kInf, -3.0, -0.75});
  check_reduce(dt, BRAID_MAX, a, b, V{2.25, 3.0, 0.25, 1e10, 5.0, 3.0, -0.5});
}

TEST(KernelsReduceKnown, Float32) {
  check_float_known<float>(BRAID_FLOAT32);
  // float32 rounding: 2^24 + 1 is not representable; ties to even.
  check_reduce(BRAID_FLOAT32, BRAID_SUM, std::vector<float>{16777216.0f, 16777218.0f},
               std::vector<float>{1.0f, 1.0f}, std::vector<float>{16777216.0f, 16777220.0f});
}

TEST(KernelsReduceKnown, Float64) {
  check_float_known<double>(BRAID_FLOAT64);
  check_reduce(BRAID_FLOAT64, BRAID_SUM, std::vector<double>{9007199254740992.0, 9007199254740994.0},
               std::vector<double>{1.0, 1.0}, std::vector<double>{9007199254740992.0, 9007199254740996.0});
}

TEST(KernelsReduceKnown, Float16) {
  using V = std::vector<uint16_t>;
  // 1 + 2^-11 ties to 1.0; (1 + 2^-10) + 2^-11 ties up to 1 + 2^-9; 65504 + 65504
  // overflows; 2^-24 * 0.5 ties to 0; -2 + 0.5; 3 * -0.25; inf + 1.
  const V a = {0x3C00, 0x3C01, 0x7BFF, 0x0001, 0xC000, 0x4200, 0x7C00};
  const V b = {0x1000, 0x1000, 0x7BFF, 0x3800, 0x3800, 0xB400, 0x3C00};
  check_reduce(BRAID_FLOAT16, BRAID_SUM, a, b, V{0x3C00, 0x3C02, 0x7C00, 0x3800, 0xBE00, 0x4180, 0x7C00});
  check_reduce(BRAID_FLOAT16, BRAID_AVG, a, b, V{0x3C00, 0x3C02, 0x7C00, 0x3800, 0xBE00, 0x4180, 0x7C00});
  check_reduce(BRAID_FLOAT16, BRAID_PROD, a, b, V{0x1000, 0x1001, 0x7C00, 0x0000, 0xBC00, 0xBA00, 0x7C00});
  check_reduce(BRAID_FLOAT16, BRAID_MIN, a, b, V{0x1000, 0x1000, 0x7BFF, 0x0001, 0xC000, 0xB400, 0x3C00});
  check_reduce(BRAID_FLOAT16, BRAID_MAX, a, b, V{0x3C00, 0x3C01, 0x7BFF, 0x3800, 0x3800, 0x4200, 0x7C00});
  // Subnormal sums stay exact: 0x0001 + 0x03FF = 0x0400 (smallest normal).
  check_reduce(BRAID_FLOAT16, BRAID_SUM, V{0x0001, 0x8003}, V{0x03FF, 0x0001}, V{0x0400, 0x8002});
}

TEST(KernelsReduceKnown, BFloat16) {
  using V = std::vector<uint16_t>;
  // 1 + 2^-8 ties to 1.0; (1 + 2^-7) + 2^-8 ties up to 1 + 2^-6; max + max
  // overflows; -2 + 0.5; 3 * -0.25; inf + 1.
  const V a = {0x3F80, 0x3F81, 0x7F7F, 0xC000, 0x4040, 0x7F80};
  const V b = {0x3B80, 0x3B80, 0x7F7F, 0x3F00, 0xBE80, 0x3F80};
  check_reduce(BRAID_BFLOAT16, BRAID_SUM, a, b, V{0x3F80, 0x3F82, 0x7F80, 0xBFC0, 0x4030, 0x7F80});
  check_reduce(BRAID_BFLOAT16, BRAID_AVG, a, b, V{0x3F80, 0x3F82, 0x7F80, 0xBFC0, 0x4030, 0x7F80});
  check_reduce(BRAID_BFLOAT16, BRAID_PROD, a, b, V{0x3B80, 0x3B81, 0x7F80, 0xBF80, 0xBF40, 0x7F80});
  check_reduce(BRAID_BFLOAT16, BRAID_MIN, a, b, V{0x3B80, 0x3B80, 0x7F7F, 0xC000, 0xBE80, 0x3F80});
  check_reduce(BRAID_BFLOAT16, BRAID_MAX, a, b, V{0x3F80, 0x3F81, 0x7F7F, 0x3F00, 0x4040, 0x7F80});
}

// Sums and products whose results are subnormal, as the only such lane of
// a vector block or with others: AVX512_BF16's conversion would flush them
// to zero, so those blocks must round them as the scalar code does.
TEST(KernelsReduceKnown, BFloat16SubnormalResults) {
  using V = std::vector<uint16_t>;
  // 2^-130 + 2^-131 and 2^-64 * 2^-66 (subnormal), then 1 + 1 and 2 * 3.
  const V a = {0x0010, 0x8010, 0x1f80, 0x3f80, 0x4000, 0x0001, 0x0001, 0x0003};
  const V b = {0x0008, 0x0008, 0x1e80, 0x3f80, 0x4040, 0x0001, 0x8000, 0x3f80};
  for (braid_redop_t op : {BRAID_SUM, BRAID_PROD}) {
    V want(a.size());
    for (size_t i = 0; i < a.size(); ++i) {
      const float x = bfloat16_to_float(a[i]), y = bfloat16_to_float(b[i]);
      want[i] = float_to_bfloat16(op == BRAID_SUM ? x + y : x * y);
    }
    check_reduce(BRAID_BFLOAT16, op, a, b, want);
  }
  // The first one by hand: 2^-130 + 2^-131 = 0x0018.
  V one(1);
  const uint16_t x = 0x0010, y = 0x0008;
  reduce(BRAID_BFLOAT16, BRAID_SUM, one.data(), &x, &y, 1);
  EXPECT_EQ(one[0], 0x0018);
}

// MIN and MAX propagate a NaN from either side, for every floating type.
template <class T>
void check_nan_minmax(braid_dtype_t dt, T nan, T one, bool (*is_nan)(T)) {
  for (braid_redop_t op : {BRAID_MIN, BRAID_MAX, BRAID_SUM, BRAID_PROD}) {
    SCOPED_TRACE(name_of(dt, op));
    for (size_t n : {size_t{3}, size_t{999}}) {
      std::vector<T> a(n), b(n);
      for (size_t i = 0; i < n; ++i) {
        a[i] = (i % 3 == 1) ? one : nan;
        b[i] = (i % 3 == 0) ? one : nan;
      }
      std::vector<T> dst(n);
      reduce(dt, op, dst.data(), a.data(), b.data(), n);
      for (size_t i = 0; i < n; ++i) ASSERT_TRUE(is_nan(dst[i])) << i;
      reduce(dt, op, a.data(), a.data(), b.data(), n);
      for (size_t i = 0; i < n; ++i) ASSERT_TRUE(is_nan(a[i])) << i;
    }
  }
}

TEST(KernelsReduceKnown, NaNPropagates) {
  check_nan_minmax<float>(
      BRAID_FLOAT32, std::numeric_limits<float>::quiet_NaN(), 1.0f, +[](float x) { return std::isnan(x); });
  check_nan_minmax<double>(
      BRAID_FLOAT64, std::numeric_limits<double>::quiet_NaN(), 1.0, +[](double x) { return std::isnan(x); });
  check_nan_minmax<uint16_t>(BRAID_FLOAT16, 0x7E00, 0x3C00, half_is_nan);
  check_nan_minmax<uint16_t>(BRAID_FLOAT16, 0xFC01, 0x3C00, half_is_nan);  // signalling, negative
  check_nan_minmax<uint16_t>(BRAID_BFLOAT16, 0x7FC0, 0x3F80, bf16_is_nan);
  check_nan_minmax<uint16_t>(BRAID_BFLOAT16, 0x7F81, 0x3F80, bf16_is_nan);
}

// ---------------------------------------------------------------------------
// reduce() against an independent scalar reference: every dtype x op, counts
// around the block sizes, out of place / dst == a / dst == b, buffers at odd
// addresses, and guard bytes that must stay untouched.

template <class T>
T ref_int(braid_redop_t op, T a, T b) {
  switch (op) {
    case BRAID_SUM:
    case BRAID_AVG:
      return static_cast<T>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));  // modulo 2^width
    case BRAID_PROD:
      return static_cast<T>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
    case BRAID_MIN:
      return a < b ? a : b;
    case BRAID_BAND:
      return static_cast<T>(a & b);
    case BRAID_BOR:
      return static_cast<T>(a | b);
    case BRAID_BXOR:
      return static_cast<T>(a ^ b);
    default:
      return a > b ? a : b;
  }
}

template <class F>
F ref_float(braid_redop_t op, F a, F b) {
  switch (op) {
    case BRAID_SUM:
    case BRAID_AVG:
      return a + b;
    case BRAID_PROD:
      return a * b;
    case BRAID_MIN:
      if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<F>::quiet_NaN();
      return a < b ? a : b;
    default:
      if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<F>::quiet_NaN();
      return a > b ? a : b;
  }
}

template <class T>
T load_at(const unsigned char* p, size_t i) {
  T v;
  std::memcpy(&v, p + i * sizeof(T), sizeof(T));
  return v;
}
template <class T>
void store_at(unsigned char* p, size_t i, T v) {
  std::memcpy(p + i * sizeof(T), &v, sizeof(T));
}

// out[i] = a[i] op b[i], computed one element at a time in plain C++.
void reference_reduce(braid_dtype_t dt, braid_redop_t op, unsigned char* out, const unsigned char* a,
                      const unsigned char* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    switch (dt) {
      case BRAID_INT8:
        store_at(out, i, ref_int(op, load_at<int8_t>(a, i), load_at<int8_t>(b, i)));
        break;
      case BRAID_UINT8:
        store_at(out, i, ref_int(op, load_at<uint8_t>(a, i), load_at<uint8_t>(b, i)));
        break;
      case BRAID_INT32:
        store_at(out, i, ref_int(op, load_at<int32_t>(a, i), load_at<int32_t>(b, i)));
        break;
      case BRAID_UINT32:
        store_at(out, i, ref_int(op, load_at<uint32_t>(a, i), load_at<uint32_t>(b, i)));
        break;
      case BRAID_INT64:
        store_at(out, i, ref_int(op, load_at<int64_t>(a, i), load_at<int64_t>(b, i)));
        break;
      case BRAID_UINT64:
        store_at(out, i, ref_int(op, load_at<uint64_t>(a, i), load_at<uint64_t>(b, i)));
        break;
      case BRAID_FLOAT16:
        store_at(out, i,
                 float_to_half(ref_float(op, half_to_float(load_at<uint16_t>(a, i)),
                                         half_to_float(load_at<uint16_t>(b, i)))));
        break;
      case BRAID_BFLOAT16:
        store_at(out, i,
                 float_to_bfloat16(ref_float(op, bfloat16_to_float(load_at<uint16_t>(a, i)),
                                             bfloat16_to_float(load_at<uint16_t>(b, i)))));
        break;
      case BRAID_FLOAT32:
        store_at(out, i, ref_float(op, load_at<float>(a, i), load_at<float>(b, i)));
        break;
      case BRAID_FLOAT64:
        store_at(out, i, ref_float(op, load_at<double>(a, i), load_at<double>(b, i)));
        break;
      default:
        break;
    }
  }
}

bool element_is_nan(braid_dtype_t dt, const unsigned char* p, size_t i) {
  switch (dt) {
    case BRAID_FLOAT16:
      return half_is_nan(load_at<uint16_t>(p, i));
    case BRAID_BFLOAT16:
      return bf16_is_nan(load_at<uint16_t>(p, i));
    case BRAID_FLOAT32:
      return std::isnan(load_at<float>(p, i));
    case BRAID_FLOAT64:
      return std::isnan(load_at<double>(p, i));
    default:
      return false;
  }
}

// Bit-exact, except that any NaN matches any NaN (payloads are not specified).
::testing::AssertionResult same_elements(braid_dtype_t dt, const unsigned char* got,
                                         const unsigned char* want, size_t n) {
  const size_t es = elem_size(dt);
  for (size_t i = 0; i < n; ++i) {
    if (element_is_nan(dt, want, i)) {
      if (element_is_nan(dt, got, i)) continue;
      return ::testing::AssertionFailure() << "element " << i << ": expected NaN";
    }
    if (std::memcmp(got + i * es, want + i * es, es) != 0) {
      uint64_t g = 0, w = 0;
      std::memcpy(&g, got + i * es, es);
      std::memcpy(&w, want + i * es, es);
      return ::testing::AssertionFailure()
             << "element " << i << ": got bits 0x" << std::hex << g << ", expected 0x" << w;
    }
  }
  return ::testing::AssertionSuccess();
}

// Random inputs: raw random bits (every float class: NaN, inf, subnormals,
// huge and tiny), or small values whose sums and products are ordinary.
void fill_random(braid_dtype_t dt, unsigned char* p, size_t n, std::mt19937_64& rng, bool raw_bits) {
  if (raw_bits || !is_floating(dt)) {
    for (size_t i = 0; i < n * elem_size(dt); ++i) p[i] = static_cast<unsigned char>(rng());
    return;
  }
  std::uniform_int_distribution<int> small(-64, 64);
  for (size_t i = 0; i < n; ++i) {
    const double v = small(rng) / 8.0;
    switch (dt) {
      case BRAID_FLOAT16:
        store_at(p, i, float_to_half(static_cast<float>(v)));
        break;
      case BRAID_BFLOAT16:
        store_at(p, i, float_to_bfloat16(static_cast<float>(v)));
        break;
      case BRAID_FLOAT32:
        store_at(p, i, static_cast<float>(v));
        break;
      default:
        store_at(p, i, v);
        break;
    }
  }
}

enum class Alias { kNone, kDstIsA, kDstIsB };

TEST(KernelsReduceRandom, EveryDtypeOpCountAliasingAndAlignment) {
  std::mt19937_64 rng(12345);
  constexpr size_t kGuard = 64;
  for (braid_dtype_t dt : kAllDtypes) {
    const size_t es = elem_size(dt);
    for (braid_redop_t op : kAllOps) {
      if (!redop_supported(dt, op)) continue;
      for (size_t n : kCounts) {
        for (size_t misalign : {size_t{0}, size_t{1}}) {
          for (Alias alias : {Alias::kNone, Alias::kDstIsA, Alias::kDstIsB}) {
            for (bool raw_bits : {true, false}) {
              SCOPED_TRACE(name_of(dt, op) + " count " + std::to_string(n) + " misalign " +
                           std::to_string(misalign) + " alias " + std::to_string(static_cast<int>(alias)) +
                           (raw_bits ? " raw bits" : " small values"));
              const size_t bytes = n * es;
              // Buffers with guard zones on both sides, data at an odd offset when misaligned.
              std::vector<unsigned char> abuf(bytes + 2 * kGuard, 0xA5), bbuf(bytes + 2 * kGuard, 0x5A),
                  dbuf(bytes + 2 * kGuard, 0xC3);
              unsigned char* a = abuf.data() + kGuard + misalign;
              unsigned char* b = bbuf.data() + kGuard + misalign;
              fill_random(dt, a, n, rng, raw_bits);
              fill_random(dt, b, n, rng, raw_bits);
              std::vector<unsigned char> want(bytes + 1);
              reference_reduce(dt, op, want.data(), a, b, n);

              unsigned char* dst = alias == Alias::kDstIsA   ? a
                                   : alias == Alias::kDstIsB ? b
                                                             : dbuf.data() + kGuard + misalign;
              std::vector<unsigned char>& dbacking = alias == Alias::kDstIsA   ? abuf
                                                     : alias == Alias::kDstIsB ? bbuf
                                                                               : dbuf;
              const std::vector<unsigned char> before = dbacking;
              reduce(dt, op, dst, a, b, n);
              ASSERT_TRUE(same_elements(dt, dst, want.data(), n));
              // Nothing outside [dst, dst + bytes) changed.
              const size_t off = static_cast<size_t>(dst - dbacking.data());
              for (size_t i = 0; i < dbacking.size(); ++i) {
                if (i >= off && i < off + bytes) continue;
                ASSERT_EQ(dbacking[i], before[i]) << "byte " << i << " outside dst changed";
              }
            }
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// divide().

TEST(KernelsDivide, Float32AndFloat64) {
  std::vector<float> f = {3.0f, -6.0f, 1.0f, std::numeric_limits<float>::infinity(), 0.0f, 7.5f};
  divide(BRAID_FLOAT32, f.data(), f.data(), f.size(), 3);
  EXPECT_EQ(bit_patterns(f),
            bit_patterns(std::vector<float>{1.0f, -2.0f, 1.0f / 3.0f, std::numeric_limits<float>::infinity(),
                                            0.0f, 2.5f}));
  std::vector<double> d = {3.0, -6.0, 1.0, -std::numeric_limits<double>::infinity(), 0.0, 7.5};
  divide(BRAID_FLOAT64, d.data(), d.data(), d.size(), 3);
  EXPECT_EQ(bit_patterns(d), bit_patterns(std::vector<double>{
                                 1.0, -2.0, 1.0 / 3.0, -std::numeric_limits<double>::infinity(), 0.0, 2.5}));
  std::vector<float> nan = {std::numeric_limits<float>::quiet_NaN()};
  divide(BRAID_FLOAT32, nan.data(), nan.data(), 1, 4);
  EXPECT_TRUE(std::isnan(nan[0]));
}

TEST(KernelsDivide, Float16AndBFloat16RoundToNearestEven) {
  // 1/3 in float16 is 0x3555; 65504/2 = 32752 exact; 2^-24 / 2 ties to 0;
  // 3 * 2^-24 / 2 = 1.5 * 2^-24 ties up to 2 * 2^-24.
  std::vector<uint16_t> h = {0x3C00, 0x7BFF, 0x0001, 0x0003, 0xC000, 0x7C00};
  std::vector<uint16_t> h2 = h;
  divide(BRAID_FLOAT16, h.data(), h.data(), 1, 3);
  EXPECT_EQ(h[0], 0x3555);
  divide(BRAID_FLOAT16, h2.data(), h2.data(), h2.size(), 2);
  EXPECT_EQ(h2, (std::vector<uint16_t>{0x3800, 0x77FF, 0x0000, 0x0002, 0xBC00, 0x7C00}));
  // bfloat16: 1/3 -> 0x3EAB; 1/7 -> 0x3E12.
  std::vector<uint16_t> b = {0x3F80, 0x3F80, 0xC000};
  divide(BRAID_BFLOAT16, b.data(), b.data(), 2, 3);
  EXPECT_EQ(b[0], 0x3EAB);
  EXPECT_EQ(b[1], 0x3EAB);
  EXPECT_EQ(b[2], 0xC000);  // beyond count: untouched
  std::vector<uint16_t> b7 = {0x3F80};
  divide(BRAID_BFLOAT16, b7.data(), b7.data(), 1, 7);
  EXPECT_EQ(b7[0], 0x3E12);
}

TEST(KernelsDivide, MatchesReferenceForEveryCount) {
  std::mt19937_64 rng(777);
  for (braid_dtype_t dt : {BRAID_FLOAT16, BRAID_BFLOAT16, BRAID_FLOAT32, BRAID_FLOAT64}) {
    const size_t es = elem_size(dt);
    for (size_t n : kCounts) {
      for (int divisor : {1, 2, 3, 7, 8}) {
        for (bool raw_bits : {true, false}) {
          SCOPED_TRACE(name_of(dt, BRAID_AVG) + " count " + std::to_string(n) + " divisor " +
                       std::to_string(divisor));
          std::vector<unsigned char> buf(n * es + 1 + 16, 0xEE);
          unsigned char* data = buf.data() + 1;  // odd address
          fill_random(dt, data, n, rng, raw_bits);
          std::vector<unsigned char> want(n * es + 1);
          for (size_t i = 0; i < n; ++i) {
            switch (dt) {
              case BRAID_FLOAT16:
                store_at(
                    want.data(), i,
                    float_to_half(half_to_float(load_at<uint16_t>(data, i)) / static_cast<float>(divisor)));
                break;
              case BRAID_BFLOAT16:
                store_at(want.data(), i,
                         float_to_bfloat16(bfloat16_to_float(load_at<uint16_t>(data, i)) /
                                           static_cast<float>(divisor)));
                break;
              case BRAID_FLOAT32:
                store_at(want.data(), i, load_at<float>(data, i) / static_cast<float>(divisor));
                break;
              default:
                store_at(want.data(), i, load_at<double>(data, i) / static_cast<double>(divisor));
                break;
            }
          }
          // Out of place (the input untouched), then in place.
          const std::vector<unsigned char> input = buf;
          std::vector<unsigned char> out(buf.size(), 0xEE);
          divide(dt, data, out.data() + 1, n, divisor);
          ASSERT_TRUE(same_elements(dt, out.data() + 1, want.data(), n));
          ASSERT_EQ(buf, input);
          for (size_t i = n * es + 1; i < out.size(); ++i) ASSERT_EQ(out[i], 0xEE);
          ASSERT_EQ(out[0], 0xEE);
          divide(dt, data, data, n, divisor);
          ASSERT_TRUE(same_elements(dt, data, want.data(), n));
          for (size_t i = n * es + 1; i < buf.size(); ++i) ASSERT_EQ(buf[i], 0xEE);
          ASSERT_EQ(buf[0], 0xEE);
        }
      }
    }
  }
}

TEST(KernelsDivide, IntegerTypesAreLeftAlone) {
  for (braid_dtype_t dt : kAllDtypes) {
    if (is_floating(dt)) continue;
    std::vector<unsigned char> buf(1000 * elem_size(dt));
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<unsigned char>(i * 7);
    const std::vector<unsigned char> before = buf;
    divide(dt, buf.data(), buf.data(), 1000, 3);
    EXPECT_EQ(buf, before) << name_of(dt, BRAID_AVG);
  }
}

TEST(KernelsDivide, CountZeroTouchesNothing) {
  float x = 6.0f;
  divide(BRAID_FLOAT32, &x, &x, 0, 3);
  EXPECT_EQ(x, 6.0f);
  divide(BRAID_FLOAT32, nullptr, nullptr, 0, 3);
  reduce(BRAID_FLOAT32, BRAID_SUM, nullptr, nullptr, nullptr, 0);
}

TEST(KernelsCopy, StreamingCopyIsExactAtEveryAlignmentAndTouchesNothingElse) {
  // Sizes below, at and across the 16-byte head and 64-byte body steps; both
  // ends at every offset inside a 16-byte line.
  const size_t sizes[] = {0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1000, 4096 + 17, 70001};
  std::mt19937 rng(7);
  std::vector<unsigned char> src(70001 + 64), dst(70001 + 96);
  for (auto& b : src) b = static_cast<unsigned char>(rng());
  for (size_t n : sizes)
    for (size_t so = 0; so < 16; so += 5)
      for (size_t d_off = 0; d_off < 16; ++d_off) {
        std::fill(dst.begin(), dst.end(), 0xA5);
        unsigned char* d = dst.data() + 16 + d_off;
        copy_streaming(d, src.data() + so, n);
        ASSERT_EQ(std::memcmp(d, src.data() + so, n), 0) << n << " bytes, src+" << so << " dst+" << d_off;
        for (unsigned char* p = dst.data(); p < d; ++p) ASSERT_EQ(*p, 0xA5) << "wrote before dst";
        for (unsigned char* p = d + n; p < dst.data() + dst.size(); ++p)
          ASSERT_EQ(*p, 0xA5) << "wrote past dst";
      }
}

// A thread with denormals-are-zero set (torch.set_flush_denormal, binaries
// built with -ffast-math): min and max still return one of their inputs, bit
// for bit, in the vector body as in the tail (AVX-512's minps returned a
// subnormal bfloat16 as -0 there).
TEST(KernelsReduceKnown, MinMaxKeepSubnormalBitsUnderDenormalsAreZero) {
#if defined(__x86_64__)
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved | 0x8040);                                // DAZ | FTZ
  const size_t n = 65;                                       // vector blocks and a tail
  std::vector<uint16_t> a(n, 0x800c), b(n, 0x3f80), out(n);  // -subnormal, 1.0
  reduce(BRAID_BFLOAT16, BRAID_MIN, out.data(), a.data(), b.data(), n);
  std::vector<uint16_t> c(n, 0x0005), d(n, 0xbf80), out2(n);  // +subnormal, -1.0
  reduce(BRAID_BFLOAT16, BRAID_MAX, out2.data(), c.data(), d.data(), n);
  _mm_setcsr(saved);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(out[i], 0x800c) << "min, element " << i;
    ASSERT_EQ(out2[i], 0x0005) << "max, element " << i;
  }
#else
  GTEST_SKIP() << "x86 only (MXCSR)";
#endif
}

}  // namespace
}  // namespace braid::kernels
