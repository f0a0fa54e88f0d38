// reduce_perf: braid_reduce; the root ends with the reduction of all ranks'
// count elements (other ranks' recvbuf is not checked). busbw = algbw.
#include "perf_common.h"

namespace {

using braid_perf::MpiArgs;
using braid_perf::Reference;
using braid_perf::RunArgs;
using braid_perf::Span;

braid_result_t run(const RunArgs& a) {
  return braid_reduce(a.sendbuf, a.recvbuf, a.count, a.dtype, a.op, a.root, a.comm, nullptr);
}

int run_mpi(const MpiArgs& a) {
  return MPI_Reduce(a.sendbuf, a.recvbuf, a.count, a.dtype, a.op, a.root, a.comm);
}

const braid_perf::CollDesc kDesc = {
    .name = "reduce",
    .call = "braid_reduce",
    .reduces = true,
    .rooted = true,
    .result_on_root_only = true,
    .in_place = true,
    .send_span = Span::kCount,
    .recv_span = Span::kCount,
    .busbw_factor = [](int) { return 1.0; },
    .run = run,
    .mpi = run_mpi,
    .expected = [](const Reference& ref, size_t i) { return ref.reduced(i); },
};

}  // namespace

int main(int argc, char** argv) {
  return braid_perf::perf_main(argc, argv, kDesc);
}
