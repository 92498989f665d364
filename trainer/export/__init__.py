"""Writing a trained drafter in the public formats (z-lab DFlash, speculators)."""
