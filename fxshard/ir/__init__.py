"""What the passes share: the layout, per-node specs, placements and their propagation rules, pipeline cuts."""

# the rules of the mixers' ops and of random draws register into the rule table with the rest (fxshard.ir.sharding):
# importing any part of fxshard.ir loads them, so no propagation runs without them
from fxshard.ir import sharding_draws, sharding_mixers  # noqa: E402,F401
