"""How torch's OpenMP threads wait: a setting for a machine that other processes share, which the command
line adds to the environment before it first imports torch (perinstance.apply_shared_machine_settings;
importing the package changes nothing).

Why: torch's OpenMP runtime (libgomp) makes an idle thread spin on its core while it waits for the
others. When another process holds one of the two cores, each parallel operation waits for a thread
that is not running, while its partner spins. Measured on 2 cores, training then ran at 0.09× the
one-thread speed. With a passive wait policy a waiting thread sleeps instead: 0.92× the one-thread
speed with a core busy, at a cost of 8-19% on an idle machine (benchmarks/bench_shared_machine.py,
docs/reliability.md). libgomp reads these variables once, when `import torch` loads it, so
they must be in the environment before that. Child processes inherit them.
"""

import os
from collections.abc import Mapping, MutableMapping

# The variables that decide how libgomp waits; a user who sets any of them keeps their choice.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
SHARED_MACHINE_SETTINGS = {"OMP_WAIT_POLICY": "PASSIVE"}


def settings_to_add(environ: Mapping[str, str]) -> dict[str, str]:
    """The wait settings to add to `environ`: none if the user has set any wait variable."""
    if any(name in environ for name in WAIT_VARIABLES):
        return {}
    return dict(SHARED_MACHINE_SETTINGS)



def add_wait_policy(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Add the shared-machine wait policy to `environ` (settings_to_add); returns what was added."""
    added = settings_to_add(environ)
    environ.update(added)
    return added
