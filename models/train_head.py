"""`python -m models.train_head`, its documented name: training is training/train_head.py, beside the models."""
import sys

if __name__ == "__main__":
    from training.train_head import cli
    sys.exit(cli())
