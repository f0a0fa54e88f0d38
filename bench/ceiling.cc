// ceiling: the in-process ceiling of all_reduce, broadcast, all_gather and
// reduce_scatter, what "% of ceiling" is measured against.
//
// N threads (-t, default 2) share one address space; each has its own input
// and output buffer, as N ranks would, and one call of the collective (-C,
// default all_reduce) moves the fewest bytes it can:
// - all_reduce: each thread reduces its 1/N slice of all N inputs in one pass
//   (the slice is walked in blocks that stay in L1, so each input byte is read
//   once and each result byte written once) into the same slice of its own
//   output; a barrier; each thread copies the N - 1 other reduced slices from
//   their owners' outputs into its own output (memcpy: the all-gather);
// - reduce_scatter: the first half of that: thread t reduces block t of all N
//   inputs into its output;
// - all_gather: each thread copies every thread's input (its own included,
//   out of place) into its block of its own output, straight from the owner;
// - broadcast: the root's (thread 0's) input goes to every other output, each
//   thread copying its 1/N slice of it to all of them (so N cores share the
//   N - 1 copies, as processes can when the root writes into its peers'
//   buffers while they read); the root's output is untouched, as in place.
// A barrier ends each call, so that the next one does not overwrite what
// another thread still reads and the threads run calls in step, as ranks do.
// No IPC, no extra copy, no protocol: a shared-memory collective between
// processes can approach this but not pass it.
//
// The barrier spins on an atomic for a short while, then calls sched_yield, so
// that threads may outnumber cores. float32 (-d float) and bfloat16
// (-d bfloat16: reductions convert to float32, sum, round once to nearest even).
//
// The table has the columns of the *_perf binaries' out-of-place group: size,
// count (per rank for all_gather and reduce_scatter, as there), type, redop
// (sum, or none), root (0 for broadcast, else -1), time (mean of -n iterations
// after -w warm-up ones, in us), algbw = size / time, busbw = algbw times the
// collective's factor (2(n-1)/n, 1, (n-1)/n, (n-1)/n), and #wrong (one more
// iteration is checked against exact values).
#include "flags.h"

#include <getopt.h>
#include <sched.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

// ---------------------------------------------------------------------------
// Vectorised reduction loops. Blocks of kBlock elements have a compile-time trip
// count, so the loops vectorise at -O2 as well; AVX-512 and AVX2 clones where
// available (braid's kernels dispatch to AVX-512 too: a ceiling without it
// ran bfloat16 at 0.6-0.7x braid's speed).

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define CEILING_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#endif
#endif
#ifndef CEILING_CLONES
#define CEILING_CLONES
#endif

constexpr size_t kBlock = 2048;  // 8 KiB of float32 per block: the partial sums stay in L1

inline float bf16_to_f32(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

inline uint16_t f32_to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);  // to nearest even, in the top half
  const uint32_t quiet = x | 0x400000u;                     // nan stays (quiet) nan
  // Selecting before the shift keeps the vector code in 32-bit lanes until the final pack.
  return static_cast<uint16_t>(((x & 0x7fffffffu) > 0x7f800000u ? quiet : rounded) >> 16);
}

// dst[i] = a[i] + b[i] for one block.
CEILING_CLONES void add2_block(float* __restrict dst, const float* __restrict a, const float* __restrict b) {
  for (size_t i = 0; i < kBlock; ++i) dst[i] = a[i] + b[i];
}

// dst[i] += a[i] for one block.
CEILING_CLONES void add_block(float* __restrict dst, const float* __restrict a) {
  for (size_t i = 0; i < kBlock; ++i) dst[i] += a[i];
}

// bfloat16: partial sums in float32 (acc), rounded once in the pass that adds the
// last input, so n inputs take n - 1 passes over the block.
CEILING_CLONES void bf16_sum2_block(float* __restrict acc, const uint16_t* __restrict a,
                                    const uint16_t* __restrict b) {
  for (size_t i = 0; i < kBlock; ++i) acc[i] = bf16_to_f32(a[i]) + bf16_to_f32(b[i]);
}

CEILING_CLONES void bf16_add_block(float* __restrict acc, const uint16_t* __restrict a) {
  for (size_t i = 0; i < kBlock; ++i) acc[i] += bf16_to_f32(a[i]);
}

CEILING_CLONES void bf16_add_store_block(uint16_t* __restrict dst, const float* __restrict acc,
                                         const uint16_t* __restrict a) {
  for (size_t i = 0; i < kBlock; ++i) dst[i] = f32_to_bf16(acc[i] + bf16_to_f32(a[i]));
}

CEILING_CLONES void bf16_sum2_store_block(uint16_t* __restrict dst, const uint16_t* __restrict a,
                                          const uint16_t* __restrict b) {
  for (size_t i = 0; i < kBlock; ++i) dst[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

// out[i] = sum over k < n of in[k][i], for i in [lo, hi): every input element
// read once, every output element written once.
void reduce_f32(const std::vector<unsigned char*>& bufs, unsigned char* dst, size_t lo, size_t hi) {
  const size_t n = bufs.size();
  auto in = [&](size_t k) { return reinterpret_cast<const float*>(bufs[k]); };
  float* out = reinterpret_cast<float*>(dst);
  size_t i = lo;
  for (; i + kBlock <= hi; i += kBlock) {
    if (n == 1) {
      std::memcpy(out + i, in(0) + i, kBlock * sizeof(float));
      continue;
    }
    add2_block(out + i, in(0) + i, in(1) + i);
    for (size_t k = 2; k < n; ++k) add_block(out + i, in(k) + i);
  }
  for (; i < hi; ++i) {  // tail
    float acc = in(0)[i];
    for (size_t k = 1; k < n; ++k) acc += in(k)[i];
    out[i] = acc;
  }
}

// The same in bfloat16: summed in float32, rounded once.
void reduce_bf16(const std::vector<unsigned char*>& bufs, unsigned char* dst, size_t lo, size_t hi) {
  alignas(64) float acc[kBlock];
  const size_t n = bufs.size();
  auto in = [&](size_t k) { return reinterpret_cast<const uint16_t*>(bufs[k]); };
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  size_t i = lo;
  for (; i + kBlock <= hi; i += kBlock) {
    if (n == 1) {
      std::memcpy(out + i, in(0) + i, kBlock * sizeof(uint16_t));
    } else if (n == 2) {
      bf16_sum2_store_block(out + i, in(0) + i, in(1) + i);
    } else {
      bf16_sum2_block(acc, in(0) + i, in(1) + i);
      for (size_t k = 2; k + 1 < n; ++k) bf16_add_block(acc, in(k) + i);
      bf16_add_store_block(out + i, acc, in(n - 1) + i);
    }
  }
  for (; i < hi; ++i) {  // tail
    float a = bf16_to_f32(in(0)[i]);
    for (size_t k = 1; k < n; ++k) a += bf16_to_f32(in(k)[i]);
    out[i] = f32_to_bf16(a);
  }
}

// ---------------------------------------------------------------------------
// Barrier: arrive on a counter; the last thread resets it and bumps the
// generation the others wait on (spin, then yield the core).

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class SpinBarrier {
 public:
  explicit SpinBarrier(int n) : n_(n) {}

  void wait() {
    const unsigned gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins < kSpins) {
        cpu_relax();
      } else {
        sched_yield();
      }
    }
  }

 private:
  static constexpr int kSpins = 256;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<unsigned> generation_{0};
  const int n_;
};

// ---------------------------------------------------------------------------
// Options

enum class Type { kFloat32, kBFloat16 };

struct TypeInfo {
  Type type;
  const char* name;   // as the *_perf binaries print it
  const char* alias;  // also accepted by -d
  size_t size;
};

constexpr TypeInfo kTypes[] = {
    {Type::kFloat32, "float", "float32", 4},
    {Type::kBFloat16, "bfloat16", nullptr, 2},
};

enum class Collective { kAllReduce, kBroadcast, kAllGather, kReduceScatter };

struct CollectiveInfo {
  Collective coll;
  const char* name;
  bool reduces;
  bool per_rank_count;  // size = count x threads, as the *_perf binaries count
  double (*busbw_factor)(double n);
};

constexpr CollectiveInfo kCollectives[] = {
    {Collective::kAllReduce, "all_reduce", true, false, [](double n) { return 2 * (n - 1) / n; }},
    {Collective::kBroadcast, "broadcast", false, false, [](double) { return 1.0; }},
    {Collective::kAllGather, "all_gather", false, true, [](double n) { return (n - 1) / n; }},
    {Collective::kReduceScatter, "reduce_scatter", true, true, [](double n) { return (n - 1) / n; }},
};

struct Options : braid_bench::Sweep {
  long threads = 2;
  std::vector<const TypeInfo*> types{&kTypes[0]};
  const CollectiveInfo* coll = &kCollectives[0];
};

void print_usage(FILE* out, const char* prog) {
  std::fprintf(out,
               "Usage: %s [options]\n"
               "  The in-process ceiling of a collective: threads sharing one address space move the\n"
               "  fewest bytes it can (all_reduce: each reduces its slice of every input in one pass,\n"
               "  then copies the other slices). Sizes take K, M, G suffixes (powers of 1024).\n"
               "  -C, --collective <name>    all_reduce, broadcast, all_gather or reduce_scatter\n"
               "                             (default all_reduce)\n"
               "  -t, --threads <n>          threads, the ranks of the collective (default 2)\n"
               "  -b, --minbytes <size>      smallest size (default 8)\n"
               "  -e, --maxbytes <size>      largest size (default 64M)\n"
               "  -f, --stepfactor <n>       multiply the size by n (>= 2) between steps (default 2)\n"
               "  -i, --stepbytes <size>     add this many bytes between steps instead of -f\n"
               "  -n, --iters <n>            timed iterations per size (default 20)\n"
               "  -w, --warmup_iters <n>     untimed iterations before them (default 5)\n"
               "  -c, --check <0|1>          check the results (default 1)\n"
               "  -d, --datatype <type>      float|float32 or bfloat16, or all (default float)\n"
               "  -h, --help                 this text\n",
               prog);
}

using braid_bench::parse_long;
using braid_bench::parse_size;

enum class ParseResult { kRun, kHelp, kError };

ParseResult parse_args(int argc, char** argv, Options* opt, std::string* error) {
  static const option kLongOptions[] = {{"collective", required_argument, nullptr, 'C'},
                                        {"threads", required_argument, nullptr, 't'},
                                        {"minbytes", required_argument, nullptr, 'b'},
                                        {"maxbytes", required_argument, nullptr, 'e'},
                                        {"stepfactor", required_argument, nullptr, 'f'},
                                        {"stepbytes", required_argument, nullptr, 'i'},
                                        {"iters", required_argument, nullptr, 'n'},
                                        {"warmup_iters", required_argument, nullptr, 'w'},
                                        {"check", required_argument, nullptr, 'c'},
                                        {"datatype", required_argument, nullptr, 'd'},
                                        {"help", no_argument, nullptr, 'h'},
                                        {nullptr, 0, nullptr, 0}};
  auto fail = [&](const std::string& flag, const std::string& why) {
    *error = flag + ": " + why;
    return ParseResult::kError;
  };
  opterr = 0;
  optind = 1;
  for (;;) {
    const int c = getopt_long(argc, argv, ":C:t:b:e:f:i:n:w:c:d:h", kLongOptions, nullptr);
    if (c == -1) break;
    // The flag as the user wrote it when getopt rejected it, else its short form.
    char short_flag[3] = {'-', static_cast<char>(c), '\0'};
    if ((c == '?' || c == ':') && optopt != 0 && (c == '?' || optind > argc)) {
      short_flag[1] = static_cast<char>(optopt);
    }
    const std::string flag =
        (c == '?' || c == ':') && short_flag[1] == static_cast<char>(c) ? argv[optind - 1] : short_flag;
    const char* arg = optarg;
    switch (c) {
      case 'C': {
        opt->coll = nullptr;
        for (const CollectiveInfo& ci : kCollectives) {
          if (std::strcmp(arg, ci.name) == 0) opt->coll = &ci;
        }
        if (opt->coll == nullptr) {
          return fail(flag, "unknown collective '" + std::string(arg) +
                                "' (all_reduce, broadcast, all_gather or reduce_scatter)");
        }
        break;
      }
      case 't':
        if (!parse_long(arg, 1, 4096, &opt->threads)) return fail(flag, "threads must be an integer >= 1");
        break;
      case 'd': {
        opt->types.clear();
        const bool all = std::strcmp(arg, "all") == 0;
        for (const TypeInfo& ti : kTypes) {
          if (all || std::strcmp(arg, ti.name) == 0 || (ti.alias && std::strcmp(arg, ti.alias) == 0)) {
            opt->types.push_back(&ti);
          }
        }
        if (opt->types.empty()) {
          return fail(flag, "unknown datatype '" + std::string(arg) + "' (float, float32, bfloat16 or all)");
        }
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
  return ParseResult::kRun;
}

// ---------------------------------------------------------------------------
// The threads

// Input element i of thread t: a small integer, so every sum is exact in
// float32 and rounds once (at the end) in bfloat16.
inline float input_value(int t, size_t i) {
  return static_cast<float>((i * 7 + static_cast<size_t>(t) * 3) % 11);
}

struct Job {
  const TypeInfo* type = nullptr;  // nullptr: the threads exit
  size_t count = 0;
};

struct Shared {
  explicit Shared(const Options& o) : opt(o), nthreads(static_cast<int>(o.threads)), barrier(nthreads) {}

  const Options& opt;
  const int nthreads;
  SpinBarrier barrier;
  size_t alloc = 0;
  std::vector<unsigned char*> in;   // per thread, allocated and first touched by its thread
  std::vector<unsigned char*> out;  // per thread
  std::vector<long long> wrong;     // per thread, for the last job
  // reduce_scatter: thread t's block of every input, set by thread t per job.
  std::vector<std::vector<unsigned char*>> blocks;
  std::atomic<bool> alloc_failed{false};
  Job job;             // written by thread 0 before the barrier that starts a job
  double time_us = 0;  // written by thread 0
};

double now_seconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Slice t of count elements: cache-line multiples, so no two threads write one line.
void slice(const Shared& sh, size_t count, size_t elem, int t, size_t* lo, size_t* hi) {
  const size_t line = 64 / elem;
  size_t chunk = (count + static_cast<size_t>(sh.nthreads) - 1) / static_cast<size_t>(sh.nthreads);
  chunk = (chunk + line - 1) / line * line;
  *lo = std::min(count, chunk * static_cast<size_t>(t));
  *hi = std::min(count, *lo + chunk);
}

// reduce_f32 or reduce_bf16: out[i] = sum of in[k][i] for i in [lo, hi).
void reduce(const Job& job, const std::vector<unsigned char*>& in, unsigned char* out, size_t lo, size_t hi) {
  if (lo >= hi) return;
  if (job.type->type == Type::kFloat32) {
    reduce_f32(in, out, lo, hi);
  } else {
    reduce_bf16(in, out, lo, hi);
  }
}

// One call of the collective, as thread t sees it; it ends with a barrier.
void run_call(Shared& sh, const Job& job, int t) {
  const size_t elem = job.type->size;
  const size_t block = job.count * elem;  // all_gather and reduce_scatter: one rank's block
  const int n = sh.nthreads;
  size_t lo = 0, hi = 0;
  switch (sh.opt.coll->coll) {
    case Collective::kAllReduce:
      slice(sh, job.count, elem, t, &lo, &hi);
      reduce(job, sh.in, sh.out[t], lo, hi);
      sh.barrier.wait();
      for (int d = 1; d < n; ++d) {  // start at t + 1, so threads read different owners
        const int j = (t + d) % n;
        slice(sh, job.count, elem, j, &lo, &hi);
        if (lo < hi) std::memcpy(sh.out[t] + lo * elem, sh.out[j] + lo * elem, (hi - lo) * elem);
      }
      break;
    case Collective::kReduceScatter:
      reduce(job, sh.blocks[t], sh.out[t], 0, job.count);
      break;
    case Collective::kAllGather:
      for (int d = 0; d < n; ++d) {  // own block first, then from t + 1 on
        const int j = (t + d) % n;
        if (block > 0) std::memcpy(sh.out[t] + static_cast<size_t>(j) * block, sh.in[j], block);
      }
      break;
    case Collective::kBroadcast:
      // Every thread copies its slice of the root's input to every other
      // output: the n - 1 copies are shared by all n cores, as a broadcast
      // between processes can share them (a root that writes into its
      // peers' buffers while they read).
      slice(sh, job.count, elem, t, &lo, &hi);
      for (int d = 1; d <= n; ++d) {  // start at t + 1, so threads write different outputs
        const int j = (t + d) % n;
        if (j == 0) continue;
        if (lo < hi) std::memcpy(sh.out[j] + lo * elem, sh.in[0] + lo * elem, (hi - lo) * elem);
      }
      break;
  }
  sh.barrier.wait();
}

// Elements of thread t's input for this job.
size_t input_count(const Shared& sh, const Job& job) {
  return sh.opt.coll->coll == Collective::kReduceScatter ? job.count * static_cast<size_t>(sh.nthreads)
                                                         : job.count;
}

// Elements of thread t's output for this job.
size_t output_count(const Shared& sh, const Job& job) {
  return sh.opt.coll->coll == Collective::kAllGather ? job.count * static_cast<size_t>(sh.nthreads)
                                                     : job.count;
}

void fill_input(const Shared& sh, const Job& job, unsigned char* buf, int t) {
  const size_t count = input_count(sh, job);
  if (job.type->type == Type::kFloat32) {
    float* p = reinterpret_cast<float*>(buf);
    for (size_t i = 0; i < count; ++i) p[i] = input_value(t, i);
  } else {
    uint16_t* p = reinterpret_cast<uint16_t*>(buf);
    for (size_t i = 0; i < count; ++i) p[i] = f32_to_bf16(input_value(t, i));
  }
}

// Element i of thread t's output, exactly (small integers).
float expected_value(const Shared& sh, const Job& job, int t, size_t i) {
  const int n = sh.nthreads;
  float sum = 0;
  switch (sh.opt.coll->coll) {
    case Collective::kAllReduce:
      for (int k = 0; k < n; ++k) sum += input_value(k, i);
      return sum;
    case Collective::kReduceScatter:
      for (int k = 0; k < n; ++k) sum += input_value(k, static_cast<size_t>(t) * job.count + i);
      return sum;
    case Collective::kAllGather:
      return input_value(static_cast<int>(i / job.count), i % job.count);
    case Collective::kBroadcast:
      return input_value(0, i);
  }
  return 0;
}

long long count_wrong(const Shared& sh, const Job& job, int t) {
  if (sh.opt.coll->coll == Collective::kBroadcast && t == 0) return 0;  // the root receives nothing
  const unsigned char* buf = sh.out[t];
  long long wrong = 0;
  const size_t count = output_count(sh, job);
  for (size_t i = 0; i < count; ++i) {
    const float expected = expected_value(sh, job, t, i);
    if (job.type->type == Type::kFloat32) {
      wrong += reinterpret_cast<const float*>(buf)[i] != expected;
    } else {
      wrong += reinterpret_cast<const uint16_t*>(buf)[i] != f32_to_bf16(expected);
    }
  }
  return wrong;
}

void run_job(Shared& sh, const Job& job, int t) {
  fill_input(sh, job, sh.in[t], t);
  sh.blocks[t].clear();
  if (sh.opt.coll->coll == Collective::kReduceScatter) {
    for (int k = 0; k < sh.nthreads; ++k)
      sh.blocks[t].push_back(sh.in[k] + static_cast<size_t>(t) * job.count * job.type->size);
  }
  sh.barrier.wait();  // every input is filled before anyone reads it
  for (long i = 0; i < sh.opt.warmup; ++i) run_call(sh, job, t);
  sh.barrier.wait();
  const double t0 = now_seconds();
  for (long i = 0; i < sh.opt.iters; ++i) run_call(sh, job, t);  // ends with a barrier
  if (t == 0) sh.time_us = (now_seconds() - t0) * 1e6 / static_cast<double>(sh.opt.iters);
  sh.wrong[t] = -1;
  if (!sh.opt.check) return;
  std::memset(sh.out[t], 0xff, output_count(sh, job) * job.type->size);  // nan in both types
  sh.barrier.wait();
  run_call(sh, job, t);
  sh.wrong[t] = count_wrong(sh, job, t);
}

void thread_main(Shared& sh, int t) {
  sh.in[t] = static_cast<unsigned char*>(std::aligned_alloc(4096, sh.alloc));
  sh.out[t] = static_cast<unsigned char*>(std::aligned_alloc(4096, sh.alloc));
  if (sh.in[t] == nullptr || sh.out[t] == nullptr) {
    sh.alloc_failed.store(true);
  } else {
    std::memset(sh.in[t], 0, sh.alloc);  // first touch by the owner: its pages, its NUMA node
    std::memset(sh.out[t], 0, sh.alloc);
  }
  sh.barrier.wait();
  if (sh.alloc_failed.load()) return;
  for (;;) {
    sh.barrier.wait();  // thread 0 has posted the next job
    const Job job = sh.job;
    if (job.type == nullptr) return;
    run_job(sh, job, t);
    sh.barrier.wait();  // results in sh before thread 0 reads them
  }
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

std::string format_time(double us) {
  char buf[32];
  std::snprintf(buf, sizeof buf, us >= 10000 ? "%7.0f" : us >= 100 ? "%7.1f" : "%7.2f", us);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  std::string error;
  const ParseResult parsed = parse_args(argc, argv, &opt, &error);
  if (parsed != ParseResult::kRun) {
    print_usage(parsed == ParseResult::kHelp ? stdout : stderr, "ceiling");
    if (parsed == ParseResult::kError) std::fprintf(stderr, "ceiling: error: %s\n", error.c_str());
    return parsed == ParseResult::kHelp ? 0 : 2;
  }

  Shared sh(opt);
  const size_t n = static_cast<size_t>(sh.nthreads);
  sh.alloc = std::max<size_t>(4096, (opt.max_bytes + 4095) / 4096 * 4096);
  sh.in.assign(n, nullptr);
  sh.out.assign(n, nullptr);
  sh.wrong.assign(n, 0);
  sh.blocks.assign(n, {});
  std::vector<std::thread> workers;
  for (int t = 1; t < sh.nthreads; ++t) workers.emplace_back(thread_main, std::ref(sh), t);

  // Thread 0 is this one: allocate like the others, then drive the size loop.
  sh.in[0] = static_cast<unsigned char*>(std::aligned_alloc(4096, sh.alloc));
  sh.out[0] = static_cast<unsigned char*>(std::aligned_alloc(4096, sh.alloc));
  if (sh.in[0] == nullptr || sh.out[0] == nullptr) {
    sh.alloc_failed.store(true);
  } else {
    std::memset(sh.in[0], 0, sh.alloc);
    std::memset(sh.out[0], 0, sh.alloc);
  }
  sh.barrier.wait();
  if (sh.alloc_failed.load()) {
    std::fprintf(stderr, "ceiling: cannot allocate 2 x %zu bytes per thread (-e)\n", sh.alloc);
    for (std::thread& w : workers) w.join();
    return 1;
  }

  const CollectiveInfo& coll = *opt.coll;
  std::printf("# ceiling: %s%s between %d threads of one process, no IPC\n", coll.name,
              coll.reduces ? " (sum)" : "", sh.nthreads);
  switch (coll.coll) {
    case Collective::kAllReduce:
      std::printf(
          "# each thread reduces its 1/%d slice of all %d inputs in one pass, then copies the other slices "
          "(memcpy); 2 spinning barriers per iteration\n",
          sh.nthreads, sh.nthreads);
      break;
    case Collective::kReduceScatter:
      std::printf(
          "# each thread reduces its block of all %d inputs in one pass; 1 spinning barrier per iteration\n",
          sh.nthreads);
      break;
    case Collective::kAllGather:
      std::printf(
          "# each thread copies all %d inputs (its own too) into its output (memcpy); 1 spinning barrier per "
          "iteration\n",
          sh.nthreads);
      break;
    case Collective::kBroadcast:
      std::printf(
          "# each thread copies its 1/%d slice of the root's (0's) input to every other output (memcpy), the "
          "root's own untouched (as in place); 1 spinning barrier per iteration\n",
          sh.nthreads);
      break;
  }
  if (opt.step_factor != 0) {
    std::printf("# minBytes %zu maxBytes %zu step: %zu(factor) warmup iters: %ld iters: %ld validation: %d\n",
                opt.min_bytes, opt.max_bytes, opt.step_factor, opt.warmup, opt.iters, opt.check ? 1 : 0);
  } else {
    std::printf("# minBytes %zu maxBytes %zu step: %zu(bytes) warmup iters: %ld iters: %ld validation: %d\n",
                opt.min_bytes, opt.max_bytes, opt.step_bytes, opt.warmup, opt.iters, opt.check ? 1 : 0);
  }
  std::printf("#  %u online CPUs\n#\n", std::thread::hardware_concurrency());
  print_line("#%62s%s", "", "out-of-place");
  print_line("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s", "size", "count", "type", "redop", "root",
             "time", "algbw", "busbw", "#wrong");
  print_line("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s", "(B)", "(elements)", "", "", "", "(us)",
             "(GB/s)", "(GB/s)", "");
  std::fflush(stdout);

  const double factor = coll.busbw_factor(static_cast<double>(n));
  double busbw_sum = 0;
  long busbw_n = 0;
  long long total_wrong = 0;
  for (const TypeInfo* type : opt.types) {
    for (size_t bytes = opt.min_bytes; bytes <= opt.max_bytes;) {
      sh.job = Job{type, bytes / type->size / (coll.per_rank_count ? n : 1)};
      sh.barrier.wait();  // start the job
      run_job(sh, sh.job, 0);
      sh.barrier.wait();  // every thread's results are in
      const size_t size = sh.job.count * type->size * (coll.per_rank_count ? n : 1);
      const double algbw = sh.time_us > 0 ? static_cast<double>(size) / sh.time_us / 1e3 : 0;
      const double busbw = algbw * factor;
      busbw_sum += busbw;
      ++busbw_n;
      long long wrong = 0;
      for (long long w : sh.wrong) wrong += w;
      if (opt.check) total_wrong += wrong;
      const std::string wrong_text = opt.check ? std::to_string(wrong) : "N/A";
      std::printf("%12zu  %12zu  %8s  %6s  %6d  %s  %6.2f  %6.2f %6s\n", size, sh.job.count, type->name,
                  coll.reduces ? "sum" : "none", coll.coll == Collective::kBroadcast ? 0 : -1,
                  format_time(sh.time_us).c_str(), algbw, busbw, wrong_text.c_str());
      std::fflush(stdout);
      const size_t next =
          opt.step_factor != 0 ? (bytes == 0 ? 1 : bytes * opt.step_factor) : bytes + opt.step_bytes;
      if (next <= bytes || (opt.step_factor != 0 && bytes != 0 && next / opt.step_factor != bytes)) break;
      bytes = next;
    }
  }
  sh.job = Job{};
  sh.barrier.wait();  // the threads exit
  for (std::thread& w : workers) w.join();

  if (opt.check) {
    std::printf("# Wrong values         : %lld %s\n", total_wrong, total_wrong ? "FAILED" : "OK");
  } else {
    std::printf("# Wrong values         : N/A (-c 0)\n");
  }
  std::printf("# Avg bus bandwidth    : %.3f\n#\n", busbw_n ? busbw_sum / static_cast<double>(busbw_n) : 0.0);
  for (size_t t = 0; t < n; ++t) {
    std::free(sh.in[t]);
    std::free(sh.out[t]);
  }
  return total_wrong > 0 ? 1 : 0;
}
