"""The simulator: the scheduler core on a virtual clock, measured costs, recorded acceptance."""
