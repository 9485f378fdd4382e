"""Training the draft models: boost-tuning an SSM pool (``boost``) and the draft head on
the LLM's features (``head``). No serving process imports this package."""
