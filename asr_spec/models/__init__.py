"""Models: resolve and load target/draft pairs (loading), CTranslate2 reading and conversion (ct2, embedded), drafts
cut from a target or trained by distillation (drafts), presets (configs/*.toml)."""
