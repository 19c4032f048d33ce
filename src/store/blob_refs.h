// The blob keys a kernel's state refers to, read from its bytes: what garbage collection must
// keep.
//
// Every namespace delta and snapshot is an "NBSD" container (src/replica/python/nbos_state_wire.py:
// magic, version 1, kind 'D' or 'S', u32 little-endian header length, JSON header) whose header
// names the blobs it needs: "payload" (the pickles, when stored apart), "blobs" ([token, key]
// pairs) and "oob" (keys). A checkpoint, a journal record or a whole state-machine snapshot holds
// such containers verbatim, alone or inside framing of its own (a checkpoint's side effects, the
// snapshot's records): the scan finds each container by its magic wherever it lies. A false
// match (the magic inside a pickle) can only add keys, so the scan never drops a real reference.
#pragma once

#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace nbos::store {

// The valid keys named by the container at the start of `bytes`, in its header's order (payload,
// blobs, oob) without repeats; none if no container starts there.
std::vector<std::string> BlobKeysOfContainer(std::string_view bytes);

// Adds to `keys` the valid blob keys named by every container in `bytes`.
void AddBlobKeysIn(std::string_view bytes, std::set<std::string>* keys);

}  // namespace nbos::store
