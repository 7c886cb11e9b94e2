# expert_arena_gpu_option(VAR LABEL): a tri-state cache option AUTO | ON | OFF (default AUTO).
# Any CMake true constant (1, YES, TRUE...) reads as ON and any false one as OFF, so
# -DEXPERT_ARENA_CUDA=1 works; anything else fails the configure with the accepted values.
function(expert_arena_gpu_option var label)
  set(${var} AUTO CACHE STRING
      "Build the ${label} backend: AUTO (when found), ON (required), OFF")
  set_property(CACHE ${var} PROPERTY STRINGS AUTO ON OFF)
  string(TOUPPER "${${var}}" value)
  if(value STREQUAL "AUTO")
    set(value AUTO)
  elseif(value MATCHES "^(ON|YES|TRUE|Y|1)$")
    set(value ON)
  elseif(value MATCHES "^(OFF|NO|FALSE|N|0)$")
    set(value OFF)
  else()
    message(FATAL_ERROR "${var}=${${var}}: expected AUTO, ON or OFF")
  endif()
  set(${var} ${value} PARENT_SCOPE)
endfunction()
