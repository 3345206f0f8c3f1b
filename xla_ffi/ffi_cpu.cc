// The FFI targets for the CPU platform.
#include "ffi_handlers.h"

namespace bagua::ffi_handlers {

HandlerTable cpu_handlers() { return handlers<Cpu>(); }

}  // namespace bagua::ffi_handlers
