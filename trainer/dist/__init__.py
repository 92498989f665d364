"""Scale-out across nodes: torch.distributed under torchrun, one process per node (see trainer.distributed_run)."""
