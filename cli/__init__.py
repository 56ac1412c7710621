"""The ``fxshard`` command line: parses arguments and calls the library."""
