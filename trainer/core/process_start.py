"""The first thing `python -m trainer` runs (trainer/__init__.py imports it before anything else): the start of a
run's timeline (status.json `timeline`), before torch and transformers are imported (seconds of a restart that are
easy to miss)."""

import os as _os
import time as _time

IMPORTED_AT = round(_time.time(), 3)
# Whether the user set Inductor's cache folder, read before torch is imported: torch sets the variable itself the
# first time anything asks for its cache (its default, /tmp/torchinductor_<user>), which is no choice of the user's
# and must not keep trainer.core.compile_cache from choosing.
CACHE_DIR_SET_BY_HAND = "TORCHINDUCTOR_CACHE_DIR" in _os.environ
