"""The product's tools: trace replay and load reports, the simulator, fault injection, cost
profiles and trace generation (things operators run). The lab's experiments live in `bench/`."""
