"""What tests share: the oracle, model and server helpers, checks, and the test-only servers
(soak, stand-ins) that some benchmarks reuse."""
