// Links braid::braid_ddp from an installed braid and averages one gradient on one rank.
#include <braid/ddp.hpp>

#include <cstdio>
#include <memory>

int main() {
  braid_unique_id_t id;
  braid_comm_t comm;
  if (braid_get_unique_id(&id) != BRAID_SUCCESS || braid_comm_init_rank(&comm, 1, id, 0) != BRAID_SUCCESS) {
    std::fprintf(stderr, "init failed: %s\n", braid_get_last_error());
    return 1;
  }
  float w[2] = {1, 2}, g[2] = {0.5f, 0.25f};
  std::unique_ptr<braid::ddp::Reducer> ddp;
  braid::ddp::Result r = braid::ddp::Reducer::create(comm, {{"w", w, g, 2, BRAID_FLOAT32}}, {}, {}, &ddp);
  if (r.ok()) r = ddp->mark_ready(0);
  if (r.ok()) r = ddp->finish();
  if (!r.ok()) {
    std::fprintf(stderr, "ddp failed: %s\n", r.message.c_str());
    return 1;
  }
  ddp.reset();
  braid_comm_destroy(comm);
  if (g[0] != 0.5f || g[1] != 0.25f) return 1;
  std::printf("ddp consumer ok\n");
  return 0;
}
