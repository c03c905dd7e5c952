"""Scale-out on torch.distributed: tensor parallelism (tp.py)."""
