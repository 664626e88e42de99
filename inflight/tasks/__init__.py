"""Tasks: prompt streams with a verifiable reward. The serve-side rollout driver draws problems from a task and scores
each finished sample with the task's reward; the learner only ever sees the number. Tasks import nothing but the
standard library, so a serve node and a learner node can both load them.

- `arithmetic`: the embedded default, seeded synthetic arithmetic ("What is 3 + 4?") with an exact-match reward.
"""
