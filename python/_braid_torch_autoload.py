"""Makes the backend "braid" known to every torch process, so that an
unchanged script needs only `init_process_group("braid")`, without
`import braid_torch`.

torch (2.5 and later) calls the entry points of the group "torch.backends"
at the end of `import torch` (unless TORCH_DEVICE_BACKEND_AUTOLOAD=0);
braid_torch's installation names `register` here. This module lives outside
the package on purpose: torch turns any exception from an entry point into
a failed `import torch`, and importing a module inside braid_torch would
import the package, extension and all, before `register` could catch
anything. A braid_torch that cannot load (a missing shared library, a torch
it was not built for) is a warning here, and the error again at
`import braid_torch` or when a group asks for "braid".
"""

import warnings


def register():
    try:
        import braid_torch  # noqa: F401  registers "braid" (2-3 ms: torch.distributed is already imported)
    except Exception as err:  # noqa: BLE001  - never break `import torch`
        message = f"braid_torch did not load, so the backend 'braid' is not registered: {err}"
        try:
            warnings.warn(message, stacklevel=2)
        except Exception:  # noqa: BLE001  - warnings are errors here (-W error): still not torch's failure
            import sys

            print(f"warning: {message}", file=sys.stderr)
