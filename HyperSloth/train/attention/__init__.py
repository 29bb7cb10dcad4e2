"""Which kernel packed rows attend with, a room of its own: `setting.py` resolves `fast_model_args.attention` on the
worker's GPU and model and makes torch's flash ops run it; `fa4.py` hooks FlashAttention-4 into torch's flash-impl
registry as torch 2.11 needs it and checks it against bundled flash before a run trains on it."""
