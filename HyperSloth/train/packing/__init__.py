"""Packed rows kept exact: the start-up check that the loaded model keeps a packed row's samples apart, with its
fixes (decoders whose mask ignores the position ids get the masks built from them; linear attention and Mamba
layers whose kernels carry state across samples run one sample at a time: recurrent; Unsloth's attention with sinks
gets a mask per sample: sink_attention) and the refusal otherwise (check),
and the references that prove it at length in tests and benchmarks: a packed sample against itself alone, a step
from samples alone (exactness)."""
