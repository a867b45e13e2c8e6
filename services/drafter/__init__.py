"""The drafter service: one draft model, per-request draft KV, batched candidate trees."""
