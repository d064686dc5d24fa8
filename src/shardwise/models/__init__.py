"""Reference models. Plain single-device code; parallelism is applied from outside."""
