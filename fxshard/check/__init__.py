"""The static checks over a compiled program: what ``fxshard check`` and ``fxshard verify`` judge.

``check`` runs the written rank files on meta tensors (``rank_trace``) and matches their collectives across ranks
(``collective_diff``); ``verify`` compares a run of them with one device.  The cost and time model, the other
consumer of a compiled program, is :mod:`fxshard.cost`; neither imports the other.
"""
