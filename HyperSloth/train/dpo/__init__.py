"""Preference tuning (DPO): the trainer (a sibling of SFT's, sharing the planner, sync and evaluation) and the
preference loss (packed pairs, per-segment log-probs, the reference switch)."""
