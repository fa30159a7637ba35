"""Model configuration (`model_config`), dtype resolution (`dtype`) and an embedding server's
pooling (`pooling`, no torch: the main process reads it)."""
