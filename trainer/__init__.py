"""The DFlash drafter trainer (`python -m trainer <verb>`)."""

import time as _time

# The first thing `python -m trainer` runs: the start of a run's timeline (status.json `timeline`), before
# torch and transformers are imported (seconds of a restart that are easy to miss).
IMPORTED_AT = round(_time.time(), 3)
