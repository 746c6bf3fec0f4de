"""mpitrain: a declarative experiment runner for distributed data-parallel training over MPI."""
