"""Value types every layer shares: token trees, drafting methods, sampling parameters, logprobs,
and the per-request entries of a speculation step. They import nothing above them."""
