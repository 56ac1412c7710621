"""Capture: load the user's model file and trace it to one flat ATen graph with module provenance."""
