"""The speculative engine: drafting, verification, logits processors, and the in-process
executor (`spec_engine.SpecEngine`) that runs them with the scheduler core. The value types it
works on (trees, methods, sampling parameters, step entries) are in `shared.values`."""
