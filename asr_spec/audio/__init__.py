"""Audio in: load and resample (loading), cut into windows (chunking), batched log-mel (features)."""
