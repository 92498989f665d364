"""One training step and the loop around it: the loss, the step, the engines' contract, the single engine, pre-flight."""
