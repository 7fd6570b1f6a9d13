"""Draft distillation: pseudo-label cache (data), training (train), agreement and speed (evaluation),
`asr-spec distill` (commands, parsed by cli/distill.py)."""
