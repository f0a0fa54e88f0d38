#include "tools/check/collective_check.h"

#include "tools/result_name.h"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <new>

namespace braid::check {
namespace {

// ---------------------------------------------------------------- dtypes ---

constexpr size_t kDtypeSize[BRAID_NUM_DTYPES] = {1, 1, 4, 4, 8, 8, 2, 2, 4, 8};
constexpr const char* kDtypeNames[BRAID_NUM_DTYPES] = {"int8",   "uint8",   "int32",    "uint32",  "int64",
                                                       "uint64", "float16", "bfloat16", "float32", "float64"};
constexpr const char* kOpNames[BRAID_NUM_OPS] = {"sum", "prod", "min", "max", "avg", "band", "bor", "bxor"};
constexpr const char* kCollNames[static_cast<int>(Collective::kNumCollectives)] = {
    "all_reduce", "broadcast",  "reduce",  "all_gather", "reduce_scatter", "gather",
    "scatter",    "all_to_all", "barrier", "send_recv",  "isend_irecv"};

size_t esize(braid_dtype_t dt) {
  return kDtypeSize[dt];
}
bool is_float(braid_dtype_t dt) {
  return dt >= BRAID_FLOAT16 && dt <= BRAID_FLOAT64;
}
bool is_signed_int(braid_dtype_t dt) {
  return dt == BRAID_INT8 || dt == BRAID_INT32 || dt == BRAID_INT64;
}
uint64_t width_mask(size_t es) {
  return es >= 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * es)) - 1;
}

bool op_valid(braid_dtype_t dt, braid_redop_t op) {
  if (op == BRAID_BAND || op == BRAID_BOR || op == BRAID_BXOR) return !is_float(dt);
  return op != BRAID_AVG || is_float(dt);
}

bool is_reducing(Collective c) {
  return c == Collective::kAllReduce || c == Collective::kReduce || c == Collective::kReduceScatter;
}
bool is_rooted(Collective c) {
  return c == Collective::kBroadcast || c == Collective::kReduce || c == Collective::kGather ||
         c == Collective::kScatter;
}
bool is_p2p(Collective c) {
  return c == Collective::kSendRecv || c == Collective::kIsendIrecv;
}
// Whether the largest buffer of the collective holds nranks * count elements.
bool is_multi(Collective c) {
  return c == Collective::kAllGather || c == Collective::kReduceScatter || c == Collective::kGather ||
         c == Collective::kScatter || c == Collective::kAllToAll;
}

// --------------------------------------- float16 / bfloat16 (independent) ---
// The reference deliberately does not use braid's own conversions.

float bits_to_f32(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
uint32_t f32_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

float half_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1f;
  uint32_t m = h & 0x3ff;
  if (e == 0) {
    float v = std::ldexp(static_cast<float>(m), -24);
    return sign ? -v : v;
  }
  if (e == 31) return bits_to_f32(sign | 0x7f800000u | (m << 13));
  return bits_to_f32(sign | ((e + 112) << 23) | (m << 13));
}

uint16_t f32_to_half(float f) {  // round to nearest even
  uint32_t x = f32_to_bits(f);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00;   // NaN
  if (x >= 0x477ff000u) return sign | 0x7c00;  // >= 65520 rounds to infinity
  if (x < 0x38800000u) {                       // below 2^-14: subnormal half or zero
    float a = bits_to_f32(x) * 16777216.0f;    // exact: scaled by 2^24
    return sign | static_cast<uint16_t>(std::nearbyint(a));
  }
  x += 0xfffu + ((x >> 13) & 1u);
  x -= 0x38000000u;
  return sign | static_cast<uint16_t>(x >> 13);
}

float bf16_to_f32(uint16_t b) {
  return bits_to_f32(static_cast<uint32_t>(b) << 16);
}

uint16_t f32_to_bf16(float f) {
  uint32_t x = f32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

// Value of an element as a double (floats), or its integer value (ints).
double bits_to_double(braid_dtype_t dt, uint64_t bits) {
  switch (dt) {
    case BRAID_INT8:
      return static_cast<int8_t>(bits);
    case BRAID_UINT8:
      return static_cast<uint8_t>(bits);
    case BRAID_INT32:
      return static_cast<int32_t>(bits);
    case BRAID_UINT32:
      return static_cast<uint32_t>(bits);
    case BRAID_INT64:
      return static_cast<double>(static_cast<int64_t>(bits));
    case BRAID_UINT64:
      return static_cast<double>(bits);
    case BRAID_FLOAT16:
      return half_to_f32(static_cast<uint16_t>(bits));
    case BRAID_BFLOAT16:
      return bf16_to_f32(static_cast<uint16_t>(bits));
    case BRAID_FLOAT32:
      return bits_to_f32(static_cast<uint32_t>(bits));
    case BRAID_FLOAT64: {
      double d;
      std::memcpy(&d, &bits, 8);
      return d;
    }
    default:
      return 0;
  }
}

// Float dtypes only; exact for the values the exact modes produce.
uint64_t double_to_bits(braid_dtype_t dt, double v) {
  switch (dt) {
    case BRAID_FLOAT16:
      return f32_to_half(static_cast<float>(v));
    case BRAID_BFLOAT16:
      return f32_to_bf16(static_cast<float>(v));
    case BRAID_FLOAT32:
      return f32_to_bits(static_cast<float>(v));
    case BRAID_FLOAT64: {
      uint64_t b;
      std::memcpy(&b, &v, 8);
      return b;
    }
    default:
      return 0;
  }
}

// Largest integer L such that every integer in [-L, L] is exact in the dtype.
int64_t exact_int_limit(braid_dtype_t dt) {
  switch (dt) {
    case BRAID_FLOAT16:
      return 2048;
    case BRAID_BFLOAT16:
      return 256;
    case BRAID_FLOAT32:
      return int64_t{1} << 24;
    default:
      return int64_t{1} << 53;
  }
}
// Unit roundoff and smallest positive (subnormal) value.
double unit_roundoff(braid_dtype_t dt) {
  switch (dt) {
    case BRAID_FLOAT16:
      return std::ldexp(1.0, -11);
    case BRAID_BFLOAT16:
      return std::ldexp(1.0, -8);
    case BRAID_FLOAT32:
      return std::ldexp(1.0, -24);
    default:
      return std::ldexp(1.0, -53);
  }
}
double tiny_value(braid_dtype_t dt) {
  switch (dt) {
    case BRAID_FLOAT16:
      return std::ldexp(1.0, -24);
    case BRAID_BFLOAT16:
      return std::ldexp(1.0, -133);
    case BRAID_FLOAT32:
      return std::ldexp(1.0, -149);
    default:
      return std::ldexp(1.0, -1074);
  }
}

// Stored mantissa bits of a float dtype (the exponent has the rest but the sign).
int mantissa_bits(braid_dtype_t dt) {
  switch (dt) {
    case BRAID_FLOAT16:
      return 10;
    case BRAID_BFLOAT16:
      return 7;
    case BRAID_FLOAT32:
      return 23;
    default:
      return 52;
  }
}

// Random bits -> a finite, normal, non-zero float of the dtype.
uint64_t sanitize_float(braid_dtype_t dt, uint64_t b) {
  const int mbits = mantissa_bits(dt), ebits = static_cast<int>(8 * esize(dt)) - 1 - mbits;
  uint64_t emask = ((uint64_t{1} << ebits) - 1) << mbits;
  uint64_t e = b & emask;
  if (e == emask) b &= ~(uint64_t{1} << (mbits + ebits - 1));  // Inf/NaN -> exponent 0111..1
  if (e == 0) b |= uint64_t{1} << mbits;                       // zero/subnormal -> exponent 1
  return b;
}

std::string format_elem(braid_dtype_t dt, uint64_t bits) {
  char buf[96];
  size_t es = esize(dt);
  bits &= width_mask(es);
  if (is_float(dt)) {
    std::snprintf(buf, sizeof buf, "0x%0*" PRIx64 " (%.17g)", static_cast<int>(2 * es), bits,
                  bits_to_double(dt, bits));
  } else if (is_signed_int(dt)) {
    int64_t v = static_cast<int64_t>(bits << (64 - 8 * es)) >> (64 - 8 * es);
    std::snprintf(buf, sizeof buf, "0x%0*" PRIx64 " (%" PRId64 ")", static_cast<int>(2 * es), bits, v);
  } else {
    std::snprintf(buf, sizeof buf, "0x%0*" PRIx64 " (%" PRIu64 ")", static_cast<int>(2 * es), bits, bits);
  }
  return buf;
}

// ------------------------------------------------------------------- data ---

uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

enum class Mode {
  kBits,       // data movement: arbitrary bit patterns
  kIntWrap,    // integer sum/min/max: full-width random values (sums wrap)
  kIntOdd,     // integer prod: odd full-width values (products wrap, never vanish)
  kSumExact,   // float sum: small integers, every partial sum exact
  kAvgExact,   // float avg: per index q + d_r with sum_r d_r = 0, so the average is q
  kProdExact,  // float prod: +-1, +-2, +-0.5, at most four 2s and four 0.5s per index
  kMinMax,     // float min/max: finite normal non-zero random values
  kRandom,     // float sum/avg: uniform [-1, 1) rounded to the dtype; tolerance
  // float sum/avg and prod: per index two ranks give full-precision values,
  // 2^-4 <= |v| < 2^4, the others 0 (sum) or 1 (prod), so the result is one
  // correctly rounded operation (two for avg), compared bit for bit.
  kRoundSum,
  kRoundProd,
};

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::kBits:
      return "bits";
    case Mode::kIntWrap:
      return "wrap";
    case Mode::kIntOdd:
      return "odd";
    case Mode::kSumExact:
    case Mode::kAvgExact:
    case Mode::kProdExact:
      return "exact";
    case Mode::kMinMax:
      return "finite";
    case Mode::kRandom:
      return "random";
    case Mode::kRoundSum:
    case Mode::kRoundProd:
      return "rounding";
  }
  return "?";
}

Mode primary_mode(Collective c, braid_dtype_t dt, int op) {
  if (!is_reducing(c) || op < 0) return Mode::kBits;
  if (!is_float(dt)) return op == BRAID_PROD ? Mode::kIntOdd : Mode::kIntWrap;
  switch (op) {
    case BRAID_SUM:
      return Mode::kSumExact;
    case BRAID_AVG:
      return Mode::kAvgExact;
    case BRAID_PROD:
      return Mode::kProdExact;
    default:
      return Mode::kMinMax;
  }
}

// The input of every rank: a pure function of (seed, rank, index).
class Gen {
 public:
  Gen(braid_dtype_t dt, Mode mode, uint64_t seed, int nranks)
      : dt_(dt), mode_(mode), n_(nranks), mask_(width_mask(esize(dt))) {
    keys_.resize(nranks + 1);
    for (int r = 0; r <= nranks; ++r) keys_[r] = mix64(seed ^ mix64(0x5bd1e995u + static_cast<uint64_t>(r)));
    int64_t limit = exact_int_limit(dt);
    int64_t amax = dt == BRAID_FLOAT16 || dt == BRAID_BFLOAT16 ? 8 : dt == BRAID_FLOAT32 ? 4096 : 1 << 20;
    if (mode == Mode::kSumExact) {
      if (limit / n_ >= 1) {
        a_ = std::min<int64_t>(amax, limit / n_);
        active_ = n_;
      } else {  // more ranks than exact integers: only `limit` ranks contribute to each index
        a_ = 1;
        active_ = limit;
      }
    } else if (mode == Mode::kAvgExact) {
      // |partial sums| <= n*A + ceil(n/2)*C <= limit.
      int64_t half = (n_ + 1) / 2;
      a_ = std::min<int64_t>(amax, limit / (2 * int64_t{n_}));
      c_ = std::min<int64_t>(amax, limit / (2 * half));
    } else if (mode == Mode::kProdExact) {
      period_ = std::max(1, (n_ + 3) / 4);
    }
  }

  braid_dtype_t dtype() const { return dt_; }
  Mode mode() const { return mode_; }
  int nranks() const { return n_; }
  bool tolerant() const { return mode_ == Mode::kRandom; }

  uint64_t hash(int rank, uint64_t idx) const { return mix64(keys_[rank] + idx * 0xd1b54a32d192ed03ull); }

  uint64_t bits(int rank, uint64_t idx) const {
    switch (mode_) {
      case Mode::kBits:
      case Mode::kIntWrap:
        return hash(rank, idx) & mask_;
      case Mode::kIntOdd:
        return (hash(rank, idx) | 1) & mask_;
      case Mode::kMinMax:
        return sanitize_float(dt_, hash(rank, idx) & mask_);
      case Mode::kSumExact:
      case Mode::kAvgExact:
      case Mode::kProdExact:
      case Mode::kRoundSum:
      case Mode::kRoundProd:
        return double_to_bits(dt_, exact_value(rank, idx));
      case Mode::kRandom: {
        double u = static_cast<double>(hash(rank, idx) >> 11) * 0x1p-52 - 1.0;
        return double_to_bits(dt_, u);
      }
    }
    return 0;
  }

  // The value of a float element (exact modes without a round trip through the dtype).
  double value(int rank, uint64_t idx) const {
    if (mode_ != Mode::kBits && mode_ != Mode::kIntWrap && mode_ != Mode::kIntOdd && mode_ != Mode::kMinMax &&
        mode_ != Mode::kRandom)
      return exact_value(rank, idx);
    return bits_to_double(dt_, bits(rank, idx));
  }

 private:
  // An integer in [0, n), from the high bits of h.
  static uint64_t below(uint64_t h, uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(h) * n) >> 64);
  }

  double exact_value(int rank, uint64_t idx) const {
    uint64_t h = hash(rank, idx);
    switch (mode_) {
      case Mode::kSumExact: {
        bool active =
            active_ >= n_ || static_cast<int64_t>((static_cast<uint64_t>(rank) + idx) % n_) < active_;
        return active ? static_cast<double>(static_cast<int64_t>(below(h, 2 * a_ + 1)) - a_) : 0.0;
      }
      case Mode::kAvgExact: {
        // q depends on the index only (key n_), c on the index and the rank pair.
        int64_t q = static_cast<int64_t>(below(hash(n_, idx), 2 * a_ + 1)) - a_;
        int64_t d = 0;
        if (!(n_ % 2 == 1 && rank == n_ - 1)) {
          int64_t c = static_cast<int64_t>(below(hash(rank & ~1, idx ^ 0xa5a5a5a5u), c_ + 1));
          d = rank % 2 == 0 ? c : -c;
        }
        return static_cast<double>(q + d);
      }
      case Mode::kRoundSum:
      case Mode::kRoundProd: {
        // The two ranks of this index (one where there is one rank).
        const uint64_t un = static_cast<uint64_t>(n_);
        const uint64_t first = below(hash(n_, idx), un);
        const uint64_t second =
            n_ > 1 ? (first + 1 + below(hash(n_, idx ^ 0x5bd1e995u), un - 1)) % un : first;
        const uint64_t r = static_cast<uint64_t>(rank);
        if (r != first && r != second) return mode_ == Mode::kRoundSum ? 0.0 : 1.0;
        const int mbits = mantissa_bits(dt_);
        const double frac = std::ldexp(static_cast<double>(h & ((uint64_t{1} << mbits) - 1)), -mbits);
        const double v = std::ldexp(1.0 + frac, static_cast<int>(h >> 61) - 4);
        return (h >> 60) & 1 ? -v : v;
      }
      case Mode::kProdExact: {
        uint64_t slot =
            period_ == 1 ? 0 : (static_cast<uint64_t>(rank) + idx) % static_cast<uint64_t>(period_);
        double mag = slot == 0 ? 2.0 : (slot == 1 ? 0.5 : 1.0);
        return (h & 1) ? -mag : mag;
      }
      default:
        return 0;
    }
  }

  braid_dtype_t dt_;
  Mode mode_;
  int n_;
  uint64_t mask_;
  std::vector<uint64_t> keys_;
  int64_t a_ = 0, c_ = 0, active_ = 0;
  int period_ = 1;
};

struct Expect {
  uint64_t bits = 0;
  double value = 0;  // tolerant mode: the exact value
  double tol = -1;   // < 0: compare bits exactly
};

// Reduction of every rank's element idx, as the library must compute it.
Expect reduce_ref(const Gen& g, braid_redop_t op, uint64_t idx) {
  braid_dtype_t dt = g.dtype();
  int n = g.nranks();
  Expect e;
  if (!is_float(dt)) {
    size_t es = esize(dt);
    uint64_t mask = width_mask(es);
    unsigned shift = static_cast<unsigned>(64 - 8 * es);
    uint64_t acc = g.bits(0, idx);
    for (int r = 1; r < n; ++r) {
      uint64_t b = g.bits(r, idx);
      switch (op) {
        case BRAID_SUM:
          acc = (acc + b) & mask;
          break;
        case BRAID_PROD:
          acc = (acc * b) & mask;
          break;
        case BRAID_MIN:
        case BRAID_MAX: {
          bool less;
          if (is_signed_int(dt))
            less =
                (static_cast<int64_t>(b << shift) >> shift) < (static_cast<int64_t>(acc << shift) >> shift);
          else
            less = b < acc;
          if ((op == BRAID_MIN) == less) acc = b;
          break;
        }
        case BRAID_BAND:
          acc &= b;
          break;
        case BRAID_BOR:
          acc |= b;
          break;
        case BRAID_BXOR:
          acc ^= b;
          break;
        default:
          break;
      }
    }
    e.bits = acc;
    return e;
  }
  if (op == BRAID_MIN || op == BRAID_MAX) {
    uint64_t best = g.bits(0, idx);
    double bv = bits_to_double(dt, best);
    for (int r = 1; r < n; ++r) {
      uint64_t b = g.bits(r, idx);
      double v = bits_to_double(dt, b);
      if (op == BRAID_MIN ? v < bv : v > bv) best = b, bv = v;
    }
    e.bits = best;
    return e;
  }
  if (op == BRAID_PROD) {
    double p = 1;
    for (int r = 0; r < n; ++r) p *= g.value(r, idx);
    e.bits = double_to_bits(dt, p);
    return e;
  }
  // SUM / AVG. braid.h: a float16 AVG divides each input by n before the sum.
  const bool scaled = op == BRAID_AVG && dt == BRAID_FLOAT16;
  if (g.mode() == Mode::kRoundSum) {
    // Two nonzero terms, whose sum double holds exactly below float64 (and
    // rounds correctly in float64): the dtype's rounding of it. AVG divides
    // that rounded sum (one more rounding); float16 AVG divides each input
    // first (braid.h). Rounding through float or double first agrees: each
    // is one operation, and the wider type has twice the precision and more.
    auto rounded = [dt](double x) { return bits_to_double(dt, double_to_bits(dt, x)); };
    double s = 0;
    for (int r = 0; r < n; ++r) s += scaled ? rounded(g.value(r, idx) / n) : g.value(r, idx);
    e.bits = double_to_bits(dt, op == BRAID_AVG && !scaled ? rounded(s) / n : s);
    return e;
  }
  double s = 0, sabs = 0;
  for (int r = 0; r < n; ++r) {
    double v = g.value(r, idx);
    s += v;
    sabs += std::fabs(v);
  }
  double res = op == BRAID_AVG ? s / n : s;
  // Scaled exact inputs stay exact where n is a power of two (k / 2^m fits
  // float16 for the exact mode's |k| <= 2048); otherwise each one rounds.
  if (!g.tolerant() && !(scaled && (n & (n - 1)) != 0)) {
    e.bits = double_to_bits(dt, res);  // exact by construction
    return e;
  }
  // Each of the n-1 additions (done in the dtype when partial sums travel
  // between ranks) errs by at most u * sum|x|; the final rounding (and the
  // division for avg) by u * |result|. Scaled inputs: each x/n errs by
  // u * |x| / n, and each addition by u * sum|x| / n. Factor 2 for safety.
  double u = unit_roundoff(dt);
  double tol = 2.0 * u * std::max(n - 1, 1) * sabs + 2.0 * tiny_value(dt);
  if (scaled)
    tol = 2.0 * u * sabs + 2.0 * u * std::fabs(res) + 2.0 * n * tiny_value(dt);
  else if (op == BRAID_AVG)
    tol = tol / n + 2.0 * u * std::fabs(res);
  else
    tol += 2.0 * u * std::fabs(res);
  e.value = res;
  e.bits = double_to_bits(dt, res);
  e.tol = tol;
  return e;
}

// ---------------------------------------------------------------- buffers ---

// One allocation: [front guard][data: elems elements][back guard], every byte
// initialised (junk or input) and snapshotted before the call.
// Recycles allocations between the checks of a group: fresh pages cost a
// fault each, which otherwise dominates the largest checks.
// With an arena (registered memory, CheckOptions::registered_arena_bytes),
// new allocations are cut from it until it is full, then from the heap;
// clear() (between groups, when no buffer is live) empties it again.
class Pool {
 public:
  Pool() = default;
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  ~Pool() { clear(); }

  void use_arena(uint8_t* base, size_t bytes) {
    clear();
    arena_ = base;
    arena_bytes_ = bytes;
  }
  int64_t heap_allocations() const { return heap_allocations_; }

  uint8_t* get(size_t bytes, size_t* capacity) {
    size_t best = free_.size();
    for (size_t i = 0; i < free_.size(); ++i)
      if (free_[i].cap >= bytes && (best == free_.size() || free_[i].cap < free_[best].cap)) best = i;
    if (best != free_.size()) {
      Block b = free_[best];
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
      *capacity = b.cap;
      return b.ptr;
    }
    size_t cap = (std::max<size_t>(bytes, 1) + 4095) & ~size_t{4095};
    *capacity = cap;
    if (arena_ != nullptr && arena_bytes_ - arena_used_ >= cap) {
      uint8_t* p = arena_ + arena_used_;
      arena_used_ += cap;
      return p;
    }
    if (arena_ != nullptr) ++heap_allocations_;
    return static_cast<uint8_t*>(::operator new(cap, std::align_val_t(64)));
  }
  void put(uint8_t* p, size_t cap) {
    if (p == nullptr) return;
    free_.push_back({p, cap});
    if (free_.size() <= kMaxFree) return;
    // Arena blocks stay listed until clear(): only heap blocks go back.
    for (size_t i = 0; i < free_.size(); ++i) {
      if (in_arena(free_[i].ptr)) continue;
      ::operator delete(free_[i].ptr, std::align_val_t(64));
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
      return;
    }
  }
  void clear() {
    for (const Block& b : free_)
      if (!in_arena(b.ptr)) ::operator delete(b.ptr, std::align_val_t(64));
    free_.clear();
    arena_used_ = 0;
  }

 private:
  static constexpr size_t kMaxFree = 12;
  struct Block {
    uint8_t* ptr;
    size_t cap;
  };
  bool in_arena(const uint8_t* p) const {
    return arena_ != nullptr && p >= arena_ && p < arena_ + arena_bytes_;
  }
  std::vector<Block> free_;
  uint8_t* arena_ = nullptr;
  size_t arena_bytes_ = 0, arena_used_ = 0;
  int64_t heap_allocations_ = 0;
};

// One allocation: [front guard][data: elems elements][back guard], every byte
// initialised (junk or input) and snapshotted before the call.
class Buffer {
 public:
  Buffer(Pool& pool, const char* name, size_t elems, size_t es, size_t guard, size_t misalign,
         uint64_t junk_key)
      : pool_(pool), name_(name), elems_(elems), es_(es) {
    front_ = guard + misalign;
    total_ = front_ + elems * es + guard;
    base_ = pool_.get(total_, &cap_);
    // xorshift64*: cheap, and not periodic (a periodic pattern could hide a
    // library that moves bytes around inside the buffer).
    uint64_t x = junk_key | 1;
    auto next = [&x] {
      x ^= x >> 12;
      x ^= x << 25;
      x ^= x >> 27;
      return x * 0x2545f4914f6cdd1dull;
    };
    size_t i = 0;
    for (; i + 8 <= total_; i += 8) {
      uint64_t w = next();
      std::memcpy(base_ + i, &w, 8);
    }
    if (i < total_) {
      uint64_t w = next();
      std::memcpy(base_ + i, &w, total_ - i);
    }
  }
  ~Buffer() {
    pool_.put(base_, cap_);
    pool_.put(snap_, snap_cap_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  const char* name() const { return name_; }
  uint8_t* data() { return base_ + front_; }
  uint8_t* at(size_t elem) { return data() + elem * es_; }
  size_t elems() const { return elems_; }
  void set(size_t i, uint64_t bits) { std::memcpy(data() + i * es_, &bits, es_); }  // little endian
  uint64_t get(size_t i) const {
    uint64_t b = 0;
    std::memcpy(&b, base_ + front_ + i * es_, es_);
    return b;
  }
  void snapshot() {
    if (snap_ == nullptr) snap_ = pool_.get(total_, &snap_cap_);
    std::memcpy(snap_, base_, total_);
  }

  // First byte in [lo, hi) (offsets into the allocation) that differs from the snapshot, or -1.
  int64_t first_change(size_t lo, size_t hi) const {
    if (lo >= hi || std::memcmp(base_ + lo, snap_ + lo, hi - lo) == 0) return -1;
    for (size_t i = lo; i < hi; ++i)
      if (base_[i] != snap_[i]) return static_cast<int64_t>(i);
    return -1;
  }
  uint8_t byte(size_t off) const { return base_[off]; }
  uint8_t snap_byte(size_t off) const { return snap_[off]; }
  size_t front() const { return front_; }
  size_t total() const { return total_; }

 private:
  Pool& pool_;
  const char* name_;
  size_t elems_, es_;
  size_t front_ = 0, total_ = 0;
  uint8_t* base_ = nullptr;
  size_t cap_ = 0;
  uint8_t* snap_ = nullptr;
  size_t snap_cap_ = 0;
};

struct Output {
  Buffer* buf;
  size_t begin;  // element index in buf
  size_t count;
  std::function<Expect(size_t k)> expect;  // k in [0, count)
};

// ------------------------------------------------------------------ check ---

// Data shared by the checks of one (collective, dtype, count, op, data mode)
// block, which differ only in root, placement and form: the generator, this
// rank's input and the reduction reference (computed once per block).
struct Block {
  Block(braid_dtype_t dt, Mode mode, uint64_t seed, int nranks) : gen(dt, mode, seed, nranks) {}
  Gen gen;
  std::vector<uint8_t> input;  // this rank's elements 0, 1, ... in the dtype
  bool ref_ready = false;
  uint64_t ref_idx0 = 0;
  std::vector<Expect> ref;
};

struct Desc {
  Collective coll = Collective::kAllReduce;
  braid_dtype_t dt = BRAID_INT8;
  int op = -1;
  int root = -1;
  size_t count = 0;
  bool in_place = false;
  bool blocking = true;
  Mode mode = Mode::kBits;
  int wait_style = 0;   // i-forms: 0 braid_wait, 1 braid_test loop, 2 braid_wait_all
  size_t misalign = 0;  // bytes added to the front guard (one element, or 0)
  bool order = false;   // p2p: post receives first
  uint64_t seed = 0;    // junk patterns of this check (inputs come from the Block)
  uint64_t seq = 0;     // position in the matrix, the same on every rank
};

std::string describe(const Desc& d) {
  std::string s = kCollNames[static_cast<int>(d.coll)];
  if (d.coll == Collective::kBarrier) {
    s += d.blocking ? " blocking" : " i-form";
    if (!d.blocking) s += d.wait_style == 1 ? "(test)" : "(wait)";
    return s;
  }
  char buf[256];
  std::snprintf(buf, sizeof buf, " %s op=%s root=%s count=%zu %s %s", kDtypeNames[d.dt],
                d.op >= 0 ? kOpNames[d.op] : "-", d.root >= 0 ? std::to_string(d.root).c_str() : "-", d.count,
                d.coll == Collective::kIsendIrecv && d.blocking ? "odd-ranks-recv-first"
                : is_p2p(d.coll)                                ? (d.order ? "recv-first" : "send-first")
                : d.in_place                                    ? "in-place"
                                                                : "out-of-place",
                d.blocking ? "blocking"
                           : (d.wait_style == 1   ? "i-form(test)"
                              : d.wait_style == 2 ? "i-form(wait_all)"
                                                  : "i-form(wait)"));
  s += buf;
  s += " data=";
  s += mode_name(d.mode);
  if (d.misalign) s += " misaligned";
  return s;
}

struct Result {
  bool api_error = false;
  std::string api_msg;
  int64_t wrong = 0;
  int64_t compared = 0;
  bool have_first = false;
  std::string first_where;  // "recvbuf[5]"
  Expect first_expect;
  uint64_t first_got = 0;
  bool outside = false;
  std::string outside_msg;
  bool failed() const { return api_error || wrong > 0 || outside; }
};

class Runner {
 public:
  Runner(braid_comm_t comm, const CheckOptions& opts) : comm_(comm), o_(opts) {
    log_ = o_.log ? o_.log : stderr;
  }

  CheckReport run();

 private:
  void say(const char* fmt, ...) __attribute__((format(printf, 2, 3)));
  bool api(braid_result_t r, const char* fn, Result& res);
  void misuse(const std::string& what, Result& res);
  void complete(std::vector<braid_request_t>& reqs, int style, Result& res);
  void run_group(Collective c, braid_dtype_t dt, size_t count);
  void run_barrier_group();
  void run_check(const Desc& d, Block* blk);
  void execute(const Desc& d, Result& res, Block* blk);
  void verify(Buffer& b, const Output* out, braid_dtype_t dt, Result& res);
  bool finish_group(const std::string& label, std::chrono::steady_clock::time_point started);
  std::unique_ptr<Buffer> make(const Desc& d, const char* name, size_t elems, int salt);
  uint64_t next_seq() { return seq_++; }

  braid_comm_t comm_;
  const CheckOptions& o_;
  FILE* log_;
  int rank_ = 0, n_ = 1;
  CheckReport rep_;
  uint64_t seq_ = 0;
  int lines_ = 0;
  bool broken_ = false;
  Pool pool_;
  // Current group.
  std::vector<uint8_t> g_flags_;
  int64_t g_checks_ = 0, g_failed_ = 0, g_wrong_ = 0, g_api_ = 0, g_injected_ = 0;
};

void Runner::say(const char* fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  int len = std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (len < 0) return;
  size_t n = std::min(static_cast<size_t>(len), sizeof buf - 2);
  if (n == 0 || buf[n - 1] != '\n') buf[n++] = '\n';
  // One write per line, so that lines of concurrent ranks do not interleave.
  std::fflush(log_);
  size_t off = 0;
  while (off < n) {
    ssize_t w = ::write(fileno(log_), buf + off, n - off);
    if (w <= 0) break;
    off += static_cast<size_t>(w);
  }
}

bool Runner::api(braid_result_t r, const char* fn, Result& res) {
  if (r == BRAID_SUCCESS) return true;
  ++rep_.api_errors;
  ++g_api_;
  const char* msg = braid_comm_get_last_error(comm_);
  std::string m =
      std::string(fn) + " returned " + result_name(r) + ": " + (msg && *msg ? msg : "(no message)");
  if (!res.api_error) {
    res.api_error = true;
    res.api_msg = m;
  } else {
    res.api_msg += "; " + m;
  }
  braid_result_t async = BRAID_SUCCESS;
  if (braid_comm_get_async_error(comm_, &async) != BRAID_SUCCESS || async != BRAID_SUCCESS) broken_ = true;
  return false;
}

// A call that returned success but broke the API contract.
void Runner::misuse(const std::string& what, Result& res) {
  ++rep_.api_errors;
  ++g_api_;
  if (!res.api_msg.empty()) res.api_msg += "; ";
  res.api_error = true;
  res.api_msg += what;
}

// Completes every non-null request in reqs with the given style.
void Runner::complete(std::vector<braid_request_t>& reqs, int style, Result& res) {
  if (style == 2) {
    std::vector<braid_request_t> live;
    for (auto r : reqs)
      if (r) live.push_back(r);
    if (!live.empty()) api(braid_wait_all(static_cast<int>(live.size()), live.data()), "braid_wait_all", res);
    for (auto& r : reqs) r = nullptr;
    return;
  }
  if (style == 0) {
    for (auto& r : reqs)
      if (r) api(braid_wait(&r), "braid_wait", res);
    return;
  }
  // braid_test loop over all requests: spin briefly, then sleep a little
  // (ranks may outnumber cores).
  double limit = o_.op_timeout_s > 0 ? o_.op_timeout_s : 600.0;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(limit);
  for (int iter = 0;; ++iter) {
    bool pending = false;
    for (auto& r : reqs) {
      if (!r) continue;
      int done = 0;
      braid_result_t rc = braid_test(&r, &done);
      if (done) {
        api(rc, "braid_test", res);
        if (r != nullptr) {
          misuse("braid_test reported done but did not set *request to NULL", res);
          r = nullptr;
        }
      } else if (rc != BRAID_SUCCESS) {
        api(rc, "braid_test (not done)", res);
        braid_request_free(r);
        r = nullptr;
      } else {
        pending = true;
      }
    }
    if (!pending) return;
    if (std::chrono::steady_clock::now() > deadline) {
      misuse("braid_test loop: not done after " + std::to_string(limit) + " s", res);
      broken_ = true;
      for (auto& r : reqs)
        if (r) braid_request_free(r), r = nullptr;
      return;
    }
    if (iter > 64) {
      struct timespec ts = {0, 20 * 1000};
      nanosleep(&ts, nullptr);
    }
  }
}

std::unique_ptr<Buffer> Runner::make(const Desc& d, const char* name, size_t elems, int salt) {
  uint64_t key =
      mix64(d.seed ^ mix64(0x6a756e6bull + static_cast<uint64_t>(rank_) * 131 + static_cast<uint64_t>(salt)));
  return std::make_unique<Buffer>(pool_, name, elems, esize(d.dt), o_.guard_bytes, d.misalign, key);
}

void Runner::verify(Buffer& b, const Output* out, braid_dtype_t dt, Result& res) {
  size_t es = esize(dt);
  size_t lo = out ? b.front() + out->begin * es : b.total();
  size_t hi = out ? lo + out->count * es : b.total();
  if (!out) lo = hi = b.total();
  int64_t at = b.first_change(0, lo);
  if (at < 0) at = b.first_change(hi, b.total());
  if (at >= 0 && !res.outside) {
    res.outside = true;
    int64_t rel = at - static_cast<int64_t>(b.front());
    int64_t data_bytes = static_cast<int64_t>(b.elems() * es);
    char buf[256];
    const char* where = rel < 0             ? "in the guard before the buffer"
                        : rel >= data_bytes ? "in the guard after the buffer"
                                            : "inside the buffer, outside the output";
    char range[96];
    if (out)
      std::snprintf(range, sizeof range, "output is elements [%zu, %zu) of %zu", out->begin,
                    out->begin + out->count, b.elems());
    else
      std::snprintf(range, sizeof range, "no output in this buffer; %zu elements", b.elems());
    std::snprintf(buf, sizeof buf, "%s byte %+" PRId64 " (%s; %s) changed 0x%02x -> 0x%02x", b.name(), rel,
                  where, range, b.snap_byte(static_cast<size_t>(at)), b.byte(static_cast<size_t>(at)));
    res.outside_msg = buf;
  }
  if (!out) return;
  for (size_t k = 0; k < out->count; ++k) {
    Expect e = out->expect(k);
    uint64_t got = b.get(out->begin + k);
    bool ok;
    if (e.tol < 0) {
      ok = got == (e.bits & width_mask(es));
    } else {
      double v = bits_to_double(dt, got);
      ok = std::isfinite(v) && std::fabs(v - e.value) <= e.tol;
    }
    ++res.compared;
    if (ok) continue;
    if (!res.have_first) {
      res.have_first = true;
      res.first_where = std::string(b.name()) + "[" + std::to_string(out->begin + k) + "]";
      res.first_expect = e;
      res.first_got = got;
    }
    ++res.wrong;
  }
}

void Runner::execute(const Desc& d, Result& res, Block* blk_in) {
  const int n = n_, rank = rank_;
  const size_t c = d.count, nc = static_cast<size_t>(n) * d.count;
  const braid_dtype_t dt = d.dt;
  const braid_redop_t op = static_cast<braid_redop_t>(d.op < 0 ? 0 : d.op);
  const int root = d.root;
  const bool ip = d.in_place;
  Block empty(dt, d.mode, d.seed, n);  // barrier: no data
  Block& blk = blk_in ? *blk_in : empty;
  const Gen& g = blk.gen;
  std::vector<std::unique_ptr<Buffer>> bufs;
  std::vector<Output> outs;  // at most one per buffer
  const size_t es = esize(dt);
  auto fill = [&](Buffer* b, size_t begin, size_t cnt, int src, uint64_t idx0) {
    if (src == rank && (idx0 + cnt) * es <= blk.input.size()) {
      if (cnt > 0) std::memcpy(b->at(begin), blk.input.data() + idx0 * es, cnt * es);
      return;
    }
    for (size_t k = 0; k < cnt; ++k) b->set(begin + k, g.bits(src, idx0 + k));
  };
  auto add = [&](std::unique_ptr<Buffer> b) {
    Buffer* p = b.get();
    bufs.push_back(std::move(b));
    return p;
  };
  auto move_expect = [&g](int src, uint64_t idx0) {
    return [&g, src, idx0](size_t k) {
      Expect e;
      e.bits = g.bits(src, idx0 + k);
      return e;
    };
  };
  auto red_expect = [&blk, op](uint64_t idx0, size_t cnt) {
    if (!blk.ref_ready || blk.ref_idx0 != idx0 || blk.ref.size() != cnt) {
      blk.ref.resize(cnt);
      for (size_t k = 0; k < cnt; ++k) blk.ref[k] = reduce_ref(blk.gen, op, idx0 + k);
      blk.ref_ready = true;
      blk.ref_idx0 = idx0;
    }
    return [&blk](size_t k) { return blk.ref[k]; };
  };
  // Unused buffers of non-roots: a real (checked-untouched) buffer for the
  // blocking form, NULL for the i-form (both allowed by the API).
  const bool null_unused = !d.blocking;
  const bool is_root = rank == root;
  std::vector<braid_request_t> reqs;
  braid_request_t req = nullptr;
  braid_result_t r = BRAID_SUCCESS;
  const char* fn = "";

  switch (d.coll) {
    case Collective::kAllReduce: {
      Buffer* s = add(make(d, ip ? "buf" : "sendbuf", c, 1));
      fill(s, 0, c, rank, 0);
      Buffer* rb = ip ? s : add(make(d, "recvbuf", c, 2));
      outs.push_back({rb, 0, c, red_expect(0, c)});
      for (auto& b : bufs) b->snapshot();
      fn = d.blocking ? "braid_all_reduce" : "braid_iall_reduce";
      r = d.blocking ? braid_all_reduce(s->data(), rb->data(), c, dt, op, comm_, nullptr)
                     : braid_iall_reduce(s->data(), rb->data(), c, dt, op, comm_, nullptr, &req);
      break;
    }
    case Collective::kBroadcast: {
      Buffer* s = nullptr;
      Buffer* rb = nullptr;
      if (ip) {
        s = rb = add(make(d, "buf", c, 1));
        if (is_root) fill(s, 0, c, rank, 0);
      } else {
        if (is_root || !null_unused) s = add(make(d, "sendbuf", c, 1));
        if (is_root) fill(s, 0, c, rank, 0);
        rb = add(make(d, "recvbuf", c, 2));
      }
      outs.push_back({rb, 0, c, move_expect(root, 0)});
      for (auto& b : bufs) b->snapshot();
      void* sp = s ? s->data() : nullptr;
      fn = d.blocking ? "braid_broadcast" : "braid_ibroadcast";
      r = d.blocking ? braid_broadcast(sp, rb->data(), c, dt, root, comm_, nullptr)
                     : braid_ibroadcast(sp, rb->data(), c, dt, root, comm_, nullptr, &req);
      break;
    }
    case Collective::kReduce: {
      Buffer* s = add(make(d, ip ? "buf" : "sendbuf", c, 1));
      fill(s, 0, c, rank, 0);
      Buffer* rb = ip ? s : nullptr;
      if (!ip && (is_root || !null_unused)) rb = add(make(d, "recvbuf", c, 2));
      if (is_root) outs.push_back({rb, 0, c, red_expect(0, c)});
      for (auto& b : bufs) b->snapshot();
      void* rp = rb ? rb->data() : nullptr;
      fn = d.blocking ? "braid_reduce" : "braid_ireduce";
      r = d.blocking ? braid_reduce(s->data(), rp, c, dt, op, root, comm_, nullptr)
                     : braid_ireduce(s->data(), rp, c, dt, op, root, comm_, nullptr, &req);
      break;
    }
    case Collective::kAllGather: {
      Buffer* rb = add(make(d, "recvbuf", nc, 2));
      Buffer* s = rb;
      if (ip) {
        fill(rb, rank * c, c, rank, 0);
      } else {
        s = add(make(d, "sendbuf", c, 1));
        fill(s, 0, c, rank, 0);
      }
      outs.push_back({rb, 0, nc, [&g, c](size_t k) {
                        Expect e;
                        e.bits = g.bits(static_cast<int>(k / c), k % c);
                        return e;
                      }});
      for (auto& b : bufs) b->snapshot();
      void* sp = ip ? rb->at(rank * c) : s->data();
      fn = d.blocking ? "braid_all_gather" : "braid_iall_gather";
      r = d.blocking ? braid_all_gather(sp, rb->data(), c, dt, comm_, nullptr)
                     : braid_iall_gather(sp, rb->data(), c, dt, comm_, nullptr, &req);
      break;
    }
    case Collective::kReduceScatter: {
      Buffer* s = add(make(d, ip ? "buf" : "sendbuf", nc, 1));
      fill(s, 0, nc, rank, 0);
      Buffer* rb = ip ? s : add(make(d, "recvbuf", c, 2));
      size_t begin = ip ? rank * c : 0;
      outs.push_back({rb, begin, c, red_expect(rank * c, c)});
      for (auto& b : bufs) b->snapshot();
      void* rp = rb->at(begin);
      fn = d.blocking ? "braid_reduce_scatter" : "braid_ireduce_scatter";
      r = d.blocking ? braid_reduce_scatter(s->data(), rp, c, dt, op, comm_, nullptr)
                     : braid_ireduce_scatter(s->data(), rp, c, dt, op, comm_, nullptr, &req);
      break;
    }
    case Collective::kGather: {
      Buffer* s = nullptr;
      Buffer* rb = nullptr;
      if (ip) {
        rb = s = add(make(d, "buf", nc, 2));
        fill(rb, rank * c, c, rank, 0);
      } else {
        s = add(make(d, "sendbuf", c, 1));
        fill(s, 0, c, rank, 0);
        if (is_root || !null_unused) rb = add(make(d, "recvbuf", nc, 2));
      }
      if (is_root)
        outs.push_back({rb, 0, nc, [&g, c](size_t k) {
                          Expect e;
                          e.bits = g.bits(static_cast<int>(k / c), k % c);
                          return e;
                        }});
      for (auto& b : bufs) b->snapshot();
      void* sp = ip ? rb->at(rank * c) : s->data();
      void* rp = rb ? rb->data() : nullptr;
      fn = d.blocking ? "braid_gather" : "braid_igather";
      r = d.blocking ? braid_gather(sp, rp, c, dt, root, comm_, nullptr)
                     : braid_igather(sp, rp, c, dt, root, comm_, nullptr, &req);
      break;
    }
    case Collective::kScatter: {
      Buffer* s = nullptr;
      Buffer* rb = nullptr;
      size_t begin = 0;
      if (ip) {
        s = rb = add(make(d, "buf", nc, 1));
        if (is_root) fill(s, 0, nc, rank, 0);
        begin = rank * c;
      } else {
        if (is_root || !null_unused) s = add(make(d, "sendbuf", nc, 1));
        if (is_root) fill(s, 0, nc, rank, 0);
        rb = add(make(d, "recvbuf", c, 2));
      }
      outs.push_back({rb, begin, c, move_expect(root, rank * c)});
      for (auto& b : bufs) b->snapshot();
      void* sp = s ? s->data() : nullptr;
      void* rp = rb->at(begin);
      fn = d.blocking ? "braid_scatter" : "braid_iscatter";
      r = d.blocking ? braid_scatter(sp, rp, c, dt, root, comm_, nullptr)
                     : braid_iscatter(sp, rp, c, dt, root, comm_, nullptr, &req);
      break;
    }
    case Collective::kAllToAll: {
      Buffer* s = add(make(d, ip ? "buf" : "sendbuf", nc, 1));
      fill(s, 0, nc, rank, 0);
      Buffer* rb = ip ? s : add(make(d, "recvbuf", nc, 2));
      outs.push_back({rb, 0, nc, [&g, c, rank](size_t k) {
                        Expect e;
                        e.bits = g.bits(static_cast<int>(k / c), rank * c + k % c);
                        return e;
                      }});
      for (auto& b : bufs) b->snapshot();
      fn = d.blocking ? "braid_all_to_all" : "braid_iall_to_all";
      r = d.blocking ? braid_all_to_all(s->data(), rb->data(), c, dt, comm_, nullptr)
                     : braid_iall_to_all(s->data(), rb->data(), c, dt, comm_, nullptr, &req);
      break;
    }
    case Collective::kSendRecv: {
      int right = (rank + 1) % n, left = (rank + n - 1) % n;
      Buffer* s = add(make(d, "sendbuf", c, 1));
      fill(s, 0, c, rank, 0);
      Buffer* rb = add(make(d, "recvbuf", c, 2));
      outs.push_back({rb, 0, c, move_expect(left, 0)});
      for (auto& b : bufs) b->snapshot();
      if (!api(braid_group_start(), "braid_group_start", res)) break;
      reqs.assign(2, nullptr);
      for (int step = 0; step < 2; ++step) {
        bool do_recv = (step == 0) == d.order;
        if (do_recv) {
          if (d.blocking)
            api(braid_recv(rb->data(), c, dt, left, comm_, nullptr), "braid_recv (in group)", res);
          else
            api(braid_irecv(rb->data(), c, dt, left, comm_, nullptr, &reqs[0]), "braid_irecv (in group)",
                res);
        } else {
          if (d.blocking)
            api(braid_send(s->data(), c, dt, right, comm_, nullptr), "braid_send (in group)", res);
          else
            api(braid_isend(s->data(), c, dt, right, comm_, nullptr, &reqs[1]), "braid_isend (in group)",
                res);
        }
      }
      api(braid_group_end(), "braid_group_end", res);
      if (!d.blocking) complete(reqs, d.wait_style, res);
      break;
    }
    case Collective::kIsendIrecv: {
      int right = (rank + 1) % n, left = (rank + n - 1) % n;
      size_t c2 = c / 2 + 1;  // a second message of another size: matching must follow post order
      Buffer* s1 = add(make(d, "sendbuf1", c, 1));
      Buffer* s2 = add(make(d, "sendbuf2", c2, 3));
      fill(s1, 0, c, rank, 0);
      fill(s2, 0, c2, rank, c);
      Buffer* r1 = add(make(d, "recvbuf1", c, 2));
      Buffer* r2 = add(make(d, "recvbuf2", c2, 4));
      outs.push_back({r1, 0, c, move_expect(left, 0)});
      outs.push_back({r2, 0, c2, move_expect(left, c)});
      for (auto& b : bufs) b->snapshot();
      if (d.blocking) {
        // Deadlock-free even with rendezvous sends: odd ranks receive first.
        bool recv_first = rank % 2 == 1;
        for (int step = 0; step < 2; ++step) {
          if ((step == 0) == recv_first) {
            if (!api(braid_recv(r1->data(), c, dt, left, comm_, nullptr), "braid_recv", res)) break;
            if (!api(braid_recv(r2->data(), c2, dt, left, comm_, nullptr), "braid_recv", res)) break;
          } else {
            if (!api(braid_send(s1->data(), c, dt, right, comm_, nullptr), "braid_send", res)) break;
            if (!api(braid_send(s2->data(), c2, dt, right, comm_, nullptr), "braid_send", res)) break;
          }
        }
      } else {
        reqs.assign(4, nullptr);
        for (int step = 0; step < 2; ++step) {
          if ((step == 0) == d.order) {
            api(braid_irecv(r1->data(), c, dt, left, comm_, nullptr, &reqs[0]), "braid_irecv", res);
            api(braid_irecv(r2->data(), c2, dt, left, comm_, nullptr, &reqs[1]), "braid_irecv", res);
          } else {
            api(braid_isend(s1->data(), c, dt, right, comm_, nullptr, &reqs[2]), "braid_isend", res);
            api(braid_isend(s2->data(), c2, dt, right, comm_, nullptr, &reqs[3]), "braid_isend", res);
          }
        }
        complete(reqs, d.wait_style, res);
      }
      break;
    }
    case Collective::kBarrier: {
      fn = d.blocking ? "braid_barrier" : "braid_ibarrier";
      r = d.blocking ? braid_barrier(comm_, nullptr) : braid_ibarrier(comm_, nullptr, &req);
      break;
    }
    default:
      break;
  }

  if (*fn) {  // a single collective call
    if (api(r, fn, res) && !d.blocking) {
      if (req == nullptr) {
        misuse(std::string(fn) + " returned BRAID_SUCCESS but no request", res);
      } else {
        reqs.assign(1, req);
        complete(reqs, d.wait_style, res);
      }
    }
  }
  if (res.api_error) return;  // the data means nothing after a failed call
  if (o_.inject_fault_every > 0 && d.seq % o_.inject_fault_every == 0 && !bufs.empty() &&
      rank == static_cast<int>((d.seq / o_.inject_fault_every) % n)) {
    // Flip a high bit of one output element (far outside any tolerance), or
    // a byte of the guard after the first buffer when this rank has no output.
    const Output* o = nullptr;
    for (auto& out : outs)
      if (out.count > 0) o = &out;
    if (o != nullptr) {
      o->buf->at(o->begin + o->count / 2)[esize(dt) - 1] ^= 0x40;
      ++rep_.injected;
      ++g_injected_;
    } else if (o_.guard_bytes >= 4) {
      bufs[0]->data()[bufs[0]->elems() * esize(dt) + 3] ^= 0x5a;
      ++rep_.injected;
      ++g_injected_;
    }
  }
  for (auto& b : bufs) {
    const Output* out = nullptr;
    for (auto& o : outs)
      if (o.buf == b.get()) out = &o;
    verify(*b, out, dt, res);
  }
}

void Runner::run_check(const Desc& d, Block* blk) {
  ++rep_.checks;
  ++g_checks_;
  Result res;
  execute(d, res, blk);
  bool failed = res.failed();
  g_flags_.push_back(failed ? 1 : 0);
  if (!failed) {
    if (o_.verbose >= 2) say("braid-check: rank %d: ok   %s", rank_, describe(d).c_str());
    return;
  }
  ++rep_.failed;
  ++g_failed_;
  rep_.wrong_elements += res.wrong;
  g_wrong_ += res.wrong;
  if (res.outside) ++rep_.outside_writes;
  if (lines_ >= o_.max_failure_lines) {
    if (lines_ == o_.max_failure_lines)
      say("braid-check: rank %d: more failures; not printing them (max %d lines)", rank_,
          o_.max_failure_lines);
    ++lines_;
    return;
  }
  ++lines_;
  std::string what = describe(d);
  if (res.api_error) {
    say("braid-check: rank %d: FAIL %s: %s", rank_, what.c_str(), res.api_msg.c_str());
    return;
  }
  std::string detail;
  if (res.wrong > 0) {
    const Expect& e = res.first_expect;
    detail = std::to_string(res.wrong) + " of " + std::to_string(res.compared) + " elements wrong, first " +
             res.first_where + ": expected " + format_elem(d.dt, e.bits);
    if (e.tol >= 0) {
      char buf[96];
      std::snprintf(buf, sizeof buf, " (exact %.17g, tolerance %.3g)", e.value, e.tol);
      detail += buf;
    }
    detail += " got " + format_elem(d.dt, res.first_got);
  }
  if (res.outside) {
    if (!detail.empty()) detail += "; ";
    detail += "wrote outside the output: " + res.outside_msg;
  }
  say("braid-check: rank %d: FAIL %s: %s", rank_, what.c_str(), detail.c_str());
}

void Runner::run_group(Collective c, braid_dtype_t dt, size_t count) {
  std::vector<int> ops;
  if (is_reducing(c)) {
    if (o_.ops.empty()) {
      for (int op = 0; op < BRAID_NUM_OPS; ++op)
        if (op_valid(dt, static_cast<braid_redop_t>(op))) ops.push_back(op);
    } else {
      for (braid_redop_t op : o_.ops)
        if (op >= 0 && op < BRAID_NUM_OPS && op_valid(dt, op)) ops.push_back(op);
    }
  } else {
    ops.push_back(-1);
  }
  std::vector<int> roots;
  if (is_rooted(c)) {
    if (o_.roots.empty()) {
      for (int r = 0; r < n_; ++r) roots.push_back(r);
    } else {
      for (int r : o_.roots)
        if (r >= 0 && r < n_ && std::find(roots.begin(), roots.end(), r) == roots.end()) roots.push_back(r);
    }
  } else {
    roots.push_back(-1);
  }
  std::vector<bool> places;
  if (is_p2p(c)) {
    places = {false};
  } else {
    if (o_.out_of_place) places.push_back(false);
    if (o_.in_place) places.push_back(true);
  }
  std::vector<bool> forms;
  if (o_.blocking && !(c == Collective::kIsendIrecv && n_ < 2))
    forms.push_back(true);  // self send would block
  if (o_.nonblocking) forms.push_back(false);

  size_t es = esize(dt);
  size_t biggest = count * es * (is_multi(c) ? static_cast<size_t>(n_) : 1);
  for (int op : ops) {
    std::vector<Mode> modes = {primary_mode(c, dt, op)};
    if (is_reducing(c) && is_float(dt) && o_.random_floats && (op == BRAID_SUM || op == BRAID_AVG))
      modes.push_back(Mode::kRandom);
    if (is_reducing(c) && is_float(dt) && (op == BRAID_SUM || op == BRAID_AVG || op == BRAID_PROD))
      modes.push_back(op == BRAID_PROD ? Mode::kRoundProd : Mode::kRoundSum);
    for (Mode mode : modes) {
      bool skip = o_.max_buffer_bytes > 0 && biggest > o_.max_buffer_bytes;
      std::unique_ptr<Block> blk;
      if (!skip) {
        blk = std::make_unique<Block>(dt, mode,
                                      mix64(o_.seed * 0x9e3779b97f4a7c15ull ^ mix64(seq_ + 0x626c6b)), n_);
        size_t elems =
            is_p2p(c) ? count + count / 2 + 1 : count * (is_multi(c) ? static_cast<size_t>(n_) : 1);
        blk->input.resize(elems * es);
        for (size_t i = 0; i < elems; ++i) {
          uint64_t b = blk->gen.bits(rank_, i);
          std::memcpy(blk->input.data() + i * es, &b, es);
        }
      }
      for (int root : roots) {
        for (bool ip : places) {
          for (bool blocking : forms) {
            uint64_t seq = next_seq();
            Desc d;
            d.coll = c;
            d.dt = dt;
            d.op = op;
            d.root = root;
            d.count = count;
            d.in_place = ip;
            d.blocking = blocking;
            d.mode = mode;
            d.wait_style = static_cast<int>(seq % 3);
            d.misalign = mix64(seq ^ 0x6d6973616c69676eull) % 4 == 0 ? es : 0;
            d.order = (mix64(seq ^ 0x6f72646572ull) & 1) != 0;
            d.seed = mix64(o_.seed * 0x9e3779b97f4a7c15ull + seq);
            d.seq = seq;
            if (skip) {
              ++rep_.skipped;
              continue;
            }
            if (broken_) return;
            run_check(d, blk.get());
          }
        }
      }
    }
  }
}

void Runner::run_barrier_group() {
  for (int i = 0; i < 6; ++i) {
    Desc d;
    d.coll = Collective::kBarrier;
    d.blocking = i % 2 == 0;
    if (d.blocking ? !o_.blocking : !o_.nonblocking) continue;
    uint64_t seq = next_seq();
    d.seq = seq;
    d.wait_style = static_cast<int>(seq % 3);
    if (broken_) return;
    run_check(d, nullptr);
  }
}

// All ranks sum their group counts (braid on braid) and learn which checks
// failed anywhere. Returns false when the run must stop (on every rank alike).
bool Runner::finish_group(const std::string& label, std::chrono::steady_clock::time_point started) {
  int64_t local[6] = {g_checks_, g_failed_, g_wrong_, g_api_, broken_ ? 1 : 0, g_injected_};
  int64_t global[6] = {0, 0, 0, 0, 0, 0};
  Result res;
  bool ok = api(braid_all_reduce(local, global, 6, BRAID_INT64, BRAID_SUM, comm_, nullptr),
                "braid_all_reduce (group counts)", res);
  std::vector<uint8_t> any(g_flags_.size(), 0);
  if (ok && !g_flags_.empty())
    ok = api(braid_all_reduce(g_flags_.data(), any.data(), g_flags_.size(), BRAID_UINT8, BRAID_MAX, comm_,
                              nullptr),
             "braid_all_reduce (group failure flags)", res);
  int64_t distinct = 0;
  for (uint8_t f : any) distinct += f != 0;
  bool stop = false;
  if (!ok) {
    rep_.agreement_ok = false;
    say("braid-check: rank %d: %s: agreement failed: %s", rank_, label.c_str(), res.api_msg.c_str());
    stop = true;
    distinct = g_failed_;
    global[1] = g_failed_, global[2] = g_wrong_, global[3] = g_api_, global[5] = g_injected_;
  } else {
    bool consistent = global[0] == g_checks_ * n_ && distinct <= global[1] &&
                      (distinct > 0) == (global[1] > 0) && (g_failed_ == 0 || distinct >= 1);
    for (size_t i = 0; i < any.size() && consistent; ++i)
      if (g_flags_[i] && !any[i]) consistent = false;
    if (!consistent) {
      rep_.agreement_ok = false;
      say("braid-check: rank %d: %s: the count all-reduces disagree: checks %" PRId64 " (expected %" PRId64
          "), failed %" PRId64 " summed vs %" PRId64 " distinct (local %" PRId64 ")",
          rank_, label.c_str(), global[0], g_checks_ * n_, global[1], distinct, g_failed_);
    }
    if (global[4] > 0) stop = true;
  }
  rep_.total_checks += g_checks_;
  rep_.total_failed += distinct;
  rep_.total_wrong_elements += global[2];
  rep_.total_api_errors += global[3];
  rep_.total_injected += global[5];
  if (o_.verbose >= 1 && rank_ == 0)
    say("braid-check: %-44s %5" PRId64 " checks, %" PRId64 " failed (%.3f s)", label.c_str(), g_checks_,
        distinct, std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  g_flags_.clear();
  pool_.clear();  // the next group has other sizes
  g_checks_ = g_failed_ = g_wrong_ = g_api_ = g_injected_ = 0;
  if (stop) {
    rep_.stopped_early = true;
    if (rank_ == 0) say("braid-check: stopping: the communicator is broken (%s)", label.c_str());
  }
  return !stop;
}

CheckReport Runner::run() {
  auto t0 = std::chrono::steady_clock::now();
  Result res;
  if (!api(braid_comm_rank(comm_, &rank_), "braid_comm_rank", res) ||
      !api(braid_comm_size(comm_, &n_), "braid_comm_size", res) || n_ < 1) {
    say("braid-check: cannot query the communicator: %s", res.api_msg.c_str());
    rep_.agreement_ok = false;
    rep_.stopped_early = true;
    return rep_;
  }
  rep_.rank = rank_;
  rep_.nranks = n_;
  if (o_.op_timeout_s > 0 &&
      !api(braid_comm_set_timeout(comm_, o_.op_timeout_s), "braid_comm_set_timeout", res))
    say("braid-check: rank %d: %s", rank_, res.api_msg.c_str());

  void* arena = nullptr;
  if (o_.registered_arena_bytes > 0) {
    // Every rank registers its arena (a collective call): buffers cut from
    // it let the library take its registered-memory paths.
    rep_.registered = true;
    if (!api(braid_mem_alloc(&arena, o_.registered_arena_bytes), "braid_mem_alloc", res) ||
        !api(braid_comm_register(comm_, arena, o_.registered_arena_bytes), "braid_comm_register", res)) {
      say("braid-check: rank %d: no registered arena: %s", rank_, res.api_msg.c_str());
      if (arena != nullptr) braid_mem_free(arena);
      rep_.api_errors = rep_.total_api_errors = 1;
      rep_.stopped_early = true;
      return rep_;
    }
    pool_.use_arena(static_cast<uint8_t*>(arena), o_.registered_arena_bytes);
  }

  std::vector<Collective> colls = o_.collectives.empty() ? all_collectives() : o_.collectives;
  std::vector<braid_dtype_t> dts = o_.dtypes.empty() ? all_dtypes() : o_.dtypes;
  std::vector<size_t> counts = o_.counts.empty() ? default_counts() : o_.counts;
  bool go = true;
  for (Collective c : colls) {
    if (!go) break;
    if (c == Collective::kBarrier) {
      auto g0 = std::chrono::steady_clock::now();
      run_barrier_group();
      go = finish_group("barrier", g0);
      continue;
    }
    for (braid_dtype_t dt : dts) {
      if (!go) break;
      if (dt < 0 || dt >= BRAID_NUM_DTYPES) continue;
      for (size_t count : counts) {
        auto g0 = std::chrono::steady_clock::now();
        run_group(c, dt, count);
        char label[128];
        std::snprintf(label, sizeof label, "%s %s count=%zu", kCollNames[static_cast<int>(c)],
                      kDtypeNames[dt], count);
        go = finish_group(label, g0);
        if (!go) break;
      }
    }
  }
  if (arena != nullptr) {
    rep_.heap_buffers = pool_.heap_allocations();
    pool_.use_arena(nullptr, 0);
    if (!api(braid_comm_transport_bytes(comm_, "shm_window", &rep_.window_bytes),
             "braid_comm_transport_bytes", res) ||
        !api(braid_comm_deregister(comm_, arena), "braid_comm_deregister", res) ||
        !api(braid_mem_free(arena), "braid_mem_free", res)) {
      say("braid-check: rank %d: %s", rank_, res.api_msg.c_str());
      ++rep_.api_errors;
    }
  }
  rep_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep_;
}

struct Alias {
  int value;
  const char* names[4];
};

bool lookup(std::string_view s, const Alias* table, size_t n, int* out) {
  for (size_t i = 0; i < n; ++i) {
    for (const char* name : table[i].names) {
      if (name != nullptr && s == name) {
        *out = table[i].value;
        return true;
      }
    }
  }
  return false;
}

}  // namespace

const char* collective_name(Collective c) {
  int i = static_cast<int>(c);
  return i >= 0 && i < static_cast<int>(Collective::kNumCollectives) ? kCollNames[i] : "?";
}

bool parse_collective(std::string_view s, Collective* out) {
  static constexpr Alias kAliases[] = {
      {static_cast<int>(Collective::kAllReduce), {"all_reduce", "allreduce"}},
      {static_cast<int>(Collective::kBroadcast), {"broadcast", "bcast"}},
      {static_cast<int>(Collective::kReduce), {"reduce"}},
      {static_cast<int>(Collective::kAllGather), {"all_gather", "allgather"}},
      {static_cast<int>(Collective::kReduceScatter), {"reduce_scatter", "reducescatter"}},
      {static_cast<int>(Collective::kGather), {"gather"}},
      {static_cast<int>(Collective::kScatter), {"scatter"}},
      {static_cast<int>(Collective::kAllToAll), {"all_to_all", "alltoall"}},
      {static_cast<int>(Collective::kBarrier), {"barrier"}},
      {static_cast<int>(Collective::kSendRecv), {"send_recv", "sendrecv"}},
      {static_cast<int>(Collective::kIsendIrecv), {"isend_irecv", "isendirecv"}},
  };
  int v = 0;
  if (!lookup(s, kAliases, std::size(kAliases), &v)) return false;
  *out = static_cast<Collective>(v);
  return true;
}

bool parse_dtype(std::string_view s, braid_dtype_t* out) {
  static constexpr Alias kAliases[] = {
      {BRAID_INT8, {"int8", "i8"}},
      {BRAID_UINT8, {"uint8", "u8"}},
      {BRAID_INT32, {"int32", "i32", "int"}},
      {BRAID_UINT32, {"uint32", "u32"}},
      {BRAID_INT64, {"int64", "i64"}},
      {BRAID_UINT64, {"uint64", "u64"}},
      {BRAID_FLOAT16, {"float16", "fp16", "f16", "half"}},
      {BRAID_BFLOAT16, {"bfloat16", "bf16"}},
      {BRAID_FLOAT32, {"float32", "fp32", "f32", "float"}},
      {BRAID_FLOAT64, {"float64", "fp64", "f64", "double"}},
  };
  int v = 0;
  if (!lookup(s, kAliases, std::size(kAliases), &v)) return false;
  *out = static_cast<braid_dtype_t>(v);
  return true;
}

bool parse_redop(std::string_view s, braid_redop_t* out) {
  for (int i = 0; i < BRAID_NUM_OPS; ++i) {
    if (s == kOpNames[i]) {
      *out = static_cast<braid_redop_t>(i);
      return true;
    }
  }
  return false;
}

const char* dtype_label(braid_dtype_t dt) {
  return dt >= 0 && dt < BRAID_NUM_DTYPES ? kDtypeNames[dt] : "?";
}
const char* redop_label(braid_redop_t op) {
  return op >= 0 && op < BRAID_NUM_OPS ? kOpNames[op] : "?";
}

std::vector<Collective> all_collectives() {
  std::vector<Collective> v;
  for (int i = 0; i < static_cast<int>(Collective::kNumCollectives); ++i)
    v.push_back(static_cast<Collective>(i));
  return v;
}

std::vector<braid_dtype_t> all_dtypes() {
  std::vector<braid_dtype_t> v;
  for (int i = 0; i < BRAID_NUM_DTYPES; ++i) v.push_back(static_cast<braid_dtype_t>(i));
  return v;
}

std::vector<size_t> default_counts() {
  return {0, 1, 2, 7, 31, 1024 + 3, 65536 + 17, (size_t{1} << 20) + 1};
}
std::vector<size_t> quick_counts() {
  return {0, 1, 7, 1000, 70000};
}

CheckOptions quick_options() {
  CheckOptions o;
  o.counts = quick_counts();
  return o;
}

std::string CheckReport::summary() const {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%" PRId64 " checks, %" PRId64 " failed, %" PRId64 " wrong elements",
                total_checks, total_failed, total_wrong_elements);
  std::string s = buf;
  if (total_api_errors > 0) s += ", " + std::to_string(total_api_errors) + " API errors";
  if (skipped > 0) s += ", " + std::to_string(skipped) + " skipped (too large)";
  if (!agreement_ok) s += ", ranks disagree";
  if (stopped_early) s += ", stopped early";
  if (total_injected > 0) s += ", " + std::to_string(total_injected) + " faults injected";
  if (registered) {
    s += ", " + std::to_string(window_bytes) + " bytes through registered windows on rank " +
         std::to_string(rank);
    if (heap_buffers > 0) s += " (" + std::to_string(heap_buffers) + " buffers outside the arena)";
  }
  return s;
}

CheckReport run_check_matrix(braid_comm_t comm, const CheckOptions& opts) {
  Runner runner(comm, opts);
  return runner.run();
}

}  // namespace braid::check
