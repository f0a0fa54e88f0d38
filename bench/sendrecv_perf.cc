// sendrecv_perf: inside one braid group, each rank sends count elements to
// rank + 1 and receives count elements from rank - 1 (a ring shift).
// busbw = algbw.
//
// No in-place form: with sendbuf == recvbuf the incoming message would
// overwrite the outgoing one while it is being sent, so the result is not
// defined. nccl-tests times that case anyway and hides its errors; here the
// in-place columns say N/A instead.
#include "perf_common.h"

namespace {

using braid_perf::MpiArgs;
using braid_perf::Reference;
using braid_perf::RunArgs;
using braid_perf::Span;

braid_result_t run(const RunArgs& a) {
  const int next = (a.rank + 1) % a.nranks;
  const int prev = (a.rank + a.nranks - 1) % a.nranks;
  braid_result_t r = braid_group_start();
  if (r != BRAID_SUCCESS) return r;
  r = braid_send(a.sendbuf, a.count, a.dtype, next, a.comm, nullptr);
  if (r == BRAID_SUCCESS) r = braid_recv(a.recvbuf, a.count, a.dtype, prev, a.comm, nullptr);
  const braid_result_t end = braid_group_end();  // always close the group
  return r != BRAID_SUCCESS ? r : end;
}

int run_mpi(const MpiArgs& a) {
  const int next = (a.rank + 1) % a.nranks;
  const int prev = (a.rank + a.nranks - 1) % a.nranks;
  return MPI_Sendrecv(a.sendbuf, a.count, a.dtype, next, 0, a.recvbuf, a.count, a.dtype, prev, 0, a.comm,
                      MPI_STATUS_IGNORE);
}

const braid_perf::CollDesc kDesc = {
    .name = "sendrecv",
    .call = "braid_send/braid_recv group",
    .reduces = false,
    .rooted = false,
    .result_on_root_only = false,
    .in_place = false,
    .send_span = Span::kCount,
    .recv_span = Span::kCount,
    .busbw_factor = [](int) { return 1.0; },
    .run = run,
    .mpi = run_mpi,
    .expected = [](const Reference& ref,
                   size_t i) { return ref.input((ref.rank() + ref.nranks() - 1) % ref.nranks(), i); },
};

}  // namespace

int main(int argc, char** argv) {
  return braid_perf::perf_main(argc, argv, kDesc);
}
