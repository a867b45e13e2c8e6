"""Text from token ids as they arrive: incremental detokenization and stop strings."""
