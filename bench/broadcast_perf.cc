// broadcast_perf: braid_broadcast; every rank ends with the root's count
// elements. busbw = algbw.
#include "perf_common.h"

namespace {

using braid_perf::MpiArgs;
using braid_perf::Reference;
using braid_perf::RunArgs;
using braid_perf::Span;

braid_result_t run(const RunArgs& a) {
  return braid_broadcast(a.sendbuf, a.recvbuf, a.count, a.dtype, a.root, a.comm, nullptr);
}

int run_mpi(const MpiArgs& a) {
  // MPI broadcasts one buffer: the root's send buffer, everyone else's recv buffer.
  void* buf = a.rank == a.root ? const_cast<void*>(a.sendbuf) : a.recvbuf;
  return MPI_Bcast(buf, a.count, a.dtype, a.root, a.comm);
}

const braid_perf::CollDesc kDesc = {
    .name = "broadcast",
    .call = "braid_broadcast",
    .reduces = false,
    .rooted = true,
    .result_on_root_only = false,
    .in_place = true,
    .send_span = Span::kCount,
    .recv_span = Span::kCount,
    .busbw_factor = [](int) { return 1.0; },
    .run = run,
    .mpi = run_mpi,
    .expected = [](const Reference& ref, size_t i) { return ref.input(ref.root(), i); },
    .mpi_in_place = true,
};

}  // namespace

int main(int argc, char** argv) {
  return braid_perf::perf_main(argc, argv, kDesc);
}
