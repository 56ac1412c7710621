"""fxshard's version: a leaf, so that the modules writing it (rank file headers, --version, the report) import no
compiler through the package's public names."""

__version__ = "0.1.0"
