"""`python -m inflight.learn`: the training pool's process (rollout buffer, staleness gate, FSDP2 step, publisher)."""
