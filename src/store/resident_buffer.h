// Allocation of multi-megabyte blob buffers (internal to the store).
//
// A fresh multi-MiB allocation is an untouched mmap, so filling it takes one page fault per 4 KiB.
// Under virtualisation a fault can cost ~10 us, which caps filling a buffer at ~300 MB/s, below
// the read speed of the page cache. Populating a range in one madvise call removes nearly all of
// those faults. The hint is best effort: kernels without it (MADV_POPULATE_WRITE needs 5.14) just
// fault as usual, and it never changes the bytes, so applying it to memory malloc owns is safe.
//
// Transparent huge pages are not requested. On VMs whose balloon reports free memory to the host
// (virtio free page reporting), free 2 MiB blocks, the ones huge pages are made of, are the blocks
// the host has taken back: populating 256 MiB as huge pages a few seconds after the last
// allocation ran at 120-260 MB/s there, against 1.4-2.6 GB/s as 4 KiB pages.
#pragma once

#include <cstddef>
#include <string>

namespace nbos::store {

// Makes the whole pages inside [p, p + len) resident now, in one call.
void MakeResident(char* p, size_t len);

// Reserves capacity for `size` bytes in the empty string `s` and makes all of it resident.
void ReserveResident(std::string& s, size_t size);

}  // namespace nbos::store
