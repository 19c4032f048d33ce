// Allocation of multi-megabyte blob buffers (internal to the store).
//
// A fresh multi-MiB allocation is an untouched mmap, so filling it takes one page fault per 4 KiB.
// Under virtualisation a fault can cost ~10 us, which caps filling a buffer at ~300 MB/s, below
// the read speed of the page cache. Asking for transparent huge pages and populating a range in
// one madvise call removes nearly all of those faults. All hints are best effort: kernels without
// them (MADV_POPULATE_WRITE needs 5.14) or with THP disabled just fault as usual. The hints never
// change the bytes, so applying them to memory malloc owns is safe.
#pragma once

#include <cstddef>
#include <string>

namespace nbos::store {

// Reserves capacity for `size` bytes in the empty string `s`, as huge pages from a few MiB up.
// Nothing is made resident yet.
void ReserveLarge(std::string& s, size_t size);

// Makes the whole pages inside [p, p + len) resident now, in one call.
void MakeResident(char* p, size_t len);

// ReserveLarge, then MakeResident on all of the capacity.
void ReserveResident(std::string& s, size_t size);

}  // namespace nbos::store
