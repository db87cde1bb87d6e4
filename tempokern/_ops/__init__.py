"""Op wrappers: validation, output allocation and torch.library registration per op."""
