#include "backend.h"

#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <utility>

namespace braid_torch {
namespace {

std::exception_ptr backend_error(const std::string& message) {
  try {
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    return std::current_exception();
  }
}

void check_tensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "braid: ", op, " got a tensor on ", t.device(),
              "; braid takes CPU and CUDA tensors");
  TORCH_CHECK(t.layout() == c10::kStrided, "braid: ", op, " needs dense (strided) tensors, got layout ",
              t.layout());
}

void check_single(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK(tensors.size() == 1, "braid: ", op, " takes exactly one tensor per process, got ",
              tensors.size());
  check_tensor(tensors[0], op);
}

// `b` (named `what`) on a's device with a's dtype; `a` is named `a_is`.
void check_same(const at::Tensor& a, const at::Tensor& b, const char* op, const char* what,
                const char* a_is = "the input") {
  check_tensor(b, op);
  TORCH_CHECK(a.device() == b.device(), "braid: ", op, ": ", what, " is on ", b.device(), " but ", a_is,
              " on ", a.device(), " (one device per call)");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "braid: ", op, ": ", what, " has dtype ", b.scalar_type(),
              " but ", a_is, " has ", a.scalar_type());
}

// A contiguous tensor with t's contents: t itself when it already is.
at::Tensor staged(const at::Tensor& t) {
  return t.is_contiguous() ? t : t.contiguous();
}

size_t nbytes(const at::Tensor& t) {
  return static_cast<size_t>(t.numel()) * t.element_size();
}

// How braid reduces a torch dtype: its braid type, braid elements per torch
// element (2 for complex), and the braid op for the torch op.
struct Reduction {
  braid_dtype_t dtype;
  size_t per_element;
  braid_redop_t op;
  double premul = 1.0;  // PREMUL_SUM's factor
  bool has_premul = false;
};

Reduction reduction_for(const at::Tensor& t, const c10d::ReduceOp& rop, const char* op) {
  Reduction r{BRAID_FLOAT32, 1, BRAID_SUM};
  const auto st = t.scalar_type();
  bool complex = false, boolean = false;
  switch (st) {
    case at::kFloat:
      r.dtype = BRAID_FLOAT32;
      break;
    case at::kDouble:
      r.dtype = BRAID_FLOAT64;
      break;
    case at::kHalf:
      r.dtype = BRAID_FLOAT16;
      break;
    case at::kBFloat16:
      r.dtype = BRAID_BFLOAT16;
      break;
    case at::kChar:
      r.dtype = BRAID_INT8;
      break;
    case at::kByte:
      r.dtype = BRAID_UINT8;
      break;
    case at::kInt:
      r.dtype = BRAID_INT32;
      break;
    case at::kLong:
      r.dtype = BRAID_INT64;
      break;
    case at::kUInt32:
      r.dtype = BRAID_UINT32;
      break;
    case at::kUInt64:
      r.dtype = BRAID_UINT64;
      break;
    case at::kBool:
      r.dtype = BRAID_UINT8;
      boolean = true;
      break;
    case at::kComplexFloat:
      r.dtype = BRAID_FLOAT32;
      r.per_element = 2;
      complex = true;
      break;
    case at::kComplexDouble:
      r.dtype = BRAID_FLOAT64;
      r.per_element = 2;
      complex = true;
      break;
    case at::kComplexHalf:
      r.dtype = BRAID_FLOAT16;
      r.per_element = 2;
      complex = true;
      break;
    default:
      TORCH_CHECK(
          false, "braid: ", op, " cannot reduce dtype ", st,
          " (supported: float32, float64, float16, bfloat16, int8, uint8, int32, int64, uint32, uint64, "
          "bool, complex32, complex64, complex128)");
  }
  switch (rop.op_) {
    case c10d::ReduceOp::SUM:
      r.op = BRAID_SUM;
      break;
    case c10d::ReduceOp::AVG:
      r.op = BRAID_AVG;
      break;
    case c10d::ReduceOp::PRODUCT:
      r.op = BRAID_PROD;
      break;
    case c10d::ReduceOp::MIN:
      r.op = BRAID_MIN;
      break;
    case c10d::ReduceOp::MAX:
      r.op = BRAID_MAX;
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      r.op = BRAID_SUM;
      r.has_premul = true;
      auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(rop.supplement_.get());
      TORCH_CHECK(sup != nullptr, "braid: ", op, ": PREMUL_SUM without its factor");
      r.premul = sup->tensor_factor.defined() ? sup->tensor_factor.item<double>() : sup->double_factor;
      TORCH_CHECK(at::isFloatingType(st) || complex, "braid: ", op,
                  ": PREMUL_SUM needs a floating dtype, got ", st);
      break;
    }
    case c10d::ReduceOp::BAND:
      r.op = BRAID_BAND;
      break;
    case c10d::ReduceOp::BOR:
      r.op = BRAID_BOR;
      break;
    case c10d::ReduceOp::BXOR:
      r.op = BRAID_BXOR;
      break;
    default:
      TORCH_CHECK(false, "braid: ", op, ": unknown reduce op ", static_cast<int>(rop.op_));
  }
  if (r.op == BRAID_BAND || r.op == BRAID_BOR || r.op == BRAID_BXOR)
    TORCH_CHECK(!at::isFloatingType(st) && !complex, "braid: ", op,
                ": BAND, BOR and BXOR need an integer or bool dtype, got ", st);
  if (complex)
    TORCH_CHECK(r.op == BRAID_SUM || r.op == BRAID_AVG, "braid: ", op,
                ": complex tensors reduce with SUM, AVG or PREMUL_SUM only");
  if (boolean) {
    // bool as bytes 0/1: SUM, MAX and BOR are logical or, PRODUCT, MIN and
    // BAND logical and; BXOR stays as it is.
    TORCH_CHECK(r.op != BRAID_AVG, "braid: ", op, ": AVG is not defined for bool");
    if (r.op == BRAID_SUM || r.op == BRAID_MAX || r.op == BRAID_BOR) r.op = BRAID_MAX;
    if (r.op == BRAID_PROD || r.op == BRAID_MIN || r.op == BRAID_BAND) r.op = BRAID_MIN;
  }
  if (r.op == BRAID_AVG)
    TORCH_CHECK(at::isFloatingType(st) || complex, "braid: ", op, ": AVG needs a floating dtype, got ", st);
  return r;
}

// The buffer a reduction works in: contiguous, and pre-scaled for PREMUL_SUM.
at::Tensor reduction_buffer(const at::Tensor& t, const Reduction& r) {
  if (r.has_premul) return t.mul(r.premul).contiguous();
  return staged(t);
}

// Starts braid_NAME inside a StartFn: the blocking form for a stream-ordered
// work (it returns once enqueued), else the i-form, whose request joins
// `reqs`.
#define BRAID_START(name, op, ...)                                                     \
  do {                                                                                 \
    braid_request_t r_ = nullptr;                                                      \
    check(blocking ? braid_##name(__VA_ARGS__) : braid_i##name(__VA_ARGS__, &r_), op); \
    if (!blocking) reqs.push_back(r_);                                                 \
  } while (0)

// Copies consecutive slices of the 1-D staging tensor `flat` into `outs`, in
// order: how every op that stages through one flat buffer hands results back.
void copy_slices(const at::Tensor& flat, std::vector<at::Tensor>& outs) {
  int64_t off = 0;
  for (auto& t : outs) {
    t.copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
    off += t.numel();
  }
}

// The copy-out of ops that staged their outputs: each staging buffer into
// its target where they differ (non-contiguous targets).
std::function<void()> copy_back(std::vector<at::Tensor> targets, std::vector<at::Tensor> bufs) {
  return [targets, bufs]() mutable {
    for (size_t i = 0; i < targets.size(); ++i)
      if (!bufs[i].is_same(targets[i])) targets[i].copy_(bufs[i]);
  };
}

const c10::TypePtr& tensor_list_type() {
  static const c10::TypePtr type = c10::ListType::create(c10::TensorType::get());
  return type;
}

// A callback may come after the process group is gone (an abort returns
// before the engine has failed every op): the slot shares the queue.
struct CallbackSlot {
  c10::intrusive_ptr<BraidWork> work;
  std::shared_ptr<CompletionQueue> queue;
};

// Splits of dim 0 into byte counts and displacements for all_to_allv.
void split_layout(const at::Tensor& t, const std::vector<int64_t>& splits, int size, const char* what,
                  std::vector<size_t>* counts, std::vector<size_t>* displs) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const size_t row_bytes = rows == 0 ? 0 : nbytes(t) / static_cast<size_t>(rows);
  counts->assign(size, 0);
  displs->assign(size, 0);
  if (splits.empty()) {
    TORCH_CHECK(rows % size == 0, "braid: all_to_all_single: ", what, " has ", rows,
                " rows, not divisible by the group size ", size, " (pass split sizes)");
    for (int p = 0; p < size; ++p) (*counts)[p] = static_cast<size_t>(rows / size) * row_bytes;
  } else {
    TORCH_CHECK(static_cast<int>(splits.size()) == size, "braid: all_to_all_single: ", what,
                " split sizes have ", splits.size(), " entries for a group of ", size);
    int64_t total = 0;
    for (int p = 0; p < size; ++p) {
      TORCH_CHECK(splits[p] >= 0, "braid: all_to_all_single: negative split size for rank ", p);
      (*counts)[p] = static_cast<size_t>(splits[p]) * row_bytes;
      total += splits[p];
    }
    TORCH_CHECK(total == rows, "braid: all_to_all_single: ", what, " split sizes sum to ", total,
                " but dim 0 is ", rows);
  }
  for (int p = 1; p < size; ++p) (*displs)[p] = (*displs)[p - 1] + (*counts)[p - 1];
}

}  // namespace

// ---- BraidWork ----

void* cuda_stream_handle(const c10::Stream& stream) {
#if BRAID_TORCH_AT_LEAST(2, 11)
  return stream.native_handle();
#else
  using StreamOf = void* (*)(const c10::Stream*);  // the member function, `this` first
  static const StreamOf stream_of = []() -> StreamOf {
    void* lib = dlopen("libc10_cuda.so", RTLD_LAZY | RTLD_NOLOAD);
    return lib == nullptr ? nullptr
                          : reinterpret_cast<StreamOf>(dlsym(lib, "_ZNK3c104cuda10CUDAStream6streamEv"));
  }();
  TORCH_CHECK(
      stream_of != nullptr,
      "braid: cannot read the CUDA stream's handle: c10::cuda::CUDAStream::stream() is not in a loaded "
      "libc10_cuda.so (torch ",
      TORCH_VERSION, " without CUDA?)");
  return stream_of(&stream);
#endif
}

// The current stream of a CUDA device, through the device-generic guard
// torch registers for CUDA (no CUDA headers or libraries needed here).
c10::Stream current_stream(c10::Device device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

BraidWork::BraidWork(int rank, c10d::OpType type, std::string what, std::vector<at::Tensor> outputs,
                     c10::Device device, braid_comm_t comm)
    : c10d::Work(rank, type),
      what_(std::move(what)),
      outputs_(std::move(outputs)),
      device_(device),
      comm_(comm),
      future_(device.is_cuda() ? c10::make_intrusive<c10::ivalue::Future>(tensor_list_type(),
                                                                          std::vector<c10::Device>{device})
                               : c10::make_intrusive<c10::ivalue::Future>(tensor_list_type())) {
  if (device.is_cuda()) {
    stream = cuda_stream_handle(current_stream(device));
    // torch's default stream is the legacy default stream, whose handle is
    // NULL, which braid reads as host-ordered: name it as CU_STREAM_LEGACY
    // (cudaStreamLegacy) instead, the same stream to the driver.
    if (stream == nullptr) stream = reinterpret_cast<braid_stream_t>(0x1);
  }
}

void BraidWork::copy_out() {
  if (!on_success) return;
  // Raw data, as gloo and NCCL write it: autograd refuses an in-place copy
  // into a view of a leaf that requires grad.
  at::NoGradGuard no_grad;
  on_success();
}

void BraidWork::complete_enqueued() {
  // The copies out go on the stream behind braid's op, in order.
  copy_out();
  const c10::Stream s = current_stream(device_);
  // Tensors allocated on another stream and freed by the caller now are
  // not reused before this stream got past the op (as recordStream does).
  const c10::impl::VirtualGuardImpl impl(device_.type());
  for (const std::vector<at::Tensor>* list : {&keep_alive, &outputs_})
    for (const at::Tensor& t : *list)
      if (t.defined() && t.device() == device_) impl.recordDataPtrOnStream(t.storage().data_ptr(), s);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    event_.emplace(device_.type());
    event_->record(s);
    finishing_ = true;
    keep_alive.clear();  // freed to the stream's pool: reused behind braid's op only
    on_success = nullptr;
  }
  // A CUDA future: it records the stream's state, and waiters sync with it.
  // Complete before the work, as in finalize().
  future_->markCompleted(c10::IValue(outputs_));
  mark_completed();
}

BraidWork::~BraidWork() {
  for (braid_request_t r : requests_) braid_request_free(r);
}

void BraidWork::track(std::vector<braid_request_t> requests, const std::shared_ptr<CompletionQueue>& queue) {
  // braid drives a small operation to its end while posting it when the
  // peers are ready: such requests finish here, on the caller's thread,
  // without a trip through the completion thread.
  std::vector<braid_request_t> pending;
  for (braid_request_t r : requests) {
    int done = 0;
    braid_result_t code = braid_test(&r, &done);
    if (!done) {
      pending.push_back(r);
    } else if (code != BRAID_SUCCESS) {
      record_error(code, braid_get_last_error());
    }
  }
  requests = std::move(pending);
  {
    std::lock_guard<std::mutex> lock(requests_mu_);
    requests_ = requests;
  }
  remaining_.store(static_cast<int>(requests.size()));
  if (requests.empty()) {
    finalize();
    return;
  }
  for (braid_request_t r : requests) {
    auto* slot = new CallbackSlot{c10::intrusive_ptr<BraidWork>::reclaim_copy(this), queue};
    if (braid_request_set_callback(r, &CompletionQueue::on_request_done, slot) != BRAID_SUCCESS) {
      // Only a bug can get here (the request is fresh and ours).
      record_error(BRAID_ERR_INTERNAL, braid_get_last_error());
      delete slot;
      if (remaining_.fetch_sub(1) == 1) queue->push(c10::intrusive_ptr<BraidWork>::reclaim_copy(this));
    }
  }
}

void BraidWork::record_error(braid_result_t code, const std::string& message) {
  std::lock_guard<std::mutex> lock(error_mu_);
  if (error_code_ == BRAID_SUCCESS) {
    error_code_ = code;
    error_message_ = message;
  }
}

void BraidWork::finalize() {
  std::vector<braid_request_t> leftover;
  {
    std::lock_guard<std::mutex> lock(requests_mu_);
    leftover.swap(requests_);
  }
  for (braid_request_t r : leftover) braid_request_free(r);
  std::string message;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (completed_) return;
    if (finishing_) {
      // Another thread completes it: back once it did, as wait() promises.
      cv_.wait(lock, [&] { return completed_; });
      return;
    }
    finishing_ = true;
    std::lock_guard<std::mutex> elock(error_mu_);
    if (error_code_ != BRAID_SUCCESS)
      message =
          "braid: " + what_ + " failed (" + braid_get_error_string(error_code_) + "): " + error_message_;
  }
  // Outside mutex_ (finishing_ keeps every other thread off these members):
  // a barrier's copy-out waits for the works before it, whose Future
  // callbacks may need the GIL, which a thread polling isCompleted() holds
  // while it takes mutex_.
  if (message.empty() && on_success) {
    try {
      copy_out();
    } catch (const std::exception& e) {
      message = "braid: " + what_ + ": copying the result out failed: " + e.what();
    }
  }
  std::exception_ptr failure;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!message.empty()) exception_ = backend_error(message);
    failure = exception_;
    keep_alive.clear();
    on_success = nullptr;
  }
  // The Future first, then the work (as gloo's do): whoever sees the work
  // completed may ask for the Future's value.
  if (failure)
    future_->setError(failure);
  else
    future_->markCompleted(c10::IValue(outputs_));
  mark_completed();
}

void BraidWork::mark_completed() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    completed_ = true;
  }
  cv_.notify_all();
}

bool BraidWork::isCompleted() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Stream-ordered: done once the device ran it, as NCCL's works report.
  if (event_) return completed_ && event_->query();
  return completed_;
}

bool BraidWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ && !exception_;
}

bool BraidWork::wait(std::chrono::milliseconds timeout) {
  if (deferred.load()) return true;
  if (stream != nullptr) {
    // The caller's current stream waits for the op on the device; the CPU
    // does not, unless given a timeout: then, as with NCCL, it waits for
    // the device to finish the op, and a late one is an error. A failure
    // seen so far breaks the communicator: report it.
    {
      // No event: the op never reached the stream (its group failed at
      // endCoalescing), and the work failed.
      std::unique_lock<std::mutex> lock(mutex_);
      if (!event_) {
        cv_.wait(lock, [&] { return completed_; });
        if (exception_) std::rethrow_exception(exception_);
        return true;
      }
    }
    event_->block(current_stream(device_));
    if (timeout != kNoTimeout) {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      while (!event_->query()) {
        if (std::chrono::steady_clock::now() >= deadline)
          C10_THROW_ERROR(DistBackendError,
                          "braid: " + what_ + " did not complete on the device within the wait timeout of " +
                              std::to_string(timeout.count()) + " ms");
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    braid_result_t async = BRAID_SUCCESS;
    if (braid_comm_get_async_error(comm_, &async) != BRAID_SUCCESS) {
      // The handle names no communicator: the group was aborted or shut
      // down, and every op it had ended (destroy drains, abort fails them).
      // What this one's request said reaches finalize() through the
      // completion thread; asking the handle would report nothing.
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait_for(lock, std::chrono::seconds(10), [&] { return completed_; });
      if (exception_) std::rethrow_exception(exception_);
      if (completed_) return true;
      C10_THROW_ERROR(
          DistBackendError,
          "braid: " + what_ + ": the process group was aborted or shut down before the op finished");
    }
    if (async != BRAID_SUCCESS)
      C10_THROW_ERROR(DistBackendError, "braid: " + what_ + ": the communicator failed (" +
                                            braid_get_error_string(async) +
                                            "): " + braid_comm_get_last_error(comm_));
    return true;
  }
  if (timeout == kNoTimeout) {
    // Drive braid on this thread: the quickest way to the result.
    waiter_.store(true);
    std::vector<braid_request_t> mine;
    {
      std::lock_guard<std::mutex> lock(requests_mu_);
      mine.swap(requests_);
    }
    if (!mine.empty()) {
      for (braid_request_t& r : mine) {
        braid_result_t code = braid_wait(&r);
        if (code != BRAID_SUCCESS) record_error(code, braid_get_last_error());
      }
      // The callbacks may not have run yet; whoever comes first finalizes.
      finalize();
    } else {
      // Another waiter drives, or the work already finished.
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return completed_; });
    }
  } else {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!cv_.wait_for(lock, timeout, [&] { return completed_; }))
      C10_THROW_ERROR(DistBackendError, "braid: " + what_ + " did not complete within the wait timeout of " +
                                            std::to_string(timeout.count()) + " ms");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

void BraidWork::abort() {
  TORCH_CHECK(false, "braid: aborting one Work is not supported; abort the process group instead");
}

// ---- CompletionQueue ----

CompletionQueue::CompletionQueue() {
  std::lock_guard<std::mutex> lock(mu_);
  threads_.emplace_back([this] { loop(); });
}

namespace {
// Set on a queue's own thread when the queue was destroyed there: loop()
// then returns without touching the freed object.
thread_local bool t_queue_destroyed = false;
}  // namespace

CompletionQueue::~CompletionQueue() {
  // The others finish what is queued and leave. The last reference to the
  // process group may be dropped on a queue thread (a future's callback held
  // it): that one cannot join itself, and leaves once it returns here.
  std::thread self;
  std::vector<std::thread> others;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    for (std::thread& t : threads_) {
      if (t.get_id() == std::this_thread::get_id())
        self = std::move(t);
      else
        others.push_back(std::move(t));
    }
  }
  cv_.notify_all();
  for (std::thread& t : others) t.join();
  if (self.joinable()) {
    std::deque<c10::intrusive_ptr<BraidWork>> left;
    {
      std::lock_guard<std::mutex> lock(mu_);
      left.swap(queue_);
    }
    for (auto& work : left) work->finalize();
    t_queue_destroyed = true;
    self.detach();
  }
}

void CompletionQueue::add_worker_if_needed() {
  // Completing a work runs its Future's callbacks, which may wait for
  // another work's Future (torch's PowerSGD hook does): that one must not
  // queue behind it. Whatever is queued has an idle thread or a new one.
  if (!queue_.empty() && idle_ == 0 && !stop_ && threads_.size() < kMaxWorkers)
    threads_.emplace_back([this] { loop(); });
}

void CompletionQueue::push(c10::intrusive_ptr<BraidWork> work) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(work));
    add_worker_if_needed();
  }
  cv_.notify_one();
}

void CompletionQueue::on_request_done(void* user, braid_result_t result, const char* message) {
  auto* slot = static_cast<CallbackSlot*>(user);
  if (result != BRAID_SUCCESS) slot->work->record_error(result, message);
  if (slot->work->remaining_.fetch_sub(1) == 1 && !slot->work->waiter_.load())
    slot->queue->push(std::move(slot->work));
  delete slot;
}

void CompletionQueue::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    --idle_;
    if (queue_.empty()) return;  // stop, and everything delivered
    auto work = std::move(queue_.front());
    queue_.pop_front();
    add_worker_if_needed();
    lock.unlock();
    work->finalize();
    work.reset();  // may destroy this queue (see the destructor)
    if (t_queue_destroyed) return;
    lock.lock();
  }
}

// ---- BraidBackend ----

namespace {
// The process group coalescing on this thread, if any (braid's group is
// per thread and spans every communicator).
thread_local BraidBackend* t_coalescing = nullptr;
}  // namespace

BraidBackend::BraidBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           std::chrono::milliseconds timeout, std::string group_name)
    : c10d::Backend(rank, size), group_name_(std::move(group_name)), timeout_(timeout) {
  const std::string key = "braid/unique_id";
  braid_unique_id_t id;
  if (rank == 0) {
    check(braid_get_unique_id(&id), "init (making the unique id)");
    store->set(key, std::vector<uint8_t>(id.internal, id.internal + sizeof(id.internal)));
  } else {
    std::vector<uint8_t> bytes = store->get(key);
    TORCH_CHECK(bytes.size() == sizeof(id.internal), "braid: the store holds a unique id of ", bytes.size(),
                " bytes under '", key, "', expected ", sizeof(id.internal));
    std::memcpy(id.internal, bytes.data(), bytes.size());
  }
  braid_comm_t comm = nullptr;
  check(braid_comm_init_rank(&comm, size, id, rank), "init");
  comm_.store(comm);
  // Every rank has read the id once init is through (each joined with its
  // token). Removing it keeps a later group on the same store from reading
  // this one's: torchrun's static rendezvous hands a restarted job the same
  // store and prefixes, and a rank that read the dead job's id would wait
  // out the timeout connecting to it. A store that cannot delete keeps it.
  if (rank == 0) {
    try {
      store->deleteKey(key);
    } catch (const std::exception&) {
    }
  }
  setTimeout(timeout);
}

BraidBackend::~BraidBackend() {
  if (t_coalescing == this) t_coalescing = nullptr;
  shutdown();
}

std::string BraidBackend::describe() const {
  return "group '" + group_name_ + "', rank " + std::to_string(rank_) + " of " + std::to_string(size_);
}

void BraidBackend::fail_call(const char* op, braid_result_t code) const {
  fail_call(op, code, braid_get_last_error());
}

void BraidBackend::fail_call(const char* op, braid_result_t code, const std::string& why) const {
  C10_THROW_ERROR(DistBackendError, std::string("braid: ") + op + " (" + describe() + ") failed (" +
                                        braid_get_error_string(code) + "): " + why);
}

void BraidBackend::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  TORCH_CHECK(comm_ != nullptr, "braid: the process group was shut down");
  double seconds = timeout.count() > 0 ? static_cast<double>(timeout.count()) / 1000.0 : 1e9;
  check(braid_comm_set_timeout(comm_, std::min(seconds, 1e9)), "set_timeout");
}

#if BRAID_TORCH_HAS_ERROR_TYPE
c10d::ErrorType BraidBackend::getError() {
  const braid_comm_t comm = comm_.load();
  if (comm == nullptr) return aborted_.load() ? c10d::ErrorType::COMM_ERROR : c10d::ErrorType::SUCCESS;
  braid_result_t err = BRAID_SUCCESS;
  if (braid_comm_get_async_error(comm, &err) != BRAID_SUCCESS) err = BRAID_ERR_ABORTED;  // aborted meanwhile
  switch (err) {
    case BRAID_SUCCESS:
      return c10d::ErrorType::SUCCESS;
    case BRAID_ERR_TIMEOUT:
      return c10d::ErrorType::TIMEOUT;
    case BRAID_ERR_REMOTE:
      return c10d::ErrorType::REMOTE_ERROR;
    default:
      return c10d::ErrorType::COMM_ERROR;
  }
}
#endif

void BraidBackend::abort() {
  aborted_.store(true);
  if (braid_comm_t comm = comm_.exchange(nullptr)) braid_comm_abort(comm);
}

std::string BraidBackend::close_comm() {
  braid_comm_t comm = comm_.exchange(nullptr);
  if (comm == nullptr) return "";
  if (barrier_failed_.load()) {
    braid_comm_abort(comm);
    return "";
  }
  // The ranks' last calls did not match (braid.h): wrong data was returned
  // and nothing after it could say so; gloo's root would time out instead.
  if (braid_comm_destroy(comm) == BRAID_ERR_MISMATCH)
    return "destroying the process group (" + describe() + "): " + braid_get_last_error() +
           " (braid_torch passes tensors as bytes: counts are in bytes)";
  return "";
}

// Warns, not raises: destroy_process_group shuts groups down in a loop and
// clears its records after it, so a raise here left torch half torn down
// (is_initialized() true, init_process_group refused, other groups alive).
void BraidBackend::shutdown() {
  if (std::string why = close_comm(); !why.empty()) TORCH_WARN("braid: ", why);
}

c10::intrusive_ptr<BraidWork> BraidBackend::make_work(c10d::OpType type, const char* op,
                                                      std::vector<at::Tensor> outputs, c10::Device device) {
  TORCH_CHECK(comm_ != nullptr, "braid: ", op, " on a process group that was shut down or aborted");
  if (!c10d::isP2POp(type)) seq_.fetch_add(1);
  return c10::make_intrusive<BraidWork>(rank_, type, std::string(op) + " (" + describe() + ")",
                                        std::move(outputs), device, comm_);
}

c10::intrusive_ptr<c10d::Work> BraidBackend::launch(const c10::intrusive_ptr<BraidWork>& work,
                                                    const StartFn& start, bool grouped, bool blocking) {
  // Stream-ordered calls return once enqueued: their blocking form is
  // enough, and nothing is left to track.
  if (work->stream != nullptr) blocking = true;
  if (t_coalescing != nullptr && t_coalescing != this) {
    // Another group's coalescing on this thread holds braid's group open:
    // this op would join it and start only at that group's end, after this
    // call returned. Refused; and that coalescing is ended (its ops start),
    // as torch will not end it once this exception leaves its block.
    t_coalescing->end_coalescing(true);
    TORCH_CHECK(false, "braid: ", work->what(),
                " was called while another process group coalesces on this thread (inside its "
                "_coalescing_manager or batch_isend_irecv); call it outside that block, or on that group");
  }
  // braid finds the context of the legacy default stream as the calling
  // thread's current one: the tensors' device's.
  c10::OptionalDeviceGuard device_guard;
  if (work->stream != nullptr) device_guard.reset_device(work->device());
  std::vector<braid_request_t> requests;
  // A host-ordered call torch waits for at once (asyncOp=false) is posted
  // under the lock, in this rank's order, but waited for after it: another
  // thread's send must get posted meanwhile (its receiver may be what this
  // collective waits for). This thread drives braid while it waits.
  const bool wait_here = blocking && work->stream == nullptr;
  {
    std::unique_lock<std::mutex> lock = c10d::isP2POp(work->retrieveOpType())
                                            ? std::unique_lock<std::mutex>(launch_mu_)
                                            : lock_for_collective();
    // Inside torch's coalescing the calls join the open braid group and
    // start at endCoalescing: their requests are kept until then.
    const bool deferred = coalescing_thread_.load() == std::this_thread::get_id();
    if (grouped) braid_group_start();
    try {
      start(requests, work->stream != nullptr);
    } catch (...) {
      if (grouped) braid_group_end();
      for (braid_request_t r : requests) braid_request_free(r);
      throw;
    }
    if (grouped) {
      braid_result_t code = braid_group_end();
      if (code != BRAID_SUCCESS) {
        for (braid_request_t r : requests) braid_request_free(r);
        fail_call(work->what().c_str(), code);
      }
    }
    if (deferred) {
      work->deferred.store(true);
      coalesced_.push_back({work, std::move(requests)});
      return work;
    }
    if (work->stream != nullptr) {
      // An i-form some op calls directly: the op completes on its own. The
      // copies out are enqueued under the lock, right behind the op, before
      // another thread's op on the same stream.
      for (braid_request_t r : requests) braid_request_free(r);
      work->complete_enqueued();
      return work;
    }
  }
  if (wait_here) {
    for (braid_request_t& r : requests) {
      const braid_result_t code = braid_wait(&r);
      if (code != BRAID_SUCCESS) work->record_error(code, braid_get_last_error());
    }
    work->finalize();
    return work;
  }
  work->track(std::move(requests), completions_);
  register_pending(work);
  return work;
}

void BraidBackend::register_pending(const c10::intrusive_ptr<BraidWork>& work) {
  const c10d::OpType type = work->retrieveOpType();
  if (!work->isCompleted()) {
    auto add = [&](std::vector<c10::weak_intrusive_ptr<BraidWork>>* list) {
      if (list->size() >= 64)  // the finished ones go
        list->erase(std::remove_if(list->begin(), list->end(),
                                   [](const c10::weak_intrusive_ptr<BraidWork>& w) {
                                     auto p = w.lock();
                                     return !p || p->isCompleted();
                                   }),
                    list->end());
      list->emplace_back(work);
    };
    std::lock_guard<std::mutex> lock(inflight_mu_);
    add(&tracked_);
    if (!c10d::isP2POp(type) && type != c10d::OpType::BARRIER) add(&inflight_);
  }
}

std::unique_lock<std::mutex> BraidBackend::lock_for_collective() {
  std::unique_lock<std::mutex> lock(launch_mu_);
  sparse_phases_cv_.wait(lock, [&] { return !sparse_between_phases_; });
  return lock;
}

bool BraidBackend::end_if_pending() {
  std::vector<c10::intrusive_ptr<BraidWork>> pending;
  {
    std::lock_guard<std::mutex> lock(inflight_mu_);
    for (const auto& w : tracked_)
      if (auto p = w.lock(); p && !p->isCompleted()) pending.push_back(std::move(p));
  }
  if (pending.empty() || comm_.load() == nullptr) return false;
  abort();
  // Every pending request fails now; wait() completes its work here, or
  // waits for the completion thread that already took it.
  for (auto& work : pending) {
    try {
      work->wait();
    } catch (const std::exception&) {
    }
  }
  return true;
}

void BraidBackend::startCoalescing() {
  std::unique_lock<std::mutex> lock = lock_for_collective();
  TORCH_CHECK(coalescing_thread_.load() == std::thread::id(), "braid: startCoalescing (", describe(),
              ") while an earlier coalescing has not ended (one at a time per process group)");
  TORCH_CHECK(comm_ != nullptr, "braid: startCoalescing on a process group that was shut down or aborted");
  TORCH_CHECK(t_coalescing == nullptr, "braid: startCoalescing (", describe(),
              ") while another process group coalesces on this thread (one at a time per thread: braid's "
              "group spans the thread)");
  braid_group_start();
  coalescing_thread_.store(std::this_thread::get_id());
  t_coalescing = this;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> BraidBackend::endCoalescing() {
  std::vector<c10::intrusive_ptr<BraidWork>> parts = end_coalescing(false);
  const c10::Device device = parts.empty() ? c10::Device(c10::kCPU) : parts.front()->device();
  return c10::make_intrusive<CoalescedWork>(rank_, std::move(parts), device);
}

std::vector<c10::intrusive_ptr<BraidWork>> BraidBackend::end_coalescing(bool abandon) {
  std::vector<Deferred> deferred;
  braid_result_t code = BRAID_SUCCESS;
  std::string message;
  {
    std::lock_guard<std::mutex> lock(launch_mu_);
    if (coalescing_thread_.load() != std::this_thread::get_id()) {
      if (abandon) return {};
      TORCH_CHECK(false, "braid: endCoalescing (", describe(), ") without a startCoalescing on this thread");
    }
    coalescing_thread_.store(std::thread::id());
    t_coalescing = nullptr;
    deferred.swap(coalesced_);
    // braid enqueues stream-ordered calls here, on the legacy default
    // stream of the current device: the tensors' (as launch() sets it).
    c10::OptionalDeviceGuard device_guard;
    for (const Deferred& d : deferred)
      if (d.work->stream != nullptr) {
        device_guard.reset_device(d.work->device());
        break;
      }
    code = braid_group_end();
    if (code != BRAID_SUCCESS) message = braid_get_last_error();
    // Stream-ordered works: braid enqueued the group's ops just now; the
    // copies out go behind them, under the lock like any launch.
    for (Deferred& d : deferred) {
      if (d.work->stream == nullptr) continue;
      d.work->deferred.store(false);
      for (braid_request_t r : d.requests) braid_request_free(r);
      d.requests.clear();
      if (code != BRAID_SUCCESS) {
        d.work->record_error(code, message);
        d.work->finalize();
      } else {
        d.work->complete_enqueued();
      }
    }
  }
  std::vector<c10::intrusive_ptr<BraidWork>> parts;
  for (Deferred& d : deferred) {
    // A failed group failed the ops it started: their requests say so.
    if (d.work->stream == nullptr) {
      d.work->track(std::move(d.requests), completions_);
      // Deferred until armed: a wait() from another thread in between
      // would find no request to drive, and the callbacks, seeing it
      // waiting, would leave the work to it.
      d.work->deferred.store(false);
      register_pending(d.work);
    }
    parts.push_back(d.work);
  }
  if (code != BRAID_SUCCESS && !abandon)
    C10_THROW_ERROR(DistBackendError, "braid: the coalesced operations (" + describe() + ") failed (" +
                                          braid_get_error_string(code) + "): " + message);
  return parts;
}

// ---- CoalescedWork ----

CoalescedWork::CoalescedWork(int rank, std::vector<c10::intrusive_ptr<BraidWork>> parts, c10::Device device)
    : c10d::Work(rank, c10d::OpType::COALESCED),
      parts_(std::move(parts)),
      future_(device.is_cuda() ? c10::make_intrusive<c10::ivalue::Future>(tensor_list_type(),
                                                                          std::vector<c10::Device>{device})
                               : c10::make_intrusive<c10::ivalue::Future>(tensor_list_type())) {
  for (const auto& p : parts_)
    for (const at::Tensor& t : p->result()) outputs_.push_back(t);
  if (parts_.empty()) {
    future_->markCompleted(c10::IValue(outputs_));
    return;
  }
  // Completes once every part's future has, with the first error if any.
  auto left = std::make_shared<std::atomic<size_t>>(parts_.size());
  auto failure = std::make_shared<std::pair<std::mutex, std::exception_ptr>>();
  c10::intrusive_ptr<c10::ivalue::Future> all = future_;
  std::vector<at::Tensor> outputs = outputs_;
  for (const auto& p : parts_) {
    p->getFuture()->addCallback([left, failure, all, outputs](c10::ivalue::Future& part) {
      if (part.hasError()) {
        std::lock_guard<std::mutex> lock(failure->first);
        if (!failure->second) failure->second = part.exception_ptr();
      }
      if (left->fetch_sub(1) != 1) return;
      if (failure->second)
        all->setError(failure->second);
      else
        all->markCompleted(c10::IValue(outputs));
    });
  }
}

bool CoalescedWork::isCompleted() {
  for (const auto& p : parts_)
    if (!p->isCompleted()) return false;
  return true;
}

bool CoalescedWork::isSuccess() const {
  for (const auto& p : parts_)
    if (!p->isSuccess()) return false;
  return true;
}

bool CoalescedWork::wait(std::chrono::milliseconds timeout) {
  // One deadline for all parts, as the caller asked for the whole.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (const auto& p : parts_) {
    if (timeout == kNoTimeout) {
      p->wait();
    } else {
      // At least 1 ms: 0 would mean no timeout at all (kNoTimeout).
      auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      p->wait(std::max(left, std::chrono::milliseconds(1)));
    }
  }
  return true;
}

// ---- operations ----

c10::intrusive_ptr<c10d::Work> BraidBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                       const c10d::BroadcastOptions& opts) {
  CoalescingGuard guard(this);
  check_single(tensors, "broadcast");
  at::Tensor t = tensors[0], buf = staged(t);
  auto work = make_work(c10d::OpType::BROADCAST, "broadcast", {t}, t.device());
  work->keep_alive = {buf};
  if (!buf.is_same(t)) work->on_success = [t, buf]() mutable { t.copy_(buf); };
  const int root = static_cast<int>(opts.rootRank);
  return launch(
      work,
      [&](std::vector<braid_request_t>& reqs, bool blocking) {
        braid_request_t r = nullptr;
        check(braid_ibroadcast(buf.data_ptr(), buf.data_ptr(), nbytes(buf), BRAID_UINT8, root, comm_,
                               work->stream, &r),
              "broadcast");
        reqs.push_back(r);
      },
      false, waited_at_once(opts));
}

c10::intrusive_ptr<c10d::Work> BraidBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceOptions& opts) {
  CoalescingGuard guard(this);
  if (tensors.size() == 1 && tensors[0].layout() == c10::kSparse) return sparse_allreduce(tensors[0], opts);
  check_single(tensors, "all_reduce");
  at::Tensor t = tensors[0];
  Reduction red = reduction_for(t, opts.reduceOp, "all_reduce");
  at::Tensor buf = reduction_buffer(t, red);
  auto work = make_work(c10d::OpType::ALLREDUCE, "all_reduce", {t}, t.device());
  work->keep_alive = {buf};
  if (!buf.is_same(t)) work->on_success = [t, buf]() mutable { t.copy_(buf); };
  return launch(
      work,
      [&](std::vector<braid_request_t>& reqs, bool blocking) {
        BRAID_START(all_reduce, "all_reduce", buf.data_ptr(), buf.data_ptr(), buf.numel() * red.per_element,
                    red.dtype, red.op, comm_, work->stream);
      },
      false, waited_at_once(opts));
}

// Sparse COO sum: every rank's (indices, values) gathered, padded to the
// largest nnz, then summed by coalescing. It completes before returning.
c10::intrusive_ptr<c10d::Work> BraidBackend::sparse_allreduce(at::Tensor t,
                                                              const c10d::AllreduceOptions& opts) {
  // Its steps wait for each other: it cannot join a coalescing's group.
  TORCH_CHECK(
      coalescing_thread_.load() != std::this_thread::get_id(),
      "braid: all_reduce of a sparse tensor inside a coalescing (_coalescing_manager) is not supported");
  const char* name = "all_reduce (sparse)";
  TORCH_CHECK(t.device().is_cpu(), "braid: ", name, " got a tensor on ", t.device(), "; CPU tensors only");
  TORCH_CHECK(opts.reduceOp.op_ == c10d::ReduceOp::SUM, "braid: ", name, " supports SUM only");
  auto work = make_work(c10d::OpType::ALLREDUCE, name, {t});
  at::Tensor in = t.coalesce();
  at::Tensor idx = in.indices().contiguous(), val = in.values().contiguous();
  std::unique_lock<std::mutex> lock = lock_for_collective();
  int64_t nnz = in._nnz();
  std::vector<int64_t> counts(size_);
  {
    // The first phase is waited for outside the lock, which holds other
    // collectives back until the second has started (see
    // sparse_between_phases_).
    braid_request_t req = nullptr;
    check(braid_iall_gather(&nnz, counts.data(), 1, BRAID_INT64, comm_, nullptr, &req), name);
    sparse_between_phases_ = true;
    lock.unlock();
    const braid_result_t code = braid_wait(&req);
    lock.lock();
    sparse_between_phases_ = false;
    sparse_phases_cv_.notify_all();
    check(code, name);
  }
  const int64_t most = *std::max_element(counts.begin(), counts.end());
  std::vector<int64_t> val_shape = val.sizes().vec();
  val_shape[0] = most;
  at::Tensor idx_pad = at::zeros({idx.size(0), most}, idx.options()),
             val_pad = at::zeros(val_shape, val.options());
  idx_pad.narrow(1, 0, nnz).copy_(idx);
  val_pad.narrow(0, 0, nnz).copy_(val);
  std::vector<int64_t> all_val_shape = {size_};
  all_val_shape.insert(all_val_shape.end(), val_shape.begin(), val_shape.end());
  at::Tensor idx_all = at::empty({size_, idx.size(0), most}, idx.options()),
             val_all = at::empty(all_val_shape, val.options());
  // The first failure of the second phase, with its message (later calls
  // overwrite the thread's last error).
  braid_result_t failed = BRAID_SUCCESS;
  std::string why;
  auto note = [&](braid_result_t code) {
    if (code != BRAID_SUCCESS && failed == BRAID_SUCCESS) {
      failed = code;
      why = braid_get_last_error();
    }
  };
  braid_request_t reqs[2] = {nullptr, nullptr};
  braid_group_start();
  note(braid_iall_gather(idx_pad.data_ptr(), idx_all.data_ptr(), nbytes(idx_pad), BRAID_UINT8, comm_, nullptr,
                         &reqs[0]));
  note(braid_iall_gather(val_pad.data_ptr(), val_all.data_ptr(), nbytes(val_pad), BRAID_UINT8, comm_, nullptr,
                         &reqs[1]));
  note(braid_group_end());
  lock.unlock();  // the second phase is waited for outside it too
  for (braid_request_t& r : reqs)
    if (r != nullptr)
      note(braid_wait(&r));  // each, even after a failure: they write into idx_all and val_all
  if (failed != BRAID_SUCCESS) fail_call(name, failed, why);
  std::vector<at::Tensor> idx_parts, val_parts;
  for (int r = 0; r < size_; ++r) {
    idx_parts.push_back(idx_all[r].narrow(1, 0, counts[r]));
    val_parts.push_back(val_all[r].narrow(0, 0, counts[r]));
  }
  at::Tensor sum = at::sparse_coo_tensor(at::cat(idx_parts, 1), at::cat(val_parts, 0), in.sizes()).coalesce();
  work->on_success = [t, sum]() mutable { t.copy_(sum); };
  work->track({}, completions_);
  return work;
}

c10::intrusive_ptr<c10d::Work> BraidBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  CoalescingGuard guard(this);
  TORCH_CHECK(!tensors.empty(), "braid: all_reduce_coalesced needs at least one tensor");
  for (auto& t : tensors) check_same(tensors[0], t, "all_reduce_coalesced", "a tensor", "the first tensor");
  Reduction red = reduction_for(tensors[0], opts.reduceOp, "all_reduce_coalesced");
  // One reduction over the tensors packed end to end.
  std::vector<at::Tensor> flat_parts;
  for (auto& t : tensors)
    flat_parts.push_back(red.has_premul ? t.mul(red.premul).reshape(-1) : t.reshape(-1));
  at::Tensor flat = at::cat(flat_parts);
  auto work =
      make_work(c10d::OpType::ALLREDUCE_COALESCED, "all_reduce_coalesced", tensors, tensors[0].device());
  work->keep_alive = {flat};
  std::vector<at::Tensor> outs = tensors;
  work->on_success = [outs, flat]() mutable { copy_slices(flat, outs); };
  return launch(
      work,
      [&](std::vector<braid_request_t>& reqs, bool blocking) {
        BRAID_START(all_reduce, "all_reduce_coalesced", flat.data_ptr(), flat.data_ptr(),
                    flat.numel() * red.per_element, red.dtype, red.op, comm_, work->stream);
      },
      false, waited_at_once(opts));
}

c10::intrusive_ptr<c10d::Work> BraidBackend::reduce(std::vector<at::Tensor>& tensors,
                                                    const c10d::ReduceOptions& opts) {
  CoalescingGuard guard(this);
  check_single(tensors, "reduce");
  at::Tensor t = tensors[0];
  Reduction red = reduction_for(t, opts.reduceOp, "reduce");
  at::Tensor buf = reduction_buffer(t, red);
  const int root = static_cast<int>(opts.rootRank);
  auto work = make_work(c10d::OpType::REDUCE, "reduce", {t}, t.device());
  work->keep_alive = {buf};
  if (!buf.is_same(t) && root == rank_) work->on_success = [t, buf]() mutable { t.copy_(buf); };
  return launch(
      work,
      [&](std::vector<braid_request_t>& reqs, bool blocking) {
        BRAID_START(reduce, "reduce", buf.data_ptr(), buf.data_ptr(), buf.numel() * red.per_element,
                    red.dtype, red.op, root, comm_, work->stream);
      },
      false, waited_at_once(opts));
}

c10::intrusive_ptr<c10d::Work> BraidBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::AllgatherOptions& opts) {
  CoalescingGuard guard(this);
  check_single(inputs, "all_gather");
  TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_, "braid: all_gather needs ",
              size_, " output tensors (one per rank)");
  at::Tensor in = staged(inputs[0]);
  bool uneven = false;
  for (auto& o : outputs[0]) {
    check_same(in, o, "all_gather", "an output");
    uneven |= o.numel() != in.numel();
  }
  if (uneven) return allgather_uneven(outputs[0], in, opts);
  const int64_t n = in.numel();
  at::Tensor flat = at::empty({size_ * n}, in.options());
  auto work = make_work(c10d::OpType::ALLGATHER, "all_gather", outputs[0], in.device());
  work->keep_alive = {in, flat};
  std::vector<at::Tensor> outs = outputs[0];
  work->on_success = [outs, flat]() mutable { copy_slices(flat, outs); };
  return launch(
      work,
      [&](std::vector<braid_request_t>& reqs, bool blocking) {
        BRAID_START(all_gather, "all_gather", in.data_ptr(), flat.data_ptr(), nbytes(in), BRAID_UINT8, comm_,
                    work->stream);
      },
      false, waited_at_once(opts));
}

// Outputs of different sizes (torch allows them, NCCL runs broadcasts):
// one broadcast per rank, rooted there, all in one braid group. This rank's
// own output must match its input; each other rank's size is checked by
// braid against what that rank sends (a mismatch error names both calls).
c10::intrusive_ptr<c10d::Work> BraidBackend::allgather_uneven(std::vector<at::Tensor>& outputs,
                                                              const at::Tensor& in,
                                                              const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs[rank_].numel() == in.numel(), "braid: all_gather: output ", rank_,
              " (this rank's) has ", outputs[rank_].numel(), " elements but the input has ", in.numel());
  std::vector<at::Tensor> bufs;
  for (const at::Tensor& o : outputs) bufs.push_back(staged(o));
  auto work = make_work(c10d::OpType::ALLGATHER, "all_gather", outputs, in.device());
  work->keep_alive = bufs;
  work->keep_alive.push_back(in);
  work->on_success = copy_back(outputs, bufs);
  return launch(
      work,
      [&](std::vector<braid_request_t>& reqs, bool blocking) {
        for (int r = 0; r < size_; ++r) {
          const void* src = r == rank_ ? in.data_ptr() : bufs[r].data_ptr();
          BRAID_START(broadcast, "all_gather", src, bufs[r].data_ptr(), nbytes(bufs[r]), BRAID_UINT8, r,
                      comm_, work->stream);
        }
      },
      true, waited_at_once(opts));
}

c10::intrusive_ptr<c10d::Work> BraidBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                             const c10d::AllgatherOptions& opts) {
  CoalescingGuard guard(this);
  check_tensor(input, "all_gather_into_tensor");
  check_same(input, output, "all_gather_into_tensor", "the output");
  TORCH_CHECK(output.numel() == input.numel() * size_, "braid: all_gather_into_tensor: the output has ",
              output.numel(), " elements, expected ", size_, " x ", input.numel());
  at::Tensor in = staged(input), out = staged(output);
  auto work = make_work(c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor", {output}, input.device());
  work->keep_alive = {in, out};
  if (!out.is_same(output)) work->on_success = [output, out]() mutable { output.copy_(out); };
  return launch(
      work,
      [&](std::vector<braid_request_t>& reqs, bool blocking) {
        BRAID_START(all_gather, "all_gather_into_tensor", in.data_ptr(), out.data_ptr(), nbytes(in),
                    BRAID_UINT8, comm_, work->stream);
      },
      false, waited_at_once(opts));
}

c10::intrusive_ptr<c10d::Work> BraidBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  CoalescingGuard guard(this);
  TORCH_CHECK(!inputs.empty(), "braid: all_gather_coalesced needs at least one input");
  TORCH_CHECK(static_cast<int>(outputs.size()) == size_, "braid: all_gather_coalesced needs ", size_,
              " output lists (one per rank), got ", outputs.size());
  for (auto& t : inputs) check_same(inputs[0], t, "all_gather_coalesced", "an input", "the first input");
  for (auto& list : outputs) {
    TORCH_CHECK(list.size() == inputs.size(), "braid: all_gather_coalesced: an output list has ", list.size(),
                " tensors for ", inputs.size(), " inputs");
    for (size_t j = 0; j < list.size(); ++j) {
      check_same(inputs[0], list[j], "all_gather_coalesced", "an output", "the first input");
      TORCH_CHECK(list[j].numel() == inputs[j].numel(), "braid: all_gather_coalesced: output ", j, " has ",
                  list[j].numel(), " elements, its input ", inputs[j].numel());
    }
  }
  std::vector<at::Tensor> parts;
  for (auto& t : inputs) parts.push_back(t.reshape(-1));
  at::Tensor flat_in = at::cat(parts);
  const int64_t total = flat_in.numel();
  at::Tensor flat_out = at::empty({size_ * total}, flat_in.options());
  std::vector<at::Tensor> all_outputs;
  for (auto& list : outputs) all_outputs.insert(all_outputs.end(), list.begin(), list.end());
  auto work =
      make_work(c10d::OpType::ALLGATHER_COALESCED, "all_gather_coalesced", all_outputs, inputs[0].device());
  work->keep_alive = {flat_in, flat_out};
  // Rank by rank, each rank's tensors in order: the layout of flat_out.
  work->on_success = [all_outputs, flat_out]() mutable { copy_slices(flat_out, all_outputs); };
  return launch(
      work,
      [&](std::vector<braid_request_t>& reqs, bool blocking) {
        BRAID_START(all_gather, "all_gather_coalesced", flat_in.data_ptr(), flat_out.data_ptr(),
                    nbytes(flat_in), BRAID_UINT8, comm_, work->stream);
      },
      false, waited_at_once(opts));
}

c10::intrusive_ptr<c10d::Work> BraidBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  CoalescingGuard guard(this);
  TORCH_CHECK(outputs.size() == inputs.size(), "braid: all_gather_into_tensor_coalesced: ", outputs.size(),
              " outputs for ", inputs.size(), " inputs");
  std::vector<at::Tensor> ins, outs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i], "all_gather_into_tensor_coalesced");
    check_same(inputs[i], outputs[i], "all_gather_into_tensor_coalesced", "an output");
    // One device for the whole group: a later pair that fails its call
    // would leave the earlier ones queued with buffers about to be freed.
    TORCH_CHECK(inputs[i].device() == inputs[0].device(), "braid: all_gather_into_tensor_coalesced: input ",
                i, " is on ", inputs[i].device(), " but input 0 on ", inputs[0].device(),
                " (one device per call)");
    TORCH_CHECK(outputs[i].numel() == inputs[i].numel() * size_,
                "braid: all_gather_into_tensor_coalesced: output ", i, " has ", outputs[i].numel(),
                " elements, expected ", size_, " x ", inputs[i].numel());
    ins.push_back(staged(inputs[i]));
    outs.push_back(staged(outputs[i]));
  }
  auto work = make_work(c10d::OpType::COALESCED, "all_gather_into_tensor_coalesced", outputs,
                        inputs.empty() ? c10::Device(c10::kCPU) : inputs[0].device());
  work->keep_alive = ins;
  work->keep_alive.insert(work->keep_alive.end(), outs.begin(), outs.end());
  work->on_success = copy_back(outputs, outs);
  return launch(
      work,
      [&](std::vector<braid_request_t>& reqs, bool blocking) {
        for (size_t i = 0; i < ins.size(); ++i) {
          BRAID_START(all_gather, "all_gather_into_tensor_coalesced", ins[i].data_ptr(), outs[i].data_ptr(),
                      nbytes(ins[i]), BRAID_UINT8, comm_, work->stream);
        }
      },
      true, waited_at_once(opts));
}

c10::intrusive_ptr<c10d::Work> BraidBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::GatherOptions& opts) {
  CoalescingGuard guard(this);
  check_single(inputs, "gather");
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < size_, "braid: gather: root ", root, " is out of range for a group of ",
              size_);
  at::Tensor in = staged(inputs[0]);
  const int64_t n = in.numel();
  at::Tensor flat;
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_, "braid: gather needs ",
                size_, " output tensors on the root");
    for (auto& o : outputs[0]) {
      check_same(in, o, "gather", "an output");
      TORCH_CHECK(o.numel() == n, "braid: gather: an output has ", o.numel(), " elements, the input ", n);
    }
    outs = outputs[0];
    flat = at::empty({size_ * n}, in.options());
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                "braid: gather: only the root passes output tensors");
  }
  auto work = make_work(c10d::OpType::GATHER, "gather", outs, in.device());
  work->keep_alive = {in};
  if (flat.defined()) {
    work->keep_alive.push_back(flat);
    work->on_success = [outs, flat]() mutable { copy_slices(flat, outs); };
  }
  return launch(
      work,
      [&](std::vector<braid_request_t>& reqs, bool blocking) {
        BRAID_START(gather, "gather", in.data_ptr(), flat.defined() ? flat.data_ptr() : nullptr, nbytes(in),
                    BRAID_UINT8, root, comm_, work->stream);
      },
      false, waited_at_once(opts));
}

c10::intrusive_ptr<c10d::Work> BraidBackend::scatter(std::vector<at::Tensor>& outputs,
                                                     std::vector<std::vector<at::Tensor>>& inputs,
                                                     const c10d::ScatterOptions& opts) {
  CoalescingGuard guard(this);
  check_single(outputs, "scatter");
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < size_, "braid: scatter: root ", root, " is out of range for a group of ",
              size_);
  at::Tensor target = outputs[0], out = staged(target);
  at::Tensor flat;
  if (rank_ == root) {
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_, "braid: scatter needs ",
                size_, " input tensors on the root");
    std::vector<at::Tensor> parts;
    for (auto& t : inputs[0]) {
      check_same(target, t, "scatter", "an input", "the output");
      TORCH_CHECK(t.numel() == target.numel(), "braid: scatter: an input has ", t.numel(),
                  " elements, the output ", target.numel());
      parts.push_back(t.reshape(-1));
    }
    flat = at::cat(parts);
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                "braid: scatter: only the root passes input tensors");
  }
  auto work = make_work(c10d::OpType::SCATTER, "scatter", {target}, target.device());
  work->keep_alive = {out};
  if (flat.defined()) work->keep_alive.push_back(flat);
  if (!out.is_same(target)) work->on_success = [target, out]() mutable { target.copy_(out); };
  return launch(
      work,
      [&](std::vector<braid_request_t>& reqs, bool blocking) {
        BRAID_START(scatter, "scatter", flat.defined() ? flat.data_ptr() : nullptr, out.data_ptr(),
                    nbytes(out), BRAID_UINT8, root, comm_, work->stream);
      },
      false, waited_at_once(opts));
}

c10::intrusive_ptr<c10d::Work> BraidBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                            std::vector<std::vector<at::Tensor>>& inputs,
                                                            const c10d::ReduceScatterOptions& opts) {
  CoalescingGuard guard(this);
  check_single(outputs, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
              "braid: reduce_scatter needs ", size_, " input tensors (one per rank)");
  at::Tensor target = outputs[0];
  Reduction red = reduction_for(target, opts.reduceOp, "reduce_scatter");
  std::vector<at::Tensor> parts;
  bool even = true;
  for (auto& t : inputs[0]) {
    check_same(target, t, "reduce_scatter", "an input", "the output");
    even = even && t.numel() == target.numel();
    parts.push_back(red.has_premul ? t.mul(red.premul).reshape(-1) : t.reshape(-1));
  }
  at::Tensor out = staged(target);
  auto work = make_work(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", {target}, target.device());
  if (!even) {
    // Input r is rank r's share, of rank r's output size (gloo allows
    // shares of different sizes): one reduce per rank, rooted there, in
    // one group.
    TORCH_CHECK(parts[rank_].numel() == target.numel(), "braid: reduce_scatter: input ", rank_,
                " (this rank's share) has ", parts[rank_].numel(), " elements, the output ", target.numel());
    for (at::Tensor& p : parts) p = p.contiguous();
    work->keep_alive = parts;
    work->keep_alive.push_back(out);
    if (!out.is_same(target)) work->on_success = [target, out]() mutable { target.copy_(out); };
    return launch(
        work,
        [&](std::vector<braid_request_t>& reqs, bool blocking) {
          for (int r = 0; r < size_; ++r)
            BRAID_START(reduce, "reduce_scatter", parts[r].data_ptr(), r == rank_ ? out.data_ptr() : nullptr,
                        parts[r].numel() * red.per_element, red.dtype, red.op, r, comm_, work->stream);
        },
        true, waited_at_once(opts));
  }
  at::Tensor flat = at::cat(parts);
  work->keep_alive = {flat, out};
  if (!out.is_same(target)) work->on_success = [target, out]() mutable { target.copy_(out); };
  return launch(
      work,
      [&](std::vector<braid_request_t>& reqs, bool blocking) {
        BRAID_START(reduce_scatter, "reduce_scatter", flat.data_ptr(), out.data_ptr(),
                    out.numel() * red.per_element, red.dtype, red.op, comm_, work->stream);
      },
      false, waited_at_once(opts));
}

c10::intrusive_ptr<c10d::Work> BraidBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                  const c10d::ReduceScatterOptions& opts) {
  CoalescingGuard guard(this);
  std::vector<at::Tensor> outputs = {output}, inputs = {input};
  return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> BraidBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  CoalescingGuard guard(this);
  const char* name = outputs.size() == 1 ? "reduce_scatter_tensor" : "reduce_scatter_tensor_coalesced";
  TORCH_CHECK(outputs.size() == inputs.size() && !outputs.empty(), "braid: ", name, ": ", outputs.size(),
              " outputs for ", inputs.size(), " inputs");
  std::vector<at::Tensor> ins, outs;
  std::vector<Reduction> reds;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(outputs[i], name);
    check_same(outputs[i], inputs[i], name, "the input", "the output");
    TORCH_CHECK(outputs[i].device() == outputs[0].device(), "braid: ", name, ": output ", i, " is on ",
                outputs[i].device(), " but output 0 on ", outputs[0].device(), " (one device per call)");
    TORCH_CHECK(inputs[i].numel() == outputs[i].numel() * size_, "braid: ", name, ": the input has ",
                inputs[i].numel(), " elements, expected ", size_, " x ", outputs[i].numel());
    reds.push_back(reduction_for(outputs[i], opts.reduceOp, name));
    ins.push_back(reduction_buffer(inputs[i], reds.back()));
    outs.push_back(staged(outputs[i]));
  }
  auto work = make_work(outputs.size() == 1 ? c10d::OpType::_REDUCE_SCATTER_BASE : c10d::OpType::COALESCED,
                        name, outputs, outputs[0].device());
  work->keep_alive = ins;
  work->keep_alive.insert(work->keep_alive.end(), outs.begin(), outs.end());
  work->on_success = copy_back(outputs, outs);
  return launch(
      work,
      [&](std::vector<braid_request_t>& reqs, bool blocking) {
        for (size_t i = 0; i < ins.size(); ++i) {
          BRAID_START(reduce_scatter, name, ins[i].data_ptr(), outs[i].data_ptr(),
                      outs[i].numel() * reds[i].per_element, reds[i].dtype, reds[i].op, comm_, work->stream);
        }
      },
      ins.size() > 1, waited_at_once(opts));
}

c10::intrusive_ptr<c10d::Work> BraidBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                           std::vector<int64_t>& output_split_sizes,
                                                           std::vector<int64_t>& input_split_sizes,
                                                           const c10d::AllToAllOptions& opts) {
  CoalescingGuard guard(this);
  check_tensor(input, "all_to_all_single");
  check_same(input, output, "all_to_all_single", "the output");
  at::Tensor in = staged(input), out = staged(output);
  auto work = make_work(c10d::OpType::ALLTOALL_BASE, "all_to_all_single", {output}, input.device());
  work->keep_alive = {in, out};
  if (!out.is_same(output)) work->on_success = [output, out]() mutable { output.copy_(out); };
  if (output_split_sizes.empty() && input_split_sizes.empty()) {
    TORCH_CHECK(in.numel() == out.numel() && in.numel() % size_ == 0, "braid: all_to_all_single: input (",
                in.numel(), " elements) and output (", out.numel(),
                ") must match and divide evenly by the group size ", size_);
    return launch(
        work,
        [&](std::vector<braid_request_t>& reqs, bool blocking) {
          BRAID_START(all_to_all, "all_to_all_single", in.data_ptr(), out.data_ptr(), nbytes(in) / size_,
                      BRAID_UINT8, comm_, work->stream);
        },
        false, waited_at_once(opts));
  }
  std::vector<size_t> sc, sd, rc, rd;
  split_layout(in, input_split_sizes, size_, "the input", &sc, &sd);
  split_layout(out, output_split_sizes, size_, "the output", &rc, &rd);
  return launch(
      work,
      [&](std::vector<braid_request_t>& reqs, bool blocking) {
        BRAID_START(all_to_allv, "all_to_all_single", in.data_ptr(), sc.data(), sd.data(), out.data_ptr(),
                    rc.data(), rd.data(), BRAID_UINT8, comm_, work->stream);
      },
      false, waited_at_once(opts));
}

c10::intrusive_ptr<c10d::Work> BraidBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllToAllOptions& opts) {
  CoalescingGuard guard(this);
  TORCH_CHECK(static_cast<int>(outputs.size()) == size_ && static_cast<int>(inputs.size()) == size_,
              "braid: all_to_all needs ", size_, " input and output tensors, got ", inputs.size(), " and ",
              outputs.size());
  std::vector<size_t> sc(size_), sd(size_), rc(size_), rd(size_);
  std::vector<at::Tensor> parts;
  for (int p = 0; p < size_; ++p) {
    check_tensor(inputs[p], "all_to_all");
    check_same(inputs[0], inputs[p], "all_to_all", "an input", "the first input");
    check_same(inputs[0], outputs[p], "all_to_all", "an output", "the first input");
    parts.push_back(inputs[p].reshape(-1));
    sc[p] = nbytes(inputs[p]);
    rc[p] = nbytes(outputs[p]);
    if (p > 0) {
      sd[p] = sd[p - 1] + sc[p - 1];
      rd[p] = rd[p - 1] + rc[p - 1];
    }
  }
  at::Tensor flat_in = at::cat(parts);
  int64_t out_elems = 0;
  for (auto& o : outputs) out_elems += o.numel();
  at::Tensor flat_out = at::empty({out_elems}, inputs[0].options());
  auto work = make_work(c10d::OpType::ALLTOALL, "all_to_all", outputs, inputs[0].device());
  work->keep_alive = {flat_in, flat_out};
  std::vector<at::Tensor> outs = outputs;
  work->on_success = [outs, flat_out]() mutable { copy_slices(flat_out, outs); };
  return launch(
      work,
      [&](std::vector<braid_request_t>& reqs, bool blocking) {
        BRAID_START(all_to_allv, "all_to_all", flat_in.data_ptr(), sc.data(), sd.data(), flat_out.data_ptr(),
                    rc.data(), rd.data(), BRAID_UINT8, comm_, work->stream);
      },
      false, waited_at_once(opts));
}

// Tags travel with the messages and are checked against the receive's (a
// receive posted for another tag fails, naming both): braid matches
// messages in post order, as NCCL does, where gloo matches by tag.
c10::intrusive_ptr<c10d::Work> BraidBackend::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  CoalescingGuard guard(this);
  check_single(tensors, "send");
  at::Tensor buf = staged(tensors[0]);
  auto work = make_work(c10d::OpType::SEND, "send", {tensors[0]}, buf.device());
  work->keep_alive = {buf};
  return launch(work, [&](std::vector<braid_request_t>& reqs, bool blocking) {
    BRAID_START(send_tagged, "send", buf.data_ptr(), nbytes(buf), BRAID_UINT8, dst_rank,
                static_cast<uint32_t>(tag), comm_, work->stream);
  });
}

c10::intrusive_ptr<c10d::Work> BraidBackend::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  CoalescingGuard guard(this);
  check_single(tensors, "recv");
  at::Tensor t = tensors[0], buf = staged(t);
  auto work = make_work(c10d::OpType::RECV, "recv", {t}, t.device());
  work->keep_alive = {buf};
  work->source_rank_ = src_rank;
  if (!buf.is_same(t)) work->on_success = [t, buf]() mutable { t.copy_(buf); };
  return launch(work, [&](std::vector<braid_request_t>& reqs, bool blocking) {
    BRAID_START(recv_tagged, "recv", buf.data_ptr(), nbytes(buf), BRAID_UINT8, src_rank,
                static_cast<uint32_t>(tag), comm_, work->stream);
  });
}

c10::intrusive_ptr<c10d::Work> BraidBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  CoalescingGuard guard(this);
  check_single(tensors, "recv (any source)");
  // Its source is known only once it ran, which a stream-ordered work does
  // not wait for.
  TORCH_CHECK(tensors[0].device().is_cpu(), "braid: recv from any source takes CPU tensors, got one on ",
              tensors[0].device(), "; receive from a named rank for CUDA tensors");
  at::Tensor t = tensors[0], buf = staged(t);
  auto work = make_work(c10d::OpType::RECVANYSOURCE, "recv (any source)", {t});
  work->keep_alive = {buf};
  if (!buf.is_same(t)) work->on_success = [t, buf]() mutable { t.copy_(buf); };
  BraidWork* w = work.get();  // braid writes the sender's rank once it is known
  return launch(work, [&](std::vector<braid_request_t>& reqs, bool blocking) {
    BRAID_START(recv_any_tagged, "recv (any source)", buf.data_ptr(), nbytes(buf), BRAID_UINT8,
                &w->source_rank_, static_cast<uint32_t>(tag), comm_, work->stream);
  });
}

c10::intrusive_ptr<c10d::Work> BraidBackend::barrier(const c10d::BarrierOptions& opts) {
  CoalescingGuard guard(this);
  auto work = make_work(c10d::OpType::BARRIER, "barrier", {});
  // Collectives before it are done in braid once it is (one order on every
  // rank); their works complete too before the barrier's does, as gloo's do,
  // so a result read after barrier() is there. Their own errors stay theirs.
  std::vector<c10::weak_intrusive_ptr<BraidWork>> before;
  {
    std::lock_guard<std::mutex> lock(inflight_mu_);
    before.swap(inflight_);
  }
  if (!before.empty()) {
    work->on_success = [before = std::move(before)] {
      for (const auto& w : before) {
        if (auto p = w.lock()) {
          try {
            p->wait();
          } catch (const std::exception&) {
          }
        }
      }
    };
  }
  return launch(
      work,
      [&](std::vector<braid_request_t>& reqs, bool blocking) {
        BRAID_START(barrier, "barrier", comm_, nullptr);
      },
      false, waited_at_once(opts));
}

namespace {
// monitored_barrier's messages carry a tag of their own: a user's send or
// receive left in flight across it fails with a mismatch naming the tags
// instead of taking the barrier's byte.
constexpr uint32_t kBarrierTag = 0x6d626172;  // "mbar"

void release_barrier_bytes(void* user, braid_result_t, const char*) {
  delete static_cast<std::shared_ptr<std::vector<uint8_t>>*>(user);
}
}  // namespace

void BraidBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  CoalescingGuard guard(this);
  TORCH_CHECK(coalescing_thread_.load() != std::this_thread::get_id(),
              "braid: monitored_barrier inside a coalescing (batch_isend_irecv, _coalescing_manager) is not "
              "supported");
  TORCH_CHECK(comm_ != nullptr, "braid: monitored_barrier on a process group that was shut down");
  const auto limit = opts.timeout == c10d::kUnsetTimeout ? timeout_ : opts.timeout;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  const std::string ms = std::to_string(limit.count()) + " ms";
  uint8_t token = 1;
  // The messages say what gloo's say (torch's tests and users' log searches
  // look for them), then braid's details.
  if (limit.count() <= 0)
    C10_THROW_ERROR(DistBackendError, "braid: monitored_barrier (" + describe() + "): Rank " +
                                          std::to_string(rank_) + " timed out in monitoredBarrier after " +
                                          ms + " (a timeout of " + ms + " leaves no time to wait)");
  auto arrived = std::make_shared<std::vector<uint8_t>>(size_, 0);
  std::vector<braid_request_t> reqs(size_, nullptr);
  // Leaving with receives still posted: they complete later (a late token,
  // or the abort that ends the group), into bytes that must live until then:
  // each receive's callback holds them.
  auto abandon = [&] {
    barrier_failed_.store(true);
    for (braid_request_t& r : reqs) {
      if (r == nullptr) continue;
      auto* held = new std::shared_ptr<std::vector<uint8_t>>(arrived);
      if (braid_request_set_callback(r, &release_barrier_bytes, held) != BRAID_SUCCESS)
        (void)held;  // only a bug gets here: never freed, as the receive may still write
      braid_request_free(std::exchange(r, nullptr));
    }
  };
  // Polls a receive until it completes (its result) or the deadline passes
  // (BRAID_ERR_IN_PROGRESS).
  auto poll_until_deadline = [&](braid_request_t* r) {
    for (;;) {
      int done = 0;
      const braid_result_t code = braid_test(r, &done);
      if (code != BRAID_SUCCESS || done) return code;
      if (std::chrono::steady_clock::now() >= deadline) return BRAID_ERR_IN_PROGRESS;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  };
  // Every rank checks in with rank 0, which names the ranks that did not
  // arrive in time; then rank 0 releases everyone. A rank waits for the
  // release as long as rank 0 waits for the others (as gloo's do): rank 0
  // failing leaves them released by their own deadline, not the group's.
  if (rank_ != 0) {
    check(braid_send_tagged(&token, 1, BRAID_UINT8, 0, kBarrierTag, comm_, nullptr), "monitored_barrier");
    braid_result_t code =
        braid_irecv_tagged(&(*arrived)[0], 1, BRAID_UINT8, 0, kBarrierTag, comm_, nullptr, &reqs[0]);
    if (code != BRAID_SUCCESS) fail_call("monitored_barrier", code);
    code = poll_until_deadline(&reqs[0]);
    if (code == BRAID_SUCCESS) return;
    // No release in time, or rank 0 gave up first (it ends its group by
    // abort once it named the missing ranks): gloo says the same of both.
    const std::string why = code == BRAID_ERR_IN_PROGRESS
                                ? "no release within " + ms + " (rank 0 names the ranks that did not arrive)"
                                : std::string(braid_get_error_string(code)) + ": " + braid_get_last_error();
    abandon();
    C10_THROW_ERROR(DistBackendError, "braid: monitored_barrier (" + describe() + "): Rank " +
                                          std::to_string(rank_) +
                                          " successfully reached monitoredBarrier, but received errors while "
                                          "waiting for send/recv from rank 0: " +
                                          why);
  }
  for (int p = 1; p < size_; ++p) {
    braid_result_t code =
        braid_irecv_tagged(&(*arrived)[p], 1, BRAID_UINT8, p, kBarrierTag, comm_, nullptr, &reqs[p]);
    if (code != BRAID_SUCCESS) {
      abandon();
      fail_call("monitored_barrier", code);
    }
  }
  std::vector<int> missing;
  for (int p = 1; p < size_; ++p) {
    const braid_result_t code = poll_until_deadline(&reqs[p]);
    if (code == BRAID_ERR_IN_PROGRESS) {
      missing.push_back(p);
      if (!wait_all_ranks) break;
    } else if (code != BRAID_SUCCESS) {
      abandon();
      fail_call("monitored_barrier", code);
    }
  }
  if (!missing.empty()) {
    abandon();
    std::string ranks;
    for (int p : missing) ranks += (ranks.empty() ? "" : ", ") + std::to_string(p);
    // gloo's wording: "Ranks" whenever it waited for all (torch's tests match it).
    C10_THROW_ERROR(DistBackendError,
                    "braid: monitored_barrier (" + describe() + "): Rank" + (wait_all_ranks ? "s " : " ") +
                        ranks + " failed to pass monitoredBarrier in " + ms + " (did not reach it)");
  }
  for (int p = 1; p < size_; ++p)
    check(braid_send_tagged(&token, 1, BRAID_UINT8, p, kBarrierTag, comm_, nullptr), "monitored_barrier");
}

}  // namespace braid_torch
