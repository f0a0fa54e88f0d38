// The libtorch adapter of the DDP layer: autograd hooks drive the Reducer.
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <braid/ddp_torch.hpp>

#include <stdexcept>
#include <string>
#include <utility>

namespace braid::ddp {
namespace {

[[noreturn]] void throw_result(const Result& r) {
  throw std::runtime_error("braid ddp: " + r.message);
}

// A dtype no braid call takes: Reducer::create refuses it on this rank, and
// so fails on every rank at once (a throw before create left the peers
// waiting in it until their timeout).
constexpr braid_dtype_t kRefused = static_cast<braid_dtype_t>(-1);

// Why `what` (a CPU, contiguous tensor of a dtype braid handles) cannot be
// used, or "".
std::string refusal(const std::string& what, const torch::Tensor& t) {
  if (!t.device().is_cpu())
    return "braid ddp: " + what + " is on " + t.device().str() +
           "; this build of braid handles CPU tensors only";
  if (!t.is_contiguous()) return "braid ddp: " + what + " is not contiguous";
  return "";
}

// The braid dtype of `t`, or kRefused with *why set (the first reason kept).
braid_dtype_t checked_dtype(const std::string& what, const torch::Tensor& t, std::string* why) {
  std::string reason = refusal(what, t);
  if (reason.empty()) {
    static const std::pair<c10::ScalarType, braid_dtype_t> kTable[] = {
        {c10::kFloat, BRAID_FLOAT32},     {c10::kDouble, BRAID_FLOAT64}, {c10::kHalf, BRAID_FLOAT16},
        {c10::kBFloat16, BRAID_BFLOAT16}, {c10::kChar, BRAID_INT8},      {c10::kByte, BRAID_UINT8},
        {c10::kBool, BRAID_UINT8},        {c10::kInt, BRAID_INT32},      {c10::kLong, BRAID_INT64}};
    for (const auto& [torch_type, braid_type] : kTable) {
      if (t.scalar_type() == torch_type) return braid_type;
    }
    reason = "braid ddp: " + what + " has dtype " + std::string(c10::toString(t.scalar_type())) +
             ", which braid does not handle";
  }
  if (why->empty()) *why = reason;
  return kRefused;
}

}  // namespace

// Runs after AccumulateGrad has added this step's gradient to param.grad.
struct ModuleDdp::Hook : torch::autograd::FunctionPostHook {
  Hook(ModuleDdp* owner, size_t index) : owner_(owner), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    owner_->on_gradient(index_);
    return outputs;
  }
  ModuleDdp* owner_;
  size_t index_;
};

std::unique_ptr<ModuleDdp> wrap(torch::nn::Module& module, braid_comm_t comm, const Options& options) {
  std::unique_ptr<ModuleDdp> ddp(new ModuleDdp());
  std::vector<Parameter> params;
  std::vector<Buffer> buffers;
  std::string refused;  // this rank's first tensor braid cannot take
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const torch::Tensor& p = item.value();
    const braid_dtype_t dt = checked_dtype("parameter '" + item.key() + "'", p, &refused);
    if (!p.requires_grad()) {
      // Frozen: no gradient, but every replica starts from rank 0's values
      // (torch's DDP broadcasts every parameter), so it goes as a buffer.
      buffers.push_back({item.key(), p.data_ptr(), static_cast<size_t>(p.numel()), dt, p.sizes().vec()});
      ddp->buffers_.push_back(p);
      continue;
    }
    // grad == nullptr: the gradient lives in the bucket; param.grad becomes a view of it.
    params.push_back(
        {item.key(), p.data_ptr(), nullptr, static_cast<size_t>(p.numel()), dt, p.sizes().vec()});
    ddp->params_.push_back(p);
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    const torch::Tensor& b = item.value();
    const braid_dtype_t dt = checked_dtype("buffer '" + item.key() + "'", b, &refused);
    buffers.push_back({item.key(), b.data_ptr(), static_cast<size_t>(b.numel()), dt, b.sizes().vec()});
    ddp->buffers_.push_back(b);
  }
  {
    // Parameters are leaves that require grad: write their new values without autograd noticing.
    torch::NoGradGuard no_grad;
    if (Result r = Reducer::create(comm, std::move(params), std::move(buffers), options, &ddp->reducer_);
        !r) {
      if (!refused.empty()) throw std::runtime_error(refused);
      throw_result(r);
    }
  }
  for (size_t i = 0; i < ddp->params_.size(); ++i) {
    torch::Tensor& p = ddp->params_[i];
    // param.grad becomes the view once a gradient arrives (on_gradient):
    // until then it stays as it is (None), as with torch's DDP.
    ddp->grad_views_.push_back(
        torch::from_blob(ddp->reducer_->grad(i), p.sizes(), p.options().requires_grad(false)));
    ddp->accumulators_.push_back(torch::autograd::impl::grad_accumulator(p));
    ddp->hook_keys_.push_back(
        ddp->accumulators_.back()->add_post_hook(std::make_unique<ModuleDdp::Hook>(ddp.get(), i)));
  }
  return ddp;
}

ModuleDdp::~ModuleDdp() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
  // A parameter's grad may still be a view of a bucket that is about to go
  // (none where wrap threw before the views were made).
  for (size_t i = 0; i < grad_views_.size(); ++i) {
    if (params_[i].grad().defined() && params_[i].grad().data_ptr() == grad_views_[i].data_ptr()) {
      params_[i].mutable_grad() = grad_views_[i].clone();
    }
  }
}

void ModuleDdp::on_gradient(size_t index) {
  const int task = torch::autograd::get_current_graph_task_id();
  if (!end_queued_ || task != queued_task_) {
    // A callback still queued for another backward pass: that one threw, and
    // autograd drops the callbacks of a pass that fails. Its step goes too,
    // before this pass touches a slot its all_reduce may still write.
    if (end_queued_)
      if (Result r = reducer_->abandon_step(); !r) throw_result(r);
    end_queued_ = true;
    queued_task_ = task;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { end_of_backward(); });
  }
  torch::Tensor& p = params_[index];
  const torch::Tensor& view = grad_views_[index];
  // After zero_grad(set_to_none) AccumulateGrad made a new tensor: move it into the bucket.
  if (!p.grad().defined() || p.grad().data_ptr() != view.data_ptr()) {
    torch::NoGradGuard no_grad;
    if (p.grad().defined()) {
      view.copy_(p.grad());
    } else {
      view.zero_();
    }
    p.mutable_grad() = view;
  }
  if (Result r = reducer_->mark_ready(index); !r) throw_result(r);
}

void ModuleDdp::end_of_backward() {
  end_queued_ = false;
  const bool synchronised = reducer_->step_synchronised();
  if (Result r = reducer_->finish(); !r) throw_result(r);
  // Parameters unused here (allowed by the options) that another rank used
  // get the average. One no rank used keeps its grad, None included, as
  // torch's DDP leaves it; after a no_sync pass the slots hold an earlier
  // step's average, and undefined grads stay so too.
  if (!synchronised) return;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].grad().defined() && reducer_->used_in_last_step(i))
      params_[i].mutable_grad() = grad_views_[i];
  }
}

void ModuleDdp::sync_buffers() {
  torch::NoGradGuard no_grad;
  // A buffer's storage may have been replaced since wrap (torch::load sets
  // it anew): the broadcast goes where the data is now, not to the freed one.
  for (size_t i = 0; i < buffers_.size(); ++i) {
    const torch::Tensor& b = buffers_[i];
    if (std::string why = refusal("buffer (index " + std::to_string(i) + ")", b); !why.empty())
      throw std::runtime_error(why);
    if (Result r = reducer_->move_buffer(i, b.data_ptr(), static_cast<size_t>(b.numel())); !r)
      throw_result(r);
  }
  if (Result r = reducer_->sync_buffers(); !r) throw_result(r);
}

}  // namespace braid::ddp
