"""DeepSpeed's engine as a strategy: its config, the op build and the strategy itself."""
