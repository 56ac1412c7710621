"""Training the compiled program: launcher, optimizer settings, memory, checkpoints, export, reference."""
