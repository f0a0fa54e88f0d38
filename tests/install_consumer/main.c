/* Links against an installed braid through find_package and pkg-config, and
 * runs a one-rank all_reduce. */
#include <braid/braid.h>
#include <stdio.h>

int main(void) {
  braid_unique_id_t id;
  braid_comm_t comm;
  float in[3] = {1, 2, 3}, out[3] = {0, 0, 0};
  if (braid_get_unique_id(&id) != BRAID_SUCCESS || braid_comm_init_rank(&comm, 1, id, 0) != BRAID_SUCCESS) {
    fprintf(stderr, "init failed: %s\n", braid_get_last_error());
    return 1;
  }
  if (braid_all_reduce(in, out, 3, BRAID_FLOAT32, BRAID_SUM, comm, NULL) != BRAID_SUCCESS) return 1;
  braid_comm_destroy(comm);
  if (out[0] != 1 || out[1] != 2 || out[2] != 3) return 1;
  printf("consumer ok\n");
  return 0;
}
