"""The runtime: execute a Plan on torch.distributed, one action list per rank."""
