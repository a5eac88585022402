"""P's side of the runtime: step plans and "layer L is written" items in, layer writes out, DONE or
FAILED to D."""
