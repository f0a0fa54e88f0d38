// Host memory other processes of this host can map (braid_mem_alloc).
//
// Each allocation is its own memfd, mapped shared. A peer maps it through
// the owner's pidfd (pidfd_getfd), which asks for the same permission as the
// cross-memory reads the shm transport already uses. Collectives whose
// buffers lie in such memory, registered on a communicator, then read and
// write each other's buffers with plain loads and stores: no copy through a
// slot, no page pinning by the kernel.
#pragma once

#include <cstddef>
#include <cstdint>

#include "src/core/status.h"

namespace braid {

struct SharedAllocation {
  char* base = nullptr;
  size_t bytes = 0;  // as mapped: the request rounded up to whole pages
  int fd = -1;       // the memfd, open for as long as the allocation lives
  int registrations = 0;
  uint64_t serial = 0;  // never reused in this process, as fd numbers and addresses are
};

// A new allocation of at least `bytes` (> 0), zero-filled.
Status shared_alloc(size_t bytes, void** out);
// Frees what shared_alloc returned (exactly that pointer), unless a
// communicator still has it registered (peers map it: memory at the same
// address later would not be what they read).
Status shared_free(void* ptr);
// The allocation that holds all of [ptr, ptr + bytes), if one does, with
// one more registration on it (shared_free refuses while any), counted under
// the same lock that found it: a free on another thread cannot close the
// memfd between the two, so peers never take a reused fd number.
bool retain_shared(const void* ptr, size_t bytes, SharedAllocation* out);
// Drops one registration on the allocation at `base`.
void shared_release(char* base);

// Maps, read-write, the allocation whose memfd is `fd` in the process of
// `pidfd`, `bytes` long (its SharedAllocation::bytes); munmap undoes it.
Status map_peer_allocation(int pidfd, int fd, size_t bytes, char** out);

}  // namespace braid
