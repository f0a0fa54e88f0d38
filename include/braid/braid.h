/* braid: collective communication for host and CUDA memory.
 *
 * Conventions
 * - Every function returns braid_result_t. braid_get_error_string() names the
 *   code; braid_get_last_error() (per thread) and braid_comm_get_last_error()
 *   (per communicator) give the full message: rank, peer, operation, cause.
 * - Handles are opaque. A destroyed communicator or a completed request is
 *   rejected with BRAID_ERR_INVALID_ARGUMENT, never dereferenced. A child of
 *   fork() cannot use a communicator its parent made (BRAID_ERR_INVALID_USAGE;
 *   braid_comm_destroy there only drops the child's handle).
 * - Every operation has a blocking form and an `i` form that returns a
 *   braid_request_t; the `i` form progresses without the caller polling.
 * - In-place is allowed everywhere: sendbuf == recvbuf, or the NCCL layouts
 *   (all_gather: sendbuf == recvbuf + rank * count; reduce_scatter:
 *   recvbuf == sendbuf + rank * count).
 * - `stream`: NULL for a host-ordered operation on host memory. A CUDA stream
 *   (a cudaStream_t; the legacy default stream, whose handle is NULL, as
 *   cudaStreamLegacy, and the per-thread one as cudaStreamPerThread) makes the
 *   operation stream-ordered, with NCCL's semantics: buffers may be device or
 *   host memory, the call enqueues the operation on the stream and returns,
 *   and the operation reads its inputs once the stream's earlier work is done;
 *   later work on the stream sees its results. The blocking form returns
 *   without waiting; braid_wait on the `i` form waits until the results are
 *   in place. An error found later fails the request, or is reported by
 *   braid_comm_get_async_error; the stream is never left waiting, and the
 *   failed call's outputs are undefined.
 *   Every collective but barrier on device buffers, on a communicator whose
 *   ranks are all on one host, moves its data device to device through
 *   CUDA IPC (NVLink, PCIe, or one GPU's memory when ranks share a GPU);
 *   the first such call sets that up with
 *   every rank (it blocks until all ranks made it). Every rank must then pass
 *   device memory, or every rank host memory, to the same call
 *   (BRAID_ERR_MISMATCH otherwise). Send and receive, calls across hosts, and
 *   jobs where a rank cannot map another's memory (the log says why) move
 *   device data through pinned host memory (host staging).
 * - Every rank calls the same collectives on a communicator in the same
 *   order, with the same count, dtype, op and root (as with NCCL). A call
 *   from several threads on one communicator must be ordered by the caller:
 *   two calls of the same shape that ranks make in different orders cannot
 *   be told apart, and their results are wrong. Different kinds, counts,
 *   dtypes and ops are found where messages meet (BRAID_ERR_MISMATCH). A
 *   different root, or a count of 0 on some ranks only, is not: such a call
 *   times out or returns wrong data, unless BRAID_CHECK_CALLS=1, which
 *   compares every collective's arguments first (one small exchange per
 *   call). A collective on one rank against comm_split on another times out.
 */
#ifndef BRAID_BRAID_H_
#define BRAID_BRAID_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BRAID_VERSION_MAJOR 0
#define BRAID_VERSION_MINOR 1
#define BRAID_VERSION_PATCH 0
#define BRAID_VERSION_CODE (BRAID_VERSION_MAJOR * 10000 + BRAID_VERSION_MINOR * 100 + BRAID_VERSION_PATCH)

typedef enum {
  BRAID_SUCCESS = 0,
  BRAID_ERR_INVALID_ARGUMENT = 1, /* a bad argument; the message names it */
  BRAID_ERR_INVALID_USAGE = 2,    /* a valid call at the wrong time (e.g. unbalanced group_end) */
  BRAID_ERR_SYSTEM = 3,           /* an OS call failed (socket, shm, ...); the message says which */
  BRAID_ERR_INTERNAL = 4,         /* a bug in braid */
  BRAID_ERR_REMOTE = 5,           /* a peer failed, closed its connection or sent garbage */
  BRAID_ERR_TIMEOUT = 6,          /* an operation passed its deadline */
  BRAID_ERR_ABORTED = 7,          /* braid_comm_abort was called */
  BRAID_ERR_MISMATCH = 8,         /* ranks called different operations */
  BRAID_ERR_UNSUPPORTED = 9,      /* a feature this build does not have */
  BRAID_ERR_IN_PROGRESS = 10      /* braid_test: not done yet (never returned by braid_test itself) */
} braid_result_t;

typedef enum {
  BRAID_INT8 = 0,
  BRAID_UINT8 = 1,
  BRAID_INT32 = 2,
  BRAID_UINT32 = 3,
  BRAID_INT64 = 4,
  BRAID_UINT64 = 5,
  BRAID_FLOAT16 = 6,
  BRAID_BFLOAT16 = 7,
  BRAID_FLOAT32 = 8,
  BRAID_FLOAT64 = 9,
  BRAID_NUM_DTYPES = 10
} braid_dtype_t;

/* BRAID_AVG is defined for floating types only. bfloat16, float32 and
 * float64 sum, then divide by the number of ranks (one rounding for the
 * division). float16 divides each rank's input by the number of ranks, then
 * sums, as NCCL does: its sum would pass 65504, and give inf, where the
 * average fits (2 ranks of 40000). With a number of ranks that is not a
 * power of two, each scaled input rounds once more. The bitwise BAND, BOR
 * and BXOR are defined for integer types only. Other pairings are rejected with BRAID_ERR_INVALID_ARGUMENT.
 * Where both inputs of a floating SUM, PROD or AVG are NaN, which NaN's
 * payload comes out is unspecified (the result is NaN). MIN and MAX
 * propagate NaN (as torch.minimum does; fminf would drop it), on host and
 * device alike; of two equal values (-0.0 and +0.0) either may come out. */
typedef enum {
  BRAID_SUM = 0,
  BRAID_PROD = 1,
  BRAID_MIN = 2,
  BRAID_MAX = 3,
  BRAID_AVG = 4,
  BRAID_BAND = 5,
  BRAID_BOR = 6,
  BRAID_BXOR = 7,
  BRAID_NUM_OPS = 8
} braid_redop_t;

typedef struct braid_comm* braid_comm_t;
typedef struct braid_request* braid_request_t;
typedef void* braid_stream_t; /* a cudaStream_t, or NULL for host-ordered */

#define BRAID_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[BRAID_UNIQUE_ID_BYTES];
} braid_unique_id_t;

/* Pass as color to braid_comm_split to take no part in any new communicator. */
#define BRAID_SPLIT_NOCOLOR (-1)

/* ---- errors and versions ---- */
const char* braid_get_error_string(braid_result_t result);
/* Message of the last failed call made by this thread ("" if none). */
const char* braid_get_last_error(void);
/* Message of the last failed call on this communicator, or of the error that
 * broke it. Valid until the next call on the communicator from any thread. */
const char* braid_comm_get_last_error(braid_comm_t comm);
braid_result_t braid_get_version(int* version);
/* Size of one element in bytes, 0 for an unknown type. */
size_t braid_dtype_size(braid_dtype_t dtype);
const char* braid_dtype_name(braid_dtype_t dtype);
const char* braid_redop_name(braid_redop_t op);

/* ---- communicators ---- */
/* Creates an id and starts the rendezvous root in this process (NCCL style);
 * hand the id to every rank out of band (MPI_Bcast, a file, a store). The
 * root listens on BRAID_SOCKET_IFNAME's address, else on the interface that
 * reaches MASTER_ADDR when that is set, else on the first non-loopback one. */
braid_result_t braid_get_unique_id(braid_unique_id_t* id);
/* Joins rank `rank` of `nranks` (1 to 2^20) to the job of `id`. */
braid_result_t braid_comm_init_rank(braid_comm_t* comm, int nranks, braid_unique_id_t id, int rank);
/* Joins the job described by the torchrun / TorchDistributor environment:
 * MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (LOCAL_RANK is informational).
 * Rank 0 runs the rendezvous root on BRAID_ROOT_PORT, default MASTER_PORT + 1
 * (MASTER_PORT itself belongs to torch's store under torchrun). */
braid_result_t braid_comm_init_env(braid_comm_t* comm);
/* Collective over comm. Ranks with the same color form a communicator,
 * ordered by (key, old rank). color == BRAID_SPLIT_NOCOLOR gives *newcomm = NULL. */
braid_result_t braid_comm_split(braid_comm_t comm, int color, int key, braid_comm_t* newcomm);
/* Waits for outstanding operations, then frees everything. Requests of comm
 * the caller still holds do not keep it: each still reports its operation's
 * result to braid_wait / braid_test. It does not cancel: a receive nobody
 * matches keeps it waiting until that receive's deadline, unless another
 * thread calls braid_comm_abort with the handle meanwhile (which cancels;
 * every other call takes the handle as destroyed from the start).
 * Returns BRAID_ERR_MISMATCH, having freed everything all the same, where a
 * peer's message arrived that no call on this rank took: the ranks' calls
 * did not match and nothing after them showed it (ranks passing different
 * roots to a last broadcast, a send with no receive), so the last calls may
 * have returned wrong data. Messages from a peer that failed are not
 * counted, and one still on its way is not seen. */
braid_result_t braid_comm_destroy(braid_comm_t comm);
/* Makes every pending operation fail with BRAID_ERR_ABORTED and tells the
 * peers (a braid_comm_split of comm on another thread too, also while it
 * sets up the new communicator); then frees like destroy: later calls with the handle fail with
 * BRAID_ERR_INVALID_ARGUMENT (not a live communicator). Safe to call from
 * another thread.
 * Returns once no peer can still write into a buffer of a failed receive: a
 * large receive on one host whose sender is copying a chunk into it waits
 * for that chunk (microseconds; at most 5 s for a sender that is stopped). */
braid_result_t braid_comm_abort(braid_comm_t comm);
braid_result_t braid_comm_rank(braid_comm_t comm, int* rank);
braid_result_t braid_comm_size(braid_comm_t comm, int* size);
/* The error that broke the communicator, BRAID_SUCCESS while it is healthy. */
braid_result_t braid_comm_get_async_error(braid_comm_t comm, braid_result_t* async_error);
/* Deadline for each later operation on comm, in seconds (> 0). The default is
 * BRAID_TIMEOUT from the environment, else 600. An operation takes the value
 * in force when it is posted, so setting it around one call overrides the
 * deadline of that call only; a call inside a group is posted at
 * braid_group_end and takes the value in force then. */
braid_result_t braid_comm_set_timeout(braid_comm_t comm, double seconds);
/* Prints, through braid's log (BRAID_DEBUG_FILE or stderr; shown unless
 * BRAID_DEBUG=NONE), the operations this rank has in flight: name, sequence
 * number, algorithm, bytes, step, how long it has run and the peer it waits
 * on. Safe from any thread; when another thread is driving, that thread
 * prints within one wake-up (20 ms). SIGUSR1 does the same for every
 * communicator of the process (BRAID_DUMP_SIGNAL=0 leaves SIGUSR1 alone). */
braid_result_t braid_comm_dump(braid_comm_t comm);
/* Payload bytes this rank has moved between itself and its peers on comm
 * through one transport, "shm", "tcp" or "self": sent, or copied straight
 * between its memory and a peer's (a large send on one host is copied in
 * chunks by both ends, each counting its own); "cuda_ipc": read from peers'
 * device memory. Shows which transport
 * carries which traffic (e.g. that ranks of one host talk over shm and hosts
 * over tcp). */
braid_result_t braid_comm_transport_bytes(braid_comm_t comm, const char* transport, uint64_t* bytes);

/* ---- registered host memory ----
 * Host memory from braid_mem_alloc, registered on a communicator whose ranks
 * all run on this host, lets all_reduce, broadcast, all_gather and
 * reduce_scatter (calls of BRAID_WINDOW_MIN_BYTES, default 16 KiB, or more)
 * read and write the ranks' buffers directly, with no copy through the
 * transport: where every buffer the call reads on another rank (for
 * all_reduce also every output) lies in a registered range, on every rank.
 * Otherwise the call runs as it would without registration. The bytes moved
 * this way are counted as transport "shm_window". */
/* Zero-filled memory of at least `bytes`, which ranks of this host can map.
 * It is shared memory: a child made by fork() shares it with its parent
 * (no copy on write), so a child must not write it; the child may allocate
 * its own, and braid_mem_free there unmaps the parent's in the child only
 * (the parent's registrations do not hold it there). */
braid_result_t braid_mem_alloc(void** ptr, size_t bytes);
/* Frees what braid_mem_alloc returned; refused (BRAID_ERR_INVALID_USAGE) while
 * a live communicator has it registered. NULL is a no-op. */
braid_result_t braid_mem_free(void* ptr);
/* Collective over comm: every rank registers one range [buf, buf + bytes)
 * inside its braid_mem_alloc memory (sizes and offsets may differ between
 * ranks). If any rank's range is not such memory (or NULL, or empty), every
 * rank returns BRAID_ERR_INVALID_ARGUMENT naming that rank, and nothing is
 * registered. Where the ranks cannot map each other's memory (ranks on
 * several hosts; pidfd_getfd refused) the registration is kept but changes
 * nothing (BRAID_DEBUG=INFO says why); across hosts it is each rank's own,
 * and a bad range fails on its rank only. */
braid_result_t braid_comm_register(braid_comm_t comm, void* buf, size_t bytes);
/* Collective: every rank names the buf it registered. Ranks that name
 * different registrations all get BRAID_ERR_MISMATCH, and nothing changes. */
braid_result_t braid_comm_deregister(braid_comm_t comm, void* buf);

/* ---- requests ---- */
/* Waits for the operation, frees the request and sets *request = NULL.
 * Returns the operation's result. An operation still in this thread's open
 * group (it starts at braid_group_end) is BRAID_ERR_INVALID_USAGE for
 * braid_wait and braid_test, and the request stays valid. */
braid_result_t braid_wait(braid_request_t* request);
/* *done = 1 once the operation completed; then the request is freed,
 * *request = NULL and the operation's result is returned. Like MPI_Test,
 * it moves the operation along for a few microseconds first. */
braid_result_t braid_test(braid_request_t* request, int* done);
/* Waits for all; returns the first failure (each request is freed). */
braid_result_t braid_wait_all(int count, braid_request_t* requests);
/* Drops the handle; the operation still completes, and an error it meets is
 * reported by braid_comm_get_async_error. */
braid_result_t braid_request_free(braid_request_t request);

/* Called once when the operation completes, with its result and message
 * (valid during the call). It runs on whichever thread completes the
 * operation, often braid's progress thread, or at once on this thread if the
 * operation is already done; it must return quickly and must not call braid
 * (a call that could wait fails with BRAID_ERR_INVALID_USAGE there).
 * The request stays valid: wait, test or free it as usual; braid_wait and
 * braid_test return only once the callback has returned. At most one
 * callback per request; a second call is rejected. */
typedef void (*braid_callback_t)(void* user, braid_result_t result, const char* message);
braid_result_t braid_request_set_callback(braid_request_t request, braid_callback_t callback, void* user);

/* ---- groups ----
 * Between braid_group_start and braid_group_end (per thread, nestable),
 * operations are queued, not started; group_end starts them together and
 * waits for the blocking ones. A ring exchange where every rank sends and
 * receives at once does not deadlock inside a group. The operations of one
 * group must not read what another of them writes (as with NCCL, their
 * order inside the group is not promised): stream-ordered ones read their
 * inputs before any of them ran where device memory is staged through the
 * host. A call the group refuses (bad arguments) fails it: group_end
 * returns that error, and where the group holds other operations on that
 * communicator, it is aborted (its peers learn why) since they cannot all
 * be made; a call whose handle names no live communicator aborts every
 * communicator the group holds operations on. A communicator with
 * operations in the thread's open group cannot be destroyed
 * (BRAID_ERR_INVALID_USAGE). */
braid_result_t braid_group_start(void);
braid_result_t braid_group_end(void);

/* ---- point-to-point ----
 * Messages between two ranks match in the order they were posted, and a
 * receive must ask for as many bytes as its send sent (BRAID_ERR_MISMATCH
 * otherwise, naming both sizes). A rank may send to itself: the message
 * waits in a buffer of BRAID_SHM_SLOTS pieces (1 MiB by default; up to 64
 * messages per piece) until a receive takes it, so more, or a larger
 * blocking send to itself, must be grouped with its receive, or follow a
 * braid_irecv, or it waits until its deadline. */
braid_result_t braid_send(const void* buf, size_t count, braid_dtype_t dtype, int peer, braid_comm_t comm,
                          braid_stream_t stream);
braid_result_t braid_recv(void* buf, size_t count, braid_dtype_t dtype, int peer, braid_comm_t comm,
                          braid_stream_t stream);
braid_result_t braid_isend(const void* buf, size_t count, braid_dtype_t dtype, int peer, braid_comm_t comm,
                           braid_stream_t stream, braid_request_t* request);
braid_result_t braid_irecv(void* buf, size_t count, braid_dtype_t dtype, int peer, braid_comm_t comm,
                           braid_stream_t stream, braid_request_t* request);
/* Receive from whichever rank's message arrives first (MPI_ANY_SOURCE): a
 * message goes to the earliest posted receive that can take it, so receives
 * from one peer still match that peer's sends in order. *source holds the
 * sender's rank once the operation completed. */
braid_result_t braid_recv_any(void* buf, size_t count, braid_dtype_t dtype, int* source, braid_comm_t comm,
                              braid_stream_t stream);
braid_result_t braid_irecv_any(void* buf, size_t count, braid_dtype_t dtype, int* source, braid_comm_t comm,
                               braid_stream_t stream, braid_request_t* request);
/* The same with a tag (the calls above use tag 0). Tags are checked, not
 * matched: messages still match in post order, as NCCL's do (MPI's tags pick
 * the message). A receive whose matching send has another tag fails with
 * BRAID_ERR_MISMATCH naming both, and the communicator is broken, as after
 * any mismatched call, instead of taking the other message's bytes. */
braid_result_t braid_send_tagged(const void* buf, size_t count, braid_dtype_t dtype, int peer, uint32_t tag,
                                 braid_comm_t comm, braid_stream_t stream);
braid_result_t braid_recv_tagged(void* buf, size_t count, braid_dtype_t dtype, int peer, uint32_t tag,
                                 braid_comm_t comm, braid_stream_t stream);
braid_result_t braid_isend_tagged(const void* buf, size_t count, braid_dtype_t dtype, int peer, uint32_t tag,
                                  braid_comm_t comm, braid_stream_t stream, braid_request_t* request);
braid_result_t braid_irecv_tagged(void* buf, size_t count, braid_dtype_t dtype, int peer, uint32_t tag,
                                  braid_comm_t comm, braid_stream_t stream, braid_request_t* request);
braid_result_t braid_recv_any_tagged(void* buf, size_t count, braid_dtype_t dtype, int* source, uint32_t tag,
                                     braid_comm_t comm, braid_stream_t stream);
braid_result_t braid_irecv_any_tagged(void* buf, size_t count, braid_dtype_t dtype, int* source, uint32_t tag,
                                      braid_comm_t comm, braid_stream_t stream, braid_request_t* request);

/* ---- collectives ----
 * Counts are per rank as in NCCL: all_gather / gather take sendcount (recvbuf
 * holds nranks * sendcount), reduce_scatter / scatter take recvcount (sendbuf
 * holds nranks * recvcount), all_to_all takes the count sent to each peer.
 * Buffers a rank does not use (recvbuf of a non-root in reduce and gather,
 * sendbuf of a non-root in broadcast and scatter) may be NULL. */
braid_result_t braid_all_reduce(const void* sendbuf, void* recvbuf, size_t count, braid_dtype_t dtype,
                                braid_redop_t op, braid_comm_t comm, braid_stream_t stream);
braid_result_t braid_broadcast(const void* sendbuf, void* recvbuf, size_t count, braid_dtype_t dtype,
                               int root, braid_comm_t comm, braid_stream_t stream);
braid_result_t braid_reduce(const void* sendbuf, void* recvbuf, size_t count, braid_dtype_t dtype,
                            braid_redop_t op, int root, braid_comm_t comm, braid_stream_t stream);
braid_result_t braid_all_gather(const void* sendbuf, void* recvbuf, size_t sendcount, braid_dtype_t dtype,
                                braid_comm_t comm, braid_stream_t stream);
braid_result_t braid_reduce_scatter(const void* sendbuf, void* recvbuf, size_t recvcount, braid_dtype_t dtype,
                                    braid_redop_t op, braid_comm_t comm, braid_stream_t stream);
braid_result_t braid_gather(const void* sendbuf, void* recvbuf, size_t sendcount, braid_dtype_t dtype,
                            int root, braid_comm_t comm, braid_stream_t stream);
braid_result_t braid_scatter(const void* sendbuf, void* recvbuf, size_t recvcount, braid_dtype_t dtype,
                             int root, braid_comm_t comm, braid_stream_t stream);
braid_result_t braid_all_to_all(const void* sendbuf, void* recvbuf, size_t count, braid_dtype_t dtype,
                                braid_comm_t comm, braid_stream_t stream);
/* Uneven all_to_all (MPI_Alltoallv): sendcounts[p] elements starting at
 * sendbuf + sdispls[p] go to rank p; recvcounts[p] elements from rank p land
 * at recvbuf + rdispls[p]. Counts and displacements are in elements, one per
 * rank. A block whose size differs from what its receiver expects fails the
 * receiver with BRAID_ERR_MISMATCH (and breaks the communicator). */
braid_result_t braid_all_to_allv(const void* sendbuf, const size_t* sendcounts, const size_t* sdispls,
                                 void* recvbuf, const size_t* recvcounts, const size_t* rdispls,
                                 braid_dtype_t dtype, braid_comm_t comm, braid_stream_t stream);
braid_result_t braid_barrier(braid_comm_t comm, braid_stream_t stream);

braid_result_t braid_iall_reduce(const void* sendbuf, void* recvbuf, size_t count, braid_dtype_t dtype,
                                 braid_redop_t op, braid_comm_t comm, braid_stream_t stream,
                                 braid_request_t* request);
braid_result_t braid_ibroadcast(const void* sendbuf, void* recvbuf, size_t count, braid_dtype_t dtype,
                                int root, braid_comm_t comm, braid_stream_t stream, braid_request_t* request);
braid_result_t braid_ireduce(const void* sendbuf, void* recvbuf, size_t count, braid_dtype_t dtype,
                             braid_redop_t op, int root, braid_comm_t comm, braid_stream_t stream,
                             braid_request_t* request);
braid_result_t braid_iall_gather(const void* sendbuf, void* recvbuf, size_t sendcount, braid_dtype_t dtype,
                                 braid_comm_t comm, braid_stream_t stream, braid_request_t* request);
braid_result_t braid_ireduce_scatter(const void* sendbuf, void* recvbuf, size_t recvcount,
                                     braid_dtype_t dtype, braid_redop_t op, braid_comm_t comm,
                                     braid_stream_t stream, braid_request_t* request);
braid_result_t braid_igather(const void* sendbuf, void* recvbuf, size_t sendcount, braid_dtype_t dtype,
                             int root, braid_comm_t comm, braid_stream_t stream, braid_request_t* request);
braid_result_t braid_iscatter(const void* sendbuf, void* recvbuf, size_t recvcount, braid_dtype_t dtype,
                              int root, braid_comm_t comm, braid_stream_t stream, braid_request_t* request);
braid_result_t braid_iall_to_all(const void* sendbuf, void* recvbuf, size_t count, braid_dtype_t dtype,
                                 braid_comm_t comm, braid_stream_t stream, braid_request_t* request);
braid_result_t braid_iall_to_allv(const void* sendbuf, const size_t* sendcounts, const size_t* sdispls,
                                  void* recvbuf, const size_t* recvcounts, const size_t* rdispls,
                                  braid_dtype_t dtype, braid_comm_t comm, braid_stream_t stream,
                                  braid_request_t* request);
braid_result_t braid_ibarrier(braid_comm_t comm, braid_stream_t stream, braid_request_t* request);

/* ---- reduction kernels (host memory) ----
 * dst[i] = a[i] op b[i] for i < count; dst may be a or b (the same address),
 * but a partial overlap is refused (BRAID_ERR_INVALID_ARGUMENT). AVG reduces as
 * SUM here (the division belongs to the collective). float16 and bfloat16 are
 * computed in float32 and rounded to nearest even. */
braid_result_t braid_reduce_local(void* dst, const void* a, const void* b, size_t count, braid_dtype_t dtype,
                                  braid_redop_t op);

#ifdef __cplusplus
}
#endif

#endif /* BRAID_BRAID_H_ */
