"""Code releases on a target: sync (content-hashed upload) and the controller's cache of what it installed."""
