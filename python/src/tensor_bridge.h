// Tensors across the Python boundary by DLPack, with no libtorch: the engine's memory goes
// out as a "dltensor" capsule any DLPack consumer (torch.utils.dlpack.from_dlpack) wraps
// without a copy, and a caller's tensor comes in as a capsule it made (to_dlpack) that is
// borrowed for the length of one call.
#pragma once

#include <Python.h>

#include <cstddef>
#include <cstdint>

#include <dlpack/dlpack.h>

#include "engine/core/dtype.h"
#include "engine/core/status.h"

namespace strata::python {

// A capsule viewing `numel` elements of `dtype` at `data` on `device` as a 1-D tensor.
// The memory stays the engine's: the tensor must not be used after the engine gives the
// memory back (the front end drops its views first). New reference.
PyObject* make_capsule(void* data, size_t numel, DType dtype, DLDevice device);

// A caller's tensor, borrowed from its capsule: host memory, C-contiguous. The capsule is
// consumed (renamed "used_dltensor"); the tensor's producer is told it may free it when
// this object goes (the caller keeps its own reference to the tensor anyway).
class BorrowedTensor {
 public:
  static StatusOr<BorrowedTensor> borrow(PyObject* capsule, DType expected, const char* what);
  BorrowedTensor(BorrowedTensor&& other) noexcept : managed_(other.managed_) { other.managed_ = nullptr; }
  BorrowedTensor& operator=(BorrowedTensor&&) = delete;
  BorrowedTensor(const BorrowedTensor&) = delete;
  ~BorrowedTensor();

  void* data() const;
  size_t numel() const;

 private:
  explicit BorrowedTensor(DLManagedTensor* managed) : managed_(managed) {}
  DLManagedTensor* managed_;
};

}  // namespace strata::python
