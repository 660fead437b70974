"""The science: accuracy, sharpness and generalization against step cost."""
