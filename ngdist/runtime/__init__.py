"""Runtime: partitioning, the executor, the communicator and the trainer."""
