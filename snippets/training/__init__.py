"""The trainer core: one loop with a forward_backward seam, DDP / FSDP / parallel on top."""
