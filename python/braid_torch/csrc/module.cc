// Python binding: exposes BraidBackend as a subclass of torch's
// c10d Backend so torch.distributed can hold it as a process group backend.
#include <pybind11/chrono.h>
#include <torch/python.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "backend.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "braid backend for torch.distributed";
  // The base class is registered by torch._C._distributed_c10d, which the
  // package imports first.
  py::class_<braid_torch::BraidBackend, c10d::Backend, c10::intrusive_ptr<braid_torch::BraidBackend>>(
      m, "BraidBackend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, const std::string& group_name) {
             return c10::make_intrusive<braid_torch::BraidBackend>(store, rank, size, timeout, group_name);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("group_name"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly(
          "comm_handle",
          [](const braid_torch::BraidBackend& b) { return reinterpret_cast<uintptr_t>(b.comm()); })
      // What torch's C++ asks a backend (c10d::ErrorType, registered by
      // torch), which its Python binding of ProcessGroup does not expose.
      .def("get_error", &braid_torch::BraidBackend::getError);
  m.def("version", [] {
    int v = 0;
    braid_get_version(&v);
    return v;
  });
}
