"""Train jobs: compiled against eager, several processes against one, training checkpoints."""
