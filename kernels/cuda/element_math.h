// The arithmetic of the CUDA reduction kernels, one element at a time:
// how a stored element becomes a compute value and back (float16 and
// bfloat16 widen to float32), and the reductions. Everything here is
// __host__ __device__, so the host compiler builds the same templates for the
// tests that hold them to kernels/cpu's results (tests/cuda_kernels_test.cc).
//
// The rules are kernels/cpu's: integers wrap, floating MIN/MAX return NaN when
// either input is NaN, float16/bfloat16 round to nearest even, AVG reduces as
// SUM (the collective divides once). With k inputs the halves accumulate in
// float32 and round once, which for two inputs is exactly the CPU kernel.
#pragma once

#include <braid/braid.h>

#include <cstdint>
#include <type_traits>

#include <cstring>

#include "kernels/cpu/reduce_kernels.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define BRAID_HD __host__ __device__ __forceinline__
#else
#define BRAID_HD inline
#endif

namespace braid::cuda_math {

// A stored element whose compute value is itself.
template <class T>
struct Plain {
  using Stored = T;
  using Compute = T;
  static BRAID_HD Compute load(Stored s) { return s; }
  static BRAID_HD Stored store(Compute c) { return c; }
};

// float16: hardware conversions on the device (round to nearest even, as the
// CPU's); the CPU's own conversions on the host.
struct Half {
  using Stored = uint16_t;
  using Compute = float;
  static BRAID_HD Compute load(Stored s) {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(s));
#else
    return braid::kernels::half_to_float(s);
#endif
  }
  static BRAID_HD Stored store(Compute c) {
#if defined(__CUDA_ARCH__)
    return __half_as_ushort(__float2half_rn(c));
#else
    return braid::kernels::float_to_half(c);
#endif
  }
};

// bfloat16: the upper half of a float32; narrowing rounds to nearest even on
// the dropped 16 bits and quiets a NaN (never truncating it to infinity).
struct BFloat16 {
  using Stored = uint16_t;
  using Compute = float;
  static BRAID_HD Compute load(Stored s) { return bits_to_float(static_cast<uint32_t>(s) << 16); }
  static BRAID_HD Stored store(Compute c) {
    const uint32_t u = float_to_bits(c);
    if (c != c) return static_cast<Stored>((u >> 16) | 0x0040u);
    return static_cast<Stored>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }

 private:
  static BRAID_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
#endif
  }
  static BRAID_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
#endif
  }
};

// Integer arithmetic in the unsigned type of at least int's width: wraps
// instead of overflowing (signed overflow would be undefined).
template <class T>
using Wide = std::common_type_t<std::make_unsigned_t<T>, unsigned>;

struct Sum {
  template <class T>
  BRAID_HD void operator()(T& acc, T x) const {
    if constexpr (std::is_integral_v<T>)
      acc = static_cast<T>(static_cast<Wide<T>>(acc) + static_cast<Wide<T>>(x));
    else
      acc = acc + x;
  }
};
struct Prod {
  template <class T>
  BRAID_HD void operator()(T& acc, T x) const {
    if constexpr (std::is_integral_v<T>)
      acc = static_cast<T>(static_cast<Wide<T>>(acc) * static_cast<Wide<T>>(x));
    else
      acc = acc * x;
  }
};
struct Min {
  template <class T>
  BRAID_HD void operator()(T& acc, T x) const {
    if constexpr (std::is_integral_v<T>)
      acc = acc < x ? acc : x;
    else
      acc = (acc < x || acc != acc) ? acc : x;
  }
};
struct Max {
  template <class T>
  BRAID_HD void operator()(T& acc, T x) const {
    if constexpr (std::is_integral_v<T>)
      acc = acc > x ? acc : x;
    else
      acc = (acc > x || acc != acc) ? acc : x;
  }
};
struct Band {
  template <class T>
  BRAID_HD void operator()(T& acc, T x) const {
    acc = acc & x;
  }
};
struct Bor {
  template <class T>
  BRAID_HD void operator()(T& acc, T x) const {
    acc = acc | x;
  }
};
struct Bxor {
  template <class T>
  BRAID_HD void operator()(T& acc, T x) const {
    acc = acc ^ x;
  }
};

// Element i of the reduction of `nsrcs` inputs, as a stored element.
template <class E, class Op>
BRAID_HD typename E::Stored reduce_element(const typename E::Stored* const* srcs, int nsrcs, uint64_t i,
                                           Op op) {
  typename E::Compute acc = E::load(srcs[0][i]);
  for (int s = 1; s < nsrcs; ++s) op(acc, E::load(srcs[s][i]));
  return E::store(acc);
}

// x / divisor in the compute type (the AVG finish), as a stored element.
template <class E>
BRAID_HD typename E::Stored divide_element(typename E::Stored x, int divisor) {
  using C = typename E::Compute;
  return E::store(E::load(x) / static_cast<C>(divisor));
}

// Calls fn(E{}) with the element policy of `dtype` (one table for the
// kernels' dispatch and the tests); false for an unknown dtype.
template <class Fn>
bool visit_element(braid_dtype_t dtype, Fn&& fn) {
  switch (dtype) {
    case BRAID_INT8:
      return fn(Plain<int8_t>{}), true;
    case BRAID_UINT8:
      return fn(Plain<uint8_t>{}), true;
    case BRAID_INT32:
      return fn(Plain<int32_t>{}), true;
    case BRAID_UINT32:
      return fn(Plain<uint32_t>{}), true;
    case BRAID_INT64:
      return fn(Plain<int64_t>{}), true;
    case BRAID_UINT64:
      return fn(Plain<uint64_t>{}), true;
    case BRAID_FLOAT16:
      return fn(Half{}), true;
    case BRAID_BFLOAT16:
      return fn(BFloat16{}), true;
    case BRAID_FLOAT32:
      return fn(Plain<float>{}), true;
    case BRAID_FLOAT64:
      return fn(Plain<double>{}), true;
    default:
      return false;
  }
}

// Calls fn(Op{}) with the reduction `op` stands for on elements E (AVG
// reduces as SUM); false where `op` is not defined for E (AVG and the
// bitwise ops on the types kernels/cpu refuses them for).
template <class E, class Fn>
bool visit_op(braid_redop_t op, Fn&& fn) {
  constexpr bool integral = std::is_integral_v<typename E::Compute>;
  switch (op) {
    case BRAID_SUM:
      return fn(Sum{}), true;
    case BRAID_AVG:
      if constexpr (!integral) return fn(Sum{}), true;
      return false;
    case BRAID_PROD:
      return fn(Prod{}), true;
    case BRAID_MIN:
      return fn(Min{}), true;
    case BRAID_MAX:
      return fn(Max{}), true;
    case BRAID_BAND:
      if constexpr (integral) return fn(Band{}), true;
      return false;
    case BRAID_BOR:
      if constexpr (integral) return fn(Bor{}), true;
      return false;
    case BRAID_BXOR:
      if constexpr (integral) return fn(Bxor{}), true;
      return false;
    default:
      return false;
  }
}

}  // namespace braid::cuda_math
