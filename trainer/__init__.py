"""The DFlash drafter trainer (`python -m trainer <verb>`)."""

import os as _os
import time as _time

# The first thing `python -m trainer` runs: the start of a run's timeline (status.json `timeline`), before
# torch and transformers are imported (seconds of a restart that are easy to miss).
IMPORTED_AT = round(_time.time(), 3)
# Whether the user set Inductor's cache folder, read before torch is imported: torch sets the variable itself the
# first time anything asks for its cache (its default, /tmp/torchinductor_<user>), which is no choice of the user's
# and must not keep trainer.compile_cache from choosing.
CACHE_DIR_SET_BY_HAND = "TORCHINDUCTOR_CACHE_DIR" in _os.environ
