"""The controller's base, below every layer: errors, the inventory (its only reader), shell quoting and names, YAML files."""
