"""Outputs: every run-directory file name and environment variable of a run (run_files), crash-safe
checkpoints (checkpoints), the per-rank logs (logs), the run report (report) and the adapter export
(export).
"""
