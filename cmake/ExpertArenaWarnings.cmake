# Warnings as errors on our own targets only (never on the system headers we include).
function(expert_arena_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Werror -Wno-missing-field-initializers)
endfunction()
