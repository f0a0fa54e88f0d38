// The data the *_perf binaries check results against (bench/perf_common.h):
// a reduction done at another width, signedness or precision must give a
// result the check calls wrong. Such reductions passed before, as the
// inputs were small integers that every interpretation reads alike.
#include <braid/braid.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>

#include "bench/perf_common.h"

namespace {

using braid_perf::Reference;

constexpr int kRanks = 4;
constexpr size_t kCount = 1024;

uint64_t mask_of(unsigned width) {
  return width == 64 ? ~uint64_t{0} : (uint64_t{1} << width) - 1;
}

// Elements of the result where `reduce` (over the ranks' inputs) differs
// from the expected result.
template <class F>
size_t differing(const Reference& ref, F reduce) {
  size_t n = 0;
  for (size_t i = 0; i < kCount; ++i) n += reduce(i) != ref.reduced(i).bits;
  return n;
}

// Every bit of an integer type, the sign bit included, is 0 in some input
// and 1 in another (but prod's lowest).
TEST(PerfReference, IntegerInputsTakeEveryBit) {
  struct Case {
    braid_dtype_t dtype;
    unsigned width;
  };
  for (const Case c : {Case{BRAID_INT8, 8}, Case{BRAID_UINT8, 8}, Case{BRAID_INT32, 32},
                       Case{BRAID_UINT32, 32}, Case{BRAID_INT64, 64}, Case{BRAID_UINT64, 64}}) {
    for (braid_redop_t op : {BRAID_SUM, BRAID_PROD, BRAID_MAX, BRAID_BXOR}) {
      const Reference ref(c.dtype, true, op, kRanks, 0, 0, kCount);
      uint64_t any = 0, every = mask_of(c.width);
      for (int r = 0; r < kRanks; ++r) {
        for (size_t i = 0; i < kCount; ++i) {
          any |= ref.input(r, i).bits;
          every &= ref.input(r, i).bits;
        }
      }
      EXPECT_EQ(any, mask_of(c.width)) << braid_dtype_name(c.dtype) << " op " << op;
      // prod's inputs are odd (so that products do not run to 0).
      EXPECT_EQ(every, op == BRAID_PROD ? 1u : 0u) << braid_dtype_name(c.dtype) << " op " << op;
    }
  }
}

// uint8's max taken as int8's, and uint64's sum and max taken as two
// 32-bit lanes each, give results the check calls wrong.
TEST(PerfReference, AnotherWidthOrSignednessIsWrong) {
  const Reference max8(BRAID_UINT8, true, BRAID_MAX, kRanks, 0, 0, kCount);
  EXPECT_GT(differing(max8,
                      [&](size_t i) {
                        int8_t m = static_cast<int8_t>(max8.input(0, i).bits);
                        for (int r = 1; r < kRanks; ++r)
                          m = std::max(m, static_cast<int8_t>(max8.input(r, i).bits));
                        return uint64_t{static_cast<uint8_t>(m)};
                      }),
            kCount / 4);
  for (braid_redop_t op : {BRAID_SUM, BRAID_MAX}) {
    const Reference ref(BRAID_UINT64, true, op, kRanks, 0, 0, kCount);
    EXPECT_GT(differing(ref,
                        [&](size_t i) {
                          uint32_t lane[2] = {};
                          for (int r = 0; r < kRanks; ++r) {
                            for (int l = 0; l < 2; ++l) {
                              const auto v = static_cast<uint32_t>(ref.input(r, i).bits >> (32 * l));
                              lane[l] = r == 0 ? v : op == BRAID_SUM ? lane[l] + v : std::max(lane[l], v);
                            }
                          }
                          return uint64_t{lane[0]} | uint64_t{lane[1]} << 32;
                        }),
              kCount / 4)
        << "op " << op;
  }
  // The sum in the type's own width and signedness is what is expected.
  const Reference sum8(BRAID_INT8, true, BRAID_SUM, kRanks, 0, 0, kCount);
  EXPECT_EQ(differing(sum8,
                      [&](size_t i) {
                        uint8_t s = 0;
                        for (int r = 0; r < kRanks; ++r) s = static_cast<uint8_t>(s + sum8.input(r, i).bits);
                        return uint64_t{s};
                      }),
            0u);
}

// A float64 sum done in float32 differs from the expected one.
TEST(PerfReference, Float64NeedsMoreThanFloat32) {
  for (braid_redop_t op : {BRAID_SUM, BRAID_MAX}) {
    const Reference ref(BRAID_FLOAT64, true, op, kRanks, 0, 0, kCount);
    size_t differ = 0;
    for (size_t i = 0; i < kCount; ++i) {
      float acc = static_cast<float>(ref.input(0, i).real);
      for (int r = 1; r < kRanks; ++r) {
        const auto v = static_cast<float>(ref.input(r, i).real);
        acc = op == BRAID_SUM ? acc + v : std::max(acc, v);
      }
      differ += static_cast<double>(acc) != ref.reduced(i).real;
    }
    EXPECT_GT(differ, kCount / 4) << "op " << op;
  }
}

}  // namespace
