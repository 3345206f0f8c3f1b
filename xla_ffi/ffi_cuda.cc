// The FFI targets for the CUDA platform; compiled only when CUDA is built.
#include "ffi_handlers.h"

namespace bagua::ffi_handlers {

HandlerTable cuda_handlers() { return handlers<Cuda>(); }

}  // namespace bagua::ffi_handlers
