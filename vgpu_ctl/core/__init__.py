"""The pure core: geometry of a GPU, placement policies, quota arithmetic. No I/O, no database."""
