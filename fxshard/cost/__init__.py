"""The cost and time model of a compiled program: what ``fxshard plan``, ``--auto`` and ``calibrate`` predict.

Memory (``costs``, ``saved``, ``alive``, ``zero_memory``, ``microbatches``), time (``profile``, ``timemodel``,
``pipesim``, ``timeline``), the hardware it runs on (``hardware``: the profiles and the JSON files beside it,
``calibrate``: measuring one) and the search over layouts (``search``, ``auto``, ``auto_options``).  The static
checks, the other consumer of a compiled program, are :mod:`fxshard.check`; neither imports the other.
"""
