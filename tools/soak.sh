#!/usr/bin/env bash
# The soak (not in the default suite): 4 ranks, 20,000 random operations
# checked for exact results, with no growth in memory or descriptors after
# warm-up; over shared memory, then over tcp, then on 2 simulated hosts
# (shm inside each, tcp between). Arguments go to braid-soak
# (e.g. --ops 2000 for a short run).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/build.sh >/dev/null
export BRAID_SOCKET_IFNAME=${BRAID_SOCKET_IFNAME:-lo}
for transport in shm tcp; do
  echo "== braid-soak over $transport"
  /usr/bin/time -f "wall %e s, max rss %M KiB (launcher)" build/tests/soak/braid-soak --transport "$transport" "$@"
done
echo "== braid-soak on 2 simulated hosts (shm inside, tcp across)"
/usr/bin/time -f "wall %e s, max rss %M KiB (launcher)" build/tests/soak/braid-soak --hosts 2 "$@"
