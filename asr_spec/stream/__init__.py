"""Live transcription: audio streams in, stable text streams out (policy.py: the pure per-stream policy;
vocabulary.py: what it needs of a tokenizer; driver.py: many streams through one engine)."""
