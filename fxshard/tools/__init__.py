"""Tools over compiled programs: static checks, rank traces, the cost plan, verification."""
