"""The model's kernels and batching, each against its twin or baseline in the same run."""
