"""`python -m inflight.run`: serve + learn on split pools in one run directory (see `inflight.run.app`)."""
