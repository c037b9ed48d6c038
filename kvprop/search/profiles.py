"""Hypothesis profiles, registered in one place and always chosen explicitly.

``CI=true`` would otherwise make Hypothesis load its own ``ci`` profile silently. Each
profile sets ``deadline`` and ``suppress_health_check`` itself, because a machine's own
``@settings`` would drop the stateful defaults.

``ci`` and ``fuzz`` leave out Hypothesis's shrink phase: on a 100-step failing example it
ran into Hypothesis's 300 s shrinking limit here, while kvprop's own minimiser reduces the
same failure (as a trace) in seconds. ``dev`` and ``repro`` keep it.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from kvprop.errors import ConfigError

QUIET_CHECKS = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
PROFILES = ("dev", "ci", "fuzz", "repro")
ENV = "KVPROP_PROFILE"
DATABASE_DIR = ".hypothesis/examples"


def register() -> None:
    # Every profile starts from Hypothesis's own defaults, never from whichever profile is loaded.
    base = settings.get_profile("default")
    common = dict(deadline=None, suppress_health_check=QUIET_CHECKS, stateful_step_count=40, derandomize=False)
    settings.register_profile(
        "dev", base, max_examples=60, database=DirectoryBasedExampleDatabase(DATABASE_DIR), **common
    )
    no_shrink = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
    settings.register_profile(
        "ci",
        base,
        max_examples=150,
        database=None,
        print_blob=False,
        phases=no_shrink,
        **{**common, "derandomize": True, "stateful_step_count": 100},
    )
    settings.register_profile(
        "fuzz",
        base,
        max_examples=1_000_000,
        database=DirectoryBasedExampleDatabase(DATABASE_DIR),
        phases=no_shrink,
        **{**common, "stateful_step_count": 100},
    )
    settings.register_profile(
        "repro",
        base,
        max_examples=1,
        database=DirectoryBasedExampleDatabase(DATABASE_DIR),
        phases=[Phase.explicit, Phase.reuse, Phase.shrink],
        verbosity=Verbosity.verbose,
        **common,
    )


def load(name: str | None = None) -> str:
    """Load ``name``, else $KVPROP_PROFILE, else ``dev``; an unknown name is an error."""
    register()
    name = name or os.environ.get(ENV) or "dev"
    if name not in PROFILES:
        raise ConfigError(
            f"unknown Hypothesis profile {name!r} (from {ENV} or the caller); known: {', '.join(PROFILES)}"
        )
    settings.load_profile(name)
    return name
