"""Plan execution on torch.distributed (issue #6); nothing is implemented here yet."""
