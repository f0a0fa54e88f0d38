// Google Benchmark microbenchmarks of the host reduction kernels: GB/s for
// every dtype x op at three buffer sizes (in L1/L2, in the last-level cache,
// in memory), beside memcpy of the same size. Bytes count what moves: a
// reduction reads two buffers and writes one (3 x size), memcpy reads one and
// writes one (2 x size), so "% of memcpy" compares like with like.
//
// Each kernel's output is checked once before it is timed; a wrong value
// fails the run (exit status 1), which is what ctest's kernel_bench_check
// relies on. After the usual Google Benchmark output, a table gives GB/s and
// the ratio to memcpy per dtype x op.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <new>
#include <string>
#include <vector>

#include "kernels/cpu/copy_kernels.h"
#include "kernels/cpu/reduce_kernels.h"

namespace {

using braid::kernels::reduce;

const size_t kSizes[] = {size_t{32} << 10, size_t{1} << 20, size_t{32} << 20};

std::string size_text(size_t bytes) {
  if (bytes >= (size_t{1} << 20)) return std::to_string(bytes >> 20) + "MiB";
  return std::to_string(bytes >> 10) + "KiB";
}

// One element of `dtype` holding the small integer v (exact in every type).
void store(braid_dtype_t dtype, void* p, int v) {
  switch (dtype) {
    case BRAID_INT8:
    case BRAID_UINT8: {
      const auto x = static_cast<uint8_t>(v);
      std::memcpy(p, &x, 1);
      return;
    }
    case BRAID_INT32:
    case BRAID_UINT32: {
      const auto x = static_cast<uint32_t>(v);
      std::memcpy(p, &x, 4);
      return;
    }
    case BRAID_INT64:
    case BRAID_UINT64: {
      const auto x = static_cast<uint64_t>(v);
      std::memcpy(p, &x, 8);
      return;
    }
    case BRAID_FLOAT16: {
      const uint16_t x = braid::kernels::float_to_half(static_cast<float>(v));
      std::memcpy(p, &x, 2);
      return;
    }
    case BRAID_BFLOAT16: {
      const uint16_t x = braid::kernels::float_to_bfloat16(static_cast<float>(v));
      std::memcpy(p, &x, 2);
      return;
    }
    case BRAID_FLOAT32: {
      const auto x = static_cast<float>(v);
      std::memcpy(p, &x, 4);
      return;
    }
    case BRAID_FLOAT64: {
      const auto x = static_cast<double>(v);
      std::memcpy(p, &x, 8);
      return;
    }
    default:
      return;
  }
}

// a = 6, b = 3 everywhere: every op has a distinct, exact answer.
int expected(braid_redop_t op) {
  switch (op) {
    case BRAID_SUM:
    case BRAID_AVG:
      return 9;
    case BRAID_PROD:
      return 18;
    case BRAID_MIN:
      return 3;
    case BRAID_MAX:
      return 6;
    case BRAID_BAND:
      return 6 & 3;
    case BRAID_BOR:
      return 6 | 3;
    case BRAID_BXOR:
      return 6 ^ 3;
    default:
      return -1;
  }
}

// Buffers start on a cache line, as torch's CPU tensors and braid's slots
// do: from malloc (16 bytes past a page for large blocks) every 64-byte
// access straddles two lines, which cost the 512-bit bfloat16 loop a third
// of its speed at 32 MiB and memcpy nothing.
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new (n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete (p, std::align_val_t{64}); }
  bool operator==(const CacheLineAllocator&) const { return true; }
};
using Bytes = std::vector<char, CacheLineAllocator<char>>;

// Buffers outlive a case: Google Benchmark calls a case's function several
// times (growing the iteration count), and page-faulting 100 MiB each time
// would cost more than the timing.
struct Buffers {
  Bytes a, b, dst, want;
  std::string filled_for;  // the reduce case a and b hold inputs for ("" after memcpy used them)
};
Buffers& buffers_for(size_t bytes) {
  static std::map<size_t, Buffers> all;
  Buffers& buf = all[bytes];
  if (buf.a.size() != bytes) buf.a.assign(bytes, 0), buf.b.assign(bytes, 0), buf.dst.assign(bytes, 0);
  return buf;
}

// Every element = v: one stored, then copied in doubling runs.
void fill(braid_dtype_t dtype, Bytes& buf, int v) {
  const size_t es = braid_dtype_size(dtype);
  if (buf.size() < es) return;
  store(dtype, buf.data(), v);
  for (size_t done = es; done < buf.size(); done *= 2)
    std::memcpy(buf.data() + done, buf.data(), std::min(done, buf.size() - done));
}

void BM_reduce(benchmark::State& state, braid_dtype_t dtype, braid_redop_t op, size_t bytes) {
  Buffers& buf = buffers_for(bytes);
  const size_t count = bytes / braid_dtype_size(dtype);
  // Filled and checked at the first call for this case only.
  const std::string key = std::string(braid_dtype_name(dtype)) + "/" + braid_redop_name(op);
  if (buf.filled_for != key) {
    fill(dtype, buf.a, 6);
    fill(dtype, buf.b, 3);
    reduce(dtype, op, buf.dst.data(), buf.a.data(), buf.b.data(), count);
    buf.want.assign(bytes, 0);
    fill(dtype, buf.want, expected(op));
    if (std::memcmp(buf.want.data(), buf.dst.data(), bytes) != 0) {
      state.SkipWithError("wrong result: the kernel's output differs from the expected value");
      return;
    }
    buf.filled_for = key;
  }
  for (auto _ : state) {
    reduce(dtype, op, buf.dst.data(), buf.a.data(), buf.b.data(), count);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(3 * bytes));
}

void BM_memcpy(benchmark::State& state, size_t bytes) {
  Buffers& buf = buffers_for(bytes);
  std::memset(buf.a.data(), 1, bytes);
  buf.filled_for.clear();
  for (auto _ : state) {
    std::memcpy(buf.dst.data(), buf.a.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(2 * bytes));
}

// The shm slot copy (kernels::copy_streaming): its stores go to memory, so
// within one core it runs below memcpy in cache; it pays off only where
// another core reads the destination next (docs/design.md).
void BM_streaming(benchmark::State& state, size_t bytes) {
  Buffers& buf = buffers_for(bytes);
  std::memset(buf.a.data(), 1, bytes);
  buf.filled_for.clear();
  braid::kernels::copy_streaming(buf.dst.data(), buf.a.data(), bytes);
  if (std::memcmp(buf.dst.data(), buf.a.data(), bytes) != 0) {
    state.SkipWithError("copy_streaming: the copy differs from its source");
    return;
  }
  for (auto _ : state) {
    braid::kernels::copy_streaming(buf.dst.data(), buf.a.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(2 * bytes));
}

// The console output as usual, plus what the summary table needs.
class TableReporter : public benchmark::ConsoleReporter {
 public:
  bool failed = false;
  std::map<std::string, double> gbps;  // "float32/sum/1MiB" or "memcpy/1MiB" -> GB/s

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.error_occurred) {
        failed = true;
        continue;
      }
      if (run.run_type != Run::RT_Iteration) continue;
      auto it = run.counters.find("bytes_per_second");
      if (it == run.counters.end()) continue;
      // "reduce/float32/sum/1MiB" -> "float32/sum/1MiB"
      std::string name = run.benchmark_name();
      if (name.rfind("reduce/", 0) == 0) name = name.substr(7);
      gbps[name] = it->second.value / 1e9;
    }
  }
};

void print_table(const TableReporter& rep) {
  std::printf(
      "\n# braid host reduction kernels (%s): GB/s counting bytes read and written, and %% of memcpy\n",
      braid::kernels::active_isa());
  std::printf("%-10s %-5s", "dtype", "op");
  for (size_t s : kSizes) std::printf(" %14s", size_text(s).c_str());
  std::printf("\n%-10s %-5s", "memcpy", "-");
  for (size_t s : kSizes) {
    auto it = rep.gbps.find("memcpy/" + size_text(s));
    if (it == rep.gbps.end())
      std::printf(" %14s", "-");
    else
      std::printf(" %8.1f      ", it->second);
  }
  std::printf("\n%-10s %-5s", "streaming", "-");
  for (size_t s : kSizes) {
    auto it = rep.gbps.find("streaming/" + size_text(s));
    auto base = rep.gbps.find("memcpy/" + size_text(s));
    if (it == rep.gbps.end())
      std::printf(" %14s", "-");
    else if (base == rep.gbps.end())
      std::printf(" %6.1f (    -)", it->second);
    else
      std::printf(" %6.1f (%4.0f%%)", it->second, 100.0 * it->second / base->second);
  }
  std::printf("\n");
  for (int d = 0; d < BRAID_NUM_DTYPES; ++d) {
    const auto dtype = static_cast<braid_dtype_t>(d);
    for (int o = 0; o < BRAID_NUM_OPS; ++o) {
      const auto op = static_cast<braid_redop_t>(o);
      if (op == BRAID_AVG || !braid::kernels::redop_supported(dtype, op)) continue;
      const std::string key = std::string(braid_dtype_name(dtype)) + "/" + braid_redop_name(op) + "/";
      bool any = false;
      std::string line;
      char cell[64];
      for (size_t s : kSizes) {
        auto it = rep.gbps.find(key + size_text(s));
        auto base = rep.gbps.find("memcpy/" + size_text(s));
        if (it == rep.gbps.end()) {
          std::snprintf(cell, sizeof(cell), " %14s", "-");
        } else {
          any = true;
          if (base == rep.gbps.end())  // memcpy filtered out: no ratio to give
            std::snprintf(cell, sizeof(cell), " %6.1f (    -)", it->second);
          else
            std::snprintf(cell, sizeof(cell), " %6.1f (%4.0f%%)", it->second,
                          100.0 * it->second / base->second);
        }
        line += cell;
      }
      if (any) std::printf("%-10s %-5s%s\n", braid_dtype_name(dtype), braid_redop_name(op), line.c_str());
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  for (size_t s : kSizes) benchmark::RegisterBenchmark(("memcpy/" + size_text(s)).c_str(), BM_memcpy, s);
  for (size_t s : kSizes)
    benchmark::RegisterBenchmark(("streaming/" + size_text(s)).c_str(), BM_streaming, s);
  for (int d = 0; d < BRAID_NUM_DTYPES; ++d) {
    const auto dtype = static_cast<braid_dtype_t>(d);
    for (int o = 0; o < BRAID_NUM_OPS; ++o) {
      const auto op = static_cast<braid_redop_t>(o);
      // AVG reduces as SUM (the collective divides once at the end).
      if (op == BRAID_AVG || !braid::kernels::redop_supported(dtype, op)) continue;
      for (size_t s : kSizes) {
        const std::string name = std::string("reduce/") + braid_dtype_name(dtype) + "/" +
                                 braid_redop_name(op) + "/" + size_text(s);
        benchmark::RegisterBenchmark(name.c_str(), BM_reduce, dtype, op, s);
      }
    }
  }
  // A tenth of a second per case unless asked otherwise: 180 cases.
  std::vector<char*> args(argv, argv + argc);
  bool has_min_time = false;
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--benchmark_min_time", 20) == 0) has_min_time = true;
  static char min_time[] = "--benchmark_min_time=0.1";
  if (!has_min_time) args.push_back(min_time);
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 2;
  benchmark::AddCustomContext("braid_kernel_isa", braid::kernels::active_isa());
  TableReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  print_table(reporter);
  benchmark::Shutdown();
  if (reporter.failed) {
    std::fprintf(stderr, "kernel_bench: a kernel gave a wrong result (see the ERROR lines above)\n");
    return 1;
  }
  return 0;
}
