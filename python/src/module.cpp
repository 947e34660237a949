// streamalloc._C: the pybind11 module behind the `streamalloc` Python
// package. It installs the torch allocator and exposes statistics, snapshot
// and cache controls; streamalloc's C++ errors arrive as the Python
// exceptions a user expects (see translate_exception).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <c10/util/Exception.h>

#include <cstdint>
#include <exception>
#include <string>

#include "diagnosis_bindings.hpp"
#include "introspection.hpp"
#include "process_allocator.hpp"
#include "streamalloc/core/config.hpp"
#include "streams_bindings.hpp"
#include "torch_allocator.hpp"
#include "torch_pool_ids.hpp"
#include "torch_settings.hpp"
#include "torch_tags.hpp"

namespace py = pybind11;

namespace streamalloc {
namespace {

// torch.cuda.OutOfMemoryError when torch is importable, else MemoryError.
void set_out_of_memory_error(const char* message) {
  try {
    py::object type = py::module_::import("torch").attr("cuda").attr("OutOfMemoryError");
    PyErr_SetString(type.ptr(), message);
  } catch (py::error_already_set&) {
    PyErr_SetString(PyExc_MemoryError, message);
  }
}

// For this module's functions only (a module-local translator: a global
// one would also see every exception of torch's own bindings, which share
// pybind11's registry, and turn torch's ValueError and TypeError into
// RuntimeError). out_of_memory -> torch.cuda.OutOfMemoryError; usage and
// config errors -> ValueError; device failures -> RuntimeError; torch's
// errors keep their Python types.
void translate_exception(std::exception_ptr pending) {
  try {
    if (pending) std::rethrow_exception(pending);
  } catch (const out_of_memory& e) {
    set_out_of_memory_error(e.what());
  } catch (const c10::OutOfMemoryError& e) {
    set_out_of_memory_error(e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
  } catch (const c10::IndexError& e) {
    PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
  } catch (const c10::NotImplementedError& e) {
    PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const usage_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const config_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const device_failure& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

// Ratios are floats; every other counter is an integer, as in torch.
bool is_ratio(const std::string& key) {
  const std::string bytes_suffix = "_bytes";
  const bool fragmentation = key.rfind("fragmentation.", 0) == 0;
  const bool ends_in_bytes =
      key.size() >= bytes_suffix.size() && key.compare(key.size() - bytes_suffix.size(), bytes_suffix.size(), bytes_suffix) == 0;
  return fragmentation && !ends_in_bytes;
}

py::dict stats_dict(int device) {
  py::dict out;
  for (const auto& [key, value] : device_stats_of(device).to_map()) {
    if (is_ratio(key)) {
      out[py::str(key)] = value;
    } else {
      out[py::str(key)] = static_cast<std::int64_t>(value);
    }
  }
  return out;
}

py::dict block_dict(const block_info& b) {
  py::dict out;
  out["address"] = b.address;
  out["size"] = b.size;
  out["requested_size"] = b.requested_size;
  out["state"] = to_string(b.state);
  out["frames"] = py::list();
  // The allocation tag (streamalloc.tag / attribute) while tagging is on.
  // None: an allocation sampling skipped or made before tagging began.
  if (tagging_on() && b.state == block_state::active_allocated) out["tag"] = tag_name_of(b.address);
  return out;
}

// The layout of torch.cuda.memory._snapshot()["segments"][i].
py::dict segment_dict(const segment_info& s) {
  py::dict out;
  const c10::MempoolId_t pool = to_mempool_id(s.pool);
  out["device"] = s.device;
  out["address"] = s.address;
  out["total_size"] = s.total_size;
  out["allocated_size"] = s.allocated_size;
  out["active_size"] = s.active_size;
  out["requested_size"] = s.requested_size;
  out["stream"] = static_cast<std::int64_t>(s.stream);
  out["segment_type"] = s.is_small ? "small" : "large";
  out["segment_pool_id"] = py::make_tuple(pool.first, pool.second);
  out["is_expandable"] = s.is_expandable;
  out["is_stitched"] = s.is_stitched;  // streamalloc only: chunks moved here by stitching
  out["frames"] = py::list();
  py::list blocks;
  for (const block_info& b : s.blocks) blocks.append(block_dict(b));
  out["blocks"] = blocks;
  return out;
}

py::dict snapshot_dict(int device) {
  py::list segments;
  for (const segment_info& s : collect_segments(device)) segments.append(segment_dict(s));
  // One empty trace per device: the memory history goes to torch's
  // _snapshot() (memory_history.hpp), not to this layout.
  py::list traces;
  for (int d = 0; d < managed_device_count(); ++d) traces.append(py::list());
  py::dict settings;
  settings["STREAMALLOC_CONF"] = process_allocator_config().to_string();
  py::dict out;
  out["segments"] = segments;
  out["device_traces"] = traces;
  out["allocator_settings"] = settings;
  return out;
}

py::list config_keys() {
  py::list out;
  for (const allocator_config::key_doc& doc : allocator_config::keys()) {
    out.append(py::make_tuple(doc.key, doc.description));
  }
  return out;
}

}  // namespace
}  // namespace streamalloc

PYBIND11_MODULE(_C, m) {
  using namespace streamalloc;
  m.doc() = "streamalloc's C++ side; use the `streamalloc` package rather than this module.";
  py::register_local_exception_translator(&translate_exception);

  m.def("install", &install_torch_allocator, py::arg("config") = std::string(),
        "Registers streamalloc as torch's CUDA allocator, with `config` (`key:value,...`) layered on "
        "STREAMALLOC_CONF, itself on the keys torch's allocator variable shares with streamalloc. Raises "
        "ValueError for a bad option and RuntimeError when torch has already initialised CUDA.");
  m.def("is_installed", &torch_allocator_installed, "Whether torch's current CUDA allocator is streamalloc's.");
  m.def("stats", &stats_dict, py::arg("device"),
        "torch.cuda.memory_stats()'s keys for `device`, plus fragmentation.* metrics.");
  m.def(
      "snapshot", [](int device) { return snapshot_dict(device); }, py::arg("device") = k_all_devices,
      "Segments and blocks like torch.cuda.memory._snapshot(); device -1 means every device.");
  m.def("empty_cache", &empty_caches, py::call_guard<py::gil_scoped_release>(),
        "Returns unused cached segments of every device to the driver.");
  m.def("reset_peak_stats", &reset_peak_stats_of, py::arg("device"));
  m.def("reset_accumulated_stats", &reset_accumulated_stats_of, py::arg("device"));
  m.def(
      "config",
      [] {
        if (torch_allocator_installed() || process_allocators_created()) return process_allocator_config().to_string();
        return startup_config(std::string(), false).to_string();
      },
      "The configuration in use (or that install() will use), in STREAMALLOC_CONF syntax.");
  m.def("config_keys", &config_keys, "(key, description) for every STREAMALLOC_CONF option.");
  m.def("device_count", &managed_device_count, "Devices streamalloc manages (0 until CUDA is initialised).");
  // Private, for tests: several arenas without having to contend for them.
  m.def(
      "_use_arena", [](int index, int device) { allocator_of(device).move_this_thread(index); }, py::arg("index"),
      py::arg("device"),
      "Moves the calling thread to arena `index` of `device` (below the `arenas` setting), as sustained "
      "contention would; for tests.");
  m.def(
      "_arena_count",
      [](int device) {
        const device_allocator* allocator = existing_allocator_of(device);
        return allocator == nullptr ? 0 : allocator->arena_count();
      },
      py::arg("device"), "Arenas `device`'s allocator has made (0 before it exists); for tests.");

  bind_streams(m);
  bind_diagnosis(m);
}
