"""Environments: an episode is a conversation between the policy and an environment (inflight/envs/base.py)."""
