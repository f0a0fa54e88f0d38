// gather_perf: braid_gather; count is what each rank sends, the root's recvbuf
// holds nranks blocks of count, block r from rank r (other ranks' recvbuf is
// not checked). busbw = algbw * (n-1)/n, as nccl-tests does.
#include "perf_common.h"

namespace {

using braid_perf::MpiArgs;
using braid_perf::Reference;
using braid_perf::RunArgs;
using braid_perf::Span;

braid_result_t run(const RunArgs& a) {
  return braid_gather(a.sendbuf, a.recvbuf, a.count, a.dtype, a.root, a.comm, nullptr);
}

int run_mpi(const MpiArgs& a) {
  return MPI_Gather(a.sendbuf, a.count, a.dtype, a.recvbuf, a.count, a.dtype, a.root, a.comm);
}

const braid_perf::CollDesc kDesc = {
    .name = "gather",
    .call = "braid_gather",
    .reduces = false,
    .rooted = true,
    .result_on_root_only = true,
    .in_place = true,
    .send_span = Span::kCount,
    .recv_span = Span::kCountTimesRanks,
    .busbw_factor = [](int n) { return static_cast<double>(n - 1) / n; },
    .run = run,
    .mpi = run_mpi,
    .expected = [](const Reference& ref,
                   size_t i) { return ref.input(static_cast<int>(i / ref.count()), i % ref.count()); },
};

}  // namespace

int main(int argc, char** argv) {
  return braid_perf::perf_main(argc, argv, kDesc);
}
