// scatter_perf: braid_scatter; the root sends nranks blocks of count, rank r
// receives block r. busbw = algbw * (n-1)/n, as nccl-tests does.
#include "perf_common.h"

namespace {

using braid_perf::MpiArgs;
using braid_perf::Reference;
using braid_perf::RunArgs;
using braid_perf::Span;

braid_result_t run(const RunArgs& a) {
  return braid_scatter(a.sendbuf, a.recvbuf, a.count, a.dtype, a.root, a.comm, nullptr);
}

int run_mpi(const MpiArgs& a) {
  return MPI_Scatter(a.sendbuf, a.count, a.dtype, a.recvbuf, a.count, a.dtype, a.root, a.comm);
}

const braid_perf::CollDesc kDesc = {
    .name = "scatter",
    .call = "braid_scatter",
    .reduces = false,
    .rooted = true,
    .result_on_root_only = false,
    .in_place = true,
    .send_span = Span::kCountTimesRanks,
    .recv_span = Span::kCount,
    .busbw_factor = [](int n) { return static_cast<double>(n - 1) / n; },
    .run = run,
    .mpi = run_mpi,
    .expected =
        [](const Reference& ref, size_t i) {
          return ref.input(ref.root(), static_cast<size_t>(ref.rank()) * ref.count() + i);
        },
};

}  // namespace

int main(int argc, char** argv) {
  return braid_perf::perf_main(argc, argv, kDesc);
}
