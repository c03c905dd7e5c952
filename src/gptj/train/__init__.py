"""Training and fine-tuning: data preparation (data.py, data_cli.py), typed YAML configs (config.py), the
training loop (trainer.py) over the model it trains (model.py), its checkpoints and final model
(checkpoints.py), and the process's place among the ranks (ranks.py)."""
