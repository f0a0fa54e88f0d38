// all_reduce_perf: braid_all_reduce; every rank ends with the reduction of all
// ranks' count elements. busbw = algbw * 2(n-1)/n.
#include "perf_common.h"

namespace {

using braid_perf::MpiArgs;
using braid_perf::Reference;
using braid_perf::RunArgs;
using braid_perf::Span;

braid_result_t run(const RunArgs& a) {
  return braid_all_reduce(a.sendbuf, a.recvbuf, a.count, a.dtype, a.op, a.comm, nullptr);
}

int run_mpi(const MpiArgs& a) {
  return MPI_Allreduce(a.sendbuf, a.recvbuf, a.count, a.dtype, a.op, a.comm);
}

const braid_perf::CollDesc kDesc = {
    .name = "all_reduce",
    .call = "braid_all_reduce",
    .reduces = true,
    .rooted = false,
    .result_on_root_only = false,
    .in_place = true,
    .send_span = Span::kCount,
    .recv_span = Span::kCount,
    .busbw_factor = [](int n) { return 2.0 * (n - 1) / n; },
    .run = run,
    .mpi = run_mpi,
    .expected = [](const Reference& ref, size_t i) { return ref.reduced(i); },
};

}  // namespace

int main(int argc, char** argv) {
  return braid_perf::perf_main(argc, argv, kDesc);
}
