"""The speculative engine: token trees, drafting, verification, sampling, and the in-process
executor (`spec_engine.SpecEngine`) that runs them with the scheduler core."""
