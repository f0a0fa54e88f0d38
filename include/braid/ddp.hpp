// braid::ddp — data-parallel training over braid's C API.
//
// Each rank holds a full replica of the model and trains on its own shard of
// the batch. The Reducer averages the gradients across ranks during the
// backward pass: parameters are packed into buckets in reverse registration
// order (the order a backward pass usually produces gradients), and a
// bucket's all_reduce starts as soon as its last gradient is marked ready,
// so communication overlaps the rest of the backward pass. The last bucket
// (the first parameters registered) starts at finish().
//
//   std::unique_ptr<braid::ddp::Reducer> ddp;
//   auto r = braid::ddp::Reducer::create(comm, params, buffers, {}, &ddp);
//   for each step:
//     forward; backward, calling ddp->mark_ready(i) as gradient i is final;
//     r = ddp->finish();           // gradients now hold the average over ranks
//     optimizer step
//
// Host memory only: gradients on a GPU go through torch's DDP with the
// braid backend (python/), not through this layer.
// Errors are values: every call that can fail returns a Result naming what
// went wrong. Needs C++17.
#ifndef BRAID_DDP_HPP_
#define BRAID_DDP_HPP_

#include <braid/braid.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace braid::ddp {

struct Result {
  braid_result_t code = BRAID_SUCCESS;
  std::string message;

  bool ok() const { return code == BRAID_SUCCESS; }
  explicit operator bool() const { return ok(); }
};

// A trainable tensor. `data` is broadcast from rank 0 when the Reducer is
// created. `grad` is where the backward pass leaves the gradient; the Reducer
// copies it into the bucket at mark_ready and the average back at finish().
// With grad == nullptr the gradient lives in the bucket itself (no copies):
// the backward pass writes it to Reducer::grad(i).
struct Parameter {
  std::string name;
  void* data = nullptr;
  void* grad = nullptr;
  size_t count = 0;
  braid_dtype_t dtype = BRAID_FLOAT32;
  // Its dimensions, if it has any (torch's sizes(); their product must be
  // count): create compares them across ranks, as torch's DDP compares
  // parameter shapes. Empty: only count and dtype are compared.
  std::vector<int64_t> shape = {};
};

// State that is not trained but must agree across ranks (e.g. running
// statistics): broadcast from rank 0 at creation and by sync_buffers().
struct Buffer {
  std::string name;
  void* data = nullptr;
  size_t count = 0;
  braid_dtype_t dtype = BRAID_FLOAT32;
  std::vector<int64_t> shape = {};  // as Parameter::shape
};

struct Options {
  // Bucket capacity in bytes. The first bucket (the last parameters
  // registered, the first gradients of a backward pass) is capped at
  // first_bucket_bytes so that communication starts early.
  size_t bucket_bytes = size_t{25} << 20;
  size_t first_bucket_bytes = size_t{1} << 20;
  // When false, finish() fails if a parameter was never marked ready in the
  // step, naming it. When true such a parameter contributes zeros (or, if it
  // was marked ready in a no_sync step since the last synchronised one, the
  // gradient it accumulated): its gradient becomes the sum over the ranks
  // that used it divided by the world size, as with torch's DDP and
  // find_unused_parameters. One no rank used keeps its grad as it was
  // (used_in_last_step). Options must be the same on every rank.
  bool allow_unused_parameters = false;
  // When true (and with more than one rank), the buckets live in memory
  // every rank of a host can map (braid_mem_alloc), registered on a
  // communicator the Reducer splits from the one given to create and runs
  // its all_reduces on. On one host that lets each all_reduce of
  // BRAID_WINDOW_MIN_BYTES or more (16 KiB, 128 KiB where ranks share
  // cores) move data straight between the ranks' buckets, with no copy
  // through the transport; across hosts it changes nothing but the
  // communicator. The Reducer's communicator ends with it, on each rank
  // alone (a deregistration would be collective). Being its own, it takes
  // the timeout comm had at create, and braid_comm_abort(comm) does not
  // reach it: a watchdog that aborts comm to end a hung step aborts
  // bucket_comm() too. When false, the buckets are plain memory and the
  // all_reduces run on comm itself.
  bool register_buckets = true;
};

struct BucketInfo {
  std::vector<size_t> parameters;  // parameter indices, in bucket order
  size_t bytes = 0;
  braid_dtype_t dtype = BRAID_FLOAT32;
};

class Reducer {
 public:
  // Validates the parameters, checks that every rank registered the same
  // shapes and dtypes, builds the buckets and broadcasts parameters and
  // buffers from rank 0. Collective over comm (and so is its split, with
  // Options::register_buckets). Gradients must be of a
  // floating dtype (float16, bfloat16, float32, float64). A bucket holds one
  // dtype; buckets are numbered in the order they fill (by the first
  // parameter registered in each), so a model mixing dtypes still starts
  // each bucket as soon as it is full. *out is set only on success.
  static Result create(braid_comm_t comm, std::vector<Parameter> parameters, std::vector<Buffer> buffers,
                       const Options& options, std::unique_ptr<Reducer>* out);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Gradient i is final for this step. Starts the all_reduce of every bucket
  // that is now complete, in bucket order (every rank must start the same
  // all_reduces in the same order, whatever order its gradients arrive in).
  // Safe to call from several threads.
  Result mark_ready(size_t i);

  // Ends the step: starts the last bucket, waits for every bucket, leaves
  // the average over ranks in each gradient, and resets for the next step.
  // Collective: every rank calls finish() or abandon_step() once per step,
  // in the same steps (with allow_unused_parameters a rank that marked
  // nothing still takes part, with zeros); an extra call on one rank pairs
  // with its peers' next step, and the ranks stay a step apart. In a no_sync step it only
  // resets: gradients keep accumulating locally. Whether a step is one is
  // fixed at its first mark_ready (a NoSync that ends between the backward
  // pass and finish() leaves the step local).
  Result finish();
  // Whether the current step communicates (see finish()).
  bool step_synchronised() const;
  // Drops the current step after a backward pass that failed before
  // finish(). In a synchronised step the buckets not started yet start now,
  // with zeros for gradients not ready and a mark that every rank sees:
  // every rank runs the same all_reduces (none pairs with a later step's),
  // and every rank's finish() for this step fails, saying a rank dropped it
  // (its gradients are then not averages). A failed finish() and a Reducer
  // destroyed mid-step drop the step the same way. Each bucket's all_reduce
  // carries one element more than its gradients for the mark. A Reducer
  // destroyed before this rank began a step (no mark_ready since the last
  // finish) sends nothing: peers inside that step fail when they learn the
  // rank is gone, or at their timeout.
  Result abandon_step();

  // Where gradient i lives: the Parameter's grad, or its slot in the bucket
  // when grad was nullptr.
  void* grad(size_t i) const;

  // While a NoSync is alive, steps do not communicate; the first step after
  // it ends averages the accumulated gradients (gradient accumulation). A
  // NoSync must not outlive its Reducer.
  class NoSync {
   public:
    explicit NoSync(Reducer* reducer);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    Reducer* reducer_;
    bool previous_;
  };
  NoSync no_sync() { return NoSync(this); }

  // Broadcasts every Buffer from rank 0 again, on comm. Collective: call it
  // between steps on every rank (with register_buckets false, inside a step
  // the ranks' bucket all_reduces and the broadcasts could interleave
  // differently, BRAID_ERR_MISMATCH).
  Result sync_buffers();
  // Buffer `index` now lives at `data` (its owner gave it new storage, as
  // loading a checkpoint does); its element count must stay as registered.
  // Local: call it on every rank whose buffer moved, before sync_buffers.
  Result move_buffer(size_t index, void* data, size_t count);

  const std::vector<BucketInfo>& buckets() const;
  // Buckets whose all_reduce started in the current step (0 after finish()).
  size_t buckets_started() const;
  // The order in which buckets started in the last synchronised step.
  std::vector<size_t> last_start_order() const;
  size_t num_parameters() const;
  // Whether some rank gave parameter i a gradient (or accumulated one under
  // no_sync) in the last synchronised step. Always true without
  // allow_unused_parameters; with it, finish() leaves the grad of a
  // parameter no rank used as it was (a gradient in its bucket slot too).
  bool used_in_last_step(size_t i) const;
  // The communicator the buckets' all_reduces run on: the Reducer's own
  // (Options::register_buckets), else the one given to create.
  braid_comm_t bucket_comm() const;
  // Whether the buckets are registered on bucket_comm(): false with
  // Options::register_buckets false or one rank, or where a rank could not
  // allocate such memory (on one host every rank then says false; across
  // hosts only that rank). Registered buckets across hosts, or where ranks
  // cannot map each other's memory, move as plain ones: the byte count
  // braid_comm_transport_bytes(bucket_comm(), "shm_window") shows whether
  // data moved between the buckets.
  bool buckets_registered() const;

 private:
  struct State;
  explicit Reducer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace braid::ddp

#endif  // BRAID_DDP_HPP_
