// alltoall_perf: braid_all_to_all; count is what each rank sends to each peer:
// block p of rank r's sendbuf goes to rank p, block p of its recvbuf comes
// from rank p. busbw = algbw * (n-1)/n.
#include "perf_common.h"

namespace {

using braid_perf::MpiArgs;
using braid_perf::Reference;
using braid_perf::RunArgs;
using braid_perf::Span;

braid_result_t run(const RunArgs& a) {
  return braid_all_to_all(a.sendbuf, a.recvbuf, a.count, a.dtype, a.comm, nullptr);
}

int run_mpi(const MpiArgs& a) {
  return MPI_Alltoall(a.sendbuf, a.count, a.dtype, a.recvbuf, a.count, a.dtype, a.comm);
}

const braid_perf::CollDesc kDesc = {
    .name = "alltoall",
    .call = "braid_all_to_all",
    .reduces = false,
    .rooted = false,
    .result_on_root_only = false,
    .in_place = true,
    .send_span = Span::kCountTimesRanks,
    .recv_span = Span::kCountTimesRanks,
    .busbw_factor = [](int n) { return static_cast<double>(n - 1) / n; },
    .run = run,
    .mpi = run_mpi,
    .expected =
        [](const Reference& ref, size_t i) {
          const size_t peer = i / ref.count();
          return ref.input(static_cast<int>(peer),
                           static_cast<size_t>(ref.rank()) * ref.count() + i % ref.count());
        },
};

}  // namespace

int main(int argc, char** argv) {
  return braid_perf::perf_main(argc, argv, kDesc);
}
