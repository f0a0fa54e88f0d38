// Shared driver of the braid-tests binaries (all_reduce_perf, broadcast_perf, ...).
//
// The binaries follow the format and conventions of NVIDIA's nccl-tests, so that
// their output can be read (and parsed) the same way. Each <name>_perf.cc fills in
// one CollDesc and calls perf_main(); everything else lives in perf_common.cc:
// MPI start-up, the braid communicator (unique id broadcast with MPI_Bcast from
// rank 0), flags, the size loop, buffers, data, checking, timing and the table.
// MPI is the launcher and the bootstrap channel: every byte of braid's columns
// moves through braid. With `--compare mpi` each size is also run through MPI's
// own collective (CollDesc::mpi), out of place on the same buffers, timed the
// same way, and printed in extra columns beside braid's out-of-place ones.
//
// Sizes and counts (nccl-tests conventions). For each step of the size loop,
// `bytes` is the requested size and count = bytes / sizeof(type):
// - all_reduce, broadcast, reduce, sendrecv: the braid count is `count`; the
//   size column is count * sizeof(type).
// - all_gather, reduce_scatter, gather, scatter, alltoall: the braid count is the
//   per-rank count, count / nranks (all_gather/gather: elements each rank sends;
//   reduce_scatter/scatter: elements each rank receives; alltoall: elements sent
//   to each peer). The count column shows that per-rank count; the size column
//   shows the larger buffer, per-rank count * nranks * sizeof(type) (the recv
//   buffer of all_gather/gather, the send buffer of reduce_scatter/scatter, either
//   buffer of alltoall).
// - The size column is always the largest buffer a rank passes, and
//   algbw = size / time for every collective, as in nccl-tests.
// - busbw = algbw * busbw_factor(nranks): 2(n-1)/n for all_reduce; (n-1)/n for
//   all_gather, reduce_scatter, alltoall, gather and scatter; 1 for broadcast,
//   reduce and sendrecv.
//
// In-place layouts (NCCL's): one buffer holds max(send, recv) elements; when the
// two sides differ in size, the smaller one is block `rank` of the larger one
// (all_gather/gather: sendbuf = recvbuf + rank * count; reduce_scatter/scatter:
// recvbuf = sendbuf + rank * count); otherwise sendbuf == recvbuf.
#ifndef BRAID_BENCH_PERF_COMMON_H_
#define BRAID_BENCH_PERF_COMMON_H_

#include <braid/braid.h>

#include "mpi_comm.h"  // <mpi.h>, C API only

#include <cstddef>
#include <cstdint>
#include <vector>

namespace braid_perf {

// One element's value: `bits` (two's complement at the type's width, higher
// bits ignored) for integer types, `real` for floating ones.
struct Value {
  double real = 0;
  uint64_t bits = 0;
};

// The data every rank sends and the results the collective must produce, for one
// (dtype, op, root, count) run on one rank. Floating inputs are chosen so that
// every result is exact in its dtype (float16 and bfloat16 included), so results
// are compared exactly; only avg allows a rounding tolerance. Integer inputs are
// full-width bit patterns, their results computed with the type's wraparound.
// Each value depends on the source rank and on a hash of the element index, so
// data from the wrong rank or at the wrong offset shows up.
class Reference {
 public:
  // `reduces` false: a data-movement collective (op is ignored).
  Reference(braid_dtype_t dtype, bool reduces, braid_redop_t op, int nranks, int rank, int root,
            size_t count);

  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  int root() const { return root_; }
  size_t count() const { return count_; }  // the count passed to braid (per rank where that applies)

  // Element `index` of rank `src`'s send buffer.
  Value input(int src, size_t index) const { return value(src, slot(index)); }
  // Element `index` of the reduction, over all ranks, of their send buffers.
  Value reduced(size_t index) const { return reduced_[slot(index)]; }
  // Largest accepted |result - expected|: 0 except for avg.
  double tolerance() const { return tolerance_; }

  // input(src, index) == value(src, slot(index)) with slot(index) < slots(): a
  // rank's whole send buffer takes only slots() distinct values.
  unsigned slots() const { return modulus_; }
  unsigned slot(size_t index) const {
    uint64_t z = (static_cast<uint64_t>(index) + 1) * 0x9E3779B97F4A7C15ull;
    z ^= z >> 29;
    z *= 0xBF58476D1CE4E5B9ull;
    z ^= z >> 32;
    return static_cast<unsigned>(((z & 0xffffffffull) * modulus_) >> 32);
  }
  Value value(int src, unsigned slot) const;

 private:
  enum class Kind { kSpread, kSum, kProd };

  // t in [0, slots()): which of the slots' values rank `src` holds there.
  uint64_t ordinal(int src, unsigned slot) const;
  // The small value (t, t - 50, or the sum's or product's term) a float
  // input holds; integers hold bit patterns hashed from t.
  double small_value(int src, unsigned slot) const;

  Kind kind_;
  bool signed_;
  bool integer_;
  bool wide_float_;  // float64: values also need bits float32 lacks
  unsigned width_;   // bits, for integer types
  uint64_t mask_;    // the low width_ bits
  unsigned modulus_;
  uint64_t sum_cap_;  // kSum: ranks at or above this contribute 0 (keeps sums exact)
  int nranks_, rank_, root_;
  size_t count_;
  double tolerance_ = 0;
  std::vector<Value> reduced_;  // indexed by slot
};

// The elements a buffer holds, in units of the braid count.
enum class Span { kCount, kCountTimesRanks };

struct RunArgs {
  const void* sendbuf;
  void* recvbuf;
  size_t count;  // the braid count (see the conventions above)
  braid_dtype_t dtype;
  braid_redop_t op;  // meaningful when the collective reduces
  int root;          // meaningful when the collective is rooted
  int rank;
  int nranks;
  braid_comm_t comm;
};

// The same iteration, through MPI (`--compare mpi`): out of place, the same
// buffers, count, dtype, op and root as RunArgs, translated to MPI's types.
struct MpiArgs {
  const void* sendbuf;
  void* recvbuf;
  int count;  // the braid count, which MPI's per-rank count equals
  MPI_Datatype dtype;
  MPI_Op op;  // meaningful when the collective reduces
  int root;   // meaningful when the collective is rooted
  int rank;
  int nranks;
  MPI_Comm comm;  // a duplicate of MPI_COMM_WORLD
};

// One collective, as one binary measures it.
struct CollDesc {
  const char* name;          // the binary is <name>_perf
  const char* call;          // the braid call(s), for error messages
  bool reduces;              // takes -o; otherwise the redop column says "none"
  bool rooted;               // takes -r; otherwise the root column says -1
  bool result_on_root_only;  // only the root's recvbuf receives a result (reduce, gather)
  bool in_place;             // false: the in-place columns say N/A
  Span send_span;            // size of sendbuf
  Span recv_span;            // size of recvbuf
  double (*busbw_factor)(int nranks);
  // One blocking iteration through the braid C API.
  braid_result_t (*run)(const RunArgs& args);
  // The same iteration through MPI, for `--compare mpi`; returns MPI's error
  // code. Its results are not checked. Not called where MPI has no equivalent
  // type or op (float16, bfloat16, avg): those columns say N/A.
  int (*mpi)(const MpiArgs& args);
  // Expected element `index` of this rank's recv buffer (of the recv region in
  // place). Not called on non-roots when result_on_root_only.
  Value (*expected)(const Reference& ref, size_t index);
  // MPI's call has one buffer (MPI_Bcast), like braid's in-place call: the
  // ratio compares braid in place, since out of place braid also copies the
  // root's input to its output, bytes MPI never moves.
  bool mpi_in_place = false;
};

// Runs the benchmark and returns the process exit code: 0 when every check
// passed, 1 on wrong results, 2 on a usage error.
int perf_main(int argc, char** argv, const CollDesc& desc);

}  // namespace braid_perf

#endif  // BRAID_BENCH_PERF_COMMON_H_
