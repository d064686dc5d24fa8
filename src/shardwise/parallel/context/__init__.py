"""Context parallel: the sequence chunked over the cp ranks (all-to-all attention and the ring)."""
