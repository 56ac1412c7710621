"""What the passes share: the layout, per-node specs, placements and their propagation rules, pipeline cuts."""
