#include "store/resident_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cassert>
#include <cstdint>

namespace nbos::store {

namespace {

// Below this, malloc serves from the heap and faults are few enough not to matter.
constexpr size_t kLargeThreshold = size_t{4} << 20;

// The whole pages inside [p, p + len) (neighbouring allocations are left alone), or false.
bool PageRange(char* p, size_t len, void*& addr, size_t& bytes) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto start = reinterpret_cast<uintptr_t>(p);
  const uintptr_t begin = (start + page - 1) & ~(page - 1);
  const uintptr_t end = (start + len) & ~(page - 1);
  if (end <= begin) return false;
  addr = reinterpret_cast<void*>(begin);
  bytes = end - begin;
  return true;
}

}  // namespace

void MakeResident(char* p, size_t len) {
  void* addr = nullptr;
  size_t bytes = 0;
  if (len >= kLargeThreshold && PageRange(p, len, addr, bytes)) {
    ::madvise(addr, bytes, MADV_POPULATE_WRITE);
  }
}

void ReserveResident(std::string& s, size_t size) {
  assert(s.empty());
  s.reserve(size);
  MakeResident(s.data(), s.capacity());
}

}  // namespace nbos::store
