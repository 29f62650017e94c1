"""Runtime: run a Plan on torch.distributed (training, checkpoints, export)."""
