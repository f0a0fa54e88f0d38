// braid's sockets are not a forked child's: a peer learns that a rank died
// from its connections closing, which a child still holding copies prevents
// (a DataLoader worker forked from a rank kept the rank's tcp connections
// open after the rank died, and its peers waited for their deadline instead
// of failing at once; the root of a rendezvous kept listening in every
// forked rank). In the child, every socket braid made that is still open
// (the same socket as when made) is pointed at /dev/null: the child drops
// its reference, and the descriptor's number stays taken, so a stale close
// from the parent's objects cannot hit a file the child opened since.
#pragma once

namespace braid {

// Marks `fd`, a socket braid just made (created or accepted), as one a
// forked child lets go of. Sockets closed since need no unmarking: the child
// checks that a descriptor still is the socket that was marked.
void guard_socket_from_children(int fd);

}  // namespace braid
