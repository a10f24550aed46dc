"""What every long-running program of the project shares: structured logging, the event-loop runner and
the config-file loading mechanism (file -> environment -> flags). Imports nothing of the project."""
