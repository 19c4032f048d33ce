#include "replica/python_engine.h"

#include <pybind11/embed.h>
#include <pybind11/stl.h>
#include <spdlog/spdlog.h>

#include "common/check.h"
#include "replica/nbos_engine_source.h"
#include "replica/nbos_state_codec_source.h"
#include "replica/nbos_state_modules_source.h"
#include "replica/nbos_state_pickle_source.h"
#include "replica/nbos_state_process_source.h"
#include "replica/nbos_state_scan_source.h"
#include "replica/nbos_state_source.h"
#include "replica/nbos_state_wire_source.h"
#include "store/blob_store.h"

namespace py = pybind11;

namespace nbos::replica {

namespace {

// CPython is one per process, so the host the `_nbos` module talks to is too.
EngineHost* g_host = nullptr;

std::string PythonErrorText(py::error_already_set& e) { return e.what(); }

py::object Compile(const char* name, const char* source) {
  return py::module_::import("builtins")
      .attr("compile")(source, std::string("<") + name + ">", "exec");
}

// Code a warm process compiled ahead (Preload), by module name, in the embedded `_nbos` module
// (so that it goes with the interpreter).
py::dict Precompiled() {
  py::module_ nbos = py::module_::import("_nbos");
  if (!py::hasattr(nbos, "_precompiled")) nbos.attr("_precompiled") = py::dict();
  return nbos.attr("_precompiled");
}

// Defines module `name` from source compiled into the binary, so nbos needs no files beside it.
py::module_ LoadModule(const char* name, const char* source) {
  py::module_ module = py::module_::import("types").attr("ModuleType")(name);
  module.attr("__file__") = std::string("<") + name + ">";
  py::module_::import("sys").attr("modules")[name] = module;
  py::object code = Precompiled().attr("pop")(name, py::none());
  if (code.is_none()) code = Compile(name, source);
  py::module_::import("builtins").attr("exec")(code, module.attr("__dict__"));
  return module;
}

// The namespace-state modules (python/nbos_state*.py), each after those it imports.
struct EmbeddedModule {
  const char* name;
  const char* source;
};
constexpr EmbeddedModule kStateModules[] = {
    {"nbos_state_wire", kNbosStateWireSource},
    {"nbos_state_codec", kNbosStateCodecSource},
    {"nbos_state_scan", kNbosStateScanSource},
    {"nbos_state_process", kNbosStateProcessSource},
    {"nbos_state_pickle", kNbosStatePickleSource},
    {"nbos_state_modules", kNbosStateModulesSource},
    {"nbos_state", kNbosStateSource},
};

struct OwnedBlob {
  std::unique_ptr<store::BlobBuffer> buffer;
};

}  // namespace

PYBIND11_EMBEDDED_MODULE(_nbos, m) {
  // What get() returns: the blob's bytes as a writable buffer that owns them, so arrays and
  // tensors rebuilt from a blob use its memory instead of copies (each get is a fresh buffer).
  py::class_<OwnedBlob>(m, "Blob", py::buffer_protocol())
      .def_buffer([](OwnedBlob& b) {
        return py::buffer_info(b.buffer->data(), 1, py::format_descriptor<uint8_t>::format(),
                               static_cast<py::ssize_t>(b.buffer->size()));
      })
      .def("__len__", [](const OwnedBlob& b) { return b.buffer->size(); });

  // The blob store, as nbos_state expects it: put(bytes) -> key, get(key) -> Blob, contains.
  // Store I/O runs without the GIL; failures raise RuntimeError with the store's message.
  py::class_<store::BlobStore>(m, "BlobStore")
      .def("put",
           [](store::BlobStore& s, py::buffer data) {
             py::buffer_info info = data.request();
             std::string_view bytes(static_cast<const char*>(info.ptr),
                                    static_cast<size_t>(info.size * info.itemsize));
             Result<std::string> key = [&] {
               py::gil_scoped_release nogil;
               return s.Put(bytes);
             }();
             if (!key.ok()) throw std::runtime_error(key.status().ToString());
             return *key;
           })
      .def("get",
           [](store::BlobStore& s, const std::string& key) {
             Result<std::unique_ptr<store::BlobBuffer>> blob = [&] {
               py::gil_scoped_release nogil;
               return s.GetBuffer(key);
             }();
             if (!blob.ok()) throw std::runtime_error(blob.status().ToString());
             return OwnedBlob{std::move(*blob)};
           })
      .def("contains", [](store::BlobStore& s, const std::string& key) {
        Result<bool> has = [&] {
          py::gil_scoped_release nogil;
          return s.Contains(key);
        }();
        if (!has.ok()) throw std::runtime_error(has.status().ToString());
        return *has;
      });

  // For standbys' diagnostics: the replica's log, never the user's output (fds 1 and 2 are
  // captured and published with the request being followed).
  m.def("log_warning", [](const std::string& text) { spdlog::warn("{}", text); });
  m.def("write_stream", [](const std::string& name, const std::string& text) {
    if (g_host) g_host->WriteStream(name, text);
  });
  m.def("flush_streams", [] {
    if (g_host) g_host->FlushStreams();
  });
  m.def("publish", [](const std::string& msg_type, std::string content_json,
                      std::string metadata_json, std::vector<py::bytes> buffers) {
    if (!g_host) return;
    std::vector<std::string> raw;
    raw.reserve(buffers.size());
    for (auto& b : buffers) raw.emplace_back(b);
    g_host->Publish(msg_type, std::move(content_json), std::move(metadata_json), std::move(raw));
  });
  m.def("input_request", [](const std::string& prompt, bool password) -> std::string {
    if (!g_host) throw py::value_error("no kernel host");
    auto r = g_host->RequestInput(prompt, password);
    if (!r.ok()) {
      if (PyErr_Occurred()) throw py::error_already_set();
      throw std::runtime_error(r.status().message());
    }
    return std::move(r).value();
  });
}

// The interpreter Preload started, until Start adopts it.
std::unique_ptr<py::scoped_interpreter> g_preloaded;

namespace {

// What nbos_engine.py and nbos_state.py import at their top, less the standard library's small
// modules.
constexpr const char* kEngineImports[] = {"IPython.core.interactiveshell",
                                          "IPython.core.displayhook",
                                          "IPython.core.displaypub",
                                          "IPython.core.magic",
                                          "IPython.core.error",
                                          "pickletools",
                                          "hashlib"};

}  // namespace

struct PythonEngine::Impl {
  std::unique_ptr<py::scoped_interpreter> interpreter;
  py::object engine;
};

Status PythonEngine::Preload(const std::vector<std::string>& modules) {
  NBOS_CHECK(!g_preloaded && g_host == nullptr, "Preload once, before Start");
  g_preloaded = std::make_unique<py::scoped_interpreter>(/*init_signal_handlers=*/true);
  // The engine's own imports (IPython's shell: most of a start's time) come first, whatever the
  // daemon asks for: a promoted process then only builds its shell.
  std::vector<std::string> all(std::begin(kEngineImports), std::end(kEngineImports));
  all.insert(all.end(), modules.begin(), modules.end());
  for (const std::string& name : all) {
    try {
      py::module_::import(name.c_str());
    } catch (py::error_already_set& e) {
      return Internal("preloading " + name + " failed: " + PythonErrorText(e));
    }
  }
  // Compiling the engine's sources has no effect but time; running them waits for the kernel's
  // environment.
  try {
    Precompiled()["nbos_engine"] = Compile("nbos_engine", kNbosEngineSource);
    for (const EmbeddedModule& m : kStateModules) Precompiled()[m.name] = Compile(m.name, m.source);
  } catch (py::error_already_set& e) {
    return Internal("compiling the engine failed: " + PythonErrorText(e));
  }
  return Status::Ok();
}

Status PythonEngine::ReplaceEnvironment(const std::vector<std::string>& env) {
  NBOS_CHECK(g_preloaded, "ReplaceEnvironment needs a preloaded interpreter");
  try {
    // os.environ's own clear/update call unsetenv/putenv, so the C environment follows.
    py::dict entries;
    for (const std::string& entry : env) {
      size_t eq = entry.find('=');
      if (eq == std::string::npos || eq == 0) continue;
      entries[py::str(entry.substr(0, eq))] = py::str(entry.substr(eq + 1));
    }
    py::object environ = py::module_::import("os").attr("environ");
    environ.attr("clear")();
    environ.attr("update")(entries);
    return Status::Ok();
  } catch (py::error_already_set& e) {
    return Internal("setting the environment failed: " + PythonErrorText(e));
  }
}

PythonEngine::PythonEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

PythonEngine::~PythonEngine() {
  g_host = nullptr;
  if (impl_) impl_->engine = py::object();
}

Result<std::unique_ptr<PythonEngine>> PythonEngine::Start(EngineHost* host, std::string version,
                                                          std::string connection_file) {
  // A second engine would take over g_host: the first one's output would go to the wrong kernel.
  NBOS_CHECK(g_host == nullptr, "one PythonEngine per process");
  auto impl = std::make_unique<Impl>();
  impl->interpreter = g_preloaded
                          ? std::move(g_preloaded)
                          : std::make_unique<py::scoped_interpreter>(/*init_signal_handlers=*/true);
  g_host = host;
  try {
    py::module_ module = LoadModule("nbos_engine", kNbosEngineSource);
    impl->engine = module.attr("Engine")(version, connection_file);
    std::unique_ptr<PythonEngine> engine(new PythonEngine(std::move(impl)));
    engine->kernel_info_json_ = engine->impl_->engine.attr("kernel_info")().cast<std::string>();
    return engine;
  } catch (py::error_already_set& e) {
    g_host = nullptr;
    return Internal("starting the Python engine failed: " + PythonErrorText(e));
  }
}

bool PythonEngine::Handles(std::string_view msg_type) {
  static constexpr std::string_view kTypes[] = {
      "execute_request", "complete_request",      "inspect_request", "is_complete_request",
      "history_request", "comm_info_request",     "comm_open",       "comm_msg",
      "comm_close",      "nbos_namespace_request"};
  for (auto t : kTypes) {
    if (t == msg_type) return true;
  }
  return false;
}

Result<std::optional<std::string>> PythonEngine::Handle(const jupyter::Message& request) {
  try {
    jupyter::Json msg{{"header", request.header},
                      {"parent_header", request.parent_header},
                      {"metadata", request.metadata},
                      {"content", request.content}};
    std::vector<py::bytes> buffers;
    for (const auto& b : request.buffers) buffers.emplace_back(b);
    py::object reply = impl_->engine.attr("handle")(
        request.msg_type(), msg.dump(-1, ' ', false, jupyter::Json::error_handler_t::replace),
        buffers);
    if (reply.is_none()) return std::optional<std::string>();
    return std::optional<std::string>(reply.cast<std::string>());
  } catch (py::error_already_set& e) {
    return Status(StatusCode::kInternal, PythonErrorText(e));
  }
}

void PythonEngine::Shutdown() {
  try {
    impl_->engine.attr("shutdown")();
  } catch (py::error_already_set&) {
    // Exit hooks failing must not keep the kernel from exiting.
  }
}

namespace {
template <typename F>
Status CallPython(const char* what, F&& f) {
  try {
    f();
    return Status::Ok();
  } catch (py::error_already_set& e) {
    return Internal(std::string(what) + ": " + PythonErrorText(e));
  } catch (const std::exception& e) {
    return Internal(std::string(what) + ": " + e.what());
  }
}
}  // namespace

Status PythonEngine::EnableReplication(store::BlobStore* store, uint64_t replica_id) {
  return CallPython("enable replication", [&] {
    for (const EmbeddedModule& m : kStateModules) LoadModule(m.name, m.source);
    impl_->engine.attr("enable_replication")(py::cast(store, py::return_value_policy::reference),
                                             replica_id);
  });
}

Result<std::string> PythonEngine::TakeDelta() {
  std::string delta;
  Status s = CallPython("take delta",
                        [&] { delta = impl_->engine.attr("take_delta")().cast<std::string>(); });
  if (!s.ok()) return s;
  return delta;
}

Result<std::string> PythonEngine::ApplyDelta(const std::string& delta) {
  std::string divergence;
  Status s = CallPython("apply delta", [&] {
    divergence = impl_->engine.attr("apply_delta")(py::bytes(delta)).cast<std::string>();
  });
  if (!s.ok()) return s;
  return divergence;
}

Result<std::string> PythonEngine::TakeSideEffects() {
  std::string changes;
  Status s = CallPython("take side effects", [&] {
    changes = impl_->engine.attr("take_side_effects")().cast<std::string>();
  });
  if (!s.ok()) return s;
  return changes;
}

Status PythonEngine::ApplySideEffects(const std::string& changes_json) {
  return CallPython("apply side effects",
                    [&] { impl_->engine.attr("apply_side_effects")(changes_json); });
}

Status PythonEngine::FinishStandby(const jupyter::Json& done_meta) {
  return CallPython("finish standby",
                    [&] { impl_->engine.attr("finish_standby")(done_meta.dump()); });
}

Result<std::string> PythonEngine::Checkpoint() {
  std::string data;
  Status s = CallPython("checkpoint",
                        [&] { data = impl_->engine.attr("checkpoint")().cast<std::string>(); });
  if (!s.ok()) return s;
  return data;
}

Result<std::string> PythonEngine::Restore(
    const std::string& checkpoint, const std::vector<std::pair<bool, std::string>>& records) {
  std::string divergence;
  Status s = CallPython("restore", [&] {
    py::list list;
    for (const auto& [is_delta, payload] : records) {
      list.append(py::make_tuple(is_delta ? "delta" : "side_effect", py::bytes(payload)));
    }
    divergence = impl_->engine.attr("restore")(py::bytes(checkpoint), list).cast<std::string>();
  });
  if (!s.ok()) return s;
  return divergence;
}

bool PythonEngine::RaiseIfSignalled() { return PyErr_CheckSignals() != 0; }

PythonEngine::Unlocked::Unlocked() : state_(PyEval_SaveThread()) {}
PythonEngine::Unlocked::~Unlocked() { PyEval_RestoreThread(static_cast<PyThreadState*>(state_)); }

}  // namespace nbos::replica
