// braid-check: the collective correctness matrix.
//
// run_check_matrix() is called on every rank of an existing communicator with
// identical options. It runs every selected collective x dtype x reduction x
// root x count x {out-of-place, in-place} x {blocking, i-form} and compares
// every output element against a reference that each rank computes locally:
// inputs are a deterministic function of (seed, rank, index), so no reference
// data is ever communicated.
//
// Inputs are chosen so that results are exact in every dtype and every
// reduction order (integers wrap the same way the reference does; float sums
// stay below 2^11 in float16, 2^8 in bfloat16, ...), and compared bit for bit.
// Float sum/avg additionally run on random data, compared with a tolerance of
// about n * eps of the dtype. Bytes around and outside the output (guard
// regions, the const send buffer, unused slots of in-place layouts, the
// buffers of ranks that receive nothing) must be left untouched.
//
// After each (collective, dtype, count) group the ranks all-reduce their
// counts, so every rank ends with the same job-wide totals.
#pragma once

#include <braid/braid.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace braid::check {

enum class Collective {
  kAllReduce,
  kBroadcast,
  kReduce,
  kAllGather,
  kReduceScatter,
  kGather,
  kScatter,
  kAllToAll,
  kBarrier,
  kSendRecv,    // ring exchange inside braid_group_start/end (send/recv, or isend/irecv + wait)
  kIsendIrecv,  // two ordered messages each way, without a group (isend/irecv, or blocking send/recv)
  kNumCollectives
};

const char* collective_name(Collective c);
// Accepts the names printed by collective_name ("all_reduce", "send_recv", ...)
// and a few aliases ("allreduce", "bcast", "alltoall", ...).
bool parse_collective(std::string_view name, Collective* out);
bool parse_dtype(std::string_view name, braid_dtype_t* out);  // "float16", "fp16", "half", "bf16", ...
bool parse_redop(std::string_view name,
                 braid_redop_t* out);  // "sum", "prod", ..., "avg", "band", "bor", "bxor"
const char* dtype_label(braid_dtype_t dtype);
const char* redop_label(braid_redop_t op);

std::vector<Collective> all_collectives();
std::vector<braid_dtype_t> all_dtypes();
// 0, 1, 2, 7, 31, 1024+3, 65536+17, (1<<20)+1 elements.
std::vector<size_t> default_counts();
// 0, 1, 7, 1000, 70000 elements.
std::vector<size_t> quick_counts();

struct CheckOptions {
  std::vector<Collective> collectives;  // empty: all
  std::vector<braid_dtype_t> dtypes;    // empty: all ten
  std::vector<braid_redop_t> ops;       // empty: every op valid for the dtype
  std::vector<size_t> counts;           // empty: default_counts()
  std::vector<int> roots;               // empty: every rank; out-of-range roots are skipped
  bool out_of_place = true;
  bool in_place = true;
  bool blocking = true;
  bool nonblocking = true;    // i-forms, completed by braid_wait, braid_test loops or braid_wait_all
  bool random_floats = true;  // extra float sum/avg pass on random data, with a tolerance
  uint64_t seed = 1;
  int verbose = 0;  // 1: one line per group, with its time (rank 0); 2: also one line per check (every rank)
  int max_failure_lines = 20;  // per rank
  // > 0: braid_comm_set_timeout(comm, op_timeout_s) before the run, and the
  // deadline of braid_test loops. 0 keeps the communicator's timeout.
  double op_timeout_s = 0;
  // A check whose buffers on one rank would exceed this many bytes is skipped
  // (on every rank alike); 0 means no limit.
  size_t max_buffer_bytes = size_t{1} << 30;
  size_t guard_bytes = 64;  // guard region before and after every buffer
  FILE* log = nullptr;      // failure and progress lines; nullptr means stderr
  // Self-test of the harness: when k > 0, one rank corrupts the result of
  // every k-th check after the call returned (an output element, or a guard
  // byte where that rank has no output), and the run must then report exactly
  // those checks as failed (CheckReport::total_injected).
  int inject_fault_every = 0;
  // > 0: every buffer is cut from an arena of this many bytes per rank,
  // allocated with braid_mem_alloc and registered on the communicator for
  // the run (buffers that no longer fit come from the heap, unregistered).
  size_t registered_arena_bytes = 0;
};

// The options of the unit-test suite: quick_counts(), everything else default.
CheckOptions quick_options();

struct CheckReport {
  int rank = -1;
  int nranks = 0;
  // This rank.
  int64_t checks = 0;          // checks run (each check runs on every rank)
  int64_t failed = 0;          // checks that failed on this rank
  int64_t wrong_elements = 0;  // wrong output elements seen by this rank
  int64_t outside_writes = 0;  // checks that changed bytes outside their output
  int64_t api_errors = 0;      // calls that did not return BRAID_SUCCESS
  int64_t skipped = 0;         // checks skipped by max_buffer_bytes
  int64_t injected = 0;        // faults injected by this rank (inject_fault_every)
  // The whole job, from the all-reduce after each group: the same on every rank.
  int64_t total_checks = 0;          // distinct checks
  int64_t total_failed = 0;          // distinct checks that failed on at least one rank
  int64_t total_wrong_elements = 0;  // summed over ranks
  int64_t total_api_errors = 0;      // summed over ranks
  int64_t total_injected = 0;        // summed over ranks (one rank injects per check)
  bool agreement_ok = true;          // the count all-reduces worked and agreed
  bool stopped_early = false;        // an API error stopped the run (on every rank)
  // registered_arena_bytes > 0: this rank's bytes through registered windows
  // (braid_comm_transport_bytes "shm_window") and its buffers that did not
  // fit the arena.
  bool registered = false;
  uint64_t window_bytes = 0;
  int64_t heap_buffers = 0;
  double seconds = 0;

  bool ok() const {
    return failed == 0 && total_failed == 0 && api_errors == 0 && total_api_errors == 0 && agreement_ok &&
           !stopped_early;
  }
  // "12345 checks, 0 failed, 0 wrong elements"
  std::string summary() const;
};

CheckReport run_check_matrix(braid_comm_t comm, const CheckOptions& opts);

}  // namespace braid::check
