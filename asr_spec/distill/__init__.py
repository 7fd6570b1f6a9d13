"""Draft distillation: pseudo-label cache (data), training and agreement (train), `asr-spec distill` (cli)."""
