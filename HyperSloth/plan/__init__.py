"""Plan: the resolved run (run), the batching planner (batching), the planner's inputs (inputs) and the
eval set (eval_set). No torch: `hypersloth-plan` previews a run on a laptop with exactly the code the
workers plan with.
"""
