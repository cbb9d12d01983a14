"""Training objectives: the LightningModules (classifier, masked patch prediction, distillation), the
optimizer and the LR schedule. Imports nothing from `run` or `reliability`."""
