// strata._strata: the Session (session.h) for Python. Status errors become
// strata.StrataError carrying the message trail; engine memory leaves as DLPack capsules
// (tensor_bridge.h); calls that wait on the engine release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/log.h"
#include "engine/trace.h"
#include "python/src/session.h"
#include "python/src/tensor_bridge.h"

namespace py = pybind11;

namespace strata::python {
namespace {

PyObject* g_error = nullptr;  // strata.StrataError, set once at import

// Raises StrataError for a failed Status.
void check(const Status& status) {
  if (status.ok()) return;
  PyErr_SetString(g_error, status.to_string().c_str());
  throw py::error_already_set();
}

template <class T>
T value(StatusOr<T> result) {
  check(result.status());
  return std::move(result).value();
}

// Runs `f` (returning Status or StatusOr) without the GIL; raises, holding it, on failure.
template <class F>
auto unlocked(F&& f) {
  auto result = [&] {
    py::gil_scoped_release release;
    return f();
  }();
  if constexpr (std::is_same_v<decltype(result), Status>) {
    check(result);
  } else {
    return value(std::move(result));
  }
}

// The session, for calls that read the engine: an error once it is closed.
const Session& live(const Session& s) {
  if (s.closed()) check(FailedPreconditionError("the engine was closed"));
  return s;
}

// Host memory on the CPU device, the GPU's on CUDA.
py::object capsule_of(const Region& region) {
  const DLDevice device = region.device == DeviceKind::kCuda ? DLDevice{kDLCUDA, region.ordinal} : DLDevice{kDLCPU, 0};
  PyObject* capsule = make_capsule(region.data, region.numel, region.dtype, device);
  if (capsule == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(capsule);
}

py::dict report_dict(const StepReport& report) {
  py::dict d;
  d["step"] = report.step;
  d["loss"] = report.loss;
  d["step_seconds"] = report.step_seconds;
  d["grad_norm"] = report.grad_norm;
  d["skipped"] = report.skipped;
  d["loss_scale"] = report.loss_scale;
  d["device_high_water_bytes"] = report.device_high_water_bytes;
  d["device_budget_bytes"] = report.device_budget_bytes;
  d["pinned_bytes"] = report.pinned_bytes;
  d["nvme_bytes_read"] = report.nvme_bytes_read;
  d["nvme_bytes_written"] = report.nvme_bytes_written;
  py::dict busy;
  for (size_t s = 0; s < kStageCount; ++s) busy[py::str(std::string(stage_name(static_cast<Stage>(s))))] = report.busy[s];
  d["busy_seconds"] = busy;
  return d;
}

py::dict plan_dict(const EnginePlan& plan) {
  py::dict d;
  py::list lines;
  for (const PlanLine& line : plan.lines) lines.append(py::make_tuple(line.what, std::string(tier_name(line.tier)), line.bytes));
  d["lines"] = lines;
  d["device_bytes"] = plan.device_bytes;
  d["device_budget_bytes"] = plan.device_budget_bytes;
  d["pinned_bytes"] = plan.pinned_bytes;
  d["host_bytes"] = plan.host_bytes;
  d["nvme_bytes"] = plan.nvme_bytes;
  d["state_bytes"] = plan.state_bytes;
  d["prefetch_depth"] = plan.prefetch_depth;
  d["gather_slots"] = plan.gather_slots;
  d["text"] = plan.text;
  return d;
}

py::dict layout_dict(const GroupLayout& layout) {
  py::dict d;
  d["name"] = layout.name;
  d["numel"] = layout.numel;
  d["padded_numel"] = layout.padded_numel;
  d["shard_numel"] = layout.shard_numel;
  py::list tensors;
  for (const TensorLayout& t : layout.tensors) tensors.append(py::make_tuple(t.name, t.shape, t.offset, t.numel));
  d["tensors"] = tensors;
  return d;
}

using HfNameTuple = std::tuple<std::string, int, int, uint64_t, std::vector<int64_t>>;  // name, group, tensor, offset, full shape

std::vector<HfTensorName> hf_names(const std::vector<HfNameTuple>& names) {
  std::vector<HfTensorName> out;
  for (const auto& [name, group, tensor, offset, shape] : names) out.push_back({name, group, tensor, offset, shape});
  return out;
}

using SessionClass = py::class_<Session>;

// Creation, the settings read back, and what precedes start(): groups, held gradients, the
// model's work for placement auto.
void bind_session_setup(SessionClass& session) {
  session
      .def(py::init([](const std::string& text, const std::string& source) { return unlocked([&] { return Session::create(text, source); }); }),
           py::arg("config_json"), py::arg("source"))
      .def_property_readonly("rank", &Session::rank)
      .def_property_readonly("world_size", &Session::world_size)
      .def_property_readonly("param_dtype", [](const Session& s) { return std::string(dtype_name(s.param_dtype())); })
      .def_property_readonly("gradient_accumulation_steps", &Session::gradient_accumulation_steps)
      .def_property_readonly("gradient_clipping", [](const Session& s) { return s.config().gradient_clipping; })
      .def_property_readonly("closed", &Session::closed)
      .def_property_readonly("in_micro_batch", &Session::in_micro_batch)
      .def_property_readonly("learning_rate", &Session::learning_rate)
      .def_property_readonly("steps_taken", [](const Session& s) { return live(s).steps_taken(); })
      .def_property_readonly("loss_scale", [](const Session& s) { return live(s).loss_scale(); })
      .def("register_group",
           [](Session& s, const std::string& name, const std::vector<std::tuple<std::string, std::vector<int64_t>, bool>>& tensors,
              bool trainable, const std::string& dtype) {
             std::vector<TensorEntry> entries;
             for (const auto& [tensor, shape, decay] : tensors) entries.push_back({tensor, shape, decay});
             return value(s.register_group(name, entries, trainable, value(parse_dtype(dtype))));
           })
      .def("declare_held_gradients", [](Session& s, int count) { check(s.declare_held_gradients(count)); })
      .def_property_readonly("placement_auto", &Session::placement_auto)
      .def("declare_work",
           [](Session& s, int64_t matmul_weights, int64_t attention_layers, int64_t attention_width, int64_t seq_len, int64_t head_weights,
              bool recompute) {
             SessionWork work;
             work.flops.matmul_weights = matmul_weights;
             work.flops.attention_layers = attention_layers;
             work.flops.attention_width = attention_width;
             work.seq_len = seq_len;
             work.head_weights = head_weights;
             work.recompute = recompute;
             s.declare_work(work);
           })
      .def_property_readonly("placement_text", &Session::placement_text)
      .def("start", [](Session& s) { unlocked([&] { return s.start(); }); });
}

// After start(): values in and out, the steps, checkpoints and model directories, close.
void bind_session_use(SessionClass& session) {
  session
      .def("plan", [](const Session& s) { return plan_dict(live(s).plan()); })
      .def("layout", [](const Session& s, int g) { return layout_dict(live(s).layout(g)); })
      .def("write_group",
           [](Session& s, int g, py::capsule values) {
             BorrowedTensor t = value(BorrowedTensor::borrow(values.ptr(), DType::kFloat32, "write_group"));
             unlocked([&] { return s.write_group(g, {static_cast<const float*>(t.data()), t.numel()}); });
           })
      .def("read_group",
           [](Session& s, int g, py::capsule out) {
             BorrowedTensor t = value(BorrowedTensor::borrow(out.ptr(), DType::kFloat32, "read_group"));
             unlocked([&] { return s.read_group(g, {static_cast<float*>(t.data()), t.numel()}); });
           })
      .def("refresh", [](Session& s) { unlocked([&] { return s.refresh(); }); })
      .def_property_readonly("device",
                             [](const Session& s) {
                               const std::string kind(device_kind_name(live(s).device_kind()));
                               return s.device_kind() == DeviceKind::kCpu ? kind : kind + ":" + std::to_string(s.device_ordinal());
                             })
      .def("use_caller_stream", [](Session& s, uintptr_t handle) { check(s.use_caller_stream(handle)); })
      .def("begin_micro_batch", [](Session& s) { unlocked([&] { return s.begin_micro_batch(); }); })
      .def("gather",
           [](Session& s, int g) {
             return capsule_of(unlocked([&] { return s.gather(g); }));
           })
      .def("release", [](Session& s, int g) { unlocked([&] { return s.release(g); }); })
      .def("gradient_buffer",
           [](Session& s, int g) {
             return capsule_of(unlocked([&] { return s.gradient_buffer(g); }));
           })
      .def("grads_ready", [](Session& s, int g) { unlocked([&] { return s.grads_ready(g); }); })
      .def("end_micro_batch",
           [](Session& s, double loss) -> py::object {
             const std::optional<StepReport> report = unlocked([&] { return s.end_micro_batch(loss); });
             if (!report) return py::none();
             return report_dict(*report);
           })
      .def("begin_forward", [](Session& s) { unlocked([&] { return s.begin_forward(); }); })
      .def("end_forward", [](Session& s) { unlocked([&] { return s.end_forward(); }); })
      .def("save_checkpoint", [](Session& s, const std::string& dir, const std::string& state) { unlocked([&] { return s.save_checkpoint(dir, state); }); })
      .def("load_checkpoint", [](Session& s, const std::string& dir) { return unlocked([&] { return s.load_checkpoint(dir); }); })
      .def("export_hf",
           [](Session& s, const std::string& dir, const std::string& config, const std::vector<HfNameTuple>& names,
              const std::string& tokenizer_dir, uint64_t shard_bytes, const std::string& dtype) {
             const std::vector<HfTensorName> n = hf_names(names);
             unlocked([&] { return s.export_hf(dir, config, n, tokenizer_dir, shard_bytes, dtype); });
           })
      .def("load_hf",
           [](Session& s, const std::string& dir, const std::vector<HfNameTuple>& names) {
             const std::vector<HfTensorName> n = hf_names(names);
             unlocked([&] { return s.load_hf(dir, n); });
           })
      .def("close", [](Session& s) { unlocked([&] { return s.close(); }); });
}

void bind_session(py::module_& m) {
  SessionClass session(m, "Session");
  bind_session_setup(session);
  bind_session_use(session);
}

}  // namespace
}  // namespace strata::python

PYBIND11_MODULE(_strata, m) {
  m.doc() = "Strata's engine for the strata package (use strata.initialize)";
  strata::python::g_error = PyErr_NewExceptionWithDoc("strata.StrataError", "An error from Strata's engine, with its message trail.",
                                                      PyExc_RuntimeError, nullptr);
  m.attr("StrataError") = py::handle(strata::python::g_error);
  strata::python::bind_session(m);
}
