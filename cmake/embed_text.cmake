# Writes INPUT into OUTPUT as a C++ raw string constant named VAR.
file(READ ${INPUT} content)
get_filename_component(name ${INPUT} NAME)
file(WRITE ${OUTPUT}.tmp
  "// Generated from ${name}; do not edit.\n#pragma once\n\n"
  "// The limit the standard names (65536) is not one of GCC or clang, which read any length.\n"
  "#pragma GCC diagnostic ignored \"-Woverlength-strings\"\n\n"
  "inline constexpr char ${VAR}[] = R\"nbos_py(${content})nbos_py\";\n")
file(COPY_FILE ${OUTPUT}.tmp ${OUTPUT} ONLY_IF_DIFFERENT)
file(REMOVE ${OUTPUT}.tmp)
