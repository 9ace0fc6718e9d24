// The ops that compose others (resolve_step, resolve_groups) call their parts through the
// dispatcher, straight to the backend kernel (below the autograd and inplace-or-view keys: the
// parts are the composing op's implementation, not calls of their own).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

namespace torch_kvcm2 {
namespace parts {

using T = const at::Tensor&;
using Opt = const std::optional<at::Tensor>&;
using ResolveFn = void(T, T, T, T, T, T, T, T, T, T, T, int64_t, int64_t, int64_t, int64_t, Opt,
                       Opt, Opt, int64_t);
using FetchFn = void(const at::TensorList&, const at::TensorList&, at::IntArrayRef,
                     const at::TensorList&, T, T, int64_t, int64_t);

template <typename Fn>
c10::TypedOperatorHandle<Fn> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

// torch_kvcm2::resolve and torch_kvcm2::fetch, looked up once.
inline const c10::TypedOperatorHandle<ResolveFn>& resolve() {
  static const auto op = handle<ResolveFn>("torch_kvcm2::resolve");
  return op;
}
inline const c10::TypedOperatorHandle<FetchFn>& fetch() {
  static const auto op = handle<FetchFn>("torch_kvcm2::fetch");
  return op;
}

}  // namespace parts
}  // namespace torch_kvcm2
