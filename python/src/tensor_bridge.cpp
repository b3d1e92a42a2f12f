#include "python/src/tensor_bridge.h"

#include <string>

namespace strata::python {
namespace {

constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kUsedCapsuleName = "used_dltensor";

// A DLManagedTensor with the shape it points at; its own manager.
struct OwnedView {
  DLManagedTensor managed{};
  int64_t shape[1] = {0};
};

void delete_view(DLManagedTensor* managed) { delete static_cast<OwnedView*>(managed->manager_ctx); }

// A capsule nobody consumed still owns its tensor.
void destroy_capsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, kCapsuleName) == 0) return;  // consumed: the consumer owns it now
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
}

DLDataType dl_dtype(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return {kDLBfloat, 16, 1};
    case DType::kFloat16: return {kDLFloat, 16, 1};
    default: return {kDLFloat, static_cast<uint8_t>(8 * dtype_size(dtype)), 1};
  }
}

bool same_dtype(DLDataType a, DLDataType b) { return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes; }

// Row-major contiguous: no strides given, or the compact ones.
bool is_contiguous(const DLTensor& t) {
  if (t.strides == nullptr) return true;
  int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != expected) return false;
    expected *= t.shape[i];
  }
  return true;
}

}  // namespace

PyObject* make_capsule(void* data, size_t numel, DType dtype, DLDevice device) {
  auto* view = new OwnedView();
  view->shape[0] = static_cast<int64_t>(numel);
  DLTensor& t = view->managed.dl_tensor;
  t.data = data;
  t.device = device;
  t.ndim = 1;
  t.dtype = dl_dtype(dtype);
  t.shape = view->shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  view->managed.manager_ctx = view;
  view->managed.deleter = delete_view;
  PyObject* capsule = PyCapsule_New(&view->managed, kCapsuleName, destroy_capsule);
  if (capsule == nullptr) delete view;
  return capsule;
}

StatusOr<BorrowedTensor> BorrowedTensor::borrow(PyObject* capsule, DType expected, const char* what) {
  if (PyCapsule_IsValid(capsule, kCapsuleName) == 0)
    return InvalidArgumentError(std::string(what) + ": expected an unconsumed DLPack capsule (torch.utils.dlpack.to_dlpack(tensor))");
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  if (PyCapsule_SetName(capsule, kUsedCapsuleName) != 0) return InternalError(std::string(what) + ": could not consume the capsule");
  BorrowedTensor borrowed(managed);
  const DLTensor& t = managed->dl_tensor;
  if (t.device.device_type != kDLCPU) return InvalidArgumentError(std::string(what) + ": the tensor must be in host memory");
  if (!same_dtype(t.dtype, dl_dtype(expected)))
    return InvalidArgumentError(std::string(what) + ": the tensor must be " + std::string(dtype_name(expected)));
  if (!is_contiguous(t)) return InvalidArgumentError(std::string(what) + ": the tensor must be contiguous");
  return borrowed;
}

BorrowedTensor::~BorrowedTensor() {
  if (managed_ != nullptr && managed_->deleter != nullptr) managed_->deleter(managed_);
}

void* BorrowedTensor::data() const {
  const DLTensor& t = managed_->dl_tensor;
  return static_cast<char*>(t.data) + t.byte_offset;
}

size_t BorrowedTensor::numel() const {
  const DLTensor& t = managed_->dl_tensor;
  size_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= static_cast<size_t>(t.shape[i]);
  return n;
}

}  // namespace strata::python
