"""`python -m inflight.serve`: the inference pool's process (engine, rollout driver, ZeroMQ streams, OpenAI API)."""
