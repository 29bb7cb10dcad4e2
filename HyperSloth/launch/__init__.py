"""Launch: the local launcher (local), the tmux launcher (tmux), the run's rendezvous store (rendezvous)
and the pre-flight model check (model_source). No model code: nothing here imports HyperSloth.train.
"""
