"""The costs: step time, compile time, memory and collectives on the CPU backend."""
