// Self-registration of op bindings: each csrc/<op>/bind.cpp adds itself with
// TK_BIND(name) { m.def(...); }, so adding an op never edits a shared file.
#pragma once
#include <pybind11/pybind11.h>
#include <vector>

namespace tk {
using BindFn = void (*)(pybind11::module_&);
std::vector<BindFn>& bind_registry();
struct BindRegistrar {
  explicit BindRegistrar(BindFn f) { bind_registry().push_back(f); }
};
}  // namespace tk

#define TK_BIND(name)                                              \
  static void tk_bind_##name(pybind11::module_& m);                \
  static ::tk::BindRegistrar tk_bind_registrar_##name(tk_bind_##name); \
  static void tk_bind_##name(pybind11::module_& m)
