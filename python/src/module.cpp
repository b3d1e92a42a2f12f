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

py::object capsule_of(const Session& session, const Region& region) {
  (void)session;
  const DLDevice device{kDLCPU, 0};
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

std::vector<HfTensorName> hf_names(const std::vector<std::tuple<std::string, int, int>>& names) {
  std::vector<HfTensorName> out;
  for (const auto& [name, group, tensor] : names) out.push_back({name, group, tensor});
  return out;
}

void bind_session(py::module_& m) {
  using R = py::call_guard<py::gil_scoped_release>;
  py::class_<Session>(m, "Session")
      .def(py::init([](const std::string& text, const std::string& source) { return value(Session::create(text, source)); }),
           py::arg("config_json"), py::arg("source"))
      .def_property_readonly("rank", &Session::rank)
      .def_property_readonly("world_size", &Session::world_size)
      .def_property_readonly("param_dtype", [](const Session& s) { return std::string(dtype_name(s.param_dtype())); })
      .def_property_readonly("gradient_accumulation_steps", &Session::gradient_accumulation_steps)
      .def_property_readonly("gradient_clipping", [](const Session& s) { return s.config().gradient_clipping; })
      .def_property_readonly("closed", &Session::closed)
      .def_property_readonly("in_micro_batch", &Session::in_micro_batch)
      .def_property_readonly("learning_rate", &Session::learning_rate)
      .def_property_readonly("steps_taken", &Session::steps_taken)
      .def_property_readonly("loss_scale", &Session::loss_scale)
      .def("register_group",
           [](Session& s, const std::string& name, const std::vector<std::tuple<std::string, std::vector<int64_t>, bool>>& tensors) {
             std::vector<TensorEntry> entries;
             for (const auto& [tensor, shape, decay] : tensors) entries.push_back({tensor, shape, decay});
             return value(s.register_group(name, entries));
           })
      .def("start", [](Session& s) { check(s.start()); }, R())
      .def("plan", [](const Session& s) { return plan_dict(s.plan()); })
      .def("layout", [](const Session& s, int g) { return layout_dict(s.layout(g)); })
      .def("write_group",
           [](Session& s, int g, py::capsule values) {
             BorrowedTensor t = value(BorrowedTensor::borrow(values.ptr(), DType::kFloat32, "write_group"));
             py::gil_scoped_release release;
             check(s.write_group(g, {static_cast<const float*>(t.data()), t.numel()}));
           })
      .def("read_group",
           [](Session& s, int g, py::capsule out) {
             BorrowedTensor t = value(BorrowedTensor::borrow(out.ptr(), DType::kFloat32, "read_group"));
             py::gil_scoped_release release;
             check(s.read_group(g, {static_cast<float*>(t.data()), t.numel()}));
           })
      .def("refresh", [](Session& s) { check(s.refresh()); }, R())
      .def("begin_micro_batch", [](Session& s) { check(s.begin_micro_batch()); }, R())
      .def("gather",
           [](Session& s, int g) {
             Region region;
             {
               py::gil_scoped_release release;
               region = value(s.gather(g));
             }
             return capsule_of(s, region);
           })
      .def("release", [](Session& s, int g) { check(s.release(g)); }, R())
      .def("gradient_buffer",
           [](Session& s, int g) {
             Region region;
             {
               py::gil_scoped_release release;
               region = value(s.gradient_buffer(g));
             }
             return capsule_of(s, region);
           })
      .def("grads_ready", [](Session& s, int g) { check(s.grads_ready(g)); }, R())
      .def("end_micro_batch",
           [](Session& s, double loss) -> py::object {
             std::optional<StepReport> report;
             {
               py::gil_scoped_release release;
               report = value(s.end_micro_batch(loss));
             }
             if (!report) return py::none();
             return report_dict(*report);
           })
      .def("begin_forward", [](Session& s) { check(s.begin_forward()); }, R())
      .def("end_forward", [](Session& s) { check(s.end_forward()); }, R())
      .def("save_checkpoint", [](Session& s, const std::string& dir, const std::string& state) { check(s.save_checkpoint(dir, state)); }, R())
      .def("load_checkpoint", [](Session& s, const std::string& dir) { return value(s.load_checkpoint(dir)); }, R())
      .def("export_hf",
           [](Session& s, const std::string& dir, const std::string& config, const std::vector<std::tuple<std::string, int, int>>& names,
              const std::string& tokenizer_dir, uint64_t shard_bytes, const std::string& dtype) {
             const std::vector<HfTensorName> n = hf_names(names);
             py::gil_scoped_release release;
             check(s.export_hf(dir, config, n, tokenizer_dir, shard_bytes, dtype));
           })
      .def("load_hf",
           [](Session& s, const std::string& dir, const std::vector<std::tuple<std::string, int, int>>& names) {
             const std::vector<HfTensorName> n = hf_names(names);
             py::gil_scoped_release release;
             check(s.load_hf(dir, n));
           })
      .def("close", [](Session& s) { check(s.close()); }, R());
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
