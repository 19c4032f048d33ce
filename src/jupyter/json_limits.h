// Limits on untrusted JSON checked before it is parsed. nlohmann::json parses nesting without
// recursion, but serialising and comparing a value recurse once per level: a message nested a
// million levels deep would take the stack of whoever dumps it. Checking the text first costs one
// pass over its bytes.
#pragma once

#include <string_view>

namespace nbos::jupyter {

// Whether arrays and objects in `text` nest at most `max_depth` levels ("[]" is depth 1).
// Brackets inside strings do not count. Does not validate the rest of the syntax.
bool JsonDepthWithin(std::string_view text, int max_depth);

}  // namespace nbos::jupyter
