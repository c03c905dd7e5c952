"""Scale-out on torch.distributed: tensor parallelism (tp.py), pipeline parallelism (pp.py), launching ranks (launch.py)."""
