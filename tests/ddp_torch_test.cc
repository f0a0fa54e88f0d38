// The libtorch adapter of the DDP layer on forked ranks: a wrapped module
// trains like one process on the whole batch, replicas stay identical,
// no_sync accumulates, and an unused parameter is named.
#include <gtest/gtest.h>
#include <braid/ddp_torch.hpp>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "tests/rank_test.h"

namespace {

constexpr int kIn = 8, kHidden = 16, kOut = 4, kBatch = 24;

torch::nn::Sequential make_model(int seed, int hidden = kHidden) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(kIn, hidden), torch::nn::ReLU(),
                               torch::nn::Linear(hidden, kOut));
}

struct Data {
  torch::Tensor x, t;
  Data() {
    torch::manual_seed(1234);
    x = torch::rand({kBatch, kIn}) * 2 - 1;
    t = torch::rand({kBatch, kOut});
  }
};

torch::Tensor loss_of(torch::nn::Sequential& m, const torch::Tensor& x, const torch::Tensor& t) {
  return torch::mse_loss(m->forward(x), t);
}

// Largest relative difference between the parameters of two models.
double max_rel_diff(torch::nn::Sequential& a, torch::nn::Sequential& b) {
  double worst = 0;
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    auto rel = (pa[i] - pb[i]).abs() / pb[i].abs().clamp_min(1e-3);
    worst = std::max(worst, rel.max().item<double>());
  }
  return worst;
}

void expect_identical_across_ranks(braid_comm_t comm, torch::nn::Sequential& m, int nranks) {
  for (const auto& p : m->parameters()) {
    const size_t n = static_cast<size_t>(p.numel());
    std::vector<float> all(n * nranks);
    BRAID_ASSERT_OK(braid_all_gather(p.data_ptr<float>(), all.data(), n, BRAID_FLOAT32, comm, nullptr));
    for (int q = 1; q < nranks; ++q) {
      EXPECT_EQ(std::memcmp(&all[q * n], all.data(), n * sizeof(float)), 0) << "rank " << q << " differs";
    }
  }
}

void train_like_one_process(int nranks, const braid::ddp::Options& options) {
  braid::test::run_ranks(nranks, {}, [&](braid_comm_t comm, int rank, int n) {
    torch::set_num_threads(1);
    const Data data;
    auto model = make_model(10 + rank);  // wrap() replaces these with rank 0's values
    auto ddp = braid::ddp::wrap(*model, comm, options);
    auto alone = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
    torch::nn::Sequential reference(alone);
    ASSERT_EQ(max_rel_diff(model, reference), 0.0);
    torch::optim::SGD opt(model->parameters(), 0.1), ref_opt(reference->parameters(), 0.1);
    const int rows = kBatch / n;
    for (int step = 0; step < 20; ++step) {
      opt.zero_grad();  // set_to_none: the adapter moves each new gradient into its bucket
      loss_of(model, data.x.narrow(0, rank * rows, rows), data.t.narrow(0, rank * rows, rows)).backward();
      opt.step();
      ref_opt.zero_grad();
      loss_of(reference, data.x, data.t).backward();
      ref_opt.step();
    }
    const double worst = max_rel_diff(model, reference);
    EXPECT_LE(worst, 1e-5);
    if (rank == 0) std::printf("libtorch, %d ranks, 20 steps: largest relative difference %.2e\n", n, worst);
    expect_identical_across_ranks(comm, model, n);
  });
}

TEST(DdpTorch, TwoRanksTrainLikeOneProcess) {
  braid::ddp::Options small;
  small.first_bucket_bytes = 16;
  small.bucket_bytes = 300;
  train_like_one_process(2, small);
}

TEST(DdpTorch, FourRanksTrainLikeOneProcess) {
  train_like_one_process(4, {});
}

TEST(DdpTorch, NoSyncAccumulates) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int rank, int n) {
    torch::set_num_threads(1);
    const Data data;
    auto model = make_model(3);
    auto ddp = braid::ddp::wrap(*model, comm);
    auto reference =
        torch::nn::Sequential(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone()));
    torch::optim::SGD opt(model->parameters(), 0.1), ref_opt(reference->parameters(), 0.1);
    const int half = kBatch / 2, rows = half / n;
    for (int step = 0; step < 5; ++step) {
      opt.zero_grad();
      {
        auto scope = ddp->no_sync();
        loss_of(model, data.x.narrow(0, rank * rows, rows), data.t.narrow(0, rank * rows, rows)).backward();
        EXPECT_EQ(ddp->reducer().buckets_started(), 0u);
      }
      loss_of(model, data.x.narrow(0, half + rank * rows, rows), data.t.narrow(0, half + rank * rows, rows))
          .backward();
      opt.step();
      ref_opt.zero_grad();
      loss_of(reference, data.x.narrow(0, 0, half), data.t.narrow(0, 0, half)).backward();
      loss_of(reference, data.x.narrow(0, half, half), data.t.narrow(0, half, half)).backward();
      ref_opt.step();
    }
    EXPECT_LE(max_rel_diff(model, reference), 1e-5);
  });
}

struct WithSpare : torch::nn::Module {
  WithSpare() {
    torch::manual_seed(5);
    used = register_module("used", torch::nn::Linear(kIn, kOut));
    spare = register_module("spare", torch::nn::Linear(kIn, kOut));
  }
  torch::Tensor forward(const torch::Tensor& x) { return used->forward(x); }
  torch::nn::Linear used{nullptr}, spare{nullptr};
};

TEST(DdpTorch, UnusedParameterIsNamedOrAllowed) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int, int) {
    torch::set_num_threads(1);
    const Data data;
    {
      WithSpare m;
      auto ddp = braid::ddp::wrap(m, comm);
      try {
        torch::mse_loss(m.forward(data.x), data.t).backward();
        ADD_FAILURE() << "backward with an unused parameter did not throw";
      } catch (const std::exception& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("parameter 'spare.weight' (index 2) never became ready"), std::string::npos)
            << what;
      }
    }
    WithSpare m;
    braid::ddp::Options allow;
    allow.allow_unused_parameters = true;
    auto ddp = braid::ddp::wrap(m, comm, allow);
    // Unused on every rank: its grad stays None, as torch's DDP leaves it
    // (an optimizer then skips it; weight decay would move it otherwise).
    torch::mse_loss(m.forward(data.x), data.t).backward();
    EXPECT_FALSE(m.spare->weight.grad().defined());
    EXPECT_GT(m.used->weight.grad().abs().sum().item<float>(), 0.0f);
  });
}

// `spare` joins the output only while use_spare is set.
struct Switchable : torch::nn::Module {
  Switchable() {
    torch::manual_seed(6);
    used = register_module("used", torch::nn::Linear(kIn, kOut));
    spare = register_module("spare", torch::nn::Linear(kIn, kOut));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return use_spare ? used->forward(x) + spare->forward(x) : used->forward(x);
  }
  torch::nn::Linear used{nullptr}, spare{nullptr};
  bool use_spare = true;
};

// Used on rank 0 only: every rank gets the average, rank 1 a grad it never
// computed. Frozen parameters start from rank 0's values, as torch's DDP
// broadcasts them.
TEST(DdpTorch, AParameterOneRankUsesIsAveragedAndFrozenOnesComeFromRankZero) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int rank, int) {
    torch::set_num_threads(1);
    const Data data;
    Switchable m;
    m.use_spare = rank == 0;
    m.used->bias.set_requires_grad(false);
    {
      torch::NoGradGuard no_grad;
      m.used->bias.fill_(static_cast<float>(rank + 1));
    }
    braid::ddp::Options allow;
    allow.allow_unused_parameters = true;
    auto ddp = braid::ddp::wrap(m, comm, allow);
    EXPECT_EQ(m.used->bias.min().item<float>(), 1.0f);
    EXPECT_EQ(m.used->bias.max().item<float>(), 1.0f);
    EXPECT_FALSE(m.used->bias.grad().defined());
    torch::mse_loss(m.forward(data.x), data.t).backward();
    ASSERT_TRUE(m.spare->weight.grad().defined());
    const torch::Tensor g = m.spare->weight.grad().clone();
    std::vector<float> both(2 * g.numel());
    BRAID_ASSERT_OK(
        braid_all_gather(g.data_ptr<float>(), both.data(), g.numel(), BRAID_FLOAT32, comm, nullptr));
    EXPECT_EQ(std::memcmp(both.data(), both.data() + g.numel(), g.numel() * sizeof(float)), 0);
    EXPECT_GT(g.abs().sum().item<float>(), 0.0f);
  });
}

double max_rel_diff(torch::nn::Module& a, torch::nn::Module& b) {
  double worst = 0;
  auto pa = a.parameters(), pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    auto rel = (pa[i] - pb[i]).abs() / pb[i].abs().clamp_min(1e-3);
    worst = std::max(worst, rel.max().item<double>());
  }
  return worst;
}

// After a synchronised step, a no_sync pass that leaves a parameter unused
// (its grad set to None) must leave it None, not an earlier step's average
// from its bucket slot, which the next pass would add to.
TEST(DdpTorch, NoSyncLeavesAnUnusedGradientUndefined) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int rank, int n) {
    torch::set_num_threads(1);
    const Data data;
    Switchable m, ref;
    auto ddp = braid::ddp::wrap(m, comm);
    torch::optim::SGD opt(m.parameters(), 0.1), ref_opt(ref.parameters(), 0.1);
    const int half = kBatch / 2, rows = half / n;
    auto mine = [&](int from) {
      return std::make_pair(data.x.narrow(0, from + rank * rows, rows),
                            data.t.narrow(0, from + rank * rows, rows));
    };
    auto loss = [](Switchable& s, const std::pair<torch::Tensor, torch::Tensor>& b) {
      return torch::mse_loss(s.forward(b.first), b.second);
    };
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      {
        auto scope = ddp->no_sync();
        m.use_spare = false;
        loss(m, mine(0)).backward();
      }
      if (step > 0) {
        EXPECT_FALSE(m.spare->weight.grad().defined()) << "step " << step;
      }
      m.use_spare = true;
      loss(m, mine(half)).backward();
      opt.step();
      ref_opt.zero_grad();
      ref.use_spare = false;
      loss(ref, {data.x.narrow(0, 0, half), data.t.narrow(0, 0, half)}).backward();
      ref.use_spare = true;
      loss(ref, {data.x.narrow(0, half, half), data.t.narrow(0, half, half)}).backward();
      ref_opt.step();
    }
    EXPECT_LE(max_rel_diff(m, ref), 1e-5);
  });
}

// Throws from its backward while `fail` is set: between the two layers, so
// the later layer's gradients (and their hooks) come before the throw.
struct Thrower : torch::autograd::Function<Thrower> {
  static inline bool fail = false;
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    if (fail) throw std::runtime_error("injected failure in backward");
    return g;
  }
};

struct TwoLayers : torch::nn::Module {
  TwoLayers() {
    torch::manual_seed(8);
    fc1 = register_module("fc1", torch::nn::Linear(kIn, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kOut));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(Thrower::apply(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// A backward pass that throws never runs the end-of-backward callback; the
// next pass drops that step and trains as usual.
TEST(DdpTorch, ABackwardThatThrowsLeavesTheNextStepWorking) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int rank, int n) {
    torch::set_num_threads(1);
    const Data data;
    TwoLayers m, ref;
    braid::ddp::Options small;
    small.bucket_bytes = small.first_bucket_bytes = 256;  // fc2's bucket starts before the throw
    auto ddp = braid::ddp::wrap(m, comm, small);
    torch::optim::SGD opt(m.parameters(), 0.1), ref_opt(ref.parameters(), 0.1);
    const int rows = kBatch / n;
    const torch::Tensor x = data.x.narrow(0, rank * rows, rows), t = data.t.narrow(0, rank * rows, rows);
    Thrower::fail = true;
    try {
      torch::mse_loss(m.forward(x), t).backward();
      ADD_FAILURE() << "the injected failure did not throw";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("injected failure"), std::string::npos) << e.what();
    }
    Thrower::fail = false;
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      torch::mse_loss(m.forward(x), t).backward();
      opt.step();
      ref_opt.zero_grad();
      torch::mse_loss(ref.forward(data.x), data.t).backward();
      ref_opt.step();
    }
    EXPECT_LE(max_rel_diff(m, ref), 1e-5);
  });
}

// The mismatch is an exception on every rank, also where the parameters
// already have gradients (the destructor of the half-made wrapper read
// gradient views it had not made yet, and crashed).
TEST(DdpTorch, DifferentModelsThrow) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int rank, int) {
    torch::set_num_threads(1);
    auto model = make_model(1, rank == 0 ? kHidden : kHidden + 2);
    const Data data;
    loss_of(model, data.x, data.t).backward();
    try {
      auto ddp = braid::ddp::wrap(*model, comm);
      ADD_FAILURE() << "wrap of different models did not throw";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("parameter '0.weight' (index 0) has shape [" +
                                           std::to_string(kHidden + 2) + ", " + std::to_string(kIn) +
                                           "] float32 on rank 1 and shape [" + std::to_string(kHidden) +
                                           ", " + std::to_string(kIn) + "] float32 on rank 0"),
                std::string::npos)
          << e.what();
    }
  });
}

// A parameter of the same size in another shape is a different model too,
// as torch's DDP finds: wrap throws on every rank, naming both shapes.
struct Shaped : torch::nn::Module {
  explicit Shaped(bool transposed) {
    w = register_parameter("w", transposed ? torch::zeros({4, 2}) : torch::zeros({2, 4}));
  }
  torch::Tensor w;
};

TEST(DdpTorch, AParameterInAnotherShapeThrows) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int rank, int) {
    torch::set_num_threads(1);
    Shaped m(rank == 1);
    try {
      auto ddp = braid::ddp::wrap(m, comm);
      ADD_FAILURE() << "wrap of parameters in different shapes did not throw on rank " << rank;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("parameter 'w' (index 0) has shape [4, 2] float32 on rank 1 and "
                                           "shape [2, 4] float32 on rank 0"),
                std::string::npos)
          << e.what();
    }
  });
}

// A tensor braid cannot take on one rank only (here an int16 buffer) fails
// wrap on every rank at once, each naming what it can: it threw on that
// rank before the others' comparison, which then waited out the timeout.
struct WithCounter : torch::nn::Module {
  explicit WithCounter(bool int16) {
    torch::manual_seed(3);
    fc = register_module("fc", torch::nn::Linear(kIn, kOut));
    counter = register_buffer("counter", torch::zeros({2}, int16 ? torch::kShort : torch::kInt));
  }
  torch::nn::Linear fc{nullptr};
  torch::Tensor counter;
};

TEST(DdpTorch, ATensorOneRankCannotTakeFailsWrapEverywhere) {
  braid::test::run_ranks(2, {{"BRAID_TIMEOUT", "60"}}, [&](braid_comm_t comm, int rank, int) {
    torch::set_num_threads(1);
    WithCounter m(rank == 1);
    const auto start = std::chrono::steady_clock::now();
    try {
      auto ddp = braid::ddp::wrap(m, comm);
      ADD_FAILURE() << "wrap did not throw on rank " << rank;
    } catch (const std::runtime_error& e) {
      const char* expected = rank == 1 ? "buffer 'counter' has dtype Short, which braid does not handle"
                                       : "rank 1 refused its arguments";
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20)) << "rank " << rank;
  });
}

// sync_buffers broadcasts into a buffer's storage as it is now: loading a
// checkpoint gives buffers new storage (Tensor::set_), and the broadcast
// went to the freed one, leaving the buffers as loaded.
TEST(DdpTorch, SyncBuffersFollowsABufferGivenNewStorage) {
  braid::test::run_ranks(2, {}, [&](braid_comm_t comm, int rank, int) {
    torch::set_num_threads(1);
    torch::manual_seed(5);
    torch::nn::BatchNorm1d bn(kOut);
    auto ddp = braid::ddp::wrap(*bn, comm);
    {
      torch::NoGradGuard no_grad;
      bn->running_mean.set_(torch::full({kOut}, static_cast<float>(rank + 1)));
      bn->running_var.set_(torch::full({kOut}, static_cast<float>(rank + 5)));
    }
    ddp->sync_buffers();
    EXPECT_EQ(bn->running_mean.min().item<float>(), 1.0f);
    EXPECT_EQ(bn->running_mean.max().item<float>(), 1.0f);
    EXPECT_EQ(bn->running_var.max().item<float>(), 5.0f);
    {
      torch::NoGradGuard no_grad;
      bn->running_mean.set_(torch::zeros({kOut + 1}));
    }
    try {
      ddp->sync_buffers();
      ADD_FAILURE() << "a buffer of another size was broadcast";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "buffer 'running_mean' (index 0) now has 5 elements, where 4 were registered"),
                std::string::npos)
          << e.what();
    }
  });
}

}  // namespace
