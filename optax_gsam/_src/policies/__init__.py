"""When a step is full: rho schedules and the cheap-step policies."""
