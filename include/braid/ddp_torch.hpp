// braid::ddp for libtorch: DistributedDataParallel for C++ training code.
//
//   auto ddp = braid::ddp::wrap(model, comm);   // model: torch::nn::Module
//   for each step:
//     optimizer.zero_grad();
//     loss = ...; loss.backward();             // gradients now averaged over ranks
//     optimizer.step();
//
// wrap() broadcasts rank 0's parameters and buffers, then hooks every
// parameter's gradient accumulator: as a gradient is final its bucket fills,
// a full bucket's all_reduce starts while the backward pass goes on, and the
// end of the backward pass waits for all of them. Each parameter's grad is a
// view into its bucket (no copies), as torch's gradient_as_bucket_view.
//
// CPU tensors only in this build. Failures throw std::runtime_error with
// braid's message, from wrap() or from backward(). Not supported: a backward
// pass that runs another one inside it (reentrant checkpointing, an autograd
// Function calling backward): the inner pass's gradients are taken for a new
// pass, which drops the outer step on every rank (backward() throws).
#ifndef BRAID_DDP_TORCH_HPP_
#define BRAID_DDP_TORCH_HPP_

#include <torch/torch.h>
#include <braid/ddp.hpp>

#include <cstdint>
#include <memory>
#include <vector>

namespace braid::ddp {

class ModuleDdp {
 public:
  ~ModuleDdp();
  ModuleDdp(const ModuleDdp&) = delete;
  ModuleDdp& operator=(const ModuleDdp&) = delete;

  // Gradient accumulation: backward passes inside the scope do not
  // communicate; the first one after it averages the accumulated gradients.
  Reducer::NoSync no_sync() { return reducer_->no_sync(); }
  // Broadcasts the module's buffers from rank 0 again (e.g. BatchNorm statistics).
  void sync_buffers();
  Reducer& reducer() { return *reducer_; }

 private:
  friend std::unique_ptr<ModuleDdp> wrap(torch::nn::Module& module, braid_comm_t comm,
                                         const Options& options);
  struct Hook;
  ModuleDdp() = default;
  void on_gradient(size_t index);
  void end_of_backward();

  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> buffers_;
  std::vector<torch::Tensor> grad_views_;  // parameter i's slot in its bucket
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  std::unique_ptr<Reducer> reducer_;
  // The backward pass (autograd graph task) whose end callback is queued:
  // one that threw never runs it, and the next one must drop its step.
  bool end_queued_ = false;
  int queued_task_ = 0;
};

// Collective over comm. Throws std::runtime_error naming the parameter or the
// failure (e.g. a CUDA or non-contiguous parameter, different models on
// different ranks).
std::unique_ptr<ModuleDdp> wrap(torch::nn::Module& module, braid_comm_t comm, const Options& options = {});

}  // namespace braid::ddp

#endif  // BRAID_DDP_TORCH_HPP_
