// reduce_scatter_perf: braid_reduce_scatter; each rank sends nranks blocks of
// count and receives block `rank` of the reduction. busbw = algbw * (n-1)/n.
#include "perf_common.h"

namespace {

using braid_perf::MpiArgs;
using braid_perf::Reference;
using braid_perf::RunArgs;
using braid_perf::Span;

braid_result_t run(const RunArgs& a) {
  return braid_reduce_scatter(a.sendbuf, a.recvbuf, a.count, a.dtype, a.op, a.comm, nullptr);
}

int run_mpi(const MpiArgs& a) {
  return MPI_Reduce_scatter_block(a.sendbuf, a.recvbuf, a.count, a.dtype, a.op, a.comm);
}

const braid_perf::CollDesc kDesc = {
    .name = "reduce_scatter",
    .call = "braid_reduce_scatter",
    .reduces = true,
    .rooted = false,
    .result_on_root_only = false,
    .in_place = true,
    .send_span = Span::kCountTimesRanks,
    .recv_span = Span::kCount,
    .busbw_factor = [](int n) { return static_cast<double>(n - 1) / n; },
    .run = run,
    .mpi = run_mpi,
    .expected = [](const Reference& ref,
                   size_t i) { return ref.reduced(static_cast<size_t>(ref.rank()) * ref.count() + i); },
};

}  // namespace

int main(int argc, char** argv) {
  return braid_perf::perf_main(argc, argv, kDesc);
}
