#include "transports/shm/shm_transport.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <new>

#include "kernels/cpu/copy_kernels.h"
#include "src/core/logging.h"
#include "transports/shm/shared_memory.h"

namespace braid {
namespace {

constexpr uint64_t kSegmentMagic =
    0x32657344494152ull;  // "RAIDse2" in memory: the header holds the write probe
constexpr size_t kCacheLine = 64;

// A value in each process that peers read once at setup to learn whether
// cross-memory attach (process_vm_readv) is permitted between them, and a
// word they write it into (process_vm_writev: peer-read collectives write
// finished pieces into each other's buffers). Every writer stores the same
// value, so concurrent probes do not matter.
const uint64_t kPeerReadProbe = 0x6272616964636d61ull;
uint64_t g_peer_write_probe = 0;

struct alignas(kCacheLine) SegmentHeader {
  uint64_t magic;
  int32_t pid;
  int32_t rank;
  uint64_t probe_addr;        // &kPeerReadProbe in the owner's address space
  uint64_t write_probe_addr;  // &g_peer_write_probe there
  alignas(kCacheLine) Doorbell bell;
  alignas(kCacheLine) std::atomic<uint32_t> failed;  // 0, or the braid_result_t that failed this rank
  char reason[512];
};

struct alignas(kCacheLine) FifoControl {
  std::atomic<uint64_t> consumed;  // slots the receiver released
  SharedCopy copy;                 // the offered send being copied, if any
};

// Each message starts on a cache line and its payload follows the header at
// once, so a message of up to 24 bytes travels in the header's line: one
// miss for the receiver instead of two.
struct SlotHeader {
  // Message number + 1 once the payload is valid; kSkip | (message number
  // + 1) where the sender closed a packed slot and that message is in the
  // next slot.
  std::atomic<uint64_t> seq;
  uint64_t bytes;
  CallTag tag;
};
static_assert(sizeof(SlotHeader) == 40, "payloads stay 8-byte aligned and share the header's line");
constexpr uint64_t kSkip = 1ull << 63;

size_t round_up(size_t x, size_t a) {
  return (x + a - 1) / a * a;
}

// Small messages are packed back to back into the first kPackArea bytes of a
// slot, so a sender can run far ahead of a receiver that is not scheduled
// (ranks outnumber cores) with a few slots: 4 slots hold 256 messages of up
// to 24 bytes. The area is small so that a run of small calls cycles through
// a few cache-resident pages, not through megabytes of slots.
constexpr size_t kPackArea = 4096;
constexpr size_t kPackMaxStride = 1024;  // larger messages take a slot each
size_t stride_of(size_t bytes) {
  return round_up(sizeof(SlotHeader) + bytes, kCacheLine);
}
bool packable(size_t stride) {
  return stride <= kPackMaxStride;
}
// Whether a message of `stride` bytes may be packed at `offset` of a slot.
bool packs_at(size_t offset, size_t stride) {
  return packable(stride) && offset + stride <= kPackArea;
}
// Whether a slot filled to `offset` can take no more messages (not even an
// empty one): both sides then move to the next slot without a skip mark.
bool pack_area_full(size_t offset) {
  return offset + kCacheLine > kPackArea;
}
// The pack area's line starts as bits: where a packed message may begin.
static_assert(kPackArea / kCacheLine == 64, "one bit per line start of the pack area");
uint64_t line_bit(size_t offset) {
  return uint64_t{1} << (offset / kCacheLine);
}
// The line starts a message at `offset` of `stride` bytes covers with its
// payload (those after its header's line), within the pack area.
uint64_t payload_lines(size_t offset, size_t stride) {
  const size_t first = offset / kCacheLine + 1;
  const size_t end = std::min(offset + stride, kPackArea) / kCacheLine;
  if (end <= first) return 0;
  const uint64_t below_end = end == 64 ? ~uint64_t{0} : (uint64_t{1} << end) - 1;
  return below_end & ~((uint64_t{1} << first) - 1);
}

struct Layout {
  size_t slot_stride;  // SlotHeader + payload
  size_t fifo_bytes;
  size_t header_bytes;
  size_t total(size_t nfifos) const { return header_bytes + nfifos * fifo_bytes; }
  static Layout make(const Config& c) {
    Layout l;
    l.slot_stride = round_up(sizeof(SlotHeader) + c.shm_slot_bytes, kCacheLine);
    l.fifo_bytes = sizeof(FifoControl) + static_cast<size_t>(c.shm_slots) * l.slot_stride;
    l.header_bytes = round_up(sizeof(SegmentHeader), 4096);
    return l;
  }
};

// Who made a segment: its name carries the creator's pid and pid namespace,
// so two jobs with one token (braid_comm_init_env hashes MASTER_ADDR:PORT)
// never meet on a name, a rerun never meets what a killed run left, and a
// segment whose creator is gone can be told apart (remove_stale_segments).
struct SegmentOwner {
  uint64_t pid_ns = 0;  // inode of /proc/self/ns/pid, 0 where unreadable
  int32_t pid = 0;
  uint8_t ok = 0;  // the segment was made
  uint8_t pad[3] = {};
};
static_assert(sizeof(SegmentOwner) == 16, "exchanged as bytes");

uint64_t pid_namespace_id() {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

constexpr char kNamePrefix[] = "braid-";

std::string segment_name(const JobToken& token, int rank, const SegmentOwner& owner) {
  return "/" + std::string(kNamePrefix) + token_hex(token, 8) + "-" + std::to_string(rank) + "-" +
         std::to_string(owner.pid) + "-" + std::to_string(owner.pid_ns);
}

// Whether process `pid` of this pid namespace is gone or on its way out (a
// zombie, or exiting: a peer killed a moment ago closed its sockets, which
// is how survivors learn of it, before it became a zombie).
bool process_gone(int32_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0) return errno == ESRCH;
  FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return false;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* after = std::strrchr(buf, ')');  // the command name may hold anything
  if (after == nullptr) return false;
  char state = 0;
  unsigned long flags = 0;
  if (std::sscanf(after + 1, " %c %*d %*d %*d %*d %*d %lu", &state, &flags) != 2) return false;
  constexpr unsigned long kExiting = 0x4;  // PF_EXITING
  return state == 'Z' || state == 'X' || (flags & kExiting) != 0;
}

// Unlinks the segments in /dev/shm that a process of this pid namespace,
// running as this user, made and left behind when it died before its peers
// had mapped them (a job killed during init). Names of other namespaces
// are left alone: their pids mean nothing here.
void remove_stale_segments() {
  const uint64_t ns = pid_namespace_id();
  if (ns == 0) return;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  while (const dirent* e = readdir(dir)) {
    const char* name = e->d_name;
    if (std::strncmp(name, kNamePrefix, sizeof(kNamePrefix) - 1) != 0) continue;
    char token[17];
    int rank = 0;
    int32_t pid = 0;
    unsigned long long their_ns = 0;
    int end = 0;
    if (std::sscanf(name + sizeof(kNamePrefix) - 1, "%16[0-9a-f]-%d-%d-%llu%n", token, &rank, &pid, &their_ns,
                    &end) != 4 ||
        name[sizeof(kNamePrefix) - 1 + static_cast<size_t>(end)] != '\0' || their_ns != ns)
      continue;
    struct stat st;
    if (fstatat(dirfd(dir), name, &st, 0) != 0 || st.st_uid != geteuid() || !process_gone(pid)) continue;
    if (shm_unlink(("/" + std::string(name)).c_str()) == 0)
      BRAID_INFO("SHM", -1, "removed /dev/shm/%s, left by process %d, which is gone", name,
                 static_cast<int>(pid));
  }
  closedir(dir);
}

}  // namespace

struct ShmTransport::Mapping {
  void* base = nullptr;
  size_t bytes = 0;
  int rank = -1;
  ~Mapping() {
    if (base != nullptr) munmap(base, bytes);
  }
  SegmentHeader* header() const { return static_cast<SegmentHeader*>(base); }
};

namespace {

class ShmConnection : public Connection {
 public:
  ShmConnection(ShmTransport::Mapping* mine, ShmTransport::Mapping* theirs, size_t recv_fifo,
                size_t send_fifo, const Layout& layout, const Config& config, int peer)
      : layout_(layout),
        slots_(static_cast<uint64_t>(config.shm_slots)),
        slot_bytes_(config.shm_slot_bytes),
        mine_(mine->header()),
        theirs_(theirs->header()),
        payload_lines_(slots_, 0),
        peer_(peer) {
    recv_ = static_cast<char*>(mine->base) + layout.header_bytes + recv_fifo * layout.fifo_bytes;
    send_ = static_cast<char*>(theirs->base) + layout.header_bytes + send_fifo * layout.fifo_bytes;
    peer_pid_ = theirs_->pid;
    // A pidfd reports the peer's exit even while it is an unreaped zombie
    // (kill(pid, 0) still succeeds then) and cannot name a reused pid.
#ifdef SYS_pidfd_open
    peer_pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, peer_pid_, 0));
#endif
  }
  ~ShmConnection() override {
    if (peer_pidfd_ >= 0) close(peer_pidfd_);
  }

  const char* kind() const override {
    return "shm";
  }
  size_t slot_bytes() const override {
    return slot_bytes_;
  }

  // A message goes after the previous one in the open slot when both are
  // small and it fits the pack area; else it starts the next slot, which
  // needs the receiver to have released one (flow control counts slots).
  void* send_slot(size_t bytes) override {
    const size_t stride = stride_of(bytes);
    if (open_ && packs_at(fill_, stride)) {
      next_in_open_ = true;
      return header(send_, taken_ - 1, fill_) + 1;
    }
    if (open_) close_open_slot();
    // The receiver's count lives on a line it writes at every slot release:
    // read it only when the count seen last says the fifo is full.
    if (taken_ - consumed_seen_ >= slots_) {
      consumed_seen_ = control(send_)->consumed.load(std::memory_order_acquire);
      if (taken_ - consumed_seen_ >= slots_) return nullptr;
    }
    next_in_open_ = false;
    return header(send_, taken_, 0) + 1;
  }
  void commit_send(size_t bytes, const CallTag& tag) override {
    const size_t stride = stride_of(bytes);
    size_t at;  // the message's offset in its slot
    if (next_in_open_) {
      at = fill_;
      fill_ += stride;
    } else {
      at = 0;
      ++taken_;
      fill_ = stride;
      open_ = packable(stride);
    }
    SlotHeader* h = header(send_, taken_ - 1, at);
    if (open_ && pack_area_full(fill_)) open_ = false;
    uint64_t& stale = payload_lines_[(taken_ - 1) % slots_];
    stale = (stale & ~line_bit(at)) | payload_lines(at, stride);
    // The receiver looks for the next message where this one ends. Where an
    // old payload's bytes lie there, they could read as its number: clear
    // it first. Only there: clearing on every message wrote a second line
    // per message, the one the receiver polls (a steady run of one size
    // finds headers where it looks, lap after lap).
    if (open_ && (stale & line_bit(fill_)) != 0) {
      header(send_, taken_ - 1, fill_)->seq.store(0, std::memory_order_relaxed);
      stale &= ~line_bit(fill_);
    }
    h->bytes = bytes;
    h->tag = tag;
    h->seq.store(++sent_, std::memory_order_release);
    theirs_->bell.ring(true);
  }
  void copy_to_slot(void* slot, const void* src, size_t bytes) override {
    if (bytes >= stream_min_ && bytes < stream_max_)
      kernels::copy_streaming(slot, src, bytes);
    else
      std::memcpy(slot, src, bytes);
  }
  void stream_copies(size_t min_bytes, size_t max_bytes) {
    stream_min_ = min_bytes;
    stream_max_ = max_bytes;
  }
  bool recv_ready(const void** data, size_t* bytes) override {
    SlotHeader* h = header(recv_, at_slot_, at_);
    uint64_t seq = h->seq.load(std::memory_order_acquire);
    if (seq == (kSkip | (received_ + 1))) {
      release_slot();
      h = header(recv_, at_slot_, 0);
      seq = h->seq.load(std::memory_order_acquire);
    }
    if (seq != received_ + 1) return false;
    // The peer's word: a length past its slot (or, packed, past the pack
    // area) would have this rank read beyond it, past the segment's end
    // for the last slot. The receive then waits, and check_peer says why.
    const uint64_t n = h->bytes;
    if (n > slot_bytes_ || (at_ > 0 && !packs_at(at_, stride_of(n)))) {
      if (corrupt_.is_ok())
        corrupt_ =
            Status::remote("rank " + std::to_string(peer_) + " (this host) wrote a message header of " +
                           std::to_string(n) + " bytes at offset " + std::to_string(at_) + " of a slot of " +
                           std::to_string(slot_bytes_) + " bytes (shared memory corrupted)");
      return false;
    }
    *data = h + 1;
    *bytes = n;
    return true;
  }
  const CallTag& recv_tag() const override {
    return header(recv_, at_slot_, at_)->tag;
  }
  void release_recv() override {
    const size_t stride = stride_of(header(recv_, at_slot_, at_)->bytes);
    ++received_;
    at_ += stride;
    // Releases inside a packed slot tell the sender nothing: it waits only
    // for whole slots.
    if (!packable(stride) || pack_area_full(at_)) release_slot();
  }
  Status progress() override {
    return Status::ok();
  }
  bool supports_peer_reads() const override {
    return peer_reads_;
  }
  Status read_peer(void* dst, uint64_t remote, size_t bytes) override {
    return cross_copy(false, static_cast<char*>(dst), remote, bytes);
  }
  Status write_peer(uint64_t remote, const void* src, size_t bytes) override {
    return cross_copy(true, const_cast<char*>(static_cast<const char*>(src)), remote, bytes);
  }
  SharedCopy* shared_copy(bool as_sender) override {
    return &control(as_sender ? send_ : recv_)->copy;
  }
  void wake_peer() override {
    theirs_->bell.ring(true);
  }
  Status map_peer_memory(int fd, size_t bytes, char** out) override {
    return map_peer_allocation(peer_pidfd_, fd, bytes, out);
  }
  void enable_peer_reads() {
    peer_reads_ = true;
  }
  // process_vm_writev (`write`) or process_vm_readv between `local` and the
  // peer's `remote`, until every byte moved.
  Status cross_copy(bool write, char* local, uint64_t remote, size_t bytes) {
    while (bytes > 0) {
      iovec mine{local, bytes}, far{reinterpret_cast<void*>(remote), bytes};
      ssize_t n = write ? process_vm_writev(peer_pid_, &mine, 1, &far, 1, 0)
                        : process_vm_readv(peer_pid_, &mine, 1, &far, 1, 0);
      if (n <= 0) {
        if (n < 0 && errno == EINTR) continue;
        int err = n < 0 ? errno : EFAULT;
        return Status(err == ESRCH ? BRAID_ERR_REMOTE : BRAID_ERR_SYSTEM,
                      std::string(write ? "writing " : "reading ") + std::to_string(bytes) + " bytes " +
                          (write ? "to" : "from") + " rank " + std::to_string(peer_) + " (pid " +
                          std::to_string(peer_pid_) + ") with " +
                          (write ? "process_vm_writev: " : "process_vm_readv: ") + std::strerror(err));
      }
      local += n;
      remote += static_cast<uint64_t>(n);
      bytes -= static_cast<size_t>(n);
    }
    return Status::ok();
  }
  Status check_peer(bool thorough) override {
    BRAID_RETURN_IF_ERROR(corrupt_);
    BRAID_RETURN_IF_ERROR(peer_failure());
    if (thorough && peer_exited())
      return Status::remote("rank " + std::to_string(peer_) + " (pid " + std::to_string(peer_pid_) +
                            ", this host) died");
    return Status::ok();
  }
  Status peer_failure() override {
    if (uint32_t code = theirs_->failed.load(std::memory_order_acquire); code != 0) {
      char reason[sizeof(theirs_->reason)];
      std::memcpy(reason, theirs_->reason, sizeof(reason));
      // Report the peer's own code: a mismatch it found is a mismatch here too.
      if (code > BRAID_ERR_IN_PROGRESS) code = BRAID_ERR_REMOTE;
      return Status(static_cast<braid_result_t>(code),
                    "rank " + std::to_string(peer_) + " (pid " + std::to_string(peer_pid_) +
                        ", this host) failed: " + printable_text(reason, strnlen(reason, sizeof(reason))));
    }
    return Status::ok();
  }

 private:
  // The open slot takes no more messages: the next one starts the next
  // slot, which the receiver learns from a skip mark where it would look.
  void close_open_slot() {
    open_ = false;
    payload_lines_[(taken_ - 1) % slots_] &= ~line_bit(fill_);
    header(send_, taken_ - 1, fill_)->seq.store(kSkip | (sent_ + 1), std::memory_order_release);
    theirs_->bell.ring(true);  // a receiver asleep on the closed slot moves on and frees it
  }
  void release_slot() {
    ++at_slot_;
    at_ = 0;
    control(recv_)->consumed.store(at_slot_, std::memory_order_release);
    theirs_->bell.ring(true);
  }
  bool peer_exited() const {
    if (peer_pidfd_ >= 0) {
      pollfd p{peer_pidfd_, POLLIN, 0};
      return poll(&p, 1, 0) > 0;
    }
    return kill(peer_pid_, 0) != 0 && errno == ESRCH;
  }
  FifoControl* control(char* fifo) const {
    return reinterpret_cast<FifoControl*>(fifo);
  }
  // The message header at `offset` in the fifo's slot number `n` (counted
  // from the start, so modulo the slot count).
  SlotHeader* header(char* fifo, uint64_t n, size_t offset) const {
    return reinterpret_cast<SlotHeader*>(fifo + sizeof(FifoControl) + (n % slots_) * layout_.slot_stride +
                                         offset);
  }

  Layout layout_;
  uint64_t slots_;
  size_t slot_bytes_;
  Status corrupt_;  // a message header that could not be from an intact peer (recv_ready)
  SegmentHeader* mine_;
  SegmentHeader* theirs_;
  char* recv_ = nullptr;
  char* send_ = nullptr;
  // Sender: messages sent, slots taken, whether the last one taken is open
  // for packing and how far it is filled, where the next send_slot put it.
  uint64_t sent_ = 0;
  uint64_t taken_ = 0;
  bool open_ = false;
  size_t fill_ = 0;
  bool next_in_open_ = false;
  uint64_t consumed_seen_ = 0;  // the receiver's slot release count, as last read
  // Per slot, the pack area's line starts whose first word holds payload
  // bytes (line_bit): where the next message's number must be cleared.
  std::vector<uint64_t> payload_lines_;
  size_t stream_min_ = 0, stream_max_ = 0;  // copy_to_slot's streaming band (empty: none)
  // Receiver: messages released, and the slot and offset of the next one.
  uint64_t received_ = 0;
  uint64_t at_slot_ = 0;
  size_t at_ = 0;
  int peer_;
  int peer_pid_ = 0;
  int peer_pidfd_ = -1;
  bool peer_reads_ = false;
};

// Whether process_vm_readv can read `peer`'s probe value and
// process_vm_writev write it back into its probe word (permissions,
// seccomp and Yama can each forbid either).
bool probe_peer_reads(const SegmentHeader* peer) {
  uint64_t got = 0;
  iovec local{&got, sizeof(got)}, far{reinterpret_cast<void*>(peer->probe_addr), sizeof(got)};
  if (process_vm_readv(peer->pid, &local, 1, &far, 1, 0) != static_cast<ssize_t>(sizeof(got)) ||
      got != kPeerReadProbe)
    return false;
  iovec to{reinterpret_cast<void*>(peer->write_probe_addr), sizeof(got)};
  return process_vm_writev(peer->pid, &local, 1, &to, 1, 0) == static_cast<ssize_t>(sizeof(got));
}

Status map_segment(const std::string& name, size_t bytes, bool create, void** base) {
  int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) return Status::system("shm_open(" + name + ")", errno);
  if (create) {
    // posix_fallocate makes a full /dev/shm fail here, not with SIGBUS later.
    int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (err != 0) {
      close(fd);
      shm_unlink(name.c_str());
      if (err == ENOSPC)
        return Status(BRAID_ERR_SYSTEM,
                      "shared memory segment " + name + " of " + std::to_string(bytes) +
                          " bytes does not fit in /dev/shm (full or too small); free space there, "
                          "lower BRAID_SHM_SLOT_BYTES, or use BRAID_TRANSPORT=tcp");
      if (err == EFBIG)
        return Status(BRAID_ERR_SYSTEM,
                      "shared memory segment " + name + " of " + std::to_string(bytes) +
                          " bytes exceeds this process's file size limit (ulimit -f); "
                          "raise it, lower BRAID_SHM_SLOT_BYTES, or use BRAID_TRANSPORT=tcp");
      return Status::system("sizing shared memory segment " + name, err);
    }
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());  // nobody else will: its size stays in /dev/shm's memory
    return Status::system("mmap of " + name, err);
  }
  *base = p;
  return Status::ok();
}

}  // namespace

Status ShmTransport::setup(Bootstrap& bootstrap, const std::vector<int>& host_group, int nchannels,
                           const Config& config, std::unique_ptr<ShmTransport>* out, bool* unavailable) {
  *unavailable = false;
  std::unique_ptr<ShmTransport> t(new ShmTransport());
  const int me = bootstrap.rank();
  const Layout layout = Layout::make(config);
  const size_t npeers = host_group.size() - 1;
  const size_t bytes = layout.total(npeers * static_cast<size_t>(nchannels));
  SegmentOwner mine;
  mine.pid = static_cast<int32_t>(getpid());
  mine.pid_ns = pid_namespace_id();
  const std::string my_name = segment_name(bootstrap.token(), me, mine);
  const Deadline deadline = Deadline::after_seconds(config.timeout_s);
  // Names unlinked on return. Our segment leaves /dev/shm once peers mapped
  // it, or on any early return. A peer killed between making its segment and
  // our return cannot unlink it: on failure every rank unlinks the host
  // group's names once they are known (those already gone give ENOENT, which
  // is fine), and before that, what processes now gone left.
  struct Unlink {
    std::vector<std::string> names;
    bool stale = false;
    ~Unlink() {
      for (const std::string& n : names) shm_unlink(n.c_str());
      if (stale) remove_stale_segments();
    }
  } unlink;
  Status st;
  if (npeers > 0) {
    remove_stale_segments();
    // A name with our pid that exists already is a segment of a process
    // this pid had before, gone without unlinking it (a crash, or a
    // namespace the sweep cannot read): nobody else can own it.
    shm_unlink(my_name.c_str());
    auto m = std::make_unique<Mapping>();
    m->bytes = bytes;
    m->rank = me;
    st = map_segment(my_name, bytes, true, &m->base);
    if (st) unlink.names.push_back(my_name);
    if (st) {
      auto* h = new (m->base) SegmentHeader();
      h->magic = kSegmentMagic;
      h->pid = static_cast<int32_t>(getpid());
      h->rank = me;
      h->probe_addr = reinterpret_cast<uint64_t>(&kPeerReadProbe);
      h->write_probe_addr = reinterpret_cast<uint64_t>(&g_peer_write_probe);
      h->failed.store(0);
      std::memset(h->reason, 0, sizeof(h->reason));
      t->maps_.push_back(std::move(m));
    }
  }
  // Let local peers read our memory with process_vm_readv (and take
  // registered buffers' descriptors with pidfd_getfd) where Yama would
  // otherwise allow only our ancestors to (harmless where Yama is absent).
  // Only with local peers: it widens who may attach to this process.
  if (npeers > 0) prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  // Every rank takes part in the barriers, so a failure anywhere is seen everywhere.
  mine.ok = st ? 1 : 0;
  std::vector<uint8_t> gathered;
  unlink.stale = npeers > 0;  // until every owner is known
  BRAID_RETURN_IF_ERROR(bootstrap.all_gather(&mine, sizeof(mine), &gathered, deadline));
  std::vector<SegmentOwner> owners(gathered.size() / sizeof(SegmentOwner));
  std::memcpy(owners.data(), gathered.data(), owners.size() * sizeof(SegmentOwner));
  unlink.stale = false;
  for (int peer : host_group)
    if (peer != me && owners[static_cast<size_t>(peer)].ok)
      unlink.names.push_back(segment_name(bootstrap.token(), peer, owners[static_cast<size_t>(peer)]));
  // From here every rank knows of a failure anywhere: all report it alike.
  *unavailable = true;
  if (!st) return st;
  for (size_t r = 0; r < owners.size(); ++r)
    if (!owners[r].ok)
      return Status::remote("rank " + std::to_string(r) + " could not create its shared memory segment");
  *unavailable = false;
  for (int peer : host_group) {
    if (peer == me) continue;
    auto m = std::make_unique<Mapping>();
    m->bytes = bytes;
    m->rank = peer;
    st = map_segment(segment_name(bootstrap.token(), peer, owners[static_cast<size_t>(peer)]), bytes, false,
                     &m->base);
    if (!st) break;
    if (m->header()->magic != kSegmentMagic) {
      st = Status::internal("shared memory segment of rank " + std::to_string(peer) + " has a bad header");
      break;
    }
    t->maps_.push_back(std::move(m));
  }
  bool reads_ok = config.shm_peer_reads;
  for (size_t i = 1; st && reads_ok && i < t->maps_.size(); ++i)
    reads_ok = probe_peer_reads(t->maps_[i]->header());
  const uint8_t ok = static_cast<uint8_t>((st ? 1 : 0) | (reads_ok ? 2 : 0));
  std::vector<uint8_t> oks;
  BRAID_RETURN_IF_ERROR(bootstrap.all_gather(&ok, 1, &oks, deadline));
  *unavailable = true;
  if (!st) return st;
  bool all_reads = true;
  for (size_t r = 0; r < oks.size(); ++r) {
    if (!(oks[r] & 1))
      return Status::remote("rank " + std::to_string(r) + " could not map a shared memory segment");
    all_reads = all_reads && (oks[r] & 2);
  }
  *unavailable = false;

  // FIFO index of sender `s` inside receiver `r`'s segment.
  auto fifo_index = [&](int channel, int receiver, int sender) {
    size_t pos =
        static_cast<size_t>(std::find(host_group.begin(), host_group.end(), sender) - host_group.begin());
    if (sender > receiver) --pos;
    return static_cast<size_t>(channel) * npeers + pos;
  };
  for (size_t i = 1; i < t->maps_.size(); ++i) {
    int peer = t->maps_[i]->rank;
    for (int c = 0; c < nchannels; ++c) {
      auto conn =
          std::make_unique<ShmConnection>(t->maps_[0].get(), t->maps_[i].get(), fifo_index(c, me, peer),
                                          fifo_index(c, peer, me), layout, config, peer);
      // Every rank decides alike, so algorithms that read peers agree.
      if (all_reads) conn->enable_peer_reads();
      t->conns_.push_back(std::move(conn));
      t->conn_peer_.push_back(peer);
      t->conn_channel_.push_back(c);
    }
  }
  // Peers mapped ours, which goes now; theirs are theirs to unlink.
  unlink.names.clear();
  if (npeers > 0) unlink.names.push_back(my_name);
  *out = std::move(t);
  return Status::ok();
}

ShmTransport::~ShmTransport() = default;

Connection* ShmTransport::connection(int channel, int peer) {
  for (size_t i = 0; i < conns_.size(); ++i)
    if (conn_peer_[i] == peer && conn_channel_[i] == channel) return conns_[i].get();
  return nullptr;
}

void ShmTransport::stream_copies(size_t min_bytes, size_t max_bytes) {
  for (auto& c : conns_) static_cast<ShmConnection*>(c.get())->stream_copies(min_bytes, max_bytes);
}

namespace {

// Spins until `ready` holds: only for time_slot_copies, which runs before
// the engine exists and only where every rank has a core of its own.
template <typename Ready>
Status spin_until(ShmConnection* c, int peer, const Bootstrap& bootstrap, Deadline deadline, Ready ready) {
  for (uint32_t spins = 1;; ++spins) {
    if (ready()) return Status::ok();
    if (spins % 4096 == 0) {
      BRAID_RETURN_IF_ERROR(c->check_peer(true));
      BRAID_RETURN_IF_ERROR(bootstrap.abort_status());
      if (deadline.expired())
        return Status::timeout("timing shm slot copies with rank " + std::to_string(peer) +
                               ": it did not answer before the init deadline (BRAID_TIMEOUT)");
      sched_yield();
    }
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

Status ShmTransport::time_slot_copies(int peer, bool sender, size_t bytes, int rounds,
                                      const Bootstrap& bootstrap, Deadline deadline, CopyTimes* out) {
  auto* c = static_cast<ShmConnection*>(connection(0, peer));
  if (c == nullptr) return Status::internal("no shm connection to rank " + std::to_string(peer));
  bytes = std::min(bytes, c->slot_bytes());
  std::vector<char> buffer(bytes, 1);
  // Rounds take turns: slot copy of `bytes` plain, then streaming.
  enum Kind { kPlain, kStreaming };
  constexpr int kinds = 2;
  std::vector<double> took[kinds];
  // One round of each kind warms the slots and the caches.
  for (int i = 0; i < kinds * (rounds + 1); ++i) {
    const Kind kind = static_cast<Kind>(i % kinds);
    const void* data = nullptr;
    size_t n = 0;
    void* slot = nullptr;
    if (sender) {
      const auto t0 = std::chrono::steady_clock::now();
      BRAID_RETURN_IF_ERROR(
          spin_until(c, peer, bootstrap, deadline, [&] { return (slot = c->send_slot(bytes)) != nullptr; }));
      if (kind == kStreaming)
        kernels::copy_streaming(slot, buffer.data(), bytes);
      else
        std::memcpy(slot, buffer.data(), bytes);
      c->commit_send(bytes, CallTag{});
      BRAID_RETURN_IF_ERROR(
          spin_until(c, peer, bootstrap, deadline, [&] { return c->recv_ready(&data, &n); }));
      c->release_recv();
      const std::chrono::duration<double, std::micro> t = std::chrono::steady_clock::now() - t0;
      if (i >= kinds) took[kind].push_back(t.count());
    } else {
      BRAID_RETURN_IF_ERROR(
          spin_until(c, peer, bootstrap, deadline, [&] { return c->recv_ready(&data, &n); }));
      std::memcpy(buffer.data(), data, std::min(n, buffer.size()));
      c->release_recv();
      BRAID_RETURN_IF_ERROR(
          spin_until(c, peer, bootstrap, deadline, [&] { return (slot = c->send_slot(0)) != nullptr; }));
      c->commit_send(0, CallTag{});
    }
  }
  if (sender && rounds > 0) {
    out->plain_us = median(took[kPlain]);
    out->streaming_us = median(took[kStreaming]);
  }
  return Status::ok();
}

Doorbell* ShmTransport::doorbell() {
  return maps_.empty() ? nullptr : &maps_[0]->header()->bell;
}

void ShmTransport::mark_failed(const Status& why) {
  if (maps_.empty() || why.is_ok()) return;
  SegmentHeader* h = maps_[0]->header();
  std::strncpy(h->reason, why.message().c_str(), sizeof(h->reason) - 1);
  h->failed.store(static_cast<uint32_t>(why.code()), std::memory_order_release);
  for (auto& m : maps_) m->header()->bell.ring(true);
}

}  // namespace braid
