// A two-layer perceptron in plain C++ with a hand-written backward pass:
// the model of the DDP example and of the DDP layer's tests.
//
//   h = relu(x W1^T + b1),  y = h W2^T + b2,  loss = mean over rows of 0.5 |y - t|^2
//
// Parameters in registration order: 0 W1, 1 b1, 2 W2, 3 b2. The backward pass
// produces them in reverse (b2, W2, b1, W1) and reports each as it is final.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace braid::examples {

// Deterministic values in [-scale, scale) from a seed (SplitMix64).
inline void fill_uniform(std::vector<float>* v, uint64_t seed, float scale) {
  for (float& x : *v) {
    uint64_t z = (seed += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    x = scale * (static_cast<float>(z >> 40) / static_cast<float>(1 << 23) - 1.0f);
  }
}

// A regression task: inputs and the outputs of a fixed random "teacher".
struct Dataset {
  int rows = 0, in = 0, out = 0;
  std::vector<float> x, t;

  Dataset(int rows_, int in_, int out_, uint64_t seed) : rows(rows_), in(in_), out(out_) {
    x.resize(static_cast<size_t>(rows) * in);
    t.resize(static_cast<size_t>(rows) * out);
    fill_uniform(&x, seed, 1.0f);
    std::vector<float> teacher(static_cast<size_t>(in) * out);
    fill_uniform(&teacher, seed + 1, 1.0f);
    for (int r = 0; r < rows; ++r) {
      for (int o = 0; o < out; ++o) {
        float s = 0;
        for (int i = 0; i < in; ++i) s += x[r * in + i] * teacher[o * in + i];
        t[r * out + o] = s > 0 ? s : 0.5f * s;
      }
    }
  }
  const float* x_row(int r) const { return &x[static_cast<size_t>(r) * in]; }
  const float* t_row(int r) const { return &t[static_cast<size_t>(r) * out]; }
};

struct Mlp {
  static constexpr int kParams = 4;
  int in, hidden, out;
  std::vector<float> p[kParams];    // W1 (hidden x in), b1, W2 (out x hidden), b2
  std::vector<float> own[kParams];  // gradient storage unless redirected
  float* grad[kParams];             // where backward writes each gradient
  const char* names[kParams] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};

  Mlp(int in_, int hidden_, int out_, uint64_t seed) : in(in_), hidden(hidden_), out(out_) {
    const size_t sizes[kParams] = {static_cast<size_t>(hidden) * in, static_cast<size_t>(hidden),
                                   static_cast<size_t>(out) * hidden, static_cast<size_t>(out)};
    for (int k = 0; k < kParams; ++k) {
      p[k].resize(sizes[k]);
      fill_uniform(&p[k], seed + 17 * k, 0.5f);
      own[k].assign(sizes[k], 0.0f);
      grad[k] = own[k].data();
    }
  }
  size_t count(int k) const { return p[k].size(); }

  void zero_grad() {
    for (int k = 0; k < kParams; ++k) std::fill(grad[k], grad[k] + count(k), 0.0f);
  }

  // Forward and backward over `rows` rows; gradients of the mean loss are
  // added to grad[]. ready(k) is called as gradient k becomes final.
  float backward(const float* x, const float* t, int rows, const std::function<void(int)>& ready) {
    std::vector<float> pre(static_cast<size_t>(rows) * hidden), h(pre.size()),
        dy(static_cast<size_t>(rows) * out);
    float loss = 0;
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < hidden; ++j) {
        float s = p[1][j];
        for (int i = 0; i < in; ++i) s += p[0][j * in + i] * x[r * in + i];
        pre[r * hidden + j] = s;
        h[r * hidden + j] = s > 0 ? s : 0;
      }
      for (int o = 0; o < out; ++o) {
        float s = p[3][o];
        for (int j = 0; j < hidden; ++j) s += p[2][o * hidden + j] * h[r * hidden + j];
        const float d = s - t[r * out + o];
        loss += 0.5f * d * d / rows;
        dy[r * out + o] = d / rows;
      }
    }
    for (int r = 0; r < rows; ++r) {
      for (int o = 0; o < out; ++o) grad[3][o] += dy[r * out + o];
    }
    if (ready) ready(3);
    for (int r = 0; r < rows; ++r) {
      for (int o = 0; o < out; ++o) {
        for (int j = 0; j < hidden; ++j) grad[2][o * hidden + j] += dy[r * out + o] * h[r * hidden + j];
      }
    }
    if (ready) ready(2);
    std::vector<float> dpre(pre.size());
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < hidden; ++j) {
        float s = 0;
        for (int o = 0; o < out; ++o) s += dy[r * out + o] * p[2][o * hidden + j];
        dpre[r * hidden + j] = pre[r * hidden + j] > 0 ? s : 0;
      }
    }
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < hidden; ++j) grad[1][j] += dpre[r * hidden + j];
    }
    if (ready) ready(1);
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < hidden; ++j) {
        for (int i = 0; i < in; ++i) grad[0][j * in + i] += dpre[r * hidden + j] * x[r * in + i];
      }
    }
    if (ready) ready(0);
    return loss;
  }

  void sgd(float lr) {
    for (int k = 0; k < kParams; ++k) {
      for (size_t e = 0; e < count(k); ++e) p[k][e] -= lr * grad[k][e];
    }
  }
};

}  // namespace braid::examples
