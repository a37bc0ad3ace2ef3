"""The hand-off between the two processes: a shared-memory ring of hidden-state slots."""
