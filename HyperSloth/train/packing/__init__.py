"""Packed rows kept exact: the start-up check that the loaded model keeps a packed row's samples apart, with the
fix for decoders whose mask ignores the position ids and the refusal otherwise (check), and the references that
prove it at length in tests and benchmarks: a packed sample against itself alone, a step from samples alone
(exactness)."""
