# Warnings on our own targets only (never on the system headers we include).
#
# Warnings are always on; turning them into errors is a developer and CI choice
# (EXPERT_ARENA_WERROR, ON in the presets CI uses), never forced on someone who builds the
# project with their own compiler, flags or build type: a new compiler's new warning must not
# break their build. See docs/building.md.
option(EXPERT_ARENA_WERROR "Treat compiler warnings in expert-arena's own code as errors" OFF)

function(expert_arena_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-missing-field-initializers)
  if(EXPERT_ARENA_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()
