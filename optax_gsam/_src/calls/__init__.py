"""The user's side of a step: how the loss function is called, and where a transform may sit in a chain."""
