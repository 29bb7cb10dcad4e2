"""Launch: the local launcher (local), the tmux launcher (tmux), the run's rendezvous store (rendezvous),
one node of a multi-node run on torch's elastic agent (multinode, node_join, node_watch) and the pre-flight
model check (model_source). No model code: nothing here imports HyperSloth.train.
"""
