"""Hardware groups (``conf/hardware/`` ↔ this package): where ranks run and how they are started."""
