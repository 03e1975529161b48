"""Communication: the process groups every collective goes through, and the launcher."""
