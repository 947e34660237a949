// The diagnosis part of streamalloc._C. The Python package builds
// streamalloc.tag(), attribute(), report(), watch() and last_oom_report()
// on these; module hooks call set_thread_tag on every module entry and
// exit, so it does nothing but validate the id and swap a thread-local.
#include "diagnosis_bindings.hpp"

#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>

#include "oom_diagnosis.hpp"
#include "torch_tags.hpp"

namespace py = pybind11;

namespace streamalloc {
namespace {

tag_id checked_tag(std::int64_t id) {
  if (id < 0 || static_cast<std::size_t>(id) >= process_allocation_tags().tag_count()) {
    throw usage_error("streamalloc: unknown tag id " + std::to_string(id) + " (use intern_tag)");
  }
  return static_cast<tag_id>(id);
}

py::dict summary_dict(const tag_summary& s) {
  py::list by_tag;
  for (const tag_total& t : s.by_tag) by_tag.append(py::make_tuple(t.name, t.bytes, t.count));
  py::list by_size;
  for (const size_bucket_total& b : s.by_size) {
    by_size.append(py::make_tuple(b.min_bytes, b.max_bytes, b.bytes, b.count));
  }
  py::dict out;
  out["by_tag"] = by_tag;
  out["by_size"] = by_size;
  out["recorded_bytes"] = s.recorded_bytes;
  out["recorded_count"] = s.recorded_count;
  out["sampled"] = s.sampled;
  out["sample_every"] = s.sample_every;
  return out;
}

py::object report_dict(const std::optional<oom_report>& report) {
  if (!report) return py::none();
  const oom_report& r = *report;
  const oom_context& c = r.context;
  py::list holders;
  for (const oom_holder& h : r.holders) {
    py::dict holder;
    holder["tag"] = h.tag;
    holder["bytes"] = h.bytes;
    holder["count"] = h.count;
    holders.append(holder);
  }
  py::dict out;
  out["device"] = c.device;
  out["requested_bytes"] = c.requested_bytes;
  out["device_total_bytes"] = c.device_total_bytes;
  out["device_free_bytes"] = c.device_free_bytes;
  out["reserved_bytes"] = c.reserved_bytes;
  out["allocated_bytes"] = r.allocated_bytes;
  out["largest_free_block_bytes"] = c.largest_free_block_bytes;
  out["limit_bytes"] = r.limit_bytes;
  out["available_bytes"] = r.available_bytes;
  out["unallocated_bytes"] = r.unallocated_bytes;
  out["free_cached_bytes"] = r.free_cached_bytes;
  out["external_fragmentation"] = r.external_fragmentation;
  out["pending_other_streams_bytes"] = r.pending_other_streams_bytes;
  out["outside_bytes"] = r.outside_bytes;
  out["tagging"] = r.tagging;
  out["sampled"] = r.sampled;
  out["sample_every"] = r.sample_every;
  out["holders"] = holders;
  py::list processes;
  for (const device_process& p : c.processes) {
    py::dict process;
    process["pid"] = p.pid;
    process["used_bytes"] = p.used_bytes;
    processes.append(process);
  }
  out["processes"] = processes;
  out["other_holders"] = r.other_holders;
  out["other_holders_bytes"] = r.other_holders_bytes;
  out["case"] = to_string(r.kind);
  out["suggestion"] = r.suggestion;
  out["text"] = describe(r);
  return py::object(std::move(out));
}

}  // namespace

py::object tag_name_of(std::uintptr_t address) {
  if (!tagging_on()) return py::none();
  allocation_tags& tags = process_allocation_tags();
  tag_id id = k_untagged;
  if (!tags.tag_of(address, &id)) return py::none();
  return py::str(tags.name_of(id));
}

void bind_diagnosis(py::module_& m) {
  m.def(
      "enable_tagging",
      [](std::uint32_t sample_every, std::size_t always_record_bytes) {
        tagging_options options;
        options.sample_every = sample_every;
        options.always_record_bytes = always_record_bytes;
        enable_tagging(options);
      },
      py::arg("sample_every") = 1, py::arg("always_record_bytes") = tagging_options{}.always_record_bytes,
      "Records the tag of every allocation from now on (one in sample_every below always_record_bytes).");
  m.def("disable_tagging", &disable_tagging, "Stops recording tags and forgets every record.");
  m.def(
      "tagging_options",
      []() -> py::object {
        if (!tagging_on()) return py::none();
        const tagging_options options = process_allocation_tags().options();
        py::dict out;
        out["sample_every"] = options.sample_every;
        out["always_record_bytes"] = options.always_record_bytes;
        return py::object(std::move(out));
      },
      "None while tagging is off, else its sampling options.");
  m.def(
      "intern_tag", [](const std::string& name) { return process_allocation_tags().intern(name); }, py::arg("name"));
  m.def(
      "tag_name", [](std::int64_t id) { return process_allocation_tags().name_of(checked_tag(id)); }, py::arg("id"));
  m.def("thread_tag", &allocation_tags::thread_tag, "The calling thread's own tag id (0: none).");
  m.def(
      "set_thread_tag", [](std::int64_t id) { return allocation_tags::set_thread_tag(checked_tag(id)); },
      py::arg("id"), "Sets the calling thread's tag; returns the previous id.");
  m.def(
      "set_inherited_tag", [](std::int64_t id) { return process_allocation_tags().set_inherited_tag(checked_tag(id)); },
      py::arg("id"), "Sets the tag of threads without one of their own; returns the previous id.");
  m.def(
      "restore_inherited_tag",
      [](std::int64_t expected, std::int64_t previous) {
        process_allocation_tags().restore_inherited_tag(checked_tag(expected), checked_tag(previous));
      },
      py::arg("expected"), py::arg("previous"));
  m.def(
      "tag_summary", [](int device) { return summary_dict(process_allocation_tags().summary(device)); },
      py::arg("device") = allocation_tags::k_all_devices_tags,
      "Recorded live bytes by tag and by size bucket of `device` (-1: every device).");
  m.def("tag_of", &tag_name_of, py::arg("address"), "The tag of the live allocation at `address`, or None.");
  m.def(
      "last_oom_report", [] { return report_dict(last_oom_report()); },
      "The newest out-of-memory report as a dict, or None.");
}

}  // namespace streamalloc
