"""Data parallel: DDP, ZeRO-1 and FSDP2 (zero2, fsdp, hsdp, fsdp-offload), one module per implementation."""
