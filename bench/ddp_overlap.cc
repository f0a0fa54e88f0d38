// ddp_overlap: what overlapping gradient all_reduce with the backward pass
// buys, through braid's DDP layer.
//
// A synthetic model of L layers, each with P float32 parameters. One backward
// step produces the layers' gradients last layer first; each layer writes its
// gradient and then takes the rest of its compute time.
//   sequential: the whole backward, then every bucket is marked ready at once
//               and all-reduced ("backward, then all_reduce everything").
//   overlap:    each layer's gradient is marked ready as soon as it is written,
//               so full buckets are all-reduced while later layers compute.
// Both use the same Reducer and buckets; only the timing of mark_ready differs.
// --compute-us auto (default) gives each layer 1/L of the time one all_reduce of
// every gradient takes, measured first: a backward as long as its
// communication, the balance DDP's overlap is designed for (where one side
// dominates, overlap can hide at most the other side).
// The step time is the slowest rank's, the median of --iters steps.
//
// --compute sleep (default): a layer's compute time passes with its CPU core
//   free, as when an accelerator runs the backward and the host only launches
//   it; the gradient lands in host memory without the CPU (one element per
//   page is written, to vary and check every page). On this 2-core machine
//   with 4 ranks no core is ever idle otherwise, so this is the only way to
//   show overlap at all.
// --compute spin: the core is busy for the whole compute time and writes every
//   gradient element (a CPU backward). Overlap then only helps where a core is
//   left over for communication.
//
//   mpirun -np 4 build/bench/ddp_overlap [--layers 24] [--layer-params 1M]
//          [--compute-us auto|N] [--compute sleep|spin] [--iters 10] [--buckets 1M,4M,25M,...]
//          [--grad-copies]   (gradients in their own arrays instead of views into the buckets)
//          [--plain-buckets] (Options::register_buckets = false: buckets in plain memory, all-reduced
//                             through the transport instead of between the ranks' buckets)
// The last line reads `overlap/sequential = X.XX` for the default bucket size (25 MiB).
#include <braid/braid.h>
#include <braid/ddp.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench/flags.h"
#include "bench/mpi_comm.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kPageFloats = 4096 / sizeof(float);

struct Config {
  long layers = 24;
  size_t layer_params = size_t{1} << 20;
  long compute_us = -1;  // -1: auto, the backward as long as the all_reduce of every gradient
  bool spin = false;
  bool grad_copies = false;    // gradients outside the buckets, copied in and out
  bool plain_buckets = false;  // Options::register_buckets = false
  long iters = 10;
  std::vector<size_t> buckets = {size_t{1} << 20, size_t{4} << 20, size_t{25} << 20, size_t{64} << 20,
                                 size_t{256} << 20};
};

bool parse_bucket_list(const char* s, std::vector<size_t>* out) {
  out->clear();
  for (const std::string& entry : braid_bench::split_list(s)) {
    size_t v = 0;
    if (!braid_bench::parse_size(entry.c_str(), &v) || v == 0) return false;
    out->push_back(v);
  }
  return !out->empty();
}

bool parse(int argc, char** argv, Config* c, std::string* error) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    bool ok = v != nullptr;
    if (a == "--layers") {
      ok = ok && braid_bench::parse_long(v, 1, 4096, &c->layers);
    } else if (a == "--layer-params") {
      ok = ok && braid_bench::parse_size(v, &c->layer_params) && c->layer_params > 0;
    } else if (a == "--compute-us") {
      ok = ok && (std::strcmp(v, "auto") == 0 || braid_bench::parse_long(v, 0, 10'000'000, &c->compute_us));
      if (ok && std::strcmp(v, "auto") == 0) c->compute_us = -1;
    } else if (a == "--compute") {
      ok = ok && (std::strcmp(v, "sleep") == 0 || std::strcmp(v, "spin") == 0);
      if (ok) c->spin = std::strcmp(v, "spin") == 0;
    } else if (a == "--grad-copies") {
      c->grad_copies = true;
      continue;
    } else if (a == "--plain-buckets") {
      c->plain_buckets = true;
      continue;
    } else if (a == "--iters") {
      ok = ok && braid_bench::parse_long(v, 1, 100000, &c->iters);
    } else if (a == "--buckets") {
      ok = ok && parse_bucket_list(v, &c->buckets);
    } else {
      *error = "unknown argument '" + a + "'";
      return false;
    }
    if (!ok) {
      *error = "bad or missing value for " + a + (v != nullptr ? std::string(" ('") + v + "')" : "");
      return false;
    }
    ++i;
  }
  return true;
}

// Spends the rest of a layer's compute time, with the core free or busy.
void compute_until(Clock::time_point end, bool spin) {
  if (!spin) {
    std::this_thread::sleep_until(end);
    return;
  }
  volatile unsigned sink = 0;
  while (Clock::now() < end) {
    for (int k = 0; k < 256; ++k) sink = sink + static_cast<unsigned>(k);
  }
}

struct Runner {
  const Config& cfg;
  braid_comm_t comm;
  int rank, nranks;
  std::vector<std::vector<float>> params, grads;

  // The backward's output. On the CPU (spin) every element is written. Under
  // an accelerator (sleep) the data arrives without the host CPU: one element
  // per page is written, enough to make every page's content depend on the
  // step and to check every page after the all_reduce.
  void write_gradient(float* g, float value) const {
    if (cfg.spin) {
      std::fill(g, g + cfg.layer_params, value);
      return;
    }
    for (size_t e = 0; e < cfg.layer_params; e += kPageFloats) g[e] = value;
    g[cfg.layer_params - 1] = value;
  }

  // One step; returns its time in seconds. Checks the averaged gradients.
  double step(braid::ddp::Reducer* ddp, bool overlap, int salt, bool* correct) {
    const auto t0 = Clock::now();
    for (long l = cfg.layers - 1; l >= 0; --l) {
      const auto end = Clock::now() + std::chrono::microseconds(cfg.compute_us);
      write_gradient(static_cast<float*>(ddp->grad(static_cast<size_t>(l))),
                     static_cast<float>(rank + salt + l % 3));
      compute_until(end, cfg.spin);
      if (overlap) *correct &= ddp->mark_ready(static_cast<size_t>(l)).ok();
    }
    if (!overlap) {
      for (long l = cfg.layers - 1; l >= 0; --l) *correct &= ddp->mark_ready(static_cast<size_t>(l)).ok();
    }
    *correct &= ddp->finish().ok();
    const double t = std::chrono::duration<double>(Clock::now() - t0).count();
    // Average over ranks of rank + salt + l % 3: exact in float32 for these values.
    for (long l = 0; l < cfg.layers; ++l) {
      const float want = static_cast<float>((nranks - 1) / 2.0 + salt + l % 3);
      const float* g = static_cast<const float*>(ddp->grad(static_cast<size_t>(l)));
      for (size_t e = 0; e < cfg.layer_params; e += kPageFloats) *correct &= g[e] == want;
      *correct &= g[cfg.layer_params - 1] == want;
    }
    return t;
  }

  // Median over iterations of the slowest rank's step time.
  double median_step(braid::ddp::Reducer* ddp, bool overlap, bool* correct) {
    std::vector<double> times;
    for (long it = -2; it < cfg.iters; ++it) {  // two warm-up steps
      double t = step(ddp, overlap, static_cast<int>(it & 7), correct);
      MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (it >= 0) times.push_back(t);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  }
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, nranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  Config cfg;
  std::string error;
  if (!parse(argc, argv, &cfg, &error)) {
    if (rank == 0) std::fprintf(stderr, "ddp_overlap: %s\n", error.c_str());
    MPI_Finalize();
    return 2;
  }
  if (std::getenv("BRAID_SOCKET_IFNAME") == nullptr) setenv("BRAID_SOCKET_IFNAME", "lo", 0);
  braid_comm_t comm = nullptr;
  if (braid_bench::braid_comm_from_mpi(MPI_COMM_WORLD, &comm) != BRAID_SUCCESS) {
    std::fprintf(stderr, "ddp_overlap: rank %d: making the communicator: %s\n", rank, braid_get_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

  Runner run{cfg, comm, rank, nranks, {}, {}};
  double allreduce_ms = 0;
  std::vector<braid::ddp::Parameter> params;
  for (long l = 0; l < cfg.layers; ++l) {
    run.params.emplace_back(cfg.layer_params, 0.0f);
    run.grads.emplace_back(cfg.layer_params, 0.0f);
  }
  for (long l = 0; l < cfg.layers; ++l) {
    params.push_back({"layer" + std::to_string(l), run.params[l].data(),
                      cfg.grad_copies ? run.grads[l].data() : nullptr, cfg.layer_params, BRAID_FLOAT32});
  }
  {
    // One all_reduce of every gradient (median of 3, slowest rank): the communication a step needs.
    std::vector<float> all(cfg.layers * cfg.layer_params, 1.0f);
    std::vector<double> times;
    for (int it = 0; it < 4; ++it) {
      const auto t0 = Clock::now();
      if (braid_all_reduce(all.data(), all.data(), all.size(), BRAID_FLOAT32, BRAID_SUM, comm, nullptr) !=
          BRAID_SUCCESS) {
        std::fprintf(stderr, "ddp_overlap: rank %d: all_reduce: %s\n", rank, braid_get_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      double t = std::chrono::duration<double>(Clock::now() - t0).count();
      MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (it > 0) times.push_back(t);
    }
    std::sort(times.begin(), times.end());
    allreduce_ms = times[1] * 1e3;
    if (cfg.compute_us < 0) cfg.compute_us = static_cast<long>(allreduce_ms * 1e3 / cfg.layers);
  }
  const double grad_mib = static_cast<double>(cfg.layers * cfg.layer_params * sizeof(float)) / (1 << 20);
  if (rank == 0) {
    std::printf("# ddp_overlap: %d ranks, %ld layers x %zu float32 parameters (%.0f MiB of gradients)\n",
                nranks, cfg.layers, cfg.layer_params, grad_mib);
    std::printf("# gradients %s\n", cfg.grad_copies ? "in their own arrays, copied into the buckets and back"
                                                    : "written straight into the buckets (no copies)");
    std::printf("# one all_reduce of every gradient: %.1f ms\n", allreduce_ms);
    std::printf("# compute %ld us per layer, %s; step = median of %ld, slowest rank\n", cfg.compute_us,
                cfg.spin ? "spin (CPU busy)" : "sleep (CPU free, as under an accelerator)", cfg.iters);
    std::printf("# %10s %8s %10s %14s %12s %18s %8s\n", "bucket", "buckets", "windows", "sequential_ms",
                "overlap_ms", "overlap/sequential", "correct");
  }
  const size_t default_bucket = braid::ddp::Options{}.bucket_bytes;
  double default_ratio = -1;
  bool all_correct = true;
  for (size_t bucket : cfg.buckets) {
    braid::ddp::Options opt;
    opt.bucket_bytes = bucket;
    opt.register_buckets = !cfg.plain_buckets;
    std::unique_ptr<braid::ddp::Reducer> ddp;
    if (auto r = braid::ddp::Reducer::create(comm, params, {}, opt, &ddp); !r) {
      std::fprintf(stderr, "ddp_overlap: rank %d: %s\n", rank, r.message.c_str());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    bool correct = true;
    uint64_t window_before = 0, window_after = 0;
    braid_comm_transport_bytes(ddp->bucket_comm(), "shm_window", &window_before);
    const double seq = run.median_step(ddp.get(), false, &correct);
    const double ovl = run.median_step(ddp.get(), true, &correct);
    braid_comm_transport_bytes(ddp->bucket_comm(), "shm_window", &window_after);
    int ok = correct;
    MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
    all_correct &= ok != 0;
    if (bucket == default_bucket) default_ratio = ovl / seq;
    if (rank == 0) {
      std::printf("  %8.0fMiB %8zu %10s %14.1f %12.1f %18.2f %8s\n", static_cast<double>(bucket) / (1 << 20),
                  ddp->buckets().size(), window_after > window_before ? "yes" : "no", seq * 1e3, ovl * 1e3,
                  ovl / seq, ok ? "yes" : "NO");
    }
  }
  // For reference: the backward alone, without communication.
  double t_compute = 0;
  for (long it = 0; it < 3; ++it) {
    const auto t0 = Clock::now();
    for (long l = 0; l < cfg.layers; ++l) {
      const auto end = Clock::now() + std::chrono::microseconds(cfg.compute_us);
      run.write_gradient(run.grads[l].data(), 1.0f);
      compute_until(end, cfg.spin);
    }
    t_compute = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  MPI_Allreduce(MPI_IN_PLACE, &t_compute, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0) std::printf("# backward alone: %.1f ms\n", t_compute * 1e3);
  if (rank == 0) {
    if (default_ratio >= 0) {
      std::printf("overlap/sequential = %.2f\n", default_ratio);
    } else {
      std::printf("# the default bucket size (%zu MiB) was not in --buckets\n", default_bucket >> 20);
    }
  }
  braid_comm_destroy(comm);
  MPI_Finalize();
  return all_correct ? 0 : 1;
}
