// The DDP Reducer: buckets of gradients all-reduced while the backward pass
// runs. Uses braid's public C API only.
#include <braid/ddp.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

namespace braid::ddp {
namespace {

Result fail(braid_result_t code, std::string message) {
  return Result{code, std::move(message)};
}

Result from_call(braid_result_t code, const std::string& what) {
  if (code == BRAID_SUCCESS) return {};
  return fail(code, what + ": " + braid_get_last_error());
}

bool is_floating(braid_dtype_t t) {
  return t == BRAID_FLOAT16 || t == BRAID_BFLOAT16 || t == BRAID_FLOAT32 || t == BRAID_FLOAT64;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t d = 0; d < shape.size(); ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

// "parameter 'name' (index 3)"; `kind` "buffer" for a Buffer.
std::string label(const std::string& name, size_t index, const char* kind = "parameter") {
  std::string s = std::string(kind) + " ";
  if (!name.empty()) s += "'" + name + "' ";
  return s + "(index " + std::to_string(index) + ")";
}

// Why `shape` does not describe `count` elements, or "".
std::string shape_problem(const std::vector<int64_t>& shape, size_t count) {
  if (shape.empty()) return "";
  uint64_t product = 1;
  for (int64_t d : shape) {
    if (d < 0) return "has a negative dimension in its shape " + shape_text(shape);
    product *= static_cast<uint64_t>(d);
  }
  if (product != count)
    return "has shape " + shape_text(shape) + " (" + std::to_string(product) + " elements) but count " +
           std::to_string(count);
  return "";
}

// FNV-1a over the shapes and dtypes: what every rank must agree on.
void mix(uint64_t* h, uint64_t v) {
  for (int b = 0; b < 8; ++b) {
    *h ^= (v >> (8 * b)) & 0xff;
    *h *= 1099511628211ull;
  }
}

// memcpy without its pointer rules for empty parameters (data may be null).
void copy_bytes(void* dst, const void* src, size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}

// After a bucket's gradients, its all_reduce carries the step mark: 0 from a
// rank that keeps the step, 1 from a rank that drops it (any nonzero average
// drops the step on every rank). With allow_unused_parameters one used mark
// per parameter of the bucket follows: 1 from a rank that gave it a
// gradient (nonzero average: some rank used it).
void set_mark(braid_dtype_t t, void* at, bool dropped) {
  switch (t) {
    case BRAID_FLOAT16:
    case BRAID_BFLOAT16: {
      const uint16_t one = t == BRAID_FLOAT16 ? 0x3C00 : 0x3F80, v = dropped ? one : 0;
      std::memcpy(at, &v, sizeof v);
      break;
    }
    case BRAID_FLOAT32: {
      const float v = dropped ? 1.0f : 0.0f;
      std::memcpy(at, &v, sizeof v);
      break;
    }
    default: {
      const double v = dropped ? 1.0 : 0.0;
      std::memcpy(at, &v, sizeof v);
      break;
    }
  }
}

bool marked(braid_dtype_t t, const void* at) {
  // Nonzero: any bit but the sign's (an average of marks is never NaN).
  const size_t n = braid_dtype_size(t);
  const auto* b = static_cast<const unsigned char*>(at);
  for (size_t k = 0; k + 1 < n; ++k)
    if (b[k] != 0) return true;
  return (b[n - 1] & 0x7f) != 0;  // little-endian: the sign is the top bit of the last byte
}

}  // namespace

struct Reducer::State {
  struct Bucket {
    BucketInfo info;
    size_t count = 0;                  // elements of gradients
    size_t marks = 1;                  // elements after them: the step mark, then used marks
    unsigned char* storage = nullptr;  // inside State::arena
    size_t pending = 0;                // parameters not yet ready in this step
    braid_request_t request = nullptr;
  };

  braid_comm_t comm = nullptr;
  // Where the buckets' all_reduces run: comm, or with register_buckets a
  // communicator split from it that this State owns, on which `arena` is
  // registered. It is destroyed before the arena is freed: braid refuses to
  // free memory a live communicator has registered.
  braid_comm_t bucket_comm = nullptr;
  bool owns_bucket_comm = false;
  bool registered = false;
  // Every bucket's storage, each on a cache line: from braid_mem_alloc
  // (arena_mapped) or aligned_alloc.
  unsigned char* arena = nullptr;
  bool arena_mapped = false;
  int rank = 0;
  int nranks = 1;
  Options options;
  std::vector<Parameter> params;
  std::vector<Buffer> buffers;
  std::vector<Bucket> buckets;
  std::vector<BucketInfo> infos;
  std::vector<size_t> bucket_of;  // per parameter
  std::vector<size_t> offset_of;  // per parameter, element offset in its bucket
  std::vector<bool> ready;
  // Per parameter: it got a gradient in a no_sync step since the last
  // synchronised one, so what its gradient holds is this rank's share even
  // if the synchronised step leaves it unused.
  std::vector<bool> accumulated;
  // Per parameter: marked ready in this step (not filled in by finish()).
  std::vector<bool> given;
  // Per parameter: some rank gave it a gradient in the last synchronised step.
  std::vector<bool> used_last;

  mutable std::mutex mu;
  bool sync = true;  // outside every NoSync
  // A step communicates or not as `sync` was at its first mark_ready: a
  // NoSync that ends (or begins) between the backward pass and finish()
  // does not change the step.
  bool step_begun = false, step_sync = true;
  bool dropping = false;  // inside drop_step()
  size_t next_to_start = 0;
  std::vector<size_t> start_order;
  std::vector<size_t> last_order;
  Result step_error;  // the first failure of this step, reported again by finish()

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    // Refused, harmlessly, for a bucket_comm() the caller aborted.
    if (owns_bucket_comm) (void)braid_comm_destroy(bucket_comm);
    if (arena_mapped)
      (void)braid_mem_free(arena);
    else
      std::free(arena);
  }

  unsigned char* slot(size_t i) const {
    const Bucket& b = buckets[bucket_of[i]];
    return b.storage + offset_of[i] * braid_dtype_size(b.info.dtype);
  }
  size_t bytes(size_t i) const { return params[i].count * braid_dtype_size(params[i].dtype); }

  unsigned char* mark(const Bucket& b, size_t k = 0) const {
    return b.storage + b.info.bytes + k * braid_dtype_size(b.info.dtype);
  }

  // Starts, in bucket order, every bucket whose gradients are all ready
  // (with the step mark: `dropping` while drop_step() runs). The last bucket
  // waits for the step's end (`closing`: finish() or a drop): a rank that
  // drops the step after its backward pass ended would otherwise have no
  // bucket left to carry the mark, and its peers' finish() would succeed
  // while it skipped the step. The last bucket is the last to fill anyway.
  Result start_ready_buckets(bool closing = false) {
    while (step_error.ok() && next_to_start < buckets.size() && buckets[next_to_start].pending == 0 &&
           (closing || next_to_start + 1 < buckets.size())) {
      Bucket& b = buckets[next_to_start];
      set_mark(b.info.dtype, mark(b), dropping);
      for (size_t j = 1; j < b.marks; ++j) {
        const size_t i = b.info.parameters[j - 1];
        set_mark(b.info.dtype, mark(b, j), given[i] || accumulated[i]);
      }
      braid_result_t r = braid_iall_reduce(b.storage, b.storage, b.count + b.marks, b.info.dtype, BRAID_AVG,
                                           bucket_comm, nullptr, &b.request);
      if (r != BRAID_SUCCESS) {
        b.request = nullptr;
        step_error = from_call(r, "all_reduce of gradient bucket " + std::to_string(next_to_start));
        return step_error;
      }
      start_order.push_back(next_to_start);
      ++next_to_start;
    }
    return step_error;
  }

  // Waits for every started bucket; the first failure wins.
  Result wait_started() {
    Result result = step_error;
    for (size_t k = 0; k < next_to_start; ++k) {
      Bucket& b = buckets[k];
      if (b.request == nullptr) continue;
      braid_result_t r = braid_wait(&b.request);
      b.request = nullptr;
      if (r != BRAID_SUCCESS && result.ok()) {
        result = from_call(r, "all_reduce of gradient bucket " + std::to_string(k));
      }
    }
    return result;
  }

  bool step_synchronised() const { return step_begun ? step_sync : sync; }

  // This rank gives the synchronised step up: the buckets it has not started
  // go now, unready gradients as zeros, marked, so that peers finish the
  // same all_reduces (a peer's next step would otherwise pair with them and
  // average gradients of two steps) and their finish() fails.
  Result drop_step() {
    if (!step_synchronised()) return {};
    dropping = true;
    for (size_t i = 0; i < params.size(); ++i) {
      if (ready[i]) continue;
      std::memset(slot(i), 0, bytes(i));
      ready[i] = true;
      --buckets[bucket_of[i]].pending;
    }
    start_ready_buckets(true);
    dropping = false;
    return wait_started();
  }

  // How many ranks dropped the step, from its buckets' marks (0: none).
  int ranks_that_dropped() const {
    for (size_t k = 0; k < next_to_start; ++k) {
      const Bucket& b = buckets[k];
      if (!marked(b.info.dtype, mark(b))) continue;
      double avg = 0;
      switch (b.info.dtype) {
        case BRAID_FLOAT32: {
          float f;
          std::memcpy(&f, mark(b), sizeof f);
          avg = f;
          break;
        }
        case BRAID_FLOAT64:
          std::memcpy(&avg, mark(b), sizeof avg);
          break;
        default:
          return -1;  // some; 16-bit marks are not counted
      }
      return static_cast<int>(avg * nranks + 0.5);
    }
    return 0;
  }

  void reset_step() {
    step_begun = false;
    for (size_t i = 0; i < ready.size(); ++i) ready[i] = given[i] = false;
    for (Bucket& b : buckets) b.pending = b.info.parameters.size();
    next_to_start = 0;
    start_order.clear();
    step_error = {};
  }

  // The buckets' memory, and with options.register_buckets the
  // communicator it is registered on. Collective over comm.
  Result make_arena(size_t bytes) {
    bucket_comm = comm;
    if (options.register_buckets && nranks > 1) {
      if (Result r = from_call(braid_comm_split(comm, 0, rank, &bucket_comm),
                               "Reducer::create: making the buckets' communicator");
          !r) {
        bucket_comm = nullptr;
        return r;
      }
      owns_bucket_comm = true;
      void* mapped = nullptr;
      if (braid_mem_alloc(&mapped, bytes) == BRAID_SUCCESS) {
        arena = static_cast<unsigned char*>(mapped);
        arena_mapped = true;
      }
      // A rank without such memory names null: on one host every rank's
      // registration then fails alike, and every rank goes on with plain
      // memory (across hosts a registration is each rank's own).
      registered = braid_comm_register(bucket_comm, arena, bytes) == BRAID_SUCCESS;
    }
    if (arena == nullptr) arena = static_cast<unsigned char*>(std::aligned_alloc(64, bytes));
    // Every rank learns whether every other has its buckets: one that
    // returned alone would leave its peers in the broadcast that follows
    // until their deadline.
    int32_t lacking = arena == nullptr ? 1 : 0;
    std::vector<int32_t> all(static_cast<size_t>(nranks));
    if (Result r = from_call(braid_all_gather(&lacking, all.data(), 1, BRAID_INT32, comm, nullptr),
                             "Reducer::create: checking that every rank has its buckets");
        !r) {
      return r;
    }
    if (lacking != 0) {
      return fail(BRAID_ERR_SYSTEM,
                  "Reducer::create: cannot allocate " + std::to_string(bytes) + " bytes of gradient buckets");
    }
    for (int q = 0; q < nranks; ++q) {
      if (all[static_cast<size_t>(q)] != 0) {
        return fail(BRAID_ERR_SYSTEM, "Reducer::create: rank " + std::to_string(q) +
                                          " could not allocate its gradient buckets");
      }
    }
    return {};
  }

  Result broadcast(void* data, size_t count, braid_dtype_t dtype, const std::string& what) {
    return from_call(braid_broadcast(data, data, count, dtype, 0, comm, nullptr), "broadcast of " + what);
  }
};

namespace {

// What Reducer::create refuses before any rank talks to another.
Result check_arguments(const std::vector<Parameter>& parameters, const std::vector<Buffer>& buffers,
                       const Options& options) {
  if (options.bucket_bytes == 0 || options.first_bucket_bytes == 0) {
    return fail(BRAID_ERR_INVALID_ARGUMENT,
                "Reducer::create: bucket_bytes and first_bucket_bytes must be > 0");
  }
  if (parameters.empty()) return fail(BRAID_ERR_INVALID_ARGUMENT, "Reducer::create: no parameters");
  for (size_t i = 0; i < parameters.size(); ++i) {
    const Parameter& p = parameters[i];
    const std::string who = "Reducer::create: " + label(p.name, i);
    if (braid_dtype_size(p.dtype) == 0) {
      return fail(BRAID_ERR_INVALID_ARGUMENT, who + " has an unknown dtype " + std::to_string(p.dtype));
    }
    if (!is_floating(p.dtype)) {
      return fail(BRAID_ERR_INVALID_ARGUMENT,
                  who + " has dtype " + braid_dtype_name(p.dtype) +
                      "; gradients must be float16, bfloat16, float32 or float64");
    }
    if (p.data == nullptr && p.count > 0)
      return fail(BRAID_ERR_INVALID_ARGUMENT, who + " has data == nullptr");
    if (std::string why = shape_problem(p.shape, p.count); !why.empty())
      return fail(BRAID_ERR_INVALID_ARGUMENT, who + " " + why);
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    const Buffer& b = buffers[i];
    const std::string who = "Reducer::create: " + label(b.name, i, "buffer");
    if (braid_dtype_size(b.dtype) == 0) {
      return fail(BRAID_ERR_INVALID_ARGUMENT, who + " has an unknown dtype " + std::to_string(b.dtype));
    }
    if (b.count > 0 && b.data == nullptr)
      return fail(BRAID_ERR_INVALID_ARGUMENT, who + " has data == nullptr");
    if (std::string why = shape_problem(b.shape, b.count); !why.empty())
      return fail(BRAID_ERR_INVALID_ARGUMENT, who + " " + why);
  }
  return {};
}

// One tensor's count, dtype and shape, folded into the model's hash.
uint64_t tensor_key(size_t count, braid_dtype_t dtype, const std::vector<int64_t>& shape) {
  uint64_t h = 14695981039346656037ull;
  mix(&h, (uint64_t{count} << 8) | static_cast<uint64_t>(dtype));
  mix(&h, shape.size());
  for (int64_t d : shape) mix(&h, static_cast<uint64_t>(d));
  return h;
}

// Where the ranks registered as many parameters and buffers but their
// shapes or dtypes differ: every rank exchanges each tensor's description
// and names the first that differs from rank 0's (collective).
Result name_the_difference(braid_comm_t comm, int nranks, const std::vector<Parameter>& parameters,
                           const std::vector<Buffer>& buffers) {
  constexpr size_t kMaxDims = 8, kWords = 3 + kMaxDims;  // count, dtype, ndim, dims
  const size_t tensors = parameters.size() + buffers.size();
  std::vector<uint64_t> mine(tensors * kWords, 0);
  auto describe_into = [&](size_t i, size_t count, braid_dtype_t dtype, const std::vector<int64_t>& shape) {
    uint64_t* w = &mine[i * kWords];
    w[0] = count;
    w[1] = static_cast<uint64_t>(dtype);
    w[2] = shape.size();
    for (size_t d = 0; d < shape.size() && d < kMaxDims; ++d) w[3 + d] = static_cast<uint64_t>(shape[d]);
  };
  for (size_t i = 0; i < parameters.size(); ++i)
    describe_into(i, parameters[i].count, parameters[i].dtype, parameters[i].shape);
  for (size_t i = 0; i < buffers.size(); ++i)
    describe_into(parameters.size() + i, buffers[i].count, buffers[i].dtype, buffers[i].shape);
  std::vector<uint64_t> all(mine.size() * static_cast<size_t>(nranks));
  if (Result r =
          from_call(braid_all_gather(mine.data(), all.data(), mine.size(), BRAID_UINT64, comm, nullptr),
                    "Reducer::create: comparing the model's tensors across ranks");
      !r) {
    return r;
  }
  auto text = [](const uint64_t* w) {
    std::string s;
    if (w[2] == 0) {
      s = std::to_string(w[0]) + " elements";
    } else {
      std::vector<int64_t> dims;
      for (size_t d = 0; d < w[2] && d < kMaxDims; ++d) dims.push_back(static_cast<int64_t>(w[3 + d]));
      s = "shape " + shape_text(dims);
      if (w[2] > kMaxDims) s.insert(s.size() - 1, ", ... (" + std::to_string(w[2]) + " dimensions)");
    }
    return s + " " + braid_dtype_name(static_cast<braid_dtype_t>(w[1]));
  };
  for (size_t i = 0; i < tensors; ++i) {
    const uint64_t* zero = &all[i * kWords];
    for (int q = 1; q < nranks; ++q) {
      const uint64_t* other = &all[(static_cast<size_t>(q) * tensors + i) * kWords];
      if (std::memcmp(zero, other, kWords * sizeof(uint64_t)) == 0) continue;
      const bool is_param = i < parameters.size();
      const size_t index = is_param ? i : i - parameters.size();
      const std::string& name = is_param ? parameters[index].name : buffers[index].name;
      const std::string who = label(name, index, is_param ? "parameter" : "buffer");
      return fail(BRAID_ERR_MISMATCH, "Reducer::create: " + who + " has " + text(other) + " on rank " +
                                          std::to_string(q) + " and " + text(zero) + " on rank 0");
    }
  }
  // Only dimensions past the eighth differ.
  return fail(BRAID_ERR_MISMATCH,
              "Reducer::create: a parameter's or buffer's shape differs between ranks "
              "beyond its eighth dimension");
}

}  // namespace

Result Reducer::create(braid_comm_t comm, std::vector<Parameter> parameters, std::vector<Buffer> buffers,
                       const Options& options, std::unique_ptr<Reducer>* out) {
  if (out == nullptr) return fail(BRAID_ERR_INVALID_ARGUMENT, "Reducer::create: out is null");
  out->reset();
  auto s = std::make_unique<State>();
  s->comm = comm;
  if (Result r = from_call(braid_comm_rank(comm, &s->rank), "Reducer::create: comm"); !r) return r;
  if (Result r = from_call(braid_comm_size(comm, &s->nranks), "Reducer::create: comm"); !r) return r;
  const Result local = check_arguments(parameters, buffers, options);

  // Every rank must register the same model: compare shapes before any
  // bucket all_reduce could pair up mismatched data.
  // The options too: they decide the buckets, so the all_reduces' sizes.
  // And whether each rank took its own arguments: one that refused them
  // returns at once, and its peers would wait here until their deadline.
  constexpr size_t kFields = 6;
  uint64_t mine[kFields] = {parameters.size(),       14695981039346656037ull, buffers.size(),
                            14695981039346656037ull, 14695981039346656037ull, local.ok() ? 0u : 1u};
  for (const Parameter& p : parameters) mix(&mine[1], tensor_key(p.count, p.dtype, p.shape));
  for (const Buffer& b : buffers) mix(&mine[3], tensor_key(b.count, b.dtype, b.shape));
  for (uint64_t v : {uint64_t{options.bucket_bytes}, uint64_t{options.first_bucket_bytes},
                     uint64_t{options.allow_unused_parameters}, uint64_t{options.register_buckets}})
    mix(&mine[4], v);
  std::vector<uint64_t> all(kFields * static_cast<size_t>(s->nranks));
  if (Result r = from_call(braid_all_gather(mine, all.data(), kFields, BRAID_UINT64, comm, nullptr),
                           "Reducer::create: comparing the model across ranks");
      !r) {
    return r;
  }
  if (!local.ok()) return local;
  for (int q = 0; q < s->nranks; ++q) {
    if (all[kFields * static_cast<size_t>(q) + 5] != 0)
      return fail(BRAID_ERR_INVALID_ARGUMENT, "Reducer::create: rank " + std::to_string(q) +
                                                  " refused its arguments (its error names them)");
  }
  for (int q = 1; q < s->nranks; ++q) {
    const uint64_t* other = &all[kFields * static_cast<size_t>(q)];
    if (std::memcmp(other, all.data(), 4 * sizeof(uint64_t)) == 0 && other[4] != all[4]) {
      return fail(BRAID_ERR_MISMATCH, "Reducer::create: rank " + std::to_string(q) +
                                          "'s Options (bucket_bytes, first_bucket_bytes, "
                                          "allow_unused_parameters, register_buckets) differ from rank 0's");
    }
    if (std::memcmp(other, all.data(), sizeof mine) != 0) {
      // Every rank sees the same exchange, so all take this branch together.
      bool same_lengths = true;
      for (int r = 1; r < s->nranks; ++r) {
        const uint64_t* o = &all[kFields * static_cast<size_t>(r)];
        same_lengths = same_lengths && o[0] == all[0] && o[2] == all[2];
      }
      if (same_lengths) return name_the_difference(comm, s->nranks, parameters, buffers);
      const bool params_differ = other[0] != all[0] || other[1] != all[1];
      return fail(BRAID_ERR_MISMATCH,
                  "Reducer::create: rank " + std::to_string(q) + " registered " + std::to_string(other[0]) +
                      " parameters and " + std::to_string(other[2]) + " buffers, rank 0 " +
                      std::to_string(all[0]) + " and " + std::to_string(all[2]) + "; their " +
                      (params_differ ? "parameter" : "buffer") + " shapes or dtypes differ");
    }
  }

  // Buckets in reverse registration order, one open bucket per dtype.
  s->options = options;
  s->params = std::move(parameters);
  s->buffers = std::move(buffers);
  const size_t n = s->params.size();
  s->bucket_of.assign(n, 0);
  s->offset_of.assign(n, 0);
  s->ready.assign(n, false);
  s->given.assign(n, false);
  s->used_last.assign(n, true);
  s->accumulated.assign(n, false);
  std::vector<std::pair<braid_dtype_t, size_t>> open;  // dtype -> bucket index
  for (size_t k = n; k-- > 0;) {
    const braid_dtype_t dt = s->params[k].dtype;
    size_t* slot = nullptr;
    for (auto& [t, b] : open) {
      if (t == dt) slot = &b;
    }
    const size_t limit = slot != nullptr && *slot == 0 ? options.first_bucket_bytes : options.bucket_bytes;
    if (slot != nullptr && s->buckets[*slot].info.bytes + s->bytes(k) > limit) {
      *slot = s->buckets.size();
      s->buckets.emplace_back();
      s->buckets.back().info.dtype = dt;
    } else if (slot == nullptr) {
      open.emplace_back(dt, s->buckets.size());
      slot = &open.back().second;
      s->buckets.emplace_back();
      s->buckets.back().info.dtype = dt;
    }
    State::Bucket& b = s->buckets[*slot];
    s->bucket_of[k] = *slot;
    s->offset_of[k] = b.count;
    b.info.parameters.push_back(k);
    b.count += s->params[k].count;
    b.info.bytes += s->bytes(k);
  }
  // Buckets start in order, so that order must be the order they fill in:
  // by the earliest-registered parameter each holds (its gradient comes
  // last). With one dtype that is the order they were opened in; with
  // several (bf16 weights, fp32 norms), the fp32 bucket opened first holds
  // every layer's norm, fills at the end of the pass, and would have held
  // back every bf16 bucket behind it.
  {
    std::vector<size_t> order(s->buckets.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return s->buckets[a].info.parameters.back() > s->buckets[b].info.parameters.back();
    });
    std::vector<State::Bucket> sorted;
    for (size_t k : order) sorted.push_back(std::move(s->buckets[k]));
    s->buckets = std::move(sorted);
    for (size_t k = 0; k < s->buckets.size(); ++k)
      for (size_t i : s->buckets[k].info.parameters) s->bucket_of[i] = k;
  }
  std::vector<size_t> offsets;
  size_t arena_bytes = 0;
  for (State::Bucket& b : s->buckets) {
    b.marks = 1 + (options.allow_unused_parameters ? b.info.parameters.size() : 0);
    offsets.push_back(arena_bytes);
    arena_bytes += (b.info.bytes + b.marks * braid_dtype_size(b.info.dtype) + 63) / 64 * 64;
    b.pending = b.info.parameters.size();
    s->infos.push_back(b.info);
  }
  if (Result r = s->make_arena(arena_bytes); !r) return r;
  for (size_t k = 0; k < s->buckets.size(); ++k) s->buckets[k].storage = s->arena + offsets[k];

  // Start every replica from rank 0's values: parameters packed per bucket.
  for (size_t k = 0; k < s->buckets.size(); ++k) {
    State::Bucket& b = s->buckets[k];
    for (size_t i : b.info.parameters) copy_bytes(s->slot(i), s->params[i].data, s->bytes(i));
    if (Result r =
            s->broadcast(b.storage, b.count, b.info.dtype, "the parameters of bucket " + std::to_string(k));
        !r) {
      return r;
    }
    for (size_t i : b.info.parameters) copy_bytes(s->params[i].data, s->slot(i), s->bytes(i));
    std::memset(b.storage, 0, b.info.bytes);  // gradients kept in the bucket start at zero
  }
  std::unique_ptr<Reducer> made(new Reducer(std::move(s)));
  if (Result r = made->sync_buffers(); !r) return r;
  *out = std::move(made);
  return {};
}

Reducer::Reducer(std::unique_ptr<State> state) : state_(std::move(state)) {}

Reducer::~Reducer() {
  // Requests still in flight write into bucket storage: let them finish. A
  // step this rank began is dropped (peers fail fast instead of waiting for
  // buckets that never come).
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->step_begun)
    state_->drop_step();
  else
    state_->wait_started();
}

Result Reducer::mark_ready(size_t i) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  if (i >= s.params.size()) {
    return fail(BRAID_ERR_INVALID_ARGUMENT, "mark_ready: parameter index " + std::to_string(i) +
                                                " is out of range (" + std::to_string(s.params.size()) +
                                                " parameters)");
  }
  if (s.ready[i]) {
    return fail(BRAID_ERR_INVALID_USAGE,
                "mark_ready: " + label(s.params[i].name, i) + " was marked ready twice in one step");
  }
  if (!s.step_begun) {
    s.step_begun = true;
    s.step_sync = s.sync;
  }
  s.ready[i] = true;
  if (!s.step_sync) {
    s.accumulated[i] = true;
    return {};
  }
  s.given[i] = true;
  if (s.params[i].grad != nullptr) copy_bytes(s.slot(i), s.params[i].grad, s.bytes(i));
  --s.buckets[s.bucket_of[i]].pending;
  return s.start_ready_buckets();
}

Result Reducer::finish() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.step_synchronised()) {
    s.reset_step();
    return {};
  }
  std::vector<size_t> missing;
  for (size_t i = 0; i < s.params.size(); ++i) {
    if (!s.ready[i]) missing.push_back(i);
  }
  if (!missing.empty() && !s.options.allow_unused_parameters) {
    std::string msg =
        "finish: " + label(s.params[missing[0]].name, missing[0]) + " never became ready in this step";
    if (missing.size() > 1) msg += " (and " + std::to_string(missing.size() - 1) + " more)";
    msg +=
        "; every parameter needs a gradient each step, or set Options::allow_unused_parameters "
        "(this rank drops the step, and so do its peers)";
    s.drop_step();
    s.reset_step();
    return fail(BRAID_ERR_INVALID_USAGE, msg);
  }
  // Gradients that live in their bucket slot and go unused here: what they
  // hold comes back if no rank used them (as for a Parameter's own grad).
  std::vector<std::pair<size_t, std::vector<unsigned char>>> kept;
  for (size_t i : missing) {
    // Unused in this step: zeros, or what it accumulated under no_sync (as
    // torch's DDP sends a gradient that is defined). A slot (grad ==
    // nullptr) holds that already.
    if (!s.accumulated[i]) {
      if (s.params[i].grad == nullptr && s.bytes(i) > 0)
        kept.emplace_back(i, std::vector<unsigned char>(s.slot(i), s.slot(i) + s.bytes(i)));
      std::memset(s.slot(i), 0, s.bytes(i));  // all-zero bits are zero in every floating dtype
    } else if (s.params[i].grad != nullptr) {
      copy_bytes(s.slot(i), s.params[i].grad, s.bytes(i));
    }
    s.ready[i] = true;
    --s.buckets[s.bucket_of[i]].pending;
  }
  s.start_ready_buckets(true);
  Result result = s.wait_started();
  if (const int dropped = result.ok() ? s.ranks_that_dropped() : 0; dropped != 0) {
    result = fail(BRAID_ERR_INVALID_USAGE,
                  "finish: " + (dropped > 0 ? std::to_string(dropped) + " rank(s)" : std::string("a rank")) +
                      " dropped this step (abandon_step, a failed finish() or a Reducer destroyed mid-step "
                      "there); its gradients are not averages: zero them and go on, or stop");
  } else if (result.ok()) {
    for (const State::Bucket& b : s.buckets)
      for (size_t j = 1; j < b.marks; ++j)
        s.used_last[b.info.parameters[j - 1]] = marked(b.info.dtype, s.mark(b, j));
    for (size_t i = 0; i < s.params.size(); ++i) {
      // A gradient no rank gave is left as it was, as torch's DDP leaves it.
      if (s.params[i].grad != nullptr && s.used_last[i]) copy_bytes(s.params[i].grad, s.slot(i), s.bytes(i));
    }
    for (const auto& [i, bytes] : kept)
      if (!s.used_last[i]) copy_bytes(s.slot(i), bytes.data(), bytes.size());
  } else {
    result.message = "finish: " + result.message;
  }
  s.last_order = s.start_order;
  s.accumulated.assign(s.params.size(), false);
  s.reset_step();
  return result;
}

bool Reducer::step_synchronised() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->step_synchronised();
}

Result Reducer::abandon_step() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  Result result;
  if (s.step_synchronised()) {
    result = s.drop_step();
    s.accumulated.assign(s.params.size(), false);  // as finish() would
  } else {
    result = s.wait_started();  // a local step: what no_sync accumulated stays
  }
  s.reset_step();
  return result;
}

void* Reducer::grad(size_t i) const {
  if (i >= state_->params.size()) return nullptr;
  return state_->params[i].grad != nullptr ? state_->params[i].grad : state_->slot(i);
}

Reducer::NoSync::NoSync(Reducer* reducer) : reducer_(reducer) {
  std::lock_guard<std::mutex> lock(reducer_->state_->mu);
  previous_ = reducer_->state_->sync;
  reducer_->state_->sync = false;
}

Reducer::NoSync::~NoSync() {
  std::lock_guard<std::mutex> lock(reducer_->state_->mu);
  reducer_->state_->sync = previous_;
}

Result Reducer::sync_buffers() {
  State& s = *state_;
  for (size_t i = 0; i < s.buffers.size(); ++i) {
    Buffer& b = s.buffers[i];
    if (b.count == 0) continue;
    const std::string what = label(b.name, i, "buffer");
    if (Result r = s.broadcast(b.data, b.count, b.dtype, what); !r) return r;
  }
  return {};
}

Result Reducer::move_buffer(size_t index, void* data, size_t count) {
  State& s = *state_;
  if (index >= s.buffers.size())
    return fail(BRAID_ERR_INVALID_ARGUMENT, "move_buffer: buffer index " + std::to_string(index) +
                                                " is out of range (" + std::to_string(s.buffers.size()) +
                                                " buffers)");
  Buffer& b = s.buffers[index];
  const std::string who = "move_buffer: " + label(b.name, index, "buffer");
  if (count != b.count)
    return fail(BRAID_ERR_INVALID_ARGUMENT, who + " now has " + std::to_string(count) + " elements, where " +
                                                std::to_string(b.count) + " were registered");
  if (data == nullptr && count > 0) return fail(BRAID_ERR_INVALID_ARGUMENT, who + ": data is null");
  b.data = data;
  return {};
}

const std::vector<BucketInfo>& Reducer::buckets() const {
  return state_->infos;
}

size_t Reducer::buckets_started() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->next_to_start;
}

std::vector<size_t> Reducer::last_start_order() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->last_order;
}

bool Reducer::used_in_last_step(size_t i) const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return i < state_->used_last.size() && state_->used_last[i];
}

braid_comm_t Reducer::bucket_comm() const {
  return state_->bucket_comm;
}

bool Reducer::buckets_registered() const {
  return state_->registered;
}

size_t Reducer::num_parameters() const {
  return state_->params.size();
}

}  // namespace braid::ddp
