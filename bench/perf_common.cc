#include "perf_common.h"  // includes <mpi.h> (C API only)

#include "flags.h"

#include <getopt.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

namespace braid_perf {
namespace {

// ---------------------------------------------------------------------------
// Element types

struct TypeInfo {
  braid_dtype_t dtype;
  const char* name;   // as printed (nccl-tests names)
  const char* alias;  // also accepted by -d, or nullptr
  size_t size;
  bool is_signed;  // holds negative values (signed integers and floats)
  bool is_float;
  double max_exact;  // sums of non-negative integers up to this are exact
  double epsilon;    // relative rounding unit, for the avg tolerance
};

// Indexed by braid_dtype_t.
constexpr TypeInfo kTypes[] = {
    {BRAID_INT8, "int8", nullptr, 1, true, false, 127, 0},
    {BRAID_UINT8, "uint8", nullptr, 1, false, false, 255, 0},
    {BRAID_INT32, "int32", nullptr, 4, true, false, 1 << 24, 0},
    {BRAID_UINT32, "uint32", nullptr, 4, false, false, 1 << 24, 0},
    {BRAID_INT64, "int64", nullptr, 8, true, false, 1 << 24, 0},
    {BRAID_UINT64, "uint64", nullptr, 8, false, false, 1 << 24, 0},
    {BRAID_FLOAT16, "half", "float16", 2, true, true, 2048, 0x1p-10},
    {BRAID_BFLOAT16, "bfloat16", nullptr, 2, true, true, 256, 0x1p-7},
    {BRAID_FLOAT32, "float", "float32", 4, true, true, 1 << 24, 0x1p-23},
    {BRAID_FLOAT64, "double", "float64", 8, true, true, 1 << 24, 0x1p-52},
};
static_assert(sizeof(kTypes) / sizeof(kTypes[0]) == BRAID_NUM_DTYPES);

const TypeInfo& type_info(braid_dtype_t dtype) {
  return kTypes[dtype];
}

// Indexed by braid_redop_t.
constexpr const char* kOpNames[] = {"sum", "prod", "min", "max", "avg", "band", "bor", "bxor"};
static_assert(sizeof(kOpNames) / sizeof(kOpNames[0]) == BRAID_NUM_OPS);

bool is_bitwise(braid_redop_t op) {
  return op == BRAID_BAND || op == BRAID_BOR || op == BRAID_BXOR;
}

// Whether braid defines `op` on a type: avg on floats, bitwise ops on integers.
bool op_defined(braid_redop_t op, const TypeInfo& ti) {
  return op == BRAID_AVG ? ti.is_float : is_bitwise(op) ? !ti.is_float : true;
}

// MPI's type for a braid dtype; false where MPI has none (float16, bfloat16).
bool mpi_type(braid_dtype_t dtype, MPI_Datatype* out) {
  switch (dtype) {
    case BRAID_INT8:
      *out = MPI_INT8_T;
      return true;
    case BRAID_UINT8:
      *out = MPI_UINT8_T;
      return true;
    case BRAID_INT32:
      *out = MPI_INT32_T;
      return true;
    case BRAID_UINT32:
      *out = MPI_UINT32_T;
      return true;
    case BRAID_INT64:
      *out = MPI_INT64_T;
      return true;
    case BRAID_UINT64:
      *out = MPI_UINT64_T;
      return true;
    case BRAID_FLOAT32:
      *out = MPI_FLOAT;
      return true;
    case BRAID_FLOAT64:
      *out = MPI_DOUBLE;
      return true;
    case BRAID_FLOAT16:
    case BRAID_BFLOAT16:
    case BRAID_NUM_DTYPES:
      break;
  }
  return false;
}

// MPI's reduction for a braid op; false where MPI has none (avg).
bool mpi_op(braid_redop_t op, MPI_Op* out) {
  switch (op) {
    case BRAID_SUM:
      *out = MPI_SUM;
      return true;
    case BRAID_PROD:
      *out = MPI_PROD;
      return true;
    case BRAID_MIN:
      *out = MPI_MIN;
      return true;
    case BRAID_MAX:
      *out = MPI_MAX;
      return true;
    case BRAID_BAND:
      *out = MPI_BAND;
      return true;
    case BRAID_BOR:
      *out = MPI_BOR;
      return true;
    case BRAID_BXOR:
      *out = MPI_BXOR;
      return true;
    case BRAID_AVG:
    case BRAID_NUM_OPS:
      break;
  }
  return false;
}

// float16 / bfloat16 storage and conversions (round to nearest even).
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

uint32_t float_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  return x;
}

float bits_float(uint32_t x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

uint16_t float_to_half(float f) {
  const uint32_t x = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t exp = (x >> 23) & 0xff;
  uint32_t mant = x & 0x7fffff;
  if (exp == 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);  // inf, nan
  const int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00;  // overflow
  if (e <= 0) {                         // half subnormal, or zero
    if (e < -10) return sign;
    mant |= 0x800000;
    const int shift = 14 - e;
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (h & 1))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;  // a carry rounds up into the exponent
  return static_cast<uint16_t>(sign | h);
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000 | (mant << 13));
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t float_to_bfloat16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet nan
  return static_cast<uint16_t>((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

float bfloat16_to_float(uint16_t b) {
  return bits_float(static_cast<uint32_t>(b) << 16);
}

// A Value as the type T stores it.
template <class T>
T from_value(const Value& v) {
  if constexpr (std::is_same_v<T, Half>) {
    return Half{float_to_half(static_cast<float>(v.real))};
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return BFloat16{float_to_bfloat16(static_cast<float>(v.real))};
  } else if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(v.bits);  // the low bits, two's complement
  } else {
    return static_cast<T>(v.real);
  }
}

template <class T>
double to_double(T v) {
  if constexpr (std::is_same_v<T, Half>) {
    return half_to_float(v.bits);
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return bfloat16_to_float(v.bits);
  } else {
    return static_cast<double>(v);
  }
}

// Calls f(std::type_identity<T>{}) with T the storage type of dtype.
template <class F>
void dispatch(braid_dtype_t dtype, F&& f) {
  switch (dtype) {
    case BRAID_INT8:
      return f(std::type_identity<int8_t>{});
    case BRAID_UINT8:
      return f(std::type_identity<uint8_t>{});
    case BRAID_INT32:
      return f(std::type_identity<int32_t>{});
    case BRAID_UINT32:
      return f(std::type_identity<uint32_t>{});
    case BRAID_INT64:
      return f(std::type_identity<int64_t>{});
    case BRAID_UINT64:
      return f(std::type_identity<uint64_t>{});
    case BRAID_FLOAT16:
      return f(std::type_identity<Half>{});
    case BRAID_BFLOAT16:
      return f(std::type_identity<BFloat16>{});
    case BRAID_FLOAT32:
      return f(std::type_identity<float>{});
    case BRAID_FLOAT64:
      return f(std::type_identity<double>{});
    case BRAID_NUM_DTYPES:
      break;
  }
  std::abort();
}

}  // namespace

// ---------------------------------------------------------------------------
// Reference data
//
// Element i of rank r is a function of r and of s = hash(i) mod M (M prime),
// through t = (s * (r mod (M - 1) + 1) + r) mod M: for every rank, t runs over
// all of [0, M) as s does, and ranks differ at the same index for most s.
// The small value v, from t:
// - data movement, min, max: M = 101, v = t (t - 50 for signed types). With
//   101 ranks or more, min and max saturate at the ends of that range.
// - sum, avg: M = K, the largest prime in [3, 13] with nranks * (K - 1) no more
//   than what the type holds exactly (int8 127, uint8 255, float16 2048,
//   bfloat16 256); v = t. If even K = 3 is too large (over 63 ranks in int8),
//   ranks from max_exact / 2 on contribute 0.
// - prod: M = the smallest prime >= max(11, nranks + 6); magnitude 2 where
//   (r + s) mod M < 6 (so at most 6 ranks per element, and every rank on 6 slots
//   in M), else 1; negative for odd t on signed types. |product| <= 64.
// Floating types hold v; float64 holds v * (1 + 2^-30) outside prod, exact in
// float64 and in its sums, but not in float32 (a reduction done in float32
// shows). Integer types hold a full-width bit pattern hashed from t (odd for
// prod): every bit, the sign bit included, takes both values, and the results
// follow the type's wraparound, so a reduction at another width or
// signedness shows. Every rank contributes there.
// The reduction over ranks depends only on s, so it is tabulated once per run.

namespace {

uint64_t mix64(uint64_t z) {  // splitmix64's finaliser
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// `bits` at `width` as a signed value.
int64_t sign_extend(uint64_t bits, unsigned width) {
  const unsigned shift = 64 - width;
  return static_cast<int64_t>(bits << shift) >> shift;
}

}  // namespace

Reference::Reference(braid_dtype_t dtype, bool reduces, braid_redop_t op, int nranks, int rank, int root,
                     size_t count)
    : signed_(type_info(dtype).is_signed),
      integer_(!type_info(dtype).is_float),
      wide_float_(dtype == BRAID_FLOAT64),
      width_(static_cast<unsigned>(8 * type_info(dtype).size)),
      mask_(width_ == 64 ? ~uint64_t{0} : (uint64_t{1} << width_) - 1),
      nranks_(nranks),
      rank_(rank),
      root_(root),
      count_(count) {
  const TypeInfo& ti = type_info(dtype);
  sum_cap_ = static_cast<uint64_t>(nranks);
  if (!reduces || op == BRAID_MIN || op == BRAID_MAX || is_bitwise(op)) {
    kind_ = Kind::kSpread;
    modulus_ = 101;
  } else if (op == BRAID_PROD) {
    kind_ = Kind::kProd;
    modulus_ = std::max(11u, static_cast<unsigned>(nranks) + 6);
    for (;; ++modulus_) {
      bool prime = true;
      for (unsigned d = 2; d * d <= modulus_ && prime; ++d) prime = modulus_ % d != 0;
      if (prime) break;
    }
  } else {
    kind_ = Kind::kSum;
    const double limit = std::floor(ti.max_exact / nranks) + 1;
    modulus_ = 3;
    for (unsigned prime : {5u, 7u, 11u, 13u}) {
      if (prime <= limit) modulus_ = prime;
    }
    if (!integer_) sum_cap_ = static_cast<uint64_t>(ti.max_exact) / (modulus_ - 1);
  }
  if (!reduces) return;

  reduced_.resize(modulus_);
  for (unsigned s = 0; s < modulus_; ++s) {
    Value acc = value(0, s);
    for (int r = 1; r < nranks; ++r) {
      const Value v = value(r, s);
      if (integer_) {
        const bool less =
            signed_ ? sign_extend(v.bits, width_) < sign_extend(acc.bits, width_) : v.bits < acc.bits;
        switch (op) {
          case BRAID_SUM:
            acc.bits += v.bits;
            break;
          case BRAID_PROD:
            acc.bits *= v.bits;
            break;
          case BRAID_MIN:
            if (less) acc = v;
            break;
          case BRAID_MAX:
            if (!less && v.bits != acc.bits) acc = v;
            break;
          case BRAID_BAND:
            acc.bits &= v.bits;
            break;
          case BRAID_BOR:
            acc.bits |= v.bits;
            break;
          case BRAID_BXOR:
            acc.bits ^= v.bits;
            break;
          case BRAID_AVG:  // not defined for integers (refused at parsing)
          case BRAID_NUM_OPS:
            break;
        }
        acc.bits &= mask_;
        continue;
      }
      switch (op) {
        case BRAID_SUM:
        case BRAID_AVG:
          acc.real += v.real;
          break;
        case BRAID_PROD:
          acc.real *= v.real;
          break;
        case BRAID_MIN:
          acc.real = std::min(acc.real, v.real);
          break;
        case BRAID_MAX:
          acc.real = std::max(acc.real, v.real);
          break;
        case BRAID_BAND:  // bitwise ops are not defined for floats (refused at parsing)
        case BRAID_BOR:
        case BRAID_BXOR:
        case BRAID_NUM_OPS:
          break;
      }
    }
    if (op == BRAID_AVG) acc.real /= nranks;
    reduced_[s] = acc;
  }
  if (op == BRAID_AVG) {
    // The sums are exact (the values are chosen so), and braid divides once:
    // one rounding of a result below M, two where a division multiplies by a
    // rounded reciprocal. Anything looser would pass a rank's lost share
    // (t / nranks, up to (M - 1) / nranks).
    tolerance_ = 2 * ti.epsilon * (modulus_ - 1);
  }
}

uint64_t Reference::ordinal(int src, unsigned s) const {
  const uint64_t r = static_cast<uint64_t>(src);
  return (static_cast<uint64_t>(s) * (r % (modulus_ - 1) + 1) + r) % modulus_;
}

double Reference::small_value(int src, unsigned s) const {
  const uint64_t r = static_cast<uint64_t>(src);
  const uint64_t t = ordinal(src, s);
  switch (kind_) {
    case Kind::kSpread:
      return signed_ ? static_cast<double>(t) - 50 : static_cast<double>(t);
    case Kind::kSum:
      return r < sum_cap_ ? static_cast<double>(t) : 0;
    case Kind::kProd: {
      const double magnitude = (r + s) % modulus_ < 6 ? 2 : 1;
      return (signed_ && (t & 1)) ? -magnitude : magnitude;
    }
  }
  return 0;
}

Value Reference::value(int src, unsigned s) const {
  Value out;
  if (integer_) {
    // Prod's patterns are odd, so that products do not run to 0 as factors
    // of 2 pile up.
    const uint64_t pattern = mix64(ordinal(src, s) + 1000 * static_cast<uint64_t>(kind_));
    out.bits = (kind_ == Kind::kProd ? pattern | 1 : pattern) & mask_;
    return out;
  }
  const double v = small_value(src, s);
  out.real = wide_float_ && kind_ != Kind::kProd ? v * (1 + 0x1p-30) : v;
  return out;
}

namespace {

// ---------------------------------------------------------------------------
// Options

struct Options : braid_bench::Sweep {
  std::vector<braid_dtype_t> dtypes{BRAID_FLOAT32};
  std::vector<braid_redop_t> ops{BRAID_SUM};
  long root = 0;                  // -1: every root
  bool compare_mpi = false;       // --compare mpi
  bool register_buffers = false;  // -R 1: buffers from braid_mem_alloc, registered on every communicator
  // --algos: one communicator per entry (BRAID_ALGO=<collective>:<entry>;
  // "auto" leaves the choice to the tuner), timed in turn at every size.
  std::vector<std::string> algos;
  // --trace-compare: an untraced and a traced communicator (BRAID_TRACE_FILE
  // set to this pattern), timed in turn at every size.
  std::string trace_pattern;
  // --env-compare: a communicator made under the environment as launched and
  // one made with NAME set to VALUE, timed in turn at every size.
  std::string env_name, env_value;
  // --rounds: interleaved turns, best kept, of --algos / --trace-compare /
  // --env-compare (default 3) and of braid and MPI under --compare (default 1).
  long rounds = 0;
  long rounds_or(long unset) const { return rounds > 0 ? rounds : unset; }
};

// One communicator of a side-by-side run (--algos, --trace-compare,
// --env-compare): made while one environment variable holds `value` (or is
// unset); no variable: the environment as launched.
struct Variant {
  std::string label;
  std::string variable;
  bool set;
  std::string value;
};

std::vector<Variant> variants_of(const Options& opt, const char* collective) {
  std::vector<Variant> out;
  for (const std::string& a : opt.algos)
    out.push_back({a, "BRAID_ALGO", a != "auto", std::string(collective) + ":" + a});
  if (!opt.trace_pattern.empty()) {
    out.push_back({"untraced", "BRAID_TRACE_FILE", false, ""});
    out.push_back({"traced", "BRAID_TRACE_FILE", true, opt.trace_pattern});
  }
  if (!opt.env_name.empty()) {
    out.push_back({"launched", "", false, ""});
    out.push_back({"variant", opt.env_name, true, opt.env_value});
  }
  return out;
}

// The flag that asked for the side-by-side columns, and the ratio it prints
// (second column over first; none for --algos).
const char* variants_flag(const Options& opt) {
  return !opt.algos.empty() ? "--algos" : !opt.trace_pattern.empty() ? "--trace-compare" : "--env-compare";
}
const char* variants_ratio(const Options& opt) {
  return !opt.trace_pattern.empty() ? "traced/untraced"
         : !opt.env_name.empty()    ? "variant/launched"
                                    : nullptr;
}

// The collectives whose algorithm BRAID_ALGO chooses.
bool has_algorithms(const char* name) {
  for (const char* c : {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter"})
    if (std::strcmp(name, c) == 0) return true;
  return false;
}

void print_usage(FILE* out, const char* prog, const CollDesc& desc) {
  std::fprintf(out,
               "Usage: %s [options]\n"
               "  Launch with mpirun, one process per rank. Sizes take K, M, G suffixes (powers of 1024).\n"
               "  -b, --minbytes <size>      smallest size (default 8)\n"
               "  -e, --maxbytes <size>      largest size (default 64M)\n"
               "  -f, --stepfactor <n>       multiply the size by n (>= 2) between steps (default 2)\n"
               "  -i, --stepbytes <size>     add this many bytes between steps instead of -f\n"
               "  -n, --iters <n>            timed iterations per size (default 20)\n"
               "  -w, --warmup_iters <n>     untimed iterations before them (default 5)\n"
               "  -c, --check <0|1>          check the results (default 1)\n"
               "  -d, --datatype <type>      int8 uint8 int32 uint32 int64 uint64 half|float16 bfloat16\n"
               "                             float|float32 double|float64, or all (default float)\n"
               "  -o, --op <op>              sum prod min max avg band bor bxor, or all (default sum)%s\n"
               "  -r, --root <rank>          root rank, or all (default 0)%s\n"
               "  -R, --register <0|1>       1: buffers from braid_mem_alloc, registered on every\n"
               "                             communicator (braid_comm_register; default 0)\n"
               "      --compare mpi          also run each size through MPI's own collective (out of\n"
               "                             place, same buffers and iterations) and print its time,\n"
               "                             busbw and braid's busbw / MPI's\n"
               "      --algos a,b,...        time each algorithm (BRAID_ALGO=<collective>:a; auto: the\n"
               "                             tuner's choice) side by side, out of place: one\n"
               "                             communicator each, taking turns at every size\n"
               "      --trace-compare <path> time an untraced and a traced communicator side by side\n"
               "                             (BRAID_TRACE_FILE=<path>, %%r: rank), out of place, taking\n"
               "                             turns at every size; prints traced / untraced\n"
               "      --env-compare NAME=VALUE  time a communicator made with the environment as\n"
               "                             launched and one made with NAME=VALUE (a BRAID_* setting)\n"
               "                             side by side, out of place, taking turns at every size;\n"
               "                             prints variant / launched\n"
               "      --rounds <n>           turns per column and size of --algos, --trace-compare or\n"
               "                             --env-compare (default 3), or of braid and MPI under\n"
               "                             --compare (default 1), best kept\n"
               "  -h, --help                 this text\n",
               prog, desc.reduces ? "" : "; ignored here", desc.rooted ? "" : "; ignored here");
}

using braid_bench::parse_long;
using braid_bench::parse_size;

enum class ParseResult { kRun, kHelp, kError };

constexpr int kCompareFlag = 0x100;  // --compare: long form only
constexpr int kAlgosFlag = 0x101, kRoundsFlag = 0x102, kTraceCompareFlag = 0x103, kEnvCompareFlag = 0x104;

ParseResult parse_args(int argc, char** argv, const CollDesc& desc, Options* opt, std::string* error) {
  static const option kLongOptions[] = {{"minbytes", required_argument, nullptr, 'b'},
                                        {"maxbytes", required_argument, nullptr, 'e'},
                                        {"stepfactor", required_argument, nullptr, 'f'},
                                        {"stepbytes", required_argument, nullptr, 'i'},
                                        {"iters", required_argument, nullptr, 'n'},
                                        {"warmup_iters", required_argument, nullptr, 'w'},
                                        {"check", required_argument, nullptr, 'c'},
                                        {"datatype", required_argument, nullptr, 'd'},
                                        {"op", required_argument, nullptr, 'o'},
                                        {"root", required_argument, nullptr, 'r'},
                                        {"register", required_argument, nullptr, 'R'},
                                        {"compare", required_argument, nullptr, kCompareFlag},
                                        {"algos", required_argument, nullptr, kAlgosFlag},
                                        {"rounds", required_argument, nullptr, kRoundsFlag},
                                        {"trace-compare", required_argument, nullptr, kTraceCompareFlag},
                                        {"env-compare", required_argument, nullptr, kEnvCompareFlag},
                                        {"help", no_argument, nullptr, 'h'},
                                        {nullptr, 0, nullptr, 0}};
  auto fail = [&](const std::string& flag, const std::string& why) {
    *error = flag + ": " + why;
    return ParseResult::kError;
  };
  bool dtype_all = false, op_all = false;
  opterr = 0;
  optind = 1;
  for (;;) {
    const int c = getopt_long(argc, argv, ":b:e:f:i:n:w:c:d:o:r:R:h", kLongOptions, nullptr);
    if (c == -1) break;
    // The flag as the user wrote it when getopt rejected it, else its short form.
    auto long_name = [](int f) -> const char* {
      return f == kCompareFlag        ? "--compare"
             : f == kAlgosFlag        ? "--algos"
             : f == kRoundsFlag       ? "--rounds"
             : f == kTraceCompareFlag ? "--trace-compare"
             : f == kEnvCompareFlag   ? "--env-compare"
                                      : nullptr;
    };
    std::string flag = long_name(c) ? long_name(c) : "-" + std::string(1, static_cast<char>(c));
    if (c == '?' || c == ':') {
      flag = long_name(optopt)                            ? long_name(optopt)
             : optopt != 0 && (c == '?' || optind > argc) ? "-" + std::string(1, static_cast<char>(optopt))
                                                          : std::string(argv[optind - 1]);
    }
    const char* arg = optarg;
    switch (c) {
      case 'd': {
        opt->dtypes.clear();
        dtype_all = std::strcmp(arg, "all") == 0;
        for (const TypeInfo& ti : kTypes) {
          if (dtype_all || std::strcmp(arg, ti.name) == 0 || (ti.alias && std::strcmp(arg, ti.alias) == 0)) {
            opt->dtypes.push_back(ti.dtype);
          }
        }
        if (opt->dtypes.empty()) return fail(flag, "unknown datatype '" + std::string(arg) + "'");
        break;
      }
      case 'o': {
        opt->ops.clear();
        op_all = std::strcmp(arg, "all") == 0;
        for (int op = 0; op < BRAID_NUM_OPS; ++op) {
          if (op_all || std::strcmp(arg, kOpNames[op]) == 0) {
            opt->ops.push_back(static_cast<braid_redop_t>(op));
          }
        }
        if (opt->ops.empty()) return fail(flag, "unknown reduction op '" + std::string(arg) + "'");
        break;
      }
      case 'r':
        if (std::strcmp(arg, "all") == 0) {
          opt->root = -1;
        } else if (!parse_long(arg, -1, 1L << 30, &opt->root)) {
          return fail(flag, "the root must be a rank, all, or -1 (all)");
        }
        break;
      case 'R': {
        long v = 0;
        if (!parse_long(arg, 0, 1, &v)) return fail(flag, "expected 0 or 1");
        opt->register_buffers = v == 1;
        break;
      }
      case kCompareFlag:
        if (std::strcmp(arg, "mpi") != 0) {
          return fail(flag, "unknown comparison '" + std::string(arg) + "' (expected mpi)");
        }
        opt->compare_mpi = true;
        break;
      case kAlgosFlag: {
        if (!has_algorithms(desc.name))
          return fail(flag, std::string(desc.name) + " has no algorithms to choose");
        opt->algos.clear();
        for (std::string& a : braid_bench::split_list(arg))
          if (!a.empty()) opt->algos.push_back(std::move(a));
        if (opt->algos.empty()) return fail(flag, "no algorithm named");
        break;
      }
      case kRoundsFlag:
        if (!parse_long(arg, 1, 1000, &opt->rounds)) return fail(flag, "expected 1 to 1000 rounds");
        break;
      case kTraceCompareFlag:
        if (*arg == '\0') return fail(flag, "no trace path given");
        opt->trace_pattern = arg;
        break;
      case kEnvCompareFlag: {
        const char* eq = std::strchr(arg, '=');
        opt->env_name.assign(arg, eq != nullptr ? static_cast<size_t>(eq - arg) : std::strlen(arg));
        if (eq == nullptr || opt->env_name.rfind("BRAID_", 0) != 0 || opt->env_name.size() == 6)
          return fail(flag, "expected BRAID_NAME=VALUE, got '" + std::string(arg) + "'");
        opt->env_value = eq + 1;
        break;
      }
      case 'h':
        return ParseResult::kHelp;
      case ':':
        return fail(flag, "missing value");
      default:
        if (std::string why; !braid_bench::take_sweep_flag(c, arg, opt, &why)) return fail(flag, why);
        break;
    }
  }
  if (optind < argc) return fail(argv[optind], "unexpected argument");
  if (std::string bad_flag, why; !braid_bench::finish_sweep(opt, &bad_flag, &why)) return fail(bad_flag, why);
  if (!opt->algos.empty() && opt->compare_mpi) return fail("--algos", "cannot be combined with --compare");
  if (!opt->trace_pattern.empty() && opt->compare_mpi)
    return fail("--trace-compare", "cannot be combined with --compare");
  if (!opt->trace_pattern.empty() && !opt->algos.empty())
    return fail("--trace-compare", "cannot be combined with --algos");
  if (!opt->env_name.empty() && (opt->compare_mpi || !opt->algos.empty() || !opt->trace_pattern.empty()))
    return fail("--env-compare", "cannot be combined with --compare, --algos or --trace-compare");
  if (desc.reduces && !dtype_all && !op_all && !op_defined(opt->ops[0], type_info(opt->dtypes[0]))) {
    return fail("-o", std::string(kOpNames[opt->ops[0]]) + " is not defined for " +
                          type_info(opt->dtypes[0]).name +
                          " (avg needs a floating type, band/bor/bxor an integer type)");
  }
  return ParseResult::kRun;
}

// ---------------------------------------------------------------------------
// Running

constexpr size_t kGuardBytes = 64;
constexpr unsigned char kGuardByte = 0x5a;
constexpr unsigned char kPoisonByte = 0xff;  // nan in every float type

struct Context {
  const CollDesc& desc;
  const Options& opt;
  braid_comm_t comm;
  MPI_Comm mpi_comm;  // --compare mpi: a duplicate of MPI_COMM_WORLD, else MPI_COMM_NULL
  int rank;
  int nranks;
  const char* host;
  unsigned char* sendbuf;  // max_bytes + kGuardBytes each
  unsigned char* recvbuf;  // also the in-place buffer
};

[[noreturn]] void die(const Context& ctx, const char* what, braid_result_t result) {
  const char* detail = ctx.comm != nullptr ? braid_comm_get_last_error(ctx.comm) : nullptr;
  if (detail == nullptr || detail[0] == '\0') detail = braid_get_last_error();
  if (detail == nullptr) detail = "";
  std::fprintf(stderr, "braid-tests: rank %d on %s: %s failed: %s%s%s\n", ctx.rank, ctx.host, what,
               braid_get_error_string(result), detail[0] ? ": " : "", detail);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

size_t span_elems(Span span, size_t count, int nranks) {
  return span == Span::kCount ? count : count * static_cast<size_t>(nranks);
}

// Where one iteration's data lives.
struct Layout {
  unsigned char* send;
  size_t send_elems;
  unsigned char* recv;
  size_t recv_elems;
};

Layout make_layout(const Context& ctx, size_t count, size_t elem, bool in_place) {
  const size_t se = span_elems(ctx.desc.send_span, count, ctx.nranks);
  const size_t re = span_elems(ctx.desc.recv_span, count, ctx.nranks);
  if (!in_place) return {ctx.sendbuf, se, ctx.recvbuf, re};
  const size_t block = static_cast<size_t>(ctx.rank) * count * elem;
  return {ctx.recvbuf + (se < re ? block : 0), se, ctx.recvbuf + (re < se ? block : 0), re};
}

void fill_input(void* buf, size_t n, braid_dtype_t dtype, const Reference& ref) {
  dispatch(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    std::vector<T> by_slot(ref.slots());
    for (unsigned s = 0; s < ref.slots(); ++s) by_slot[s] = from_value<T>(ref.value(ref.rank(), s));
    T* p = static_cast<T*>(buf);
    for (size_t j = 0; j < n; ++j) p[j] = by_slot[ref.slot(j)];
  });
}

long long count_wrong(const void* buf, size_t n, braid_dtype_t dtype, const Reference& ref,
                      const CollDesc& desc) {
  long long wrong = 0;
  const double tol = ref.tolerance();
  dispatch(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* p = static_cast<const T*>(buf);
    for (size_t j = 0; j < n; ++j) {
      if constexpr (std::is_integral_v<T>) {
        wrong += p[j] != from_value<T>(desc.expected(ref, j));
      } else {
        if (!(std::fabs(to_double(p[j]) - desc.expected(ref, j).real) <= tol))
          ++wrong;  // nan counts as wrong
      }
    }
  });
  return wrong;
}

long long count_guard(const unsigned char* end) {
  long long hit = 0;
  for (size_t i = 0; i < kGuardBytes; ++i) hit += end[i] != kGuardByte;
  return hit;
}

// Before the checked iteration, each integer output element gets a value
// that differs from what it should hold (its expected value with bits
// flipped): 0xff bytes are -1 in signed types, a value bor, band and sums
// legitimately produce, so an element braid never wrote could pass. Float
// elements keep the poison bytes, a nan, which never passes.
void poison_integers(void* buf, size_t n, braid_dtype_t dtype, const Reference& ref, const CollDesc& desc) {
  dispatch(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_integral_v<T>) {
      T* p = static_cast<T*>(buf);
      for (size_t j = 0; j < n; ++j) p[j] = static_cast<T>(from_value<T>(desc.expected(ref, j)) ^ T{0x5a});
    }
  });
}

// Input in the send region, poison in the recv region (so stale results from the
// timed iterations cannot pass the check), guard bytes after each used region.
// `check`: the iteration whose output is checked (see poison_integers).
void prepare(const Context& ctx, const Layout& l, size_t elem, bool in_place, const Reference& ref,
             braid_dtype_t dtype, bool check) {
  if (in_place) {
    const size_t used = std::max(l.send_elems, l.recv_elems) * elem;
    std::memset(ctx.recvbuf, kPoisonByte, used);
    std::memset(ctx.recvbuf + used, kGuardByte, kGuardBytes);
  } else {
    std::memset(l.send + l.send_elems * elem, kGuardByte, kGuardBytes);
    std::memset(l.recv, kPoisonByte, l.recv_elems * elem);
    std::memset(l.recv + l.recv_elems * elem, kGuardByte, kGuardBytes);
  }
  if (check) poison_integers(l.recv, l.recv_elems, dtype, ref, ctx.desc);
  fill_input(l.send, l.send_elems, dtype, ref);
}

long long guard_hits(const Context& ctx, const Layout& l, size_t elem, bool in_place) {
  if (in_place) return count_guard(ctx.recvbuf + std::max(l.send_elems, l.recv_elems) * elem);
  return count_guard(l.send + l.send_elems * elem) + count_guard(l.recv + l.recv_elems * elem);
}

// Elements of `now` that differ from `before` (as long as it, elem bytes
// each).
long long changed_elements(const std::vector<unsigned char>& before, const unsigned char* now, size_t elem) {
  long long changed = 0;
  for (size_t at = 0; at < before.size(); at += elem)
    changed += std::memcmp(&before[at], now + at, elem) != 0;
  return changed;
}

double now_seconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Measurement {
  double time_us;           // max over ranks
  long long wrong;          // summed over ranks; -1 when not checked
  long long out_of_bounds;  // guard bytes overwritten, summed over ranks
};

// -w untimed iterations, a barrier, then the mean time of -n iterations in
// microseconds, the largest over the ranks. The same for braid and for MPI.
template <class F>
double time_iterations(const Context& ctx, F&& run_once) {
  for (long i = 0; i < ctx.opt.warmup; ++i) run_once();
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = now_seconds();
  for (long i = 0; i < ctx.opt.iters; ++i) run_once();
  const double local_us = (now_seconds() - t0) * 1e6 / static_cast<double>(ctx.opt.iters);
  double time_us = 0;
  MPI_Allreduce(&local_us, &time_us, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return time_us;
}

Measurement measure(const Context& ctx, braid_dtype_t dtype, braid_redop_t op, int root, size_t count,
                    bool in_place) {
  const size_t elem = type_info(dtype).size;
  const Reference ref(dtype, ctx.desc.reduces, op, ctx.nranks, ctx.rank, root, count);
  const Layout l = make_layout(ctx, count, elem, in_place);
  const RunArgs args{l.send, l.recv, count, dtype, op, root, ctx.rank, ctx.nranks, ctx.comm};
  auto run_once = [&] {
    const braid_result_t r = ctx.desc.run(args);
    if (r != BRAID_SUCCESS) die(ctx, ctx.desc.call, r);
  };

  prepare(ctx, l, elem, in_place, ref, dtype, false);
  Measurement m{0, -1, 0};
  m.time_us = time_iterations(ctx, run_once);
  if (!ctx.opt.check) return m;

  prepare(ctx, l, elem, in_place, ref, dtype, true);
  // Out of place, the call must leave its input alone, and where only the
  // root gets a result, the other ranks' output too: what else the call
  // writes counts as out of bounds (as the guard bytes do).
  const bool output_untouched = ctx.desc.result_on_root_only && ctx.rank != root;
  std::vector<unsigned char> input_before, output_before;
  if (!in_place) {
    input_before.assign(l.send, l.send + l.send_elems * elem);
    if (output_untouched) output_before.assign(l.recv, l.recv + l.recv_elems * elem);
  }
  run_once();
  long long local[2] = {0, guard_hits(ctx, l, elem, in_place)};
  local[1] += changed_elements(input_before, l.send, elem) + changed_elements(output_before, l.recv, elem);
  if (!ctx.desc.result_on_root_only || ctx.rank == root) {
    local[0] = count_wrong(l.recv, l.recv_elems, dtype, ref, ctx.desc);
  }
  long long global[2] = {0, 0};
  MPI_Allreduce(local, global, 2, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  m.wrong = global[0];
  m.out_of_bounds = global[1];
  return m;
}

// --compare mpi: the same out-of-place iteration through MPI on the same
// buffers and inputs, timed the same way. Returns MPI's time in microseconds,
// or -1 where MPI has no equivalent (float16, bfloat16, avg, a count over
// INT_MAX). MPI's results are not checked.
double measure_mpi(const Context& ctx, braid_dtype_t dtype, braid_redop_t op, int root, size_t count) {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op mop = MPI_OP_NULL;
  if (!mpi_type(dtype, &type) || (ctx.desc.reduces && !mpi_op(op, &mop)) ||
      count > static_cast<size_t>(INT_MAX)) {
    return -1;
  }
  const size_t elem = type_info(dtype).size;
  const Reference ref(dtype, ctx.desc.reduces, op, ctx.nranks, ctx.rank, root, count);
  const Layout l = make_layout(ctx, count, elem, false);
  MpiArgs args{};
  args.sendbuf = l.send;
  args.recvbuf = l.recv;
  args.count = static_cast<int>(count);
  args.dtype = type;
  args.op = mop;
  args.root = root;
  args.rank = ctx.rank;
  args.nranks = ctx.nranks;
  args.comm = ctx.mpi_comm;
  auto run_once = [&] {
    const int r = ctx.desc.mpi(args);
    if (r != MPI_SUCCESS) {
      char msg[MPI_MAX_ERROR_STRING] = "";
      int len = 0;
      MPI_Error_string(r, msg, &len);
      std::fprintf(stderr, "braid-tests: rank %d on %s: the MPI version of %s failed: %s\n", ctx.rank,
                   ctx.host, ctx.desc.call, msg);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  };
  prepare(ctx, l, elem, false, ref, dtype, false);
  return time_iterations(ctx, run_once);
}

// ---------------------------------------------------------------------------
// Output (rank 0 only)

// Appends printf-style text to `out`, however long.
void append_format(std::string* out, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
void append_format(std::string* out, const char* fmt, ...) {
  va_list ap, again;
  va_start(ap, fmt);
  va_copy(again, ap);
  const int n = std::vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  if (n > 0) {
    const size_t at = out->size();
    out->resize(at + static_cast<size_t>(n) + 1);
    std::vsnprintf(out->data() + at, static_cast<size_t>(n) + 1, fmt, again);
    out->resize(at + static_cast<size_t>(n));
  }
  va_end(again);
}

// Prints a formatted line without trailing blanks.
void print_line(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void print_line(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  size_t n = std::strlen(buf);
  while (n > 0 && buf[n - 1] == ' ') --n;
  std::printf("%.*s\n", static_cast<int>(n), buf);
}

// Columns: 52 characters of size, count, type, redop, root; 32 of each braid
// group (out-of-place, in-place); with --compare mpi, 26 of MPI's between them.
void print_table_header(bool compare_mpi, bool mpi_in_place) {
  const char* braid_fmt = "  %7s  %6s  %6s %6s";
  const char* mpi_fmt = "  %7s  %6s  %7s";
  char names[256], units[256];
  int n = std::snprintf(names, sizeof names, "# %10s  %12s  %8s  %6s  %6s", "size", "count", "type", "redop",
                        "root");
  int u = std::snprintf(units, sizeof units, "# %10s  %12s  %8s  %6s  %6s", "(B)", "(elements)", "", "", "");
  for (int group = 0; group < 3; ++group) {
    if (group == 1 && !compare_mpi) continue;
    if (group == 1) {
      n += std::snprintf(names + n, sizeof names - n, mpi_fmt, "time", "busbw", "ratio");
      u += std::snprintf(units + u, sizeof units - u, mpi_fmt, "(us)", "(GB/s)", "");
    } else {
      n += std::snprintf(names + n, sizeof names - n, braid_fmt, "time", "algbw", "busbw", "#wrong");
      u += std::snprintf(units + u, sizeof units - u, braid_fmt, "(us)", "(GB/s)", "(GB/s)", "");
    }
  }
  // Group titles over their columns.
  std::string titles(compare_mpi ? 142 : 116, ' ');
  titles[0] = '#';
  auto place = [&](size_t at, const char* text) { titles.replace(at, std::strlen(text), text); };
  place(63, "out-of-place");
  if (compare_mpi) place(mpi_in_place ? 92 : 89, mpi_in_place ? "mpi in-place" : "mpi out-of-place");
  place(compare_mpi ? 124 : 98, "in-place");
  print_line("%s", titles.c_str());
  print_line("%s", names);
  print_line("%s", units);
}

std::string format_time(double us) {
  char buf[32];
  std::snprintf(buf, sizeof buf, us >= 10000 ? "%7.0f" : us >= 100 ? "%7.1f" : "%7.2f", us);
  return buf;
}

std::string format_ratio(double ratio) {
  char buf[32];
  std::snprintf(buf, sizeof buf, ratio >= 99.95 ? "%.0fx" : ratio >= 9.995 ? "%.1fx" : "%.2fx", ratio);
  return buf;
}

// GB/s of `size` bytes in `us` microseconds (nccl-tests' algbw); 0 without a time.
double algbw_of(size_t size, double us) {
  return us > 0 ? static_cast<double>(size) / us / 1e3 : 0;
}

struct Totals {
  double busbw_sum = 0;
  long busbw_n = 0;
  double log_ratio_sum = 0;  // braid busbw / MPI busbw, out of place
  long ratio_n = 0;
  long long wrong = 0;
  long long out_of_bounds = 0;
  std::vector<double> variant_busbw_sum;  // --algos / --trace-compare / --env-compare: per column
  long variant_rows = 0;
};

// ---------------------------------------------------------------------------
// Start-up

struct RankInfo {
  char host[64];
  int pid;
};

}  // namespace

int perf_main(int argc, char** argv, const CollDesc& desc) {
  MPI_Init(&argc, &argv);
  int rank = 0, nranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  const std::string prog = std::string(desc.name) + "_perf";

  Options opt;
  std::string error;
  ParseResult parsed = parse_args(argc, argv, desc, &opt, &error);
  if (parsed == ParseResult::kRun && desc.rooted && opt.root >= nranks) {  // rootless: ignored, as -h says
    parsed = ParseResult::kError;
    error = "-r: root " + std::to_string(opt.root) + " is not a rank (nranks " + std::to_string(nranks) + ")";
  }
  if (parsed != ParseResult::kRun) {
    if (rank == 0) {
      print_usage(parsed == ParseResult::kHelp ? stdout : stderr, prog.c_str(), desc);
      if (parsed == ParseResult::kError) std::fprintf(stderr, "%s: error: %s\n", prog.c_str(), error.c_str());
    }
    MPI_Finalize();
    return parsed == ParseResult::kHelp ? 0 : 2;
  }

  // All ranks on one node: keep braid's TCP traffic on loopback unless told otherwise.
  MPI_Comm node_comm;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node_comm);
  int node_size = 0;
  MPI_Comm_size(node_comm, &node_size);
  MPI_Comm_free(&node_comm);
  const bool one_node = node_size == nranks;
  const bool set_lo = one_node && std::getenv("BRAID_SOCKET_IFNAME") == nullptr;
  if (set_lo) setenv("BRAID_SOCKET_IFNAME", "lo", 0);

  RankInfo me{};
  gethostname(me.host, sizeof me.host - 1);
  me.pid = static_cast<int>(getpid());
  std::vector<RankInfo> all(rank == 0 ? static_cast<size_t>(nranks) : 0);
  MPI_Gather(&me, sizeof me, MPI_BYTE, all.data(), sizeof me, MPI_BYTE, 0, MPI_COMM_WORLD);

  // Buffers for the largest size: no buffer of any step exceeds max_bytes.
  const size_t alloc = (opt.max_bytes + kGuardBytes + 4095) / 4096 * 4096;
  unsigned char *sendbuf = nullptr, *recvbuf = nullptr;
  if (opt.register_buffers) {
    void *s = nullptr, *r = nullptr;
    if (braid_mem_alloc(&s, alloc) == BRAID_SUCCESS && braid_mem_alloc(&r, alloc) == BRAID_SUCCESS) {
      sendbuf = static_cast<unsigned char*>(s);
      recvbuf = static_cast<unsigned char*>(r);
    }
  } else {
    sendbuf = static_cast<unsigned char*>(std::aligned_alloc(4096, alloc));
    recvbuf = static_cast<unsigned char*>(std::aligned_alloc(4096, alloc));
  }
  if (sendbuf == nullptr || recvbuf == nullptr) {
    std::fprintf(stderr, "braid-tests: rank %d: cannot allocate 2 x %zu bytes (-e)\n", rank, alloc);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  std::memset(sendbuf, 0, alloc);  // touch every page before timing
  std::memset(recvbuf, 0, alloc);

  braid_comm_t comm = nullptr;
  MPI_Comm mpi_comm = MPI_COMM_NULL;
  if (opt.compare_mpi) MPI_Comm_dup(MPI_COMM_WORLD, &mpi_comm);
  Context ctx{desc, opt, nullptr, mpi_comm, rank, nranks, me.host, sendbuf, recvbuf};
  if (braid_result_t r = braid_bench::braid_comm_from_mpi(MPI_COMM_WORLD, &comm); r != BRAID_SUCCESS) {
    die(ctx, "making the braid communicator", r);
  }
  ctx.comm = comm;

  // --algos, --trace-compare, --env-compare: one communicator per column,
  // each made while its variable is set (the same on every rank), so all are
  // timed in one process, in turn.
  const std::vector<Variant> variants = variants_of(opt, desc.name);
  std::vector<braid_comm_t> variant_comms;
  for (const Variant& v : variants) {
    const char* name = v.variable.c_str();
    const char* env = v.variable.empty() ? nullptr : std::getenv(name);
    const std::string saved = env != nullptr ? env : "";
    if (!v.variable.empty()) {  // else: as launched
      if (v.set)
        setenv(name, v.value.c_str(), 1);
      else
        unsetenv(name);
    }
    braid_comm_t c = nullptr;
    const braid_result_t r = braid_bench::braid_comm_from_mpi(MPI_COMM_WORLD, &c);
    if (env != nullptr)
      setenv(name, saved.c_str(), 1);
    else if (!v.variable.empty())
      unsetenv(name);
    if (r != BRAID_SUCCESS) die(ctx, ("making the communicator of column " + v.label).c_str(), r);
    variant_comms.push_back(c);
  }
  std::vector<braid_comm_t> all_comms = variant_comms;
  all_comms.push_back(comm);
  if (opt.register_buffers) {
    for (braid_comm_t c : all_comms)
      for (unsigned char* b : {sendbuf, recvbuf})
        if (braid_result_t r = braid_comm_register(c, b, alloc); r != BRAID_SUCCESS)
          die(ctx, "braid_comm_register (-R 1)", r);
  }

  if (rank == 0) {
    int version = 0;
    braid_get_version(&version);
    std::printf("# braid-tests: %s nranks %d\n", prog.c_str(), nranks);
    std::printf("# braid version %d.%d.%d, %s, blocking calls%s\n", version / 10000, version / 100 % 100,
                version % 100,
                opt.register_buffers ? "registered host memory (braid_mem_alloc + braid_comm_register)"
                                     : "host memory",
                set_lo ? ", BRAID_SOCKET_IFNAME=lo (all ranks on one node)" : "");
    if (opt.step_factor != 0) {
      std::printf(
          "# minBytes %zu maxBytes %zu step: %zu(factor) warmup iters: %ld iters: %ld validation: %d\n",
          opt.min_bytes, opt.max_bytes, opt.step_factor, opt.warmup, opt.iters, opt.check ? 1 : 0);
    } else {
      std::printf(
          "# minBytes %zu maxBytes %zu step: %zu(bytes) warmup iters: %ld iters: %ld validation: %d\n",
          opt.min_bytes, opt.max_bytes, opt.step_bytes, opt.warmup, opt.iters, opt.check ? 1 : 0);
    }
    if (desc.reduces && std::find(opt.ops.begin(), opt.ops.end(), BRAID_AVG) != opt.ops.end() &&
        std::any_of(opt.dtypes.begin(), opt.dtypes.end(),
                    [](braid_dtype_t t) { return !type_info(t).is_float; })) {
      std::printf("# avg is defined for floating types only: integer types skip it\n");
    }
    if (desc.reduces && std::any_of(opt.ops.begin(), opt.ops.end(), is_bitwise)) {
      std::printf("# band, bor and bxor are defined for integer types only: floating types skip them\n");
    }
    if (opt.compare_mpi) {
      char lib[MPI_MAX_LIBRARY_VERSION_STRING] = "";
      int len = 0;
      MPI_Get_library_version(lib, &len);
      lib[std::strcspn(lib, "\n")] = '\0';  // first line only
      if (desc.mpi_in_place) {
        std::printf(
            "# --compare mpi: %s, one buffer as braid in place; ratio = braid in-place busbw / MPI busbw\n",
            lib);
      } else {
        std::printf("# --compare mpi: %s, out of place; ratio = braid busbw / MPI busbw\n", lib);
      }
    }
    std::printf("#\n# Using devices\n");
    for (int r = 0; r < nranks; ++r) {
      std::printf("#  Rank %3d Pid %7d on %10s device host memory\n", r, all[static_cast<size_t>(r)].pid,
                  all[static_cast<size_t>(r)].host);
    }
    std::printf("#\n");
    if (variants.empty()) {
      print_table_header(opt.compare_mpi, desc.mpi_in_place);
    } else {
      std::printf("# %s: out-of-place time (us) of each column, best of %ld rounds taking turns\n",
                  variants_flag(opt), opt.rounds_or(3));
      if (!opt.env_name.empty())
        std::printf("# variant: %s=%s; launched: the environment mpirun gave\n", opt.env_name.c_str(),
                    opt.env_value.c_str());
      std::printf("#%11s  %12s  %8s  %6s  %6s", "size", "count", "type", "redop", "root");
      for (const Variant& v : variants) std::printf("  %12s", v.label.c_str());
      if (variants_ratio(opt) != nullptr) std::printf("  %16s", variants_ratio(opt));
      std::printf("\n");
    }
    std::fflush(stdout);
  }

  // Non-reducing collectives run once with op "none"; rootless ones with root -1.
  const std::vector<braid_redop_t> ops = desc.reduces ? opt.ops : std::vector<braid_redop_t>{BRAID_SUM};
  const int first_root = !desc.rooted ? -1 : opt.root < 0 ? 0 : static_cast<int>(opt.root);
  const int last_root = !desc.rooted ? -1 : opt.root < 0 ? nranks - 1 : static_cast<int>(opt.root);
  const bool per_rank = desc.send_span == Span::kCountTimesRanks || desc.recv_span == Span::kCountTimesRanks;

  Totals totals;
  for (braid_dtype_t dtype : opt.dtypes) {
    const TypeInfo& ti = type_info(dtype);
    for (braid_redop_t op : ops) {
      if (desc.reduces && !op_defined(op, ti)) continue;
      for (int root = first_root; root <= last_root; ++root) {
        for (size_t bytes = opt.min_bytes; bytes <= opt.max_bytes;) {
          size_t count = bytes / ti.size;
          if (per_rank) count /= static_cast<size_t>(nranks);
          const size_t size =
              std::max(span_elems(desc.send_span, count, nranks), span_elems(desc.recv_span, count, nranks)) *
              ti.size;
          std::string line;
          append_format(&line, "%12zu  %12zu  %8s  %6s  %6d", size, count, ti.name,
                        desc.reduces ? kOpNames[op] : "none", root);
          long long row_oob = 0;
          if (!variant_comms.empty()) {
            // Each round starts with a different column, so none always
            // runs first after the size changes.
            const size_t n = variant_comms.size();
            std::vector<double> best(n, std::numeric_limits<double>::infinity());
            for (long round = 0; round < opt.rounds_or(3); ++round) {
              for (size_t k = 0; k < n; ++k) {
                const size_t i = (k + static_cast<size_t>(round)) % n;
                Context turn = ctx;
                turn.comm = variant_comms[i];
                const Measurement m = measure(turn, dtype, op, root, count, false);
                best[i] = std::min(best[i], m.time_us);
                if (m.wrong > 0) totals.wrong += m.wrong;
                totals.out_of_bounds += m.out_of_bounds;
                row_oob += m.out_of_bounds;
              }
            }
            totals.variant_busbw_sum.resize(n);
            for (size_t i = 0; i < n; ++i) {
              append_format(&line, "  %12s", format_time(best[i]).c_str());
              totals.variant_busbw_sum[i] += algbw_of(size, best[i]) * desc.busbw_factor(nranks);
            }
            ++totals.variant_rows;
            if (variants_ratio(opt) != nullptr) append_format(&line, "  %16.3f", best[1] / best[0]);
          }
          if (variant_comms.empty()) {
            // Measured out of place, MPI, in place, in turns (--rounds),
            // the best of each kept; printed in that order once the ratio's
            // braid side (out of place, or in place where MPI has one
            // buffer) is known.
            std::string braid_cols[2];
            double busbw_of[2] = {0, 0};
            double best_us[2] = {std::numeric_limits<double>::infinity(),
                                 std::numeric_limits<double>::infinity()};
            long long wrong_of[2] = {0, 0};
            double mpi_us = -1;
            for (long round = 0; round < opt.rounds_or(1); ++round) {
              for (bool in_place : {false, true}) {
                if (in_place && !desc.in_place) continue;
                const Measurement m = measure(ctx, dtype, op, root, count, in_place);
                best_us[in_place] = std::min(best_us[in_place], m.time_us);
                wrong_of[in_place] = m.wrong < 0 ? -1 : wrong_of[in_place] + m.wrong;
                totals.out_of_bounds += m.out_of_bounds;
                row_oob += m.out_of_bounds;
                if (!in_place && opt.compare_mpi) {
                  const double t = measure_mpi(ctx, dtype, op, root, count);
                  if (t >= 0) mpi_us = mpi_us < 0 ? t : std::min(mpi_us, t);
                }
              }
            }
            for (bool in_place : {false, true}) {
              if (in_place && !desc.in_place) {
                char cols[64];
                std::snprintf(cols, sizeof cols, "  %7s  %6s  %6s %6s", "N/A", "N/A", "N/A", "N/A");
                braid_cols[1] = cols;
                continue;
              }
              const double algbw = algbw_of(size, best_us[in_place]);
              const double busbw = algbw * desc.busbw_factor(nranks);
              busbw_of[in_place] = busbw;
              totals.busbw_sum += busbw;
              ++totals.busbw_n;
              if (wrong_of[in_place] > 0) totals.wrong += wrong_of[in_place];
              const std::string wrong = wrong_of[in_place] < 0 ? "N/A" : std::to_string(wrong_of[in_place]);
              char cols[96];
              std::snprintf(cols, sizeof cols, "  %s  %6.2f  %6.2f %6s",
                            format_time(best_us[in_place]).c_str(), algbw, busbw, wrong.c_str());
              braid_cols[in_place] = cols;
            }
            append_format(&line, "%s", braid_cols[0].c_str());
            if (opt.compare_mpi && mpi_us < 0) {
              append_format(&line, "  %7s  %6s  %7s", "N/A", "N/A", "N/A");
            } else if (opt.compare_mpi) {
              const double mpi_busbw = algbw_of(size, mpi_us) * desc.busbw_factor(nranks);
              const double busbw = busbw_of[desc.mpi_in_place && desc.in_place];
              std::string ratio = "N/A";
              if (busbw > 0 && mpi_busbw > 0) {
                ratio = format_ratio(busbw / mpi_busbw);
                totals.log_ratio_sum += std::log(busbw / mpi_busbw);
                ++totals.ratio_n;
              }
              append_format(&line, "  %s  %6.2f  %7s", format_time(mpi_us).c_str(), mpi_busbw, ratio.c_str());
            }
            append_format(&line, "%s", braid_cols[1].c_str());
          }
          if (rank == 0) {
            std::printf("%s\n", line.c_str());
            if (row_oob > 0)
              std::printf("#  ^ %lld bytes past the end of the buffers were overwritten\n", row_oob);
            std::fflush(stdout);
          }
          // Next size; stop rather than wrap around.
          const size_t next =
              opt.step_factor != 0 ? (bytes == 0 ? 1 : bytes * opt.step_factor) : bytes + opt.step_bytes;
          if (next <= bytes || (opt.step_factor != 0 && bytes != 0 && next / opt.step_factor != bytes)) break;
          bytes = next;
        }
      }
    }
  }

  const long long bad = totals.wrong + totals.out_of_bounds;
  if (rank == 0) {
    if (opt.check) {
      std::printf("# Out of bounds values : %lld %s\n", bad, bad ? "FAILED" : "OK");
    } else {
      std::printf("# Out of bounds values : N/A (-c 0)\n");
    }
    if (variants.empty()) {
      std::printf("# Avg bus bandwidth    : %.3f\n",
                  totals.busbw_n ? totals.busbw_sum / static_cast<double>(totals.busbw_n) : 0.0);
    } else {
      std::printf("# Avg bus bandwidth    :");
      for (size_t i = 0; i < variants.size(); ++i) {
        std::printf(" %s %.3f%s", variants[i].label.c_str(),
                    totals.variant_rows > 0
                        ? totals.variant_busbw_sum[i] / static_cast<double>(totals.variant_rows)
                        : 0.0,
                    i + 1 < variants.size() ? "," : "\n");
      }
    }
    if (opt.compare_mpi) {
      if (totals.ratio_n > 0) {
        std::printf("# Avg bus bandwidth ratio braid/mpi : %.2f\n",
                    std::exp(totals.log_ratio_sum / static_cast<double>(totals.ratio_n)));
      } else {
        std::printf("# Avg bus bandwidth ratio braid/mpi : N/A\n");
      }
    }
    std::printf("#\n");
    std::fflush(stdout);
  }

  if (opt.register_buffers) {
    for (braid_comm_t c : all_comms)
      for (unsigned char* b : {sendbuf, recvbuf})
        if (braid_result_t r = braid_comm_deregister(c, b); r != BRAID_SUCCESS)
          die(ctx, "braid_comm_deregister (-R 1)", r);
  }
  for (braid_comm_t c : variant_comms) {
    if (braid_result_t r = braid_comm_destroy(c); r != BRAID_SUCCESS)
      die(ctx, (std::string("braid_comm_destroy (") + variants_flag(opt) + ")").c_str(), r);
  }
  if (braid_result_t r = braid_comm_destroy(comm); r != BRAID_SUCCESS) {
    ctx.comm = nullptr;  // gone: only the thread's last error remains
    die(ctx, "braid_comm_destroy", r);
  }
  if (mpi_comm != MPI_COMM_NULL) MPI_Comm_free(&mpi_comm);
  if (opt.register_buffers) {
    for (unsigned char* b : {sendbuf, recvbuf})
      if (braid_result_t r = braid_mem_free(b); r != BRAID_SUCCESS) die(ctx, "braid_mem_free (-R 1)", r);
  } else {
    std::free(sendbuf);
    std::free(recvbuf);
  }
  MPI_Finalize();
  return bad > 0 ? 1 : 0;
}

}  // namespace braid_perf
