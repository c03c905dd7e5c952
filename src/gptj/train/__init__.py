"""Training and fine-tuning: data preparation (data.py), typed YAML configs (config.py), the training loop (trainer.py)."""
