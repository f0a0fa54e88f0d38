// Python binding: exposes BraidBackend as a subclass of torch's
// c10d Backend so torch.distributed can hold it as a process group backend.
#include <pybind11/chrono.h>
#include <torch/python.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <algorithm>
#include <mutex>
#include <vector>

#include "backend.h"

namespace py = pybind11;

namespace {
std::mutex g_live_mu;
std::vector<c10::weak_intrusive_ptr<braid_torch::BraidBackend>> g_live;
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "braid backend for torch.distributed";
  // The base class is registered by torch._C._distributed_c10d, which the
  // package imports first.
  auto backend_class =
      py::class_<braid_torch::BraidBackend, c10d::Backend, c10::intrusive_ptr<braid_torch::BraidBackend>>(
          m, "BraidBackend");
  backend_class
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, const std::string& group_name) {
             auto backend =
                 c10::make_intrusive<braid_torch::BraidBackend>(store, rank, size, timeout, group_name);
             std::lock_guard<std::mutex> lock(g_live_mu);
             g_live.erase(
                 std::remove_if(g_live.begin(), g_live.end(), [](const auto& w) { return w.expired(); }),
                 g_live.end());
             g_live.emplace_back(backend);
             return backend;
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("group_name"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("comm_handle", [](const braid_torch::BraidBackend& b) {
        return reinterpret_cast<uintptr_t>(b.comm());
      });
#if BRAID_TORCH_HAS_ERROR_TYPE
  // What torch's C++ asks a backend (c10d::ErrorType, registered by torch
  // from 2.7), which its Python binding of ProcessGroup does not expose.
  backend_class.def("get_error", &braid_torch::BraidBackend::getError);
#endif
  // At the interpreter's exit (braid_torch registers it with atexit): every
  // live group with work pending is aborted and that work completed while
  // Python still runs the Futures' callbacks. Torch holds the groups; the
  // Python wrappers may be gone, hence weak references here.
  m.def(
      "_end_pending_groups",
      [] {
        std::vector<c10::intrusive_ptr<braid_torch::BraidBackend>> live;
        {
          std::lock_guard<std::mutex> lock(g_live_mu);
          for (const auto& w : g_live)
            if (auto b = w.lock()) live.push_back(std::move(b));
        }
        int ended = 0;
        for (auto& b : live) ended += b->end_if_pending() ? 1 : 0;
        return ended;
      },
      py::call_guard<py::gil_scoped_release>());
  m.def("version", [] {
    int v = 0;
    braid_get_version(&v);
    return v;
  });
}
