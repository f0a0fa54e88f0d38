"""braid as a torch.distributed backend.

Importing this package registers the backend "braid" for CPU tensors, and
for CUDA tensors where torch was built with CUDA::

    import torch.distributed as dist
    import braid_torch  # noqa: F401  (registers "braid")
    dist.init_process_group("braid")  # env://, tcp:// or file://, as with gloo

Each process group (the default one and every new_group) is one braid
communicator, joined through the group's store, for CPU and CUDA tensors
alike. Operations on CUDA tensors are stream-ordered, as with NCCL: they are
enqueued on the current stream and the call returns; ``work.wait()`` makes
the current stream wait. Between the ranks of one host, all_reduce,
broadcast, reduce, all_gather and reduce_scatter move device to device
(CUDA IPC, several ranks may share a GPU); other operations, and jobs across
hosts, go through pinned host memory.
"""

import atexit
import functools

import torch
import torch.distributed as dist

# torch's c10d classes must be registered with pybind11 before the extension
# loads: its BraidBackend derives from c10d.Backend.
import torch._C._distributed_c10d  # noqa: F401

try:
    from . import _C
except ImportError as e:
    import os as _os

    if not any(f.startswith("_C.") for f in _os.listdir(_os.path.dirname(__file__))):
        # A source checkout on sys.path (the current directory, say) hides
        # the installed package: say so rather than Python's guess.
        raise ImportError(
            f"braid_torch at {_os.path.dirname(__file__)} has no built extension (_C): this looks "
            "like the source tree, which hides the installed package; run from another directory, "
            "or build it with `pip install --no-build-isolation ./python`"
        ) from e
    raise

__all__ = ["BraidBackend", "create_backend", "monitored_barrier", "version"]

BraidBackend = _C.BraidBackend


def _env_from_mpi(joining=False):
    """Under mpirun, fill torch's RANK / WORLD_SIZE / LOCAL_RANK from Open MPI's
    variables when the launcher did not set them (MASTER_ADDR and MASTER_PORT
    still come from the user, as with any env:// job).

    At import only where MASTER_ADDR is set, so the job means to use env://:
    this runs at every `import torch` (the autoload), and in an mpirun job
    that does not (Horovod, say) RANK / WORLD_SIZE would make other libraries
    believe that torch.distributed was launched. Again when an env://
    rendezvous starts (`joining`): a script that sets MASTER_ADDR in code,
    after `import torch`, then gets them too."""
    import os

    if "MASTER_ADDR" not in os.environ and not joining:
        return
    mapping = {
        "RANK": "OMPI_COMM_WORLD_RANK",
        "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
        "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK",
        "LOCAL_WORLD_SIZE": "OMPI_COMM_WORLD_LOCAL_SIZE",
    }
    for torch_name, mpi_name in mapping.items():
        if torch_name not in os.environ and mpi_name in os.environ:
            os.environ[torch_name] = os.environ[mpi_name]


_env_from_mpi()


def _fill_env_at_rendezvous():
    """Wraps torch's env:// rendezvous so that Open MPI's variables fill the
    ones torch reads when a job connects (any backend: only what is unset)."""
    import importlib

    # The module: `torch.distributed.rendezvous` is also a function's name there.
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    handlers = getattr(rdzv, "_rendezvous_handlers", None)
    env_handler = handlers.get("env") if isinstance(handlers, dict) else None
    if env_handler is None or getattr(env_handler, "_braid_fills_mpi_env", False):
        return

    def handler(url, *args, **kwargs):
        # Only where the rendezvous reads rank and world size from the
        # environment: a caller that passed them (torch puts them in the
        # URL) is not an mpirun rank's env:// job, though it may have
        # inherited Open MPI's variables (a worker spawned by one).
        from urllib.parse import parse_qs, urlparse

        query = parse_qs(urlparse(url).query)
        if "rank" not in query and "world_size" not in query:
            _env_from_mpi(joining=True)
        return env_handler(url, *args, **kwargs)

    handler._braid_fills_mpi_env = True
    handlers["env"] = handler


_fill_env_at_rendezvous()


def version() -> str:
    v = _C.version()
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def create_backend(dist_backend_opts, pg_options=None):
    """The creator torch calls for every process group that uses braid."""
    import os

    # torch's debug levels check collectives' arguments across ranks (DETAIL
    # through a wrapper group, INFO not at all): braid's own check catches a
    # different root or count at the call itself, not at a later one.
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() in ("INFO", "DETAIL"):
        os.environ.setdefault("BRAID_CHECK_CALLS", "1")
    return _C.BraidBackend(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        dist_backend_opts.timeout,
        str(dist_backend_opts.group_id),
    )


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    """torch.distributed.monitored_barrier for braid groups.

    torch's own function accepts only gloo groups by name, so this calls the
    backend directly: rank 0 names every rank (wait_all_ranks) or the first
    rank that did not arrive within `timeout` (default: the group's timeout).
    """
    import datetime

    pg = group if group is not None else dist.group.WORLD
    backend = _cpu_backend(pg)
    if timeout is None:
        timeout = datetime.timedelta(milliseconds=-1)  # the group's timeout
    backend.monitored_barrier(timeout, wait_all_ranks)


def _cpu_backend(pg):
    """The group's CPU backend, unwrapped from the checking wrapper torch puts
    around it under TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    backend = pg._get_backend(torch.device("cpu"))
    wrapped = getattr(backend, "wrapped_pg", None)
    return wrapped if wrapped is not None else backend


_torch_monitored_barrier = dist.monitored_barrier


@functools.wraps(_torch_monitored_barrier)  # torch's signature and documentation
def _monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    # torch.distributed.monitored_barrier, which refuses every backend but
    # gloo by name: a group whose CPU backend is braid's goes to braid's, any
    # other to torch's own. An unchanged script then works with "braid".
    try:
        pg = group if group is not None else dist.group.WORLD
        is_braid = pg is not None and isinstance(_cpu_backend(pg), _C.BraidBackend)
    except (RuntimeError, ValueError, AttributeError):
        is_braid = False
    if is_braid:
        return monitored_barrier(group, timeout, wait_all_ranks)
    return _torch_monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


if not getattr(dist.monitored_barrier, "_braid", False):
    _monitored_barrier._braid = True
    dist.monitored_barrier = _monitored_barrier
    dist.distributed_c10d.monitored_barrier = _monitored_barrier


def _end_pending_groups():
    """At the interpreter's exit, a braid group with work still pending is
    aborted and that work completed (with an error), while Python still runs
    its Futures' callbacks: completed later, on braid's threads during the
    interpreter's teardown, a callback's wait for the GIL ended the process
    with `terminate called without an active exception`. Its peers learn of
    the abort at once. Groups with nothing pending are left as they are."""
    try:
        _C._end_pending_groups()
    except Exception:  # noqa: BLE001  - exiting: nothing to report it to
        pass


atexit.register(_end_pending_groups)


if not hasattr(dist.Backend, "BRAID"):
    _devices = ["cpu", "cuda"] if torch.version.cuda is not None else ["cpu"]
    dist.Backend.register_backend("braid", create_backend, extended_api=True, devices=_devices)
