// Small index helpers the algorithms share.
#pragma once

#include <algorithm>
#include <cstddef>

namespace braid {

inline int mod(int a, int n) {
  return ((a % n) + n) % n;
}

// Splits [0, total) into n near-equal parts; part k is [begin(k), begin(k+1)).
// With `align`, every part but the last is a multiple of it (device kernels
// load 16 bytes at a time where every pointer allows).
struct Split {
  size_t total, n, part;
  Split(size_t t, size_t parts, size_t align = 1)
      : total(t), n(parts), part(((t + parts - 1) / parts + align - 1) / align * align) {}
  size_t begin(size_t k) const { return std::min(total, k * part); }
  size_t size(size_t k) const { return begin(k + 1) - begin(k); }
};

}  // namespace braid
