"""Moving model state between processes: the connector API, backends, control messages,
metadata rows and the transfer state machine. Imports no GPU-only library."""
